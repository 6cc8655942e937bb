"""OTLP log records that carry GenAI message content -> events on the spans they belong to.

Some instrumentors write a model call's messages as log records (OpenTelemetry events) rather than
span attributes: the OpenTelemetry GenAI instrumentors (`opentelemetry-instrumentation-openai-v2`
by default: `gen_ai.user.message`, `gen_ai.choice`, …; with the latest experimental conventions and
`EVENT_ONLY`: `gen_ai.client.inference.operation.details`). The Collector's Kafka exporter writes
logs to their own topic (`otlp_logs` by default), as an `ExportLogsServiceRequest` in the topic's
encoding. A record is read here into `EventGroup`s per trace; assembly holds them with the trace's
spans and, when the trace is built, each event is read onto the span it names
(`tracejudge.schemas.formats.conventions.read_content_events`) as a span event of the same name would be.

Only records whose event name is a content event are kept (a service's ordinary logs are skipped
unread); a record without a trace id or span id cannot be placed and is skipped too. A structurally
bad record is a `RecordError` naming its path, as for spans (ids, attributes and values are read by
`otlp_common`, as the trace reader reads them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.conventions import CONTENT_EVENTS
from tracejudge.schemas.formats.otlp import FORMAT_JSON, FORMAT_PROTO
from tracejudge.schemas.formats.otlp_common import (
    ZERO_SPAN,
    ZERO_TRACE,
    json_attributes,
    json_document,
    json_field,
    json_id,
    json_list,
    json_object,
    json_value,
    proto_attributes,
    proto_value,
    service_name,
)
from tracejudge.schemas.formats.release_version import resource_version

FORMAT_LOGS_PROTO: Final = "otlp_logs_proto"
FORMAT_LOGS_JSON: Final = "otlp_logs_json"
FORMATS: Final = (FORMAT_LOGS_PROTO, FORMAT_LOGS_JSON)
# The encoding of each logs format: a trace's source format is its spans' encoding.
ENCODING: Final = {FORMAT_LOGS_PROTO: FORMAT_PROTO, FORMAT_LOGS_JSON: FORMAT_JSON}


@dataclass(slots=True)
class SpanEvent:
    """One content event for span `span_id`: its name and attributes (the record's body, when it is
    a map, merged under its attributes; a plain body is `content`)."""

    span_id: str
    name: str
    attributes: dict[str, Any]


@dataclass(slots=True)
class EventGroup:
    """The content events of one trace from one resource of one record."""

    # None for content events that name no trace or no span: they cannot join one, and assembly
    # counts them (`tracejudge_assembly_log_events_unplaced_total`) instead of holding them.
    trace_id: str | None
    service: str | None
    events: list[SpanEvent]
    # The resource's `service.version`: the trace's version when its spans' resources state none.
    version: str | None = None


def is_otlp_logs_json(obj: Any) -> bool:
    return isinstance(obj, Mapping) and ("resourceLogs" in obj or "resource_logs" in obj)


def decode(payload: bytes | str, fmt: str) -> list[EventGroup]:
    if fmt == FORMAT_LOGS_JSON:
        return decode_json(payload)
    if isinstance(payload, str):
        raise RecordError(errors.INVALID_PROTOBUF, "an otlp_logs_proto record must be bytes, not text")
    return decode_proto(payload)


def _event(name: str, attributes: dict[str, Any], body: Any) -> dict[str, Any]:
    if isinstance(body, Mapping):
        return {**body, **attributes}
    if body is not None:
        return {"content": body, **attributes}
    return attributes


def _unplaced(by_trace: dict[Any, EventGroup], service: str | None, name: str) -> None:
    group = by_trace.get(None)
    if group is None:
        group = by_trace[None] = EventGroup(None, service, [])
    group.events.append(SpanEvent("", name, {}))


def decode_proto(payload: bytes) -> list[EventGroup]:
    try:
        request = ExportLogsServiceRequest.FromString(payload)
    except DecodeError as exc:
        raise RecordError(errors.INVALID_PROTOBUF, f"not an OTLP ExportLogsServiceRequest: {exc}") from exc
    groups: list[EventGroup] = []
    for resource_logs in request.resource_logs:
        resource = proto_attributes(resource_logs.resource.attributes)
        service, version = service_name(resource), resource_version(resource)
        by_trace: dict[Any, EventGroup] = {}
        for scope_logs in resource_logs.scope_logs:
            for rec in scope_logs.log_records:
                attributes = proto_attributes(rec.attributes)
                name = rec.event_name or attributes.pop("event.name", "")
                if name not in CONTENT_EVENTS:
                    continue
                trace_id, span_id = rec.trace_id, rec.span_id
                if (len(trace_id) != 16 or trace_id == ZERO_TRACE or len(span_id) != 8
                        or span_id == ZERO_SPAN):
                    _unplaced(by_trace, service, name)
                    continue
                body = proto_value(rec.body) if rec.HasField("body") else None
                group = by_trace.get(trace_id)
                if group is None:
                    group = by_trace[trace_id] = EventGroup(trace_id.hex(), service, [], version)
                group.events.append(SpanEvent(span_id.hex(), name, _event(name, attributes, body)))
        groups.extend(by_trace.values())
    return groups


def decode_json(payload: bytes | str | Mapping[str, Any]) -> list[EventGroup]:
    doc = json_document(payload, is_otlp_logs_json, "logs", "resourceLogs")
    groups: list[EventGroup] = []
    resources = json_list(json_field(doc, "resourceLogs", "resource_logs"), "resourceLogs")
    for ri, resource_logs in enumerate(resources):
        where_r = f"resourceLogs[{ri}]"
        json_object(resource_logs, where_r)
        resource = json_field(resource_logs, "resource", "resource") or {}
        json_object(resource, f"{where_r}.resource")
        attributes = json_attributes(resource.get("attributes"), f"{where_r}.resource.attributes")
        service, version = service_name(attributes), resource_version(attributes)
        by_trace: dict[Any, EventGroup] = {}
        for si, scope_logs in enumerate(json_list(json_field(resource_logs, "scopeLogs", "scope_logs"),
                                              f"{where_r}.scopeLogs")):
            json_object(scope_logs, f"{where_r}.scopeLogs[{si}]")
            records = json_list(json_field(scope_logs, "logRecords", "log_records"),
                            f"{where_r}.scopeLogs[{si}].logRecords")
            for li, rec in enumerate(records):
                where = f"{where_r}.scopeLogs[{si}].logRecords[{li}]"
                json_object(rec, where)
                attributes = json_attributes(rec.get("attributes"), f"{where}.attributes")
                name = json_field(rec, "eventName", "event_name") or attributes.pop("event.name", "")
                if name not in CONTENT_EVENTS:
                    continue
                trace_id = json_id(json_field(rec, "traceId", "trace_id"), 16, f"{where}.traceId",
                                   zero_ok=True)
                span_id = json_id(json_field(rec, "spanId", "span_id"), 8, f"{where}.spanId", zero_ok=True)
                if trace_id is None or span_id is None:
                    _unplaced(by_trace, service, name)
                    continue
                body = rec.get("body")
                body = json_value(body, f"{where}.body") if body is not None else None
                group = by_trace.get(trace_id)
                if group is None:
                    group = by_trace[trace_id] = EventGroup(trace_id, service, [], version)
                group.events.append(SpanEvent(span_id, name, _event(name, attributes, body)))
        groups.extend(by_trace.values())
    return groups
