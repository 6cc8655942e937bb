"""PLACEHOLDER (the lead is writing this file): computed metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tracejudge.schemas.record import EvalRecord, ToolCall


@dataclass
class CustomMetric:
    name: str
    fn: Any


class ComputedMetrics:
    def __init__(self, *, custom: Sequence[CustomMetric] = (), single_tool: Sequence[str] = (),
                 reference_trajectory: Sequence[ToolCall] | None = None) -> None:
        self.custom = list(custom)

    def compute(self, record: EvalRecord) -> tuple[dict[str, float | None], dict[str, str]]:
        return {"latency_seconds": record.latency_seconds}, {}
