"""Small apps traced with the real `mlflow` package (3.x), returning `Trace.to_json()` strings.

The traces are what MLflow itself builds: `@mlflow.trace` / `mlflow.start_span` spans go through
MLflow's own span processor (`MlflowV3SpanProcessor`: trace info, previews, the trace-level
token-usage roll-up, the ERROR state of a failed root) and the finished trace is taken from MLflow's
in-memory trace manager by a capturing exporter. Nothing is written to disk and nothing touches the
network; `capture()` restores MLflow's default tracing when it exits.

Every app is a plain function taking the question; `APPS` maps a name to it. `run(name)` and
`run_all()` return the JSON text of the trace(s).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import mlflow
from mlflow.entities import Document, SpanType

EXPERIMENT_ID = "7"
MODEL = "gpt-4o-mini"

_LOCK = threading.Lock()


@contextmanager
def capture(experiment_id: str = EXPERIMENT_ID, seed: int | None = None) -> Iterator[list[str]]:
    """Route MLflow tracing into the yielded list (one `Trace.to_json()` per finished trace).

    With a `seed`, trace and span ids repeat from run to run (timestamps still differ)."""
    from mlflow.entities.trace_location import MlflowExperimentLocation
    from mlflow.tracing.processor.mlflow_v3 import MlflowV3SpanProcessor
    from mlflow.tracing.provider import _MLFLOW_TRACE_USER_DESTINATION, provider
    from mlflow.tracing.trace_manager import InMemoryTraceManager
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

    sink: list[str] = []

    class CapturingExporter(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            manager = InMemoryTraceManager.get_instance()
            for span in spans:
                if span.parent is None and (finished := manager.pop_trace(span.context.trace_id)):
                    sink.append(finished.trace.to_json())
            return SpanExportResult.SUCCESS

    with _LOCK:
        # What `mlflow.tracing.set_destination(MlflowExperimentLocation(...))` records, without
        # its re-initialisation of the tracer provider (which would point at a tracking store).
        _MLFLOW_TRACE_USER_DESTINATION.set(MlflowExperimentLocation(experiment_id))
        ids: IdGenerator = RandomIdGenerator()
        if seed is not None:
            rng = random.Random(seed)

            class SeededIds(IdGenerator):
                def generate_span_id(self) -> int:
                    return rng.getrandbits(64) or 1

                def generate_trace_id(self) -> int:
                    return rng.getrandbits(128) or 1

            ids = SeededIds()
        tracer_provider = TracerProvider(id_generator=ids)
        tracer_provider.add_span_processor(MlflowV3SpanProcessor(CapturingExporter(), export_metrics=False))
        # Mark MLflow's lazy set-up as done so it keeps this provider (no tracking store behind it).
        provider.once.do_once(lambda: None)
        provider.set(tracer_provider)
        try:
            yield sink
        finally:
            mlflow.tracing.reset()  # also clears the destination


# ------------------------------------------------------------------------------------------
# building blocks

CORPUS = {
    "mlflow": [("MLflow is an open source platform for the machine learning lifecycle.",
                "https://mlflow.org/docs/index.html"),
               ("MLflow Tracing records the inputs, outputs and timing of each step.",
                "https://mlflow.org/docs/tracing.html")],
    "kafka": [("Kafka consumer groups share the partitions of a topic.", "https://kafka.apache.org/groups"),
              ("Offsets are committed per partition.", "https://kafka.apache.org/offsets")],
}


def _usage(prompt: str, answer: str) -> dict[str, int]:
    inp, out = len(prompt.split()) + 7, len(answer.split())
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out}


@mlflow.trace(span_type=SpanType.RETRIEVER)
def vector_search(query: str, topic: str = "mlflow") -> list[Document]:
    return [Document(page_content=text, metadata={"doc_uri": uri, "chunk_id": f"c{i}"}, id=f"d{i}")
            for i, (text, uri) in enumerate(CORPUS[topic])]


@mlflow.trace(span_type=SpanType.RETRIEVER)
def hybrid_search(query: str) -> list[Document]:
    # A retriever that calls another retriever: only the outer one is "top level".
    dense = vector_search(query, "kafka")
    return [*dense, Document(page_content="Lag is the distance to the log end.",
                             metadata={"doc_uri": "https://kafka.apache.org/lag"})]


def chat_model(messages: list[dict[str, str]], answer: str, name: str = "chat_completion") -> dict[str, Any]:
    """A CHAT_MODEL span as an autologger records one: messages in, a chat completion out, usage."""
    with mlflow.start_span(name, span_type=SpanType.CHAT_MODEL) as span:
        span.set_inputs({"messages": messages, "model": MODEL, "temperature": 0})
        usage = _usage(" ".join(m["content"] for m in messages), answer)
        completion = {"id": "chatcmpl-1", "object": "chat.completion", "model": MODEL,
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                   "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": usage["input_tokens"],
                                "completion_tokens": usage["output_tokens"],
                                "total_tokens": usage["total_tokens"]}}
        span.set_outputs(completion)
        span.set_attribute("mlflow.chat.tokenUsage", usage)
        span.set_attribute("mlflow.llm.model", MODEL)
        return completion


@mlflow.trace(span_type=SpanType.TOOL)
def get_weather(city: str) -> str:
    return f"sunny in {city}"


@mlflow.trace(span_type=SpanType.TOOL)
def lookup_order(order_id: str, include_items: bool = False) -> dict[str, Any]:
    return {"order_id": order_id, "status": "shipped"}


@mlflow.trace(span_type=SpanType.TOOL)
def flaky_tool(x: int) -> int:
    raise ValueError("tool exploded")


# ------------------------------------------------------------------------------------------
# apps: the parity ones (tracejudge and MLflow must agree on every derived field)


@mlflow.trace(span_type=SpanType.AGENT)
def rag_agent(question: str) -> str:
    """Retriever returning Documents, then a chat model with usage; the answer is a string."""
    docs = vector_search(question)
    context = "\n".join(d.page_content for d in docs)
    answer = "MLflow is an open source platform for the ML lifecycle."
    chat_model([{"role": "system", "content": f"Context:\n{context}"}, {"role": "user", "content": question}],
               answer)
    return answer


@mlflow.trace(span_type=SpanType.AGENT)
def multi_retriever_agent(question: str) -> str:
    """Two top-level retrievers, one of which calls a nested retriever."""
    first = vector_search(question)
    second = hybrid_search(question)
    answer = f"Found {len(first) + len(second)} passages."
    chat_model([{"role": "user", "content": question}], answer)
    return answer


@mlflow.trace(span_type=SpanType.CHAT_MODEL)
def chat_endpoint(messages: list[dict[str, str]]) -> dict[str, Any]:
    """A chat app: OpenAI-style messages in (one user turn), a chat completion out."""
    return chat_model(messages, "Consumer groups share partitions.", name="llm_call")


@mlflow.trace(span_type=SpanType.AGENT)
def tool_agent(question: str) -> str:
    """Tool calls in order (one tool twice), an erroring tool caught by the agent, nested tool."""
    weather = get_weather("Paris")
    order = lookup_order("A-17", include_items=True)
    with mlflow.start_span("planner", span_type=SpanType.CHAIN):
        get_weather("Oslo")
    with suppress(ValueError):
        flaky_tool(3)
    answer = f"{weather}; order {order['status']}"
    chat_model([{"role": "user", "content": question}], answer)
    return answer


@mlflow.trace(span_type=SpanType.AGENT)
def wrapper_llm_agent(question: str) -> str:
    """A wrapper LLM span that rolls up the usage of the inner model call: counted once."""
    with mlflow.start_span("llm_wrapper", span_type=SpanType.LLM) as wrapper:
        wrapper.set_inputs({"prompt": question})
        completion = chat_model([{"role": "user", "content": question}], "Offsets are per partition.",
                                name="inner_chat")
        wrapper.set_attribute("mlflow.chat.tokenUsage", {
            "input_tokens": completion["usage"]["prompt_tokens"],
            "output_tokens": completion["usage"]["completion_tokens"],
            "total_tokens": completion["usage"]["total_tokens"]})
        wrapper.set_outputs(completion["choices"][0]["message"]["content"])
    second = chat_model([{"role": "user", "content": "and lag?"}], "Lag is the distance to the end.",
                        name="second_call")
    return second["choices"][0]["message"]["content"]


@mlflow.trace(span_type=SpanType.AGENT)
def failing_agent(question: str) -> str:
    """The root raises: MLflow records the exception event and the trace state is ERROR."""
    vector_search(question)
    raise RuntimeError("model endpoint returned 503")


@mlflow.trace(span_type=SpanType.CHAIN)
def chat_completion_app(question: str) -> dict[str, Any]:
    """The root returns a whole chat completion: the answer is choices[0].message.content."""
    return chat_model([{"role": "user", "content": question}], "Use a consumer group.")


@mlflow.trace(span_type=SpanType.AGENT)
def responses_agent(request: dict[str, Any]) -> dict[str, Any]:
    """A ResponsesAgent-style app: the answer is the assistant `output_text` of `output`."""
    question = request["input"][-1]["content"]
    chat_model([{"role": "user", "content": question}], "Partitions are ordered.")
    return {"output": [{"type": "message", "id": "msg_1", "role": "assistant",
                        "content": [{"type": "output_text", "text": "Partitions are ordered."}]}]}


def plain_text_app(question: str) -> str:
    """A root span whose inputs are a bare string (set explicitly, not a function's arguments)."""
    with mlflow.start_span("plain_text_app", span_type=SpanType.CHAIN) as root:
        root.set_inputs(question)
        docs = vector_search(question, "kafka")
        root.set_outputs(docs[0].page_content)
        return docs[0].page_content


@mlflow.trace(span_type=SpanType.CHAT_MODEL)
def single_turn_chat(messages: list[dict[str, str]]) -> dict[str, Any]:
    """One user message: MLflow and tracejudge both take its content as the request."""
    return chat_model(messages, "A topic is a named log.")


@mlflow.trace(span_type=SpanType.AGENT)
def tagged_agent(question: str) -> str:
    """Trace tags, a client request id, a session and a user, set the way an app sets them."""
    mlflow.update_current_trace(tags={"service": "checkout", "team": "payments"},
                                client_request_id="client-42", session_id="sess-1", user="user-9")
    return "Tagged answer."


def with_expectations(trace_json: str, **expectations: Any) -> str:
    """The trace with expectation assessments attached, serialised by MLflow itself (the shape
    `mlflow.log_expectation` stores and `mlflow.get_trace` returns)."""
    from mlflow.entities import AssessmentSource, Expectation
    from mlflow.entities import Trace as MlflowTrace

    trace = MlflowTrace.from_json(trace_json)
    source = AssessmentSource(source_type="HUMAN", source_id="reviewer")
    trace.info.assessments = [Expectation(name=name, value=value, source=source)
                              for name, value in expectations.items()]
    return trace.to_json()


# apps where tracejudge deliberately differs from MLflow (see the section of that name in
# docs/pages/inputs/formats.md)


@mlflow.trace(span_type=SpanType.AGENT)
def multi_turn_chat(messages: list[dict[str, str]]) -> str:
    """Several chat turns: MLflow's request is the JSON of all messages, ours the last user turn."""
    return "It keeps offsets per partition."


@mlflow.trace(span_type=SpanType.AGENT)
def query_history_agent(query: str, history: list[dict[str, str]]) -> dict[str, str]:
    """`{"query", "history"}` in, `{"answer": ...}` out: MLflow renders both dicts, we pick the text."""
    docs = vector_search(query)
    return {"answer": docs[0].page_content, "source": docs[0].metadata["doc_uri"]}


@mlflow.trace(span_type=SpanType.RETRIEVER)
def string_retriever(query: str) -> list[str]:
    return ["Plain string passage one.", "Plain string passage two."]


@mlflow.trace(span_type=SpanType.AGENT)
def string_docs_agent(question: str) -> str:
    """A retriever returning plain strings: MLflow drops them, we keep them as documents."""
    string_retriever(question)
    return "done"


@mlflow.trace(span_type=SpanType.AGENT)
def no_output_agent(question: str) -> None:
    """No output at all: MLflow's response is a blank " ", ours is None."""
    return None


APPS: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "rag": (rag_agent, ("What is MLflow?",)),
    "multi_retriever": (multi_retriever_agent, ("How do consumer groups work?",)),
    "chat": (chat_endpoint, ([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "What is a consumer group?"}],)),
    "tools": (tool_agent, ("Weather and my order?",)),
    "wrapper_llm": (wrapper_llm_agent, ("What is an offset?",)),
    "failing": (failing_agent, ("Will this fail?",)),
    "chat_completion": (chat_completion_app, ("How do I share partitions?",)),
    "tagged": (tagged_agent, ("Who am I?",)),
    "plain_text": (plain_text_app, ("What is a consumer group?",)),
    "single_turn": (single_turn_chat, ([{"role": "user", "content": "What is a topic?"}],)),
    "responses": (responses_agent, ({"input": [{"role": "user", "content": "Are partitions ordered?"}]},)),
}

