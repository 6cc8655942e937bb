"""Dashboards say 0 when the answer is 0, and a panel that can be empty for a reason says the reason.

A real Prometheus (tests/support/prometheus_stack.py) with the shipped recording rules scrapes three
loopback targets shaped like `tracejudge run`, `tracejudge sink mlflow` and `tracejudge sessions`: the
metric families their code registers (imported from the installed package, on their own registries),
fed healthy traffic only. No error, dead letter, skip or retry has happened, so those counters have no
series at all (a labelled child that was never incremented is not exposed). Every panel's PromQL, with
the dashboard variables filled in as `promql.py` does, is then evaluated: the error, dead-letter, skip
and coverage panels must answer 0 for each judge, topic, sink or app that had traffic (not an empty
vector, which Grafana draws as "No data"), and the panels that are empty for a reason (no calibration,
no canaries, no spend cap, no OpenTelemetry input here) must carry that reason as their "No value" text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics import MetricWrapperBase
from support.deploy_files import DASHBOARDS, RULES, deploy_module
from support.prometheus_stack import PrometheusServer, free_port, wait_until

from tracejudge.metrics.cost import JudgeCostMetrics
from tracejudge.metrics.judges.series import JudgeMetrics
from tracejudge.metrics.judges.sessions import SessionJudgeMetrics
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.metrics.telemetry.sessions import SessionMetrics
from tracejudge.metrics.telemetry.sinks import SinkMetrics
from tracejudge.metrics.telemetry.trust import TrustMetrics

APP, TOPIC, SINK = "shop", "traces", "mlflow"
# Trace judges: one passing, one whose every verdict failed, one eligible but never sampled (a low rate).
PASSING, FAILING, UNSAMPLED = "groundedness", "relevance_to_query", "safety"
SESSION_PASSING, SESSION_FAILING, SESSION_UNSAMPLED = ("user_frustration", "conversation_completeness",
                                                       "knowledge_retention")

Labels = frozenset[tuple[str, str]]


def labels(**values: str) -> Labels:
    return frozenset(values.items())


# (panel title, refId) -> the exact answer: one value per label set. The first group said "No data"
# before (a ratio or rate whose numerator series did not exist yet); the rest pin neighbours.
EXPECTED: dict[tuple[str, str], dict[Labels, float]] = {
    # operations
    ("Trace failure rate", "A"): {labels(app=APP): 0},
    ("Dead letters by reason", "B"): {labels(): 0},
    ("Dead-letter ratio (15m)", "A"): {labels(topic=TOPIC): 0},
    ("Verdicts skipped by reason", "B"): {labels(sink=SINK): 0},
    ("Write retries by reason", "B"): {labels(sink=SINK): 0},
    ("Sink dead letters by reason", "B"): {labels(sink=SINK): 0},
    ("Session dead letters by reason", "B"): {labels(): 0},
    # The sink creates its parked-results series at 0 when it starts; give-ups have none until the first.
    ("Parked results: waiting, parked, looked for again, given up", "B"): {labels(sink=SINK): 0},
    ("Parked results: waiting, parked, looked for again, given up", "D"): {labels(sink=SINK): 0},
    ("Parked results: waiting, parked, looked for again, given up", "F"): {labels(sink=SINK): 0},
    # quality
    ("Judge coverage (sampled / eligible)", "A"): {labels(app=APP, judge=PASSING): 1,
                                                   labels(app=APP, judge=FAILING): 1,
                                                   labels(app=APP, judge=UNSAMPLED): 0},
    ("Judge skips by reason", "B"): {labels(app=APP, judge=j): 0 for j in (PASSING, FAILING, UNSAMPLED)},
    ("Judge errors by reason", "B"): {labels(judge=j): 0 for j in (PASSING, FAILING, UNSAMPLED)},
    ("Judge error ratio (15m)", "A"): {labels(judge=PASSING): 0, labels(judge=FAILING): 0},
    ("Session judge coverage (sampled / eligible)", "A"): {labels(judge=SESSION_PASSING): 1,
                                                           labels(judge=SESSION_FAILING): 1,
                                                           labels(judge=SESSION_UNSAMPLED): 0},
    ("Session judge skips and errors by reason", "C"): {
        labels(judge=j): 0 for j in (SESSION_PASSING, SESSION_FAILING, SESSION_UNSAMPLED)},
    ("Session judge skips and errors by reason", "D"): {
        labels(judge=j): 0 for j in (SESSION_PASSING, SESSION_FAILING, SESSION_UNSAMPLED)},
    ("Session judge pass rate", "A"): {labels(app=APP, judge=SESSION_PASSING): 1,
                                       labels(app=APP, judge=SESSION_FAILING): 0},
    # already 0 through the recording rules' own `or`, or series the code creates at 0 at start
    ("Pass rate per judge and app (5m)", "A"): {labels(app=APP, judge=PASSING): 1,
                                                labels(app=APP, judge=FAILING): 0},
    ("Sessions ending unresolved (user_frustration, 1h) vs yesterday", "A"): {labels(app=APP): 0},
}

# Panels with nothing to show in this deployment, and the word their "No value" text must name.
LEGITIMATELY_EMPTY = {
    "Calibration stale (1 = re-run tracejudge calibrate)": "tracejudge calibrate",
    "Calibration: TPR, TNR, kappa (labels on the right)": "tracejudge calibrate",
    "Agreement with human labels (1d)": "human labels",
    "Canaries: disagreement with known answers (1h)": "canaries",
    "Judge spend cap: remaining vs cap": "spend cap",
    "Traces being assembled": "OpenTelemetry",
    "Assembled traces emitted by reason": "OpenTelemetry",
    # The traffic here states no version: there is no release to compare.
    "Pass rate: current vs previous release (1d)": "no version stated",
    "Release drop: two-proportion z (1d)": "no version stated",
    # The shipped rules have no SLO: `tracejudge slo render` writes those rules from the slos: section.
    "SLO error budget remaining": "No SLOs configured",
    "SLO burn rate per window (1 = budget spent exactly)": "No SLOs configured",
    # No findings stage (tracejudge findings run) and no fleet-wide spend cap here.
    "What the failures have in common": "the findings stage is not running",
    "Failing verdicts per finding (exemplars link to the trace)": "the findings stage is not running",
    "Judge spend of the whole fleet vs cap": "judges.fleet_spend",
}

# Counters of things that went wrong or were left out: none may have a series in this exposition...
BAD_EVENTS = ('{__name__=~"tracejudge_.*(errors|skipped|dead_letters|retries)_total"}',
              'tracejudge_records_total{outcome="dead_lettered"}', 'tracejudge_traces_total{status="error"}')
# ...but these, which their code creates at 0 when it starts (one label-bound child): they say 0.
BOUND_AT_START = {"tracejudge_sink_parked_retries_total"}


# --- the scrape targets ---------------------------------------------------------------------------------

def families(*owners: object) -> dict[str, MetricWrapperBase]:
    """The metric families (not label children) the owners registered, by exposed name (`describe()`;
    counters without `_total`)."""
    out: dict[str, MetricWrapperBase] = {}
    for owner in owners:
        for metric in vars(owner).values():
            if isinstance(metric, MetricWrapperBase):
                out[metric.describe()[0].name] = metric
    return out


def child(metric: MetricWrapperBase, *values: str) -> MetricWrapperBase:
    """The child with these label values; a family its owner already bound to them (the sink runtime's
    `Counter(...).labels(kind)`) is that child itself."""
    try:
        return metric.labels(*values)
    except ValueError:  # "already has labels set"
        return metric


class Target:
    """One process's registry served on 127.0.0.1, and how one round of healthy traffic moves it."""

    def __init__(self, registry: CollectorRegistry, feed: Callable[[], None], marker: str,
                 marker_labels: Mapping[str, str] | None = None) -> None:
        self.registry, self.feed, self.marker = registry, feed, marker
        self.marker_labels = dict(marker_labels or {})
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._server, self._thread = start_http_server(self.port, addr="127.0.0.1", registry=registry)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def run_target() -> Target:
    """`tracejudge run` reading JSON traces (no OpenTelemetry assembly): judges, trust series (no
    calibration, canaries or human labels), cost (no spend cap)."""
    registry = CollectorRegistry()
    owners = (PrometheusExporter(registry), JudgeMetrics(registry), TrustMetrics(registry),
              JudgeCostMetrics(registry))
    f = families(*owners)

    def feed() -> None:
        f["tracejudge_records"].labels(TOPIC, "ok").inc()
        f["tracejudge_traces"].labels(APP, "ok").inc()
        f["tracejudge_trace_latency_seconds"].labels(APP).observe(0.3)
        f["tracejudge_tokens"].labels(APP, "input").inc(120)
        f["tracejudge_tokens"].labels(APP, "output").inc(40)
        f["tracejudge_retrieved_documents"].labels(APP).observe(3)
        f["tracejudge_metric_value"].labels(APP, "document_recall").observe(0.8)
        f["tracejudge_consumer_lag_records"].labels(TOPIC, "0").set(0)
        f["tracejudge_cost_usd"].labels(APP).inc(0.01)
        f["tracejudge_trace_cost_usd"].labels(APP).observe(0.01)
        for judge in (PASSING, FAILING, UNSAMPLED):
            f["tracejudge_judge_eligible"].labels(APP, judge).inc()
        for judge, verdict in ((PASSING, "pass"), (FAILING, "fail")):
            f["tracejudge_judge_sampled"].labels(APP, judge).inc()
            f["tracejudge_judge_verdicts"].labels(APP, judge, verdict, "").inc()
            f["tracejudge_judge_score"].labels(APP, judge).observe(1.0 if verdict == "pass" else 0.0)
            f["tracejudge_judge_duration_seconds"].labels(judge).observe(1.5)
            f["tracejudge_judge_tokens"].labels(judge, "input").inc(800)
            f["tracejudge_judge_cost_usd"].labels(judge).inc(0.001)
        f["tracejudge_commits"].inc()  # last: once Prometheus has this round's commit, it has the round

    return Target(registry, feed, "tracejudge_commits_total")


