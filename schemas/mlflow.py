"""MLflow trace JSON (`Trace.to_json()` / `to_dict()`, 3.x and 2.x) -> `Trace`.

Two readers: `parse_canonical_json` reads JSON bytes/text in exactly the shape `Trace.to_json()`
writes with msgspec typed structs (the stream's hot path) and gives None for anything else;
`parse_trace` reads every shape from a decoded dict and names what is wrong. Dicts always take the
general reader; traces embedded as JSON text take `parse_trace_json` (the msgspec path first).

The general reader is a hand-written walk over the decoded JSON: only the attributes derivation needs
are JSON-decoded (`mlflow.spanType`, `mlflow.spanInputs`, `mlflow.spanOutputs`,
`mlflow.chat.tokenUsage`) and no model is validated per span. The rules it checks are those of the
pydantic schemas in `tracejudge.schemas.inputs` (`MlflowTraceV3`, `MlflowTraceV2`), sharing their
coercion functions; when the walk finds something wrong, the record is validated against the
schema to name the field (`data.spans[2].start_time_unix_nano: expected an integer, got "abc"`).

Version differences handled (see notes in the README):
* 3.x: base64 ids; 3.5 wrote hex ids, a `tr-…` span trace id and "OK"/"ERROR" status codes;
  3.0–3.4 (proto JSON) may write int64 times as strings and a root's parent as "".
* 2.x: `request_id`/`timestamp_ms`/`execution_time_ms`/`status`/`request_metadata`; spans with
  `context`, `parent_id`, `start_time`/`end_time`, `status_code`; hex ids.
"""

from __future__ import annotations

from binascii import a2b_base64 as _a2b_base64
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
import orjson

from tracejudge.schemas import errors
from tracejudge.schemas.derive import HTTP_STATUS_KEYS
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.inputs import (
    MlflowTraceV2,
    MlflowTraceV3,
    ValidationError,
    as_int,
    describe,
    hex_id,
    time_ms,
)
from tracejudge.schemas.record import python_json
from tracejudge.schemas.trace import Document, Span, SpanKind, SpanStatus, TokenUsage, Trace

__all__ = ["APP_PREFIX", "is_mlflow_trace", "parse_canonical_json", "parse_trace", "parse_trace_json"]

# The app of an MLflow trace with no `app_tag` match: its experiment, as "experiment:<id>" so it
# cannot be mistaken for an endpoint or service name from another source.
APP_PREFIX = "experiment:"

SPAN_TYPE = "mlflow.spanType"
SPAN_INPUTS = "mlflow.spanInputs"
SPAN_OUTPUTS = "mlflow.spanOutputs"
CHAT_USAGE = "mlflow.chat.tokenUsage"
TRACE_USAGE = "mlflow.trace.tokenUsage"
# Trace metadata worth keeping as record tags (usable in sampling filters).
_METADATA_TAGS = ("mlflow.trace.session", "mlflow.trace.user", "mlflow.modelId",
                  "mlflow.databricks.modelServingEndpointName", "mlflow.sourceRun")

# MLflow types the neutral SpanKind does not name: structure-only ones read as CHAIN (as the OTLP
# conventions do), anything else as UNKNOWN.
_KINDS = {**{k.value: k for k in SpanKind}, "WORKFLOW": SpanKind.CHAIN, "TASK": SpanKind.CHAIN}
# `mlflow.spanType` as written ('"RETRIEVER"'): looked up without decoding.
_RAW_KINDS = {f'"{name}"': kind for name, kind in _KINDS.items()}
_STATUS = {
    "STATUS_CODE_OK": SpanStatus.OK, "OK": SpanStatus.OK,
    "STATUS_CODE_ERROR": SpanStatus.ERROR, "ERROR": SpanStatus.ERROR,
    "STATUS_CODE_UNSET": SpanStatus.UNSET, "UNSET": SpanStatus.UNSET,
}
# v2 `status` -> v3 `state` (`TraceStatus.to_state()`); unspecified states are not stated.
_STATES = {"OK": "OK", "ERROR": "ERROR", "IN_PROGRESS": "IN_PROGRESS"}


# Enum member lookups cost ~140 ns each on Python 3.11; the per-span code uses these instead.
_TOOL, _RETRIEVER, _UNKNOWN = SpanKind.TOOL, SpanKind.RETRIEVER, SpanKind.UNKNOWN
_UNSET = SpanStatus.UNSET


