"""OTLP trace messages, as the OpenTelemetry Collector's Kafka exporter writes them, -> `Span`s.

One Kafka record is one `ExportTraceServiceRequest`: encoding `otlp_proto` (the default) is its
protobuf, `otlp_json` its OTLP/JSON form. A record may mix many traces, resources and services, and the
spans of one trace are spread across many records, so decoding stops at spans grouped per (resource,
trace): `SpanGroup`. `tracejudge.consumer.stages.assembly` buffers the groups of a trace until it is whole,
then `build_trace` makes the format-neutral `Trace`.

OTLP/JSON is not protobuf's canonical JSON: trace and span ids are hex (protobuf JSON would read a
32-char hex trace id as base64 and silently produce 24 bytes), enums are integers, 64-bit integers
are decimal strings. It is walked here directly rather than through `json_format`, which is both
slower and wrong about the ids. Base64 ids, enum names and snake_case field names (what
`MessageToJson`-style writers produce) are accepted too: their lengths never collide with hex ones. The
encodings this reader shares with the logs reader (`otlp_logs`) live in `otlp_common`.

A record is all-or-nothing: a structurally bad span makes the whole record a `RecordError` naming the
span's path (`resourceSpans[0].scopeSpans[1].spans[3].traceId`), so a record is either assembled whole
or dead-lettered whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.conventions import (
    CONTENT_EVENTS,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_UNSET,
    read_content_events,
    span_from_otel,
)
from tracejudge.schemas.formats.otlp_common import (
    ZERO_SPAN,
    ZERO_TRACE,
    json_attributes,
    json_document,
    json_field,
    json_id,
    json_int,
    json_list,
    json_object,
    json_string,
    proto_attributes,
    service_name,
)
from tracejudge.schemas.formats.release_version import resource_version, spans_version
from tracejudge.schemas.formats.session_identity import (
    MLFLOW_SESSION,
    MLFLOW_USER,
    SESSION_ATTRIBUTES,
    USER_ATTRIBUTES,
    identity,
    spans_identity,
)
from tracejudge.schemas.trace import Span, SpanStatus, Trace

FORMAT_PROTO: Final = "otlp_proto"
FORMAT_JSON: Final = "otlp_json"
FORMATS: Final = (FORMAT_PROTO, FORMAT_JSON)

# Only these events are read (exceptions, vector-DB hits, message content); other events' attributes
# are never decoded.
_READ_EVENTS: Final = frozenset({"exception", "db.query.result", *CONTENT_EVENTS})
# Span.flags: "has is-remote" (0x100) and "parent is remote" (0x200) both set.
_REMOTE_PARENT: Final = 0x300
# Set on a span whose parent lives in another process: a service's entry span. When a trace's real
# root never reaches the topic (an uninstrumented gateway propagated the context), the entry span
# stands in for it.
REMOTE_PARENT_KEY: Final = "tracejudge.parent_is_remote"
REMOTE_PARENT_ID_KEY: Final = "tracejudge.remote_parent_span_id"
_STATUS_NAMES: Final = {"STATUS_CODE_UNSET": STATUS_UNSET, "STATUS_CODE_OK": STATUS_OK,
                        "STATUS_CODE_ERROR": STATUS_ERROR}


@dataclass(slots=True)
class SpanGroup:
    """The spans of one trace from one resource of one message; `service` is its `service.name`,
    `version` its `service.version`."""

    trace_id: str
    service: str | None
    spans: list[Span]
    version: str | None = None


def detect_format(payload: bytes | str) -> str:
    """OTLP/JSON starts with `{`; anything else is read as protobuf.

    Leading spaces, tabs and CRs are skipped but not a newline: 0x0A is also the tag protobuf starts
    an `ExportTraceServiceRequest` with, and 0x0A 0x7B is a resource of 123 bytes, not JSON.
    """
    if isinstance(payload, str):
        return FORMAT_JSON
    return FORMAT_JSON if payload[:64].lstrip(b" \t\r")[:1] == b"{" else FORMAT_PROTO


_OTLP_JSON_HEAD: Final = re.compile(rb'\s*\{\s*"resource_?(?:[sS]pans|[lL]ogs)"')
_OTLP_LOGS_JSON_HEAD: Final = re.compile(rb'\s*\{\s*"resource_?[lL]ogs"')


def looks_like_otlp_json(line: bytes | str) -> bool:
    """Cheap sniff, no parsing: a JSON object whose first key is `resourceSpans` (how every OTLP/JSON
    writer starts), or `resourceLogs` (content log records for those spans). For routing lines of a
    mixed file to trace assembly."""
    head = line[:200].encode() if isinstance(line, str) else line[:200]
    return _OTLP_JSON_HEAD.match(head) is not None


def looks_like_otlp_logs_json(line: bytes | str | Mapping[str, Any]) -> bool:
    if isinstance(line, Mapping):
        return "resourceLogs" in line or "resource_logs" in line
    head = line[:200].encode() if isinstance(line, str) else line[:200]
    return _OTLP_LOGS_JSON_HEAD.match(head) is not None


def is_otlp_json(obj: Any) -> bool:
    """True for a decoded JSON object that is an OTLP trace request (`{"resourceSpans": [...]}`)."""
    return isinstance(obj, Mapping) and ("resourceSpans" in obj or "resource_spans" in obj)


def decode(payload: bytes | str, fmt: str | None = None) -> tuple[str, list[SpanGroup]]:
    """Decode one record; `fmt` is the topic's configured format, None to detect it per record."""
    if fmt is None:
        fmt = detect_format(payload)
        if fmt == FORMAT_PROTO and isinstance(payload, bytes) and payload.lstrip()[:1] == b"{":
            # A newline before the JSON: protobuf first, as an 0x0A start is more often protobuf.
            try:
                return fmt, decode_proto(payload)
            except RecordError:
                return FORMAT_JSON, decode_json(payload)
    if fmt == FORMAT_JSON:
        return fmt, decode_json(payload)
    if fmt == FORMAT_PROTO:
        if isinstance(payload, str):
            raise RecordError(errors.INVALID_PROTOBUF, "an otlp_proto record must be bytes, not text")
        return fmt, decode_proto(payload)
    raise ValueError(f"unknown OTLP format {fmt!r}; expected one of {', '.join(FORMATS)}")


