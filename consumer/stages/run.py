"""`tracejudge run`: consume traces from Kafka, evaluate them, export to Prometheus and a results topic.

The evaluation stage on the consumer runtime (`consumer/runtime/loop.py`, which owns the poll loop,
commits, rebalances, signals and `/metrics`, and the producer the results and dead letters leave
through, `consumer/runtime/producer.py`):

    ConsumerRuntime ──poll──▶ EvaluationStage.process ──▶ RecordProcessor ──▶ Pipeline.normalise
                                                              │                     │
                                                              ▼                     ▼
                                                        DeadLetterSink      Pipeline.evaluate (+ judges)
                                                              │                     │
                                                              │     PrometheusExporter.export + ResultSink
                                                              └──▶ Ticket.release() on broker ack ◀┘
                                                                          │
                                        OffsetTracker ──lowest incomplete offset──▶ commit (runtime)

At-least-once: a record's offset is committed only when its ticket is released, i.e. its metrics are
updated and its result (or dead letter) is acknowledged by the broker. Records may complete out of
order (results acked in any order, later asynchronous judges); per partition the commit is the lowest
incomplete offset.

Threads: the runtime's poll loop fetches and calls the stage; producer acks arrive on the producer's
thread and only release tickets; judges resolve on their own threads; decode workers are processes
whose answers arrive on a receiver thread.

The per-record path (`RecordProcessor`, its per-topic routes and the decoders) is a part shared with
`tracejudge backfill`: `consumer/stages/processing.py` and `consumer/stages/decoding.py`. The command's
arguments are `consumer/commands/run.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kafka.structs import TopicPartition

from tracejudge.consumer.collecting import Collector, open_files, run_hook, uses_findings
from tracejudge.consumer.config import ConfigError, Settings
from tracejudge.consumer.pipeline import Pipeline, build_judges, build_pipeline
from tracejudge.consumer.runtime import gc_policy
from tracejudge.consumer.runtime.findings_feed import FindingsFeed
from tracejudge.consumer.runtime.logs import configure_logging, suppress_logged
from tracejudge.consumer.runtime.loop import ConsumerRuntime
from tracejudge.consumer.runtime.offsets import Exports
from tracejudge.consumer.runtime.producer import Outputs
from tracejudge.consumer.runtime.stage import Runtime, Stage
from tracejudge.consumer.stages.decoding import (
    DecodePool,
    WorkerPoolDecoder,
    WorkerStartError,
    auto_workers,
    available_cpus,
)
from tracejudge.consumer.stages.processing import ASSEMBLED, Emit, FormatHandler, RecordProcessor
from tracejudge.metrics.computed import RATIO_METRICS
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.errors import StartupError

__all__ = ["Emit", "EvaluationStage", "Exports", "FormatHandler", "RecordProcessor", "StartupError",
           "StreamRunner", "configure_logging"]

log = logging.getLogger("tracejudge.run")


class EvaluationStage(Stage):
    """`tracejudge run`'s work on the consumer runtime: each record through `RecordProcessor`
    (decode, assemble, evaluate, judge), its metrics exported and its result or dead letter published;
    its ticket is released on the broker's ack. Fetching pauses at `stream.max_in_flight` exports."""

    name = "run"

    def __init__(self, settings: Settings, pipeline: Pipeline, exporter: PrometheusExporter, judges: Any,
                 handlers: Mapping[str, FormatHandler], decode_workers: int, workers_why: str, *,
                 tune_gc: bool) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.exporter = exporter
        self.judges = judges
        self.handlers = dict(handlers)
        self.exports = Exports()
        self.decode_workers = decode_workers
        self.workers_why = workers_why
        self.tune_gc = tune_gc
        self.runtime: Runtime | None = None
        self.processor: RecordProcessor | None = None
        self.decoder: WorkerPoolDecoder | None = None
        self._process: Callable[[TopicPartition, Any], None] | None = None
        self.canaries = _build_canaries(judges)
        self.trust: Any = None
        # `collections:` rules (`consumer/collecting.py`): an extra output of the results publisher.
        self.collector = Collector.build(settings.collections, exporter.registry)
        self._collection_files: dict[str, Any] = {}
        self.findings_feed = _findings_feed(settings, self.collector)
        self.external = _external_evaluations(settings, exporter, judges)

    # -- start-up -------------------------------------------------------------------------------------

    def topics(self) -> list[str]:
        return [t.name for t in self.settings.stream.topics]

    def subscription(self) -> str:
        judges = f" (judges: {', '.join(self.judges.judge_names())})" if self.judges else ""
        return ", ".join(map(str, self.settings.stream.topics)) + judges

    def outputs(self) -> Outputs:
        s = self.settings.stream
        if self.collector is not None:
            make, self._collection_files = run_hook(self.collector, s.results_topic, self.exporter)
            return Outputs(metrics=self.exporter, results_topic=s.results_topic,
                           dead_letter_topic=s.dead_letter_topic, make_results=make,
                           extra_topics=self.collector.topics)
        return Outputs(metrics=self.exporter, results_topic=s.results_topic,
                       dead_letter_topic=s.dead_letter_topic)

    def prepare(self, runtime: Runtime) -> None:
        if self.collector is not None:
            open_files(self.collector, self._collection_files)
            if self.findings_feed is not None:
                self.collector.findings = self.findings_feed.start()
        if self.decode_workers:
            self.decoder = self._start_decoder(self.decode_workers)
        else:
            log.info("decoding in the consumer process (%s)", self.workers_why)

    def _start_decoder(self, workers: int) -> WorkerPoolDecoder:
        decoder = WorkerPoolDecoder(self.settings, workers,
                                    on_worker_lost=self.exporter.decode_workers_lost.inc)
        try:
            decoder.start()
        except WorkerStartError as exc:
            raise StartupError(f"{exc} (stream.decode_workers)") from exc
        self.exporter.decode_workers.set_function(decoder.pool.live)
        log.info("decode workers ready: %d (%s)", workers, self.workers_why)
        return decoder

    def open(self, runtime: Runtime) -> None:
        s = self.settings
        self.runtime = runtime
        # The runtime's producer publishes the results and the dead letters (`runtime/producer.py`).
        results, dead_letters = runtime.producing.results, runtime.producing.dead_letters
        formats = {t.name: t.format for t in s.stream.topics}
        assembler = None
        if any(f in ASSEMBLED for f in formats.values()):
            from tracejudge.consumer.stages.assembly import TraceAssembler
            from tracejudge.metrics.telemetry.assembly import AssemblyMetrics

            assembler = TraceAssembler(s.otlp.assembly.to_settings(), app_tag=s.stream.app_tag,
                                       session_tag=s.stream.session_tag, version_tag=s.stream.version_tag,
                                       metrics=AssemblyMetrics(registry=self.exporter.registry))
        self.processor = RecordProcessor(self.pipeline, runtime.tracker, self.exporter, results, dead_letters,
                                         formats, max_record_bytes=s.stream.max_record_bytes,
                                         exports=self.exports, assembler=assembler,
                                         judge=self.judges.submit if self.judges else None,
                                         handlers=self.handlers, decoder=self.decoder)
        self.processor.trust = self.trust
        self.processor.external = self.external
        self._process = self.processor.process

    def started(self) -> None:
        if self.tune_gc:
            gc_policy.apply()

    # -- the loop -------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        assert self.processor is not None
        self.processor.emit_due()
        if self.canaries is not None:
            self.canaries.tick(now)

    def room(self) -> int:
        return self.settings.stream.max_in_flight - self.exports.count

    def process(self, tp: TopicPartition, records: list[Any]) -> None:
        process = self._process
        assert process is not None
        for record in records:
            process(tp, record)

    def polled(self, now: float) -> None:
        assert self.processor is not None
        self.processor.flush()

    def busy(self) -> int:
        return self.exports.count

    # -- rebalance (IO thread) ------------------------------------------------------------------------

    async def revoke(self, tps: set[TopicPartition], deadline: float, sleep: Any) -> str:
        # Traces still assembling would need the poll loop to complete: give them up, their records
        # are read again by whoever owns the partitions next.
        dropped = self.processor.discard_assembly() if self.processor is not None else 0
        waited = self.exports.count
        if self.runtime is not None:
            await self.runtime.producing.settle_revoked(deadline, sleep, lambda: self.exports.count)
        return f"waited for {waited} exports" + (f", {dropped} traces were assembling" if dropped else "")

    def lose(self, tps: set[TopicPartition]) -> None:
        if self.processor is not None:
            self.processor.discard_assembly()

    # -- shutdown -------------------------------------------------------------------------------------

    def stopping(self) -> None:
        if self.processor is not None and (dropped := self.processor.discard_assembly()):
            log.info("stopping: %d traces still assembling are left for re-reading", dropped)

    def drain(self, deadline: float) -> None:
        """Until `deadline`: let exports finish (the producer's re-sends run meanwhile, as the poll loop
        is not turning)."""
        if self.runtime is not None:
            self.runtime.producing.settle(deadline, lambda: self.exports.count, wait=self.exports.wait_idle)

    def close(self) -> None:
        # The runtime closes the producer after this.
        if self.judges is not None:
            with suppress_logged(log, "closing the judges"):
                self.judges.close()
        if self.decoder is not None:
            with suppress_logged(log, "stopping the decode workers"):
                self.decoder.close()
            self.decoder = None
        for f in self._collection_files.values():
            with suppress_logged(log, "closing a collection file"):
                f.close()
        if self.findings_feed is not None:
            self.findings_feed.close()


