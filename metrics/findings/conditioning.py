"""Explaining correlates away: the per-verdict sample the conditioned tests of `window.analyse` run on.

A planted cause drags its correlates along: the topic whose requests call the failing tool 80% of the
time, the document retrieved with the stale one, the request cluster of that topic all fail more
often than the rest, only because they co-occur with the cause. The window's per-value counts cannot
tell the two apart (they are marginal), so `analyse` works iteratively: it accepts the best finding
of the marginal test, then re-tests the other candidates only on the verdicts WITHOUT the accepted
value(s), accepts the best of that conditioned test, and so on up to `top_k`. A value over-represented
only through the cause has the base failure rate once the cause's verdicts are set aside and loses
its lift; a second, independent cause keeps it.

The conditioned tests need each verdict's value set, which the counts do not keep: a `Reservoir` per
(app, judge) per window holds up to `FindingsOptions.sample` (verdict failed, value set) entries, a
uniform sample of the window's verdicts (Vitter's algorithm R, seeded: the same input gives the same
findings). What it does not keep is counted (`Reservoir.dropped`; `FindingsWindow.sample_dropped`).
While a window's verdicts fit, the conditioned test is exact; past it, it runs on the sample, and a
finding says so (`Finding.sampled`) with the sample's counts as its n. A value set is built once per
result and shared by its judges' entries.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable

__all__ = ["Entry", "Reservoir", "ValueKey", "conditioned_counts", "merged_reservoir"]

ValueKey = tuple[str, str]  # (dimension, value)
Entry = tuple[bool, frozenset[ValueKey]]  # (failed, the verdict's values)
_SEED = 26


class Reservoir:
    """A uniform sample of at most `capacity` of the verdicts offered (`seen`)."""

    __slots__ = ("_rng", "capacity", "entries", "seen")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: list[Entry] = []
        self.seen = 0
        self._rng: random.Random | None = None

    @property
    def dropped(self) -> int:
        """Verdicts offered but not in the sample."""
        return self.seen - len(self.entries)

    def slot(self) -> int:
        """Offer one verdict: the index its entry goes to (`put`), or -1 when the sample leaves it out
        (the caller then need not build the entry)."""
        self.seen += 1
        n = len(self.entries)
        if n < self.capacity:
            return n
        if self._rng is None:
            self._rng = random.Random(_SEED)
        j = self._rng.randrange(self.seen)
        return j if j < self.capacity else -1

    def put(self, index: int, entry: Entry) -> None:
        if index == len(self.entries):
            self.entries.append(entry)
        else:
            self.entries[index] = entry

    def add(self, entry: Entry) -> None:
        index = self.slot()
        if index >= 0:
            self.put(index, entry)


def merged_reservoir(parts: Iterable[Reservoir], capacity: int) -> Reservoir:
    """The panes' samples as one sample of the whole window: all entries while they fit, else from
    each pane a share of `capacity` in proportion to the verdicts it saw (so a busy pane is not
    under-represented), drawn at random (seeded)."""
    parts = [p for p in parts if p.seen]
    out = Reservoir(capacity)
    out.seen = sum(p.seen for p in parts)
    if sum(len(p.entries) for p in parts) <= capacity:
        for p in parts:
            out.entries.extend(p.entries)
        return out
    rng = random.Random(_SEED)
    for p in parts:
        k = min(len(p.entries), capacity * p.seen // out.seen)
        out.entries.extend(rng.sample(p.entries, k))
    return out


def conditioned_counts(entries: Iterable[Entry], without: Collection[ValueKey],
                       candidates: Collection[ValueKey]) -> tuple[int, int, dict[ValueKey, list[int]]]:
    """Over the entries that have none of the values `without`: (failing, total, {candidate:
    [failing, total]}) for each candidate present."""
    excluded = frozenset(without)
    wanted = frozenset(candidates)
    failing = total = 0
    cells: dict[ValueKey, list[int]] = {}
    for failed, values in entries:
        if not values.isdisjoint(excluded):
            continue
        total += 1
        failing += failed
        for key in values & wanted if len(values) > len(wanted) else (v for v in values if v in wanted):
            cell = cells.get(key)
            if cell is None:
                cell = cells[key] = [0, 0]
            cell[0] += failed
            cell[1] += 1
    return failing, total, cells