def sink_target() -> Target:
    """`tracejudge sink mlflow`'s runtime series: writing, nothing skipped, retried or dead-lettered."""
    registry = CollectorRegistry()
    f = families(SinkMetrics(registry, SINK))

    def feed() -> None:
        child(f["tracejudge_sink_writes"], SINK, "written").inc(4)
        child(f["tracejudge_sink_lag_records"], SINK).set(0)
        child(f["tracejudge_sink_batches"], SINK).inc()

    return Target(registry, feed, "tracejudge_sink_batches_total", {"sink": SINK})


def sessions_target() -> Target:
    """`tracejudge sessions` with three session judges: one passing, one failing, one never sampled."""
    registry = CollectorRegistry()
    f = families(SessionMetrics(registry), SessionJudgeMetrics(registry))

    def feed() -> None:
        f["tracejudge_sessions"].labels(APP, "complete").inc()
        f["tracejudge_session_turns"].labels(APP).observe(4)
        f["tracejudge_session_duration_seconds"].labels(APP).observe(90)
        f["tracejudge_session_results_published"].inc()
        for judge in (SESSION_PASSING, SESSION_FAILING, SESSION_UNSAMPLED):
            f["tracejudge_session_judge_eligible"].labels(judge).inc()
        for judge, verdict in ((SESSION_PASSING, "none"), (SESSION_FAILING, "fail")):
            f["tracejudge_session_judge_sampled"].labels(judge).inc()
            f["tracejudge_session_judge_verdicts"].labels(APP, judge, verdict).inc()
            f["tracejudge_session_judge_score"].labels(APP, judge).observe(1.0 if verdict == "none" else 0.0)
        f["tracejudge_session_turns_received"].inc(4)

    return Target(registry, feed, "tracejudge_session_turns_received_total")