# --- protobuf ---------------------------------------------------------------------------------------


def decode_proto(payload: bytes) -> list[SpanGroup]:
    try:
        request = ExportTraceServiceRequest.FromString(payload)
    except DecodeError as exc:
        hint = " (it starts like JSON: is the topic otlp_json?)" if payload.lstrip()[:1] == b"{" else ""
        raise RecordError(errors.INVALID_PROTOBUF,
                          f"not an OTLP ExportTraceServiceRequest: {exc}{hint}") from exc
    groups: list[SpanGroup] = []
    for ri, resource_spans in enumerate(request.resource_spans):
        resource = proto_attributes(resource_spans.resource.attributes)
        service, version = service_name(resource), resource_version(resource)
        by_trace: dict[bytes, SpanGroup] = {}
        for si, scope_spans in enumerate(resource_spans.scope_spans):
            for pi, sp in enumerate(scope_spans.spans):
                trace_id = sp.trace_id
                if len(trace_id) != 16 or trace_id == ZERO_TRACE:
                    raise RecordError(errors.INVALID_RECORD, _bad_id("trace", 16, trace_id),
                                      f"{_path(ri, si, pi)}.traceId")
                span_id = sp.span_id
                if len(span_id) != 8 or span_id == ZERO_SPAN:
                    raise RecordError(errors.INVALID_RECORD, _bad_id("span", 8, span_id),
                                      f"{_path(ri, si, pi)}.spanId")
                parent = sp.parent_span_id
                if parent and len(parent) != 8:
                    raise RecordError(errors.INVALID_RECORD, _bad_id("parent span", 8, parent),
                                      f"{_path(ri, si, pi)}.parentSpanId")
                events = [(e.name, proto_attributes(e.attributes) if e.name in _READ_EVENTS else {})
                          for e in sp.events]
                span = span_from_otel(
                    span_id=span_id.hex(),
                    parent_id=parent.hex() if parent and parent != ZERO_SPAN else None,
                    name=sp.name,
                    start_ns=sp.start_time_unix_nano,
                    end_ns=sp.end_time_unix_nano or None,
                    status_code=sp.status.code,
                    status_message=sp.status.message,
                    attributes=proto_attributes(sp.attributes),
                    events=events,
                )
                if parent and sp.flags & _REMOTE_PARENT == _REMOTE_PARENT:
                    span.attributes[REMOTE_PARENT_KEY] = True
                group = by_trace.get(trace_id)
                if group is None:
                    group = by_trace[trace_id] = SpanGroup(trace_id.hex(), service, [], version)
                group.spans.append(span)
        groups.extend(by_trace.values())
    return groups


