"""How far the judges can be trusted, as Prometheus series: their calibration and their agreement with people.

    calibration file ──load at start──▶ tracejudge_judge_calibration{judge, stat}   (tpr, tnr, kappa, n)
      (`tracejudge calibrate`)          tracejudge_judge_calibration_stale{judge}   (1: fingerprint changed)
    human label + the judge's verdict ──▶ tracejudge_judge_agreement_total{app, judge, outcome}
    every label taken in ──────────────▶ tracejudge_judge_labels_total{outcome}

The calibration gauges feed the corrected pass-rate recording rule (Rogan–Gladen, in
deploy/prometheus/rules); a judge whose configuration changed since it was calibrated (its
`JudgeIdentity.version` differs from the file's) is marked stale, logged once, and the rule leaves its
corrected rate out. The stats are exported only for a calibration the file marks `calibrated`
(enough labels of each class,
 `tracejudge.metrics.judges.trust.agreement.MINIMUM_LABELS`): below that its rates say
too little to correct anything with, and only `n` is exported.

Labels are compared with the verdict the judge gave on the same record: a label that arrives with
its trace (`EvalRecord.human_labels`, in `tracejudge run`) or on a labels topic joined with the
results (`tracejudge agreement`). Label values are bounded: `judge` from configuration, `outcome` from
closed sets, `app` through the caller's limiter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tracejudge.metrics.app_labels import default_app_label
from tracejudge.schemas.result import EvaluationResult, JudgeIdentity

__all__ = ["LABEL_OUTCOMES", "STATS", "TrustMetrics", "label_passed",
           "load_calibration_gauges", "trust_for_run"]

log = logging.getLogger("tracejudge.trust")

STATS = ("tpr", "tnr", "kappa", "n")
# What happened to a human label: compared with a verdict (matched), no verdict to compare with in the
# window (unmatched), a judge tracejudge does not run (unknown_judge), a value that is no verdict (invalid).
LABEL_OUTCOMES = ("matched", "unmatched", "unknown_judge", "invalid")

def label_passed(value: Any) -> bool | None:
    """A person's verdict as pass (True) / fail (False), None when it is not one: "pass"/"fail" (and
    yes/no, true/false, ...), a bool, or a score in [0, 1] (pass from 0.5). The same reading as
    `tracejudge calibrate`'s (`tracejudge.schemas.formats.labels.label_passes`), so online agreement and the
    calibration count the same labels the same way."""
    from tracejudge.schemas.formats.labels import label_passes

    return label_passes(value)


class TrustMetrics:
    """The trust series on one registry (`tracejudge run`'s, or the agreement stage's)."""

    def __init__(self, registry: CollectorRegistry,
                 app_label: Callable[[str | None], str] = default_app_label,
                 judges: Iterable[str] | None = None) -> None:
        self.app_label = app_label
        # The judges a label may name (None: any name is taken as a judge's).
        self.judges = frozenset(judges) if judges is not None else None
        self.calibration = Gauge("tracejudge_judge_calibration", "The judge's measured agreement with "
                                 "human labels from its calibration file: stat tpr (true-pass rate), tnr "
                                 "(true-fail rate), kappa (Cohen's), n (labels).", ["judge", "stat"],
                                 registry=registry)
        self.calibration_stale = Gauge("tracejudge_judge_calibration_stale", "1 when the judge's "
                                       "configuration (its version fingerprint) differs from the one it "
                                       "was calibrated with.", ["judge"], registry=registry)
        self.agreement = Counter("tracejudge_judge_agreement", "Human labels compared with the judge's "
                                 "verdict on the same trace; outcome agree or disagree.",
                                 ["app", "judge", "outcome"], registry=registry)
        self.labels = Counter("tracejudge_judge_labels", "Human labels taken in, by outcome: matched, "
                              "unmatched (no verdict to compare with), unknown_judge, invalid.",
                              ["outcome"], registry=registry)
        for outcome in LABEL_OUTCOMES:
            self.labels.labels(outcome)

    def count_label(self, outcome: str, n: int = 1) -> None:
        self.labels.labels(outcome).inc(n)

    def agree(self, app: str | None, judge: str, human: bool, judged: bool) -> None:
        """One matched label: its app goes through the limiter."""
        self.labels.labels("matched").inc()
        self.agreement.labels(self.app_label(app), judge, "agree" if human == judged else "disagree").inc()

    def observe_result(self, result: EvaluationResult) -> None:
        """The labels that came with a judged record (`EvalRecord.human_labels`) against the verdicts
        on it. Shadow judges' verdicts are not the live judge's and are not compared."""
        labels = result.record.human_labels
        if not labels:
            return
        verdicts = {a.name: a.passed for a in result.assessments if a.shadow_of is None}
        for label in labels:
            self.observe_label(result.record.app, label.name, label.value, verdicts)

    def rejects(self, judge: Any, value: Any) -> str | None:
        """Why a label can never be compared ("unknown_judge", "invalid"), None when it can."""
        if not isinstance(judge, str) or not judge:
            return "invalid"
        if self.judges is not None and judge not in self.judges:
            return "unknown_judge"
        return "invalid" if label_passed(value) is None else None

    def observe_label(self, app: str | None, judge: Any, value: Any,
                      verdicts: Mapping[str, bool | None]) -> str:
        """One label against the verdicts on its record (judge name -> passed, None when the judge
        gave none: skipped, errored); returns the label's outcome, counted."""
        outcome = self.rejects(judge, value)
        if outcome is None:
            judged = verdicts.get(judge)
            human = label_passed(value)
            if judged is None or human is None:
                outcome = "unmatched"
            else:
                self.agree(app, judge, human, judged)
                return "matched"
        self.count_label(outcome)
        return outcome

    def set_calibration(self, judge: str, *, n: int, tpr: float | None, tnr: float | None,
                        kappa: float | None, calibrated: bool, stale: bool) -> None:
        """`calibrated` False (too few labels): only `n` is exported."""
        self.calibration.labels(judge, "n").set(n)
        if calibrated:
            for stat, value in (("tpr", tpr), ("tnr", tnr), ("kappa", kappa)):
                if value is not None:
                    self.calibration.labels(judge, stat).set(value)
        self.calibration_stale.labels(judge).set(1 if stale else 0)