class StreamRunner(ConsumerRuntime):
    """`tracejudge run` embedded: the evaluation stage on the consumer runtime. Runs until `stop()`
    (or the `stop_event` given to `run`) is set.

    Embeddable: `runner.start()` runs it in a daemon thread; `runner.registry` is the Prometheus
    registry, `runner.exporter` the metric families, `runner.http_port` the bound port of the HTTP
    endpoint once serving. Without `pipeline`/`judges` they are built from the settings (`metrics:`
    and `judges:` sections); pass `judges=False` to run without judges whatever the settings say.
    `tune_gc=True` (what `tracejudge run` passes) applies `gc_policy` to the whole process once
    connected: only for a process that runs nothing else.
    Raises `ConfigError` when a custom metric or a judge cannot be set up.
    """

    def __init__(self, settings: Settings, pipeline: Pipeline | None = None, *,
                 exporter: PrometheusExporter | None = None, judges: Any = None,
                 handlers: Mapping[str, FormatHandler] | None = None, tune_gc: bool = False) -> None:
        self.handlers = dict(handlers or {})
        workers, why = _size_decode_workers(settings, self.handlers, pipeline is not None)
        self.pipeline = pipeline or build_pipeline(settings)
        ratio = getattr(getattr(self.pipeline, "metrics", None), "ratio_metrics", RATIO_METRICS)
        self.exporter = exporter or PrometheusExporter(max_apps=settings.prometheus.max_apps,
                                                       ratio_metrics=ratio,
                                                       max_versions=settings.prometheus.max_versions)
        # The cheap signals' state per app, served at each scrape.
        self.exporter.signals.watch(getattr(getattr(self.pipeline, "metrics", None), "norms", None))
        self.judges = None if judges is False else judges or build_judges(
            settings, self.exporter.registry, self.exporter.apps, self.exporter.versions)
        stage = EvaluationStage(settings, self.pipeline, self.exporter, self.judges, self.handlers, workers,
                                why, tune_gc=tune_gc)
        stage.trust = self.trust = _trust(self.judges, self.exporter)
        super().__init__(settings, stage, self.exporter, self.exporter.registry, log=log,
                         title="tracejudge run")
        self.exports = stage.exports

    @property
    def _decode_workers(self) -> int:
        """How many decode workers `run()` starts (`stream.decode_workers`, sized)."""
        stage = self.stage
        assert isinstance(stage, EvaluationStage)
        return stage.decode_workers

    @property
    def _decoder(self) -> DecodePool | None:
        stage = self.stage
        assert isinstance(stage, EvaluationStage)
        return stage.decoder.pool if stage.decoder is not None else None

    @property
    def _processor(self) -> RecordProcessor | None:
        stage = self.stage
        assert isinstance(stage, EvaluationStage)
        return stage.processor


