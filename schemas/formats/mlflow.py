"""MLflow trace JSON (`Trace.to_json()` / `to_dict()`, 3.x and 2.x) -> `Trace`: the general reader.

`parse_trace` reads every shape from a decoded dict and names what is wrong. JSON bytes or text in
exactly the shape `Trace.to_json()` writes are read first by `tracejudge.schemas.formats.mlflow_wire` with
msgspec typed structs (the stream's hot path), which shares this module's rules (`_build_trace`,
`_attr`, `_usage`, ...) and hands everything else back to here.

The general reader is a hand-written walk over the decoded JSON: only the attributes derivation needs
are JSON-decoded (`mlflow.spanType`, `mlflow.spanInputs`, `mlflow.spanOutputs`,
`mlflow.chat.tokenUsage`) and no model is validated per span. The rules it checks are those of the
pydantic schemas in `tracejudge.schemas.formats.inputs` (`MlflowTraceV3`, `MlflowTraceV2`), sharing their
coercion functions; when the walk finds something wrong, the record is validated against the
schema to name the field (`data.spans[2].start_time_unix_nano: expected an integer, got "abc"`).

Version differences handled (see notes in the README):
* 3.x: base64 ids; 3.5 wrote hex ids, a `tr-…` span trace id and "OK"/"ERROR" status codes;
  3.0–3.4 (proto JSON) may write int64 times as strings and a root's parent as "".
* 2.x: `request_id`/`timestamp_ms`/`execution_time_ms`/`status`/`request_metadata`; spans with
  `context`, `parent_id`, `start_time`/`end_time`, `status_code`; hex ids.
"""

from __future__ import annotations

import math
from binascii import a2b_base64 as _a2b_base64
from collections.abc import Mapping
from typing import Any

import orjson

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.conventions import MLFLOW_SESSION, MLFLOW_USER, identity
from tracejudge.schemas.formats.inputs import (
    MlflowTraceV2,
    MlflowTraceV3,
    ValidationError,
    as_int,
    describe,
    hex_id,
    time_ms,
)
from tracejudge.schemas.record import HumanLabel, python_json
from tracejudge.schemas.trace import Span, SpanKind, SpanStatus, TokenUsage, Trace

__all__ = ["APP_PREFIX", "explain", "is_mlflow_trace", "parse_trace", "tagged_identity"]

# The app of an MLflow trace with no `app_tag` match: its experiment, as "experiment:<id>" so it
# cannot be mistaken for an endpoint or service name from another source.
APP_PREFIX = "experiment:"

