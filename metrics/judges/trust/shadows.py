"""Shadow judges: a candidate judge (a new prompt, model or endpoint) beside the live judge it may replace.

A candidate is configured under `judges.shadow` (`{name: {shadows: <live judge>, model?, settings}}`,
see `JudgesConfig.shadow_judges`). It runs on exactly the records its live judge sampled: the same
deterministic sample point and the live judge's rate and filters, decided in the same planning pass
(`tracejudge.metrics.judges.planning.Planner`),
so the two verdicts on a record are a fair pair. Its assessments go on the result line with
`shadow_of=<live judge>` but never into the quality series (`tracejudge_judge_verdicts_total`,
`tracejudge_judge_score`); instead each pair where both gave a verdict counts in
`tracejudge_judge_shadow_total{judge, shadow, outcome="agree"|"disagree"}`. Its cost, errors, skips and
duration are counted as any judge's (they are operational, not quality). The sinks write nothing for
shadow assessments (counted as skipped, reason `shadow`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tracejudge.metrics.judges.config import ShadowJudge
from tracejudge.metrics.judges.planning import Configured
from tracejudge.metrics.judges.series import JudgeMetrics
from tracejudge.schemas.result import Assessment

# Configures one judge: (name, settings, kind, model) -> Configured (the runner's clients and budgets).
MakeJudge = Callable[[str, Any, str, "str | None"], Configured]

__all__ = ["compare_shadows", "configure_shadows"]


def configure_shadows(
    live: list[Configured], shadows: Mapping[str, ShadowJudge], make: MakeJudge
) -> list[Configured]:
    """The shadow judges, each made by `make` with its live judge's sample rate and filters (placed
    after the live judges, so the planner has decided the live judge's sample when it reaches the
    shadow)."""
    by_name = {c.name: c for c in live}
    out = []
    for name, shadow in shadows.items():
        cj = make(name, shadow.settings, shadow.kind, shadow.model)
        target = by_name[shadow.shadows]
        cj.rate, cj.filter, cj.shadow_of = target.rate, target.filter, shadow.shadows
        out.append(cj)
    return out


def compare_shadows(metrics: JudgeMetrics, assessments: Iterable[Assessment]) -> None:
    """Count agreement of each shadow verdict with its live judge's verdict on the same record."""
    assessments = list(assessments)
    live = {a.name: a.passed for a in assessments if a.shadow_of is None and a.passed is not None}
    for a in assessments:
        if a.shadow_of is not None and a.passed is not None and a.shadow_of in live:
            metrics.observe_shadow(a.shadow_of, a.name, a.passed == live[a.shadow_of])
