"""What the failures have in common (`tracejudge.metrics.findings`): the statistics find a planted
over-represented value with a lift above 1 and its interval, find nothing in noise or in small samples,
cluster similar requests together and distinct ones apart, deterministically, and stay bounded."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tracejudge.metrics.findings import (
    ClusterOptions,
    FindingsOptions,
    FindingsWindow,
    RequestClusterer,
    dimension_values,
    verdicts,
)
from tracejudge.metrics.findings.stats import contrast, simultaneous_z
from tracejudge.schemas.record import Document, EvalRecord, TokenUsage, ToolCall
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef

TOPICS = ["refund policy for my order", "reset my account password", "shipping time to canada",
          "cancel my subscription today", "change delivery address", "warranty for broken headphones"]


def result(i: int, passed: bool | None, *, docs: tuple[str, ...] = (), tools: tuple[str, ...] = (),
           version: str | None = None, models: tuple[str, ...] = (), request: str | None = None,
           signals: tuple[str, ...] = (), app: str = "shop", judge: str = "correctness",
           **assessment: Any) -> EvaluationResult:
    record = EvalRecord(trace_id=f"t{i:05d}", app=app, request=request, version=version,
                        retrieved_context=[Document("text", d) for d in docs] or None,
                        trajectory=[ToolCall(t) for t in tools] or None,
                        model_usage={m: TokenUsage(1, 1, 2) for m in models} or None, timestamp=1000.0 + i)
    metrics: dict[str, float | None] = {f"signal_{s}": 1.0 for s in signals}
    metrics["signal_never"] = 0.0
    return EvaluationResult(record, SourceRef("agent_eval"), metrics=metrics,
                            assessments=[Assessment(judge, passed=passed, **assessment)])


def planted(seed: int, n: int = 1000, base: float = 0.1, planted_rate: float = 0.6) -> list[EvaluationResult]:
    """`n` results: 20 doc_uris, 5 tools, 3 versions at random; doc-7, the tool `search_v2` and version
    2.0 fail `planted_rate` of the time, everything else `base`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        docs = tuple(sorted({f"docs://kb/doc-{rng.randrange(20)}" for _ in range(2)}))
        tools = (rng.choice(["lookup", "search_v2", "calculator", "weather", "email"]),)
        version = rng.choice(["1.0", "1.1", "2.0"])
        bad = "docs://kb/doc-7" in docs or tools == ("search_v2",) or version == "2.0"
        fails = rng.random() < (planted_rate if bad else base)
        out.append(result(i, not fails, docs=docs, tools=tools, version=version, models=("gpt-4o-mini",)))
    return out


def analysed(results: list[EvaluationResult], **options: Any) -> list[Any]:
    window = FindingsWindow(FindingsOptions(**options), RequestClusterer())
    for r in results:
        window.add(r)
    return window.analyse()


# -- the statistics -------------------------------------------------------------------------------


def test_rate_ratio_and_its_interval_are_the_textbook_values() -> None:
    # 30 of 50 with the value fail, 20 of 150 without: RR = 0.6 / 0.1333 = 4.5.
    c = contrast(30, 50, 50, 200, simultaneous_z(0.95, 1))
    assert c is not None
    assert c.lift == pytest.approx(4.5)
    assert (c.failing_without, c.total_without) == (20, 150)
    # Katz: se = sqrt(1/30 - 1/50 + 1/20 - 1/150) = 0.23805; exp(ln 4.5 ± 1.96 se) = [2.822, 7.175].
    assert c.low == pytest.approx(2.822, abs=0.002) and c.high == pytest.approx(7.175, abs=0.004)
    # More tests widen each interval (Bonferroni).
    wider = contrast(30, 50, 50, 200, simultaneous_z(0.95, 100))
    assert wider is not None and wider.low < c.low and wider.high > c.high
    # A value every verdict has has nothing to compare with; one every failure has still gets an interval.
    assert contrast(10, 10, 10, 10, 1.96) is None
    every = contrast(10, 12, 10, 100, 1.96)
    assert every is not None and 1.0 < every.low < every.lift < every.high < float("inf")


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_a_planted_doc_tool_and_version_are_found_with_lift_above_one(seed: int) -> None:
    findings = analysed(planted(seed))
    found = {(f.dimension, f.value): f for f in findings}
    for key in [("doc_uri", "docs://kb/doc-7"), ("tool", "search_v2"), ("version", "2.0")]:
        assert key in found, (key, [(f.dimension, f.value, f.lift_interval) for f in findings])
        f = found[key]
        lo, hi = f.lift_interval
        assert 1.0 < lo < f.lift < hi
        assert f.failure_rate_with > f.failure_rate_without
        assert f.failing >= 5 and f.total >= f.failing
        # Rank 1 is tested on the whole window; each later one on the verdicts without the values
        # ranked before it (the planted causes are independent, so each keeps its lift there).
        if f.rank == 1:
            assert f.window_total == 1000 and f.conditioned_on == []
        else:
            assert 0 < f.window_total < 1000 and len(f.conditioned_on) == f.rank - 1
        assert 0 < len(f.example_trace_ids) <= 5
        assert f.to_dict()["support"] == pytest.approx(f.failing / f.window_failing, abs=1e-6)
    # Nothing but the planted values (and nothing from a model every trace used) clears the bar.
    assert set(found) <= {("doc_uri", "docs://kb/doc-7"), ("tool", "search_v2"), ("version", "2.0")}
    assert [f.rank for f in findings] == list(range(1, len(findings) + 1))
    assert [f.conditioned_on for f in findings[1:]] == [
        [f"{g.dimension}={g.value}" for g in findings[:i]] for i in range(1, len(findings))]


