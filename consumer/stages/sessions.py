"""`tracejudge sessions`: gather the turns of each conversation from the trace results, close it when
it goes quiet, evaluate it as a whole, publish one session result.

A stage on the consumer runtime (`consumer/runtime/loop.py`), consumer group `tracejudge-sessions` unless
`sessions.group_id` says otherwise:

    trace results ──poll──▶ SessionStage.process: `decode_turn` (only the fields a session needs)
    (sessions.input_topic,        │  not a result / newer schema ──▶ dead-letter topic (counted)
     default stream.results_topic)│  no session id, a session line, a duplicate ──▶ ticket released
                                  ▼
            Sessionizer: per partition, open sessions by id, turns in timestamp order, stream time
                                  │ close: quiet for inactivity_s (stream time or wall clock) -> complete;
                                  │        max_turns / max_duration_s / a memory cap -> incomplete
                                  ▼
            session_metrics + SessionJudgeRunner ──▶ SessionResult ──▶ sessions.results_topic
                                                                          │ broker ack
                                        every turn's ticket released ◀────┘ ──▶ commit (runtime)

Why it works on one partition at a time: `tracejudge run` keys the result of a turn by its session
key, so every turn of a session lands on one partition of the results topic (the results topic is
the repartition topic). State is per partition: a revoked partition's sessions are dropped.

Closing. A session is due when its partition's stream time (the latest turn time seen on the
partition; turns placed by arrival do not move it) is `inactivity_s` past the session's last turn,
or when `inactivity_s` of wall clock have passed since its last turn arrived (a quiet partition
still closes its sessions). At `max_turns` turns, or once its turns span `max_duration_s`, it is
closed at once as incomplete. Past a memory cap (`max_open_sessions`, `max_turns_held`,
`max_bytes_held`; bytes are estimated from the texts' lengths plus `TURN_OVERHEAD_BYTES` a turn)
remembered closed sessions are forgotten first, then the least recently active open sessions are
closed early (`close_reason` evicted), each counted by the cap that caused it.

Reopening. A session closed as complete is remembered with its turns (the `max_closed_sessions`
most recent, within the memory caps). A turn for it reopens it: the earlier turns and the new ones
are gathered again and the next result says `evaluation` n+1 (it replaces the earlier one). A
session closed incomplete is not remembered (that would undo its cap). A rebalance that gives a
partition back to this consumer keeps its remembered sessions; after a restart, once the partition
moved to another consumer, or once forgotten, a late turn starts a new session whose result says
`evaluation` 1. A turn the session (open or remembered) already holds, by trace id and request id,
is ignored (counted): a result published twice upstream, or read again after a rewind.

Offsets. A turn's ticket is released only when its session's result is acknowledged by the broker,
so the committed offset of a partition never passes a turn of a session not yet published. On
revocation and shutdown the open sessions are dropped uncommitted; the partition's next owner (or
this process after a restart, or after SIGKILL) reads their turns again and rebuilds them: no
session is lost. Delivery is at least once: a session published but not yet committed when the
process died is published again, and one whose turns straddle the committed offset (published
while an older session on its partition was still open) may be published again with only its
later turns, as `evaluation` 1. Readers keep the result with the most turns per evaluation.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import heapq
import itertools
import logging
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from kafka import KafkaProducer
from kafka.errors import MessageSizeTooLargeError, RecordListTooLargeError
from kafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import ConfigError, SessionsSettings, Settings, load_settings
from tracejudge.consumer.runtime import gc_policy
from tracejudge.consumer.runtime.arguments import TOPIC_METAVAR
from tracejudge.consumer.runtime.loop import (
    NO_LIMIT,
    ConsumerRuntime,
    Exports,
    Stage,
    StartupError,
    add_runtime_arguments,
    cannot_connect,
    runtime_overrides,
    stage_main,
    suppress_logged,
)
from tracejudge.consumer.runtime.loop import _Export as _Export
from tracejudge.consumer.runtime.offsets import Ticket
from tracejudge.consumer.runtime.producing import RESULT_REJECTED, DeadLetterSink, Publisher, RateLimitedLog
from tracejudge.consumer.stages.sink import (
    KNOWN_SCHEMA_VERSION,
    NOT_A_RESULT,
    RESULT_FORMAT,
    UNKNOWN_SCHEMA_VERSION,
    BadResult,
    decode_result,
)
from tracejudge.metrics.telemetry.sessions import SessionMetrics
from tracejudge.schemas.result import Assessment, SourceRef, session_key
from tracejudge.schemas.session import (
    CLOSE_REASONS,
    COMPLETE,
    SESSION_KIND,
    SessionResult,
    SessionSource,
    Turn,
    TurnLine,
    decode_turn,
    place_turn,
    session_metrics,
)

__all__ = ["DEFAULT_GROUP", "TURN_OVERHEAD_BYTES", "ClosedSession", "SessionPlan", "SessionRunner",
           "SessionStage", "Sessionizer", "add_arguments", "build_judges", "main", "plan_sessions"]

log = logging.getLogger("tracejudge.sessions")

DEFAULT_GROUP = "tracejudge-sessions"
# What a held turn costs besides its texts: the `Turn` and its id strings, its offset ticket and the
# tracker's entry, list slots and its share of the session's bookkeeping (bench/bench_sessions.py
# measures the whole with tracemalloc: 1.4 KB a turn of 550 characters of text, 5 turns a session).
TURN_OVERHEAD_BYTES = 896
INACTIVITY = "inactivity"
EVICTED = "evicted"
_SIZE_ERRORS = (MessageSizeTooLargeError, RecordListTooLargeError)


def _text_bytes(text: str | None) -> int:
    # An upper bound of what CPython keeps for the text: one byte a character for ASCII, at most four.
    if not text:
        return 0
    return len(text) if text.isascii() else 4 * len(text)


def _timestamp(turn: Turn) -> float:
    return turn.timestamp


def _holds(turns: list[Turn], line: TurnLine) -> bool:
    """Whether `turns` already hold the turn of `line` (same trace id and request id)."""
    trace_id, request_id = line.trace_id, line.request_id
    if trace_id is None and request_id is None:
        return False
    return any(t.request_id == request_id and t.trace_id == trace_id for t in turns)


# -- the state machine ------------------------------------------------------------------------------


class _Session:
    """An open session: its turns in timestamp order and the tickets of the turns read this time."""

    __slots__ = ("app", "bytes", "evaluation", "is_open", "last_arrival", "last_ts", "part", "seq",
                 "session_id", "tickets", "turns", "user_id")

    def __init__(self, part: _Part, session_id: str, evaluation: int, turns: list[Turn], nbytes: int) -> None:
        self.part = part
        self.session_id = session_id
        self.evaluation = evaluation
        self.turns = turns
        self.tickets: list[Ticket] = []
        self.bytes = nbytes
        self.user_id: str | None = None
        self.app: str | None = None
        self.last_ts = turns[-1].timestamp if turns else float("-inf")
        self.last_arrival = 0.0
        self.seq = -1
        self.is_open = True


class _Remembered:
    """A closed session kept with its turns, so a late turn reopens it."""

    __slots__ = ("app", "bytes", "evaluation", "part", "session_id", "turns", "user_id")

    def __init__(self, session: _Session) -> None:
        self.part = session.part
        self.session_id = session.session_id
        self.turns = session.turns
        self.user_id = session.user_id
        self.app = session.app
        self.evaluation = session.evaluation
        self.bytes = session.bytes


class _Part:
    """One assigned partition's sessions and its stream time."""

    __slots__ = ("closed", "heap", "open", "stream_time", "tp")

    def __init__(self, tp: TopicPartition) -> None:
        self.tp = tp
        self.open: dict[str, _Session] = {}
        self.closed: dict[str, _Remembered] = {}
        # (last turn time, seq, session): the session quiet the longest first. Entries go stale when
        # a session gets a later turn or closes (seq tells); rebuilt when stale ones dominate.
        self.heap: list[tuple[float, int, _Session]] = []
        self.stream_time = float("-inf")


