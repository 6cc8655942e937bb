"""The OTLP sink's findings: each finding (`"kind": "finding"`, `consumer/sinks/findings.py`) becomes one
`tracejudge.finding` log event per example trace, carrying that trace's id and no span id (a finding
names traces, not spans, so the event hangs on the trace, not on a span of it); an example id that is
not 32 hex digits (after `tr-`) is skipped (`no_trace_id`). A finding without example traces is one
event with no trace context. No span is sent for a finding (`emit_spans` is for verdicts).

| attribute | from the finding |
|---|---|
| `tracejudge.finding.app` / `.judge` / `.dimension` / `.value` / `.label` | `app`, `judge`, ... |
| `tracejudge.finding.failing` / `.total` / `.window_failing` / `.window_total` | the counts |
| `tracejudge.finding.support` / `.lift` / `.lift_low` / `.lift_high` | the statistics |
| `tracejudge.finding.rank` | `rank` |
| `tracejudge.finding.window.start` / `.end` | the window, Unix seconds |
| `tracejudge.finding.id` | 32 hex digits: the same finding on the same trace, the same id |
| `tracejudge.finding.topic` / `.partition` / `.offset` | the finding's record on the findings topic |

Values are as the finding states them (see the MLflow sink's findings for what they may hold).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from tracejudge.consumer.sinks.base import SinkRecord

__all__ = ["FINDING_EVENT", "finding_attributes", "finding_events"]

FINDING_EVENT = "tracejudge.finding"
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_COUNTS = ("failing", "total", "window_failing", "window_total", "rank")
_FLOATS = ("support", "lift", "failure_rate_with", "failure_rate_without")


def finding_attributes(record: SinkRecord) -> dict[str, Any]:
    """The event's attributes (see the module docstring)."""
    f = record.result
    p = "tracejudge.finding."
    attrs: dict[str, Any] = {f"{p}{k}": f[k] for k in ("app", "judge", "dimension", "value")}
    if isinstance(f.get("label"), str):
        attrs[f"{p}label"] = f["label"]
    for k in _COUNTS:
        if type(f.get(k)) is int:
            attrs[f"{p}{k}"] = f[k]
    for k in _FLOATS:
        if isinstance(f.get(k), int | float) and not isinstance(f.get(k), bool):
            attrs[f"{p}{k}"] = float(f[k])
    low, high = f["lift_interval"]
    if low is not None:
        attrs[f"{p}lift_low"] = float(low)
    if high is not None:
        attrs[f"{p}lift_high"] = float(high)
    for edge in ("start", "end"):
        if (f.get("window") or {}).get(edge) is not None:
            attrs[f"{p}window.{edge}"] = float(f["window"][edge])
    attrs.update({f"{p}topic": record.topic, f"{p}partition": record.partition, f"{p}offset": record.offset})
    return attrs


def finding_events(record: SinkRecord) -> tuple[list[tuple[int, int | None, dict[str, Any]]], int]:
    """The events of a finding, (index, trace id as an int or None: no trace context, attributes), and
    how many example ids are not 32-hex trace ids (skipped: `no_trace_id`)."""
    base = finding_attributes(record)
    examples = list(dict.fromkeys(record.result["example_trace_ids"]))
    if not examples:
        return [(0, None, {**base, "tracejudge.finding.id": _id(record, "")})], 0
    events: list[tuple[int, int | None, dict[str, Any]]] = []
    for index, tid in enumerate(examples):
        text = tid.lower().removeprefix("tr-")
        if _HEX32.match(text) and text.strip("0"):
            events.append((index, int(text, 16), {**base, "tracejudge.finding.id": _id(record, text)}))
    return events, len(examples) - len(events)


def _id(record: SinkRecord, trace: str) -> str:
    """The same finding (app, judge, dimension, value, window) on the same trace: the same id."""
    f = record.result
    window = f.get("window") or {}
    parts = [f["app"], f["judge"], f["dimension"], f["value"], str(window.get("start")),
             str(window.get("end")), trace]
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]
