"""`tracejudge run`: consume traces from Kafka, evaluate them, export to Prometheus and a results topic.

The evaluation stage on the consumer runtime (`consumer/runtime/loop.py`, which owns the poll loop,
commits, rebalances, signals and `/metrics`):

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
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec
from kafka import KafkaProducer
from kafka.structs import TopicPartition

from tracejudge.consumer.config import ConfigError, Settings, load_settings
from tracejudge.consumer.pipeline import Pipeline, build_judges, build_pipeline
from tracejudge.consumer.runtime import gc_policy
from tracejudge.consumer.runtime.loop import (
    ConsumerRuntime,
    Exports,
    Stage,
    StartupError,
    add_runtime_arguments,
    cannot_connect,
    configure_logging,
    runtime_overrides,
    stage_main,
    suppress_logged,
)
from tracejudge.consumer.runtime.loop import _Export as _Export
from tracejudge.consumer.runtime.offsets import OffsetTracker, Releasable, Ticket
from tracejudge.consumer.runtime.producing import PROCESSING_ERROR, DeadLetterSink, Publisher, ResultSink
from tracejudge.consumer.stages.decoding import (
    DECODE,
    EVALUATE,
    Decoded,
    DecodePool,
    WorkerStartError,
    auto_workers,
    available_cpus,
    decode_one,
)
from tracejudge.metrics.computed import RATIO_METRICS
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError, exception_text
from tracejudge.schemas.formats import otlp, otlp_logs
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef

__all__ = ["Emit", "EvaluationStage", "Exports", "FormatHandler", "RecordProcessor", "StartupError",
           "StreamRunner", "add_arguments", "configure_logging", "main"]

# Topic formats that go through trace assembly: OTLP spans, and OTLP logs carrying their content.
_ASSEMBLED = (*otlp.FORMATS, *otlp_logs.FORMATS)
log = logging.getLogger("tracejudge.run")

# Evaluate, export and publish one record; takes over one reference of the ticket.
Emit = Callable[[EvalRecord, SourceRef, Releasable], None]
# Starts the judges on a record; the future gives the assessments (from any thread).
JudgeHook = Callable[[EvalRecord], "concurrent.futures.Future[list[Assessment]]"]


class FormatHandler(Protocol):
    """Takes over decoding of one format.

    Either raise `RecordError` before touching the ticket (the record is dead-lettered), or own the
    ticket's initial reference: `acquire()` once per record to emit, call `emit(record, source, ticket)`
    for each (possibly later, from another thread), and `release()` the initial reference.
    """

    def __call__(self, payload: bytes, source: SourceRef, ticket: Ticket, emit: Emit) -> None: ...


class RecordProcessor:
    """The per-record path: size check, decode, evaluate, judge, export, publish or dead-letter.

    Holds no Kafka client, so it runs the same under the poll loop and in property-based tests.
    `assembler` (a `TraceAssembler`) takes the records of `otlp_proto`/`otlp_json` topics; the poll
    loop calls `emit_due()` to export the traces it completes. `judge` starts the judges on a record
    and returns a future; the result is exported and published when it resolves, from whatever
    thread resolves it.
    """

    def __init__(self, pipeline: Pipeline, tracker: OffsetTracker, exporter: PrometheusExporter,
                 results: ResultSink, dead_letters: DeadLetterSink, formats: Mapping[str, str], *,
                 max_record_bytes: int, exports: Exports | None = None, assembler: Any = None,
                 judge: JudgeHook | None = None, handlers: Mapping[str, FormatHandler] | None = None) -> None:
        self.pipeline = pipeline
        self.tracker = tracker
        self.exporter = exporter
        self.results = results
        self.dead_letters = dead_letters
        self.formats = dict(formats)
        self.max_record_bytes = max_record_bytes
        self.exports = exports or Exports()
        self.assembler = assembler
        self.judge = judge
        self.handlers = dict(handlers or {})
        # A `DecodePool` taking the single-record formats; records for it gather in `_batch` until
        # `flush()`.
        self.decoder: DecodePool | None = None
        self._batch: list[tuple[Any, SourceRef, _Export, str | None]] = []
        self._observe = exporter.processing.observe
        # `TrustMetrics`: human labels that came with a record compared with its verdicts.
        self.trust: Any = None

    def process(self, tp: TopicPartition, record: Any) -> None:
        """One fetched `ConsumerRecord`. Never raises for anything about the record."""
        started = time.perf_counter()
        ticket = self.tracker.track(tp, record.offset)
        fmt = self.formats.get(record.topic, "auto")
        source = SourceRef(format=fmt, topic=record.topic, partition=record.partition, offset=record.offset)
        value = record.value
        handed_off = queued = False
        try:
            self._check(value)
            handler = self.handlers.get(fmt)
            if handler is not None:
                handed_off = True
                handler(value, source, ticket, self.emit)
            elif fmt in otlp.FORMATS and self.assembler is not None:
                used, groups = otlp.decode(value, fmt)
                handed_off = True
                # The assembler takes one reference per trace the record feeds; ours goes now.
                forced = self.assembler.add(groups, source_format=used, ticket=ticket)
                self.exporter.count_ok(record.topic)
                ticket.release()
                for trace in forced:
                    self.emit_assembled(trace)
            elif fmt in otlp_logs.FORMATS and self.assembler is not None:
                events = otlp_logs.decode(value, fmt)
                handed_off = True
                forced = self.assembler.add(events, source_format=otlp_logs.ENCODING[fmt], ticket=ticket)
                self.exporter.count_ok(record.topic)
                ticket.release()
                for trace in forced:
                    self.emit_assembled(trace)
            elif self.decoder is not None and self.decoder.alive:
                export = self.exports.start(ticket)
                self._batch.append((record, source, export, None if fmt == "auto" else fmt))
                handed_off = queued = True
            else:
                evaluated = self.pipeline.normalise(value, None if fmt == "auto" else fmt)
                if fmt == "auto":
                    source.format = evaluated.source_format
                handed_off = True
                self.emit(evaluated, source, ticket)
        except RecordError as exc:
            if handed_off:
                log.error("%s[%s]@%s: RecordError after its ticket was handed on: %s", record.topic,
                          record.partition, record.offset, exc)
            else:
                self._dead_letter(record, source, exc.reason, exc.message, ticket)
        except Exception as exc:
            # A parser or metric bug: the record is dead-lettered with the traceback logged, the stream
            # goes on.
            log.exception("unexpected error processing %s[%s]@%s", record.topic, record.partition,
                          record.offset)
            if not handed_off:
                self._dead_letter(record, source, PROCESSING_ERROR, exception_text(exc), ticket)
        finally:
            if not queued:  # a worker's record is observed with the worker's time
                self._observe(time.perf_counter() - started)

    def flush(self) -> None:
        """Hand the records `process` queued for the decode workers over, one batch per poll."""
        batch, self._batch = self._batch, []
        if not batch:
            return
        decoder = self.decoder
        if decoder is None or not decoder.submit(batch, [(item[0].value, item[3]) for item in batch]):
            self.decode_here(batch)

    def finish_decoded(self, item: tuple[Any, SourceRef, _Export, str | None], decoded: Decoded) -> None:
        """Export, judge and publish what a decode worker made of one record (its receiver thread).
        Never raises, and never leaves the record's offset held: should finishing fail before the
        export is handed on, the record is dead-lettered."""
        try:
            self._finish_decoded(item, decoded)
        except Exception as exc:
            record, source, export, _ = item
            log.exception("finishing %s[%s]@%s failed", source.topic, source.partition, source.offset)
            if not export.released:
                self.dead_letters.send(source=source, reason=PROCESSING_ERROR, ticket=export,
                                       error=exception_text(exc), value=record.value,
                                       key=record.key, headers=record.headers, timestamp_ms=record.timestamp)

    def _finish_decoded(self, item: tuple[Any, SourceRef, _Export, str | None], decoded: Decoded) -> None:
        if decoded.redo:
            self.decode_here([item])
            return
        record, source, export, _ = item
        self._observe(decoded.seconds)
        if source.format == "auto" and decoded.source_format:
            source.format = decoded.source_format
        if decoded.record is not None:
            result = EvaluationResult(record=decoded.record, source=source, metrics=decoded.metrics or {},
                                      metric_errors=decoded.metric_errors or {})
            self._judge_and_finish(result, export, True)
            return
        where = f"{source.topic}[{source.partition}]@{source.offset}"
        if decoded.traceback:
            log.error("unexpected error %s %s:\n%s", "processing" if decoded.failed_at == DECODE
                      else "evaluating", where, decoded.traceback.rstrip())
        if decoded.failed_at == EVALUATE:
            self.dead_letters.send(source=source, reason=decoded.reason or PROCESSING_ERROR, ticket=export,
                                   error=decoded.message or "", value=None)
        else:
            self.dead_letters.send(source=source, reason=decoded.reason or PROCESSING_ERROR,
                                   error=decoded.message or "", ticket=export, value=record.value,
                                   key=record.key, headers=record.headers, timestamp_ms=record.timestamp)

    def decode_here(self, items: list[tuple[Any, SourceRef, _Export, str | None]]) -> None:
        """Decode handed-over records in this process (no worker left, or a result that could not
        cross the process boundary)."""
        for item in items:
            decoded = decode_one(self.pipeline, item[0].value, item[3])
            self.finish_decoded(item, msgspec.structs.replace(decoded, redo=False))

    def _check(self, value: bytes | None) -> None:
        if value is None:
            raise RecordError(errors.INVALID_RECORD, "the record has no value (a tombstone)")
        if len(value) > self.max_record_bytes:
            raise RecordError(errors.TOO_LARGE, f"{len(value)} bytes, more than stream.max_record_bytes "
                              f"({self.max_record_bytes}); not parsed")

    def emit(self, record: EvalRecord, source: SourceRef, ticket: Releasable, *, count: bool = True) -> None:
        """Evaluate, judge, export metrics and publish; `ticket` is released when the output is acked.
        Never raises: a failure to evaluate dead-letters the record's coordinates."""
        try:
            result = self.pipeline.evaluate(record, source)
        except Exception as exc:
            log.exception("evaluating %s[%s]@%s failed", source.topic, source.partition, source.offset)
            self.dead_letters.send(source=source, reason=PROCESSING_ERROR, ticket=self.exports.start(ticket),
                                   error=exception_text(exc), value=None, count_record=count)
            return
        export = self.exports.start(ticket)
        try:
            self._judge_and_finish(result, export, count)
        except Exception as exc:  # a bug past evaluation must not hold the offset back either
            log.exception("finishing %s[%s]@%s failed", source.topic, source.partition, source.offset)
            if not export.released:
                self.dead_letters.send(source=source, reason=PROCESSING_ERROR, ticket=export, value=None,
                                       error=exception_text(exc), count_record=count)

    def _judge_and_finish(self, result: EvaluationResult, export: _Export, count: bool) -> None:
        if self.judge is None:
            self._finish(result, export, count)
            return
        source = result.source
        try:
            future = self.judge(result.record)
        except Exception:
            log.exception("starting the judges on %s[%s]@%s failed; exporting without assessments",
                          source.topic, source.partition, source.offset)
            self._finish(result, export, count)
            return
        future.add_done_callback(lambda f: self._judged(f, result, export, count))

    def _judged(self, future: concurrent.futures.Future[list[Assessment]], result: EvaluationResult,
                export: _Export, count: bool) -> None:
        try:
            result.assessments.extend(future.result())
        except Exception:
            src = result.source
            log.exception("judging %s[%s]@%s failed; exporting without assessments", src.topic,
                          src.partition, src.offset)
        self._finish(result, export, count)

    def _finish(self, result: EvaluationResult, export: _Export, count: bool) -> None:
        try:
            self.exporter.export(result)
            if count:
                self.exporter.count_ok(result.source.topic or "")
            if self.trust is not None and result.record.human_labels:
                self.trust.observe_result(result)
        except Exception:  # a metrics bug must not hold the offset back
            src = result.source
            log.exception("exporting metrics of %s[%s]@%s failed", src.topic, src.partition, src.offset)
        self.results.publish(result, export)

    def emit_assembled(self, trace: Any) -> None:
        """Export one `AssembledTrace`; its records' tickets are released when its result is acked."""
        tickets = [t for t in trace.tickets if isinstance(t, Ticket)]
        first = min(tickets, key=lambda t: (t.tp.partition, t.offset)) if tickets else None
        source = SourceRef(format=trace.trace.source_format, topic=first.tp.topic if first else None,
                           partition=first.tp.partition if first else None,
                           offset=first.offset if first else None)
        try:
            record = trace.record()
        except RecordError as exc:
            self.dead_letters.send(source=source, reason=exc.reason, error=exc.message, value=None,
                                   ticket=self.exports.start(trace), count_record=False)
            return
        except Exception as exc:
            log.exception("deriving assembled trace %s failed", trace.trace.trace_id)
            self.dead_letters.send(source=source, reason=PROCESSING_ERROR, value=None,
                                   error=exception_text(exc), ticket=self.exports.start(trace),
                                   count_record=False)
            return
        self.emit(record, source, trace, count=False)

    def emit_due(self) -> int:
        """Export the traces assembly has finished (quiet period or maximum wait passed)."""
        assembler = self.assembler
        if assembler is None:
            return 0
        due = assembler.next_due()
        if due is None or due > time.monotonic():
            return 0
        traces = assembler.poll()
        for trace in traces:
            self.emit_assembled(trace)
        return len(traces)

    def discard_assembly(self) -> int:
        """Drop open traces without releasing their records (revocation, shutdown): read again later."""
        return self.assembler.discard() if self.assembler is not None else 0

    def _dead_letter(self, record: Any, source: SourceRef, reason: str, error: str, ticket: Ticket) -> None:
        self.dead_letters.send(source=source, reason=reason, error=error, ticket=self.exports.start(ticket),
                               value=record.value, key=record.key, headers=record.headers,
                               timestamp_ms=record.timestamp)


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
        self.producer: KafkaProducer | None = None
        self.publisher: Publisher | None = None
        self.processor: RecordProcessor | None = None
        self.decoder: DecodePool | None = None
        self._process: Callable[[TopicPartition, Any], None] | None = None
        self.canaries = _build_canaries(judges)
        self.trust: Any = None

    # -- start-up -------------------------------------------------------------------------------------

    def topics(self) -> list[str]:
        return [t.name for t in self.settings.stream.topics]

    def subscription(self) -> str:
        judges = f" (judges: {', '.join(self.judges.judge_names())})" if self.judges else ""
        return ", ".join(map(str, self.settings.stream.topics)) + judges

    def prepare(self, runtime: ConsumerRuntime) -> None:
        if self.decode_workers:
            self.decoder = self._start_decoder(self.decode_workers)
        else:
            log.info("decoding in the consumer process (%s)", self.workers_why)

    def _start_decoder(self, workers: int) -> DecodePool:
        def decoded(item: Any, result: Decoded) -> None:
            assert self.processor is not None
            self.processor.finish_decoded(item, result)

        def lost(items: Any) -> None:
            assert self.processor is not None
            self.processor.decode_here(list(items))

        pool = DecodePool(self.settings, workers, on_decoded=decoded, on_lost=lost,
                          on_worker_lost=self.exporter.decode_workers_lost.inc)
        try:
            pool.start()
        except WorkerStartError as exc:
            raise StartupError(f"{exc} (stream.decode_workers)") from exc
        self.exporter.decode_workers.set_function(pool.live)
        log.info("decode workers ready: %d (%s)", workers, self.workers_why)
        return pool

    def open(self, runtime: ConsumerRuntime) -> None:
        s = self.settings
        started = time.monotonic()
        if s.stream.results_topic or s.stream.dead_letter_topic:
            try:
                self.producer = KafkaProducer(**s.kafka.client_config(), **s.producer.producer_config())
            except Exception as exc:
                raise StartupError(cannot_connect("create the producer", s, exc, started)) from exc
            self.publisher = Publisher(self.producer, retry_backoff=s.producer.retry_backoff_seconds)
        dead_letters = DeadLetterSink(self.publisher, s.stream.dead_letter_topic, self.exporter,
                                      max_request_size=s.producer.max_request_size)
        results = ResultSink(self.publisher, s.stream.results_topic, self.exporter, dead_letters)
        formats = {t.name: t.format for t in s.stream.topics}
        assembler = None
        if any(f in _ASSEMBLED for f in formats.values()):
            from tracejudge.consumer.stages.assembly import TraceAssembler
            from tracejudge.metrics.telemetry.assembly import AssemblyMetrics

            assembler = TraceAssembler(s.otlp.assembly.to_settings(), app_tag=s.stream.app_tag,
                                       session_tag=s.stream.session_tag,
                                       metrics=AssemblyMetrics(registry=self.exporter.registry))
        self.processor = RecordProcessor(self.pipeline, runtime.tracker, self.exporter, results, dead_letters,
                                         formats, max_record_bytes=s.stream.max_record_bytes,
                                         exports=self.exports, assembler=assembler,
                                         judge=self.judges.submit if self.judges else None,
                                         handlers=self.handlers)
        self.processor.decoder = self.decoder
        self.processor.trust = self.trust
        self._process = self.processor.process

    def started(self) -> None:
        if self.tune_gc:
            gc_policy.apply()

    # -- the loop -------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        if self.publisher is not None:
            self.publisher.run_due_retries()
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
        while self.exports.count and time.monotonic() < deadline:
            if self.publisher is not None:
                self.publisher.run_due_retries()
            await sleep(0.01)
        return f"waited for {waited} exports" + (f", {dropped} traces were assembling" if dropped else "")

    def lose(self, tps: set[TopicPartition]) -> None:
        if self.processor is not None:
            self.processor.discard_assembly()

    # -- shutdown -------------------------------------------------------------------------------------

    def stopping(self) -> None:
        if self.processor is not None and (dropped := self.processor.discard_assembly()):
            log.info("stopping: %d traces still assembling are left for re-reading", dropped)

    def drain(self, deadline: float) -> None:
        """Until `deadline`: let exports finish (re-sends run here, as the poll loop is not turning)."""
        while self.exports.count and (left := deadline - time.monotonic()) > 0:
            if self.publisher is not None:
                self.publisher.run_due_retries()
            self.exports.wait_idle(min(0.05, left))

    def close(self) -> None:
        if self.producer is not None:
            with suppress_logged(log, "closing the producer"):
                self.producer.close(timeout=5)
        if self.judges is not None:
            with suppress_logged(log, "closing the judges"):
                self.judges.close()
        if self.decoder is not None:
            with suppress_logged(log, "stopping the decode workers"):
                self.decoder.close()
            self.decoder = None


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
                                                       ratio_metrics=ratio)
        self.judges = None if judges is False else judges or build_judges(
            settings, self.exporter.registry, self.exporter.apps)
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
        return stage.decoder

    @property
    def _processor(self) -> RecordProcessor | None:
        stage = self.stage
        assert isinstance(stage, EvaluationStage)
        return stage.processor


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


