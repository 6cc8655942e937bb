"""`stream.external_evaluations`: how `tracejudge run` treats the `gen_ai.evaluation.result` events other
evaluators write to a logs topic (`tracejudge.metrics.telemetry.external`)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator

from tracejudge.consumer.config.common import Section
from tracejudge.schemas.errors import ConfigError

__all__ = ["ExternalEvaluationsSettings"]


class ExternalEvaluationsSettings(Section):
    """Verdicts from other evaluators, read on the `otlp_logs_*` topics."""

    # Read other evaluators' `gen_ai.evaluation.result` events on the logs topics and export their verdicts.
    enabled: bool = True
    # Per evaluation name (`<evaluator>/<name>` first, else `<name>`): a score at least this passes,
    # when the event's label is not pass/fail, yes/no or true/false.
    thresholds: dict[str, float] = Field(default_factory=dict)
    # Distinct evaluators and evaluation names exported before new ones become "other" (counted).
    max_evaluators: int = Field(default=20, gt=0, le=1000)
    # Distinct evaluation names exported before new ones become "other" (counted).
    max_names: int = Field(default=100, gt=0, le=10_000)

    @field_validator("thresholds", mode="before")
    @classmethod
    def _thresholds(cls, v: Any) -> dict[str, float]:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"must be a mapping of evaluation names to numbers, got {type(v).__name__}")
        out: dict[str, float] = {}
        problems: list[tuple[str, str]] = []
        for name, value in v.items():
            if not isinstance(name, str) or not name.strip():
                problems.append((str(name), "the evaluation name must be a non-empty string"))
            elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                problems.append((name, f"must be a finite number, got {type(value).__name__}"))
            else:
                out[name.strip()] = float(value)
        if problems:
            raise ConfigError(problems)  # each name's own key: `thresholds.<name>`
        return out
