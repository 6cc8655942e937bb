"""Trace assembly: OTLP spans arriving over many records -> whole traces.

The Collector's Kafka exporter writes export batches, not traces: one record mixes spans of many
traces, and one trace's spans arrive over many records (on one partition with
`partition_traces_by_id`, but still never in one record). `TraceAssembler` buffers spans by trace id
and emits a trace

- `complete` once its root span has arrived and no new span came for `quiet_period_s` (a span whose
  parent is remote, a service's entry span, counts as the root: the trace's real root may live in
  an uninstrumented gateway and never arrive);
- `timeout` (flagged `Trace.complete=False`) when `max_wait_s` has passed since its first span;
- `evicted` (incomplete) when the open-trace or held-span cap forces the oldest trace out;
- `flushed` (incomplete) at the end of a finite input, for traces whose root never came.

Spans of a trace that was already emitted are dropped and counted as late: evaluating the fragment
would score a request-less partial trace a second time.

At-least-once across assembly. Every record is tracked by a ticket (the runner's offset tracker):
`add()` calls `ticket.acquire()` once per open trace the record added spans to, and an emitted
`AssembledTrace` carries the tickets of every record that contributed to it. The runner releases them
(`AssembledTrace.release()`) after the trace's result is exported, so a record's offset becomes
committable only when every trace it touched has been exported.

On partition revocation and shutdown the runner calls `discard()`: open traces are dropped WITHOUT
releasing their tickets, so their records stay uncommitted and the next owner (or this process after
a restart) reads them again and assembles the traces whole. Emitting them as incomplete instead would
commit those offsets and turn every trace in flight at a rebalance into a permanent partial result.

Time comes from an injectable clock (monotonic seconds): arrival time, not span timestamps, decides
quiet periods, so skewed producer clocks cannot hold traces or release them early. Not thread-safe:
one assembler belongs to one consumer loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tracejudge.consumer.config import AssemblySettings  # the `otlp.assembly` section
from tracejudge.metrics.telemetry.assembly import (
    REASON_COMPLETE,
    REASON_EVICTED,
    REASON_FLUSHED,
    REASON_TIMEOUT,
    AssemblyMetrics,
)
from tracejudge.schemas.formats import otlp, otlp_logs
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.otlp import REMOTE_PARENT_KEY, SpanGroup
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.trace import Span, Trace


class Ticket(Protocol):
    """A record's completion count (`tracejudge.consumer.runtime.offsets`): one reference per pending
    piece."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


@dataclass(slots=True)
class AssembledTrace:
    """A trace leaving assembly, with the tickets of every record that contributed spans to it."""

    trace: Trace
    reason: str
    tickets: list[Ticket] = field(default_factory=list)

    def release(self) -> None:
        """Call once the trace's result is exported: the records' offsets may then be committed."""
        tickets, self.tickets = self.tickets, []
        for ticket in tickets:
            ticket.release()

    def record(self) -> EvalRecord:
        return derive(self.trace)


class _OpenTrace:
    __slots__ = ("app", "events", "first_at", "has_root", "last_at", "service", "source_format", "spans",
                 "tickets", "trace_id", "versions")

    def __init__(self, trace_id: str, source_format: str, now: float) -> None:
        self.trace_id = trace_id
        self.source_format = source_format
        self.spans: list[Span] = []
        # Content log records (`otlp_logs.SpanEvent`) for this trace's spans, from a logs topic.
        self.events: list[Any] = []
        self.tickets: list[Ticket] = []
        self.has_root = False
        self.app: str | None = None  # service.name of the root span's resource
        self.service: str | None = None  # first service seen: the app while the root is missing
        # service.name -> the first service.version its resources (spans or content logs) state: the
        # app's version is its service's, never another service's.
        self.versions: dict[str | None, str] = {}
        self.first_at = now
        self.last_at = now