DIFFERING_APPS: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
    "multi_turn": (multi_turn_chat, ([{"role": "user", "content": "What is Kafka?"},
                                      {"role": "assistant", "content": "A log."},
                                      {"role": "user", "content": "And offsets?"}],)),
    "query_history": (query_history_agent, ("What is MLflow?",
                                            [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}])),
    "string_docs": (string_docs_agent, ("strings?",)),
    "no_output": (no_output_agent, ("anything?",)),
}


def call(app: Callable[..., Any], args: tuple[Any, ...]) -> None:
    with suppress(RuntimeError):  # the failing app's exception is what its trace records
        app(*args)


def run(name: str) -> str:
    """The `Trace.to_json()` of one run of the named app."""
    app, args = {**APPS, **DIFFERING_APPS}[name]
    with capture() as traces:
        call(app, args)
    if len(traces) != 1:
        raise RuntimeError(f"expected one trace from {name}, got {len(traces)}")
    return traces[0]


def run_all(names: Sequence[str] | None = None, seed: int | None = None) -> dict[str, str]:
    """{app name: trace JSON} for the named apps (all of them by default), in one capture."""
    table = {**APPS, **DIFFERING_APPS}
    names = list(names) if names is not None else list(table)
    out: dict[str, str] = {}
    with capture(seed=seed) as traces:
        for name in names:
            app, args = table[name]
            call(app, args)
            if len(traces) != 1:
                raise RuntimeError(f"expected one trace from {name}, got {len(traces)}")
            out[name] = traces.pop()
    return out