@dataclass(slots=True)
class ClosedSession:
    """A session the sessionizer closed: what to judge and publish, and the tickets its result's ack
    releases. `turns` is shared with the remembered session, never changed afterwards."""

    tp: TopicPartition
    session_id: str
    user_id: str | None
    app: str | None
    close_reason: str
    evaluation: int
    turns: list[Turn]
    tickets: list[Ticket]

    def result(self, assessments: list[Assessment]) -> SessionResult:
        turns = self.turns
        first, last = turns[0], turns[-1]
        return SessionResult(
            session_id=self.session_id, user_id=self.user_id, app=self.app,
            status=CLOSE_REASONS[self.close_reason], close_reason=self.close_reason,
            turns=[t.ref() for t in turns], started_at=first.timestamp,
            ended_at=last.timestamp + (last.latency_seconds or 0.0), metrics=session_metrics(turns),
            assessments=assessments, evaluation=self.evaluation,
            source=SessionSource(format=RESULT_FORMAT, topic=self.tp.topic, partition=self.tp.partition,
                                 first_offset=first.offset, last_offset=last.offset))


class Sessionizer:
    """Open sessions per partition, their closing, the memory caps and the remembered closed sessions
    (see the module docstring). Holds no Kafka client; `emit` gets every closed session, on the
    thread that called `add` or `due`."""

    def __init__(self, limits: SessionsSettings, metrics: SessionMetrics,
                 emit: Callable[[ClosedSession], None]) -> None:
        self.inactivity = limits.inactivity_s
        self.max_turns = limits.max_turns
        self.max_duration = limits.max_duration_s
        self.max_open = limits.max_open_sessions
        self.max_turns_held = limits.max_turns_held
        self.max_bytes = limits.max_bytes_held
        self.max_closed = limits.max_closed_sessions
        self.metrics = metrics
        self.emit = emit
        self._parts: dict[TopicPartition, _Part] = {}
        # Open sessions, least recently active (by arrival of their last turn) first.
        self._lru: OrderedDict[_Session, None] = OrderedDict()
        self._remembered: OrderedDict[_Remembered, None] = OrderedDict()
        # Revoked partitions' remembered sessions, until the rebalance's assignment says whose they are.
        self._parked: dict[TopicPartition, _Part] = {}
        self.turns_open = 0
        self.bytes_open = 0
        self.turns_closed = 0
        self.bytes_closed = 0
        self._seq = itertools.count()
        m = metrics
        self._turn_count = m.turns
        self._missing = m.placed_by_arrival.labels("missing")
        self._absurd = m.placed_by_arrival.labels("absurd")
        self._duplicate = m.ignored.labels("duplicate")

    # -- turns in -----------------------------------------------------------------------------------

    def add(self, tp: TopicPartition, line: TurnLine, ticket: Ticket, offset: int, arrival: float,
            now: float) -> bool:
        """Place one turn (`line.session_id` set) in its session; `arrival` is the epoch time it was
        read, `now` the monotonic one. False for a turn the session already holds (its ticket is
        released, counted)."""
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Part(tp)
        when, by_arrival = place_turn(line.timestamp, arrival)
        if by_arrival:
            (self._missing if line.timestamp is None else self._absurd).inc()
        elif when > part.stream_time:
            part.stream_time = when
            heap = part.heap
            if heap and heap[0][0] <= when - self.inactivity:
                self._close_quiet(part)
        session_id: str = line.session_id  # type: ignore[assignment]
        session = part.open.get(session_id)
        if session is None:
            remembered = part.closed.get(session_id)
            if remembered is not None and _holds(remembered.turns, line):  # re-read after a rewind
                self._duplicate.inc()
                ticket.release()
                return False
            session = self._open(part, session_id)
        elif _holds(session.turns, line):  # e.g. `tracejudge run` published the result twice
            self._duplicate.inc()
            ticket.release()
            return False
        turn = Turn.from_line(line, timestamp=when, placed_by_arrival=by_arrival, partition=tp.partition,
                              offset=offset)
        turns = session.turns
        if not turns or when >= turns[-1].timestamp:
            turns.append(turn)
        else:
            bisect.insort_right(turns, turn, key=_timestamp)
        session.tickets.append(ticket)
        size = (TURN_OVERHEAD_BYTES + _text_bytes(line.request) + _text_bytes(line.response)
                + _text_bytes(line.error))
        session.bytes += size
        self.bytes_open += size
        self.turns_open += 1
        if session.user_id is None:
            session.user_id = line.user_id
        if session.app is None:
            session.app = line.app
        if when > session.last_ts:
            session.last_ts = when
            self._push(part, session)
        session.last_arrival = now
        self._lru.move_to_end(session)
        self._turn_count.inc()
        if len(turns) >= self.max_turns:
            self._close(session, "max_turns", "max_turns")
        elif session.last_ts - turns[0].timestamp >= self.max_duration:
            self._close(session, "max_duration", "max_duration")
        if (self.turns_open + self.turns_closed > self.max_turns_held
                or self.bytes_open + self.bytes_closed > self.max_bytes):
            self._enforce_memory()
        return True

    def _open(self, part: _Part, session_id: str) -> _Session:
        if len(self._lru) >= self.max_open:
            self._close(next(iter(self._lru)), EVICTED, "max_open_sessions")
        remembered = part.closed.pop(session_id, None)
        if remembered is not None:
            del self._remembered[remembered]
            self.turns_closed -= len(remembered.turns)
            self.bytes_closed -= remembered.bytes
            session = _Session(part, session_id, remembered.evaluation + 1, list(remembered.turns),
                               remembered.bytes)
            session.user_id, session.app = remembered.user_id, remembered.app
            self.turns_open += len(session.turns)
            self.bytes_open += session.bytes
            self.metrics.reopened.inc()
            part.open[session_id] = session
            self._push(part, session)  # on the heap at its last turn, whatever the new turn's time
        else:
            session = _Session(part, session_id, 1, [], 0)
            part.open[session_id] = session
        self._lru[session] = None
        return session

    def _push(self, part: _Part, session: _Session) -> None:
        seq = session.seq = next(self._seq)
        heap = part.heap
        heapq.heappush(heap, (session.last_ts, seq, session))
        if len(heap) > 2 * len(part.open) + 1024:  # mostly stale entries: rebuild from the open ones
            part.heap = [(s.last_ts, s.seq, s) for s in part.open.values()]
            heapq.heapify(part.heap)

    # -- closing ------------------------------------------------------------------------------------

    def _close_quiet(self, part: _Part) -> None:
        """Close the partition's sessions its stream time has left quiet for `inactivity_s`."""
        limit = part.stream_time - self.inactivity
        heap = part.heap
        while heap and heap[0][0] <= limit:
            _, seq, session = heapq.heappop(heap)
            if session.is_open and session.seq == seq:
                self._close(session, INACTIVITY, None)

    def due(self, now: float) -> None:
        """Close the sessions whose last turn arrived `inactivity_s` of wall clock ago (`now`:
        monotonic)."""
        lru = self._lru
        limit = now - self.inactivity
        while lru:
            session = next(iter(lru))
            if session.last_arrival > limit:
                break
            self._close(session, INACTIVITY, None)

    def next_due(self, now: float) -> float | None:
        """Seconds until the next wall-clock close (None: no open session)."""
        if not self._lru:
            return None
        return max(0.0, next(iter(self._lru)).last_arrival + self.inactivity - now)

    def _close(self, session: _Session, reason: str, early: str | None) -> None:
        part = session.part
        del part.open[session.session_id]
        del self._lru[session]
        session.is_open = False
        self.turns_open -= len(session.turns)
        self.bytes_open -= session.bytes
        if early is not None:
            self.metrics.closed_early.labels(early).inc()
        closed = ClosedSession(part.tp, session.session_id, session.user_id, session.app, reason,
                               session.evaluation, session.turns, session.tickets)
        if CLOSE_REASONS[reason] == COMPLETE and self.max_closed:
            self._remember(session)
        self.emit(closed)

    def _remember(self, session: _Session) -> None:
        remembered = _Remembered(session)
        part = session.part
        old = part.closed.pop(session.session_id, None)
        if old is not None:  # cannot happen (a reopen takes it out), but never count it twice
            self._forget(old, None)
        part.closed[session.session_id] = remembered
        self._remembered[remembered] = None
        self.turns_closed += len(remembered.turns)
        self.bytes_closed += remembered.bytes
        while len(self._remembered) > self.max_closed:
            self._forget(next(iter(self._remembered)), "max_closed_sessions")

    def _forget(self, remembered: _Remembered, reason: str | None) -> None:
        remembered.part.closed.pop(remembered.session_id, None)
        self._remembered.pop(remembered, None)
        self.turns_closed -= len(remembered.turns)
        self.bytes_closed -= remembered.bytes
        if reason is not None:
            self.metrics.forgotten.labels(reason).inc()

    def _enforce_memory(self) -> None:
        """Past `max_turns_held` or `max_bytes_held`: forget remembered sessions, then evict the least
        recently active open ones."""
        while True:
            over_turns = self.turns_open + self.turns_closed > self.max_turns_held
            if not over_turns and self.bytes_open + self.bytes_closed <= self.max_bytes:
                return
            if self._remembered:
                self._forget(next(iter(self._remembered)), "memory")
            elif self._lru:
                cap = "max_turns_held" if over_turns else "max_bytes_held"
                self._close(next(iter(self._lru)), EVICTED, cap)
            else:
                return

    # -- partitions ---------------------------------------------------------------------------------

    def drop(self, tps: Iterable[TopicPartition], *, park: bool = False) -> int:
        """Drop the partitions' open sessions; their turns' tickets stay unreleased (re-read by the
        next owner). Returns the open sessions dropped (counted). Their remembered closed sessions
        are forgotten, or with `park` (a revocation) kept until the rebalance's assignment: a
        partition given back to this consumer keeps them (`assigned`), the others forget them."""
        dropped = 0
        for tp in tps:
            part = self._parts.pop(tp, None)
            if part is None:
                continue
            for session in part.open.values():
                session.is_open = False
                self._lru.pop(session, None)
                self.turns_open -= len(session.turns)
                self.bytes_open -= session.bytes
                dropped += 1
            part.open = {}
            part.heap = []
            if park and part.closed:
                self._parked[tp] = part
            else:
                for remembered in list(part.closed.values()):
                    self._forget(remembered, None)
        if dropped:
            self.metrics.dropped.inc(dropped)
        return dropped

    def assigned(self, tps: Iterable[TopicPartition]) -> None:
        """A rebalance's assignment: partitions that came back keep their remembered sessions."""
        tps = set(tps)
        for tp, part in list(self._parked.items()):
            del self._parked[tp]
            if tp in tps and tp not in self._parts:
                self._parts[tp] = part
            else:
                for remembered in list(part.closed.values()):
                    self._forget(remembered, None)

    def drop_all(self) -> int:
        dropped = self.drop(list(self._parts))
        self.assigned(())
        return dropped

    @property
    def open_sessions(self) -> int:
        return len(self._lru)

    @property
    def remembered_sessions(self) -> int:
        return len(self._remembered)

    def update_gauges(self) -> None:
        m = self.metrics
        m.open.set(len(self._lru))
        m.turns_held.set(self.turns_open)
        m.bytes_held.set(self.bytes_open)
        m.remembered.set(len(self._remembered))


