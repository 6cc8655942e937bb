"""A window of verdicts and what is over-represented among its failing ones (`FindingsWindow.analyse`).

Per (app, judge) the window counts verdicts (passed or failed) and, per dimension value, how many of
them had the value and how many of those failed, with up to `examples` failing trace ids. Memory is
bounded: at most `max_groups` (app, judge) pairs (verdicts of further pairs are counted in
`dropped_verdicts` and not kept) and `max_values` values per dimension per pair. When a dimension is
full, its half with the fewest failing verdicts (then the fewest verdicts) is forgotten to make room,
each forgotten value counted in `dropped_values[dimension]`: a value that comes back starts from zero,
so its counts can only be too low, never too high.

`analyse` applies the statistics (`stats.py`) to every candidate: at least `min_failing` failing
verdicts with the value and at least `min_share` of the pair's failing verdicts; significant when the
Bonferroni-adjusted interval of the lift is above 1. The findings of a pair are chosen one at a time,
each conditioned on those before it (`conditioning.py`): rank 1 is the candidate with the highest
lower bound in the whole window (the marginal test, on the exact counts); rank r + 1 the highest among
the remaining candidates re-tested on the verdicts WITHOUT any of the values of ranks 1..r (on the
pair's sample of value sets), so a correlate of an accepted cause, over-represented only because it
co-occurs with it, is explained away; up to `top_k`. A conditioned finding's failing/total and
window_failing/window_total are the counts of its own test (the verdicts left), its `conditioned_on`
the values set aside. The interval of every test is Bonferroni-adjusted for m·k tests (m candidates,
k = min(top_k, m) rounds at most): the whole procedure, not one round, holds `confidence`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tracejudge.metrics.findings.clusters import RequestClusterer
from tracejudge.metrics.findings.conditioning import Reservoir, ValueKey, conditioned_counts, merged_reservoir
from tracejudge.metrics.findings.dimensions import DIMENSIONS, dimension_values, verdicts
from tracejudge.metrics.findings.stats import Contrast, contrast, simultaneous_z
from tracejudge.schemas.result import EvaluationResult

__all__ = ["FINDING_KIND", "Finding", "FindingsOptions", "FindingsWindow", "GroupCounts"]

FINDING_KIND = "finding"
# On a tie (the same verdicts), the more specific dimension is named: a tool's failures before the tool.
_PREFERENCE = {"tool_error": 0}
# An app name longer than this is cut: the (app, judge) key is bounded.
APP_MAX_CHARS = 100


@dataclass(frozen=True, slots=True)
class FindingsOptions:
    """The analysis (the `findings:` keys of the same names)."""

    min_failing: int = 5
    min_share: float = 0.05
    confidence: float = 0.95
    top_k: int = 10
    max_values: int = 1000
    max_groups: int = 1000
    examples: int = 5
    dimensions: tuple[str, ...] = DIMENSIONS
    # Verdicts (value sets) kept per (app, judge) per window for the conditioned tests.
    sample: int = 5000


@dataclass(slots=True)
class Finding:
    """One value over-represented among an (app, judge)'s failing verdicts in a window. `to_dict` is the
    stable JSON shape (docs/pages/guides/findings.md)."""

    app: str
    judge: str
    dimension: str
    value: str
    label: str | None
    failing: int
    total: int
    window_failing: int
    window_total: int
    lift: float
    lift_interval: tuple[float, float]
    failure_rate_with: float
    failure_rate_without: float
    rank: int
    example_trace_ids: list[str]
    window_start: float | None
    window_end: float | None
    # The findings of higher rank whose verdicts this one's test set aside ("dimension=value").
    conditioned_on: list[str] = field(default_factory=list)
    # Its test ran on a sample of the verdicts left (the window had more than `sample`).
    sampled: bool = False
    # A request cluster named by `findings.clustering.name_with`: its characteristic words (`label` is
    # then the name); otherwise None.
    label_words: str | None = None

    @property
    def support(self) -> float:
        """The share of the window's failing verdicts that had the value."""
        return self.failing / self.window_failing if self.window_failing else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": FINDING_KIND, "app": self.app, "judge": self.judge, "dimension": self.dimension,
                "value": self.value, "label": self.label, "failing": self.failing, "total": self.total,
                "support": round(self.support, 6), "lift": round(self.lift, 6),
                "lift_interval": [round(self.lift_interval[0], 6), round(self.lift_interval[1], 6)],
                "failure_rate_with": round(self.failure_rate_with, 6),
                "failure_rate_without": round(self.failure_rate_without, 6),
                "window_failing": self.window_failing, "window_total": self.window_total,
                "rank": self.rank, "example_trace_ids": list(self.example_trace_ids),
                "window": {"start": self.window_start, "end": self.window_end},
                "conditioned_on": list(self.conditioned_on), "sampled": self.sampled,
                "label_words": self.label_words}


