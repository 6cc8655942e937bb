"""Attribute conventions -> evaluation record, with spans from the real producers: the OpenTelemetry
SDK under the GenAI / OpenInference / Traceloop conventions, and MLflow's own OTLP export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf.json_format import Parse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support.otel_producers import (
    Producer,
    Recorded,
    encode,
    genai_trace,
    interleave,
    kafka_messages,
    mlflow_otlp_batches,
    openinference_trace,
    to_otlp_json,
    traceloop_trace,
    unknown_convention_trace,
)

from tracejudge.consumer.stages.assembly import TraceAssembler
from tracejudge.schemas.formats import otlp
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.record import EvalRecord, ToolCall
from tracejudge.schemas.trace import SpanKind

# What MLflow 3.17's OTLP exporter really sent, captured by a loopback OTLP server.
EXAMPLES = Path(__file__).parent / "fixtures" / "examples"


def records(messages: list[bytes]) -> dict[str, EvalRecord]:
    """Decode records, assemble them, derive one EvalRecord per trace."""
    assembler = TraceAssembler()
    for payload in messages:
        fmt, groups = otlp.decode(payload)
        assert not assembler.add(groups, source_format=fmt)
    out = {}
    for assembled in assembler.flush():
        assert assembled.reason == "complete"
        out[assembled.trace.trace_id] = derive(assembled.trace)
    return out


def check(record: EvalRecord, rec: Recorded, app: str) -> None:
    assert record.app == app
    assert record.request == rec.question
    assert record.response == rec.answer
    assert [ToolCall(c.tool_name, c.tool_input) for c in record.trajectory or []] == [
        ToolCall(rec.tool, rec.tool_args)]
    assert record.tokens is not None
    assert (record.tokens.input, record.tokens.output) == (rec.input_tokens, rec.output_tokens)
    assert record.tokens.total == rec.input_tokens + rec.output_tokens
    assert [(d.content, d.doc_uri) for d in record.retrieved_context or []] == rec.documents
    assert record.failed is rec.failed
    assert record.latency_seconds is not None and record.latency_seconds > 0
    assert record.complete is True


@pytest.mark.parametrize("fmt", ["otlp_proto", "otlp_json"])
@pytest.mark.parametrize("structured", [False, True])
def test_genai_convention(fmt, structured):
    producer = Producer("geo-agent")
    ok = genai_trace(producer.tracer, "What is the capital of France?", "Paris.", structured=structured)
    bad = genai_trace(producer.tracer, "And its population?", "Unknown.", structured=structured,
                      tool_fails=True, fail_root=True)
    messages = [v for _, v in kafka_messages(producer.finished(), per_message=3, fmt=fmt)]
    got = records(messages)
    check(got[ok.trace_id], ok, "geo-agent")
    check(got[bad.trace_id], bad, "geo-agent")
    assert got[bad.trace_id].error == "upstream rate limit"
    # The failed tool call carries its span's error status (schema 6); the good one none.
    assert [c.error for c in got[bad.trace_id].trajectory or []] == ["population service timed out"]
    assert [c.error for c in got[ok.trace_id].trajectory or []] == [None]
    assert got[ok.trace_id].source_format == fmt


def test_openinference_convention():
    producer = Producer("docs-agent")
    rec = openinference_trace(producer.tracer, "What is MLflow?", "An MLOps platform.")
    spans = producer.finished()
    got = records([v for _, v in kafka_messages(spans, per_message=2)])
    check(got[rec.trace_id], rec, "docs-agent")
    # The LLM span's flattened messages become a chat payload; input.value is not preferred over them.
    request = encode(spans)
    llm = next(s for g in otlp.decode_proto(request.SerializeToString()) for s in g.spans
               if s.name == "ChatOpenAI")
    assert llm.kind is SpanKind.LLM
    assert llm.inputs == {"messages": [{"role": "system", "content": "Use the context."},
                                       {"role": "user", "content": "What is MLflow?"}]}
    assert llm.outputs == {"choices": [{"index": 0, "message": {"role": "assistant",
                                                                "content": "An MLOps platform."}}]}
    # Payload attributes live in inputs/outputs only: one copy per open trace.
    assert not any(k.startswith("llm.input_messages") for k in llm.attributes)


def test_traceloop_convention():
    producer = Producer("weather-bot")
    rec = traceloop_trace(producer.tracer, "Weather in Oslo?", "Rain.")
    got = records([v for _, v in kafka_messages(producer.finished(), per_message=1, fmt="otlp_json")])
    check(got[rec.trace_id], rec, "weather-bot")


def test_unknown_convention_keeps_timing_and_failure_only():
    producer = Producer("health")
    ok_id = unknown_convention_trace(producer.tracer, fail=False)
    bad_id = unknown_convention_trace(producer.tracer, fail=True)
    got = records([encode(producer.finished()).SerializeToString()])
    for trace_id in (ok_id, bad_id):
        record = got[trace_id]
        assert record.request is None and record.response is None and record.tokens is None
        assert record.trajectory == [] and record.retrieved_context is None
        assert record.latency_seconds is not None and record.app == "health"
    assert got[ok_id].failed is False
    assert got[bad_id].failed is True and got[bad_id].error == "ConnectionError: db unreachable"


def test_model_calls_count_once_for_tokens():
    """A span stating usage in two dialects counts once; a wrapper rolling up its inner call too."""
    producer = Producer("svc")
    with producer.tracer.start_as_current_span("agent", attributes={
            "openinference.span.kind": "AGENT", "input.value": "q"}) as root:
        with producer.tracer.start_as_current_span("chat", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 10,
                "gen_ai.usage.output_tokens": 2, "llm.token_count.prompt": 10,
                "llm.token_count.completion": 2, "llm.usage.total_tokens": 12}):
            pass
        with (producer.tracer.start_as_current_span("ChatModel", attributes={
                "openinference.span.kind": "LLM", "llm.token_count.prompt": 5,
                "llm.token_count.completion": 1}),
              producer.tracer.start_as_current_span("openai.chat", attributes={
                "llm.request.type": "chat", "gen_ai.usage.prompt_tokens": 5,
                "gen_ai.usage.completion_tokens": 1})):
            pass
    trace_id = format(root.get_span_context().trace_id, "032x")
    record = records([encode(producer.finished()).SerializeToString()])[trace_id]
    assert record.tokens is not None
    assert (record.tokens.input, record.tokens.output, record.tokens.total) == (15, 3, 18)


def test_mlflow_otlp_export_capture():
    """The capture of what MLflow's exporter POSTs (protobuf, shown as protobuf JSON)."""
    body = json.loads((EXAMPLES / "mlflow_otlp_export_capture.json").read_text())["body"]
    request = Parse(json.dumps(body), ExportTraceServiceRequest())
    for payload in (request.SerializeToString(), to_otlp_json(request)):
        (record,) = records([payload]).values()
        assert record.trace_id == "082591cd722925b844de01aa8327dec4"
        assert record.request == "hello" and record.response == "hi"
        assert [(d.content, d.doc_uri) for d in record.retrieved_context or []] == [("doc text", "u1")]
        assert record.tokens is not None and record.tokens.total == 6
        assert record.failed is False and record.app is None