# -- the stage --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """What `tracejudge sessions` reads and writes, resolved from the settings."""

    input_topic: str
    results_topic: str
    dead_letter_topic: str | None
    group_id: str


def plan_sessions(settings: Settings) -> SessionPlan:
    """Resolve the `sessions:` section; `ConfigError` naming the key when the stage cannot run."""
    s = settings.sessions
    source = s.input_topic or settings.stream.results_topic
    problems: list[tuple[str, str]] = []
    if not source:
        problems.append(("sessions.input_topic", "is required: the trace results topic to read (or "
                                                 "stream.results_topic, which it defaults to)"))
    if not s.results_topic:
        problems.append(("sessions.results_topic", "is required: the topic the session results go to"))
    elif s.results_topic == source:
        problems.append(("sessions.results_topic", f"is the input topic {source!r}; session results go to "
                                                   "a topic of their own"))
    if s.dead_letter_topic is not None and s.dead_letter_topic in (source, s.results_topic):
        problems.append(("sessions.dead_letter_topic", f"is {s.dead_letter_topic!r}, also the input or the "
                                                       "results topic"))
    if problems:
        raise ConfigError(problems)
    assert source is not None and s.results_topic is not None
    return SessionPlan(source, s.results_topic, s.dead_letter_topic, s.group_id or DEFAULT_GROUP)