def _findings_feed(settings: Settings, collector: Collector | None) -> FindingsFeed | None:
    """The reader of `findings.findings_topic` when a collection rule has a `finding:` condition;
    `ConfigError` when there is no findings topic to read."""
    if collector is None or not any(uses_findings(r) for r in collector.rules):
        return None
    topic = getattr(settings.findings, "findings_topic", None)
    if topic is None:
        raise ConfigError("findings.findings_topic", "a collection rule has a finding: condition, and "
                          "tracejudge run reads the current findings from this topic (the one `tracejudge "
                          "findings run` publishes to); set it")
    return FindingsFeed(settings, topic)


def _trust(judges: Any, exporter: PrometheusExporter) -> Any:
    """The judges' trust series (`metrics/telemetry/trust.py`): calibration from `judges.calibration_file`,
    agreement with the labels records carry. ConfigError when the calibration file cannot be read."""
    if judges is None or not hasattr(judges, "identities"):
        return None
    from tracejudge.metrics.judges.trust.calibration import CalibrationError
    from tracejudge.metrics.telemetry.trust import trust_for_run

    try:
        return trust_for_run(judges, exporter.registry, exporter.apps)
    except CalibrationError as exc:
        raise ConfigError([("judges.calibration_file", str(exc))]) from None


def _external_evaluations(settings: Settings, exporter: PrometheusExporter, judges: Any) -> Any:
    """Other evaluators' verdicts (`stream.external_evaluations`, metrics/telemetry/external.py), when a
    logs topic is consumed and they are enabled; else None."""
    ext = settings.stream.external_evaluations
    if not ext.enabled or not any(t.format in ("otlp_logs_proto", "otlp_logs_json")
                                  for t in settings.stream.topics):
        return None
    from tracejudge.metrics.telemetry.external import for_run

    return for_run(exporter, judges, thresholds=ext.thresholds, max_evaluators=ext.max_evaluators,
                   max_names=ext.max_names, app_tag=settings.stream.app_tag)