def _bad_id(what: str, size: int, got: bytes) -> str:
    if len(got) == size:
        return f"{what} id is all zeros (invalid)"
    return f"{what} id must be {size} bytes, got {len(got)}"


# --- OTLP/JSON --------------------------------------------------------------------------------------


def decode_json(payload: bytes | str | Mapping[str, Any]) -> list[SpanGroup]:
    """Decode OTLP/JSON (hex ids, integer enums, 64-bit integers as strings)."""
    doc = json_document(payload, is_otlp_json, "trace", "resourceSpans")
    groups: list[SpanGroup] = []
    for ri, resource_spans in enumerate(json_list(json_field(doc, "resourceSpans", "resource_spans"),
                                              "resourceSpans")):
        where_r = f"resourceSpans[{ri}]"
        json_object(resource_spans, where_r)
        resource = json_field(resource_spans, "resource", "resource") or {}
        json_object(resource, f"{where_r}.resource")
        attributes = json_attributes(resource.get("attributes"), f"{where_r}.resource.attributes")
        service, version = service_name(attributes), resource_version(attributes)
        by_trace: dict[str, SpanGroup] = {}
        scopes = json_list(json_field(resource_spans, "scopeSpans", "scope_spans"), f"{where_r}.scopeSpans")
        for si, scope_spans in enumerate(scopes):
            json_object(scope_spans, f"{where_r}.scopeSpans[{si}]")
            for pi, sp in enumerate(json_list(scope_spans.get("spans"), f"{where_r}.scopeSpans[{si}].spans")):
                where = _path(ri, si, pi)
                json_object(sp, where)
                trace_id = json_id(json_field(sp, "traceId", "trace_id"), 16, f"{where}.traceId")
                if trace_id is None:
                    raise RecordError(errors.INVALID_RECORD, "traceId is missing", f"{where}.traceId")
                span_id = json_id(json_field(sp, "spanId", "span_id"), 8, f"{where}.spanId")
                if span_id is None:
                    raise RecordError(errors.INVALID_RECORD, "spanId is missing", f"{where}.spanId")
                parent = json_id(json_field(sp, "parentSpanId", "parent_span_id"), 8, f"{where}.parentSpanId",
                                  zero_ok=True)
                status = sp.get("status") or {}
                json_object(status, f"{where}.status")
                events = []
                for ei, event in enumerate(json_list(sp.get("events"), f"{where}.events")):
                    json_object(event, f"{where}.events[{ei}]")
                    name = event.get("name") or ""
                    attrs = (json_attributes(event.get("attributes"), f"{where}.events[{ei}].attributes")
                             if name in _READ_EVENTS else {})
                    events.append((name, attrs))
                end_ns = json_int(json_field(sp, "endTimeUnixNano", "end_time_unix_nano"),
                                   f"{where}.endTimeUnixNano")
                span = span_from_otel(
                    span_id=span_id,
                    parent_id=parent,
                    name=json_string(sp.get("name"), f"{where}.name"),
                    start_ns=json_int(json_field(sp, "startTimeUnixNano", "start_time_unix_nano"),
                                       f"{where}.startTimeUnixNano"),
                    end_ns=end_ns or None,
                    status_code=_status_code(status.get("code"), f"{where}.status.code"),
                    status_message=json_string(status.get("message"), f"{where}.status.message"),
                    attributes=json_attributes(sp.get("attributes"), f"{where}.attributes"),
                    events=events,
                )
                if parent and json_int(sp.get("flags"), f"{where}.flags") & _REMOTE_PARENT == _REMOTE_PARENT:
                    span.attributes[REMOTE_PARENT_KEY] = True
                group = by_trace.get(trace_id)
                if group is None:
                    group = by_trace[trace_id] = SpanGroup(trace_id, service, [], version)
                group.spans.append(span)
        groups.extend(by_trace.values())
    return groups


