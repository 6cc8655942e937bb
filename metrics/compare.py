"""A run against a baseline run: per judge and pass/fail metric, the pass rate then and now and an
interval for the difference, so a release gate fails on a real drop and not on noise.

The rows are paired: both runs evaluated the same dataset, so each row of the new run is compared with
the same row of the baseline (the same request: its text, the n-th occurrence of a text with the n-th).
Pairing removes the row-to-row variation (hard questions are hard in both runs), so the interval of a
paired difference is narrower than that of two independent samples of the same size. The interval is
Newcombe's hybrid score interval for a difference of paired proportions (Newcombe 1998, "Improved
confidence intervals for the difference between binomial proportions based on paired data", method 10):
the Wilson score intervals of the two pass rates combined with the correlation of the pairs. It stays
inside [-1, 1], is never degenerate at 0% or 100%, and keeps close to its nominal coverage on the small
samples release datasets are.

What a row says for one name (`outcomes`): passed (True), failed (False) or nothing (None): a judge that
errored, was skipped or does not apply gives no evidence either way and the row is left out of that
name's pairs; a failed trace (the app failed to answer, `tracejudge eval --app`) is a failure for every
judge and metric of the row, never a pass and never left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tracejudge.schemas.result import FAILED, PASSED, EvaluationResult, assessment_status

__all__ = ["BINARY_METRICS", "Difference", "PairedRuns", "RowKeys", "evidence", "newcombe_paired",
           "outcomes", "wilson"]

# Computed metrics that are a pass (1) or a fail (0) per record: compared as judges are.
BINARY_METRICS = frozenset({
    "retrieval_hit_rate",
    "trajectory_exact_match",
    "trajectory_in_order_match",
    "trajectory_any_order_match",
    "trajectory_single_tool_use",
})
Z95 = 1.959963984540054


def wilson(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion `passed / n` ((0, 1) for n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = passed / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_paired(both: int, new_only: int, base_only: int, neither: int,
                    z: float = Z95) -> tuple[float, float, float]:
    """(difference, low, high) of new pass rate - baseline pass rate over paired rows.

    `both`: rows passing in both runs; `new_only`: passing now, failing in the baseline; `base_only`:
    the reverse; `neither`: failing in both. Newcombe's method 10: with Wilson intervals (l1, u1) of
    the new rate p1 and (l2, u2) of the baseline rate p2, and phi the correlation of the 2x2 table
    (its cross term `both * neither - new_only * base_only` less n/2 when above n/2, 0 between 0 and
    n/2, as Newcombe corrects it; 0 when a margin is empty),
        low  = d - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2)
        high = d + sqrt((u1 - p1)^2 - 2 phi (u1 - p1)(p2 - l2) + (p2 - l2)^2)."""
    n = both + new_only + base_only + neither
    if n == 0:
        raise ValueError("no paired rows")
    p1, p2 = (both + new_only) / n, (both + base_only) / n
    l1, u1 = wilson(both + new_only, n, z)
    l2, u2 = wilson(both + base_only, n, z)
    margins = (both + new_only) * (base_only + neither) * (both + base_only) * (new_only + neither)
    # Newcombe's correction of phi: a positive association counts only beyond n/2 (never negative).
    cross = both * neither - new_only * base_only
    cross = cross - n / 2 if cross > n / 2 else min(cross, 0)
    phi = cross / math.sqrt(margins) if margins else 0.0
    d = p1 - p2
    low = d - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = d + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return d, max(-1.0, low), min(1.0, high)


def outcomes(result: EvaluationResult) -> dict[str, bool | None]:
    """Each live judge's and binary metric's outcome on one result: True passed, False failed, None no
    evidence. A failed trace fails every name it has (its judges were skipped as `failed_trace`)."""
    failed = bool(result.record.failed)
    out: dict[str, bool | None] = {}
    for a in result.assessments:
        if a.shadow_of is not None:
            continue
        status = assessment_status(a)
        out[a.name] = False if failed else (True if status == PASSED else False if status == FAILED else None)
    for name in BINARY_METRICS:
        value = result.metrics.get(name)
        if value is not None:
            out[name] = False if failed else value >= 1.0
    return out


class RowKeys:
    """The pairing key of each row in turn: its request text and which occurrence of that text it is
    (a dataset may ask the same question twice); None for a row without a request."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def next(self, request: str | None) -> tuple[str, int] | None:
        if request is None:
            return None
        n = self._seen.get(request, 0)
        self._seen[request] = n + 1
        return request, n


@dataclass(frozen=True)
class Difference:
    """One name compared: pass counts over the `n` paired rows, the difference new - baseline with
    its interval, and the verdict against `margin` (worse: high < -margin; better: low > 0)."""

    name: str
    n: int
    baseline_passed: int
    new_passed: int
    difference: float
    low: float
    high: float
    margin: float

    @property
    def worse(self) -> bool:
        return self.high < -self.margin

    @property
    def verdict(self) -> str:
        if self.worse:
            return "worse"
        if self.low > 0:
            return "better"
        return "no significant change"


@dataclass
class PairedRuns:
    """The rows of two runs by key, and what pairs them (`differences`)."""

    baseline: dict[tuple[str, int], dict[str, bool | None]]
    new: dict[tuple[str, int], dict[str, bool | None]]

    @property
    def common(self) -> list[tuple[str, int]]:
        return [k for k in self.new if k in self.baseline]

    def names(self) -> list[str]:
        """Every name either run has, in first-seen order (the new run's first)."""
        seen: dict[str, None] = {}
        for rows in (self.new, self.baseline):
            for row in rows.values():
                seen.update(dict.fromkeys(row))
        return list(seen)

    def differences(self, margin: float = 0.0) -> dict[str, Difference | None]:
        """Per name, the paired comparison; None for a name with no row judged in both runs."""
        out: dict[str, Difference | None] = {}
        common = self.common
        for name in self.names():
            table = _table((self.new[k].get(name), self.baseline[k].get(name)) for k in common)
            both, new_only, base_only, neither = table
            n = sum(table)
            if n == 0:
                out[name] = None
                continue
            d, low, high = newcombe_paired(both, new_only, base_only, neither)
            out[name] = Difference(name, n, both + base_only, both + new_only, d, low, high, margin)
        return out


def _table(pairs: Iterable[tuple[bool | None, bool | None]]) -> tuple[int, int, int, int]:
    both = new_only = base_only = neither = 0
    for new, base in pairs:
        if new is None or base is None:
            continue
        if new and base:
            both += 1
        elif new:
            new_only += 1
        elif base:
            base_only += 1
        else:
            neither += 1
    return both, new_only, base_only, neither


def evidence(rows: Mapping[tuple[str, int], Mapping[str, bool | None]], name: str) -> int:
    """Rows of one run with a verdict for `name`."""
    return sum(1 for row in rows.values() if row.get(name) is not None)