class _Tickets:
    """The tickets of a session's turns read this time, released together (the result's ack)."""

    __slots__ = ("tickets",)

    def __init__(self, tickets: list[Ticket]) -> None:
        self.tickets = tickets

    def release(self) -> None:
        for ticket in self.tickets:
            ticket.release()


class SessionStage(Stage):
    """Decodes turns, feeds the `Sessionizer`, judges and publishes the sessions it closes, releases
    their turns' tickets on the broker's ack."""

    name = "sessions"

    def __init__(self, plan: SessionPlan, settings: Settings, metrics: SessionMetrics, judges: Any,
                 *, tune_gc: bool = False) -> None:
        self.plan = plan
        self.settings = settings
        self.metrics = metrics
        self.judges = judges
        self.tune_gc = tune_gc
        # Session results being judged or awaiting the broker's ack; past the cap fetching pauses.
        self.max_in_flight = settings.stream.max_in_flight
        self.exports = Exports()
        self.letters = Exports()
        self.runtime: ConsumerRuntime | None = None
        self.producer: KafkaProducer | None = None
        self.publisher: Publisher | None = None
        self.dead_letters: DeadLetterSink | None = None
        self.sessionizer = Sessionizer(settings.sessions, metrics, self._closed)
        # Sessions whose judges finished (any thread), published by the poll loop.
        self._judged: deque[tuple[ClosedSession, concurrent.futures.Future[list[Assessment]], _Export]] = \
            deque()
        self._no_session = metrics.ignored.labels("no_session")
        self._session_line = metrics.ignored.labels("session_result")
        self._log = RateLimitedLog(log)

    # -- start-up -------------------------------------------------------------------------------------

    def topics(self) -> list[str]:
        return [self.plan.input_topic]

    def subscription(self) -> str:
        judges = f"; session judges: {', '.join(self.judges.judge_names())}" if self.judges else ""
        return f"{self.plan.input_topic} (trace results) -> {self.plan.results_topic}{judges}"

    def prepare(self, runtime: ConsumerRuntime) -> None:
        self.runtime = runtime

    def open(self, runtime: ConsumerRuntime) -> None:
        self.runtime = runtime
        s = self.settings
        started = time.monotonic()
        try:
            self.producer = KafkaProducer(**s.kafka.client_config(), **s.producer.producer_config())
        except Exception as exc:
            raise StartupError(cannot_connect("create the producer", s, exc, started)) from exc
        self.publisher = Publisher(self.producer, retry_backoff=s.producer.retry_backoff_seconds)
        metrics: Any = self.metrics  # counts through count_dead_letter / dead_letter_publish_failures
        self.dead_letters = DeadLetterSink(self.publisher, self.plan.dead_letter_topic, metrics,
                                           max_request_size=s.producer.max_request_size)

    def started(self) -> None:
        if self.tune_gc:
            gc_policy.apply()

    # -- the loop -------------------------------------------------------------------------------------

    def process(self, tp: TopicPartition, records: list[Any]) -> None:
        assert self.runtime is not None
        track = self.runtime.tracker.track
        add = self.sessionizer.add
        arrival, now = time.time(), time.monotonic()
        for record in records:
            offset = record.offset
            ticket = track(tp, offset)
            value = record.value
            try:
                line = decode_turn(value)
            except (msgspec.DecodeError, TypeError):  # ValidationError is a DecodeError; None: TypeError
                self._dead_letter(record, _why_not(value), ticket)
                continue
            if line.kind is not None or line.schema_version != KNOWN_SCHEMA_VERSION:
                if line.kind == SESSION_KIND and 1 <= line.schema_version <= KNOWN_SCHEMA_VERSION:
                    self._session_line.inc()
                    ticket.release()
                    continue
                if line.schema_version > KNOWN_SCHEMA_VERSION:
                    self._dead_letter(record, BadResult(UNKNOWN_SCHEMA_VERSION, f"schema_version "
                                      f"{line.schema_version} is newer than this tracejudge reads "
                                      f"({KNOWN_SCHEMA_VERSION}); upgrade it"), ticket)
                    continue
                if line.kind is not None or line.schema_version < 1:
                    self._dead_letter(record, BadResult(NOT_A_RESULT, f"not a trace result (kind "
                                      f"{line.kind!r}, schema_version {line.schema_version})"), ticket)
                    continue
            if line.trace_id is None and line.request_id is None:
                self._dead_letter(record, _why_not(value), ticket)
                continue
            if not line.session_id:
                self._no_session.inc()
                ticket.release()
                continue
            if b'"assessments"' not in value:  # every result line has them; a look-alike does not
                self._dead_letter(record, _why_not(value), ticket)
                continue
            add(tp, line, ticket, offset, arrival, now)

    def tick(self, now: float) -> None:
        if self.publisher is not None:
            self.publisher.run_due_retries()
        self.sessionizer.due(now)
        self._publish_judged()
        self.sessionizer.update_gauges()

    def polled(self, now: float) -> None:
        self.sessionizer.due(now)
        self._publish_judged()
        self.sessionizer.update_gauges()

    def room(self) -> int:
        return NO_LIMIT if self.exports.count < self.max_in_flight else 0

    def wait_hint(self, now: float) -> float | None:
        if self._judged:
            return 0.0
        return self.sessionizer.next_due(now)

    def busy(self) -> int:
        return self.exports.count + self.letters.count

    # -- a closed session -----------------------------------------------------------------------------

    def _closed(self, closed: ClosedSession) -> None:
        turns = closed.turns
        last = turns[-1]
        duration = max(0.0, last.timestamp + (last.latency_seconds or 0.0) - turns[0].timestamp)
        self.metrics.session(closed.app, CLOSE_REASONS[closed.close_reason], len(turns), duration)
        export = self.exports.start(_Tickets(closed.tickets))
        if self.judges is None:
            self._publish(closed, [], export)
            return
        from tracejudge.metrics.judges.sessions import Conversation

        try:
            future = self.judges.submit(Conversation(closed.session_id, closed.app, turns))
        except Exception:
            log.exception("starting the session judges failed; publishing the session without assessments")
            self._publish(closed, [], export)
            return
        if future.done():  # only heuristics ran, or nothing was sampled: no need to wait for a poll
            self._judged.append((closed, future, export))
            self._publish_judged()
            return
        judged = self._judged
        future.add_done_callback(lambda f: judged.append((closed, f, export)))

    def _publish_judged(self) -> None:
        judged = self._judged
        while judged:
            closed, future, export = judged.popleft()
            try:
                assessments = future.result()
            except Exception as exc:
                self._log.warning("session judges failed", "the session judges failed (%s: %s); publishing "
                                  "the session without assessments", type(exc).__name__, exc)
                assessments = []
            self._publish(closed, list(assessments), export)

    def _publish(self, closed: ClosedSession, assessments: list[Assessment], export: _Export) -> None:
        result = closed.result(assessments)
        key, hashed = session_key(closed.session_id)
        if hashed:
            self.metrics.ids_hashed.inc()
        source = SourceRef(format=RESULT_FORMAT, topic=closed.tp.topic, partition=closed.tp.partition,
                           offset=closed.turns[0].offset)
        try:
            value = result.to_json()
        except Exception as exc:  # what custom judges put in an assessment: never hold the offsets back
            log.exception("writing the session result of %s[%d] failed", closed.tp.topic, closed.tp.partition)
            assert self.dead_letters is not None
            self.dead_letters.send(source=source, reason=RESULT_REJECTED, ticket=export, value=None,
                                   error=f"session result could not be written: {type(exc).__name__}: {exc}")
            return
        self._send(value, key.encode("utf-8", "surrogatepass"), source, export, 0)

    def _send(self, value: bytes, key: bytes, source: SourceRef, export: _Export, attempt: int) -> None:
        publisher, topic, metrics = self.publisher, self.plan.results_topic, self.metrics
        assert publisher is not None

        def acked() -> None:
            metrics.results_published.inc()
            export.release()

        def failed(exc: Exception) -> None:
            metrics.result_publish_failures.inc()
            if isinstance(exc, _SIZE_ERRORS):
                assert self.dead_letters is not None
                self.dead_letters.send(source=source, reason=RESULT_REJECTED, ticket=export, value=None,
                                       key=key, error=f"session result of {len(value)} bytes rejected by "
                                       f"the broker: {exc}")
                return
            self._log.warning("session result publish failure", "cannot publish a session result of "
                              "%s[%s] to %s (attempt %d): %s: %s; retrying, its turns' offsets wait",
                              source.topic, source.partition, topic, attempt + 1, type(exc).__name__, exc)
            publisher.retry_later(attempt, lambda: self._send(value, key, source, export, attempt + 1))

        publisher.send(topic, value=value, key=key, headers=[("content-type", b"application/json")],
                       on_ack=acked, on_error=failed)

    def _dead_letter(self, record: Any, exc: BadResult, ticket: Ticket) -> None:
        assert self.dead_letters is not None
        source = SourceRef(format=RESULT_FORMAT, topic=record.topic, partition=record.partition,
                           offset=record.offset)
        self.dead_letters.send(source=source, reason=exc.reason, error=exc.message,
                               ticket=self.letters.start(ticket), value=record.value, key=record.key,
                               headers=record.headers, timestamp_ms=record.timestamp)

    # -- rebalance (IO thread) ------------------------------------------------------------------------

    async def revoke(self, tps: set[TopicPartition], deadline: float, sleep: Any) -> str:
        # Open sessions are dropped uncommitted: the next owner rebuilds them from their turns.
        # Results on their way (judged or awaiting acks) get until the deadline.
        dropped = self.sessionizer.drop(tps, park=True)
        while (self.exports.count or self.letters.count) and time.monotonic() < deadline:
            self._publish_judged()
            if self.publisher is not None:
                self.publisher.run_due_retries()
            await sleep(0.01)
        self.sessionizer.update_gauges()
        return f"dropped {dropped} open sessions" if dropped else ""

    def lose(self, tps: set[TopicPartition]) -> None:
        self.sessionizer.drop(tps)
        self.sessionizer.update_gauges()

    def assigned(self, tps: set[TopicPartition]) -> None:
        self.sessionizer.assigned(tps)
        self.sessionizer.update_gauges()

    # -- shutdown -------------------------------------------------------------------------------------

    def stopping(self) -> None:
        dropped = self.sessionizer.drop_all()
        self.sessionizer.update_gauges()
        if dropped:
            log.info("stopping: %d open sessions dropped uncommitted; their turns are read again on restart",
                     dropped)

    def drain(self, deadline: float) -> None:
        """Until `deadline`: publish what the judges finish, let the acks arrive."""
        while (self.exports.count or self.letters.count) and (left := deadline - time.monotonic()) > 0:
            self._publish_judged()
            if self.publisher is not None:
                self.publisher.run_due_retries()
            self.exports.wait_idle(min(0.05, left))
        self._publish_judged()

    def close(self) -> None:
        if self.judges is not None:
            with suppress_logged(log, "closing the session judges"):
                self.judges.close(0.0)
        if self.producer is not None:
            with suppress_logged(log, "closing the producer"):
                self.producer.close(timeout=5)


