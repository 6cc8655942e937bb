"""`tracejudge run`: consume traces from Kafka, evaluate them, export to Prometheus and a results topic.

    Kafka topics ──poll──▶ RecordProcessor ──▶ Pipeline.normalise ──▶ Pipeline.evaluate
                                │                                           │
                                ▼                                           ▼
                          DeadLetterSink                   PrometheusExporter.export + ResultSink
                                │                                           │
                                └────────── Ticket.release() on broker ack ◀┘
                                                     │
                           OffsetTracker ──lowest incomplete offset──▶ commit (poll loop)

At-least-once: a record's offset is committed only when its ticket is released, i.e. its metrics are
updated and its result (or dead letter) is acknowledged by the broker. Records may complete out of
order (results acked in any order, later asynchronous judges); per partition the commit is the lowest
incomplete offset.

Threads: the poll loop (the caller of `run()`) fetches, processes and commits. kafka-python 3.x runs
rebalance callbacks on its IO thread, where a blocking `commit()` raises, so the listener is an
`AsyncConsumerRebalanceListener` that awaits `commit_async`. Producer acks arrive on the producer's
thread and only release tickets. The HTTP server answers scrapes and probes from its own threads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, Protocol

import msgspec
from kafka import AsyncConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition

from tracejudge.consumer import gc_policy
from tracejudge.consumer.config import ConfigError, LoggingSettings, Settings, load_settings
from tracejudge.consumer.decode_workers import (
    DECODE,
    EVALUATE,
    Decoded,
    DecodePool,
    WorkerStartError,
    auto_workers,
    available_cpus,
    decode_one,
)
from tracejudge.consumer.http_server import OperationsServer
from tracejudge.consumer.log_setup import KAFKA_CONNECTION_LOGS, configure_library_logs
from tracejudge.consumer.offsets import OffsetTracker, Releasable, Ticket
from tracejudge.consumer.pipeline import Pipeline, build_judges, build_pipeline
from tracejudge.consumer.sinks import PROCESSING_ERROR, DeadLetterSink, Publisher, ResultSink
from tracejudge.metrics.computed import RATIO_METRICS
from tracejudge.metrics.prometheus import PrometheusExporter
from tracejudge.schemas import errors, otlp, otlp_logs
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef

__all__ = ["Emit", "FormatHandler", "RecordProcessor", "StartupError", "StreamRunner", "add_arguments",
           "main"]

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


class StartupError(RuntimeError):
    """The runner could not start (broker unreachable, port taken); the message says what to fix."""


class Exports:
    """Records (or assembled traces) being exported: evaluated, maybe being judged, output not yet
    acknowledged by the broker. This work finishes by itself, so a revocation or a shutdown waits for
    it; records parked in trace assembly do not count (they are read again instead). Also the measure
    of the in-flight cap: assembly bounds its own memory."""

    def __init__(self) -> None:
        self._count = 0
        self._waiters = 0
        self._cond = threading.Condition(threading.Lock())

    def start(self, inner: Releasable) -> _Export:
        with self._cond:
            self._count += 1
        return _Export(self, inner)

    def _done(self) -> None:
        with self._cond:
            self._count -= 1
            if self._count == 0 and self._waiters:
                self._cond.notify_all()

    @property
    def count(self) -> int:
        return self._count

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            self._waiters += 1
            try:
                return self._cond.wait_for(lambda: self._count == 0, timeout)
            finally:
                self._waiters -= 1


class _Export:
    __slots__ = ("_exports", "_inner", "_released")

    def __init__(self, exports: Exports, inner: Releasable) -> None:
        self._exports = exports
        self._inner = inner
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            raise RuntimeError("export released twice")
        self._released = True
        self._exports._done()
        self._inner.release()


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
                self._dead_letter(record, source, PROCESSING_ERROR, f"{type(exc).__name__}: {exc}", ticket)
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
                                       error=f"{type(exc).__name__}: {exc}", value=record.value,
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
                                   error=f"{type(exc).__name__}: {exc}", value=None, count_record=count)
            return
        export = self.exports.start(ticket)
        try:
            self._judge_and_finish(result, export, count)
        except Exception as exc:  # a bug past evaluation must not hold the offset back either
            log.exception("finishing %s[%s]@%s failed", source.topic, source.partition, source.offset)
            if not export.released:
                self.dead_letters.send(source=source, reason=PROCESSING_ERROR, ticket=export, value=None,
                                       error=f"{type(exc).__name__}: {exc}", count_record=count)

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
                                   error=f"{type(exc).__name__}: {exc}", ticket=self.exports.start(trace),
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


def _describe(tps: Any) -> str:
    by_topic: dict[str, list[int]] = {}
    for tp in tps:
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    return ", ".join(f"{t}{sorted(p)}" for t, p in sorted(by_topic.items())) or "none"


class _RebalanceListener(AsyncConsumerRebalanceListener):
    # Runs on kafka-python's IO thread while the poll thread is blocked in poll() or close(). An
    # exception here would surface as "User rebalance callback throws an error" from poll(), so
    # every callback logs and swallows.

    def __init__(self, runner: StreamRunner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:  # the first join reports an empty revocation
            try:
                await self.runner._on_revoked(set(revoked))
            except Exception:
                log.exception("handling revoked partitions failed")

    async def on_partitions_assigned(self, assigned: Any) -> None:
        try:
            self.runner._on_assigned(set(assigned))
        except Exception:
            log.exception("handling assigned partitions failed")

    async def on_partitions_lost(self, lost: Any) -> None:
        if lost:
            try:
                self.runner._on_lost(set(lost))
            except Exception:
                log.exception("handling lost partitions failed")


class StreamRunner:
    """Runs the consumer until `stop()` (or the `stop_event` given to `run`) is set.

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
        self.settings = settings
        # The process's collector is ours to tune only when the process is `tracejudge run`.
        self._tune_gc = tune_gc
        self.handlers = dict(handlers or {})
        self._decode_workers, self._workers_why = self._size_decode_workers(pipeline is not None)
        self.pipeline = pipeline or build_pipeline(settings)
        ratio = getattr(getattr(self.pipeline, "metrics", None), "ratio_metrics", RATIO_METRICS)
        self.exporter = exporter or PrometheusExporter(max_apps=settings.prometheus.max_apps,
                                                       ratio_metrics=ratio)
        self.registry = self.exporter.registry
        self.judges = None if judges is False else judges or build_judges(
            settings, self.exporter.registry, self.exporter.apps)
        self.tracker = OffsetTracker()
        self.exports = Exports()
        self.exporter.in_flight.set_function(lambda: self.tracker.in_flight)
        self.http_port: int | None = None
        self.error: BaseException | None = None

        self._stop = threading.Event()
        self._assigned_event = threading.Event()
        self._consumer: KafkaConsumer | None = None
        self._producer: KafkaProducer | None = None
        self._publisher: Publisher | None = None
        self._processor: RecordProcessor | None = None
        self._decoder: DecodePool | None = None
        self._http: OperationsServer | None = None
        self._assigned: frozenset[TopicPartition] = frozenset()
        # Partitions revoked with unfinished records, and where to rewind if they come back to us
        # (kafka-python keeps the in-memory position of a partition re-assigned to the same member).
        self._rewind: dict[TopicPartition, int] = {}
        self._assignment_changed = False
        self._paused_since: float | None = None
        self._closing = False
        self._last_loop: float | None = None
        # Since when the broker has not answered, once that has been reported (`_watch_broker`).
        self._broker_lost_since: float | None = None
        self._thread: threading.Thread | None = None
        self._external_stop: threading.Event | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the runner to stop: it stops fetching, finishes in-flight work within the grace period,
        commits, and leaves the group. Safe from any thread and from signal handlers."""
        self._stop.set()

    def start(self) -> threading.Thread:
        """Run in a daemon thread (for embedding: the demo, tests). Join it after `stop()`; an exception
        that ended it (e.g. `StartupError`) is kept in `.error`."""

        def target() -> None:
            try:
                self.run()
            except BaseException as exc:
                self.error = exc
                log.error("tracejudge run stopped on %s: %s", type(exc).__name__, exc)

        self._thread = threading.Thread(target=target, name="tracejudge-run", daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread started by `start()`; True once it has ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_assigned(self, timeout: float) -> bool:
        """Block until partitions are assigned for the first time; True when they are."""
        return self._assigned_event.wait(timeout)

    @property
    def assignment(self) -> frozenset[TopicPartition]:
        return self._assigned

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Consume until stopped. Raises `StartupError` when the broker or the port is unusable."""
        s = self.settings
        self._external_stop = stop_event
        self._log_effective_config()
        try:
            if self._decode_workers:
                self._decoder = self._start_decoder(self._decode_workers)
            else:
                log.info("decoding in the consumer process (%s)", self._workers_why)
            if s.http.enabled:
                try:
                    self._http = OperationsServer(self.registry, host=s.http.bind_address, port=s.http.port,
                                                  liveness=self.liveness, readiness=self.readiness).start()
                except OSError as exc:
                    raise StartupError(f"cannot serve metrics on {s.http.bind_address}:{s.http.port} "
                                       f"(http.port): {exc.strerror or exc}") from exc
                self.http_port = self._http.port
                log.info("serving /metrics, /healthz, /readyz on http://%s:%d", s.http.bind_address,
                         self.http_port)
            self._processor = self._connect()
            if self._tune_gc:
                gc_policy.apply()
            self._loop(self._processor)
        finally:
            self._shutdown()

    def _size_decode_workers(self, own_pipeline: bool) -> tuple[int, str]:
        """How many decode workers to start (`stream.decode_workers`), and why, for the log."""
        wanted = self.settings.stream.decode_workers
        auto = wanted == "auto"
        if own_pipeline:
            # Decode workers build their own pipeline from the settings: a pipeline given here is not theirs.
            if not auto and wanted:
                log.warning("stream.decode_workers is ignored: the runner was given its own Pipeline")
            return 0, "the runner was given its own Pipeline"
        # OTLP topics go through trace assembly and custom handlers run here: neither uses workers.
        if not any(t.format not in _ASSEMBLED and t.format not in self.handlers
                   for t in self.settings.stream.topics):
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

    def _start_decoder(self, workers: int) -> DecodePool:
        def decoded(item: Any, result: Decoded) -> None:
            assert self._processor is not None
            self._processor.finish_decoded(item, result)

        def lost(items: Any) -> None:
            assert self._processor is not None
            self._processor.decode_here(list(items))

        pool = DecodePool(self.settings, workers, on_decoded=decoded, on_lost=lost,
                          on_worker_lost=self.exporter.decode_workers_lost.inc)
        try:
            pool.start()
        except WorkerStartError as exc:
            raise StartupError(f"{exc} (stream.decode_workers)") from exc
        self.exporter.decode_workers.set_function(pool.live)
        log.info("decode workers ready: %d (%s)", workers, self._workers_why)
        return pool

    def _connect(self) -> RecordProcessor:
        s = self.settings
        servers = ",".join(s.kafka.bootstrap_servers)
        publisher = None
        started = time.monotonic()
        if s.stream.results_topic or s.stream.dead_letter_topic:
            try:
                self._producer = KafkaProducer(**s.kafka.client_config(), **s.producer.producer_config())
            except Exception as exc:
                raise StartupError(_cannot_connect("create the producer", servers,
                                                   s.kafka.bootstrap_timeout_ms, exc, started)) from exc
            publisher = self._publisher = Publisher(self._producer,
                                                    retry_backoff=s.producer.retry_backoff_seconds)
        try:
            self._consumer = KafkaConsumer(**s.kafka.consumer_config())
        except Exception as exc:
            raise StartupError(_cannot_connect("create the consumer", servers,
                                               s.kafka.bootstrap_timeout_ms, exc, started)) from exc
        dead_letters = DeadLetterSink(publisher, s.stream.dead_letter_topic, self.exporter,
                                      max_request_size=s.producer.max_request_size)
        results = ResultSink(publisher, s.stream.results_topic, self.exporter, dead_letters)
        formats = {t.name: t.format for t in s.stream.topics}
        assembler = None
        if any(f in _ASSEMBLED for f in formats.values()):
            from tracejudge.consumer.assembly import TraceAssembler
            from tracejudge.metrics.assembly_metrics import AssemblyMetrics

            assembler = TraceAssembler(s.otlp.assembly.to_settings(), app_tag=s.stream.app_tag,
                                       metrics=AssemblyMetrics(registry=self.registry))
        processor = RecordProcessor(self.pipeline, self.tracker, self.exporter, results, dead_letters,
                                    formats, max_record_bytes=s.stream.max_record_bytes, exports=self.exports,
                                    assembler=assembler, judge=self.judges.submit if self.judges else None,
                                    handlers=self.handlers)
        processor.decoder = self._decoder
        self._consumer.subscribe(topics=list(formats), listener=_RebalanceListener(self))
        log.info("subscribed to %s as group %r%s; waiting for partitions",
                 ", ".join(map(str, s.stream.topics)), s.kafka.group_id,
                 f" (judges: {', '.join(self.judges.judge_names())})" if self.judges else "")
        return processor

    def _loop(self, processor: RecordProcessor) -> None:
        s = self.settings.stream
        consumer = self._consumer
        assert consumer is not None
        publisher = self._publisher
        exports = self.exports
        process, flush = processor.process, processor.flush
        max_in_flight = s.max_in_flight
        max_poll = self.settings.kafka.max_poll_records
        commit_every = s.commit_interval_ms / 1000
        lag_every = s.lag_interval_seconds
        next_commit = next_lag = time.monotonic()
        external = self._external_stop
        while not self._stop.is_set():
            if external is not None and external.is_set():
                break
            now = self._last_loop = time.monotonic()
            if publisher is not None:
                publisher.run_due_retries()
            processor.emit_due()
            room = max_in_flight - exports.count
            self._backpressure(consumer, paused=room <= 0, now=now)
            batch = consumer.poll(timeout_ms=s.poll_timeout_ms if room > 0 else 20,
                                  max_records=max(1, min(max_poll, room)))
            for tp, records in batch.items():
                for record in records:
                    process(tp, record)
            flush()
            now = time.monotonic()
            if now >= next_commit:
                self._commit()
                next_commit = now + commit_every
            if now >= next_lag:
                self._update_lag(consumer)
                self._watch_broker(consumer, now)
                next_lag = now + lag_every

    def _backpressure(self, consumer: KafkaConsumer, *, paused: bool, now: float) -> None:
        # Pause and resume ALL assigned partitions together: pausing a subset can starve a partition
        # for good in kafka-python 3.0.12 (fetcher bug). Re-checked every turn because a rebalance
        # brings new, unpaused partitions and keeps the paused flag of retained ones.
        if paused:
            if self._paused_since is None:
                self._paused_since = now
                self.exporter.backpressure_pauses.inc()
                log.info("in-flight cap reached (%d exports, stream.max_in_flight); pausing fetches",
                         self.exports.count)
            if consumer.assignment() - consumer.paused():
                consumer.pause(*consumer.assignment())
        elif self._paused_since is not None or self._assignment_changed:
            if self._paused_since is not None:
                self.exporter.backpressure_seconds.inc(now - self._paused_since)
                self._paused_since = None
            self._assignment_changed = False
            if consumer.paused():
                consumer.resume(*consumer.paused())

    def _commit(self) -> None:
        consumer = self._consumer
        offsets = self.tracker.committable()
        if consumer is None or not offsets:
            return
        try:
            consumer.commit(offsets, timeout_ms=self.settings.kafka.commit_timeout_ms)
        except Exception as exc:
            self.exporter.commit_failures.inc()
            # While the broker is reported unreachable, each retry's failure is no news.
            log.log(logging.DEBUG if self._broker_lost_since is not None else logging.WARNING,
                    "offset commit failed (%s: %s); the records are re-delivered unless a later "
                    "commit succeeds: %s", type(exc).__name__, exc, _describe(offsets))
            return
        self.tracker.mark_committed(offsets)
        self.exporter.commits.inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("committed %s", {f"{tp.topic}[{tp.partition}]": o.offset for tp, o in offsets.items()})

    def _watch_broker(self, consumer: KafkaConsumer, now: float) -> None:
        """One line when the group coordinator has not answered a heartbeat for longer than the session
        timeout and kafka-python has lost it (it retries meanwhile; its own lines about it are at DEBUG,
        see `consumer/log_setup.py`), and one when it answers again. (A slow rebalance also pauses
        heartbeats, but the coordinator stays known.)"""
        age = _heartbeat_age(consumer)
        if age is None:
            return
        limit = self.settings.kafka.session_timeout_ms / 1000
        servers = ",".join(self.settings.kafka.bootstrap_servers)
        if self._broker_lost_since is None:
            if age > limit and not _coordinator_known(consumer) and not self._stop.is_set():
                self._broker_lost_since = now - age
                cause = KAFKA_CONNECTION_LOGS.last_error(since=now - age)
                log.warning("Kafka at %s (kafka.bootstrap_servers) has not answered for %.0f s (more than "
                            "kafka.session_timeout_ms)%s; retrying until it answers, consuming and "
                            "committing nothing meanwhile (kafka-python's detail with --log-level DEBUG)",
                            servers, age, f"; last error: {cause}" if cause else "")
        elif age <= limit:
            log.info("Kafka at %s answers again, after %.0f s", servers, now - self._broker_lost_since)
            self._broker_lost_since = None

    def _update_lag(self, consumer: KafkaConsumer) -> None:
        for tp in consumer.assignment():
            try:
                high = consumer.highwater(tp)
                if high is None:
                    continue
                position = consumer.position(tp, timeout_ms=0)
            except Exception:  # revoked between assignment() and here, or no position yet
                continue
            # position() can run a rebalance (and our listener) inside it: set only what is still ours.
            if position is not None and tp in self._assigned:
                self.exporter.set_lag(tp.topic, tp.partition, max(0, high - position))

    def _drain(self, deadline: float) -> None:
        """Until `deadline`: let exports finish (re-sends run here, as the poll loop is not turning)."""
        while self.exports.count and (left := deadline - time.monotonic()) > 0:
            if self._publisher is not None:
                self._publisher.run_due_retries()
            self.exports.wait_idle(min(0.05, left))

    def _shutdown(self) -> None:
        s = self.settings
        consumer, producer = self._consumer, self._producer
        self._stop.set()
        try:
            if consumer is not None:
                with _suppress_logged("pausing fetches"):
                    if consumer.assignment():
                        consumer.pause(*consumer.assignment())
                if self._processor is not None and (dropped := self._processor.discard_assembly()):
                    log.info("stopping: %d traces still assembling are left for re-reading", dropped)
                if self.exports.count:
                    log.info("stopping: waiting up to %.1f s (stream.shutdown_grace_seconds) for %d "
                             "exports in flight", s.stream.shutdown_grace_seconds, self.exports.count)
                self._drain(time.monotonic() + s.stream.shutdown_grace_seconds)
                self._commit()
                unfinished = self.tracker.incomplete()
                if unfinished:
                    self.exporter.revoked_unfinished.inc(sum(unfinished.values()))
                    log.warning("stopping with %d records unfinished; they will be re-delivered: %s",
                                sum(unfinished.values()), _describe(unfinished))
                self._closing = True
                with _suppress_logged("closing the consumer"):
                    # Runs the listener's on_partitions_revoked (a last commit) and leaves the group.
                    consumer.close(autocommit=False, timeout_ms=s.kafka.commit_timeout_ms)
            if producer is not None:
                with _suppress_logged("closing the producer"):
                    producer.close(timeout=5)
            if self.judges is not None:
                with _suppress_logged("closing the judges"):
                    self.judges.close()
        finally:
            if self._decoder is not None:
                self._decoder.close()
                self._decoder = None
            if self._http is not None:
                self._http.stop()
                self._http = None
            log.info("stopped")

    # -- rebalance (kafka IO thread, while the poll thread is blocked in poll() or close()) ------------

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        consumer = self._consumer
        assert consumer is not None
        tracker = self.tracker
        processor = self._processor
        # Traces still assembling would need the poll loop to complete: give them up, their records
        # are read again by whoever owns the partitions next.
        dropped = processor.discard_assembly() if processor is not None else 0
        grace = 0.0 if self._closing else self.settings.stream.shutdown_grace_seconds
        deadline = time.monotonic() + grace
        waited = self.exports.count
        while self.exports.count and time.monotonic() < deadline:
            if self._publisher is not None:
                self._publisher.run_due_retries()
            await _io_sleep(consumer, 0.01)
        offsets = tracker.committable(revoked)
        if offsets:
            try:
                await consumer.commit_async(offsets)
            except Exception as exc:
                self.exporter.commit_failures.inc()
                log.warning("commit on revocation failed (%s: %s); those records are re-delivered",
                            type(exc).__name__, exc)
            else:
                tracker.mark_committed(offsets)
                self.exporter.commits.inc()
        left = tracker.in_flight_for(revoked)
        unfinished = tracker.revoke(revoked)
        if unfinished:
            self.exporter.revoked_unfinished.inc(left)
            self._rewind.update(unfinished)
            log.warning("%d records of revoked partitions unfinished (%d traces were assembling); "
                        "re-delivered from %s", left, dropped,
                        {f"{tp.topic}[{tp.partition}]": o for tp, o in unfinished.items()})
        self._drop_partitions(revoked, "revoked")
        committed = {f"{tp.topic}[{tp.partition}]": om.offset for tp, om in offsets.items()}
        log.info("partitions revoked: %s (waited for %d exports; committed %s)",
                 _describe(revoked), waited, committed or "nothing new")

    def _on_lost(self, lost: set[TopicPartition]) -> None:
        # The group already gave them to someone else: committing would fail; the new owner re-reads
        # from the last commit.
        if self._processor is not None:
            self._processor.discard_assembly()
        left = self.tracker.in_flight_for(lost)
        unfinished = self.tracker.revoke(lost)
        if unfinished:
            self.exporter.revoked_unfinished.inc(left)
            self._rewind.update(unfinished)
        self._drop_partitions(lost, "lost")
        log.warning("partitions lost (session expired or fenced): %s; %d unfinished records will be "
                    "re-delivered", _describe(lost), left)

    def _drop_partitions(self, tps: set[TopicPartition], event: str) -> None:
        self._assigned = self._assigned - tps
        for tp in tps:
            self.exporter.remove_lag(tp.topic, tp.partition)
        self.exporter.rebalances.labels(event).inc()
        self.exporter.assigned_partitions.set(len(self._assigned))
        self._assignment_changed = True

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        consumer = self._consumer
        assert consumer is not None
        for tp in assigned:
            offset = self._rewind.pop(tp, None)
            if offset is not None:
                # Ours again, but its unfinished records were given up on: read them again.
                consumer.seek(tp, offset)
                log.info("re-reading %s[%d] from offset %d (unfinished when revoked)", tp.topic, tp.partition,
                         offset)
        self._assigned = self._assigned | assigned
        self.exporter.rebalances.labels("assigned").inc()
        self.exporter.assigned_partitions.set(len(self._assigned))
        self._assignment_changed = True
        log.info("partitions assigned: %s (now %d)", _describe(assigned) if assigned else "none",
                 len(self._assigned))
        if self._assigned:
            self._assigned_event.set()

    # -- health ---------------------------------------------------------------------------------------

    def liveness(self) -> tuple[bool, str]:
        last = self._last_loop
        if last is None:
            return True, "starting"
        age = time.monotonic() - last
        limit = self.settings.kafka.max_poll_interval_ms / 1000
        if age > limit and not self._stop.is_set():
            return False, f"poll loop stalled for {age:.0f} s (more than kafka.max_poll_interval_ms)"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        if self._stop.is_set():
            return False, "stopping"
        if self._consumer is None:
            return False, "connecting to Kafka"
        if not self._assigned:
            return False, "no partitions assigned (joining the group, or more consumers than partitions)"
        age = _heartbeat_age(self._consumer)
        limit = self.settings.kafka.session_timeout_ms / 1000
        if age is not None and age > limit:
            return False, f"broker unreachable: no heartbeat answered for {age:.0f} s"
        return True, f"ok: {len(self._assigned)} partitions assigned"

    def _log_effective_config(self) -> None:
        lines = [f"  {k} = {v}" for k, v in self.settings.redacted().items() if v is not None]
        log.info("starting tracejudge run with (unset keys omitted, secrets redacted):\n%s", "\n".join(lines))


