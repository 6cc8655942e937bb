"""The statistics of a finding: how much likelier a verdict fails when a value is present.

For one (app, judge) window and one (dimension, value): `a` failing verdicts of the `n1` that have the
value, `c` failing of the `n2` that do not. The lift is the **rate ratio** (relative risk)

    lift = (a / n1) / (c / n2)

"a failing verdict is `lift` times as likely with the value as without it". Chosen over
P(value | failing) / P(value | passing) because it reads as a failure rate, which is what an operator
compares with the judge's pass rate, and its interval is standard: Katz's log interval,
exp(ln lift ± z·sqrt(1/a − 1/n1 + 1/c − 1/n2)), with 0.5 added to each cell (Haldane) when a cell is 0
so that a value every failure has still gets a finite, conservative interval.

Many values are tested per window, so `z` is Bonferroni-adjusted by the number of candidates tested
(`simultaneous_z`): with 200 doc_uris of pure noise a 95% per-value interval would still clear 1 about
five times. A candidate is significant when its interval's lower bound is above 1; candidates are
ranked by that lower bound (the conservative statistic), not by the point estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from tracejudge.metrics.judges.trust.agreement import wilson_interval

__all__ = ["Contrast", "contrast", "simultaneous_z", "wilson"]


def simultaneous_z(confidence: float, tests: int) -> float:
    """The two-sided normal quantile for `confidence`, Bonferroni-adjusted for `tests` intervals."""
    alpha = (1.0 - confidence) / max(1, tests)
    return NormalDist().inv_cdf(1.0 - alpha / 2.0)


def wilson(successes: int, n: int, z: float) -> tuple[float, float] | None:
    """The Wilson score interval of `successes` of `n` as (low, high); None when n is 0."""
    interval = wilson_interval(successes, n, z)
    return None if interval is None else (interval.low, interval.high)


@dataclass(frozen=True, slots=True)
class Contrast:
    """A value's failure rate against the rest of its window: the rate ratio and its interval."""

    failing_with: int
    total_with: int
    failing_without: int
    total_without: int
    lift: float
    low: float
    high: float

    @property
    def rate_with(self) -> float:
        return self.failing_with / self.total_with if self.total_with else 0.0

    @property
    def rate_without(self) -> float:
        return self.failing_without / self.total_without if self.total_without else 0.0


def contrast(failing_with: int, total_with: int, failing_all: int, total_all: int,
             z: float) -> Contrast | None:
    """The rate ratio of a value (`failing_with` of `total_with`) against the rest of the window
    (`failing_all` of `total_all` in all), with Katz's interval at `z`; None when there is no rest
    (every verdict has the value) or nothing to compare (no verdict with it)."""
    a, n1 = failing_with, total_with
    c, n2 = failing_all - failing_with, total_all - total_with
    if n1 <= 0 or n2 <= 0 or not 0 <= a <= n1 or not 0 <= c <= n2:
        return None
    fa, fn1, fc, fn2 = float(a), float(n1), float(c), float(n2)
    if a == 0 or c == 0 or a == n1 or c == n2:  # Haldane: 0.5 to each of the four cells
        fa, fn1, fc, fn2 = fa + 0.5, fn1 + 1.0, fc + 0.5, fn2 + 1.0
    lift = (fa / fn1) / (fc / fn2)
    se = math.sqrt(max(0.0, 1.0 / fa - 1.0 / fn1 + 1.0 / fc - 1.0 / fn2))
    log_lift = math.log(lift)
    return Contrast(a, n1, c, n2, lift, math.exp(log_lift - z * se), math.exp(log_lift + z * se))