def _why_not(value: bytes | None) -> BadResult:
    """Why a line that `decode_turn` refused (or that names no trace) is not a trace result, as the
    sink says it (`decode_result`: invalid_json, not_a_result, unknown_schema_version)."""
    try:
        decode_result(value)
    except BadResult as exc:
        return exc
    except Exception as exc:  # pragma: no cover - decode_result raises BadResult only
        return BadResult(NOT_A_RESULT, f"not a trace result: {exc}")
    try:
        decode_turn(value)  # type: ignore[arg-type]
    except (msgspec.DecodeError, TypeError) as exc:
        return BadResult(NOT_A_RESULT, f"not a trace result: {exc}")
    return BadResult(NOT_A_RESULT, "not a trace result: neither trace_id nor request_id")


class SessionRunner(ConsumerRuntime):
    """`tracejudge sessions` embedded: the session stage on the consumer runtime. Same embedding API as
    `StreamRunner`: `start()`, `stop()`, `join()`, `run()`, `http_port`, `registry`, `assignment`,
    `wait_assigned()`, `error`. `judges=False` runs without session judges whatever `judges:` says;
    without `judges` they are built from the `judges:` section (none without it). Raises
    `ConfigError` for a configuration that cannot work."""

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None, judges: Any = None,
                 tune_gc: bool = False) -> None:
        plan = plan_sessions(settings)
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        metrics = SessionMetrics(registry, max_apps=settings.prometheus.max_apps)
        self.judges = None if judges is False else judges or build_judges(settings, registry, metrics.apps)
        self.plan = plan
        self.session_metrics = metrics
        stage = SessionStage(plan, settings, metrics, self.judges, tune_gc=tune_gc)
        super().__init__(settings, stage, metrics, registry, log=log, title="tracejudge sessions",
                         group_id=plan.group_id, show_setting=_shown)
        self.sessionizer = stage.sessionizer
        self.exports = stage.exports


