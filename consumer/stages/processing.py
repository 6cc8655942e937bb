"""The per-record path the stages that evaluate share: `tracejudge run` (`consumer/stages/run.py`) and
`tracejudge backfill` (`consumer/stages/backfill.py`). A part of the stages, not a stage.

    RecordProcessor.process ──the topic's route (a table built once)──▶ FormatHandler (custom)
                                                                   ├──▶ TraceAssembler (OTLP spans, logs)
                                                                   └──▶ Decoder (decoding.py: inline or
                                                                        the worker pool) ──▶ finish_decoded
                                         Pipeline.evaluate (+ judges) ──▶ PrometheusExporter.export
                                                                         + ResultSink (or DeadLetterSink)

A route either raises (`RecordError` or a bug) before it takes the record's ticket over, and the record
is dead-lettered, or owns the ticket and never lets an error out. Holds no Kafka client, so it runs the
same under the poll loop and in property-based tests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tracejudge.consumer.pipeline import Pipeline
from tracejudge.consumer.runtime.offsets import Export, Exports, OffsetTracker, Releasable, Ticket
from tracejudge.consumer.runtime.producing import PROCESSING_ERROR, DeadLetterSink, ResultSink
from tracejudge.consumer.stages.decoding import (
    DECODE,
    EVALUATE,
    Decoded,
    Decoder,
    Handed,
    InlineDecoder,
)
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError, exception_text
from tracejudge.schemas.formats import otlp, otlp_logs
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef

__all__ = ["ASSEMBLED", "Emit", "FormatHandler", "JudgeHook", "RecordProcessor"]

# Topic formats that go through trace assembly: OTLP spans, and OTLP logs carrying their content.
ASSEMBLED = (*otlp.FORMATS, *otlp_logs.FORMATS)
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


# How one topic's records are taken: (fetched record, its source, its ticket, when it was taken).
Take = Callable[[Any, SourceRef, Ticket, float], None]


@dataclass(frozen=True)
class Route:
    """The route of one topic's records, chosen once from its format."""

    format: str
    take: Take


