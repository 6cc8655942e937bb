"""Prometheus metric families of tracejudge and the export of one `EvaluationResult`.

The metric names and labels here are a public contract (dashboards and alert rules query them): add
families, never rename. Everything is registered on a `CollectorRegistry` owned by the exporter, not
on prometheus_client's global one, so tests and embedded runners can build several side by side.
Other modules (judge metrics) register their families on `exporter.registry` and bound their `app`
label with the same `exporter.apps` limiter.

Label values come from bounded sets only: configured topics, a closed set of reasons, computed metric
names, and the `app` a record names, which is capped by `tracejudge.metrics.app_labels.AppLabelLimiter`.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Collection

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tracejudge.metrics.app_labels import AppLabelLimiter, label_text
from tracejudge.metrics.computed import RATIO_METRICS
from tracejudge.metrics.cost import COST_ERROR_KEY, ignored_reason, unknown_reason
from tracejudge.metrics.telemetry.consumer import ConsumerMetrics
from tracejudge.metrics.telemetry.signals import SignalMetrics
from tracejudge.metrics.version_labels import VersionLabelLimiter
from tracejudge.schemas.record import ANOMALIES
from tracejudge.schemas.result import EvaluationResult

__all__ = [
    "LATENCY_BUCKETS",
    "PrometheusExporter",
]

# Agent requests take from tens of milliseconds (a cached answer) to minutes (multi-step tool use).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
# 0.0 is its own bucket: "recall 0" (retrieved nothing useful) is the case alerts care about.
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
DOCUMENT_BUCKETS = (0, 1, 2, 3, 4, 5, 8, 10, 15, 20, 30, 50)
# A trace's cost in USD: a cached one-call answer costs a hundredth of a cent, a multi-step agent on a
# frontier model dollars.
COST_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
PROCESSING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                      1.0, 2.5, 5.0)

_INF = float("inf")
_ANOMALIES = frozenset(ANOMALIES)

# Exemplar label names + values may not exceed 128 characters ("trace_id" is 8 of them).
_EXEMPLAR_VALUE_MAX = 120
_EXEMPLAR_INTERVAL = 1.0


class _AppSeries:
    """The label children of one app, resolved once: `labels()` takes a lock and hashes every call."""

    __slots__ = ("app", "cost", "docs", "errors", "exemplar_due", "input_tokens", "latency", "ok",
                 "output_tokens", "ratios", "trace_cost")

    def __init__(self, exp: PrometheusExporter, app: str) -> None:
        self.app = app
        # When each latency bucket (and, last two, the ok/error counters) may take a new exemplar.
        self.exemplar_due = [0.0] * (len(LATENCY_BUCKETS) + 3)
        self.ok = exp.traces.labels(app, "ok")
        self.errors = exp.traces.labels(app, "error")
        self.latency = exp.trace_latency.labels(app)
        self.input_tokens = exp.tokens.labels(app, "input")
        self.output_tokens = exp.tokens.labels(app, "output")
        self.docs = exp.retrieved_documents.labels(app)
        self.ratios: dict[str, Histogram] = {}
        self.cost = exp.cost_usd.labels(app)
        self.trace_cost = exp.trace_cost.labels(app)


class PrometheusExporter(ConsumerMetrics):
    """Owns the registry and every tracejudge metric family of `tracejudge run` (the consumer's own,
    from `ConsumerMetrics`, and the evaluation's); `export(result)` records one result.

    `ratio_metrics` names the computed metrics whose values lie in [0, 1]; only those are observed in
    `tracejudge_metric_value` (latency or token counts would land in the +Inf bucket).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, max_apps: int = 100,
                 ratio_metrics: Collection[str] = RATIO_METRICS, max_versions: int = 5) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.ratio_metrics = frozenset(ratio_metrics)
        r = self.registry
        super().__init__(r)

        # -- what the traces say -------------------------------------------------------------------
        self.traces = Counter("tracejudge_traces", "Evaluated traces by app and status (error when "
                              "the trace failed).", ["app", "status"], registry=r)
        self.trace_latency = Histogram("tracejudge_trace_latency_seconds", "End-to-end latency of "
                                       "evaluated traces, with a trace_id exemplar.", ["app"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("tracejudge_tokens", "Tokens used by evaluated traces.",
                              ["app", "direction"], registry=r)
        self.retrieved_documents = Histogram("tracejudge_retrieved_documents", "Documents retrieved "
                                             "per trace (traces that retrieved).", ["app"],
                                             buckets=DOCUMENT_BUCKETS, registry=r)
        self.metric_value = Histogram("tracejudge_metric_value", "Computed ratio metrics in [0, 1] "
                                      "(document_recall, trajectory_*, custom ratio metrics).",
                                      ["app", "metric"], buckets=RATIO_BUCKETS, registry=r)
        self.metric_errors = Counter("tracejudge_metric_errors", "Computed metrics that raised for a "
                                     "record (the result carries the error).", ["metric"], registry=r)
        # -- what the traces cost (tracejudge.metrics.cost) ---------------------------------------
        self.cost_usd = Counter("tracejudge_cost_usd", "What evaluated traces cost the agent in USD, "
                                "stated by the trace or priced from its per-model usage.", ["app"],
                                registry=r)
        self.trace_cost = Histogram("tracejudge_trace_cost_usd", "Cost per trace in USD (traces whose "
                                    "cost is known).", ["app"], buckets=COST_BUCKETS, registry=r)
        self.cost_unknown = Counter("tracejudge_cost_unknown", "Traces whose cost is unknown, by reason: "
                                    "no_usage, unnamed_model (usage with no model named), unknown_model "
                                    "(not in the price table).", ["reason"], registry=r)
        self.cost_ignored = Counter("tracejudge_cost_ignored", "Stated costs or token counts set aside as "
                                    "bad input (negative, not a number, absurd), by reason.", ["reason"],
                                    registry=r)
        self.record_anomalies = Counter("tracejudge_record_anomalies", "Values records stated that were set "
                                        "aside as impossible (the result's `warnings`; the value is null), "
                                        "by reason: negative_duration, end_before_start, non_finite, "
                                        "negative_tokens, parent_cycle.", ["reason"], registry=r)
        self.app_overflow = Counter("tracejudge_app_label_overflow", "Records whose app was exported "
                                    "as 'other' because the distinct-app cap was reached.", registry=r)
        self.apps = AppLabelLimiter(max_apps, self.app_overflow)
        # Releases (tracejudge.metrics.version_labels): the judge verdict series' `version` label.
        self.version_overflow = Counter("tracejudge_version_label_overflow", "Judge verdicts whose version "
                                        "was exported as 'other': a version older than the app's "
                                        "prometheus.max_versions most recent ones.", registry=r)
        self.version_first_seen = Gauge("tracejudge_app_version_first_seen_timestamp_seconds", "When this "
                                        "process first saw each of an app's (at most max_versions) most "
                                        "recent versions, Unix time: the newest is the current release.",
                                        ["app", "version"], registry=r)
        self.versions = VersionLabelLimiter(max_versions, self.version_overflow, self.version_first_seen)
        # The cheap signals per app (`tracejudge_signals_total`, ...): `tracejudge.metrics.telemetry.signals`.
        self.signals = SignalMetrics(r)

        # -- what the stream does ------------------------------------------------------------------
        self.records = Counter("tracejudge_records", "Kafka records consumed, by outcome: ok "
                               "(evaluated and exported) or dead_lettered.", ["topic", "outcome"],
                               registry=r)
        self.dead_letters = Counter("tracejudge_dead_letters", "Records rejected as undecodable, "
                                    "invalid or too large, by reason.", ["reason"], registry=r)
        self.dead_letters_unrouted = Counter("tracejudge_dead_letters_unrouted", "Rejected records "
                                             "only logged, because no dead-letter topic is configured.",
                                             ["reason"], registry=r)
        self.dead_letter_publish_failures = Counter("tracejudge_dead_letter_publish_failures",
                                                    "Dead letters the producer failed to deliver "
                                                    "(retried; the offset waits).", registry=r)
        self.results_published = Counter("tracejudge_results_published", "Results acknowledged by the "
                                         "broker on the results topic.", registry=r)
        self.result_publish_failures = Counter("tracejudge_result_publish_failures", "Results the "
                                               "producer failed to deliver (retried; the offset waits).",
                                               registry=r)
        self.session_ids_hashed = Counter("tracejudge_session_ids_hashed", "Results whose session id "
                                          "was over 256 UTF-8 bytes and keyed by its SHA-256 instead "
                                          "(\"sha256:<hex>\"; every turn still gets the same key).",
                                          registry=r)
        self.processing = Histogram("tracejudge_record_processing_seconds", "Time to decode, evaluate "
                                    "and export one record on the consumer thread (not broker acks); "
                                    "decode and evaluate only when a decode worker did them.",
                                    buckets=PROCESSING_BUCKETS, registry=r)
        self.decode_workers = Gauge("tracejudge_decode_workers", "Decode worker processes running beside "
                                    "the consumer (stream.decode_workers).", registry=r)
        self.decode_workers_lost = Counter("tracejudge_decode_workers_lost", "Decode worker processes "
                                           "that exited unexpectedly (their records are decoded in the "
                                           "consumer process).", registry=r)
        self._ok_by_topic: dict[str, Counter] = {}
        self._series: dict[str, _AppSeries] = {}
        self._series_lock = threading.Lock()

    # -- per record ------------------------------------------------------------------------------

    def _app_series(self, app: str) -> _AppSeries:
        series = self._series.get(app)
        if series is None:
            with self._series_lock:
                series = self._series.get(app)
                if series is None:
                    series = self._series[app] = _AppSeries(self, app)
        return series

    def export(self, result: EvaluationResult) -> None:
        """Record one evaluated trace: status, latency (trace_id exemplar), tokens, documents, ratios."""
        rec = result.record
        s = self._app_series(self.apps(rec.app))
        trace_id = rec.trace_id or rec.request_id
        # Prometheus keeps one exemplar per series (per bucket) and scrapes every few seconds:
        # refreshing them once a second is enough, and building one costs as much as the observation.
        now = time.monotonic()
        due = s.exemplar_due
        slot = -1 if rec.failed else -2
        exemplar = None
        if trace_id and now >= due[slot]:
            exemplar = {"trace_id": label_text(trace_id[:_EXEMPLAR_VALUE_MAX])}
            due[slot] = now + _EXEMPLAR_INTERVAL
        (s.errors if rec.failed else s.ok).inc(1, exemplar)
        latency = rec.latency_seconds
        # Never a negative, NaN or infinite latency in the histogram, whoever built the record.
        if latency is not None and 0 <= latency < _INF:
            bucket = bisect.bisect_left(LATENCY_BUCKETS, latency)
            exemplar = None
            if trace_id and now >= due[bucket]:
                exemplar = {"trace_id": label_text(trace_id[:_EXEMPLAR_VALUE_MAX])}
                due[bucket] = now + _EXEMPLAR_INTERVAL
            s.latency.observe(latency, exemplar)
        tokens = rec.tokens
        if tokens is not None:
            # A counter only goes up (prometheus_client raises for a negative increment).
            if tokens.input is not None and tokens.input > 0:
                s.input_tokens.inc(tokens.input)
            if tokens.output is not None and tokens.output > 0:
                s.output_tokens.inc(tokens.output)
        if rec.retrieved_context is not None:
            s.docs.observe(len(rec.retrieved_context))
        self.signals.export(s.app, result.metrics, tokens)
        ratio_metrics = self.ratio_metrics
        for name, value in result.metrics.items():
            if value is None or name not in ratio_metrics or not 0.0 <= value <= 1.0:
                continue
            child = s.ratios.get(name)
            if child is None:
                child = s.ratios[name] = self.metric_value.labels(s.app, name)
            child.observe(value)
        cost = rec.cost
        if cost is not None:
            if cost.source != "unknown" and cost.total is not None:
                s.cost.inc(cost.total)
                s.trace_cost.observe(cost.total)
            elif cost.source == "unknown":
                self.cost_unknown.labels(unknown_reason(rec)).inc()
        if rec.warnings:
            for reason in rec.warnings:
                if reason in _ANOMALIES:  # the label stays bounded whatever a custom handler writes
                    self.record_anomalies.labels(reason).inc()
        for name, error in result.metric_errors.items():
            if name == COST_ERROR_KEY:
                self.cost_ignored.labels(ignored_reason(error)).inc()
            else:
                self.metric_errors.labels(name).inc()

    def count_ok(self, topic: str) -> None:
        child = self._ok_by_topic.get(topic)
        if child is None:
            child = self._ok_by_topic[topic] = self.records.labels(topic, "ok")
        child.inc()

    def count_dead_letter(self, topic: str, reason: str, routed: bool) -> None:
        self.records.labels(topic, "dead_lettered").inc()
        self.dead_letters.labels(reason).inc()
        if not routed:
            self.dead_letters_unrouted.labels(reason).inc()