def _build_canaries(judges: Any) -> Any:
    """The canaries of `judges.canary` (tracejudge.metrics.judges.trust.canaries), judged by the live judges
    from
    the poll loop's tick; None without judges or a canary section."""
    from tracejudge.metrics.judges.config import JudgeConfigError
    from tracejudge.metrics.judges.trust.canaries import build_canaries

    try:
        return build_canaries(judges) if hasattr(judges, "submit_canary") else None
    except JudgeConfigError as exc:
        raise ConfigError([(exc.key, exc.detail)]) from None


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
    if not any(t.format not in _ASSEMBLED and t.format not in handlers for t in settings.stream.topics):
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


# -- command line ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tracejudge run`; each overrides its configuration key."""
    add_runtime_arguments(
        parser, command="run", config_help="YAML configuration file",
        group=("kafka.group_id", "consumer group (kafka.group_id)"),
        results=("stream.results_topic", "publish one JSON result per record here (stream.results_topic)"),
        dead_letters=("stream.dead_letter_topic",
                      "route undecodable records here (stream.dead_letter_topic)"))
    parser.add_argument("--topic", action="append", dest="topics", metavar="NAME[:FORMAT]",
                        help="topic to consume, repeatable; FORMAT is auto (default), agent_eval, mlflow, "
                             "inference_log, otlp_proto, otlp_json, otlp_logs_proto or otlp_logs_json "
                             "(stream.topics)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {**runtime_overrides(args), "stream.topics": getattr(args, "topics", None)}
    return load_settings(getattr(args, "config", None), overrides=overrides)


def main(args: argparse.Namespace) -> int:
    """Entry point of `tracejudge run`: 0 after a clean stop, 1 when it cannot start, 2 on bad config."""
    return stage_main("run", args, settings_from_args, lambda settings: StreamRunner(settings, tune_gc=True))


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tracejudge run", description=__doc__.splitlines()[0])
    # `tracejudge --log-level X run` has it on the top-level parser.
    _parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (logging.level)")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
