"""MLflow trace JSON (`Trace.to_json()` / `to_dict()`, 3.x and 2.x) -> `Trace`: the general reader.

`parse_trace` reads every shape from a decoded dict and names what is wrong. JSON bytes or text in
exactly the shape `Trace.to_json()` writes are read first by `tracejudge.schemas.formats.mlflow_wire` with
msgspec typed structs (the stream's hot path) and hands everything else back to here; the rules the
two readers share (attribute names, span kinds and statuses, usage, the `Trace` of an info) are
`tracejudge.schemas.formats.mlflow_rules`.

The general reader is a hand-written walk over the decoded JSON: only the attributes derivation needs
are JSON-decoded (`mlflow.spanType`, `mlflow.spanInputs`, `mlflow.spanOutputs`,
`mlflow.chat.tokenUsage`) and no model is validated per span. The rules it checks are those of the
pydantic schemas in `tracejudge.schemas.formats.inputs` (`MlflowTraceV3`, `MlflowTraceV2`), sharing their
coercion functions; when the walk finds something wrong, the record is validated against the
schema to name the field (`data.spans[2].start_time_unix_nano: expected an integer, got "abc"`).

Version differences handled (see docs/pages/inputs/formats.md):
* 3.x: base64 ids; 3.5 wrote hex ids, a `tr-…` span trace id and "OK"/"ERROR" status codes;
  3.0–3.4 (proto JSON) may write int64 times as strings and a root's parent as "".
* 2.x: `request_id`/`timestamp_ms`/`execution_time_ms`/`status`/`request_metadata`; spans with
  `context`, `parent_id`, `start_time`/`end_time`, `status_code`; hex ids.
"""

from __future__ import annotations

from binascii import a2b_base64 as _a2b_base64
from collections.abc import Mapping
from typing import Any

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.inputs import (
    MlflowTraceV2,
    MlflowTraceV3,
    ValidationError,
    as_int,
    describe,
    hex_id,
)
from tracejudge.schemas.formats.mlflow_rules import (
    APP_PREFIX,
    CHAT_USAGE,
    KINDS,
    LLM_COST,
    LLM_MODEL,
    RAW_KINDS,
    RETRIEVER,
    SPAN_INPUTS,
    SPAN_OUTPUTS,
    SPAN_TYPE,
    STATUS,
    TOOL,
    TRACE_USAGE,
    UNKNOWN,
    UNSET,
    Malformed,
    attr_value,
    build_trace,
    check_events,
    exception_text,
    read_usage,
    tool_name,
)
from tracejudge.schemas.formats.session_identity import identity
from tracejudge.schemas.trace import Span, TokenUsage, Trace

__all__ = ["APP_PREFIX", "explain", "is_mlflow_trace", "parse_trace", "tagged_identity"]


def is_mlflow_trace(obj: Mapping[str, Any]) -> bool:
    return isinstance(obj.get("info"), dict) or ("info" in obj and "data" in obj)


def _extra_attributes(attrs: dict[str, Any]) -> dict[str, Any]:
    extra = [k for k in attrs if not k.startswith("mlflow.")]
    return {k: attr_value(attrs[k]) for k in extra} if extra else {}


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
            raise Malformed
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
        raise Malformed
    attrs = get("attributes")
    if attrs is None:
        attrs = {}
    elif not isinstance(attrs, dict):
        raise Malformed
    events = get("events")
    if events:
        if type(events) is not list:
            raise Malformed
        check_events(events, "timestamp" if v2 else "time_unix_nano")
    elif events is not None and type(events) is not list:
        raise Malformed

    attr = attrs.get
    kind_raw = attr(SPAN_TYPE)
    kind = RAW_KINDS.get(kind_raw, UNKNOWN) if type(kind_raw) is str else UNKNOWN
    if kind is UNKNOWN and kind_raw is not None:
        kind_raw = attr_value(kind_raw)
        kind = KINDS.get(kind_raw, UNKNOWN) if type(kind_raw) is str else UNKNOWN
    # Derivation reads the root's payloads, retrievers' outputs and tools' inputs; the rest (chat
    # spans carrying the whole prompt, mostly) stay undecoded unless the caller wants everything.
    whole = everything or parent_id is None
    inputs = attr_value(attr(SPAN_INPUTS)) if whole or kind is TOOL else None
    usage = attr(CHAT_USAGE)
    span = Span(
        span_id, parent_id, name, start,
        end or None,  # MLflow reads an end time of 0 as "not ended"
        kind,
        (STATUS.get(code, UNSET) if code else UNSET),
        message or "",
        inputs,
        attr_value(attr(SPAN_OUTPUTS)) if whole or kind is RETRIEVER else None,
        None if usage is None else read_usage(attr_value(usage)),
        exception_text(events) if events else None,
    )
    if whole:
        span.attributes = _extra_attributes(attrs)
    if span.token_usage is not None and (LLM_MODEL in attrs or LLM_COST in attrs):
        # The model call's model and stated cost: the record's per-model usage and cost.
        if not whole:
            span.attributes = {}
        for key in (LLM_MODEL, LLM_COST):
            if key in attrs:
                span.attributes[key] = attr_value(attrs[key])
    if kind is TOOL:
        span.tool_name = tool_name(inputs)
        outputs = attr(SPAN_OUTPUTS)
        if type(outputs) is str and outputs:  # the result's JSON text, as the wire reader measures it
            span.output_chars = len(outputs)
    return span


