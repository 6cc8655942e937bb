"""Model-serving inference-log rows -> EvalRecord, with and without the agent's MLflow trace.

Rows are shaped like the AI-Gateway payload table (and the legacy table) writes them: the request
and response columns are the raw JSON bodies as strings. The embedded traces are made by the real
`mlflow` package and put where Databricks serving puts them, `response.databricks_output.trace`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from mlflow.entities import Trace as MlflowTrace
from support import mlflow_apps

from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.trace import TokenUsage

CHAT_REQUEST = {"messages": [{"role": "system", "content": "You answer billing questions."},
                             {"role": "user", "content": "How do I get a refund?"}],
                "max_tokens": 200}
CHAT_RESPONSE = {"id": "chatcmpl-9", "object": "chat.completion", "model": "gpt-4o-mini",
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": "Open Billing, then Refunds."}}],
                 "usage": {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38}}


def gateway_row(**overrides: Any) -> dict[str, Any]:
    row = {"databricks_request_id": "dbx-req-1", "client_request_id": None, "request_date": "2026-11-22",
           "request_time": "2026-11-22T10:15:30.250Z", "status_code": 200, "sampling_fraction": 1.0,
           "execution_duration_ms": 840, "request": json.dumps(CHAT_REQUEST),
           "response": json.dumps(CHAT_RESPONSE), "logging_error_codes": [],
           "served_entity_id": "billing-bot-v3", "requester": "svc-frontend"}
    row.update(overrides)
    return row


def test_gateway_row() -> None:
    record = normalise(json.dumps(gateway_row()))
    assert record.source_format == "inference_log"
    assert record.request_id == "dbx-req-1"
    assert record.request == "How do I get a refund?"
    assert record.response == "Open Billing, then Refunds."
    assert record.latency_seconds == 0.84
    assert record.failed is False and record.error is None
    assert record.tokens == TokenUsage(31, 7, 38)
    assert record.app == "billing-bot-v3"
    assert record.timestamp == 1795342530.25
    assert record.trace_id is None and record.retrieved_context is None and record.trajectory is None


def test_legacy_row() -> None:
    row = {"databricks_request_id": "r-7", "client_request_id": "c-7", "date": "2026-11-22",
           "timestamp_ms": 1795342530250, "status_code": 200, "sampling_fraction": 1.0,
           "execution_time_ms": 95, "request": json.dumps(CHAT_REQUEST),
           "response": json.dumps(CHAT_RESPONSE),
           "request_metadata": {"endpoint_name": "billing-endpoint", "model_name": "billing",
                                "model_version": "3"}}
    record = normalise(row)
    assert record.app == "billing-endpoint"
    assert record.latency_seconds == 0.095
    assert record.timestamp == 1795342530.25
    assert record.request_id == "r-7"


def test_failed_request() -> None:
    row = gateway_row(status_code=429, response=json.dumps({"error_code": "REQUEST_LIMIT_EXCEEDED",
                                                           "message": "Exceeded workspace rate limit"}))
    record = normalise(row)
    assert record.failed is True
    assert record.error == "HTTP 429: Exceeded workspace rate limit"
    assert record.response is None
    assert record.tokens is None


def test_responses_api_bodies() -> None:
    request = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Where is my order?"}]}]}
    response = {"object": "response", "output": [
        {"type": "function_call", "name": "lookup_order", "arguments": "{}"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "It shipped."}]}],
        "usage": {"input_tokens": 12, "output_tokens": 3, "total_tokens": 15}}
    record = normalise(gateway_row(request=json.dumps(request), response=json.dumps(response)))
    assert record.request == "Where is my order?"
    assert record.response == "It shipped."
    assert record.tokens == TokenUsage(12, 3, 15)


def test_body_that_is_not_json_is_taken_as_text() -> None:
    record = normalise(gateway_row(request="plain text question", response="plain answer"))
    assert record.request == "plain text question" and record.response == "plain answer"


def _with_trace(trace_json: str, response: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    body = dict(response if response is not None else CHAT_RESPONSE)
    body["databricks_output"] = {"databricks_request_id": "dbx-req-1", "trace": json.loads(trace_json)}
    return gateway_row(response=json.dumps(body), **overrides)


def test_row_with_the_agents_trace() -> None:
    trace_json = mlflow_apps.run("rag")
    theirs = MlflowTrace.from_json(trace_json)
    record = normalise(_with_trace(trace_json))
    # From the row: what the endpoint was asked and answered, its timing and usage.
    assert record.request == "How do I get a refund?"
    assert record.response == "Open Billing, then Refunds."
    assert record.latency_seconds == 0.84
    assert record.tokens == TokenUsage(31, 7, 38)
    assert record.app == "billing-bot-v3"
    # From the trace: what only the trace knows.
    assert record.trace_id == theirs.info.trace_id.removeprefix("tr-")
    assert [d.content for d in record.retrieved_context] == [t for t, _ in mlflow_apps.CORPUS["mlflow"]]
    assert record.trajectory == []
    assert record.source_format == "inference_log"


def test_trace_fills_what_the_row_does_not_state() -> None:
    trace_json = mlflow_apps.run("tools")
    theirs = MlflowTrace.from_json(trace_json)
    response = {k: v for k, v in CHAT_RESPONSE.items() if k != "usage"}
    record = normalise(_with_trace(trace_json, response=response, execution_duration_ms=None))
    usage = theirs.info.token_usage
    assert record.tokens == TokenUsage(usage["input_tokens"], usage["output_tokens"], usage["total_tokens"])
    assert record.latency_seconds == theirs.info.execution_duration / 1000
    assert [c.tool_name for c in record.trajectory] == ["get_weather", "lookup_order", "get_weather",
                                                        "flaky_tool"]


def test_a_failure_in_the_trace_fails_the_record_even_with_http_200() -> None:
    record = normalise(_with_trace(mlflow_apps.run("failing")))
    assert record.failed is True
    assert record.error == "RuntimeError: model endpoint returned 503"


def test_endpoint_name_from_trace_metadata_and_app_tag() -> None:
    raw = json.loads(mlflow_apps.run("tagged"))
    raw["info"]["trace_metadata"]["mlflow.databricks.modelServingEndpointName"] = "agents-billing"
    row = _with_trace(json.dumps(raw), served_entity_id="a1b2c3")
    assert normalise(row).app == "agents-billing"
    assert normalise(row, app_tag="service").app == "checkout"  # a trace tag
    assert normalise(row, app_tag="requester").app == "svc-frontend"  # a column of the row


@pytest.mark.parametrize(("overrides", "field", "detail"), [
    ({"status_code": "abc"}, "status_code", 'expected an integer, got a string of 3 characters'),
    ({"request": 5}, "request", "expected a JSON string or an object, got 5"),
    ({"request_time": "yesterday"}, "request_time",
     'expected an RFC 3339 time or epoch milliseconds, got a string of 9 characters'),
    ({"request_metadata": ["x"]}, "request_metadata", 'expected an object, got a list of 1 item'),
])
def test_bad_rows_name_the_field(overrides: dict[str, Any], field: str, detail: str) -> None:
    with pytest.raises(RecordError) as err:
        normalise(gateway_row(**overrides))
    assert (err.value.reason, err.value.field, err.value.detail) == ("invalid_record", field, detail)


def test_bad_embedded_trace_names_the_path_inside_the_response() -> None:
    raw = json.loads(mlflow_apps.run("rag"))
    raw["data"]["spans"][1]["start_time_unix_nano"] = "soon"
    with pytest.raises(RecordError) as err:
        normalise(_with_trace(json.dumps(raw)))
    assert err.value.field == "response.databricks_output.trace.data.spans[1].start_time_unix_nano"
    assert err.value.detail == 'expected an integer, got a string of 4 characters'
