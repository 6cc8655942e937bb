"""The demo's healthy baseline and its planted causes, measured through tracejudge's own evaluation.

The agent alone (no broker): a few thousand seeded traces per setting, evaluated by `Evaluator` with
the demo runner's own settings (`evaluation_overrides`: the app tag, the heuristic judges) and grouped
into sessions judged by the heuristic `user_frustration`, as `tracejudge eval` does. The rates the
alerts watch are compared with the thresholds read from deploy/prometheus/rules/tracejudge.rules.yml.

Statistics: Wilson intervals at 99% (z = 2.576) for a rate against a threshold, with a margin of 5
points on the healthy side; two-proportion z-tests (|z| > 4) for a planted cause against the rest; a
chi-square test of homogeneity (p > 0.001) for "the rest of the distribution is unchanged", between a
planted run and a healthy run of other seeds. Every run is seeded, so every figure is reproducible.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from scipy.stats import chi2_contingency

from tracejudge import Evaluator
from tracejudge.consumer.config import load_settings
from tracejudge.consumer.demo.agent import (
    AGENT_VERSION_ATTRIBUTE,
    APPS,
    DEFAULT_VERSION,
    DEGRADED_PREFIX,
    FAILING_TOOL,
    RELEASE_VERSION,
    STALE_DOC_TEXT,
    STALE_DOC_URI,
    VERSION_TAG,
    AgentSettings,
    AgentTrace,
    SyntheticRagAgent,
)
from tracejudge.consumer.demo.command import (
    DEFAULT_FAILURE_SHARE,
    DEFAULT_FRUSTRATED_SHARE,
    DEFAULT_UNGROUNDED_SHARE,
)
from tracejudge.consumer.demo.embedded import evaluation_overrides
from tracejudge.schemas.result import EvaluationResult
from tracejudge.schemas.session import SessionResult
from tracejudge.sessions import SessionEvaluation, SessionGrouper

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "rules" / "tracejudge.rules.yml"
DEMO = [sys.executable, "-m", "tracejudge.consumer.commands.cli", "demo"]
Z99 = 2.576
MARGIN = 0.05
Z_APART = 4.0
P_SAME = 0.001
TRACES = 2000
# The demo command's defaults: the healthy baseline docs/pages/getting-started.md promises.
HEALTHY = {"ungrounded_share": DEFAULT_UNGROUNDED_SHARE, "failure_share": DEFAULT_FAILURE_SHARE,
           "frustrated_share": DEFAULT_FRUSTRATED_SHARE, "concurrent_conversations": 8}
PLANT_AFTER = 400


# -- the rules ---------------------------------------------------------------------------------


def alert_rules() -> dict[str, str]:
    """Alert name -> expression, for every alert in the rules file."""
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"] if "alert" in r}


def threshold(alert: str, series: str, op: str) -> float:
    """The number `LEVEL:series op N` compares with in `alert`'s expression (its floor or ceiling);
    `series` is a recording rule's name after its aggregation level (`tracejudge_judge_pass:ratio1h`
    for `app_judge:tracejudge_judge_pass:ratio1h`), so regrouping the rule does not lose it."""
    expr = alert_rules()[alert]
    found = re.search(rf"\b[a-z_]+:{re.escape(series)}(?:\{{[^}}]*\}})?\s*{re.escape(op)}\s*([0-9.]+)", expr)
    assert found, f"{alert}: no `LEVEL:{series} {op} N` in its expression:\n{expr}"
    return float(found.group(1))


def groundedness_floor() -> float:
    return threshold("GroundednessDropped", "tracejudge_judge_pass:ratio1h", "<")


# -- a run of the agent, evaluated by tracejudge -----------------------------------------------


@dataclass
class Run:
    items: list[AgentTrace]
    traces: list[dict[str, Any]]
    results: list[EvaluationResult]
    sessions: list[SessionResult]

    def rows(self, since: int = 0) -> Iterable[tuple[int, AgentTrace, dict[str, Any], EvaluationResult]]:
        for i, (item, trace, result) in enumerate(zip(self.items, self.traces, self.results, strict=True)):
            if i >= since:
                yield i, item, trace, result


def run_agent(count: int = TRACES, **settings: Any) -> Run:
    with SyntheticRagAgent(AgentSettings(**{**HEALTHY, **settings})) as agent:
        items = [*agent.traces(count), *agent.finish_conversations()]
    evaluator_settings = load_settings(environ={}, overrides=evaluation_overrides(), offline=True)
    with Evaluator(evaluator_settings) as evaluator:
        results = list(evaluator.evaluate_many([item.payload for item in items]))
        grouper = SessionGrouper()
        for result in results:
            grouper.add(result)
        sessions = list(SessionEvaluation(evaluator.session_judges).results(grouper.close_all()))
    return Run(items, [json.loads(item.payload) for item in items], results, sessions)


def verdict(result: EvaluationResult, judge: str = "groundedness") -> bool | None:
    """The judge's verdict as `tracejudge_judge_verdicts_total` counts it (None: no verdict)."""
    try:
        a = result.assessment(judge)
    except KeyError:
        return None
    return a.passed if a.error is None and a.skipped is None else None


