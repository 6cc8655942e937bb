"""Which offsets are safe to commit when records finish out of order.

Every fetched record gets a `Ticket`. The record's own processing holds the first reference; anything
else that must finish before the record counts as exported (a result waiting for the producer's ack,
a trace held by trace assembly, an LLM judge running on another thread) takes one more with
`acquire()` and gives it back with `release()`. When the last reference is released the offset is
complete. Per partition the committable offset is the lowest offset not yet complete, so a slow
record holds back the commit of every later one: at-least-once, never at-most-once.

A commit that would move nothing is never offered: a partition starts out "committed" at the first
offset tracked for it (where reading started: the group's committed offset, or where
`auto_offset_reset` put a group that had none), so the commit timer of a consumer whose first
records are all still in flight neither sends a commit nor counts one in `tracejudge_commits_total`.

`Exports` counts the work handed on that finishes by itself (a result awaiting the broker's ack, a
judge running): what a revocation or a shutdown waits for, and a stage's in-flight cap.

Thread-safe: tickets are released from the producer's network thread and, later, from judge threads,
while the poll loop tracks new records and the rebalance listener revokes partitions.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import Protocol

from kafka.structs import OffsetAndMetadata, TopicPartition

__all__ = ["Export", "Exports", "OffsetTracker", "Releasable", "Ticket"]


class Releasable(Protocol):
    """Anything that completes a piece of work with `release()`: a `Ticket`, an assembled trace."""

    def release(self) -> None: ...


class _Partition:
    """Tracked offsets of one assigned partition, in fetch order."""

    __slots__ = ("active", "committed", "done", "next_offset", "pending")

    def __init__(self) -> None:
        # Offsets tracked and not yet popped as complete, ascending (Kafka hands them out in order).
        self.pending: deque[int] = deque()
        # Completed offsets that are not at the head of `pending` yet (they finished out of order).
        self.done: set[int] = set()
        # The offset to commit if everything tracked so far were complete: last tracked + 1.
        self.next_offset: int | None = None
        # The last committed offset; at first the offset reading started from, which the group (or its
        # offset reset) already points at: committing it again would move nothing.
        self.committed: int | None = None
        # False once revoked: late releases of old tickets must not touch a re-assigned partition.
        self.active = True

    def commit_point(self) -> int | None:
        return self.pending[0] if self.pending else self.next_offset


class Ticket:
    """The reference count of one record's outstanding work."""

    __slots__ = ("_part", "_refs", "_tracker", "offset", "tp")

    def __init__(self, tracker: OffsetTracker, part: _Partition, tp: TopicPartition, offset: int) -> None:
        self._tracker = tracker
        self._part = part
        self._refs = 1
        self.tp = tp
        self.offset = offset

    def acquire(self) -> Ticket:
        """One more piece of work depends on this record; it must `release()` when exported."""
        with self._tracker._lock:
            if self._refs <= 0:
                raise RuntimeError(f"ticket {self.tp.topic}[{self.tp.partition}]@{self.offset} is already "
                                   "complete; acquire before releasing the last reference")
            self._refs += 1
        return self

    def release(self) -> None:
        """That piece of work is exported. The last release completes the offset."""
        with self._tracker._lock:
            if self._refs <= 0:
                raise RuntimeError(f"ticket {self.tp.topic}[{self.tp.partition}]@{self.offset} released "
                                   "more times than acquired")
            self._refs -= 1
            if self._refs == 0:
                self._tracker._complete(self._part, self.offset)

    @property
    def done(self) -> bool:
        return self._refs == 0

    def __repr__(self) -> str:
        return f"Ticket({self.tp.topic}[{self.tp.partition}]@{self.offset}, refs={self._refs})"