async def _io_sleep(consumer: KafkaConsumer, seconds: float) -> None:
    # Yield to kafka-python's event loop (heartbeats keep flowing) instead of blocking its thread.
    net = getattr(consumer, "_net", None)
    if net is not None and hasattr(net, "sleep"):
        await net.sleep(seconds)
    else:  # pragma: no cover - other kafka-python versions
        time.sleep(seconds)


def _cannot_connect(what: str, servers: str, timeout_ms: int, exc: BaseException, started: float) -> str:
    """The one line that says why `tracejudge run` could not start on Kafka."""
    if isinstance(exc, KafkaTimeoutError):  # no bootstrap server answered in time
        cause = KAFKA_CONNECTION_LOGS.last_error(since=started)
        return (f"cannot reach Kafka at {servers} (kafka.bootstrap_servers): no broker answered within "
                f"{timeout_ms / 1000:g} s (kafka.bootstrap_timeout_ms)"
                + (f"; last error: {cause}" if cause else ""))
    text, name = str(exc), type(exc).__name__
    return f"cannot {what} for Kafka at {servers} (kafka.bootstrap_servers): " + (
        text if text.startswith(name) else f"{name}: {text}")


def _coordinator_known(consumer: KafkaConsumer) -> bool:
    """Whether kafka-python still has a group coordinator (it forgets it when the broker is lost);
    False when this kafka-python does not say."""
    coordinator = getattr(consumer, "_coordinator", None)
    return getattr(coordinator, "coordinator_id", None) is not None