class _Malformed(Exception):
    """Raised by the span walk; the caller asks the schema where the record is wrong."""


def is_mlflow_trace(obj: Mapping[str, Any]) -> bool:
    return isinstance(obj.get("info"), dict) or ("info" in obj and "data" in obj)


def _attr(raw: Any) -> Any:
    """One MLflow span attribute: values are JSON-encoded strings; a value set directly on the
    OTel span is plain text and is kept as it is (as MLflow does)."""
    if type(raw) is not str:
        return raw
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:  # Python's json.dumps writes NaN/Infinity, which orjson rejects
            return python_json(raw)
        except (ValueError, RecursionError):
            return raw


def _usage(value: Any) -> TokenUsage | None:
    """`{"input_tokens", "output_tokens", "total_tokens"}`; a malformed usage is treated as unstated."""
    if type(value) is not dict:
        return None
    get = value.get
    inp, out, total = get("input_tokens"), get("output_tokens"), get("total_tokens")
    if type(inp) is not int:
        inp = None
    if type(out) is not int:
        out = None
    if type(total) is not int:
        total = None
    if inp is None and out is None and total is None:
        return None
    return TokenUsage(inp, out, total)


def _exception(events: Any) -> str | None:
    """"ValueError: tool exploded" from the first `exception` event (MLflow's own rendering)."""
    for event in events:
        if event["name"] == "exception":
            attrs = event.get("attributes") or {}
            kind = attrs.get("exception.type", "Exception")
            message = attrs.get("exception.message")
            return f"{kind}: {message}" if message else str(kind)
    return None


def _extra_attributes(attrs: dict[str, Any]) -> dict[str, Any]:
    extra = [k for k in attrs if not k.startswith("mlflow.")]
    return {k: _attr(attrs[k]) for k in extra} if extra else {}


def _check_events(events: list[Any], time_key: str) -> None:
    for event in events:
        if not isinstance(event, dict) or type(event["name"]) is not str:
            raise _Malformed
        event_attrs = event.get("attributes")
        if event_attrs is not None and not isinstance(event_attrs, dict):
            raise _Malformed
        when = event.get(time_key)
        if when is not None and type(when) is not int:
            as_int(when)


def _span_hex(raw: Any, ids: dict[str, str]) -> str:
    """A span id as hex, memoised per trace (every parent id is some span's id)."""
    if type(raw) is str:
        known = ids.get(raw)
        if known is not None:
            return known
        if len(raw) == 12 and raw[11] == "=":  # base64 of 8 bytes: MLflow 3's usual form
            try:
                known = ids[raw] = _a2b_base64(raw, strict_mode=True).hex()
                return known
            except ValueError:
                pass
    known = hex_id(raw, 8)
    if type(raw) is str:
        ids[raw] = known
    return known


def _span(raw: dict[str, Any], v2: bool, ids: dict[str, str], everything: bool) -> Span:
    # The hot loop of the stream: keep it flat (no helper calls on the common path), and check
    # exactly what the pydantic schema in `inputs` states, no more and no less.
    get = raw.get
    if v2:
        sid = raw["context"]["span_id"]
        parent = get("parent_id")
        start, end = raw["start_time"], get("end_time")
        code, message = get("status_code"), get("status_message")
    else:
        sid = raw["span_id"]
        parent = get("parent_span_id")
        start, end = raw["start_time_unix_nano"], get("end_time_unix_nano")
        status = get("status")
        if status is None:
            code = message = None
        elif isinstance(status, dict):
            code, message = status.get("code"), status.get("message")
        else:
            raise _Malformed
    span_id = _span_hex(sid, ids)
    if parent is None or parent == "":
        parent_id = None
    else:
        parent_id = ids.get(parent) if type(parent) is str else None
        if parent_id is None:
            parent_id = _span_hex(parent, ids)
    name = raw["name"]
    if type(start) is not int:
        start = as_int(start)
    if end is not None and type(end) is not int:
        end = as_int(end)
    if (type(name) is not str or (code is not None and type(code) is not str)
            or (message is not None and type(message) is not str)):
        raise _Malformed
    attrs = get("attributes")
    if attrs is None:
        attrs = {}
    elif not isinstance(attrs, dict):
        raise _Malformed
    events = get("events")
    if events:
        if type(events) is not list:
            raise _Malformed
        _check_events(events, "timestamp" if v2 else "time_unix_nano")
    elif events is not None and type(events) is not list:
        raise _Malformed

    attr = attrs.get
    kind_raw = attr(SPAN_TYPE)
    kind = _RAW_KINDS.get(kind_raw, _UNKNOWN) if type(kind_raw) is str else _UNKNOWN
    if kind is _UNKNOWN and kind_raw is not None:
        kind_raw = _attr(kind_raw)
        kind = _KINDS.get(kind_raw, _UNKNOWN) if type(kind_raw) is str else _UNKNOWN
    # Derivation reads the root's payloads, retrievers' outputs and tools' inputs; the rest (chat
    # spans carrying the whole prompt, mostly) stay undecoded unless the caller wants everything.
    whole = everything or parent_id is None
    inputs = _attr(attr(SPAN_INPUTS)) if whole or kind is _TOOL else None
    usage = attr(CHAT_USAGE)
    span = Span(
        span_id, parent_id, name, start,
        end or None,  # MLflow reads an end time of 0 as "not ended"
        kind,
        (_STATUS.get(code, _UNSET) if code else _UNSET),
        message or "",
        inputs,
        _attr(attr(SPAN_OUTPUTS)) if whole or kind is _RETRIEVER else None,
        None if usage is None else _usage(_attr(usage)),
        _exception(events) if events else None,
    )
    if whole:
        span.attributes = _extra_attributes(attrs)
    if kind is _TOOL:
        span.tool_name = _tool_name(inputs)
    return span


