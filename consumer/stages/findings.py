"""`tracejudge findings run`: what the failing verdicts have in common, per app and judge, window by
window, from the results topic.

A stage on the consumer runtime (`consumer/runtime/loop.py`), consumer group `tracejudge-findings`
unless `findings.group_id` says otherwise:

    trace results ──poll──▶ FindingsStage.process: the result line (`EvaluationResult.from_dict`)
    (findings.input_topic,        │  not a result ──▶ counted (invalid) and logged; session lines and
     default stream.results_topic)│  backfill results ──▶ counted (skipped)
                                  ▼
            Windows: the pane being gathered (`metrics.findings.FindingsWindow`: per (app, judge) the
                     verdicts and each dimension value's counts, bounded) and the closed panes
                                  │ every findings.slide_s (or window_s: tumbling), wall clock
                                  ▼
            the window's findings ──▶ /metrics (`metrics/telemetry/findings.py`: top K per app and judge)
                                  └─▶ findings.findings_topic, one JSON line each, keyed "app/judge"

A record's offset is released as soon as it is counted: the counts are statistics of a window, kept
in memory per process, and a restart (or a rebalance) starts the window again rather than re-reading
the topic. Run one replica per results topic for one view of each app and judge (several replicas
each analyse their own partitions). The window is wall-clock (processing time); a finding's `window`
is its start and end in seconds since the epoch.

Neighbours: the analysis is `metrics/findings/`, the section `consumer/config/findings.py`, the command
`consumer/commands/findings.py`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import orjson
from kafka.errors import MessageSizeTooLargeError, RecordListTooLargeError
from kafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import ConfigError, Settings
from tracejudge.consumer.runtime.loop import ConsumerRuntime
from tracejudge.consumer.runtime.offsets import Exports, Releasable
from tracejudge.consumer.runtime.producer import Outputs
from tracejudge.consumer.runtime.producing import RateLimitedLog
from tracejudge.consumer.runtime.stage import Runtime, Stage
from tracejudge.metrics.findings import Finding, FindingsWindow, RequestClusterer
from tracejudge.metrics.findings.models import ClusterModels, name_findings
from tracejudge.metrics.telemetry.findings import FindingsMetrics
from tracejudge.schemas.result import EvaluationResult
from tracejudge.schemas.results_line import KNOWN_SCHEMA_VERSION, BadResult, decode_line

__all__ = ["DEFAULT_GROUP", "FINDINGS_FORMAT", "FindingsPlan", "FindingsRunner", "FindingsStage", "Windows",
           "cluster_models", "plan_findings", "shown_setting"]

log = logging.getLogger("tracejudge.findings")
DEFAULT_GROUP = "tracejudge-findings"
FINDINGS_FORMAT = "tracejudge_finding"
_SIZE_ERRORS = (MessageSizeTooLargeError, RecordListTooLargeError)


@dataclass(frozen=True, slots=True)
class FindingsPlan:
    """What `tracejudge findings run` reads and writes, resolved from the settings."""

    input_topic: str
    findings_topic: str | None
    group_id: str


def plan_findings(settings: Settings) -> FindingsPlan:
    """Resolve the `findings:` section; `ConfigError` naming the key when the stage cannot run."""
    f = settings.findings
    source = f.input_topic or settings.stream.results_topic
    if not source:
        raise ConfigError("findings.input_topic", "is required: the trace results topic to read (or "
                                                  "stream.results_topic, which it defaults to)")
    if f.findings_topic == source:
        raise ConfigError("findings.findings_topic", f"is the input topic {source!r}; findings go to a "
                                                     "topic of their own")
    f.clustering.endpoints(settings.judges)  # an unknown endpoint is a ConfigError naming the key
    return FindingsPlan(source, f.findings_topic, f.group_id or DEFAULT_GROUP)


class Windows:
    """The panes of the window, clock-free (the caller passes `now`, seconds since the epoch): the
    pane being gathered, the closed ones the window still spans, and the request clusters they share."""

    def __init__(self, settings: Settings, now: float, models: ClusterModels | None = None) -> None:
        f = settings.findings
        self.options = f.options()
        embed = models.vector if models is not None and models.embedder is not None else None
        self.clusterer = RequestClusterer(f.clustering.options(), embed)
        self.slide = f.slide_s if f.slide_s is not None else f.window_s
        self.panes: deque[FindingsWindow] = deque(maxlen=f.panes)
        self.pane = FindingsWindow(self.options, self.clusterer, start=now)
        self.pane_end = now + self.slide

    def add(self, result: EvaluationResult) -> int:
        return self.pane.add(result)

    def due(self, now: float) -> bool:
        return now >= self.pane_end

    def close(self, now: float) -> tuple[FindingsWindow, list[Finding]]:
        """Close the pane (and any the clock skipped), analyse the window it ends; the closed pane and
        the window's findings."""
        closed, end = self.pane, self.pane_end
        self.panes.append(closed)
        merged = closed if len(self.panes) == 1 else FindingsWindow.merged(list(self.panes))
        merged.start = self.panes[0].start
        findings = merged.analyse(end=end)
        start = end
        if now - end >= self.slide * self.panes.maxlen:  # idle longer than the window: nothing spans it
            self.panes.clear()
            start = now
        while start + self.slide <= now:  # panes the clock skipped, empty
            self.panes.append(FindingsWindow(self.options, self.clusterer, start=start))
            start += self.slide
        self.pane = FindingsWindow(self.options, self.clusterer, start=start)
        self.pane_end = start + self.slide
        return closed, findings


