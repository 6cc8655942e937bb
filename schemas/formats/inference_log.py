"""Model-serving inference-log rows -> `EvalRecord`.

A row states the HTTP exchange: the raw request and response bodies (chat-completion JSON), the
status code, the model execution time and the served entity. When the response carries the agent's
MLflow trace (`databricks_output.trace`, returned when the request asked for it or when the endpoint
logs traces), the trace is parsed and derived too, and the row's own fields win over the trace's
(`tracejudge.schemas.formats.derive.merge`), except that a failure either of them records is a failure.
A body that is text but not JSON is read as text; one that looks like JSON (starts with `{` or `[`)
and does not parse was cut short or corrupted, and rejects the row naming `request` or `response`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.derive import derive, merge, stated_latency
from tracejudge.schemas.formats.derive_text import request_text, response_text
from tracejudge.schemas.formats.derive_usage import has_negative_tokens
from tracejudge.schemas.formats.inputs import InferenceLogRow, ValidationError, describe, time_ms
from tracejudge.schemas.formats.mlflow import parse_trace, tagged_identity
from tracejudge.schemas.formats.mlflow_wire import parse_trace_json
from tracejudge.schemas.formats.session_identity import identity
from tracejudge.schemas.record import NEGATIVE_TOKENS, EvalRecord, add_warning, python_json
from tracejudge.schemas.trace import TokenUsage, Trace

__all__ = ["is_inference_log_row", "normalise_row"]

# Keys only serving logs have; an agent-eval record never carries them.
_ROW_KEYS = ("databricks_request_id", "served_entity_id", "request_metadata", "execution_duration_ms",
             "execution_time_ms", "status_code", "logging_error_codes", "sampling_fraction")
# Keys the serving layer adds to bodies, not part of the model's request or answer.
_SERVING_KEYS = ("databricks_output", "databricks_options")


def is_inference_log_row(obj: Mapping[str, Any]) -> bool:
    return any(key in obj for key in _ROW_KEYS)


def _body(value: Any, field: str) -> Any:
    """A logged body: JSON text is decoded; text that is not JSON is taken as it is, unless it looks
    like JSON (starts with `{` or `[`) and does not parse: a truncated or corrupted body is bad input,
    rejected as `invalid_json` naming `field`, not a question or answer to judge."""
    if not isinstance(value, str):
        return value
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        if not value.lstrip().startswith(("{", "[")):
            return value
        try:
            return python_json(value)  # the NaN and Infinity that Python producers write
        except (ValueError, RecursionError):
            pass
        raise RecordError(errors.INVALID_JSON, f"looks like JSON but does not parse: {exc.msg} at line "
                          f"{exc.lineno} column {exc.colno}", field) from None


def _without_serving_keys(body: Any) -> Any:
    if isinstance(body, dict) and any(k in body for k in _SERVING_KEYS):
        return {k: v for k, v in body.items() if k not in _SERVING_KEYS}
    return body


def _usage(body: Any) -> TokenUsage | None:
    """OpenAI `usage`: chat completions (`prompt_tokens`…) or the Responses API (`input_tokens`…)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None

    def pick(*keys: str) -> int | None:
        for key in keys:
            value = usage.get(key)
            if type(value) is int:
                return value
        return None

    tokens = TokenUsage(pick("prompt_tokens", "input_tokens"), pick("completion_tokens", "output_tokens"),
                        pick("total_tokens"), _cached_tokens(usage))
    if tokens.input is None and tokens.output is None and tokens.total is None:
        return None
    return tokens.with_total()


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    """OpenAI's cached prompt tokens: `prompt_tokens_details.cached_tokens` (chat completions) or
    `input_tokens_details.cached_tokens` (the Responses API)."""
    for key in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(key)
        if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
            return details["cached_tokens"]
    return None


def _error_message(body: Any) -> str | None:
    if isinstance(body, str):
        return body[:500] or None
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    message = error if isinstance(error, str) else body.get("message")
    return message[:500] if isinstance(message, str) else None