class RecordProcessor:
    """The per-record path: size check, decode, evaluate, judge, export, publish or dead-letter.

    `assembler` (a `TraceAssembler`) takes the records of OTLP topics; the poll loop calls `emit_due()`
    to export the traces it completes. `decoder` (an `InlineDecoder` unless given one, e.g. a
    `WorkerPoolDecoder`) takes the single-record formats; `flush()` after each poll. `judge` starts the
    judges on a record and returns a future; the result is exported and published when it resolves,
    from whatever thread resolves it.
    """

    def __init__(self, pipeline: Pipeline, tracker: OffsetTracker, exporter: PrometheusExporter,
                 results: ResultSink, dead_letters: DeadLetterSink, formats: Mapping[str, str], *,
                 max_record_bytes: int, exports: Exports | None = None, assembler: Any = None,
                 judge: JudgeHook | None = None, handlers: Mapping[str, FormatHandler] | None = None,
                 decoder: Decoder | None = None) -> None:
        self.pipeline = pipeline
        self.tracker = tracker
        self.exporter = exporter
        self.results = results
        self.dead_letters = dead_letters
        self.max_record_bytes = max_record_bytes
        self.exports = exports or Exports()
        self.assembler = assembler
        self.judge = judge
        self.handlers = dict(handlers or {})
        self._observe = exporter.processing.observe
        self.decoder: Decoder = decoder or InlineDecoder()
        self.decoder.bind(pipeline, self.finish_decoded, self._observe)
        # `TrustMetrics`: human labels that came with a record compared with its verdicts.
        self.trust: Any = None
        # `ExternalEvaluations` (metrics/telemetry/external.py): other evaluators' verdicts on logs topics.
        self.external: Any = None
        self._routes = {topic: self._route(fmt) for topic, fmt in formats.items()}
        self._default = self._route("auto")

    def _route(self, fmt: str) -> Route:
        handler = self.handlers.get(fmt)
        if handler is not None:
            return Route(fmt, lambda record, source, ticket, started: self._handle(
                handler, record, source, ticket, started))
        if fmt in otlp.FORMATS and self.assembler is not None:
            return Route(fmt, self._assemble_spans)
        if fmt in otlp_logs.FORMATS and self.assembler is not None:
            return Route(fmt, self._assemble_logs)
        detect = None if fmt == "auto" else fmt
        return Route(fmt, lambda record, source, ticket, started: self.decoder.submit(
            Handed(record, source, self.exports.start(ticket), detect, started)))

    def process(self, tp: Any, record: Any) -> None:
        """One fetched `ConsumerRecord`. Never raises for anything about the record."""
        started = time.perf_counter()
        ticket = self.tracker.track(tp, record.offset)
        route = self._routes.get(record.topic, self._default)
        source = SourceRef(format=route.format, topic=record.topic, partition=record.partition,
                           offset=record.offset)
        try:
            self._check(record.value)
            route.take(record, source, ticket, started)
        except RecordError as exc:
            self._dead_letter(source, exc.reason, exc.message, self.exports.start(ticket), record=record)
            self._observe(time.perf_counter() - started)
        except Exception as exc:
            # A parser or metric bug: the record is dead-lettered with the traceback logged, the stream
            # goes on.
            log.exception("unexpected error processing %s[%s]@%s", record.topic, record.partition,
                          record.offset)
            self._dead_letter(source, PROCESSING_ERROR, exception_text(exc), self.exports.start(ticket),
                              record=record)
            self._observe(time.perf_counter() - started)

    def flush(self) -> None:
        """Hand the records of this poll the decoder gathered on (to the decode workers)."""
        self.decoder.flush()

    # -- the routes ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _handed_on(self, source: SourceRef, started: float) -> Iterator[None]:
        """Past this point the ticket is handed on: an error is logged, never dead-lettered again."""
        try:
            yield
        except RecordError as exc:
            log.error("%s[%s]@%s: RecordError after its ticket was handed on: %s", source.topic,
                      source.partition, source.offset, exc)
        except Exception:
            log.exception("unexpected error processing %s[%s]@%s", source.topic, source.partition,
                          source.offset)
        finally:
            self._observe(time.perf_counter() - started)

    def _handle(self, handler: FormatHandler, record: Any, source: SourceRef, ticket: Ticket,
                started: float) -> None:
        with self._handed_on(source, started):
            handler(record.value, source, ticket, self.emit)

    def _assemble_spans(self, record: Any, source: SourceRef, ticket: Ticket, started: float) -> None:
        used, groups = otlp.decode(record.value, source.format)
        self._assemble(groups, used, source, ticket, started)

    def _assemble_logs(self, record: Any, source: SourceRef, ticket: Ticket, started: float) -> None:
        events = otlp_logs.decode(record.value, source.format)
        if self.external is not None:
            self._take_evaluations(record, source, ticket)
        self._assemble(events, otlp_logs.ENCODING[source.format], source, ticket, started)

    def _take_evaluations(self, record: Any, source: SourceRef, ticket: Ticket) -> None:
        """Export the record's `gen_ai.evaluation.result` events of other evaluators; a record with one
        that cannot be read is also dead-lettered (its bytes, reason `invalid_evaluation_event`), while
        its other events and content go on as usual."""
        invalid = self.external.take(record.value, source.format).invalid
        if invalid:
            first = invalid[0]
            more = f" ({len(invalid) - 1} more invalid evaluation events)" if len(invalid) > 1 else ""
            self._dead_letter(source, errors.INVALID_EVALUATION_EVENT, f"{first.where}: {first.detail}{more}",
                              self.exports.start(ticket.acquire()), record=record, count=False)

    def _assemble(self, parts: Any, used: str, source: SourceRef, ticket: Ticket, started: float) -> None:
        with self._handed_on(source, started):
            # The assembler takes one reference per trace the record feeds; ours goes now.
            forced = self.assembler.add(parts, source_format=used, ticket=ticket)
            self.exporter.count_ok(source.topic or "")
            ticket.release()
            for trace in forced:
                self.emit_assembled(trace)

    # -- what a decoder made of a record -------------------------------------------------------------

    def finish_decoded(self, item: Handed, decoded: Decoded) -> None:
        """Export, judge and publish what the decoder made of one record (on the poll thread, or a
        pool's receiver thread). Never raises, and never leaves the record's offset held: should
        finishing fail before the export is handed on, the record is dead-lettered."""
        try:
            self._finish_decoded(item, decoded)
        except Exception as exc:
            record, source, export = item.record, item.source, item.export
            log.exception("finishing %s[%s]@%s failed", source.topic, source.partition, source.offset)
            if not export.released:
                self._dead_letter(source, PROCESSING_ERROR, exception_text(exc), export, record=record)

    def _finish_decoded(self, item: Handed, decoded: Decoded) -> None:
        record, source, export = item.record, item.source, item.export
        if source.format == "auto" and decoded.source_format:
            source.format = decoded.source_format
        result = decoded.result
        if result is not None:
            result.source = source  # the decoder knew the payload only, not where it came from
            self.pipeline.apply_norms(result)
            self._judge_and_finish(result, export, True)
            return
        where = f"{source.topic}[{source.partition}]@{source.offset}"
        if decoded.traceback:
            log.error("unexpected error %s %s:\n%s", "processing" if decoded.failed_at == DECODE
                      else "evaluating", where, decoded.traceback.rstrip())
        if decoded.failed_at == EVALUATE:
            self._dead_letter(source, decoded.reason or PROCESSING_ERROR, decoded.message or "", export)
        else:
            self._dead_letter(source, decoded.reason or PROCESSING_ERROR, decoded.message or "", export,
                              record=record)

    def _check(self, value: bytes | None) -> None:
        if value is None:
            raise RecordError(errors.INVALID_RECORD, "the record has no value (a tombstone)")
        if len(value) > self.max_record_bytes:
            raise RecordError(errors.TOO_LARGE, f"{len(value)} bytes, more than stream.max_record_bytes "
                              f"({self.max_record_bytes}); not parsed")

    # -- evaluate, judge, export, publish ------------------------------------------------------------

    def emit(self, record: EvalRecord, source: SourceRef, ticket: Releasable, *, count: bool = True) -> None:
        """Evaluate, judge, export metrics and publish; `ticket` is released when the output is acked.
        Never raises: a failure to evaluate dead-letters the record's coordinates."""
        try:
            result = self.pipeline.evaluate(record, source)
        except Exception as exc:
            log.exception("evaluating %s[%s]@%s failed", source.topic, source.partition, source.offset)
            self._dead_letter(source, PROCESSING_ERROR, exception_text(exc), self.exports.start(ticket),
                              count=count)
            return
        export = self.exports.start(ticket)
        try:
            self._judge_and_finish(result, export, count)
        except Exception as exc:  # a bug past evaluation must not hold the offset back either
            log.exception("finishing %s[%s]@%s failed", source.topic, source.partition, source.offset)
            if not export.released:
                self._dead_letter(source, PROCESSING_ERROR, exception_text(exc), export, count=count)

    def _judge_and_finish(self, result: EvaluationResult, export: Export, count: bool) -> None:
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
                export: Export, count: bool) -> None:
        try:
            result.assessments.extend(future.result())
        except Exception:
            src = result.source
            log.exception("judging %s[%s]@%s failed; exporting without assessments", src.topic,
                          src.partition, src.offset)
        self._finish(result, export, count)

    def _finish(self, result: EvaluationResult, export: Export, count: bool) -> None:
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

    # -- trace assembly ------------------------------------------------------------------------------

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
            self._dead_letter(source, exc.reason, exc.message, self.exports.start(trace), count=False)
            return
        except Exception as exc:
            log.exception("deriving assembled trace %s failed", trace.trace.trace_id)
            self._dead_letter(source, PROCESSING_ERROR, exception_text(exc), self.exports.start(trace),
                              count=False)
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

    def _dead_letter(self, source: SourceRef, reason: str, error: str, export: Releasable, *,
                     record: Any = None, count: bool = True) -> None:
        """The one way a record leaves this path rejected: with its own bytes, key and headers when
        `record` is the Kafka record that could not be decoded, else (it was read; evaluating or
        publishing it failed, or it is an assembled trace of many records) with its coordinates only."""
        if record is None:
            self.dead_letters.send(source=source, reason=reason, error=error, ticket=export, value=None,
                                   count_record=count)
        else:
            self.dead_letters.send(source=source, reason=reason, error=error, ticket=export,
                                   value=record.value, key=record.key, headers=record.headers,
                                   timestamp_ms=record.timestamp, count_record=count)