def build_judges(settings: Settings, registry: CollectorRegistry,
                 app_label: Callable[[str | None], str] | None = None) -> Any:
    """The `SessionJudgeRunner` of the `judges:` section (None without one: no session judges; with
    one but no endpoint, the heuristic `user_frustration`). Its series go to `registry`, their `app`
    bounded by `app_label` (the stage's cap). `ConfigError` names the key of a bad section."""
    if settings.judges is None:
        return None
    from tracejudge.metrics.judges.config import JudgeConfigError
    from tracejudge.metrics.judges.sessions import SessionJudgeRunner

    try:
        return SessionJudgeRunner(settings.judges, registry, app_label=app_label)
    except JudgeConfigError as exc:
        raise ConfigError([(exc.key, exc.detail)]) from None


# The settings the session stage uses (the start-up summary and --check-config show only these).
_STREAM_KEYS = ("stream.results_topic", "stream.poll_timeout_ms", "stream.commit_interval_ms",
                "stream.shutdown_grace_seconds", "stream.lag_interval_seconds", "stream.max_in_flight")


def _shown(key: str) -> bool:
    if key.startswith(("sessions.", "http.", "logging.", "producer.", "prometheus.", "judges.")):
        return True
    if key.startswith("kafka."):
        return key != "kafka.group_id"
    return key in _STREAM_KEYS