class _NotCanonical(Exception):
    """The span list is not in the shape `Trace.to_json()` of MLflow >= 3.5 writes."""


def _kind_of(raw: Any) -> SpanKind:
    """`mlflow.spanType` as `_span` reads it when it is not one of the usual quoted names."""
    if raw is None:
        return _UNKNOWN
    value = _attr(raw)
    return _KINDS.get(value, _UNKNOWN) if type(value) is str else _UNKNOWN


# --------------------------------------------------------------------------------------------
# JSON bytes in `Trace.to_json()`'s exact shape, decoded by msgspec (what `normalise()` reads).
#
# Most of a trace's bytes are its spans' `mlflow.spanInputs`/`spanOutputs`, JSON strings that
# derivation mostly never reads. orjson would allocate all of them; msgspec decodes the document
# into the structs below instead, checking the declared types and decoding the base64 ids in C,
# keeping the few attributes derivation may read as the raw bytes of their JSON text
# (`msgspec.Raw`) and skipping every other key unread. Whatever these structs reject (other
# shapes, bad records) is read again by the general path (orjson, `_parse`), which gives the
# result or names the field that is wrong.

# orjson, which the general path reads with, gives a float for an integer beyond 64 bits, and
# msgspec bounds must fit an int64: times past 2**63 - 1 ns (year 2262) take the general path.
_WireInt = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
_NO_EVENTS = msgspec.Raw(b"[]")


class _WireStatus(msgspec.Struct, gc=False):
    code: str
    message: str


# The root span's attributes `derive()` reads besides its payloads (struct field, attribute key).
_HTTP_FIELDS = tuple((f"http_{i}", key) for i, key in enumerate(HTTP_STATUS_KEYS))
# The attributes derivation reads: `mlflow.spanType` as written ('"RETRIEVER"', a JSON string),
# payloads and usage as raw JSON text (decoded only for the spans that need them), and the root
# span's HTTP status.
_WireAttributes = msgspec.defstruct("_WireAttributes", [
    ("span_type", str | None, msgspec.field(name=SPAN_TYPE, default=None)),
    ("inputs", msgspec.Raw, msgspec.field(name=SPAN_INPUTS, default=None)),
    ("outputs", msgspec.Raw, msgspec.field(name=SPAN_OUTPUTS, default=None)),
    ("usage", msgspec.Raw, msgspec.field(name=CHAT_USAGE, default=None)),
    *((name, msgspec.Raw, msgspec.field(name=key, default=None)) for name, key in _HTTP_FIELDS),
], gc=False)


class _WireSpan(msgspec.Struct, gc=False):
    # Every key is required and exactly typed: a span written any other way is read by `_span`.
    # msgspec's base64 is binascii's strict mode: standard alphabet, padded, nothing after the
    # padding, so an 8-byte id is exactly the 12-character form `_span_hex` decodes as base64.
    span_id: bytes
    parent_span_id: bytes | None
    name: str
    start_time_unix_nano: _WireInt
    end_time_unix_nano: _WireInt
    status: _WireStatus
    attributes: _WireAttributes
    events: msgspec.Raw  # nearly always "[]"; anything else is decoded and checked as JSON


