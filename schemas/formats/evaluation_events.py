"""`gen_ai.evaluation.result` log records other evaluators wrote, read from a logs topic.

The GenAI semantic conventions define an evaluation's result as an OpenTelemetry event: a log record
named `gen_ai.evaluation.result` with `gen_ai.evaluation.name` (required), `gen_ai.evaluation.score.value`
(a double), `gen_ai.evaluation.score.label`, `gen_ai.evaluation.explanation`, `gen_ai.response.id`,
`error.type`, parented to the evaluated span through its trace context. OpenLIT, Strands, AWS AgentCore
and DeepEval write them; the Collector's Kafka exporter puts them on the logs topic beside the content
events that `otlp_logs` reads. This module reads them into `ExternalEvaluation`s, so their verdicts can
be exported with tracejudge's own (`tracejudge.metrics.telemetry.external`).

Who evaluated: the proposed (not yet accepted) provenance attribute `gen_ai.evaluation.evaluator.id`
when present, else the instrumentation scope's name, else the resource's `service.name`, else
"unknown". tracejudge's own events (`tracejudge sink otlp`) carry `tracejudge.*` attributes: they are
counted as `own` and never read again, so a Collector that routes the sink's events back onto the logs
topic makes no loop.

A record that is not a structurally valid OTLP logs request has been refused by `otlp_logs` already;
here one bad event (no name, a score that is not a finite number) is an `InvalidEvent` naming its path,
and the record's other events are read as usual.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from tracejudge.schemas.formats.otlp_common import (
    ZERO_SPAN,
    ZERO_TRACE,
    json_attributes,
    json_document,
    json_field,
    json_id,
    json_list,
    proto_attributes,
    service_name,
)
from tracejudge.schemas.formats.release_version import resource_version

__all__ = ["EVENT_NAME", "EvaluationEvents", "ExternalEvaluation", "InvalidEvent", "decode", "may_hold"]

EVENT_NAME: Final = "gen_ai.evaluation.result"
_EVENT_BYTES: Final = EVENT_NAME.encode()
# An attribute with this prefix marks an event tracejudge wrote itself (`consumer/sinks/otlp.py`).
OWN_PREFIX: Final = "tracejudge."
UNKNOWN_EVALUATOR: Final = "unknown"
EVALUATOR_ID: Final = "gen_ai.evaluation.evaluator.id"
EVALUATOR_VERSION: Final = "gen_ai.evaluation.evaluator.version"
EVALUATOR_TYPE: Final = "gen_ai.evaluation.evaluator.type"


@dataclass(slots=True)
class ExternalEvaluation:
    """One evaluation result another evaluator reported."""

    name: str
    evaluator: str
    score: float | None = None
    label: str | None = None
    explanation: str | None = None
    error_type: str | None = None
    trace_id: str | None = None
    span_id: str | None = None
    response_id: str | None = None
    evaluator_version: str | None = None
    evaluator_type: str | None = None
    # The evaluated app's resource: its `service.name` (None: unset) and `service.version`.
    service: str | None = None
    version: str | None = None
    # The resource's and the record's attributes, for an `app_tag` lookup.
    tags: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InvalidEvent:
    """An evaluation event that could not be read: where it is in the record, and why."""

    where: str
    detail: str


@dataclass(slots=True)
class EvaluationEvents:
    """What one logs record held of evaluation events."""

    evaluations: list[ExternalEvaluation] = field(default_factory=list)
    invalid: list[InvalidEvent] = field(default_factory=list)
    own: int = 0


def may_hold(payload: bytes | str) -> bool:
    """Whether the record can hold an evaluation event at all: the event name is a literal in both
    encodings, so the records of ordinary logs are not parsed a second time."""
    if isinstance(payload, str):
        return EVENT_NAME in payload
    return _EVENT_BYTES in payload


def decode(payload: bytes | str, fmt: str) -> EvaluationEvents:
    """The evaluation events of one logs record (`otlp_logs_proto` or `otlp_logs_json`); call after
    `otlp_logs.decode` accepted the record's structure."""
    out = EvaluationEvents()
    if not may_hold(payload):
        return out
    events = _json_events(payload) if fmt == "otlp_logs_json" else _proto_events(payload)
    for where, raw in events:
        _read(raw, where, out)
    return out


# A raw event: attributes, resource attributes, scope name, trace id, span id (hex or None).
_Raw = tuple[dict[str, Any], dict[str, Any], str, str | None, str | None]