class TraceAssembler:
    """Buffers `SpanGroup`s by trace id and emits `AssembledTrace`s; see the module docstring."""

    def __init__(self, settings: AssemblySettings | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 metrics: AssemblyMetrics | None = None, app_tag: str | None = None,
                 session_tag: str | None = None, version_tag: str | None = None) -> None:
        self.settings = settings or AssemblySettings()
        self.app_tag = app_tag
        self.session_tag = session_tag
        self.version_tag = version_tag
        self._clock = clock
        self._metrics = metrics
        # Insertion order = first arrival: the front is the oldest (max-wait and eviction order).
        self._open: dict[str, _OpenTrace] = {}
        # Rooted traces only, ordered by last arrival: the front is the first to go quiet.
        self._quiet: dict[str, _OpenTrace] = {}
        self._emitted: dict[str, None] = {}  # FIFO of recently emitted trace ids
        self._held = 0

    @property
    def open_traces(self) -> int:
        return len(self._open)

    @property
    def spans_held(self) -> int:
        return self._held

    def add(self, groups: Iterable[SpanGroup | otlp_logs.EventGroup], *, source_format: str,
            ticket: Ticket | None = None) -> list[AssembledTrace]:
        """Add one record's span groups (or, from a logs topic, its content events: they count
        toward the caps like spans). Returns the traces a cap forced out (export them too)."""
        now = self._clock()
        settings = self.settings
        touched: set[str] = set()
        received = late = 0
        for group in groups:
            trace_id = group.trace_id
            spans: list[Span] = getattr(group, "spans", [])
            events = getattr(group, "events", None)
            items = len(spans) if events is None else len(events)
            received += len(spans)
            if trace_id is None:  # content events naming no trace or span: nothing to join
                self._count_unplaced(items)
                continue
            entry = self._open.get(trace_id)
            if entry is None:
                if trace_id in self._emitted:
                    late += items
                    continue
                entry = self._open[trace_id] = _OpenTrace(trace_id, source_format, now)
            if events is not None:
                entry.events.extend(events)
            entry.spans.extend(spans)
            self._held += items
            entry.last_at = now
            if entry.service is None:
                entry.service = group.service
            if group.version is not None and group.service not in entry.versions:
                entry.versions[group.service] = group.version
            if not entry.has_root and any(s.parent_id is None or REMOTE_PARENT_KEY in s.attributes
                                          for s in spans):
                entry.has_root = True
                entry.app = group.service
            if entry.has_root:
                # Re-insert: the quiet queue stays ordered by last arrival.
                self._quiet.pop(trace_id, None)
                self._quiet[trace_id] = entry
            if ticket is not None and trace_id not in touched:
                touched.add(trace_id)
                ticket.acquire()
                entry.tickets.append(ticket)
        out: list[AssembledTrace] = []
        while len(self._open) > settings.max_open_traces or self._held > settings.max_spans_held:
            oldest = next(iter(self._open.values()))
            out.append(self._emit(oldest, REASON_EVICTED, complete=False))
        if self._metrics is not None:
            self._metrics.spans.inc(received)
            if late:
                self._metrics.late_spans.inc(late)
            self._update_gauges()
        return out

    def poll(self, now: float | None = None) -> list[AssembledTrace]:
        """Emit the traces that are due: quiet after their root (`complete`), or past `max_wait_s`."""
        now = self._clock() if now is None else now
        max_wait, quiet = self.settings.max_wait_s, self.settings.quiet_period_s
        timed_out = []
        for entry in self._open.values():
            if now - entry.first_at < max_wait:
                break
            timed_out.append(entry)
        out = [self._emit(e, REASON_TIMEOUT, complete=False) for e in timed_out]
        done = []
        for entry in self._quiet.values():
            if now - entry.last_at < quiet:
                break
            done.append(entry)
        out.extend(self._emit(e, REASON_COMPLETE, complete=True) for e in done)
        if out and self._metrics is not None:
            self._update_gauges()
        return out

    def next_due(self) -> float | None:
        """Clock time at which `poll()` may next emit something (None when nothing is open)."""
        due = [e.first_at + self.settings.max_wait_s for e in self._first(self._open)]
        due += [e.last_at + self.settings.quiet_period_s for e in self._first(self._quiet)]
        return min(due) if due else None

    def flush(self) -> list[AssembledTrace]:
        """End of a finite input: emit everything; rooted traces are as complete as they will get."""
        out = [self._emit(e, REASON_COMPLETE, complete=True) if e.has_root
               else self._emit(e, REASON_FLUSHED, complete=False)
               for e in list(self._open.values())]
        if self._metrics is not None:
            self._update_gauges()
        return out

    def discard(self) -> int:
        """Drop every open trace WITHOUT releasing its tickets (partition revocation, shutdown).

        Their records stay uncommitted and are read again from the lowest unfinished offset, by the
        next owner or by this consumer (the runner seeks back when the partitions return to it).
        Emitted trace ids are remembered across a discard: a re-read record may also carry spans of a
        trace already emitted, whose export finishes on its own; those spans are dropped as late
        instead of becoming a second, partial copy of the trace.

        All open traces go, whatever partition their records came from: kafka-python's default
        assignors are eager, so a rebalance revokes every partition at once.
        """
        dropped = len(self._open)
        self._open.clear()
        self._quiet.clear()
        self._held = 0
        if self._metrics is not None:
            self._metrics.discarded.inc(dropped)
            self._update_gauges()
        return dropped

    @staticmethod
    def _first(d: dict[str, _OpenTrace]) -> list[_OpenTrace]:
        return [next(iter(d.values()))] if d else []

    def _emit(self, entry: _OpenTrace, reason: str, *, complete: bool) -> AssembledTrace:
        trace_id = entry.trace_id
        del self._open[trace_id]
        self._quiet.pop(trace_id, None)
        self._held -= len(entry.spans) + len(entry.events)
        self._emitted[trace_id] = None
        if len(self._emitted) > self.settings.remember_emitted:
            del self._emitted[next(iter(self._emitted))]
        if entry.events:
            span_ids = {s.span_id for s in entry.spans}
            self._count_unplaced(sum(1 for e in entry.events if e.span_id not in span_ids))
        service = entry.app if entry.has_root else entry.service
        trace = otlp.build_trace(trace_id, entry.spans, source_format=entry.source_format,
                                 app=service, complete=complete,
                                 app_tag=self.app_tag, events=entry.events, session_tag=self.session_tag,
                                 version=entry.versions.get(service), version_tag=self.version_tag)
        if self._metrics is not None:
            self._metrics.emitted.labels(reason).inc()
        return AssembledTrace(trace, reason, entry.tickets)

    def _count_unplaced(self, n: int) -> None:
        if n and self._metrics is not None:
            self._metrics.log_events_unplaced.inc(n)

    def _update_gauges(self) -> None:
        assert self._metrics is not None
        self._metrics.open_traces.set(len(self._open))
        self._metrics.spans_held.set(self._held)