class _WireData(msgspec.Struct, gc=False):
    spans: list[_WireSpan]


class _WireTrace(msgspec.Struct, gc=False):
    info: msgspec.Raw  # small: decoded by orjson and read by the same code as the general path
    data: _WireData


class _WireDocumentMetadata(msgspec.Struct, gc=False):
    doc_uri: str


class _WireDocument(msgspec.Struct, gc=False):
    # MLflow's `Document.to_dict()`; its other keys (id, chunk_id, score...) are skipped unread.
    page_content: str
    metadata: _WireDocumentMetadata


_WIRE_DECODER = msgspec.json.Decoder(_WireTrace)
_DOCUMENTS_DECODER = msgspec.json.Decoder(list[_WireDocument])
# A Raw's bytes reach orjson only through memoryview(), ~200 ns each: msgspec reads the JSON
# string holding an attribute's JSON at about orjson's speed without that toll.
_STRING_DECODER = msgspec.json.Decoder(str)


def _raw_attr(raw: msgspec.Raw) -> Any:
    """`_attr` of an attribute's JSON text: the JSON string, then the JSON inside it."""
    try:
        text = _STRING_DECODER.decode(raw)
    except msgspec.ValidationError:  # not a string: a value set directly on the span, kept as is
        return orjson.loads(memoryview(raw))
    return _attr(text)


def _raw_documents(raw: msgspec.Raw) -> list[Document] | None:
    """A retriever's `mlflow.spanOutputs` read straight into `Document`s when it is a list of
    MLflow `Document.to_dict()`s (what `documents_from_output` makes of them, at ~60% of the
    cost); None for any other form, which derivation reads from the decoded outputs."""
    try:
        chunks = _DOCUMENTS_DECODER.decode(_STRING_DECODER.decode(raw))
    except (msgspec.DecodeError, RecursionError):
        return None
    documents = [Document(chunk.page_content, chunk.metadata.doc_uri) for chunk in chunks]
    for document in documents:
        if not document.doc_uri:  # `documents_from_output` then looks for a top-level doc_uri
            return None
    return documents


def _root_attributes(attrs: Any) -> dict[str, Any]:
    out = {}
    for name, key in _HTTP_FIELDS:
        raw = getattr(attrs, name)
        if raw is not None:
            out[key] = _raw_attr(raw)
    return out


def _events_exception(events: msgspec.Raw) -> str | None:
    decoded = orjson.loads(memoryview(events))
    if type(decoded) is not list:
        raise _NotCanonical
    _check_events(decoded, "time_unix_nano")
    return _exception(decoded)


def _tool_name(inputs: Any) -> str | None:
    """A tool span recorded by a tool-calling framework names the tool in its inputs."""
    if type(inputs) is dict:
        call = inputs.get("call")
        if type(call) is dict and type(call.get("tool_name")) is str:
            return call["tool_name"]
    return None


class _NotLean(Exception):
    """A span list the lean walk cannot prune safely (a repeated span id, a child listed before its
    parent or under a parent no span has): read again keeping every span."""


def _wire_spans(spans_raw: list[_WireSpan], span_usage: bool) -> list[Span]:
    """The `Span`s `_span(..., everything=False)` builds (but for what `parse_canonical_json`
    documents), or `_NotCanonical`. The struct types already hold the checks `_span` makes with
    `type()`; what they cannot state is checked here.

    `span_usage=False` (the trace states its own token usage, so derivation sums none) keeps only
    the spans `derive()` reads: those without a parent, TOOL spans, and RETRIEVER spans with no
    RETRIEVER above them; the chains, model calls and rerankers around them (half the spans of a
    RAG agent's trace) are checked like the rest but never become `Span`s."""
    if not span_usage:
        try:
            return _walk(spans_raw, False, True)
        except _NotLean:
            pass
    return _walk(spans_raw, span_usage, False)