@dataclass(slots=True)
class _Cell:
    total: int = 0
    failing: int = 0
    examples: list[str] = field(default_factory=list)


@dataclass(slots=True)
class GroupCounts:
    """One (app, judge)'s counts in a window."""

    total: int = 0
    failing: int = 0
    values: dict[str, dict[str, _Cell]] = field(default_factory=dict)
    # The verdicts' value sets, for the conditioned tests (None: `sample` is 0).
    reservoir: Reservoir | None = None


class FindingsWindow:
    """The counts of one window (or one pane of a sliding window: `merged` adds panes up)."""

    def __init__(self, options: FindingsOptions | None = None, clusterer: RequestClusterer | None = None,
                 *, start: float | None = None) -> None:
        self.options = options or FindingsOptions()
        self.clusterer = clusterer
        self.enabled = frozenset(self.options.dimensions)
        self.groups: dict[tuple[str, str], GroupCounts] = {}
        self.dropped_values: dict[str, int] = {}
        self.dropped_verdicts = 0
        # Given a start (the stream's wall-clock window), the window's times are its own; without one
        # (files) they are the earliest and latest record times seen.
        self.start = start
        self.fixed = start is not None
        self.end: float | None = None
        self.verdicts = 0
        self.failing = 0

    def add(self, result: EvaluationResult) -> int:
        """Count a result's verdicts with its values; returns how many verdicts were counted."""
        judged = verdicts(result)
        if not judged:
            return 0
        rec = result.record
        if rec.timestamp is not None and not self.fixed:
            self._saw(rec.timestamp)
        values = dimension_values(result, self.enabled, self.clusterer)
        return self.add_values((rec.app or "unknown")[:APP_MAX_CHARS], judged, values,
                               rec.trace_id or rec.request_id)

    def _saw(self, ts: float) -> None:
        self.start = ts if self.start is None else min(self.start, ts)
        self.end = ts if self.end is None else max(self.end, ts)

    def add_values(self, app: str, judged: Iterable[tuple[str, bool]], values: Mapping[str, Iterable[str]],
                   trace_id: str | None) -> int:
        counted = 0
        keys: frozenset[ValueKey] | None = None  # built once, shared by the judges' sample entries
        sample = self.options.sample
        for judge, passed in judged:
            group = self.groups.get((app, judge))
            if group is None:
                if len(self.groups) >= self.options.max_groups:
                    self.dropped_verdicts += 1
                    continue
                group = self.groups[(app, judge)] = GroupCounts(
                    reservoir=Reservoir(sample) if sample > 0 else None)
            counted += 1
            group.total += 1
            failed = not passed
            group.failing += failed
            self.failing += failed
            reservoir = group.reservoir
            if reservoir is not None and (slot := reservoir.slot()) >= 0:
                if keys is None:
                    keys = frozenset((dim, v) for dim, vals in values.items() for v in vals)
                reservoir.put(slot, (failed, keys))
            for dim, vals in values.items():
                cells = group.values.get(dim)
                if cells is None:
                    cells = group.values[dim] = {}
                for v in vals:
                    cell = cells.get(v)
                    if cell is None:
                        if len(cells) >= self.options.max_values:
                            self._prune(dim, cells)
                        cell = cells[v] = _Cell()
                    cell.total += 1
                    if failed:
                        cell.failing += 1
                        if trace_id and len(cell.examples) < self.options.examples:
                            cell.examples.append(trace_id)
        self.verdicts += counted
        return counted

    @property
    def sample_dropped(self) -> int:
        """Verdicts of the window not in their pair's sample (the conditioned tests ran without them)."""
        return sum(g.reservoir.dropped for g in self.groups.values() if g.reservoir is not None)

    def _prune(self, dim: str, cells: dict[str, _Cell]) -> None:
        """Forget the half of a full dimension with the fewest failing verdicts, then verdicts."""
        order = sorted(cells.items(), key=lambda kv: (kv[1].failing, kv[1].total))
        gone = order[:max(1, len(order) // 2)]
        for value, _ in gone:
            del cells[value]
        self.dropped_values[dim] = self.dropped_values.get(dim, 0) + len(gone)

    @classmethod
    def merged(cls, panes: list[FindingsWindow]) -> FindingsWindow:
        """The panes of a sliding window added up into one window (same options and clusterer as the
        first); each dimension still bounded by `max_values`."""
        first = panes[0]
        out = cls(first.options, first.clusterer, start=first.start)
        for pane in panes:
            out.dropped_verdicts += pane.dropped_verdicts
            out.verdicts += pane.verdicts
            out.failing += pane.failing
            for dim, n in pane.dropped_values.items():
                out.dropped_values[dim] = out.dropped_values.get(dim, 0) + n
            if pane.start is not None and not out.fixed:
                out.start = pane.start if out.start is None else min(out.start, pane.start)
            if pane.end is not None and not out.fixed:
                out.end = pane.end if out.end is None else max(out.end, pane.end)
            for key, group in pane.groups.items():
                mine = out.groups.setdefault(key, GroupCounts())
                if group.reservoir is not None:
                    mine.reservoir = merged_reservoir([*([mine.reservoir] if mine.reservoir else []),
                                                       group.reservoir], out.options.sample)
                mine.total += group.total
                mine.failing += group.failing
                for dim, cells in group.values.items():
                    target = mine.values.setdefault(dim, {})
                    for value, cell in cells.items():
                        t = target.get(value)
                        if t is None:
                            if len(target) >= out.options.max_values:
                                out._prune(dim, target)
                            t = target[value] = _Cell()
                        t.total += cell.total
                        t.failing += cell.failing
                        room = out.options.examples - len(t.examples)
                        if room > 0:
                            t.examples.extend(cell.examples[:room])
        return out

    def analyse(self, *, end: float | None = None,
                label: Callable[[str, str], str | None] | None = None) -> list[Finding]:
        """The findings of every (app, judge), each pair's ranked 1..top_k, pairs in name order.
        `end` closes the window (default: the latest record time seen); `label(dimension, value)`
        names a value (default: the clusterer's label of a request cluster)."""
        o = self.options
        end = end if end is not None else self.end
        name = label or self._label
        out: list[Finding] = []
        for (app, judge), group in sorted(self.groups.items()):
            if group.failing < o.min_failing or group.failing >= group.total:
                continue
            floor = max(o.min_failing, o.min_share * group.failing)
            candidates = {(dim, value): cell for dim, cells in sorted(group.values.items())
                          for value, cell in cells.items()
                          if cell.failing >= floor and cell.total < group.total}
            rounds = min(o.top_k, len(candidates))
            z = simultaneous_z(o.confidence, len(candidates) * rounds)
            best = _best({k: (c.failing, c.total) for k, c in candidates.items()}, group.failing,
                         group.total, z)
            accepted: list[ValueKey] = []
            while best is not None:
                (dim, value), c = best
                cell = candidates.pop((dim, value))
                out.append(Finding(app, judge, dim, value, name(dim, value), c.failing_with, c.total_with,
                                   c.failing_with + c.failing_without, c.total_with + c.total_without,
                                   c.lift, (c.low, c.high), c.rate_with, c.rate_without, len(accepted) + 1,
                                   list(cell.examples), self.start, end,
                                   [f"{d}={v}" for d, v in accepted],
                                   bool(accepted) and group.reservoir is not None
                                   and group.reservoir.dropped > 0))
                accepted.append((dim, value))
                if len(accepted) >= o.top_k or not candidates or group.reservoir is None:
                    break
                best = self._conditioned_best(group.reservoir, accepted, candidates, z)
        return out

    def _conditioned_best(self, reservoir: Reservoir, accepted: list[ValueKey],
                          candidates: Mapping[ValueKey, _Cell], z: float) -> tuple[ValueKey, Contrast] | None:
        """The best remaining candidate on the sampled verdicts without any accepted value."""
        failing, total, cells = conditioned_counts(reservoir.entries, accepted, candidates)
        o = self.options
        if failing < o.min_failing or failing >= total:
            return None
        floor = max(o.min_failing, o.min_share * failing)
        counts = {k: (f, n) for k, (f, n) in cells.items() if f >= floor and n < total}
        return _best(counts, failing, total, z)

    def _label(self, dimension: str, value: str) -> str | None:
        if dimension == "request_cluster" and self.clusterer is not None:
            return self.clusterer.label(value)
        return None


def _best(counts: Mapping[ValueKey, tuple[int, int]], failing: int, total: int,
          z: float) -> tuple[ValueKey, Contrast] | None:
    """The candidate (failing, total with it) whose lift's interval at `z` has the highest lower bound
    above 1 (ties: the higher lift, more failing verdicts, `tool_error` before other dimensions, then by
    name); None when none is above 1."""
    top: tuple[tuple[float, float, int, int, str, str], ValueKey, Contrast] | None = None
    for key, (f, n) in counts.items():
        c = contrast(f, n, failing, total, z)
        if c is None or c.low <= 1.0:
            continue
        rank = (-c.low, -c.lift, -f, _PREFERENCE.get(key[0], 1), key[0], key[1])
        if top is None or rank < top[0]:
            top = (rank, key, c)
    return None if top is None else (top[1], top[2])
