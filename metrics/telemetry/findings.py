"""The Prometheus series of the findings stage (`tracejudge findings run`, `consumer/stages/findings.py`).

The runtime's own series come from `ConsumerMetrics`. The findings of the last window are gauges per
(app, judge, dimension, value): `tracejudge_failure_concentration` (the lift), its interval's lower
bound, and the failing and total verdicts with the value; the counter
`tracejudge_failure_concentration_failures_total` adds each window's failing verdicts of a finding and
carries an example trace id as its exemplar (OpenMetrics allows exemplars on counters, not gauges).

Bounded: at most `findings.top_k` values per (app, judge); `app` capped as `tracejudge run` caps it
(`prometheus.max_apps`), `judge` at `MAX_JUDGES` names; a value label is cut at `VALUE_LABEL_MAX`
characters. A finding that drops out of the top K is removed from every family at the next window.
What the stage drops or thins is counted: values forgotten per dimension, verdicts of (app, judge)
pairs past `findings.max_groups`, verdicts left out of the conditioning sample (`findings.sample`),
clusters forgotten, unreadable records, windows clustered by words because the embeddings endpoint
could not be used (`findings.clustering.embeddings`), cluster names not obtained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from tracejudge.metrics.app_labels import AppLabelLimiter, label_text
from tracejudge.metrics.findings import DIMENSIONS, Finding
from tracejudge.metrics.findings.models import FALLBACK_REASONS, NAME_OUTCOMES
from tracejudge.metrics.telemetry.consumer import ConsumerMetrics

__all__ = ["MAX_JUDGES", "RECORD_OUTCOMES", "VALUE_LABEL_MAX", "FindingsMetrics"]

MAX_JUDGES = 100
VALUE_LABEL_MAX = 120
_EXEMPLAR_VALUE_MAX = 100
# What became of a results-topic record: counted (ok), not a trace result (invalid), or set aside (a
# session result line, a backfill result: not the live verdicts of the window).
RECORD_OUTCOMES = ("ok", "invalid", "skipped")
_LABELS = ["app", "judge", "dimension", "value"]


class FindingsMetrics(ConsumerMetrics):
    """The runtime's series plus the findings stage's, on `registry`."""

    def __init__(self, registry: CollectorRegistry, *, max_apps: int = 100) -> None:
        super().__init__(registry)
        self.registry = r = registry
        self.lift = Gauge("tracejudge_failure_concentration", "Lift of a value among an app's and judge's "
                          "failing verdicts in the last findings window: the failure rate with the value "
                          "over the rate without it (top K per app and judge).", _LABELS, registry=r)
        self.lift_lower = Gauge("tracejudge_failure_concentration_lower", "Lower bound of the lift's "
                                "simultaneous interval (findings.confidence).", _LABELS, registry=r)
        self.failing = Gauge("tracejudge_failure_concentration_failing", "Failing verdicts with the value in "
                             "the last findings window.", _LABELS, registry=r)
        self.verdicts_with = Gauge("tracejudge_failure_concentration_verdicts", "Verdicts (passed or "
                                   "failed) with the value in the last findings window.", _LABELS, registry=r)
        self.failures = Counter("tracejudge_failure_concentration_failures", "Failing verdicts of each "
                                "finding, added per window, with an example trace id as exemplar.", _LABELS,
                                registry=r)
        self.windows = Counter("tracejudge_findings_windows", "Findings windows analysed.", registry=r)
        self.findings = Counter("tracejudge_findings", "Findings emitted, by dimension.", ["dimension"],
                                registry=r)
        self.records = Counter("tracejudge_findings_records", "Results-topic records read, by outcome (ok; "
                               "invalid: not a trace result; skipped: a session or backfill result).",
                               ["outcome"], registry=r)
        self.verdicts = Counter("tracejudge_findings_verdicts", "Live verdicts counted into windows, by "
                                "outcome (passed, failed).", ["outcome"], registry=r)
        self.values_dropped = Counter("tracejudge_findings_values_dropped", "Distinct values forgotten "
                                      "because a dimension reached findings.max_values in a window, by "
                                      "dimension.", ["dimension"], registry=r)
        self.verdicts_dropped = Counter("tracejudge_findings_verdicts_dropped", "Verdicts not counted "
                                        "because their (app, judge) pair was past findings.max_groups.",
                                        registry=r)
        self.sample_dropped = Counter("tracejudge_findings_sample_dropped", "Verdicts left out of their "
                                      "(app, judge) pair's sample past findings.sample: the conditioned "
                                      "tests of that window ran on the sample.", registry=r)
        self.clusters_evicted = Counter("tracejudge_findings_clusters_evicted", "Request clusters forgotten "
                                        "at findings.clustering.max_clusters.", registry=r)
        self.clustering_fallbacks = Counter("tracejudge_findings_clustering_fallbacks", "Windows (from the "
                                            "fallback on) whose requests were clustered by words because the "
                                            "embeddings endpoint could not be used, by reason (budget, "
                                            "circuit_open, endpoint_error, window_limit).", ["reason"],
                                            registry=r)
        self.embedded_texts = Counter("tracejudge_findings_embedded_texts", "Request texts embedded through "
                                      "findings.clustering.embeddings (cache misses).", registry=r)
        self.cluster_names = Counter("tracejudge_findings_cluster_names", "Cluster names asked of "
                                     "findings.clustering.name_with, by outcome (named; failed, budget: the "
                                     "words stay the label).", ["outcome"], registry=r)
        self.window_verdicts = Gauge("tracejudge_findings_window_verdicts", "Verdicts counted in the "
                                     "window being gathered.", registry=r)
        self.results_published = Counter("tracejudge_findings_published", "Findings acknowledged by the "
                                         "broker on findings.findings_topic.", registry=r)
        self.result_publish_failures = Counter("tracejudge_findings_publish_failures", "Findings the "
                                               "producer failed to deliver (retried).", registry=r)
        self.rejected = Counter("tracejudge_findings_rejected", "Findings the broker refused as too large "
                                "(logged, not retried).", registry=r)
        self.app_overflow = Counter("tracejudge_app_label_overflow", "Findings whose app was exported as "
                                    "'other' because the distinct-app cap was reached.", registry=r)
        self.judge_overflow = Counter("tracejudge_findings_judge_label_overflow", "Findings whose judge "
                                      f"was exported as 'other' past {MAX_JUDGES} judge names.", registry=r)
        self.apps = AppLabelLimiter(max_apps, self.app_overflow)
        self.judges = AppLabelLimiter(MAX_JUDGES, self.judge_overflow)
        for outcome in RECORD_OUTCOMES:
            self.records.labels(outcome)
        for outcome in ("passed", "failed"):
            self.verdicts.labels(outcome)
        for reason in FALLBACK_REASONS:
            self.clustering_fallbacks.labels(reason)
        for outcome in NAME_OUTCOMES:
            self.cluster_names.labels(outcome)
        for dim in DIMENSIONS:
            self.values_dropped.labels(dim)
            self.findings.labels(dim)
        self._shown: set[tuple[str, str, str, str]] = set()

    def show(self, findings: Iterable[Finding]) -> int:
        """Export a window's findings, replacing the last window's (a series whose finding dropped out
        is removed); returns the series shown."""
        shown: set[tuple[str, str, str, str]] = set()
        for f in findings:
            self.findings.labels(f.dimension).inc()
            key = (self.apps(f.app), self.judges(f.judge), f.dimension, label_text(f.value[:VALUE_LABEL_MAX]))
            if key in shown:  # two values alike in their first characters: the better-ranked one shows
                continue
            shown.add(key)
            self.lift.labels(*key).set(f.lift)
            self.lift_lower.labels(*key).set(f.lift_interval[0])
            self.failing.labels(*key).set(f.failing)
            self.verdicts_with.labels(*key).set(f.total)
            exemplar = ({"trace_id": label_text(f.example_trace_ids[0][:_EXEMPLAR_VALUE_MAX])}
                        if f.example_trace_ids else None)
            self.failures.labels(*key).inc(f.failing, exemplar)
        for key in self._shown - shown:
            for family in (self.lift, self.lift_lower, self.failing, self.verdicts_with, self.failures):
                with contextlib.suppress(KeyError):
                    family.remove(*key)
        self._shown = shown
        return len(shown)
