"""The result line's shape: the record's fields at the top level, then source, metrics, assessments."""

from __future__ import annotations

import json

import orjson

from tracejudge.schemas.record import Document, EvalRecord, TokenUsage, ToolCall
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef


def test_to_json_is_the_documented_flat_shape():
    result = EvaluationResult(
        record=EvalRecord(request_id="r", trace_id="t", request="q", response="a", tokens=TokenUsage(1, 2, 3),
                          retrieved_context=[Document("c", "u")], trajectory=[ToolCall("s", {"x": [1]})],
                          tags={"env": "prod"}),
        source=SourceRef(format="mlflow_v3", topic="traces", partition=2, offset=41),
        metrics={"latency_seconds": None, "retrieved_documents": 1.0},
        metric_errors={"mine": "ValueError: no"},
        assessments=[Assessment("groundedness", value="yes", score=1.0, passed=True, source="heuristic")],
    )
    out = orjson.loads(result.to_json())
    assert out == result.to_dict()
    record_fields = list(EvalRecord.__struct_fields__)
    assert list(out) == [*record_fields, "source", "metrics", "metric_errors", "assessments"]
    assert out["source"]["offset"] == 41 and out["tokens"] == {"input": 1, "output": 2, "total": 3}
    assert out["assessments"][0]["skipped"] is None
    assert result.key == "t"
    assert result.assessment("groundedness").passed and result.passed


def test_to_json_writes_what_a_payload_or_custom_metric_can_hold():
    # Payloads are decoded JSON (integers of any size) and custom code may put other objects in a
    # record: the result line is still written, odd objects as their str().
    class Ticket:
        def __str__(self) -> str:
            return "ticket-7"

    record = EvalRecord(request_id="r", trajectory=[ToolCall("s", {"n": 2**70, "ref": Ticket()})])
    result = EvaluationResult(record=record, source=SourceRef(format="agent_eval"))
    out = json.loads(result.to_json())
    assert out["trajectory"] == [{"tool_name": "s", "tool_input": {"n": 2**70, "ref": "ticket-7"}}]