def _walk(spans_raw: list[_WireSpan], span_usage: bool, lean: bool) -> list[Span]:
    # The stream's hottest loop: most spans need nothing past the kind check (lean) or the `Span`
    # call, and the payload decoding is inlined for the common case, its fallbacks in `_raw_attr`.
    raw_kinds, status_of, unset, unknown, tool, retriever = (
        _RAW_KINDS, _STATUS, _UNSET, _UNKNOWN, _TOOL, _RETRIEVER)
    span_of, no_events, text_of, loads = Span, _NO_EVENTS, _STRING_DECODER.decode, orjson.loads
    inline_errors = (msgspec.ValidationError, orjson.JSONDecodeError)
    ids: dict[bytes, str] = {}  # every parent id is some span's id
    # Lean: RETRIEVER spans and every span below one. A retriever whose parent is in here is
    # nested (`top_level_retrievers` would leave it out), which needs parents listed first.
    below_retriever: set[bytes] = set()
    spans: list[Span] = []
    append = spans.append
    try:
        for raw in spans_raw:
            sid = raw.span_id
            if len(sid) != 8:
                raise _NotCanonical
            if lean and sid in ids:
                raise _NotLean
            span_id = ids[sid] = sid.hex()
            parent = raw.parent_span_id
            if parent is None:
                parent_id = None
            else:
                parent_id = ids.get(parent)
                if parent_id is None:  # a child listed before its parent
                    if lean:
                        raise _NotLean
                    if len(parent) != 8:
                        raise _NotCanonical
                    parent_id = ids[parent] = parent.hex()
            events = raw.events
            attrs = raw.attributes
            kind_raw = attrs.span_type
            kind = unknown if kind_raw is None else raw_kinds.get(kind_raw)
            if kind is None:
                kind = _kind_of(kind_raw)
            if lean and parent_id is not None:
                if parent in below_retriever:
                    below_retriever.add(sid)
                    keep = kind is tool
                elif kind is retriever:
                    below_retriever.add(sid)
                    keep = True
                else:
                    keep = kind is tool
                if not keep:
                    if events != no_events:
                        _events_exception(events)  # checked as the general reader checks it
                    continue
            status = raw.status
            span = span_of(
                span_id, parent_id, raw.name, raw.start_time_unix_nano,
                raw.end_time_unix_nano or None,  # MLflow reads an end time of 0 as "not ended"
                kind, status_of.get(status.code, unset), status.message, None, None, None,
                None if events == no_events else _events_exception(events),
            )
            append(span)
            # As in `_span`: the root's payloads, tools' inputs and retrievers' outputs.
            if parent_id is None:
                if attrs.inputs is not None:
                    span.inputs = _raw_attr(attrs.inputs)
                if attrs.outputs is not None:
                    span.outputs = _raw_attr(attrs.outputs)
                span.attributes = _root_attributes(attrs)
                if kind is tool:
                    span.tool_name = _tool_name(span.inputs)
            elif kind is tool:
                raw_inputs = attrs.inputs
                if raw_inputs is not None:
                    try:
                        inputs = span.inputs = loads(text_of(raw_inputs))
                    except inline_errors:
                        inputs = span.inputs = _raw_attr(raw_inputs)
                    if type(inputs) is dict and "call" in inputs:
                        span.tool_name = _tool_name(inputs)
            elif kind is retriever and attrs.outputs is not None:
                documents = span.documents = _raw_documents(attrs.outputs)
                if documents is None:
                    span.outputs = _raw_attr(attrs.outputs)
            if span_usage and attrs.usage is not None:
                span.token_usage = _usage(_raw_attr(attrs.usage))
    except (_Malformed, KeyError, TypeError, ValueError, RecursionError):
        raise _NotCanonical from None
    return spans


def parse_canonical_json(payload: bytes | str, *, app_tag: str | None = None) -> Trace | None:
    """The `Trace` of an MLflow 3 trace's JSON in exactly the shape `Trace.to_json()` writes, or
    None for anything else (another shape, another format, bad input) — then decode the payload
    and call `parse_trace`, which reads every form and names what is wrong.

    For the payloads it reads, `derive()` of the result equals `derive()` of
    `parse_trace(orjson.loads(payload), everything=False)`. The traces differ in
    what derivation does not read: a non-root retriever's MLflow documents are in
    `Span.documents` rather than `Span.outputs`, the root's `attributes` hold only its HTTP
    status, and when the trace states its token usage the spans' `token_usage` is left None and
    only the spans derivation then reads are kept (see `_wire_spans`).
    """
    try:
        if not payload.isascii():
            # msgspec does not check the UTF-8 of the values it skips; the general path rejects it.
            if type(payload) is not bytes:
                return None
            payload.decode()
        wire = _WIRE_DECODER.decode(payload)
        info = orjson.loads(memoryview(wire.info))
        if type(info) is not dict or ("request_id" in info and "trace_id" not in info):
            return None
        raw_id = info["trace_id"]
        if type(raw_id) is not str:
            return None
        # Trace-level usage, when stated, is what derivation reports: span usage goes unread.
        usage = _stated_usage(info.get("trace_metadata"))
        return _trace(info, raw_id, _wire_spans(wire.data.spans, usage is None), False, app_tag, usage)
    except (msgspec.DecodeError, UnicodeError, _NotCanonical, _Malformed, KeyError, TypeError, ValueError,
            AttributeError, IndexError, OverflowError, RecursionError):
        return None