def load_calibration_gauges(path: str, identities: Mapping[str, JudgeIdentity],
                            metrics: TrustMetrics) -> list[str]:
    """Export the calibration of each running judge (name -> its current identity) from the
    calibration file at `path` (`tracejudge.metrics.judges.trust.calibration`); returns the judges marked
    stale.
    A judge the file does not know gets no series (it is not calibrated). A stale judge (calibrated,
    but never in the version it runs now) gets its most recent calibration's stats with stale 1, and
    one WARNING naming it. Raises `CalibrationError` when the file cannot be read."""
    from tracejudge.metrics.judges.trust.calibration import load

    calibrations = load(path)
    stale: list[str] = []
    for judge, identity in identities.items():
        entry = calibrations.get(judge, identity)
        is_stale = calibrations.stale(judge, identity)
        if is_stale:
            entry = max(calibrations.judges[judge].values(), key=lambda c: c.created_at)
        if entry is None:
            continue
        metrics.set_calibration(judge, n=entry.n, tpr=entry.tpr, tnr=entry.tnr, kappa=entry.kappa,
                                calibrated=entry.calibrated, stale=is_stale)
        if is_stale:
            stale.append(judge)
            log.warning("judge %s runs version %s but was calibrated as %s: its calibration is stale "
                        "(its corrected pass rate is withheld); run `tracejudge calibrate` again",
                        judge, identity.version, entry.version)
        elif not entry.calibrated:
            log.warning("judge %s: its calibration has too few labels (%d) to correct its pass rate",
                        judge, entry.n)
    return stale


def trust_for_run(judges: Any, registry: CollectorRegistry,
                  app_label: Callable[[str | None], str]) -> TrustMetrics | None:
    """`tracejudge run`'s trust series for its `JudgeRunner` (None without judges), with the judges'
    calibration exported from `judges.calibration_file` when one is set. Raises `CalibrationError`."""
    if judges is None:
        return None
    identities = judges.identities()
    metrics = TrustMetrics(registry, app_label, judges=identities)
    path = judges.config.calibration_file
    if path:
        load_calibration_gauges(path, identities, metrics)
    return metrics