@pytest.mark.parametrize("seed", list(range(10)))
def test_noise_with_no_real_difference_yields_no_finding(seed: int) -> None:
    rng = random.Random(seed)
    results = [result(i, rng.random() >= 0.3,
                      docs=tuple({f"docs://kb/doc-{rng.randrange(40)}" for _ in range(3)}),
                      tools=(rng.choice(["a", "b", "c", "d", "e", "f"]),),
                      version=rng.choice(["1", "2", "3"]),
                      signals=("slow",) if rng.random() < 0.2 else ())
               for i in range(800)]
    assert analysed(results) == []


def test_small_samples_yield_nothing() -> None:
    # Every failure has doc-x, but there are 4: below min_failing.
    results = [result(i, i >= 4, docs=("docs://x",) if i < 5 else ("docs://y",)) for i in range(20)]
    assert analysed(results) == []
    # The same with min_failing lowered shows the statistics would otherwise speak.
    assert [f.value for f in analysed(results, min_failing=3)] == ["docs://x"]


def test_top_k_and_min_share_bound_the_findings() -> None:
    results = planted(7)
    assert len(analysed(results, top_k=1)) == 1
    assert analysed(results, min_share=0.99) == []


def test_only_live_pass_fail_verdicts_count_and_each_judge_is_its_own_group() -> None:
    shadow = result(1, False, shadow_of="correctness")
    errored = result(2, None, error="timeout")
    skipped = result(3, None, skipped="not_sampled")
    assert verdicts(shadow) == verdicts(errored) == verdicts(skipped) == []
    window = FindingsWindow()
    for r in (shadow, errored, skipped):
        assert window.add(r) == 0
    assert window.add(result(4, True, judge="safety")) == 1
    assert window.add(result(5, False, judge="correctness", app="other-app")) == 1
    assert set(window.groups) == {("shop", "safety"), ("other-app", "correctness")}


def test_dimension_values_read_every_dimension() -> None:
    r = result(1, False, docs=("d1", "d2", "d1"), tools=("search", "search", "calc"), version="3.1",
               models=("gpt-4o", "claude"), request="What is the refund policy?",
               signals=("tool_retry_loop",))
    values = dimension_values(r, {"doc_uri", "tool", "tool_error", "version", "model", "signal",
                                  "request_cluster"}, RequestClusterer())
    assert values["doc_uri"] == ("d1", "d2") and values["tool"] == ("search", "calc")
    assert values["version"] == ("3.1",) and set(values["model"]) == {"gpt-4o", "claude"}
    assert values["signal"] == ("tool_retry_loop",)  # signal_never (0.0) is not a value
    assert values["request_cluster"][0].startswith("c") and "tool_error" not in values
    assert dimension_values(r, {"tool"}) == {"tool": ("search", "calc")}
    signed = result(2, False, docs=("https://user:pw@files.example.com/a.pdf?sig=SECRET123#p2",
                                    "/local/b.md"))
    uris = dimension_values(signed, {"doc_uri"})["doc_uri"]
    assert uris[1] == "/local/b.md" and "files.example.com/a.pdf" in uris[0]
    assert not any(s in uris[0] for s in ("SECRET123", "pw", "user"))
    # A plain anchor names a chunk of the page and stays; a fragment that could carry a token does not.
    assert uris[0].endswith("a.pdf?sig=" + uris[0].split("sig=")[1].split("#")[0] + "#p2")
    anchored = result(3, False, docs=("https://docs.example/plans#p1", "https://app.example/cb#access_token=T0K"))
    assert dimension_values(anchored, {"doc_uri"})["doc_uri"][0] == "https://docs.example/plans#p1"
    assert "T0K" not in dimension_values(anchored, {"doc_uri"})["doc_uri"][1]