def _str_map(value: dict[str, Any] | None) -> dict[str, str]:
    if not value:
        return {}
    for v in value.values():
        if type(v) is not str:
            break
    else:
        return dict(value)
    return {k: v for k, v in value.items() if type(v) is str}


def _duration_ms(info: Mapping[str, Any], v2: bool) -> float | None:
    value = info.get("execution_time_ms" if v2 else "execution_duration_ms")
    wire = None if v2 else info.get("execution_duration")
    if wire is not None and type(wire) is not str:
        raise _Malformed
    if value is not None:
        return float(as_int(value))
    if wire is None:
        return None
    if wire.endswith("s"):  # the REST wire form, a proto Duration: "0.026s"
        try:
            return float(wire[:-1]) * 1000.0
        except ValueError:
            return None
    return None


def _optional(info: Mapping[str, Any], key: str, kind: type) -> Any:
    value = info.get(key)
    if value is not None and not isinstance(value, kind):
        raise _Malformed
    return value


def _expectations(assessments: Any) -> dict[str, Any]:
    """{name: value} over valid expectation assessments (`extract_expectations_from_trace`)."""
    out: dict[str, Any] = {}
    if not isinstance(assessments, list):
        return out
    for a in assessments:
        if not isinstance(a, dict) or a.get("valid") is False:
            continue
        expectation = a.get("expectation")
        name = a.get("assessment_name") or a.get("name")
        if not isinstance(expectation, dict) or not isinstance(name, str):
            continue
        if "value" in expectation:
            out[name] = expectation["value"]
        else:
            serialized = expectation.get("serialized_value")
            if isinstance(serialized, dict) and isinstance(serialized.get("value"), str):
                out[name] = _attr(serialized["value"])
    return out


def _trace_id(value: str) -> str:
    """"tr-<hex>" (v3), "trace:/<location>/<hex>" (v4) or a v2 request id -> lowercase hex."""
    if value.startswith("tr-"):
        value = value[3:]
    elif value.startswith("trace:/"):
        value = value.rsplit("/", 1)[-1]
    return value.lower()


def _app(info: Mapping[str, Any], tags: dict[str, str], metadata: dict[str, str],
         app_tag: str | None, v2: bool) -> str | None:
    if v2:
        experiment = _optional(info, "experiment_id", str)
    else:
        experiment = None
        location = _optional(info, "trace_location", dict)
        if location is not None:
            _optional(location, "type", str)
            mlflow_experiment = _optional(location, "mlflow_experiment", dict)
            if mlflow_experiment is not None:
                experiment = _optional(mlflow_experiment, "experiment_id", str)
    if app_tag:
        value = tags.get(app_tag) or metadata.get(app_tag)
        if value:
            return value
    return f"{APP_PREFIX}{experiment}" if experiment else None


def _parse(obj: Mapping[str, Any], app_tag: str | None, everything: bool) -> Trace:
    info = obj["info"]
    if not isinstance(info, dict):
        raise _Malformed
    v2 = "request_id" in info and "trace_id" not in info
    raw_id = info["request_id"] if v2 else info["trace_id"]
    spans_raw = obj["data"]["spans"]
    if type(raw_id) is not str or not isinstance(spans_raw, list):
        raise _Malformed
    ids: dict[str, str] = {}
    spans = [_span(s, v2, ids, everything) for s in spans_raw]
    usage = _stated_usage(info.get("request_metadata" if v2 else "trace_metadata"))
    return _trace(info, raw_id, spans, v2, app_tag, usage)