class OffsetTracker:
    """Per-partition out-of-order completion; hands out the next offset to commit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._parts: dict[TopicPartition, _Partition] = {}
        self._in_flight = 0
        # Notifying a Condition costs a few microseconds per record; only pay it when someone waits.
        self._waiters = 0

    def track(self, tp: TopicPartition, offset: int) -> Ticket:
        """Start tracking a fetched record. Offsets of one partition must be tracked in ascending order."""
        with self._lock:
            part = self._parts.get(tp)
            if part is None:
                part = self._parts[tp] = _Partition()
                part.committed = offset
            elif part.next_offset is not None and offset < part.next_offset:
                # A seek back (re-delivery after a rebalance): forget the old bookkeeping; the records
                # from `offset` on will be tracked again as they come.
                self._in_flight -= len(part.pending) - len(part.done)
                part.active = False
                part = self._parts[tp] = _Partition()
                part.committed = offset
            part.pending.append(offset)
            part.next_offset = offset + 1
            self._in_flight += 1
            return Ticket(self, part, tp, offset)

    def _complete(self, part: _Partition, offset: int) -> None:
        # Called with the lock held.
        if not part.active:
            return
        self._in_flight -= 1
        pending = part.pending
        if pending and pending[0] == offset:
            pending.popleft()
            done = part.done
            while pending and pending[0] in done:
                done.remove(pending.popleft())
        else:
            part.done.add(offset)
        if self._in_flight == 0 and self._waiters:
            self._idle.notify_all()

    def committable(
        self, tps: Iterable[TopicPartition] | None = None
    ) -> dict[TopicPartition, OffsetAndMetadata]:
        """The next offset to commit for each partition that advanced since its last commit (or, before
        its first commit, since the offset reading started from): a commit that would move nothing is
        left out, so callers neither send it nor count it."""
        with self._lock:
            wanted = self._parts if tps is None else {tp: self._parts[tp] for tp in tps if tp in self._parts}
            out: dict[TopicPartition, OffsetAndMetadata] = {}
            for tp, part in wanted.items():
                point = part.commit_point()
                if point is not None and point != part.committed:
                    out[tp] = OffsetAndMetadata(point, "", -1)
            return out

    def mark_committed(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        """Record a successful commit, so `committable()` leaves those partitions out until they advance."""
        with self._lock:
            for tp, om in offsets.items():
                part = self._parts.get(tp)
                if part is not None:
                    part.committed = om.offset

    def revoke(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Stop tracking partitions. Returns, per partition that still had incomplete records, the lowest
        incomplete offset: the broker will re-deliver from there (to us or to the new owner)."""
        unfinished: dict[TopicPartition, int] = {}
        with self._lock:
            for tp in tps:
                part = self._parts.pop(tp, None)
                if part is None:
                    continue
                part.active = False
                if part.pending:
                    unfinished[tp] = part.pending[0]
                    self._in_flight -= len(part.pending) - len(part.done)
            if self._in_flight == 0 and self._waiters:
                self._idle.notify_all()
        return unfinished

    def in_flight_for(self, tps: Iterable[TopicPartition]) -> int:
        """Incomplete records of these partitions."""
        with self._lock:
            return sum(len(p.pending) - len(p.done) for tp in tps if (p := self._parts.get(tp)) is not None)

    def incomplete(self) -> dict[TopicPartition, int]:
        """Incomplete record count per tracked partition (for logs at shutdown)."""
        with self._lock:
            return {tp: n for tp, p in self._parts.items() if (n := len(p.pending) - len(p.done))}

    @property
    def in_flight(self) -> int:
        """Records tracked and not complete, over all active partitions."""
        return self._in_flight

    @property
    def partitions(self) -> set[TopicPartition]:
        with self._lock:
            return set(self._parts)

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is in flight or `timeout` seconds pass; True when idle."""
        with self._lock:
            self._waiters += 1
            try:
                return self._idle.wait_for(lambda: self._in_flight == 0, timeout)
            finally:
                self._waiters -= 1


# -- work handed on ----------------------------------------------------------------------------------


class Exports:
    """Work handed on that finishes by itself (a result awaiting the broker's ack, a judge running, a
    dead letter being sent), so a revocation or a shutdown waits for it; also the measure of a
    stage's in-flight cap. `start(ticket)` wraps a `Releasable`; its `release()` ends the work."""

    def __init__(self) -> None:
        self._count = 0
        self._waiters = 0
        self._cond = threading.Condition(threading.Lock())

    def start(self, inner: Releasable) -> Export:
        with self._cond:
            self._count += 1
        return Export(self, inner)

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


class Export:
    """One piece of work handed on (`Exports.start`); `release()` ends it and releases what it wraps."""

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
