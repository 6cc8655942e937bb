"""Real OTLP producers for the tests: spans made by the OpenTelemetry SDK (and by MLflow's own OTLP
export), encoded by the SDK's OTLP encoder, batched into Kafka messages the way the Collector's Kafka
exporter batches them.

- `Producer(service)`: an SDK `TracerProvider` with an in-memory exporter; the `*_trace` functions
  record one agent request each under a given attribute convention.
- `encode(spans)` is `opentelemetry.exporter.otlp.proto.common.trace_encoder.encode_spans`;
  `to_otlp_json(request)` writes the OTLP/JSON the Collector's `otlp_json` encoding writes (hex ids,
  integer enums, 64-bit integers as strings).
- `kafka_messages(...)` cuts spans (in the order they ended, traces interleaved) into export batches,
  optionally split per trace id (`partition_traces_by_id`).
- `mlflow_otlp_batches(n)` runs MLflow tracing in a subprocess with MLflow's OTLP span processor and
  returns the batches it exported.

Run as a script (`python otel_producers.py mlflow N`) it is that subprocess.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

# --- producing spans --------------------------------------------------------------------------------


class Producer:
    """One instrumented service: its spans, in the order they ended, land in `finished()`."""

    def __init__(self, service: str | None) -> None:
        attrs = {"service.name": service} if service else {}
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=Resource.create(attrs))
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer: Tracer = self.provider.get_tracer("tracejudge.tests", "1.0")

    def finished(self) -> list[ReadableSpan]:
        spans = list(self.exporter.get_finished_spans())
        self.exporter.clear()
        return spans


@dataclass
class Recorded:
    """What a `*_trace` function recorded, to assert the derived record against."""

    trace_id: str
    question: str
    answer: str
    tool: str
    tool_args: dict
    documents: list[tuple[str, str | None]]  # (content, doc_uri)
    input_tokens: int
    output_tokens: int
    failed: bool


def _hex(span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def genai_trace(tracer: Tracer, question: str, answer: str, *, structured: bool = False,
                tool_fails: bool = False, fail_root: bool = False) -> Recorded:
    """OpenTelemetry GenAI conventions (>= v1.37): invoke_agent -> retrieval, execute_tool, chat.

    `structured` records the message attributes as structured values instead of JSON strings.
    """
    def messages(value: list) -> object:
        return value if structured else json.dumps(value)

    docs = [("Paris is the capital of France.", "kb://geo/1"), ("Paris has 2.1M inhabitants.", "kb://geo/2")]
    user = [{"role": "user", "parts": [{"type": "text", "content": question}]}]
    reply = [{"role": "assistant", "parts": [{"type": "text", "content": answer}], "finish_reason": "stop"}]
    with tracer.start_as_current_span("invoke_agent geo", kind=SpanKind.INTERNAL, attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "geo",
            "gen_ai.input.messages": messages(user), "gen_ai.output.messages": messages(reply),
            "session.id": "sess-1"}) as root:
        with tracer.start_as_current_span("retrieval kb", kind=SpanKind.CLIENT, attributes={
                "gen_ai.operation.name": "retrieval", "gen_ai.data_source.id": "kb",
                "gen_ai.retrieval.query.text": question,
                "gen_ai.retrieval.documents": messages(
                    [{"id": f"chunk-{i}", "score": 0.9, "content": text, "metadata": {"url": uri}}
                     for i, (text, uri) in enumerate(docs)])}):
            pass
        with tracer.start_as_current_span("execute_tool population", attributes={
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "population",
                "gen_ai.tool.call.arguments": json.dumps({"city": "Paris"})}) as tool:
            if tool_fails:
                tool.set_attribute("error.type", "TimeoutError")
                tool.set_status(Status(StatusCode.ERROR, "population service timed out"))
            else:
                tool.set_attribute("gen_ai.tool.call.result", json.dumps({"population": 2100000}))
        with tracer.start_as_current_span("chat gpt-4o", kind=SpanKind.CLIENT, attributes={
                "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
                "gen_ai.request.model": "gpt-4o", "gen_ai.usage.input_tokens": 31,
                "gen_ai.usage.output_tokens": 9,
                "gen_ai.system_instructions": messages([{"type": "text", "content": "Answer briefly."}]),
                "gen_ai.input.messages": messages(user), "gen_ai.output.messages": messages(reply)}):
            pass
        if fail_root:
            root.set_attribute("error.type", "RateLimitError")
            root.set_status(Status(StatusCode.ERROR, "upstream rate limit"))
    return Recorded(_hex(root), question, answer, "population", {"city": "Paris"}, docs, 31, 9, fail_root)


def openinference_trace(tracer: Tracer, question: str, answer: str) -> Recorded:
    """OpenInference: AGENT -> RETRIEVER (flattened documents), TOOL, LLM (flattened messages)."""
    docs = [("MLflow is an MLOps platform.", "https://mlflow.org/docs"), ("Tracing records spans.", None)]
    with tracer.start_as_current_span("agent", attributes={
            "openinference.span.kind": "AGENT", "input.value": question, "input.mime_type": "text/plain",
            "output.value": answer, "output.mime_type": "text/plain", "session.id": "s-9",
            "user.id": "u-1"}) as root:
        retriever_attrs = {"openinference.span.kind": "RETRIEVER", "input.value": question}
        # The second document has no metadata: its id names a chunk, not a URI, so doc_uri is None.
        retriever_attrs.update({
            "retrieval.documents.0.document.id": "d-1",
            "retrieval.documents.0.document.content": docs[0][0],
            "retrieval.documents.0.document.score": 0.8,
            "retrieval.documents.0.document.metadata": json.dumps({"doc_uri": docs[0][1]}),
            "retrieval.documents.1.document.id": "doc-2",
            "retrieval.documents.1.document.content": docs[1][0],
        })
        with tracer.start_as_current_span("retrieve", attributes=retriever_attrs):
            pass
        with tracer.start_as_current_span("search_docs", attributes={
                "openinference.span.kind": "TOOL", "tool.name": "search_docs",
                "tool.parameters": json.dumps({"type": "object"}),
                "input.value": json.dumps({"q": "tracing"}), "input.mime_type": "application/json",
                "output.value": "found"}):
            pass
        with tracer.start_as_current_span("ChatOpenAI", attributes={
                "openinference.span.kind": "LLM", "llm.model_name": "gpt-4o-mini",
                "llm.input_messages.0.message.role": "system",
                "llm.input_messages.0.message.content": "Use the context.",
                "llm.input_messages.1.message.role": "user",
                "llm.input_messages.1.message.content": question,
                "llm.output_messages.0.message.role": "assistant",
                "llm.output_messages.0.message.content": answer,
                "llm.token_count.prompt": 40, "llm.token_count.completion": 12,
                "llm.token_count.total": 52,
                "input.value": json.dumps({"messages": [{"role": "user", "content": question}]}),
                "input.mime_type": "application/json"}):
            pass
    return Recorded(_hex(root), question, answer, "search_docs", {"q": "tracing"}, docs, 40, 12, False)


def traceloop_trace(tracer: Tracer, question: str, answer: str) -> Recorded:
    """Traceloop / OpenLLMetry: workflow -> tool (entity input), LLM (flattened gen_ai.prompt.N.*)."""
    with tracer.start_as_current_span("answer.workflow", attributes={
            "traceloop.span.kind": "workflow", "traceloop.entity.name": "answer",
            "traceloop.workflow.name": "answer",
            "traceloop.entity.input": json.dumps({"args": [], "kwargs": {"question": question}}),
            "traceloop.entity.output": json.dumps(answer)}) as root:
        with tracer.start_as_current_span("weather.tool", attributes={
                "traceloop.span.kind": "tool", "traceloop.entity.name": "weather",
                "traceloop.entity.input": json.dumps({"args": [], "kwargs": {"city": "Oslo"}}),
                "traceloop.entity.output": json.dumps("rain")}):
            pass
        with tracer.start_as_current_span("openai.chat", kind=SpanKind.CLIENT, attributes={
                "llm.request.type": "chat", "gen_ai.system": "openai", "gen_ai.request.model": "gpt-4o",
                "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": question,
                "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": answer,
                "gen_ai.completion.0.finish_reason": "stop",
                "gen_ai.usage.prompt_tokens": 22, "gen_ai.usage.completion_tokens": 5,
                "llm.usage.total_tokens": 27}):
            pass
    return Recorded(_hex(root), question, answer, "weather", {"city": "Oslo"}, [], 22, 5, False)


def unknown_convention_trace(tracer: Tracer, *, fail: bool) -> str:
    """A plain HTTP service: no GenAI convention on any span."""
    with tracer.start_as_current_span("GET /health", kind=SpanKind.SERVER, attributes={
            "http.request.method": "GET", "http.route": "/health", "gen_ai.usage.input_tokens_note": "x",
            "input.tokens": 5}) as root:
        with tracer.start_as_current_span("SELECT 1", kind=SpanKind.CLIENT,
                                          attributes={"db.system": "postgresql"}):
            pass
        if fail:
            try:
                raise ConnectionError("db unreachable")
            except ConnectionError as exc:
                root.record_exception(exc)
                root.set_status(Status(StatusCode.ERROR, "db unreachable"))
    return _hex(root)


# --- encoding ---------------------------------------------------------------------------------------


def encode(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    return encode_spans(spans)


_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def to_otlp_json(request: ExportTraceServiceRequest) -> bytes:
    """OTLP/JSON as the Collector's `otlp_json` encoding writes it: protobuf's JSON mapping with
    integer enums, then trace/span ids rewritten from base64 to hex (the one OTLP/JSON deviation)."""
    doc = MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in doc.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                _hex_ids(span)
                for link in span.get("links", []):
                    _hex_ids(link)
    return json.dumps(doc, separators=(",", ":")).encode()


def _hex_ids(obj: dict) -> None:
    for key in _ID_FIELDS:
        if obj.get(key):
            obj[key] = base64.b64decode(obj[key]).hex()


def interleave(*per_trace: Sequence[ReadableSpan]) -> list[ReadableSpan]:
    """Round-robin the spans of several traces: concurrent requests end their spans interleaved."""
    out: list[ReadableSpan] = []
    longest = max((len(s) for s in per_trace), default=0)
    for i in range(longest):
        out.extend(spans[i] for spans in per_trace if i < len(spans))
    return out


def kafka_messages(spans: Iterable[ReadableSpan], *, per_message: int, fmt: str = "otlp_proto",
                   by_trace_id: bool = False) -> list[tuple[bytes | None, bytes]]:
    """(key, value) records as the Collector's Kafka exporter writes an export batch of
    `per_message` spans; with `by_trace_id`, each batch is split per trace and keyed by its hex id."""
    spans = list(spans)
    out: list[tuple[bytes | None, bytes]] = []
    for i in range(0, len(spans), per_message):
        batch = spans[i:i + per_message]
        pieces: list[tuple[bytes | None, list[ReadableSpan]]] = [(None, batch)]
        if by_trace_id:
            by: dict[str, list[ReadableSpan]] = {}
            for s in batch:
                by.setdefault(format(s.context.trace_id, "032x"), []).append(s)
            pieces = [(k.encode(), v) for k, v in by.items()]
        for key, part in pieces:
            request = encode(part)
            value = to_otlp_json(request) if fmt == "otlp_json" else request.SerializeToString()
            out.append((key, value))
    return out


# --- MLflow's own OTLP export -----------------------------------------------------------------------


def mlflow_otlp_batches(traces: int, *, service: str | None = None, batch_size: int = 2,
                        timeout: float = 120.0) -> list[bytes]:
    """Serialized `ExportTraceServiceRequest`s exactly as MLflow's OTLP export sends them.

    A subprocess (MLflow's tracing state is process-global) enables MLflow's OTLP export through its
    real switch, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; MLflow then builds its own `OtelSpanProcessor`
    (a BatchSpanProcessor, batches of `batch_size`), and the exporter it is given encodes each batch
    with the SDK's OTLP encoder as the HTTP/gRPC exporters do, keeping the bytes instead of POSTing.
    """
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
           "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": str(batch_size), "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING": "false"}
    env.pop("OTEL_SERVICE_NAME", None)
    if service:
        env["OTEL_SERVICE_NAME"] = service
    proc = subprocess.run([sys.executable, __file__, "mlflow", str(traces)], env=env, capture_output=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"MLflow producer failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return [base64.b64decode(line) for line in proc.stdout.split() if line]


def _run_mlflow(traces: int) -> None:
    import mlflow
    import mlflow.tracing.provider as mlflow_provider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    batches: list[bytes] = []

    class KeepingExporter(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            batches.append(encode_spans(spans).SerializeToString())
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    # The one seam: where MLflow would build its HTTP exporter for the endpoint above.
    mlflow_provider.get_otlp_exporter = KeepingExporter

    @mlflow.trace(span_type="RETRIEVER")
    def retrieve(query: str) -> list[dict]:
        return [{"page_content": f"Doc about {query}.", "metadata": {"doc_uri": f"kb://{query}"}, "id": "d1"}]

    @mlflow.trace(span_type="TOOL")
    def lookup(city: str) -> str:
        if city == "Atlantis":
            raise ValueError("no such city")
        return "sunny"

    @mlflow.trace(span_type="AGENT")
    def agent(question: str) -> str:
        retrieve(question)
        with contextlib.suppress(ValueError):  # the agent recovers from its tool's error
            lookup("Atlantis" if "fail" in question else "Paris")
        with mlflow.start_span("llm", span_type="CHAT_MODEL") as span:
            span.set_inputs({"messages": [{"role": "user", "content": question}]})
            reply = {"role": "assistant", "content": f"answer {question}"}
            span.set_outputs({"choices": [{"message": reply}]})
            span.set_attribute("mlflow.chat.tokenUsage",
                               {"input_tokens": 11, "output_tokens": 3, "total_tokens": 14})
        return f"answer {question}"

    for i in range(traces):
        agent(f"question {i}" + (" fail" if i % 2 else ""))
    mlflow_provider.provider.get().force_flush()
    for batch in batches:
        sys.stdout.write(base64.b64encode(batch).decode() + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["mlflow"]:
        _run_mlflow(int(sys.argv[2]))