def _stated_usage(metadata: Any) -> TokenUsage | None:
    """`mlflow.trace.tokenUsage` of the trace metadata: a string holding a usage object."""
    stated = metadata.get(TRACE_USAGE) if type(metadata) is dict else None
    return _usage(_attr(stated)) if type(stated) is str else None


def _trace(info: dict[str, Any], raw_id: str, spans: list[Span], v2: bool, app_tag: str | None,
           usage: TokenUsage | None) -> Trace:
    metadata = _str_map(_optional(info, "request_metadata" if v2 else "trace_metadata", dict))
    tags = _str_map(_optional(info, "tags", dict))
    for key in _METADATA_TAGS:
        if key in metadata:
            tags.setdefault(key, metadata[key])
    state = _optional(info, "status" if v2 else "state", str)
    assessments = _optional(info, "assessments", list)
    request_time = info.get("timestamp_ms" if v2 else "request_time")
    if v2 and request_time is not None:
        request_time = as_int(request_time)
    return Trace(
        trace_id=_trace_id(raw_id),
        spans=spans,
        source_format="mlflow_v2" if v2 else "mlflow_v3",
        app=_app(info, tags, metadata, app_tag, v2),
        client_request_id=None if v2 else _optional(info, "client_request_id", str),
        state=_STATES.get(state) if state else None,
        request_time_ms=None if request_time is None else time_ms(request_time),
        duration_ms=_duration_ms(info, v2),
        token_usage=usage,
        tags=tags,
        metadata=metadata,
        expectations=_expectations(assessments),
    )


def parse_trace(obj: Mapping[str, Any], *, app_tag: str | None = None, field: str = "",
                everything: bool = True) -> Trace:
    """Parse one MLflow trace dict; raises `RecordError` naming the field that is wrong.

    `field` prefixes error paths when the trace is embedded in another record ("trace",
    "response.databricks_output.trace"). With `everything=False` (what `normalise()` uses) only
    what `derive()` reads is decoded: the root span's inputs, outputs and other attributes, the
    outputs of RETRIEVER spans and the inputs of TOOL spans; other spans' `inputs`, `outputs` and
    `attributes` are left empty. Validation is the same either way.
    """
    try:
        return _parse(obj, app_tag, everything)
    except (_Malformed, KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
            RecursionError) as exc:
        raise explain(obj, field, exc) from None


def parse_trace_json(text: str, *, app_tag: str | None = None, field: str = "") -> Trace:
    """An MLflow trace embedded as JSON text in another record (an agent-evaluation row's `trace`,
    a serving response's `databricks_output.trace`), read for derivation: by `parse_canonical_json`
    when it is in `Trace.to_json()`'s exact shape, else decoded by orjson and read by `parse_trace`
    with `everything=False`. Raises `RecordError`: invalid_json at `field`, or the field that is wrong.

    One difference from decoding with orjson first: a number beyond the float range under a key
    derivation never reads is skipped by msgspec unread, so such a trace is read (as it is when it
    is the whole payload) rather than rejected as invalid JSON.
    """
    trace = parse_canonical_json(text, app_tag=app_tag)
    if trace is not None:
        return trace
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise RecordError(errors.INVALID_JSON, str(exc), field or None) from None
    return parse_trace(obj, app_tag=app_tag, field=field, everything=False)


def explain(obj: Any, field: str, cause: BaseException | None = None) -> RecordError:
    """A `RecordError` naming the first field of `obj` that breaks the MLflow trace schema."""
    prefix = f"{field}." if field else ""
    if not isinstance(obj, Mapping):
        return RecordError(errors.INVALID_RECORD, f"expected an MLflow trace object, got "
                           f"{type(obj).__name__}", field or None)
    info = obj.get("info")
    v2 = isinstance(info, Mapping) and "request_id" in info and "trace_id" not in info
    schema = MlflowTraceV2 if v2 else MlflowTraceV3
    try:
        schema.model_validate(obj)
    except ValidationError as exc:
        path, detail = describe(exc)
        return RecordError(errors.INVALID_RECORD, detail, f"{prefix}{path}" if path else field or None)
    except RecursionError:
        return RecordError(errors.INVALID_RECORD, "trace is nested too deeply", field or None)
    # The schema accepts what the walk rejected: a semantic problem such as an unparsable time.
    detail = str(cause) if cause is not None and str(cause) else "malformed MLflow trace"
    return RecordError(errors.INVALID_RECORD, detail[:200], field or None)