def test_a_signal_and_a_request_cluster_are_found() -> None:
    rng = random.Random(3)
    results = []
    for i in range(500):
        topic = rng.randrange(len(TOPICS))
        looped = rng.random() < 0.15
        fails = rng.random() < (0.7 if topic == 2 or looped else 0.1)
        results.append(result(i, not fails, request=f"Hi, {TOPICS[topic]} number {rng.randrange(1000)}",
                              signals=("tool_retry_loop",) if looped else ()))
    findings = analysed(results)
    kinds = {(f.dimension, f.value if f.dimension != "request_cluster" else f.label) for f in findings}
    assert ("signal", "tool_retry_loop") in kinds
    cluster = [f for f in findings if f.dimension == "request_cluster"]
    assert len(cluster) == 1
    assert set(cluster[0].label.split(", ")) <= {"shipping", "time", "canada", "number", "hi"}
    assert "canada" in cluster[0].label


# -- clustering -----------------------------------------------------------------------------------


def test_similar_requests_group_and_distinct_ones_do_not() -> None:
    c = RequestClusterer()
    a = c.assign("What is the refund policy for order 1234?")
    assert c.assign("what is the REFUND policy for order 98?") == a
    assert c.assign("Refund policy for my order please") == a
    b = c.assign("How do I reset my account password?")
    assert b != a and c.assign("reset account password how") == b
    assert c.assign("Weather in Paris tomorrow") not in (a, b)
    assert c.assign("") is None and c.assign("123 456 !!") is None and c.assign(None) is None


def test_clustering_is_deterministic_and_labels_come_from_repeated_words() -> None:
    texts = [f"{TOPICS[i % len(TOPICS)]} for customer Zebediah{i}" for i in range(60)]
    runs = []
    for _ in range(2):
        c = RequestClusterer()
        runs.append(([c.assign(t) for t in texts], {cid: c.label(cid) for cid in c.clusters}))
    assert runs[0] == runs[1]
    ids, labels = runs[0]
    assert len(set(ids)) == len(TOPICS)
    # A word typed once (a name with the digits stripped would still be unique per request) is no label.
    assert not any("zebediah" in (label or "") for label in labels.values())
    assert any("password" in (label or "") for label in labels.values())


def test_clusters_are_bounded_and_evictions_counted() -> None:
    c = RequestClusterer(ClusterOptions(max_clusters=4))
    for word in ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]:
        c.assign(f"{word} {word}extra")
    assert len(c.clusters) == 4 and c.evicted == 2


def test_an_embedding_function_clusters_by_cosine() -> None:
    def embed(text: str) -> list[float]:  # a deterministic toy embedding: topic words as axes
        return [float("refund" in text), float("password" in text), 0.1]

    c = RequestClusterer(embed=embed)
    a = c.assign("refund please")
    assert c.assign("I want a refund") == a and c.assign("password reset") != a


# -- boundedness ----------------------------------------------------------------------------------


def test_distinct_values_beyond_the_cap_are_counted_and_dropped() -> None:
    window = FindingsWindow(FindingsOptions(max_values=50, max_groups=2))
    for i in range(1000):
        window.add(result(i, i % 3 != 0, docs=(f"docs://unique/{i}",)))
    cells = window.groups[("shop", "correctness")].values["doc_uri"]
    assert len(cells) <= 50
    assert window.dropped_values["doc_uri"] >= 950
    assert window.dropped_values["doc_uri"] + len(cells) == 1000
    # A third (app, judge) pair past max_groups is counted, not kept.
    window.add(result(1, True, judge="b"))
    window.add(result(2, True, judge="c"))
    assert len(window.groups) == 2 and window.dropped_verdicts == 1


def test_a_frequent_value_survives_pruning_among_many_rare_ones() -> None:
    window = FindingsWindow(FindingsOptions(max_values=20))
    rng = random.Random(5)
    for i in range(3000):
        bad = i % 10 == 0
        fails = rng.random() < (0.8 if bad else 0.1)
        window.add(result(i, not fails, docs=("docs://hot",) if bad else (f"docs://rare/{i}",)))
    assert [(f.dimension, f.value) for f in window.analyse()] == [("doc_uri", "docs://hot")]


