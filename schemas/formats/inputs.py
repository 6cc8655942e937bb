"""The input formats tracejudge reads, as pydantic v2 schemas: the documented source of truth.

* `AgentEvalRecord`: a Databricks/MLflow agent-evaluation row (`request`, `response`,
  `retrieved_context`, `expected_*`, `guidelines`, `reference_trajectory`, `trace`).
* `MlflowTraceV3` / `MlflowTraceV2`: `mlflow.entities.Trace.to_json()` of MLflow 3.x and 2.x.
* `InferenceLogRow`: a model-serving payload-logging row (AI-Gateway and legacy tables).

Unknown fields are ignored everywhere: producers add fields between versions.

The MLflow trace parser (`tracejudge.schemas.formats.mlflow`) does not run these models on the happy path:
a 40-span trace would cost far more to validate than to parse. It checks the same rules inline,
using the same coercion functions defined here, and only when it finds something wrong does it
validate against these models to name the field (`data.spans[2].start_time_unix_nano: …`). A test
(`tests/test_bad_input.py`) checks that the parser and these schemas accept and reject the same
records.
"""

from __future__ import annotations

import binascii
import math
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError

from tracejudge.schemas.errors import describe_value
from tracejudge.schemas.record import TOOL_ERROR_MAX_CHARS

__all__ = [
    "AgentEvalRecord",
    "ContextDocument",
    "InferenceLogRow",
    "MlflowTraceV2",
    "MlflowTraceV3",
    "ValidationError",
    "as_int",
    "brief",
    "hex_id",
    "time_ms",
]


def brief(value: Any, limit: int = 60) -> str:
    """A bad value as an error message names it: its type and size, never its content (a record's
    field may hold personal data; see `errors.describe_value`). `limit` is kept for callers."""
    return describe_value(value)


def as_int(value: Any) -> int:
    """An integer as a JSON producer may write it: a number, or a decimal string (proto JSON int64)."""
    if type(value) is int:
        return value
    if isinstance(value, str):
        stripped = value.strip()
        if stripped and (stripped.isdigit() or (stripped[0] == "-" and stripped[1:].isdigit())):
            return int(stripped)
    elif isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError(f"expected an integer, got {brief(value)}")


_HEX = frozenset("0123456789abcdefABCDEF")


def hex_id(value: Any, size: int = 8) -> str:
    """A span (size 8) or trace (size 16) id as lowercase hex, from hex or base64.

    MLflow 3 JSON writes ids in base64, MLflow 3.5 and 2.x in hex, OTLP/JSON in hex; an id of
    exactly 2*size hex digits is hex, anything else must be base64.
    """
    if isinstance(value, str):
        text = value
        if len(text) == 2 * size and _HEX.issuperset(text):
            return text.lower()
        if len(text) == 2 * size + 2 and text.startswith("0x") and _HEX.issuperset(text[2:]):
            return text[2:].lower()
        try:
            raw = binascii.a2b_base64(text, strict_mode=True)
        except (binascii.Error, ValueError):
            raw = b""
        if raw:
            return raw.hex()
        if text and len(text) % 2 == 0 and _HEX.issuperset(text):
            return text.lower()
    raise ValueError(f"expected a hex or base64 id, got {brief(value)}")


def _int(value: Any) -> int:
    return as_int(value)


def _span_id(value: Any) -> str:
    return hex_id(value, 8)


def _optional_span_id(value: Any) -> str | None:
    # A root span's parent is null, "" or absent depending on the MLflow version.
    return None if value is None or value == "" else hex_id(value, 8)


def _optional_int(value: Any) -> int | None:
    return None if value is None else as_int(value)


def _duration(value: Any) -> int | float | None:
    # A NaN or Infinity duration is kept: derivation reads it as no latency and names why.
    return value if type(value) is float and not math.isfinite(value) else _optional_int(value)


def time_ms(value: Any) -> int:
    """Epoch milliseconds from an RFC 3339 time (naive means UTC) or an integer of milliseconds."""
    if type(value) is str:
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            moment = None
        if moment is not None:
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=UTC)
            return int(moment.timestamp() * 1000)
    try:
        return as_int(value)
    except ValueError:
        raise ValueError(f"expected an RFC 3339 time or epoch milliseconds, got {brief(value)}") from None