# --- files ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _LineTicket:
    """Remembers where a trace's spans came from in a file; files need no commit tracking."""

    line: int

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass


@dataclass(slots=True)
class FileTrace:
    """An assembled trace from a file: `line` is the first line holding one of its spans."""

    trace: Trace
    line: int
    reason: str

    def record(self) -> EvalRecord:
        return derive(self.trace)


class OtlpLineAssembler:
    """`tracejudge eval` over OTLP/JSON lines (`{"resourceSpans": ...}`, one export request a line).

    A file has no arrival times, so traces leave on the caps (`evicted`) or at `finish()`; a bad line
    raises `tracejudge.schemas.errors.RecordError` and adds nothing, the others keep assembling.

        assembler = OtlpLineAssembler()
        for lineno, line in lines:
            for t in assembler.feed(line, lineno): emit(t.record(), line=t.line)
        for t in assembler.finish(): emit(t.record(), line=t.line)
    """

    def __init__(self, settings: AssemblySettings | None = None,
                 metrics: AssemblyMetrics | None = None, app_tag: str | None = None,
                 session_tag: str | None = None, version_tag: str | None = None) -> None:
        self._assembler = TraceAssembler(settings, clock=lambda: 0.0, metrics=metrics, app_tag=app_tag,
                                         session_tag=session_tag, version_tag=version_tag)

    def feed(self, payload: bytes | str | dict[str, Any], line: int) -> list[FileTrace]:
        """One line: an OTLP/JSON trace request, or a logs request whose content events belong to
        the spans of the same file (`resourceLogs`)."""
        # RecordError: the caller names the file and line.
        if otlp.looks_like_otlp_logs_json(payload):
            groups: list[Any] = otlp_logs.decode_json(payload)
        else:
            groups = otlp.decode_json(payload)
        return self._out(self._assembler.add(groups, source_format=otlp.FORMAT_JSON,
                                             ticket=_LineTicket(line)))

    def finish(self) -> list[FileTrace]:
        return self._out(self._assembler.flush())

    @staticmethod
    def _out(traces: list[AssembledTrace]) -> list[FileTrace]:
        return [FileTrace(t.trace, min(tk.line for tk in t.tickets if isinstance(tk, _LineTicket)), t.reason)
                for t in traces]
