"""How far a judge agrees with people: the statistics behind `tracejudge calibrate`.

"pass" is the positive class. Against human labels a judge's verdicts form a confusion matrix:

                    judge pass   judge fail
    human pass        tp            fn        TPR = tp / (tp + fn)   (true-pass rate)
    human fail        fp            tn        TNR = tn / (tn + fp)   (true-fail rate)

Balanced accuracy = (TPR + TNR) / 2; Cohen's kappa = (p_o - p_e) / (1 - p_e), agreement beyond
chance. Every rate comes with a 95% interval (Wilson score intervals for TPR/TNR, which stay inside
[0, 1] and keep their coverage at small n and near 0 or 1, where the normal approximation does not;
the large-sample standard error of kappa), and nothing is called calibrated below `MINIMUM_LABELS`
labels of each class: with 10 human fails a TNR of 0.9 has a 95% interval of about [0.60, 0.98],
which says little about the judge.

`corrected_rate` is the Rogan–Gladen estimator: the pass rate a judge with known TPR/TNR observes is
biased toward 50%, and (observed + TNR - 1) / (TPR + TNR - 1) undoes that. It is None when
TPR + TNR <= 1: such a judge is no better than a coin and its verdicts carry no information.

Hand-written (a few lines each) rather than imported: scipy and statsmodels have these intervals but
are not tracejudge dependencies, and the stream reads calibration files without either. The tests
check these functions against scipy's results and against hand-computed values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "MINIMUM_LABELS",
    "Agreement",
    "Confusion",
    "Interval",
    "cohen_kappa",
    "corrected_rate",
    "wilson_interval",
]

# Labels of each class (human pass, human fail) below which a judge is not shown as calibrated: at
# 30 labels a Wilson interval around a rate of 0.9 is still about ±0.1 wide; fewer is noise.
MINIMUM_LABELS = 30

# The two-sided 95% normal quantile.
Z95 = 1.959963984540054


@dataclass(frozen=True, slots=True)
class Interval:
    """A 95% confidence interval [low, high]."""

    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def __str__(self) -> str:
        return f"[{self.low:.3f}, {self.high:.3f}]"


def wilson_interval(successes: int, n: int, z: float = Z95) -> Interval | None:
    """The Wilson score interval for `successes` out of `n` (None when n is 0)."""
    if n <= 0:
        return None
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Interval(max(0.0, centre - half), min(1.0, centre + half))


def cohen_kappa(tp: int, fn: int, fp: int, tn: int) -> tuple[float | None, Interval | None]:
    """Cohen's kappa of a 2x2 table and its 95% interval from the large-sample standard error
    sqrt(p_o (1 - p_o) / (n (1 - p_e)^2)) (Cohen 1960), clipped to [-1, 1]. (None, None) with no
    labels; kappa is None when p_e is 1 (both raters always said the same class: undefined)."""
    n = tp + fn + fp + tn
    if n == 0:
        return None, None
    p_o = (tp + tn) / n
    human_pass, judge_pass = (tp + fn) / n, (tp + fp) / n
    p_e = human_pass * judge_pass + (1 - human_pass) * (1 - judge_pass)
    if p_e >= 1.0:
        return None, None
    kappa = (p_o - p_e) / (1 - p_e)
    se = math.sqrt(p_o * (1 - p_o) / (n * (1 - p_e) ** 2))
    return kappa, Interval(max(-1.0, kappa - Z95 * se), min(1.0, kappa + Z95 * se))


def corrected_rate(observed: float, tpr: float, tnr: float) -> float | None:
    """Rogan–Gladen: the true pass rate behind an `observed` one, clipped to [0, 1]; None when
    TPR + TNR <= 1 (the judge is no better than chance)."""
    youden = tpr + tnr - 1.0
    if youden <= 0.0:
        return None
    return min(1.0, max(0.0, (observed + tnr - 1.0) / youden))


@dataclass(slots=True)
class Confusion:
    """Counts of (human, judge) verdict pairs, "pass" positive."""

    tp: int = 0
    fn: int = 0
    fp: int = 0
    tn: int = 0

    def add(self, human_pass: bool, judge_pass: bool) -> None:
        if human_pass:
            if judge_pass:
                self.tp += 1
            else:
                self.fn += 1
        elif judge_pass:
            self.fp += 1
        else:
            self.tn += 1

    @classmethod
    def of(cls, pairs: Iterable[tuple[bool, bool]]) -> Confusion:
        """From (human_pass, judge_pass) pairs."""
        c = cls()
        for human, judge in pairs:
            c.add(human, judge)
        return c

    @property
    def n(self) -> int:
        return self.tp + self.fn + self.fp + self.tn

    def agreement(self) -> Agreement:
        return Agreement.of(self)


@dataclass(frozen=True, slots=True)
class Agreement:
    """Everything `calibrate` reports for one judge. Rates are None when their class has no labels."""

    confusion: Confusion
    tpr: float | None
    tnr: float | None
    tpr_interval: Interval | None
    tnr_interval: Interval | None
    balanced_accuracy: float | None
    kappa: float | None
    kappa_interval: Interval | None

    @classmethod
    def of(cls, c: Confusion) -> Agreement:
        positives, negatives = c.tp + c.fn, c.tn + c.fp
        tpr = c.tp / positives if positives else None
        tnr = c.tn / negatives if negatives else None
        balanced = (tpr + tnr) / 2 if tpr is not None and tnr is not None else None
        kappa, kappa_interval = cohen_kappa(c.tp, c.fn, c.fp, c.tn)
        return cls(c, tpr, tnr, wilson_interval(c.tp, positives), wilson_interval(c.tn, negatives),
                   balanced, kappa, kappa_interval)

    @property
    def n(self) -> int:
        return self.confusion.n

    @property
    def enough_labels(self) -> bool:
        """At least `MINIMUM_LABELS` human passes and as many human fails."""
        c = self.confusion
        return c.tp + c.fn >= MINIMUM_LABELS and c.tn + c.fp >= MINIMUM_LABELS

    def corrected(self, observed: float) -> float | None:
        """The Rogan–Gladen corrected pass rate, only when calibrated (`enough_labels`)."""
        if not self.enough_labels or self.tpr is None or self.tnr is None:
            return None
        return corrected_rate(observed, self.tpr, self.tnr)