class _Nothing:
    """The work a published finding stands for: none to release (its records were released when read)."""

    def release(self) -> None:
        return None


class FindingsStage(Stage):
    """Counts each result's verdicts into the window; at each pane's end publishes the findings."""

    name = "findings"

    def __init__(self, plan: FindingsPlan, settings: Settings, metrics: FindingsMetrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.plan = plan
        self.metrics = metrics
        self.clock = clock
        self.models = cluster_models(settings, metrics)
        self.windows = Windows(settings, clock(), self.models)
        self.exports = Exports()
        self.runtime: Runtime | None = None
        self.evicted = 0
        self._log = RateLimitedLog(log)
        m = metrics.records
        self._ok, self._invalid, self._skipped = m.labels("ok"), m.labels("invalid"), m.labels("skipped")
        self._passed, self._failed = metrics.verdicts.labels("passed"), metrics.verdicts.labels("failed")

    def topics(self) -> list[str]:
        return [self.plan.input_topic]

    def subscription(self) -> str:
        out = self.plan.findings_topic or "/metrics only (no findings.findings_topic)"
        return f"{self.plan.input_topic} (trace results) -> {out}"

    def outputs(self) -> Outputs:
        return Outputs(metrics=self.metrics, results_topic=self.plan.findings_topic,
                       record_format=FINDINGS_FORMAT)

    def prepare(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def open(self, runtime: Runtime) -> None:
        self.runtime = runtime

    # -- the loop -------------------------------------------------------------------------------------

    def process(self, tp: TopicPartition, records: list[Any]) -> None:
        assert self.runtime is not None
        track = self.runtime.tracker.track
        results = [_result(record.value) for record in records]
        if self.models is not None:  # the batch's requests embedded in as few calls as the batch size allows
            self.models.prefetch([r.record.request for r in results
                                  if isinstance(r, EvaluationResult) and r.backfill is None])
        for record, result in zip(records, results, strict=True):
            ticket = track(tp, record.offset)
            try:
                self._count(record, result)
            finally:
                ticket.release()
        self.metrics.window_verdicts.set(self.windows.pane.verdicts)

    def _count(self, record: Any, result: EvaluationResult | BadResult | None) -> None:
        if isinstance(result, BadResult):
            self._invalid.inc()
            self._log.warning("invalid result", "%s[%s]@%s is not a trace result: %.200s", record.topic,
                              record.partition, record.offset, result.message)
            return
        if result is None or result.backfill is not None:
            self._skipped.inc()
            return
        self._ok.inc()
        pane = self.windows.pane
        before = pane.failing
        counted = self.windows.add(result)
        if counted:
            failed = pane.failing - before
            self._failed.inc(failed)
            self._passed.inc(counted - failed)

    def tick(self, now: float) -> None:
        wall = self.clock()
        if self.windows.due(wall):
            self._close(wall)

    def wait_hint(self, now: float) -> float | None:
        return max(0.0, self.windows.pane_end - self.clock())

    def busy(self) -> int:
        return self.exports.count

    def _close(self, now: float) -> None:
        clusterer = self.windows.clusterer
        pane, findings = self.windows.close(now)
        if self.models is not None:
            name_findings(findings, clusterer, self.models)
            self.models.new_window()
        m = self.metrics
        m.windows.inc()
        for dim, n in pane.dropped_values.items():
            m.values_dropped.labels(dim).inc(n)
        if pane.dropped_verdicts:
            m.verdicts_dropped.inc(pane.dropped_verdicts)
        if pane.sample_dropped:
            m.sample_dropped.inc(pane.sample_dropped)
        if clusterer.evicted > self.evicted:
            m.clusters_evicted.inc(clusterer.evicted - self.evicted)
            self.evicted = clusterer.evicted
        m.show(findings)
        m.window_verdicts.set(0)
        if findings:
            top = "; ".join(f"{f.app}/{f.judge} {f.dimension}={f.value[:60]} lift {f.lift:.2f}"
                            for f in findings if f.rank == 1)
            log.info("findings window ending %s: %d findings (%s)", _iso(now), len(findings), top)
        if self.plan.findings_topic is not None:
            for f in findings:
                self._publish(f, self.exports.start(_Nothing()), 0)

    def _publish(self, finding: Finding, done: Releasable, attempt: int) -> None:
        assert self.runtime is not None and self.plan.findings_topic is not None
        publisher = self.runtime.producing.publisher
        assert publisher is not None
        value = orjson.dumps(finding.to_dict())
        key = f"{finding.app}/{finding.judge}".encode("utf-8", "replace")

        def acked() -> None:
            self.metrics.results_published.inc()
            done.release()

        def failed(exc: Exception) -> None:
            self.metrics.result_publish_failures.inc()
            if isinstance(exc, _SIZE_ERRORS):
                self.metrics.rejected.inc()
                self._log.warning("finding rejected", "a finding of %d bytes was refused by the broker: %s",
                                  len(value), exc)
                done.release()
                return
            self._log.warning("finding publish failure", "cannot publish a finding to %s (attempt %d): "
                              "%s: %s; retrying", self.plan.findings_topic, attempt + 1, type(exc).__name__,
                              exc)
            publisher.retry_later(attempt, lambda: self._publish(finding, done, attempt + 1))

        publisher.send(self.plan.findings_topic, value=value, key=key,
                       headers=[("content-type", b"application/json")], on_ack=acked, on_error=failed)

    # -- shutdown -------------------------------------------------------------------------------------

    def stopping(self) -> None:
        held = self.windows.pane.verdicts + sum(p.verdicts for p in self.windows.panes)
        if held:
            log.info("stopping: the window in progress (%d verdicts) is not analysed", held)

    def drain(self, deadline: float) -> None:
        """Until `deadline`: let the findings already sent be acknowledged."""
        assert self.runtime is not None
        self.runtime.producing.settle(deadline, lambda: self.exports.count, wait=self.exports.wait_idle)

    def close(self) -> None:
        if self.models is not None:
            self.models.close()


def cluster_models(settings: Settings, metrics: FindingsMetrics | None = None) -> ClusterModels | None:
    """The endpoints of `findings.clustering.embeddings`/`name_with` (None when neither is set or
    `auto` finds none), counting into `metrics` when given (`ConfigError` naming the key)."""
    c = settings.findings.clustering
    embeddings, name_with = c.endpoints(settings.judges)
    if (embeddings is None and name_with is None) or settings.judges is None:
        return None
    # A call waits at most what a judgement may (the stage's thread waits for it).
    options = replace(c.model_options(), timeout_seconds=settings.judges.judgement_timeout_seconds)
    if metrics is None:
        return ClusterModels(settings.judges, embeddings=embeddings, name_with=name_with,
                             options=options)
    m = metrics
    return ClusterModels(settings.judges, embeddings=embeddings, name_with=name_with,
                         options=options, registry=m.registry,
                         on_fallback=lambda reason: m.clustering_fallbacks.labels(reason).inc(),
                         on_name=lambda outcome: m.cluster_names.labels(outcome).inc(),
                         on_embedded=m.embedded_texts.inc)


def _result(value: bytes | None) -> EvaluationResult | BadResult | None:
    """The trace result of a results-topic record; None for a session result line; `BadResult` for
    anything else. One decode on the usual path; `decode_line` names what is wrong otherwise."""
    try:
        line = orjson.loads(value)  # type: ignore[arg-type]
        if (isinstance(line, dict) and "kind" not in line and "assessments" in line
                and type(line.get("schema_version", 1)) is int
                and 1 <= line.get("schema_version", 1) <= KNOWN_SCHEMA_VERSION):
            return EvaluationResult.from_dict(line)
    except (orjson.JSONDecodeError, msgspec.ValidationError, ValueError, TypeError):
        pass
    try:
        _, session = decode_line(value)
    except BadResult as exc:
        return exc
    if session is not None:
        return None
    return BadResult("not_a_result", "not a tracejudge result")


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


class FindingsRunner(ConsumerRuntime):
    """`tracejudge findings run` embedded (same API as `StreamRunner`: `start()`, `stop()`, `join()`,
    `registry`, `http_port`, `wait_assigned()`). `clock` (seconds since the epoch) times the windows."""

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        plan = plan_findings(settings)
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        metrics = FindingsMetrics(registry, max_apps=settings.prometheus.max_apps)
        self.plan = plan
        self.findings_metrics = metrics
        stage = FindingsStage(plan, settings, metrics, clock)
        super().__init__(settings, stage, metrics, registry, log=log, title="tracejudge findings",
                         group_id=plan.group_id, show_setting=shown_setting)
        self.windows = stage.windows


# The settings the findings stage uses (the start-up summary and --check-config show only these).
_STREAM_KEYS = ("stream.results_topic", "stream.poll_timeout_ms", "stream.commit_interval_ms",
                "stream.shutdown_grace_seconds", "stream.lag_interval_seconds")


def shown_setting(key: str) -> bool:
    """Whether `--check-config` and the start-up summary show `key`: the keys this stage reads."""
    if key.startswith(("findings.", "http.", "logging.", "producer.", "prometheus.")):
        return True
    if key.startswith("kafka."):
        return key != "kafka.group_id"
    return key in _STREAM_KEYS
