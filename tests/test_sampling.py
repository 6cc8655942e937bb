"""Judge sampling: deterministic in the trace id, nested across rates, shared by independent runners."""

from __future__ import annotations

import itertools
import math
import uuid

from prometheus_client import CollectorRegistry

from tracejudge.metrics.judges.config import FiltersConfig
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.sampling import (
    TraceFilter,
    is_sampled,
    sample_point,
    sampling_key,
    trace_status,
)
from tracejudge.schemas.record import Document, EvalRecord

N = 10_000
IDS = [uuid.UUID(int=i * 7919 + 17).hex for i in range(N)]  # OTLP-style 32-hex trace ids


def _within(share: float, rate: float, n: int = N) -> bool:
    # 5 standard deviations of a binomial share: fails by chance far less than once in a million runs.
    return abs(share - rate) <= 5 * math.sqrt(rate * (1 - rate) / n)


def test_rate_is_respected_over_10000_ids() -> None:
    for rate in (0.01, 0.1, 0.25, 0.5, 0.9):
        share = sum(is_sampled(t, rate) for t in IDS) / N
        assert _within(share, rate), (rate, share)
    assert all(is_sampled(t, 1.0) for t in IDS)
    assert not any(is_sampled(t, 0.0) for t in IDS)


def test_mlflow_style_ids_are_uniform_too() -> None:
    ids = [f"tr-{i:032x}" for i in range(N)]  # sequential ids must not bias the hash
    share = sum(is_sampled(t, 0.2) for t in ids) / N
    assert _within(share, 0.2)


def test_samples_nest_across_rates() -> None:
    rates = (0.05, 0.1, 0.3, 0.5, 0.8)
    samples = [{t for t in IDS if is_sampled(t, r)} for r in rates]
    for smaller, larger in itertools.pairwise(samples):
        assert smaller < larger


def test_seed_changes_the_sample_but_not_the_rate() -> None:
    a = {t for t in IDS if is_sampled(t, 0.3)}
    b = {t for t in IDS if is_sampled(t, 0.3, seed="fresh-slice")}
    assert a != b
    assert _within(len(b) / N, 0.3)
    assert {t for t in IDS if is_sampled(t, 0.3, seed="fresh-slice")} == b  # still deterministic


def test_points_are_stable_values() -> None:
    # The function is part of the contract (replicas on different versions must agree): pin it.
    assert sample_point("0af7651916cd43dd8448eb211c80319c") == 0.4469355909443745
    assert sample_point("tr-1", "seed") == 0.3684418570026014
    assert 0.0 <= sample_point("x") < 1.0


def test_sampling_key_falls_back_deterministically() -> None:
    assert sampling_key(EvalRecord(trace_id="t1", request_id="r1")) == "t1"
    assert sampling_key(EvalRecord(request_id="r1")) == "request:r1"
    a = sampling_key(EvalRecord(request="q", response="a"))
    assert a == sampling_key(EvalRecord(request="q", response="a"))
    assert a != sampling_key(EvalRecord(request="q", response="b"))


def _records(n: int) -> list[EvalRecord]:
    ctx = [Document("Kafka consumer groups share the partitions of a topic between members.")]
    return [
        EvalRecord(
            trace_id=IDS[i],
            app="shop",
            request="How do consumer groups share partitions?",
            response="Consumer groups share the partitions of a topic.",
            retrieved_context=ctx,
            failed=False,
        )
        for i in range(n)
    ]