def _status_code(value: Any, where: str) -> int:
    if value is None:
        return STATUS_UNSET
    if isinstance(value, str) and value in _STATUS_NAMES:
        return _STATUS_NAMES[value]
    code = json_int(value, where)
    if code not in (STATUS_UNSET, STATUS_OK, STATUS_ERROR):
        raise RecordError(errors.INVALID_RECORD, f"unknown status code {errors.describe_value(code)}", where)
    return code


# --- both -------------------------------------------------------------------------------------------


def _path(ri: int, si: int, pi: int) -> str:
    return f"resourceSpans[{ri}].scopeSpans[{si}].spans[{pi}]"


_TAG_PREFIX: Final = "mlflow.traceTag."


def build_trace(trace_id: str, spans: Sequence[Span], *, source_format: str, app: str | None = None,
                complete: bool = True, app_tag: str | None = None,
                events: Sequence[Any] = (), session_tag: str | None = None,
                version: str | None = None, version_tag: str | None = None) -> Trace:
    """The assembled `Trace` of one trace's spans (in any order; duplicates by span id dropped).

    `events` are the trace's content log records (`otlp_logs.SpanEvent`s): each is read onto the
    span it names, in arrival order; one naming no span of the trace is dropped.

    `app` is the service.name of the root span's resource; `app_tag` (`stream.app_tag`) names a trace
    tag (`mlflow.traceTag.<name>`) or root span attribute whose string value is the app instead.

    Session and user (`session_identity.spans_identity`): `session.id` (OpenInference, MLflow's OTLP
    export), `gen_ai.conversation.id`, Traceloop's `session_id` association property; `user.id`,
    Traceloop's `user_id`; on the root span, else the first span stating one. `session_tag`
    (`stream.session_tag`) names a trace tag or span attribute whose value is the session instead.

    Version (`release_version.spans_version`): the `version_tag` (`stream.version_tag`) trace tag or
    span attribute, else `gen_ai.agent.version` (root first), else `version`, the `service.version` of
    the root span's resource.
    """
    unique = {s.span_id: s for s in spans}
    if events:
        by_span: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
        for event in events:
            if event.span_id in unique:
                by_span.setdefault(event.span_id, []).append((event.name, event.attributes))
        for span_id, span_events in by_span.items():
            read_content_events(unique[span_id], span_events)
    ordered = sorted(unique.values(), key=lambda s: s.start_ns)
    root = next((s for s in ordered if s.parent_id is None), None)
    if root is None:
        root = next((s for s in ordered if s.attributes.get(REMOTE_PARENT_KEY) and s.parent_id not in unique),
                    None)
        if root is not None:
            # The entry span of the first instrumented service is the root of what was recorded.
            root.attributes[REMOTE_PARENT_ID_KEY] = root.parent_id
            root.parent_id = None
    trace = Trace(trace_id=trace_id, spans=ordered, source_format=source_format, app=app,
                  complete=complete)
    if root is not None:
        trace.state = "ERROR" if root.status is SpanStatus.ERROR else "OK"
        trace.request_time_ms = root.start_ns // 1_000_000
        if root.end_ns is not None and root.end_ns >= root.start_ns:
            # A root ending before it starts states no duration: derivation names it (end_before_start).
            trace.duration_ms = (root.end_ns - root.start_ns) / 1e6
        for key, value in root.attributes.items():
            if key.startswith(_TAG_PREFIX) and isinstance(value, str):
                trace.tags[key[len(_TAG_PREFIX):]] = value
        if app_tag:
            tagged = trace.tags.get(app_tag) or root.attributes.get(app_tag)
            if isinstance(tagged, str) and tagged:
                trace.app = tagged
    session = None
    if session_tag:
        session = identity(trace.tags.get(session_tag)) or spans_identity(ordered, root, (session_tag,))
    trace.session_id = session or spans_identity(ordered, root, SESSION_ATTRIBUTES)
    trace.user_id = spans_identity(ordered, root, USER_ATTRIBUTES)
    trace.version = spans_version(ordered, root, trace.tags, version, version_tag)
    # As MLflow's OTLP ingest stores them.
    if trace.session_id is not None:
        trace.metadata[MLFLOW_SESSION] = trace.session_id
    if trace.user_id is not None:
        trace.metadata[MLFLOW_USER] = trace.user_id
    return trace