def test_mlflow_own_otlp_export():
    """MLflow tracing with its own OTLP span processor; its batches interleaved with SDK traffic."""
    batches = mlflow_otlp_batches(4, service="mlflow-shop", batch_size=2)
    assert len(batches) >= 8  # 4 spans a trace, 2 spans an export batch
    producer = Producer("geo-agent")
    rec = genai_trace(producer.tracer, "Capital of France?", "Paris.")
    others = [v for _, v in kafka_messages(producer.finished(), per_message=1)]
    got = records(interleave(batches, others))
    check(got[rec.trace_id], rec, "geo-agent")
    mlflow_records = [r for r in got.values() if r.app == "mlflow-shop"]
    assert len(mlflow_records) == 4
    for record in mlflow_records:
        n = record.request.split()[1] if record.request else None
        assert record.request in (f"question {n}", f"question {n} fail")
        assert record.response == f"answer {record.request}"
        assert record.retrieved_context and record.retrieved_context[0].doc_uri == f"kb://{record.request}"
        assert record.trajectory and record.trajectory[0].tool_name == "lookup"
        failing = record.request.endswith("fail")
        assert record.trajectory[0].tool_input == {"city": "Atlantis" if failing else "Paris"}
        assert record.tokens is not None and record.tokens.total == 14
        # The tool error was caught inside the agent: the request did not fail.
        assert record.failed is False


# --- the app span, its fallbacks and failure below the root ------------------------------------------
# Real instrumentor output for each rule is in test_instrumented_apps.py; these pin each rule alone.


def _served(producer: Producer, *, status: int, agent_error: bool = False, tool_error: bool = False) -> str:
    """An HTTP SERVER root (FastAPI's instrumentation) over a GenAI agent with a tool and a chat call."""
    from opentelemetry.trace import SpanKind as OtelKind
    from opentelemetry.trace import Status, StatusCode

    tracer = producer.tracer
    user = json.dumps([{"role": "user", "parts": [{"type": "text", "content": "Is it raining?"}]}])
    reply = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": " No. "}]}])
    with tracer.start_as_current_span("POST /ask", kind=OtelKind.SERVER, attributes={
            "http.request.method": "POST", "http.route": "/ask"}) as root:
        with tracer.start_as_current_span("invoke_agent weather", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather"}) as agent:
            with tracer.start_as_current_span("execute_tool rain", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "rain"}) as tool:
                if tool_error:
                    tool.set_status(Status(StatusCode.ERROR, "sensor offline"))
            with tracer.start_as_current_span("chat gpt", attributes={
                    "gen_ai.operation.name": "chat", "gen_ai.input.messages": user,
                    "gen_ai.output.messages": reply, "gen_ai.usage.input_tokens": 9,
                    "gen_ai.usage.output_tokens": 2}):
                pass
            if agent_error:
                agent.set_status(Status(StatusCode.ERROR, "model call failed"))
        root.set_attribute("http.response.status_code", status)
    return format(root.get_span_context().trace_id, "032x")


def test_request_and_response_come_from_the_app_span_and_its_model_calls_below_an_http_root():
    producer = Producer("web")
    trace_id = _served(producer, status=200)
    record = records([encode(producer.finished()).SerializeToString()])[trace_id]
    # The agent span holds no messages: the first model call's user message, the last one's answer
    # (white space around it stripped); the app is still the root's service.
    assert (record.request, record.response, record.app) == ("Is it raining?", "No.", "web")
    assert record.trajectory == [ToolCall("rain", None)] and record.failed is False


@pytest.mark.parametrize(("status", "agent_error", "tool_error", "failed"), [
    (200, False, True, False),   # a tool error the agent recovered from
    (404, False, False, False),  # the client's error, not the agent's
    (503, False, False, True),   # the server answered with an error
    (200, True, False, True),    # the handler caught the agent's error and answered 200
])
def test_failure_is_the_root_the_app_span_or_a_top_level_agent_not_a_recovered_tool(
        status, agent_error, tool_error, failed):
    producer = Producer("web")
    trace_id = _served(producer, status=status, agent_error=agent_error, tool_error=tool_error)
    record = records([encode(producer.finished()).SerializeToString()])[trace_id]
    assert record.failed is failed
    # A failed request's answer is not made up from a model call that ran before the failure.
    assert record.response == (None if failed else "No.")