def _str_map(value: dict[str, Any] | None) -> dict[str, str]:
    if not value:
        return {}
    for v in value.values():
        if type(v) is not str:
            break
    else:
        return dict(value)
    return {k: v for k, v in value.items() if type(v) is str}


def _optional(info: Mapping[str, Any], key: str, kind: type) -> Any:
    value = info.get(key)
    if value is not None and not isinstance(value, kind):
        raise Malformed
    return value


def _parse(obj: Mapping[str, Any], app_tag: str | None, everything: bool, session_tag: str | None,
           version_tag: str | None = None) -> Trace:
    info = obj["info"]
    if not isinstance(info, dict):
        raise Malformed
    v2 = "request_id" in info and "trace_id" not in info
    raw_id = info["request_id"] if v2 else info["trace_id"]
    spans_raw = obj["data"]["spans"]
    if type(raw_id) is not str or not isinstance(spans_raw, list):
        raise Malformed
    ids: dict[str, str] = {}
    spans = [_span(s, v2, ids, everything) for s in spans_raw]
    usage = _stated_usage(info.get("request_metadata" if v2 else "trace_metadata"))
    return _trace(info, raw_id, spans, v2, app_tag, usage, session_tag, version_tag)


def _stated_usage(metadata: Any) -> TokenUsage | None:
    """`mlflow.trace.tokenUsage` of the trace metadata: a string holding a usage object."""
    stated = metadata.get(TRACE_USAGE) if type(metadata) is dict else None
    return read_usage(attr_value(stated)) if type(stated) is str else None


def _trace(info: dict[str, Any], raw_id: str, spans: list[Span], v2: bool, app_tag: str | None,
           usage: TokenUsage | None, session_tag: str | None = None, version_tag: str | None = None) -> Trace:
    """The trace of a decoded `info`, each key checked as the schema states it."""
    metadata = _str_map(_optional(info, "request_metadata" if v2 else "trace_metadata", dict))
    tags = _str_map(_optional(info, "tags", dict))
    state = _optional(info, "status" if v2 else "state", str)
    assessments = _optional(info, "assessments", list)
    request_time = info.get("timestamp_ms" if v2 else "request_time")
    if v2 and request_time is not None:
        request_time = as_int(request_time)
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
    client_request_id = None if v2 else _optional(info, "client_request_id", str)
    wire_duration = None if v2 else _optional(info, "execution_duration", str)
    return build_trace(
        raw_id, spans, "mlflow_v2" if v2 else "mlflow_v3", app_tag, usage,
        metadata=metadata, tags=tags, experiment=experiment, client_request_id=client_request_id,
        state=state, assessments=assessments, request_time=request_time,
        duration_value=info.get("execution_time_ms" if v2 else "execution_duration_ms"),
        duration_wire=wire_duration, session_tag=session_tag, version_tag=version_tag,
    )


def tagged_identity(trace: Trace, name: str) -> str | None:
    """The id a trace's tag or metadata key `name` states (`stream.session_tag`), or None."""
    return identity(trace.tags.get(name) or trace.metadata.get(name))


def parse_trace(obj: Mapping[str, Any], *, app_tag: str | None = None, field: str = "",
                everything: bool = True, session_tag: str | None = None,
                version_tag: str | None = None) -> Trace:
    """Parse one MLflow trace dict; raises `RecordError` naming the field that is wrong.

    `field` prefixes error paths when the trace is embedded in another record ("trace",
    "response.databricks_output.trace"). With `everything=False` (what `normalise()` uses) only
    what `derive()` reads is decoded: the root span's inputs, outputs and other attributes, the
    outputs of RETRIEVER spans and the inputs of TOOL spans; other spans' `inputs`, `outputs` and
    `attributes` are left empty. Validation is the same either way. `session_tag` (`stream.session_tag`)
    names a tag or metadata key whose value is the trace's session id, over MLflow's own;
    `version_tag` (`stream.version_tag`) likewise its version (`release_version.mlflow_version`).
    """
    try:
        return _parse(obj, app_tag, everything, session_tag, version_tag)
    except (Malformed, KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
            RecursionError) as exc:
        raise explain(obj, field, exc) from None


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
    # A library's own message (float(), fromisoformat(), a KeyError) quotes the record's text: described.
    detail = errors.unquoted(str(cause)) if cause is not None and str(cause) else "malformed MLflow trace"
    return RecordError(errors.INVALID_RECORD, detail[:200], field or None)