SPAN_TYPE = "mlflow.spanType"
SPAN_INPUTS = "mlflow.spanInputs"
SPAN_OUTPUTS = "mlflow.spanOutputs"
CHAT_USAGE = "mlflow.chat.tokenUsage"
LLM_MODEL = "mlflow.llm.model"
LLM_COST = "mlflow.llm.cost"
TRACE_USAGE = "mlflow.trace.tokenUsage"
# Trace metadata worth keeping as record tags (usable in sampling filters).
_METADATA_TAGS = (MLFLOW_SESSION, MLFLOW_USER, "mlflow.modelId",
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
    if span.token_usage is not None and (LLM_MODEL in attrs or LLM_COST in attrs):
        # The model call's model and stated cost: the record's per-model usage and cost.
        if not whole:
            span.attributes = {}
        for key in (LLM_MODEL, LLM_COST):
            if key in attrs:
                span.attributes[key] = _attr(attrs[key])
    if kind is _TOOL:
        span.tool_name = _tool_name(inputs)
    return span


def _tool_name(inputs: Any) -> str | None:
    """A tool span recorded by a tool-calling framework names the tool in its inputs."""
    if type(inputs) is dict:
        call = inputs.get("call")
        if type(call) is dict and type(call.get("tool_name")) is str:
            return call["tool_name"]
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


def _duration_ms(value: Any, wire: str | None) -> float | None:
    """`execution_duration_ms` (or 2.x `execution_time_ms`), else `execution_duration`, the REST
    wire form (a proto Duration: "0.026s"). A negative or non-finite duration (the NaN or Infinity a
    Python producer writes) is kept as stated: derivation sets it aside and names why."""
    if value is not None:
        if type(value) is float and not math.isfinite(value):
            return value
        return float(as_int(value))
    if wire is not None and wire.endswith("s"):
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


def human_feedback(assessments: Any) -> list[HumanLabel] | None:
    """HUMAN feedback among MLflow assessment dicts (`Trace.to_json()`'s `info.assessments`): valid
    feedback whose source type is HUMAN, as `HumanLabel`s (expectations and judges' feedback are not
    labels); None when there is none. Schema 4."""
    if not isinstance(assessments, list) or not assessments:
        return None
    out: list[HumanLabel] = []
    for a in assessments:
        if not isinstance(a, dict) or a.get("valid") is False:
            continue
        feedback, source = a.get("feedback"), a.get("source")
        name = a.get("assessment_name") or a.get("name")
        if not isinstance(feedback, dict) or "value" not in feedback or not isinstance(name, str):
            continue
        if not isinstance(source, dict) or source.get("source_type") != "HUMAN":
            continue
        source_id = source.get("source_id")
        out.append(HumanLabel(name, feedback["value"], "HUMAN",
                              source_id if isinstance(source_id, str) else None))
    return out or None


def _trace_id(value: str) -> str:
    """"tr-<hex>" (v3), "trace:/<location>/<hex>" (v4) or a v2 request id -> lowercase hex."""
    if value.startswith("tr-"):
        value = value[3:]
    elif value.startswith("trace:/"):
        value = value.rsplit("/", 1)[-1]
    return value.lower()


def _parse(obj: Mapping[str, Any], app_tag: str | None, everything: bool, session_tag: str | None) -> Trace:
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
    return _trace(info, raw_id, spans, v2, app_tag, usage, session_tag)


def _stated_usage(metadata: Any) -> TokenUsage | None:
    """`mlflow.trace.tokenUsage` of the trace metadata: a string holding a usage object."""
    stated = metadata.get(TRACE_USAGE) if type(metadata) is dict else None
    return _usage(_attr(stated)) if type(stated) is str else None


def _trace(info: dict[str, Any], raw_id: str, spans: list[Span], v2: bool, app_tag: str | None,
           usage: TokenUsage | None, session_tag: str | None = None) -> Trace:
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
    return _build_trace(
        raw_id, spans, "mlflow_v2" if v2 else "mlflow_v3", app_tag, usage,
        metadata=metadata, tags=tags, experiment=experiment, client_request_id=client_request_id,
        state=state, assessments=assessments, request_time=request_time,
        duration_value=info.get("execution_time_ms" if v2 else "execution_duration_ms"),
        duration_wire=wire_duration, session_tag=session_tag,
    )


def _build_trace(raw_id: str, spans: list[Span], source_format: str, app_tag: str | None,
                 usage: TokenUsage | None, *, metadata: dict[str, str], tags: dict[str, str],
                 experiment: str | None, client_request_id: str | None, state: str | None,
                 assessments: list[Any] | None, request_time: Any, duration_value: Any,
                 duration_wire: str | None, session_tag: str | None = None) -> Trace:
    """The `Trace` from its info's values once their types are checked (here by `_trace`, in
    `mlflow_wire` by the msgspec structs): one set of rules for both readers.

    Session and user: the metadata MLflow stores them in (`mlflow.trace.session`/`.user`, what
    `mlflow.update_current_trace(metadata=...)` sets), else a tag of the same name (apps on MLflow 2,
    whose `update_current_trace` took tags only); `session_tag` names a tag or metadata key whose
    value is the session id instead, when the trace has it."""
    session = identity(metadata.get(MLFLOW_SESSION) or tags.get(MLFLOW_SESSION))
    user = identity(metadata.get(MLFLOW_USER) or tags.get(MLFLOW_USER))
    if session_tag:
        session = identity(tags.get(session_tag) or metadata.get(session_tag)) or session
    for key in _METADATA_TAGS:
        if key in metadata:
            tags.setdefault(key, metadata[key])
    app = (tags.get(app_tag) or metadata.get(app_tag) or None) if app_tag else None
    if app is None and experiment:
        app = f"{APP_PREFIX}{experiment}"
    return Trace(
        trace_id=_trace_id(raw_id),
        spans=spans,
        source_format=source_format,
        app=app,
        client_request_id=client_request_id,
        state=_STATES.get(state) if state else None,
        request_time_ms=None if request_time is None else time_ms(request_time),
        duration_ms=_duration_ms(duration_value, duration_wire),
        token_usage=usage,
        tags=tags,
        metadata=metadata,
        expectations=_expectations(assessments),
        human_labels=human_feedback(assessments) if assessments else None,
        session_id=session,
        user_id=user,
    )


def tagged_identity(trace: Trace, name: str) -> str | None:
    """The id a trace's tag or metadata key `name` states (`stream.session_tag`), or None."""
    return identity(trace.tags.get(name) or trace.metadata.get(name))


def parse_trace(obj: Mapping[str, Any], *, app_tag: str | None = None, field: str = "",
                everything: bool = True, session_tag: str | None = None) -> Trace:
    """Parse one MLflow trace dict; raises `RecordError` naming the field that is wrong.

    `field` prefixes error paths when the trace is embedded in another record ("trace",
    "response.databricks_output.trace"). With `everything=False` (what `normalise()` uses) only
    what `derive()` reads is decoded: the root span's inputs, outputs and other attributes, the
    outputs of RETRIEVER spans and the inputs of TOOL spans; other spans' `inputs`, `outputs` and
    `attributes` are left empty. Validation is the same either way. `session_tag` (`stream.session_tag`)
    names a tag or metadata key whose value is the trace's session id, over MLflow's own.
    """
    try:
        return _parse(obj, app_tag, everything, session_tag)
    except (_Malformed, KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
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
