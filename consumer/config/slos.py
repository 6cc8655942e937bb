"""The `slos:` section: quality service-level objectives per app and judge, from which `tracejudge slo
render` writes Prometheus recording rules and multi-window, multi-burn-rate alerts
(`tracejudge.consumer.config.slo_rules`) (`tracejudge.consumer.config`).

    slos:
      - app: shop                  # the `app` label of tracejudge_judge_verdicts_total
        judge: groundedness        # a configured trace judge (checked when a judges: section exists)
        objective: 0.95            # 95% of the judged traces pass, 0 < objective < 1
        window: 28d                # the SLO window, a Prometheus duration from 7d to 90d
        min_judged: 100            # judged traces a window pair's long window needs before it may fire
        corrected: auto            # auto | true | false: the calibrated (corrected) pass rate
        name: shop-grounded        # the `slo` label; default <app>-<judge>-<objective %>

Why the checks: a threshold alert pages late on a collapse and never on a slow erosion; an SLO states
how much failure is acceptable over a window (the error budget, 1 - objective) and alerts on how fast it
is spent. Every value becomes part of a PromQL expression or a label, so each is checked here, before
anything renders: a label value holding a quote or a backslash would end its selector's string.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tracejudge.consumer.config.alert_links import duration_seconds
from tracejudge.consumer.config.common import Section
from tracejudge.metrics.judges.config import JudgesConfig
from tracejudge.schemas.errors import ConfigError

__all__ = ["MAX_WINDOW_S", "MIN_WINDOW_S", "SloSpec", "check_slos"]

# The window pairs' long windows reach 3 days: a shorter SLO window would alert on more than it spans.
MIN_WINDOW_S = 7 * 86400
# Prometheus keeps 15 days by default; beyond 90 days the budget query reads more than anyone retains.
MAX_WINDOW_S = 90 * 86400
# A label value inside a PromQL string: printable, no quote, backslash or braces (Go templates).
_LABEL_VALUE = re.compile(r'^[^"\\{}\x00-\x1f\x7f]{1,200}$')
_JUDGE = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,99}$")
_SAFE = re.compile(r"[^a-z0-9_.-]")


class SloSpec(Section):
    """One entry of `slos:`: `objective` of app's traces judged by `judge` pass, over `window`."""

    # The app (the `app` label) whose traces the SLO is about.
    app: str
    # The trace judge whose verdicts count: a pass is a good event, a fail a bad one.
    judge: str
    # The share of judged traces that must pass, e.g. 0.95 (the error budget is 1 - objective).
    objective: float = Field(gt=0, lt=1)
    # The SLO's window, a Prometheus duration from 7d to 90d.
    window: str = "28d"
    # The judged traces (verdicts) the long window of a window pair must hold for that pair to fire:
    # 1h and 6h for the page, 1d and 3d for the ticket; the 5-minute sharp-drop pair needs at least this
    # many in 5 minutes, more when the objective is high (slo_rules.sharp_minimum).
    min_judged: int = Field(default=100, ge=1, le=10_000_000)
    # auto: the corrected pass rate where the judge has a fresh calibration, the observed one elsewhere;
    # true: the corrected one only (no calibration: no series, nothing fires); false: the observed one.
    corrected: bool | Literal["auto"] = "auto"
    # The `slo` label of its series and alerts; default: derived from the app, the judge and the objective.
    name: str | None = None

    @field_validator("app")
    @classmethod
    def _app(cls, v: str) -> str:
        if not _LABEL_VALUE.match(v):
            raise ValueError('must be 1 to 200 printable characters without " \\ { or }, got ' + repr(v))
        return v

    @field_validator("judge")
    @classmethod
    def _judge(cls, v: str) -> str:
        if not _JUDGE.match(v):
            raise ValueError(f"must be a judge name (letters, digits and _ . : -), got {v!r}")
        return v

    @field_validator("window")
    @classmethod
    def _window(cls, v: str) -> str:
        try:
            seconds = duration_seconds(v)
        except ValueError:
            raise ValueError(f"must be a Prometheus duration such as 28d or 4w, got {v!r}") from None
        if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
            raise ValueError(f"must be from 7d to 90d, got {v!r}")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.match(v):
            raise ValueError(f"must be lower-case letters, digits and _ . - (at most 100), got {v!r}")
        return v

    @model_validator(mode="after")
    def _default_name(self) -> SloSpec:
        if self.name is None:
            pair = _SAFE.sub("_", f"{self.app}-{self.judge}".lower())[:88]
            self.name = f"{pair}-{_percent(self.objective)}"
        return self

    @property
    def slo(self) -> str:
        """The `slo` label (the name, given or derived)."""
        assert self.name is not None
        return self.name

    @property
    def budget(self) -> float:
        """The error budget: the share of judged traces allowed to fail, 1 - objective."""
        return round(1 - self.objective, 12)

    @property
    def window_s(self) -> int:
        return int(duration_seconds(self.window))


def _percent(objective: float) -> str:
    """0.95 -> '95', 0.995 -> '99.5'."""
    return f"{round(objective * 100, 6):g}"


def check_slos(slos: list[SloSpec], judges: JudgesConfig | None) -> None:
    """The checks across sections and entries: one SLO per (app, judge), unique names, a judge that is
    configured (when there is a judges: section), and a calibration file where `corrected: true`.
    Raises `ConfigError` with every problem, keys relative to the whole configuration."""
    problems: list[tuple[str, str]] = []
    pairs: dict[tuple[str, str], int] = {}
    names: dict[str, int] = {}
    known = None if judges is None else set(judges.judge_settings())
    for i, slo in enumerate(slos):
        where = f"slos[{i}]"
        if (slo.app, slo.judge) in pairs:
            problems.append((f"{where}.judge", f"app {slo.app!r} already has an SLO on judge {slo.judge!r} "
                             f"(slos[{pairs[slo.app, slo.judge]}]); one SLO per app and judge"))
        elif slo.slo in names:
            problems.append((f"{where}.name",
                             f"{slo.slo!r} is used by slos[{names[slo.slo]}]; give each a name"))
        pairs.setdefault((slo.app, slo.judge), i)
        names.setdefault(slo.slo, i)
        if known is not None and slo.judge not in known:
            problems.append((f"{where}.judge", f"{slo.judge!r} is not a configured trace judge "
                             f"({', '.join(sorted(known)) or 'none'})"))
        if slo.corrected is True and judges is not None and not judges.calibration_file:
            problems.append((f"{where}.corrected", "true needs judges.calibration_file (a calibration "
                             "from tracejudge calibrate); use auto to fall back to the observed pass rate"))
    if problems:
        raise ConfigError(problems)