# -- command line ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tracejudge sessions`; each overrides its configuration key."""
    add_runtime_arguments(
        parser, command="sessions",
        config_help="YAML configuration file (its sessions: and judges: sections)",
        group=("sessions.group_id", f"consumer group (sessions.group_id, default {DEFAULT_GROUP})"),
        results=("sessions.results_topic", "publish one session result per closed session here "
                                           "(sessions.results_topic, required)"),
        dead_letters=("sessions.dead_letter_topic",
                      "route records that are not trace results here (sessions.dead_letter_topic)"))
    parser.add_argument("--input-topic", metavar=TOPIC_METAVAR,
                        help="the trace results topic to read (sessions.input_topic, default "
                             "stream.results_topic)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {**runtime_overrides(args), "sessions.input_topic": getattr(args, "input_topic", None)}
    return load_settings(getattr(args, "config", None), overrides=overrides, require_topics=False)


def main(args: argparse.Namespace) -> int:
    """Entry point of `tracejudge sessions`: 0 after a clean stop, 1 when it cannot start, 2 on bad
    configuration (reported before anything connects)."""
    return stage_main("sessions", args, settings_from_args, lambda s: SessionRunner(s, tune_gc=True),
                      plan=plan_sessions, show=_shown,
                      effective=lambda plan: {"sessions.input_topic": plan.input_topic,
                                              "sessions.group_id": plan.group_id})


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tracejudge sessions", description=__doc__.splitlines()[0])
    _parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (logging.level)")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
