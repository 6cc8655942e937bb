"""The sessionizer of `tracejudge sessions` (`consumer/stages/sessions.py`), a part of that stage: per
partition, the open sessions by id with their turns in timestamp order, the partition's stream time,
and when each session closes (quiet, capped, evicted past a memory cap) or reopens (a late turn for a
session remembered closed). Pure: no Kafka client, no clock of its own, so it is tested and measured
(bench/bench_sessions.py) on its own. The stage module's docstring says why it works this way.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kafka.structs import TopicPartition

from tracejudge.consumer.config import SessionsSettings
from tracejudge.consumer.runtime.offsets import Ticket
from tracejudge.metrics.telemetry.sessions import SessionMetrics
from tracejudge.schemas.result import Assessment
from tracejudge.schemas.results_line import (
    RESULT_FORMAT,
)
from tracejudge.schemas.session import (
    CLOSE_REASONS,
    COMPLETE,
    SessionResult,
    SessionSource,
    Turn,
    TurnLine,
    place_turn,
    session_metrics,
)

__all__ = ["EVICTED", "INACTIVITY", "TURN_OVERHEAD_BYTES", "ClosedSession", "Sessionizer"]

# What a held turn costs besides its texts: the `Turn` and its id strings, its offset ticket and the
# tracker's entry, list slots and its share of the session's bookkeeping (bench/bench_sessions.py
# measures the whole with tracemalloc: 1.4 KB a turn of 550 characters of text, 5 turns a session).
TURN_OVERHEAD_BYTES = 896
INACTIVITY = "inactivity"
EVICTED = "evicted"


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