def normalise_row(obj: Mapping[str, Any], *, app_tag: str | None = None,
                  session_tag: str | None = None, version_tag: str | None = None) -> EvalRecord:
    """One inference-log row -> `EvalRecord`; raises `RecordError` naming the field that is wrong.

    Session and user: the row's `session_id`/`user_id` columns, else its trace's metadata.
    `session_tag` names a column of the row or a tag/metadata key of its trace whose value is the
    session id over those. Version likewise (`release_version`): the `version_tag` column or trace tag,
    the `version` column, a legacy table's `request_metadata.model_version`, the trace's version."""
    try:
        row = InferenceLogRow.model_validate(obj)
    except ValidationError as exc:
        path, detail = describe(exc)
        raise RecordError(errors.INVALID_RECORD, detail, path or None) from None

    request_body = _body(row.request, "request")
    response_body = _body(row.response, "response")
    status = row.status_code
    failed = None if status is None else status >= 400
    error = None
    if failed:
        message = _error_message(response_body)
        error = f"HTTP {status}: {message}" if message else f"HTTP {status}"

    duration_ms = row.execution_duration_ms
    if duration_ms is None:
        duration_ms = row.execution_time_ms
    # A negative or non-finite duration is no latency, and the record says why.
    latency, anomaly = stated_latency(duration_ms)
    when = row.request_time if row.request_time is not None else row.timestamp_ms
    endpoint = row.request_metadata.endpoint_name if row.request_metadata is not None else None

    trace_obj = None
    if isinstance(response_body, dict):
        output = response_body.get("databricks_output")
        if isinstance(output, dict):
            trace_obj = output.get("trace")
    trace = None
    if isinstance(trace_obj, str):
        trace = parse_trace_json(trace_obj, app_tag=app_tag, field="response.databricks_output.trace",
                                 session_tag=session_tag, version_tag=version_tag)
    elif trace_obj is not None:
        trace = parse_trace(trace_obj, app_tag=app_tag, field="response.databricks_output.trace",
                            everything=False, session_tag=session_tag, version_tag=version_tag)
    if trace is not None and endpoint is None:
        endpoint = trace.metadata.get("mlflow.databricks.modelServingEndpointName")

    app = None
    if app_tag:
        tagged = obj.get(app_tag)
        if isinstance(tagged, str) and tagged:
            app = tagged
        elif trace is not None:
            app = trace.tags.get(app_tag) or trace.metadata.get(app_tag)
    app = app or endpoint or row.served_entity_id

    answer = None if failed else response_text(_without_serving_keys(response_body))
    stated = EvalRecord(
        request_id=row.databricks_request_id or row.client_request_id,
        app=app,
        source_format="inference_log",
        request=request_text(_without_serving_keys(request_body)),
        response=answer,
        latency_seconds=latency,
        failed=failed,
        error=error,
        tokens=_usage(response_body),
        timestamp=None if when is None else time_ms(when) / 1000.0,
        session_id=identity(row.session_id),
        user_id=identity(row.user_id),
    )
    if anomaly is not None:
        add_warning(stated, anomaly)
    if stated.tokens is not None and has_negative_tokens(stated.tokens):
        stated.tokens = None
        add_warning(stated, NEGATIVE_TOKENS)
    if stated.tokens is not None:
        # The model that answered, as the response body names it, else the served entity: the
        # record's per-model usage (tracejudge.metrics.cost prices it).
        model = response_body.get("model") if isinstance(response_body, dict) else None
        if not isinstance(model, str) or not model:
            model = row.served_entity_id
        if model:
            stated.model_usage = {model: stated.tokens}
    tagged = identity(obj.get(session_tag)) if session_tag else None
    if tagged is None and session_tag and trace is not None:
        tagged = tagged_identity(trace, session_tag)
    if tagged is not None:
        stated.session_id = tagged
    stated.version = _stated_version(obj, row, trace, version_tag)
    if trace is None:
        return stated
    derived = derive(trace)
    record = merge(stated, derived)
    if derived.failed and not stated.failed:
        # The endpoint answered, but the agent's own trace recorded a failure.
        record.failed, record.error = True, derived.error
    return record


def _stated_version(obj: Mapping[str, Any], row: InferenceLogRow, trace: Trace | None,
                    version_tag: str | None) -> str | None:
    """The row's version over its trace's: the `version_tag` column (else that tag of its trace),
    the `version` column, a legacy table's `request_metadata.model_version` (the served model's)."""
    if version_tag:
        tagged = identity(obj.get(version_tag))
        if tagged is None and trace is not None:
            tagged = tagged_identity(trace, version_tag)
        if tagged is not None:
            return tagged
    stated = identity(row.version)
    if stated is None and row.request_metadata is not None:
        stated = identity(row.request_metadata.model_version)
    return stated
