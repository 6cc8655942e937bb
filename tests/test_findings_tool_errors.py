"""Tool errors on the trajectory (`ToolCall.error`, result schema 6) and the `tool_error` dimension of
the findings: a tool span that fails, made by the OpenTelemetry SDK (OTLP protobuf and JSON) and by
MLflow tracing (the demo agent's spans, read by both MLflow readers), and an agent-eval row that states
it, all give the failed call its error text and leave the others' None; the result line keeps it and an
older line without it reads None; the findings name the failing tool."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from support.otel_producers import Producer, genai_trace, kafka_messages

from tracejudge.consumer.demo.agent import FAILING_TOOL, FAILING_TOOL_ERROR, AgentSettings, SyntheticRagAgent
from tracejudge.consumer.stages.assembly import TraceAssembler
from tracejudge.metrics.findings import FindingsOptions, FindingsWindow, dimension_values
from tracejudge.schemas.formats import otlp
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.record import TOOL_ERROR_MAX_CHARS, EvalRecord, ToolCall
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef


def otlp_records(messages: list[bytes]) -> dict[str, EvalRecord]:
    assembler = TraceAssembler()
    for payload in messages:
        fmt, groups = otlp.decode(payload)
        assert not assembler.add(groups, source_format=fmt)
    return {a.trace.trace_id: derive(a.trace) for a in assembler.flush()}


@pytest.mark.parametrize("fmt", ["otlp_proto", "otlp_json"])
def test_an_otel_sdk_tool_span_in_error_gives_its_call_the_status_message(fmt: str) -> None:
    producer = Producer("geo-agent")
    ok = genai_trace(producer.tracer, "Capital of France?", "Paris.")
    bad = genai_trace(producer.tracer, "Population of Paris?", "Unknown.", tool_fails=True)
    got = otlp_records([v for _, v in kafka_messages(producer.finished(), per_message=3, fmt=fmt)])
    assert got[ok.trace_id].trajectory == [ToolCall("population", {"city": "Paris"}, None)]
    assert got[bad.trace_id].trajectory == [ToolCall("population", {"city": "Paris"},
                                                     "population service timed out")]
    # A tool the agent recovered from is not the request's failure.
    assert got[bad.trace_id].failed is False


def test_an_exception_raised_in_an_otel_sdk_tool_span_is_its_error() -> None:
    producer = Producer("geo-agent")
    tracer = producer.tracer
    agent = {"gen_ai.operation.name": "invoke_agent"}
    with tracer.start_as_current_span("invoke_agent geo", attributes=agent):
        for city in ("Paris", "Oslo"):
            try:
                with tracer.start_as_current_span("execute_tool weather", attributes={
                        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "weather",
                        "gen_ai.tool.call.arguments": json.dumps({"city": city})}):
                    if city == "Oslo":
                        raise ConnectionError("weather API refused the connection " + "x" * 400)
            except ConnectionError:
                pass
    (record,) = otlp_records([v for _, v in kafka_messages(producer.finished(), per_message=5)]).values()
    first, second = record.trajectory or []
    assert (first.tool_name, first.error) == ("weather", None)
    assert second.tool_name == "weather" and second.error is not None
    assert "ConnectionError" in second.error and "refused the connection" in second.error
    assert len(second.error) == TOOL_ERROR_MAX_CHARS  # a long message is cut


def _without_usage(payload: bytes) -> bytes:
    """The MLflow trace with no span stating token usage: read by the general reader, not the lean one."""
    trace = orjson.loads(payload)
    for span in trace["data"]["spans"]:
        span["attributes"].pop("mlflow.chat.tokenUsage", None)
    trace["info"].get("trace_metadata", {}).pop("mlflow.trace.tokenUsage", None)
    return orjson.dumps(trace)


def test_mlflow_tracing_a_failing_tool_span_gives_its_call_the_exception() -> None:
    with SyntheticRagAgent(AgentSettings(seed=5, failing_tool_after=0)) as agent:
        items = list(agent.traces(60))
    failed = ok = 0
    for item in items:
        lean, general = normalise(item.payload), normalise(_without_usage(item.payload))
        assert lean.trajectory == general.trajectory  # both MLflow readers read the error alike
        for call in lean.trajectory or []:
            if call.tool_name == FAILING_TOOL and not item.failed:
                assert call.error == f"ToolUnavailable: {FAILING_TOOL}: {FAILING_TOOL_ERROR}"
                failed += 1
            elif not item.failed:
                assert call.error is None, call
                ok += 1
    assert failed >= 3 and ok >= 3, (failed, ok)


def test_an_agent_eval_row_states_a_tool_error() -> None:
    row = {"request": "Where is my order?", "response": "Shipped.",
           "trajectory": [{"tool_name": "orders", "tool_input": {"id": 1}, "error": "HTTP 503"},
                          {"tool_name": "track", "failed": True}, {"tool_name": "email"}]}
    record = normalise(orjson.dumps(row), "agent_eval")
    assert record.trajectory == [ToolCall("orders", {"id": 1}, "HTTP 503"), ToolCall("track", None, "failed"),
                                 ToolCall("email")]


def _result(record: EvalRecord, passed: bool) -> EvaluationResult:
    return EvaluationResult(record, SourceRef("agent_eval"), metrics={},
                            assessments=[Assessment("groundedness", passed=passed)])


def test_the_result_line_keeps_the_error_and_an_older_line_reads_none() -> None:
    record = EvalRecord(trace_id="t1", trajectory=[ToolCall("orders", {"id": 1}, "HTTP 503"), ToolCall("x")])
    line: dict[str, Any] = orjson.loads(_result(record, False).to_json())
    assert line["trajectory"] == [{"tool_name": "orders", "tool_input": {"id": 1}, "error": "HTTP 503"},
                                  {"tool_name": "x", "tool_input": None, "error": None}]
    assert EvaluationResult.from_dict(line).record.trajectory == record.trajectory
    line["schema_version"] = 5
    for call in line["trajectory"]:
        del call["error"]
    older = EvaluationResult.from_dict(line).record.trajectory or []
    assert [c.error for c in older] == [None, None]


def test_findings_name_the_failing_tool_as_a_tool_error() -> None:
    window = FindingsWindow(FindingsOptions())
    for i in range(400):
        broken = i % 4 == 0  # a quarter of the traces call `orders` when it is down
        calls = [ToolCall("orders", {"id": i}, "HTTP 503" if broken else None), ToolCall("email")]
        record = EvalRecord(trace_id=f"t{i}", app="shop", trajectory=calls)
        result = _result(record, passed=not broken if i % 10 else False)
        if i == 0:
            assert dimension_values(result, {"tool", "tool_error"}) == {"tool": ("orders", "email"),
                                                                       "tool_error": ("orders",)}
        window.add(result)
    findings = window.analyse()
    assert [(f.dimension, f.value) for f in findings] == [("tool_error", "orders")]
    (f,) = findings
    assert f.failing == f.total == 100 and 1.0 < f.lift_interval[0] < f.lift