def _heartbeat_age(consumer: KafkaConsumer) -> float | None:
    """Seconds since the group coordinator last answered a heartbeat, when kafka-python exposes it."""
    heartbeat = getattr(getattr(consumer, "_coordinator", None), "heartbeat", None)
    last = getattr(heartbeat, "last_receive", None)
    if not isinstance(last, float) or last == float("-inf"):
        return None
    return time.monotonic() - last


class _suppress_logged:
    """Shutdown steps: log a failure and go on to the next step."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and isinstance(exc, Exception):
            log.warning("%s failed: %s: %s", self.what, type(exc).__name__, exc)
            return True
        return False


# -- command line ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tracejudge run`; each overrides its configuration key."""
    parser.add_argument("--config", metavar="FILE", help="YAML configuration file")
    parser.add_argument("--bootstrap-servers", metavar="HOST:PORT[,...]",
                        help="Kafka brokers (kafka.bootstrap_servers)")
    parser.add_argument("--topic", action="append", dest="topics", metavar="NAME[:FORMAT]",
                        help="topic to consume, repeatable; FORMAT is auto (default), agent_eval, mlflow, "
                             "inference_log, otlp_proto, otlp_json, otlp_logs_proto or otlp_logs_json "
                             "(stream.topics)")
    parser.add_argument("--group-id", help="consumer group (kafka.group_id)")
    parser.add_argument("--results-topic",
                        help="publish one JSON result per record here (stream.results_topic)")
    parser.add_argument("--dead-letter-topic",
                        help="route undecodable records here (stream.dead_letter_topic)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="port of /metrics, /healthz, /readyz (http.port, default 9464)")
    parser.add_argument("--metrics-bind-address", metavar="ADDR", help="bind address (http.bind_address)")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the configuration, print it (secrets redacted) and exit")


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {
        "kafka.bootstrap_servers": getattr(args, "bootstrap_servers", None),
        "kafka.group_id": getattr(args, "group_id", None),
        "stream.topics": getattr(args, "topics", None),
        "stream.results_topic": getattr(args, "results_topic", None),
        "stream.dead_letter_topic": getattr(args, "dead_letter_topic", None),
        "http.port": getattr(args, "metrics_port", None),
        "http.bind_address": getattr(args, "metrics_bind_address", None),
        "logging.level": getattr(args, "log_level", None),
    }
    return load_settings(getattr(args, "config", None), overrides=overrides)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(settings: LoggingSettings) -> None:
    """Root logging for the process: a stderr handler unless one is configured already (the
    `tracejudge` command's), JSON lines when `logging.format` says so, and `logging.level`."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    if settings.format == "json":
        for handler in root.handlers:
            handler.setFormatter(_JsonFormatter())
    root.setLevel(settings.level)
    # httpx's line per judge call, kafka-python's narration and its connection failures: DEBUG only.
    configure_library_logs(settings.level)


def main(args: argparse.Namespace) -> int:
    """Entry point of `tracejudge run`: 0 after a clean stop, 1 when it cannot start, 2 on bad config."""
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"tracejudge run: {exc.report()}", file=sys.stderr)
        return 2
    configure_logging(settings.logging)
    if getattr(args, "check_config", False):
        for key, value in settings.redacted().items():
            print(f"{key} = {json.dumps(value)}")
        return 0
    try:
        runner = StreamRunner(settings, tune_gc=True)
    except ConfigError as exc:
        print(f"tracejudge run: {exc.report()}", file=sys.stderr)
        return 2
    signals = {"n": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            log.error("second %s: exiting now without committing", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s received: stopping", signal.Signals(signum).name)
        runner.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        runner.run()
    except StartupError as exc:
        log.error("%s; exiting with status 1", exc)
        return 1
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tracejudge run", description=__doc__.splitlines()[0])
    # `tracejudge --log-level X run` has it on the top-level parser.
    _parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (logging.level)")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