@pytest.fixture
def targets() -> Iterator[list[Target]]:
    made: list[Target] = []
    try:
        for build in (run_target, sink_target, sessions_target):
            made.append(build())
        yield made
    finally:
        for target in made:
            target.close()


# --- the dashboards' queries ------------------------------------------------------------------------------

def panels() -> list[dict[str, Any]]:
    return [panel for path in sorted(DASHBOARDS.glob("*.json"))
            for panel in json.loads(path.read_text())["panels"] if panel["type"] != "row"]


def answer(prom: PrometheusServer, expr: str) -> dict[Labels, float]:
    """The instant vector of a dashboard query as {labels: value}, the metric name left out (a recording
    rule keeps it; Grafana's legend does not show it). Variables are filled as promql.py does."""
    resolved = deploy_module("grafana/promql.py").fill_variables(expr, rate_interval="1m")
    return {frozenset((k, v) for k, v in s["metric"].items() if k != "__name__"): float(s["value"][1])
            for s in prom.query(resolved)}


def traffic_seen(prom: PrometheusServer, targets: list[Target], round_: int) -> None:
    """Feed one round of healthy traffic to every target and wait until Prometheus scraped all of it
    (each feed moves its target's marker last, so the marker's new value means the whole round)."""
    for target in targets:
        target.feed()
    for target in targets:
        fed = target.registry.get_sample_value(target.marker, target.marker_labels)
        assert fed, f"{target.marker} {target.marker_labels} did not move"

        def scraped(target: Target = target, fed: float | None = fed) -> bool:
            return any(float(s["value"][1]) == fed for s in prom.query(target.marker))

        wait_until(scraped, 30, f"Prometheus to scrape round {round_} of {target.marker} ({fed})")