def test_panes_merge_into_one_window() -> None:
    results = planted(11)
    whole = FindingsWindow()
    panes = [FindingsWindow(), FindingsWindow(), FindingsWindow()]
    for i, r in enumerate(results):
        whole.add(r)
        panes[i % 3].add(r)
    merged = FindingsWindow.merged(panes)
    assert [(f.dimension, f.value, f.failing, f.total) for f in merged.analyse()] == \
        [(f.dimension, f.value, f.failing, f.total) for f in whole.analyse()]


# -- explaining correlates away -------------------------------------------------------------------


def correlated(seed: int, n: int = 2000) -> list[EvaluationResult]:
    """The failing tool `get_account` (every call fails the verdict 90% of the time, else 5%) is called
    on 80% of the `account` topic's requests and 5% of the others'; the `account` topic retrieves its
    own document `docs://account`. An independent second cause: version 2.0 fails 40% of the time."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = rng.choice(["account", "billing", "shipping", "returns"])
        tool = rng.random() < (0.8 if topic == "account" else 0.05)
        version = "2.0" if rng.random() < 0.2 else "1.0"
        rate = 0.9 if tool else 0.4 if version == "2.0" else 0.05
        out.append(result(i, rng.random() >= rate, docs=(f"docs://{topic}", "docs://faq"),
                          tools=("get_account",) if tool else ("search",), version=version))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_correlate_of_the_cause_is_explained_away_and_an_independent_cause_kept(seed: int) -> None:
    results = correlated(seed)
    window = FindingsWindow(FindingsOptions(), RequestClusterer())
    for r in results:
        window.add(r)
    # Marginally the account topic's document is over-represented among the failures, far past 1 ...
    group = window.groups[("shop", "correctness")]
    doc = group.values["doc_uri"]["docs://account"]
    marginal = contrast(doc.failing, doc.total, group.failing, group.total, simultaneous_z(0.95, 20))
    assert marginal is not None and marginal.low > 2.0
    # ... but only through the tool: the findings are the tool and the independent version.
    findings = window.analyse()
    assert [(f.dimension, f.value) for f in findings] == [("tool", "get_account"), ("version", "2.0")]
    tool, version = findings
    assert tool.window_total == 2000 and tool.conditioned_on == []
    # The version is tested on the traces without the tool: its counts and interval are that test's.
    without_tool = [r for r in results if r.record.trajectory[0].tool_name != "get_account"]
    assert version.window_total == len(without_tool) and version.conditioned_on == ["tool=get_account"]
    assert version.window_failing == sum(not r.assessments[0].passed for r in without_tool)
    assert version.total == sum(r.record.version == "2.0" for r in without_tool)
    assert 1.0 < version.lift_interval[0] < version.lift < version.lift_interval[1]
    assert version.sampled is False and window.sample_dropped == 0


def test_the_conditioned_test_runs_on_a_bounded_sample_and_says_so() -> None:
    results = correlated(4)
    window = FindingsWindow(FindingsOptions(sample=500), RequestClusterer())
    for r in results:
        window.add(r)
    reservoir = window.groups[("shop", "correctness")].reservoir
    assert reservoir is not None and len(reservoir.entries) == 500 and reservoir.seen == 2000
    assert window.sample_dropped == 1500
    findings = window.analyse()
    assert [(f.dimension, f.value) for f in findings] == [("tool", "get_account"), ("version", "2.0")]
    first, second = findings
    assert first.sampled is False and first.window_total == 2000  # the marginal test: exact counts
    assert second.sampled is True and second.window_total < 500  # the sample's verdicts without the tool
    # A sliding window's panes merge into one sample, still bounded.
    panes = [FindingsWindow(FindingsOptions(sample=300), RequestClusterer()) for _ in range(3)]
    for i, r in enumerate(results):
        panes[i % 3].add(r)
    merged = FindingsWindow.merged(panes)
    merged_reservoir = merged.groups[("shop", "correctness")].reservoir
    assert merged_reservoir is not None and len(merged_reservoir.entries) <= 300
    assert merged_reservoir.seen == 2000 and merged.sample_dropped == 2000 - len(merged_reservoir.entries)
    assert [(f.dimension, f.value) for f in merged.analyse()][:1] == [("tool", "get_account")]
