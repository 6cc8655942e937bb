"""The results a sink deferred, parked until they are due again (a part of the sink stage).

A sink that cannot write a record *yet* (the MLflow sink: its trace has not reached the server) defers
it (`WriteReport.defer(record, reason, after_s)`) instead of holding the whole partition. The sink stage
(`tracejudge.consumer.stages.sink`) keeps such a record here with its ticket, unreleased, so the runtime
never commits past it (`tracejudge.consumer.runtime.offsets`: a partition commits up to its lowest
incomplete offset), and offers it again in a batch of its own once due, while the partition's later
records are written meanwhile. Bounded over every partition: `room()` says how many more fit, and the
stage holds a partition when none do. In memory only: after a crash the uncommitted records are read
again and the sink's idempotent writes make that harmless.
"""

from __future__ import annotations

from dataclasses import dataclass

from kafka.structs import TopicPartition

from tracejudge.consumer.runtime.offsets import Ticket
from tracejudge.consumer.sinks.base import SinkRecord

__all__ = ["Parked", "ParkedSet"]


@dataclass(slots=True)
class Parked:
    """One deferred record: the record, its unreleased ticket, when it is due, why it waits."""

    record: SinkRecord
    ticket: Ticket
    due: float
    reason: str
    # When it was first parked, and how many times it has been offered again since.
    since: float
    offers: int = 0


class ParkedSet:
    """Parked records per partition, at most `limit` in all (0: none is ever parked)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts: dict[TopicPartition, dict[int, Parked]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def room(self) -> int:
        """How many more records may be parked now."""
        return max(0, self.limit - self._count)

    def count(self, tp: TopicPartition) -> int:
        return len(self._parts.get(tp, ()))

    def park(self, tp: TopicPartition, item: Parked) -> None:
        """Park `item` (the caller checked `room()`, or re-parks what it just took out)."""
        part = self._parts.setdefault(tp, {})
        if item.record.offset not in part:
            self._count += 1
        part[item.record.offset] = item

    def take_due(self, tp: TopicPartition, now: float, limit: int) -> list[Parked]:
        """Take out the partition's records due by `now`, in offset order, at most `limit`."""
        part = self._parts.get(tp)
        if not part:
            return []
        offsets = sorted(o for o, p in part.items() if p.due <= now)[:limit]
        return [self._pop(tp, part, o) for o in offsets]

    def take_all(self, tp: TopicPartition, limit: int) -> list[Parked]:
        """Take out the partition's records whatever their due time (a shutdown's last offer)."""
        part = self._parts.get(tp)
        if not part:
            return []
        return [self._pop(tp, part, o) for o in sorted(part)[:limit]]

    def _pop(self, tp: TopicPartition, part: dict[int, Parked], offset: int) -> Parked:
        item = part.pop(offset)
        self._count -= 1
        if not part:
            del self._parts[tp]
        return item

    def next_due(self) -> float | None:
        """The earliest due time of any parked record; None when none is parked."""
        return min((p.due for part in self._parts.values() for p in part.values()), default=None)

    def partitions(self) -> list[TopicPartition]:
        return list(self._parts)

    def drop(self, tp: TopicPartition) -> int:
        """Forget the partition's records (revoked: the next owner reads them again); how many."""
        part = self._parts.pop(tp, None)
        n = len(part) if part else 0
        self._count -= n
        return n