def _sampled_ids(runner: JudgeRunner, records: list[EvalRecord], judge: str) -> set[str]:
    out = set()
    for rec, assessments in zip(records, runner.judge_many(records), strict=True):
        a = next(x for x in assessments if x.name == judge)
        if a.skipped is None:
            out.add(rec.trace_id)
        else:
            assert a.skipped == "not_sampled"
    return out


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_two_independent_runners_choose_the_same_traces() -> None:
    """What two consumers of one group (or a replay) do: separate processes, same config."""
    config = {
        "builtin": {
            "groundedness": {"provider": "heuristic", "sample_rate": 0.3},
            "relevance_to_query": {"provider": "heuristic", "sample_rate": 0.1},
        }
    }
    records = _records(2000)
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    a, b = JudgeRunner(config, registry=reg_a), JudgeRunner(config, registry=reg_b)
    # The second consumer sees the traces in another order (other partitions first).
    ga, ra = _sampled_ids(a, records, "groundedness"), _sampled_ids(a, records, "relevance_to_query")
    gb = _sampled_ids(b, records[::-1], "groundedness")
    rb = _sampled_ids(b, records[::-1], "relevance_to_query")
    assert ga == gb and ra == rb
    assert ra < ga  # the 10% judge's traces all carry the 30% judge's verdict too
    assert _within(len(ga) / 2000, 0.3, 2000)
    for reg in (reg_a, reg_b):
        assert _value(reg, "tracejudge_judge_eligible_total", app="shop", judge="groundedness") == 4000
        assert _value(reg, "tracejudge_judge_sampled_total", app="shop", judge="groundedness") == 2 * len(ga)
        assert _value(
            reg, "tracejudge_judge_skipped_total", app="shop", judge="groundedness", reason="not_sampled"
        ) == 4000 - 2 * len(ga)


def test_failed_traces_are_never_judged_and_not_eligible() -> None:
    reg = CollectorRegistry()
    runner = JudgeRunner({"sample_rate": 1.0}, registry=reg)
    rec = _records(1)[0]
    rec.failed = True
    assessments = runner.judge_sync(rec)
    assert [a.skipped for a in assessments] == ["failed_trace", "failed_trace"]
    assert _value(reg, "tracejudge_judge_eligible_total", app="shop", judge="groundedness") == 0
    assert (
        _value(reg, "tracejudge_judge_skipped_total", app="shop", judge="groundedness", reason="failed_trace")
        == 1
    )


def test_filters_on_app_status_and_tags() -> None:
    flt = TraceFilter(FiltersConfig(apps=["shop"], status=["ok"], tags={"env": ["prod", "staging"]}))
    rec = EvalRecord(trace_id="t", app="shop", failed=False, tags={"env": "prod"})
    assert flt.matches(rec)
    assert not flt.matches(EvalRecord(trace_id="t", app="other", failed=False, tags={"env": "prod"}))
    assert not flt.matches(EvalRecord(trace_id="t", app="shop", failed=None, tags={"env": "prod"}))
    assert not flt.matches(EvalRecord(trace_id="t", app="shop", failed=False, tags={"env": "dev"}))
    assert not flt.matches(
        EvalRecord(trace_id="t", app="shop", failed=False, complete=False, tags={"env": "prod"})
    )
    assert trace_status(EvalRecord(failed=False, complete=False)) == "incomplete"
    assert trace_status(EvalRecord()) == "unknown"


def test_filtered_traces_are_skipped_and_not_eligible() -> None:
    reg = CollectorRegistry()
    runner = JudgeRunner(
        {
            "builtin": {
                "groundedness": {"provider": "heuristic", "filters": {"apps": ["other"]}},
                "relevance_to_query": {"provider": "heuristic"},
            }
        },
        registry=reg,
    )
    by_name = {a.name: a for a in runner.judge_sync(_records(1)[0])}
    assert by_name["groundedness"].skipped == "filtered"
    assert by_name["relevance_to_query"].skipped is None and by_name["relevance_to_query"].passed is True
    assert _value(reg, "tracejudge_judge_eligible_total", app="shop", judge="groundedness") == 0
    assert _value(reg, "tracejudge_judge_eligible_total", app="shop", judge="relevance_to_query") == 1


def test_the_point_is_what_the_sampling_page_says_so_another_tool_can_reproduce_the_sample():
    """docs/pages/concepts/sampling.md: BLAKE2b of seed, NUL, key (UTF-8) with an 8-byte digest, as a
    big-endian integer over 2**64."""
    import hashlib

    from tracejudge.metrics.judges.sampling import sample_point

    for seed, key in [("", "tr-0af7651916cd43dd8448eb211c80319c"), ("2026-q4", "request:r-1"), ("s", "é")]:
        digest = hashlib.blake2b((seed + "\0" + key).encode("utf-8"), digest_size=8).digest()
        assert sample_point(key, seed) == int.from_bytes(digest, "big") / 2**64