def test_error_dead_letter_and_skip_panels_say_zero_and_empty_panels_say_why(tmp_path: Path, targets) -> None:
    addresses = [t.address for t in targets]
    with PrometheusServer(tmp_path / "prom", targets=addresses, rule_files=[RULES]) as prom:
        wait_until(prom.targets_up, 30, "the three tracejudge-like targets to be scraped")
        # Two rounds of traffic, each seen by Prometheus: every counter then has two samples apart, so
        # rate() and increase() have something to say (and the recording rules' `> 0` guards pass).
        for round_ in (1, 2):
            traffic_seen(prom, targets, round_)
        for rule in ("judge:tracejudge_judge_calls:increase15m", "topic:tracejudge_records:increase15m",
                     "app:tracejudge_user_frustration_verdicts:increase1h",
                     "app_judge:tracejudge_judge_verdicts:increase5m"):
            wait_until(lambda rule=rule: prom.query(f"{rule} > 0"), 30, f"the recording rule {rule}")

        # The premise: nothing went wrong, so the bad-event counters have no series at all, and the
        # recording rules over them (what the ratio panels used to show alone) are empty.
        for selector in BAD_EVENTS:
            series = prom.query(selector)
            assert {s["metric"]["__name__"] for s in series} <= BOUND_AT_START, selector
            assert all(float(s["value"][1]) == 0 for s in series), selector
        for rule in ("judge:tracejudge_judge_errors:ratio15m",
                     "topic:tracejudge_records_dead_lettered:ratio15m"):
            assert prom.query(rule) == [], rule

        results = {(panel["title"], t["refId"]): answer(prom, t["expr"])
                   for panel in panels() for t in panel["targets"]}

    for key, expected in EXPECTED.items():
        assert key in results, f"no panel target {key}"
        got = results[key]
        assert got, f"{key[0]} ({key[1]}) is empty: Grafana would say No data where the answer is known"
        assert got == {k: pytest.approx(v) for k, v in expected.items()}, key

    empty = set()
    for panel in panels():
        if not any(results[(panel["title"], t["refId"])] for t in panel["targets"]):
            empty.add(panel["title"])
    assert empty == set(LEGITIMATELY_EMPTY), "panels empty with healthy traffic"
    for panel in panels():
        if panel["title"] in LEGITIMATELY_EMPTY:
            reason = panel["fieldConfig"]["defaults"].get("noValue", "")
            assert LEGITIMATELY_EMPTY[panel["title"]] in reason, (panel["title"], reason)

