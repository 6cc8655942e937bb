"""The result line: one per evaluated record, the same shape from `tracejudge eval` (JSON Lines) and
from `tracejudge run` (the results topic). Documented in the README under "Result schema".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from tracejudge.schemas.record import EvalRecord

# Anything a payload decoded from JSON can hold is written natively; `str()` is the last resort (as
# `derive.json_text` does) so one odd value in a custom metric's output cannot lose the result line.
_ENCODER = msgspec.json.Encoder(enc_hook=str)


@dataclass(slots=True)
class Assessment:
    """One judge's verdict on one record.

    `value` is what the judge said in its own scale ("yes"/"no", 1–5, a precision); `score` is that
    mapped to [0, 1] (1 = good); `passed` applies the judge's threshold. A judge that could not give
    a verdict has `error` set and value/score/passed None; one that was not run has `skipped` set to
    the reason ("missing_inputs", "not_sampled", "budget", "circuit_open", "failed_trace", …).
    """

    name: str
    value: Any = None
    score: float | None = None
    passed: bool | None = None
    rationale: str | None = None
    error: str | None = None
    skipped: str | None = None
    # "llm:<model>", "heuristic", "embedding:<model>", …
    source: str | None = None
    duration_seconds: float | None = None


@dataclass(slots=True)
class SourceRef:
    """Where the record came from: a file line, or a Kafka topic/partition/offset."""

    format: str
    file: str | None = None
    line: int | None = None
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None


@dataclass(slots=True)
class EvaluationResult:
    record: EvalRecord
    source: SourceRef
    # Computed metric values by name; a metric that raised has None here and its error below.
    metrics: dict[str, float | None] = field(default_factory=dict)
    metric_errors: dict[str, str] = field(default_factory=dict)
    assessments: list[Assessment] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The result line as plain Python objects (what `to_json` writes)."""
        out: dict[str, Any] = msgspec.to_builtins(self.record)
        out.update(msgspec.to_builtins(self._tail()))
        return out

    def to_json(self) -> bytes:
        # msgspec writes the structs and dataclasses natively, ~10x faster than building dicts first;
        # the two objects are spliced so the record's fields stay at the top level (the documented shape).
        head = _ENCODER.encode(self.record)
        tail = _ENCODER.encode(self._tail())
        return head[:-1] + b"," + tail[1:]

    def _tail(self) -> dict[str, Any]:
        return {"source": self.source, "metrics": self.metrics, "metric_errors": self.metric_errors,
                "assessments": self.assessments}

    def assessment(self, name: str) -> Assessment:
        """The assessment of judge `name`; KeyError naming the judges present when there is none."""
        for a in self.assessments:
            if a.name == name:
                return a
        raise KeyError(f"no assessment {name!r}; have {[a.name for a in self.assessments]}")

    @property
    def passed(self) -> bool:
        """True when every judge that gave a verdict passed (skipped and errored judges do not count:
        check `Assessment.skipped`/`error` when they matter)."""
        return all(a.passed for a in self.assessments if a.passed is not None)

    @property
    def key(self) -> str | None:
        """The Kafka key of the result: the trace id, else the request id."""
        return self.record.trace_id or self.record.request_id