def _time(value: Any) -> Any:
    if value is not None:
        time_ms(value)
    return value


def _checked(*types: type, what: str) -> Any:
    def check(value: Any) -> Any:
        if value is None or isinstance(value, types):
            return value
        raise ValueError(f"expected {what}, got {brief(value)}")
    return BeforeValidator(check)


def _request_id(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if type(value) is int:
        return str(value)
    raise ValueError(f"expected a string, got {brief(value)}")


def _identity(value: Any) -> str | None:
    """A `session_id`/`user_id` column: a string, or a number (some producers count conversations)
    as its text. A bool, list or object identifies nothing: the row is rejected naming the column."""
    if value is None or isinstance(value, str):
        return value
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return str(value)
    raise ValueError(f"expected a string, got {brief(value)}")


# A session or user id column (blank values are read as absent by the parsers).
Identity = Annotated[str | None, BeforeValidator(_identity)]
Int = Annotated[int, BeforeValidator(_int)]
OptionalInt = Annotated[int | None, BeforeValidator(_optional_int)]
Duration = Annotated[int | float | None, BeforeValidator(_duration)]
Time = Annotated[Any, BeforeValidator(_time)]
SpanId = Annotated[str, BeforeValidator(_span_id)]
OptionalSpanId = Annotated[str | None, BeforeValidator(_optional_span_id)]


class _Model(BaseModel):
    # Strict: the trace parser's inline checks are type checks, and the two must agree.
    model_config = ConfigDict(extra="ignore", strict=True)


# ------------------------------------------------------------------------------------------
# MLflow 3.x


class SpanStatusV3(_Model):
    # "STATUS_CODE_OK" / "STATUS_CODE_ERROR" / "STATUS_CODE_UNSET"; MLflow 3.5 wrote "OK"/"ERROR"/"UNSET".
    code: str | None = None
    message: str | None = None


class SpanEventV3(_Model):
    name: str
    time_unix_nano: OptionalInt = None
    # Event attribute values are raw (not JSON-encoded), unlike span attributes.
    attributes: dict[str, Any] | None = None


class SpanV3(_Model):
    span_id: SpanId
    parent_span_id: OptionalSpanId = None
    name: str
    start_time_unix_nano: Int
    end_time_unix_nano: OptionalInt = None
    status: SpanStatusV3 | None = None
    # Every value is a JSON-encoded string ("mlflow.spanType": "\"RETRIEVER\"").
    attributes: dict[str, Any] | None = None
    events: list[SpanEventV3] | None = None


class ExperimentLocation(_Model):
    experiment_id: str | None = None


class TraceLocation(_Model):
    type: str | None = None
    mlflow_experiment: ExperimentLocation | None = None


class TraceInfoV3(_Model):
    trace_id: str
    client_request_id: str | None = None
    trace_location: TraceLocation | None = None
    # RFC 3339 ("2026-11-22T00:24:04.847Z") in JSON; epoch milliseconds from some writers.
    request_time: Time = None
    execution_duration_ms: Duration = None
    # The REST wire form: a proto Duration ("0.026s").
    execution_duration: str | None = None
    state: str | None = None
    trace_metadata: dict[str, Any] | None = None
    tags: dict[str, Any] | None = None
    # Assessment dicts. Entries shaped `{"assessment_name": str, "expectation": {"value": …}}` (or
    # `{"serialized_value": {"value": "<json>"}}`) and not `"valid": false` become the record's
    # expected_* fields; anything else in the list is ignored rather than rejected.
    assessments: list[Any] | None = None


class TraceDataV3(_Model):
    spans: list[SpanV3]


class MlflowTraceV3(_Model):
    """`Trace.to_json()` of MLflow 3.x."""

    info: TraceInfoV3
    data: TraceDataV3


# ------------------------------------------------------------------------------------------
# MLflow 2.x


class SpanContextV2(_Model):
    span_id: SpanId


class SpanEventV2(_Model):
    name: str
    # Microseconds in 2.x (`int(time.time() * 1e6)`), unlike 3.x's nanoseconds.
    timestamp: OptionalInt = None
    attributes: dict[str, Any] | None = None


class SpanV2(_Model):
    name: str
    context: SpanContextV2
    parent_id: OptionalSpanId = None
    start_time: Int
    end_time: OptionalInt = None
    status_code: str | None = None
    status_message: str | None = None
    attributes: dict[str, Any] | None = None
    events: list[SpanEventV2] | None = None


class TraceInfoV2(_Model):
    request_id: str
    experiment_id: str | None = None
    timestamp_ms: OptionalInt = None
    execution_time_ms: Duration = None
    # "OK" / "ERROR" / "IN_PROGRESS" / "TRACE_STATUS_UNSPECIFIED"
    status: str | None = None
    request_metadata: dict[str, Any] | None = None
    tags: dict[str, Any] | None = None
    # Assessment dicts. Entries shaped `{"assessment_name": str, "expectation": {"value": …}}` (or
    # `{"serialized_value": {"value": "<json>"}}`) and not `"valid": false` become the record's
    # expected_* fields; anything else in the list is ignored rather than rejected.
    assessments: list[Any] | None = None


class TraceDataV2(_Model):
    spans: list[SpanV2]


class MlflowTraceV2(_Model):
    """`Trace.to_json()` of MLflow 2.x."""

    info: TraceInfoV2
    data: TraceDataV2


# ------------------------------------------------------------------------------------------
# Agent evaluation record


class ChatMessage(_Model):
    role: str
    # A string, a list of content parts, or null (an assistant message that only calls tools).
    content: str | list[Any] | None = None


class ChatRequest(_Model):
    """An OpenAI chat request: the question is the last user message."""

    messages: list[ChatMessage] = Field(min_length=1)


class QueryRequest(_Model):
    """`{"query": …, "history": [...]}`: the question is `query`."""

    query: str
    history: list[ChatMessage] | None = None


class ContextDocument(_Model):
    content: str | None = None
    doc_uri: str | None = None


class ToolStep(_Model):
    tool_name: str
    tool_input: Any = None
    # Why the call failed (schema 6, `ToolCall.error`), or `failed: true` when the row says only that.
    error: str | None = None
    failed: bool | None = None

    def error_text(self) -> str | None:
        """The call's `ToolCall.error`: the stated error (cut), "failed" when only `failed` is true."""
        if self.error:
            return self.error[:TOOL_ERROR_MAX_CHARS]
        return "failed" if self.failed else None


class ExpectedToolCall(_Model):
    """One of MLflow's `expected_tool_calls`: a tool name and, optionally, the arguments it must get."""

    name: str
    arguments: dict[str, Any] | None = None


def _request_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "as text"
    if isinstance(value, dict):
        if "messages" in value:
            return "as chat"
        if "query" in value:
            return "as query"
        return "as object"
    return None


# Union members are tagged with labels containing a space so error paths can leave them out
# (`request.messages[1].role`, not `request.as chat.messages.1.role`).
Request = Annotated[
    Annotated[str, Tag("as text")] | Annotated[ChatRequest, Tag("as chat")]
    | Annotated[QueryRequest, Tag("as query")] | Annotated[dict[str, Any], Tag("as object")],
    Discriminator(_request_kind, custom_error_type="request_type",
                  custom_error_message="expected a string or an object"),
]


def _guidelines_kind(value: Any) -> str | None:
    return "as list" if isinstance(value, list) else "as groups" if isinstance(value, dict) else None


Guidelines = Annotated[
    Annotated[list[str], Tag("as list")] | Annotated[dict[str, list[str]], Tag("as groups")],
    Discriminator(_guidelines_kind, custom_error_type="guidelines_type",
                  custom_error_message="expected a list of strings or an object of lists"),
]


class AgentEvalRecord(_Model):
    """One agent-evaluation row (Databricks Agent Evaluation / `mlflow.evaluate` schema).

    Also accepted: MLflow 3's `mlflow.genai.evaluate` row shape (`inputs`, `outputs`,
    `expectations`), used for whatever the classic fields leave unstated.
    """

    request_id: Annotated[str | None, BeforeValidator(_request_id)] = None
    # The trace the row was collected from (`schemas/formats/collected.py`), and its tool calls.
    trace_id: str | None = None
    trajectory: list[ToolStep] | None = None
    # A plain string, {"messages": [...]}, {"query": ..., "history": [...]}, or another object
    # (the question is then taken from it by the derivation rules).
    request: Request | None = None
    # A string, or a chat completion / agent output object (the answer is taken from it).
    response: Annotated[Any, _checked(str, dict, list, what="a string or an object")] = None
    retrieved_context: list[ContextDocument] | None = None
    expected_response: str | None = None
    expected_retrieved_context: list[ContextDocument] | None = None
    expected_facts: list[str] | None = None
    # A list, or named groups {"tone": ["…"]}.
    guidelines: Guidelines | None = None
    reference_trajectory: list[ToolStep] | None = None
    # MLflow's expectation for the tool-call judges (also read from `expectations`); it fills
    # `EvalRecord.reference_trajectory` and wins over `reference_trajectory`.
    expected_tool_calls: list[ExpectedToolCall] | None = None
    # An MLflow trace, as a JSON string or an object (validated by the trace parser).
    trace: Annotated[Any, _checked(str, dict, what="a JSON string or an object")] = None
    inputs: Any = None
    outputs: Any = None
    expectations: dict[str, Any] | None = None
    tags: dict[str, Any] | None = None
    # The conversation the request belongs to and who made it (schema 3).
    session_id: Identity = None
    user_id: Identity = None
    # The app's release the row came from (schema 6; `release_version`).
    version: Identity = None


# ------------------------------------------------------------------------------------------
# Inference-log row


class RequestMetadata(_Model):
    endpoint_name: str | None = None
    model_name: str | None = None
    model_version: Any = None


class InferenceLogRow(_Model):
    """A model-serving payload-logging row.

    AI-Gateway tables: `databricks_request_id, client_request_id, request_time, status_code,
    execution_duration_ms, served_entity_id, request, response, …`. Legacy tables have
    `timestamp_ms`, `execution_time_ms` and a `request_metadata` map instead. `request` and
    `response` are the raw JSON bodies (strings); an already-decoded object is accepted too.
    """

    databricks_request_id: str | None = None
    client_request_id: str | None = None
    # A TIMESTAMP column exported as RFC 3339 text, or epoch milliseconds.
    request_time: Time = None
    timestamp_ms: OptionalInt = None
    status_code: OptionalInt = None
    execution_duration_ms: Duration = None
    execution_time_ms: Duration = None
    served_entity_id: str | None = None
    request_metadata: RequestMetadata | None = None
    request: Annotated[Any, _checked(str, dict, list, what="a JSON string or an object")] = None
    response: Annotated[Any, _checked(str, dict, list, what="a JSON string or an object")] = None
    logging_error_codes: list[str] | None = None
    # The conversation the request belongs to and who made it, when the table logs them.
    session_id: Identity = None
    user_id: Identity = None
    # The app's release the row came from (schema 6; `release_version`).
    version: Identity = None


# ------------------------------------------------------------------------------------------
# Turning a validation error into a field path and a one-line detail

_MESSAGES = {
    "missing": "required field is missing",
    "string_type": "expected a string",
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "dict_type": "expected an object",
    "model_type": "expected an object",
    "model_attributes_type": "expected an object",
    "list_type": "expected a list",
    "too_short": "must not be empty",
}


def field_path(loc: tuple[int | str, ...], prefix: str = "") -> str:
    """`("data", "spans", 2, "name")` -> `data.spans[2].name` (union labels left out)."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif " " in part or "[" in part:  # a union member label, not a field
            continue
        else:
            path = f"{path}.{part}" if path else part
    return path


def describe(exc: ValidationError, prefix: str = "") -> tuple[str, str]:
    """(field path, detail) of the first error, e.g. `("data.spans[2].start_time_unix_nano",
    'expected an integer, got "abc"')`."""
    error = exc.errors(include_url=False)[0]
    kind = error["type"]
    message = _MESSAGES.get(kind)
    if message is None:
        message = error["msg"].removeprefix("Value error, ")
    if kind != "missing" and "got " not in message:
        message = f"{message}, got {brief(error.get('input'))}"
    return field_path(tuple(error["loc"]), prefix), message