def _proto_events(payload: bytes | str) -> Iterator[tuple[str, _Raw]]:
    data = payload.encode() if isinstance(payload, str) else payload
    request = ExportLogsServiceRequest.FromString(data)
    for ri, resource_logs in enumerate(request.resource_logs):
        resource: dict[str, Any] | None = None
        for si, scope_logs in enumerate(resource_logs.scope_logs):
            for li, rec in enumerate(scope_logs.log_records):
                attributes = proto_attributes(rec.attributes)
                name = rec.event_name or attributes.pop("event.name", "")
                if name != EVENT_NAME:
                    continue
                if resource is None:
                    resource = proto_attributes(resource_logs.resource.attributes)
                trace = rec.trace_id.hex() if len(rec.trace_id) == 16 and rec.trace_id != ZERO_TRACE else None
                span = rec.span_id.hex() if len(rec.span_id) == 8 and rec.span_id != ZERO_SPAN else None
                yield (f"resourceLogs[{ri}].scopeLogs[{si}].logRecords[{li}]",
                       (attributes, resource, scope_logs.scope.name, trace, span))


def _json_events(payload: bytes | str) -> Iterator[tuple[str, _Raw]]:
    doc = json_document(payload, lambda o: isinstance(o, Mapping) and (
        "resourceLogs" in o or "resource_logs" in o), "logs", "resourceLogs")
    for ri, resource_logs in enumerate(json_list(json_field(doc, "resourceLogs", "resource_logs"),
                                                 "resourceLogs")):
        where_r = f"resourceLogs[{ri}]"
        resource_doc = json_field(resource_logs, "resource", "resource") or {}
        resource = json_attributes(resource_doc.get("attributes"), f"{where_r}.resource.attributes")
        for si, scope_logs in enumerate(json_list(json_field(resource_logs, "scopeLogs", "scope_logs"),
                                                  f"{where_r}.scopeLogs")):
            scope = scope_logs.get("scope") or {}
            scope_name = scope.get("name") if isinstance(scope, Mapping) else None
            records = json_list(json_field(scope_logs, "logRecords", "log_records"),
                                f"{where_r}.scopeLogs[{si}].logRecords")
            for li, rec in enumerate(records):
                where = f"{where_r}.scopeLogs[{si}].logRecords[{li}]"
                attributes = json_attributes(rec.get("attributes"), f"{where}.attributes")
                name = json_field(rec, "eventName", "event_name") or attributes.pop("event.name", "")
                if name != EVENT_NAME:
                    continue
                trace = json_id(json_field(rec, "traceId", "trace_id"), 16, f"{where}.traceId", zero_ok=True)
                span = json_id(json_field(rec, "spanId", "span_id"), 8, f"{where}.spanId", zero_ok=True)
                yield where, (attributes, resource, scope_name if isinstance(scope_name, str) else "",
                              trace, span)


def _read(raw: _Raw, where: str, out: EvaluationEvents) -> None:
    attributes, resource, scope_name, trace, span = raw
    if any(key.startswith(OWN_PREFIX) for key in attributes):
        out.own += 1
        return
    name = attributes.get("gen_ai.evaluation.name")
    if not isinstance(name, str) or not name.strip():
        out.invalid.append(InvalidEvent(where, "gen_ai.evaluation.name is missing or not a non-empty "
                                        f"string (got {_kind(name)})"))
        return
    score = attributes.get("gen_ai.evaluation.score.value")
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, int | float):
            out.invalid.append(InvalidEvent(where, f"gen_ai.evaluation.score.value is not a number "
                                            f"(got {_kind(score)})"))
            return
        if not math.isfinite(score):
            out.invalid.append(InvalidEvent(where, f"gen_ai.evaluation.score.value is not finite ({score})"))
            return
        score = float(score)
    service = service_name(resource)
    evaluator = (_text(attributes.get(EVALUATOR_ID)) or _text(scope_name) or service or UNKNOWN_EVALUATOR)
    out.evaluations.append(ExternalEvaluation(
        name=name.strip(), evaluator=evaluator, score=score,
        label=_text(attributes.get("gen_ai.evaluation.score.label")),
        explanation=_text(attributes.get("gen_ai.evaluation.explanation")),
        error_type=_text(attributes.get("error.type")), trace_id=trace, span_id=span,
        response_id=_text(attributes.get("gen_ai.response.id")),
        evaluator_version=_text(attributes.get(EVALUATOR_VERSION)),
        evaluator_type=_text(attributes.get(EVALUATOR_TYPE)), service=service,
        version=resource_version(resource), tags={**resource, **attributes}))


def _text(value: Any) -> str | None:
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _kind(value: Any) -> str:
    """What a bad value was, without quoting it (an attribute may carry anything)."""
    return "nothing" if value is None else type(value).__name__
