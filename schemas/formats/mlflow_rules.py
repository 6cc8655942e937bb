"""The rules of an MLflow trace that both MLflow readers share: what the attributes are called, how
a span's type, status, usage, exception and tool are read, and how a trace's info becomes a `Trace`.

The general reader (`tracejudge.schemas.formats.mlflow`, any shape from a decoded dict) and the
msgspec hot path (`tracejudge.schemas.formats.mlflow_wire`, `Trace.to_json()`'s exact shape) read the
same traces into the same `Trace`; what they must agree on lives here, once. The per-span values are
plain module constants (`TOOL`, `UNSET`, ...) rather than enum lookups because the span walks of
both readers are the stream's hottest loops.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from tracejudge.schemas.formats.inputs import as_int, time_ms
from tracejudge.schemas.formats.release_version import mlflow_version
from tracejudge.schemas.formats.session_identity import MLFLOW_SESSION, MLFLOW_USER, identity
from tracejudge.schemas.record import HumanLabel, python_json
from tracejudge.schemas.trace import Span, SpanKind, SpanStatus, TokenUsage, Trace

__all__ = ["APP_PREFIX", "CHAT_USAGE", "KINDS", "LLM_COST", "LLM_MODEL", "RAW_KINDS", "RETRIEVER",
           "SPAN_INPUTS", "SPAN_OUTPUTS", "SPAN_TYPE", "STATUS", "TOOL", "TRACE_USAGE", "UNKNOWN", "UNSET",
           "Malformed", "attr_value", "build_trace", "check_events", "exception_text", "human_feedback",
           "read_usage", "tool_name"]

# The app of an MLflow trace with no `app_tag` match: its experiment, as "experiment:<id>" so it
# cannot be mistaken for an endpoint or service name from another source.
APP_PREFIX = "experiment:"

# The span attributes derivation reads, and the trace metadata key of the trace's own usage.
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
KINDS = {**{k.value: k for k in SpanKind}, "WORKFLOW": SpanKind.CHAIN, "TASK": SpanKind.CHAIN}
# `mlflow.spanType` as written ('"RETRIEVER"'): looked up without decoding.
RAW_KINDS = {f'"{name}"': kind for name, kind in KINDS.items()}
STATUS = {
    "STATUS_CODE_OK": SpanStatus.OK, "OK": SpanStatus.OK,
    "STATUS_CODE_ERROR": SpanStatus.ERROR, "ERROR": SpanStatus.ERROR,
    "STATUS_CODE_UNSET": SpanStatus.UNSET, "UNSET": SpanStatus.UNSET,
}
# v2 `status` -> v3 `state` (`TraceStatus.to_state()`); unspecified states are not stated.
_STATES = {"OK": "OK", "ERROR": "ERROR", "IN_PROGRESS": "IN_PROGRESS"}

# Enum member lookups cost ~140 ns each on Python 3.11; the per-span code uses these instead.
TOOL, RETRIEVER, UNKNOWN = SpanKind.TOOL, SpanKind.RETRIEVER, SpanKind.UNKNOWN
UNSET = SpanStatus.UNSET


class Malformed(Exception):
    """Raised by the span walk; the caller asks the schema where the record is wrong."""


def attr_value(raw: Any) -> Any:
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


def read_usage(value: Any) -> TokenUsage | None:
    """`{"input_tokens", "output_tokens", "total_tokens"[, "cache_read_input_tokens"]}`; a malformed
    usage is treated as unstated."""
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
    cached = get("cache_read_input_tokens")
    return TokenUsage(inp, out, total, cached if type(cached) is int else None)


def exception_text(events: Any) -> str | None:
    """"ValueError: tool exploded" from the first `exception` event (MLflow's own rendering)."""
    for event in events:
        if event["name"] == "exception":
            attrs = event.get("attributes") or {}
            kind = attrs.get("exception.type", "Exception")
            message = attrs.get("exception.message")
            return f"{kind}: {message}" if message else str(kind)
    return None


def check_events(events: list[Any], time_key: str) -> None:
    """Span events checked as the pydantic schema states them (`time_key`: 3.x `time_unix_nano`,
    2.x `timestamp`); raises `Malformed`."""
    for event in events:
        if not isinstance(event, dict) or type(event["name"]) is not str:
            raise Malformed
        event_attrs = event.get("attributes")
        if event_attrs is not None and not isinstance(event_attrs, dict):
            raise Malformed
        when = event.get(time_key)
        if when is not None and type(when) is not int:
            as_int(when)


def tool_name(inputs: Any) -> str | None:
    """A tool span recorded by a tool-calling framework names the tool in its inputs."""
    if type(inputs) is dict:
        call = inputs.get("call")
        if type(call) is dict and type(call.get("tool_name")) is str:
            return call["tool_name"]
    return None


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
                out[name] = attr_value(serialized["value"])
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


def build_trace(raw_id: str, spans: list[Span], source_format: str, app_tag: str | None,
                usage: TokenUsage | None, *, metadata: dict[str, str], tags: dict[str, str],
                experiment: str | None, client_request_id: str | None, state: str | None,
                assessments: list[Any] | None, request_time: Any, duration_value: Any,
                duration_wire: str | None, session_tag: str | None = None,
                version_tag: str | None = None) -> Trace:
    """The `Trace` from its info's values once their types are checked (by `mlflow._trace` in the
    general reader, by the msgspec structs in `mlflow_wire`): one set of rules for both readers.

    Session and user: the metadata MLflow stores them in (`mlflow.trace.session`/`.user`, what
    `mlflow.update_current_trace(metadata=...)` sets), else a tag of the same name (apps on MLflow 2,
    whose `update_current_trace` took tags only); `session_tag` names a tag or metadata key whose
    value is the session id instead, when the trace has it.

    Version (`release_version.mlflow_version`): the `version_tag` tag or metadata key, else
    `mlflow.modelId`, else `mlflow.source.git.commit`."""
    session = identity(metadata.get(MLFLOW_SESSION) or tags.get(MLFLOW_SESSION))
    user = identity(metadata.get(MLFLOW_USER) or tags.get(MLFLOW_USER))
    if session_tag:
        session = identity(tags.get(session_tag) or metadata.get(session_tag)) or session
    version = mlflow_version(tags, metadata, version_tag)
    for key in _METADATA_TAGS:
        if key in metadata:
            tags.setdefault(key, metadata[key])
    app = (tags.get(app_tag) or metadata.get(app_tag) or None) if app_tag else None
    if app is None and experiment:
        app = f"{APP_PREFIX}{experiment}"
    # The trace id, spans and format by position: a call of more than 15 keywords builds them into a dict.
    return Trace(
        _trace_id(raw_id), spans, source_format,
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
        version=version,
    )