def spans(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return trace["data"]["spans"]


def attribute(span: dict[str, Any], key: str) -> Any:
    value = span["attributes"].get(key)
    return None if value is None else json.loads(value)


def span_type(span: dict[str, Any]) -> str | None:
    return attribute(span, "mlflow.spanType")


def doc_uris(trace: dict[str, Any]) -> list[str]:
    return [d["metadata"]["doc_uri"] for s in spans(trace) if span_type(s) == "RETRIEVER"
            for d in attribute(s, "mlflow.spanOutputs") or []]


def tool_spans(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in spans(trace) if span_type(s) == "TOOL"]


def in_error(span: dict[str, Any]) -> bool:
    return span["status"]["code"] == "STATUS_CODE_ERROR"


def root(trace: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in spans(trace) if not s.get("parent_span_id"))


def stated_versions(trace: dict[str, Any]) -> set[str]:
    """The version as the trace states it: tag, metadata and the root's gen_ai.agent.version."""
    info = trace["info"]
    return {info["tags"][VERSION_TAG], info["trace_metadata"][VERSION_TAG],
            attribute(root(trace), AGENT_VERSION_ATTRIBUTE)}


# -- statistics ----------------------------------------------------------------------------------


def wilson(k: int, n: int, z: float = Z99) -> tuple[float, float]:
    assert n > 0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def two_proportion_z(k1: int, n1: int, k2: int, n2: int) -> float:
    """z of p1 - p2 with the pooled rate: positive when the first rate is higher."""
    pooled = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return (k1 / n1 - k2 / n2) / se if se else 0.0


def same_distribution(a: Counter[Any], b: Counter[Any], what: str) -> None:
    """Chi-square test of homogeneity: `a` and `b` could be samples of one distribution (p > P_SAME)."""
    keys = sorted(set(a) | set(b), key=str)
    _, p, _, _ = chi2_contingency([[a[k] for k in keys], [b[k] for k in keys]])
    assert p > P_SAME, f"{what} differs (chi-square p={p:.2g}, n={sum(a.values())}/{sum(b.values())}):\n" \
                       f"{dict(a)}\n{dict(b)}"


def fail_counts(rows: Iterable[tuple[int, AgentTrace, dict[str, Any], EvaluationResult]],
                key: Callable[[AgentTrace, dict[str, Any]], Iterable[Any]]) -> dict[Any, tuple[int, int]]:
    """Per dimension value: (failing groundedness verdicts, verdicts) of the traces that have it."""
    counts: dict[Any, list[int]] = {}
    for _, item, trace, result in rows:
        passed = verdict(result)
        if passed is None:
            continue
        for value in set(key(item, trace)):
            c = counts.setdefault(value, [0, 0])
            c[0] += not passed
            c[1] += 1
    return {value: (c[0], c[1]) for value, c in counts.items()}


def pass_rate(rows: Iterable[tuple[int, AgentTrace, dict[str, Any], EvaluationResult]],
              app: str | None = None) -> tuple[int, int]:
    verdicts = [verdict(r) for _, item, _, r in rows if app in (None, item.app)]
    judged = [v for v in verdicts if v is not None]
    return sum(judged), len(judged)


def assert_requests_unchanged(planted: Run, healthy: Run) -> None:
    """What a plant must not change: apps, questions, retrieved documents, tools called, failures,
    conversations (the planted run and the healthy run have different seeds)."""
    def per(items: Iterable[Any]) -> Counter[Any]:
        return Counter(items)

    same_distribution(per(i.app for i in planted.items), per(i.app for i in healthy.items), "apps")
    same_distribution(per(root(t)["attributes"]["mlflow.spanInputs"] for t in planted.traces),
                      per(root(t)["attributes"]["mlflow.spanInputs"] for t in healthy.traces), "questions")
    same_distribution(per(u for t in planted.traces for u in doc_uris(t)),
                      per(u for t in healthy.traces for u in doc_uris(t)), "retrieved documents")
    same_distribution(per(i.tools or ("none",) for i in planted.items),
                      per(i.tools or ("none",) for i in healthy.items), "tool calls")
    same_distribution(per(i.failed for i in planted.items), per(i.failed for i in healthy.items),
                      "failed requests")
    same_distribution(per(i.frustrated for i in planted.items if i.conversation_ended),
                      per(i.frustrated for i in healthy.items if i.conversation_ended), "frustrated users")


# -- runs, once per module ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def healthy() -> Run:
    return run_agent(seed=101)


@pytest.fixture(scope="module")
def stale() -> Run:
    return run_agent(seed=202, stale_doc_after=PLANT_AFTER)


@pytest.fixture(scope="module")
def failing_tool() -> Run:
    return run_agent(seed=303, failing_tool_after=PLANT_AFTER)


@pytest.fixture(scope="module")
def release() -> Run:
    return run_agent(seed=404, ungrounded_release_after=TRACES // 2)


# -- the healthy baseline --------------------------------------------------------------------------

# Alerts the agent's traffic cannot reach, and why: they watch what the demo does not run or have.
NOT_FROM_TRAFFIC = {
    "ConsumerLagHigh": "the consumer's lag behind the topic (over 10000 records), not the traces",
    "WriteBackLagging": "a write-back sink, which the demo does not run",
    "JudgeDisagreesWithHumans": "human labels, which the agent's traces carry none of",
    "JudgeCanaryFailing": "canary records, which the demo's judges section configures none of",
    "JudgeSpendNearCap": "a spend cap, which the demo's heuristic judges have none of (they cost nothing)",
}


def test_every_alert_stays_quiet_with_the_demos_defaults(healthy):
    """Each alert's rate per app (or judge, or topic) from tracejudge's evaluation of the healthy
    traffic, against the threshold in the rules file, clear of it by MARGIN at 99% confidence."""
    rules = alert_rules()
    checked: dict[str, str] = {}
    assert not healthy.items[0].planted and {i.version for i in healthy.items} == {DEFAULT_VERSION}

    floor = groundedness_floor()
    for app in APPS:
        passed, n = pass_rate(healthy.rows(), app)
        low, _ = wilson(passed, n)
        assert n >= 800 and low >= floor + MARGIN, (app, passed, n, floor)
    checked["GroundednessDropped"] = f"groundedness pass rate >= {floor} + {MARGIN}"

    ceiling = threshold("UserFrustrationRising", "tracejudge_user_frustration_unresolved:ratio1h", ">")
    for app in APPS:
        values = [s.assessment("user_frustration").value for s in healthy.sessions if s.app == app]
        _, high = wilson(values.count("unresolved"), len(values))
        assert len(values) >= 300 and high <= ceiling - MARGIN, (app, Counter(values), ceiling)
    checked["UserFrustrationRising"] = f"unresolved share <= {ceiling} - {MARGIN}"

    ceiling = threshold("JudgeErrorsHigh", "tracejudge_judge_errors:ratio15m", ">")
    for judge in ("groundedness", "relevance_to_query"):
        errors = sum(r.assessment(judge).error is not None for r in healthy.results
                     if any(a.name == judge for a in r.assessments))
        calls = sum(verdict(r, judge) is not None for r in healthy.results) + errors
        _, high = wilson(errors, calls)
        assert high <= ceiling - MARGIN, (judge, errors, calls)
    checked["JudgeErrorsHigh"] = f"judge error ratio <= {ceiling} - {MARGIN}"

    # Every trace was read (`evaluate_many` raises RecordError on one that cannot be, which the
    # runner dead-letters): 0 dead letters, under the ceiling.
    ceiling = threshold("DeadLettersRising", "tracejudge_records_dead_lettered:ratio15m", ">")
    assert len(healthy.results) == len(healthy.items) and ceiling > 0
    checked["DeadLettersRising"] = "no record unreadable"

    assert "tracejudge_judge_verdicts_total" in rules["EvaluationsMissing"]
    for app in APPS:
        assert pass_rate(healthy.rows(), app)[1] > 0
    checked["EvaluationsMissing"] = "verdicts for every app"

    # A release comparison needs two releases; the healthy traffic states one version (asserted above).
    checked["ReleaseRegressed"] = "one version"

    unknown = set(rules) - set(checked) - set(NOT_FROM_TRAFFIC)
    assert not unknown, f"alerts with no healthy-baseline check in this test: {sorted(unknown)}; add one"


# -- a stale document ------------------------------------------------------------------------------


def test_a_stale_document_fails_the_answers_that_retrieve_it_and_nothing_else(stale, healthy):
    before, after = list(stale.rows()), list(stale.rows(PLANT_AFTER))
    assert not any(STALE_DOC_TEXT in json.dumps(t) for _, _, t, _ in before[:PLANT_AFTER])
    retrieving = [(item, t, r) for _, item, t, r in after if STALE_DOC_URI in doc_uris(t)]
    assert len(retrieving) >= 150
    for item, trace, result in retrieving:
        assert "stale-doc" in item.planted and STALE_DOC_TEXT in json.dumps(trace)
        # An answered request that retrieved the stale page fails groundedness.
        assert verdict(result) in (None, False) and (verdict(result) is None) == item.failed

    # Failing verdicts concentrate on the stale doc_uri: its failure rate is above every other
    # document's (and topic's), by a z of Z_APART, and most of the app's failures are its traces.
    by_doc = fail_counts(after, lambda item, t: doc_uris(t))
    stale_fails, stale_n = by_doc[STALE_DOC_URI]
    for uri, (fails, n) in by_doc.items():
        if uri != STALE_DOC_URI:
            assert two_proportion_z(stale_fails, stale_n, fails, n) > Z_APART, (uri, fails, n)
    support_fails = sum(1 for _, item, _, r in after if item.app == "support-bot" and verdict(r) is False)
    assert stale_fails / support_fails >= 0.75
    # A topic whose questions all retrieve the page fails as often, but on fewer traces: the page
    # explains more failures than any topic does.
    by_topic = fail_counts(after, lambda item, t: [t["info"]["tags"]["topic"]])
    assert all(f < stale_fails for f, _ in by_topic.values()), by_topic

    # The page: support-bot's pass rate under the floor; docs-qa's unchanged and above it.
    floor = groundedness_floor()
    assert wilson(*pass_rate(after, "support-bot"))[1] < floor
    assert wilson(*pass_rate(after, "docs-qa"))[0] >= floor + MARGIN
    assert_requests_unchanged(stale, healthy)


# -- a failing tool ---------------------------------------------------------------------------------


def test_a_failing_tool_errors_on_its_span_degrades_the_answer_and_nothing_else(failing_tool, healthy):
    calls = [(i, item, t, r) for i, item, t, r in failing_tool.rows()
             for s in tool_spans(t) if s["name"] == FAILING_TOOL]
    after = [c for c in calls if c[0] >= PLANT_AFTER]
    assert len(after) >= 200
    for _, item, trace, result in after:
        (span,) = [s for s in tool_spans(trace) if s["name"] == FAILING_TOOL]
        assert in_error(span) and any(e["name"] == "exception" for e in span["events"])
        if not item.failed:
            # The agent carried on: the trace is not in error, the answer is degraded and fails.
            assert not in_error(root(trace)) and attribute(root(trace), "mlflow.spanOutputs").startswith(
                DEGRADED_PREFIX)
            assert result.record.failed is False and verdict(result) is False
    # Before the plant the tool errs only on a request that failed (failure_share), like any tool.
    for _, item, trace, _ in calls:
        if not item.planted:
            assert not any(in_error(s) for s in tool_spans(trace)) or item.failed
    other_tools = [(item, s) for _, item, t, _ in failing_tool.rows() for s in tool_spans(t)
                   if s["name"] != FAILING_TOOL]
    assert all(item.failed for item, s in other_tools if in_error(s))

    # Failing verdicts concentrate on the tool: above every other tool, topic and document.
    rows = list(failing_tool.rows(PLANT_AFTER))
    by_tool = fail_counts(rows, lambda item, t: item.tools or ("none",))
    tool_fails, tool_n = by_tool[FAILING_TOOL]
    for dimension in (by_tool, fail_counts(rows, lambda item, t: [t["info"]["tags"]["topic"]]),
                      fail_counts(rows, lambda item, t: doc_uris(t))):
        for value, (fails, n) in dimension.items():
            if value != FAILING_TOOL:
                assert two_proportion_z(tool_fails, tool_n, fails, n) > Z_APART, (value, fails, n)

    floor = groundedness_floor()
    assert wilson(*pass_rate(rows, "support-bot"))[1] < floor
    assert wilson(*pass_rate(rows, "docs-qa"))[0] >= floor + MARGIN
    assert_requests_unchanged(failing_tool, healthy)


# -- an ungrounded release ----------------------------------------------------------------------------


def test_an_ungrounded_release_states_its_version_and_answers_worse(release, healthy):
    switch = TRACES // 2
    for i, item, trace, result in release.rows():
        expected = RELEASE_VERSION if i >= switch else DEFAULT_VERSION
        assert stated_versions(trace) == {expected} and item.version == expected
        # The demo's runner reads the version from the agent's tag (`stream.version_tag`).
        assert result.record.version == expected
    old = pass_rate(r for r in release.rows() if r[0] < switch)
    new = pass_rate(release.rows(switch))
    assert two_proportion_z(old[0], old[1], new[0], new[1]) > Z_APART, (old, new)
    floor = groundedness_floor()
    rules = alert_rules()
    for app in APPS:
        old = pass_rate((r for r in release.rows() if r[0] < switch), app)
        new = pass_rate(release.rows(switch), app)
        assert wilson(*new)[1] < floor and wilson(*old)[0] >= floor + MARGIN
        # The release comparison pages too: its z and its drop over the rule's thresholds.
        assert "ReleaseRegressed" in rules
        z = threshold("ReleaseRegressed", "tracejudge_judge_pass_drop:zscore1d", ">")
        drop = threshold("ReleaseRegressed", "tracejudge_judge_pass_drop:ratio1d", ">")
        assert two_proportion_z(old[0], old[1], new[0], new[1]) > z
        assert old[0] / old[1] - new[0] / new[1] > drop + MARGIN
    assert_requests_unchanged(release, healthy)


def test_a_seed_serves_the_same_requests_whatever_is_planted():
    """The plants draw nothing from the requests' random stream: with one seed, the same questions,
    documents, tool calls, failures and conversations, with and without every plant."""
    def requests(**plants: Any) -> list[tuple[Any, ...]]:
        with SyntheticRagAgent(AgentSettings(**{**HEALTHY, "seed": 9, **plants})) as agent:
            items = list(agent.traces(300))
        return [(i.trace_id, i.app, i.session_id, i.turn, i.tools, i.failed,
                 root(json.loads(i.payload))["attributes"]["mlflow.spanInputs"],
                 doc_uris(json.loads(i.payload))) for i in items]

    plain = requests()
    assert requests(stale_doc_after=50, failing_tool_after=100, ungrounded_release_after=150) == plain


def test_planted_settings_are_checked():
    with pytest.raises(ValueError, match="stale_doc_after"):
        AgentSettings(stale_doc_after=-1)
    with pytest.raises(ValueError, match="release_version must differ"):
        AgentSettings(ungrounded_release_after=0, release_version=DEFAULT_VERSION)
    with pytest.raises(ValueError, match="release_ungrounded_share"):
        AgentSettings(release_ungrounded_share=2.0)
    assert AgentSettings(stale_doc_after=0, ungrounded_release_after=30).planted_after() == {
        "stale-doc": 0, "ungrounded-release": 30}


# -- the command --------------------------------------------------------------------------------------


def test_demo_plants_causes_end_to_end_and_its_summary_names_them():
    """`tracejudge demo --plant ...` with its own broker, bounded by --duration: the start and the
    final summary say what was planted, from which trace and when, and how many traces it changed."""
    proc = subprocess.run([*DEMO, "--duration", "6", "--rate", "40", "--metrics-port", "0", "--seed", "5",
                           "--plant", "stale-doc@1s", "--plant", "failing-tool@20",
                           "--plant", "ungrounded-release@3s"],
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"Planting stale-doc after 1s (from trace 41): stale document {STALE_DOC_URI}" in out
    assert f"Planting failing-tool after 20 traces (from trace 21): failing tool {FAILING_TOOL}" in out
    assert f"Planting ungrounded-release after 3s (from trace 121): release {RELEASE_VERSION}" in out
    final = out[out.index("final summary"):]
    changed = {}
    for name, first in (("stale-doc", 41), ("failing-tool", 21), ("ungrounded-release", 121)):
        found = re.search(rf"^  planted {name} \(from trace {first}, at ([0-9.]+)s\): (.*); "
                          r"(\d+) traces changed$", final, re.M)
        assert found, final
        changed[name] = int(found.group(3))
    assert STALE_DOC_URI in final and f"failing tool {FAILING_TOOL}" in final
    assert all(n > 0 for n in changed.values()), changed


@pytest.mark.parametrize(("plants", "message"), [
    (["--plant", "bogus"], "unknown cause 'bogus'"),
    (["--plant", "stale-doc@-3s"], "AFTER must be seconds"),
    (["--plant", "stale-doc", "--plant", "stale-doc@5"], "--plant stale-doc is given twice"),
])
def test_a_bad_plant_is_a_usage_error(plants, message):
    proc = subprocess.run([*DEMO, "--duration", "1", *plants], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Started a local" not in proc.stdout