def _build_canaries(judges: Any) -> Any:
    """The canaries of `judges.canary` (tracejudge.metrics.judges.trust.canaries), judged by the live judges
    from
    the poll loop's tick; None without judges or a canary section."""
    from tracejudge.metrics.judges.trust.canaries import build_canaries

    # An unreadable canary file raises `JudgeConfigError`, a `ConfigError` naming the key.
    return build_canaries(judges) if hasattr(judges, "submit_canary") else None


def _size_decode_workers(settings: Settings, handlers: Mapping[str, FormatHandler],
                         own_pipeline: bool) -> tuple[int, str]:
    """How many decode workers to start (`stream.decode_workers`), and why, for the log."""
    wanted = settings.stream.decode_workers
    auto = wanted == "auto"
    if own_pipeline:
        # Decode workers build their own pipeline from the settings: a pipeline given here is not theirs.
        if not auto and wanted:
            log.warning("stream.decode_workers is ignored: the runner was given its own Pipeline")
        return 0, "the runner was given its own Pipeline"
    # OTLP topics go through trace assembly and custom handlers run here: neither uses workers.
    if not any(t.format not in ASSEMBLED and t.format not in handlers for t in settings.stream.topics):
        if not auto and wanted:
            log.warning("stream.decode_workers is ignored: every topic is OTLP spans or has its own "
                        "handler, which are decoded in the consumer process")
        return 0, "no topic of MLflow, agent-evaluation or inference-log records"
    if not auto:
        assert isinstance(wanted, int)
        return wanted, "stream.decode_workers"
    cpus = available_cpus()
    plural = "s" if cpus > 1 else ""
    return auto_workers(cpus), f"stream.decode_workers: auto, {cpus} CPU{plural} available"
