"""A FastAPI service whose POST /ask runs a small retrieval + tool-calling agent on the `openai` SDK,
traced by the FastAPI instrumentor and OpenInference.

Frameworks: `fastapi` (driven in-process through its `TestClient`, so each request's root span is
the HTTP SERVER span `POST /ask`) and `openai`. Instrumentors: `opentelemetry-instrumentation-fastapi`
(`FastAPIInstrumentor.instrument_app`: the SERVER span plus its `http receive` / `http send` INTERNAL
children) and `openinference-instrumentation-openai` (an LLM span per chat call, an EMBEDDING span
per embeddings call). The app's own spans follow OpenInference's manual-instrumentation docs (an
`OITracer` over the harness's provider): an AGENT span `rag-agent` (`set_input`/`set_output`) and a
RETRIEVER span `retrieve` (embeds the question, ranks 3 documents embedded at startup) with
`retrieval.documents.N.document.{id,content,score,metadata}` (metadata JSON `{"source": url}`). The
tools run without spans: which ran is only in the LLM spans' messages. No settings: OpenInference
captures content by default.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

SERVICE = "fastapi-openai"
PACKAGES = ("fastapi", "starlette", "opentelemetry-instrumentation-fastapi",
            "opentelemetry-instrumentation-asgi", "openai", "openinference-instrumentation-openai",
            "openinference-instrumentation", "opentelemetry-sdk")

MODEL = "gpt-4o-mini"
DOCS = [
    ("Orders ship within 2 business days.", "https://docs.example.com/shipping"),
    ("Returns are accepted for 30 days after delivery.", "https://docs.example.com/returns"),
    ("Gift cards never expire.", "https://docs.example.com/gift-cards"),
]
TOOL_SPECS = [{"type": "function", "function": {
    "name": "order_status", "description": "Status of an order by its id.", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]
APOLOGY = "Sorry, the assistant is unavailable right now. Please try again later."

_tracer = None
_provider = None
_ran: list[str] = []
_retrieved: list[tuple[str, str]] = []


def instrument(tracer_provider, logger_provider) -> None:
    global _tracer, _provider
    from openinference.instrumentation import OITracer, TraceConfig
    from openinference.instrumentation.openai import OpenAIInstrumentor

    OpenAIInstrumentor().instrument(tracer_provider=tracer_provider)
    _tracer = OITracer(tracer_provider.get_tracer(__name__), config=TraceConfig())
    _provider = tracer_provider


class Ask(BaseModel):
    question: str
    catch_errors: bool = True  # False: the handler lets a model error escape (HTTP 500)


def order_status(order_id: str) -> str:
    _ran.append("order_status")
    if not order_id.isdigit():
        raise KeyError(f"no order {order_id!r}")
    return f"order {order_id}: shipped yesterday"


def embed(client, texts: list[str]) -> list[list[float]]:
    return [d.embedding for d in client.embeddings.create(model="text-embedding-3-small", input=texts).data]


def retrieve(client, index: list[list[float]], query: str, k: int = 2) -> list[tuple[str, str]]:
    from openinference.instrumentation import get_retriever_attributes

    with _tracer.start_as_current_span("retrieve", openinference_span_kind="retriever") as span:
        span.set_input(query)
        (q,) = embed(client, [query])
        scores = [sum(a * b for a, b in zip(q, v, strict=True)) for v in index]
        ranked = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:k]
        span.set_attributes(get_retriever_attributes(documents=[
            {"id": f"doc-{i}", "content": DOCS[i][0], "score": scores[i], "metadata": {"source": DOCS[i][1]}}
            for i in ranked]))
        found = [DOCS[i] for i in ranked]
        _retrieved.extend(found)
        return found


def answer(client, index, question: str) -> str:
    docs = retrieve(client, index, question)
    context = "\n".join(f"- {text} ({uri})" for text, uri in docs)
    messages = [{"role": "system", "content": f"Answer from these documents:\n{context}"},
                {"role": "user", "content": question}]
    for _ in range(4):
        resp = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOL_SPECS)
        msg = resp.choices[0].message
        if not msg.tool_calls:
            return msg.content
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            try:
                result = order_status(**json.loads(call.function.arguments))
            except Exception as exc:  # the model sees the error and recovers
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    raise RuntimeError("agent did not finish")


def make_app(client):
    import openai
    from fastapi import FastAPI
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.trace import Status, StatusCode

    app = FastAPI()
    index = embed(client, [text for text, _ in DOCS])  # at startup, before (outside) any request

    @app.post("/ask")
    def ask(body: Ask) -> dict:
        with _tracer.start_as_current_span("rag-agent", openinference_span_kind="agent") as span:
            span.set_input(body.question)
            try:
                text = answer(client, index, body.question)
            except openai.APIError as exc:
                if not body.catch_errors:
                    raise  # unhandled: FastAPI answers HTTP 500
                span.record_exception(exc)  # handled: the user gets an apology, the span says ERROR
                span.set_status(Status(StatusCode.ERROR, f"model call failed: {exc}"))
                span.set_output(APOLOGY)
                return {"answer": APOLOGY}
            span.set_output(text)
            return {"answer": text}

    FastAPIInstrumentor.instrument_app(app, tracer_provider=_provider)
    return app


def run(h) -> None:
    from collections import deque

    import openai
    from fastapi.testclient import TestClient
    from support.openai_stub import Reply, default_responder

    def script(*replies):  # chat calls get `replies` in order, embeddings the stub's default vectors
        queue = deque(replies)
        h.stub.responder = lambda req: (default_responder(req) if req.path.endswith("/embeddings")
                                        else queue.popleft())

    client = openai.OpenAI(base_url=h.base_url, api_key="sk-test-fake", max_retries=0)
    http = TestClient(make_app(client), raise_server_exceptions=False)

    def ask(question, catch_errors=True):
        _ran.clear()
        _retrieved.clear()
        resp = http.post("/ask", json={"question": question, "catch_errors": catch_errors})
        assert resp.status_code in (200, 500), resp.text
        return resp.status_code, (resp.json()["answer"] if resp.status_code == 200 else None)

    with h.case("rag_tool") as c:
        question = "Where is my order 1234? Orders ship when?"
        script(Reply.tool_calls(("order_status", {"order_id": "1234"}),
                                prompt_tokens=95, completion_tokens=14),
               Reply.chat("Order 1234 shipped yesterday; orders ship within 2 business days.",
                          prompt_tokens=130, completion_tokens=16))
        status, text = ask(question)
        c.expect(request=question, response=text, context=list(_retrieved), tools=list(_ran),
                 note=f"HTTP {status}; retriever returned 2 of 3 documents, then one tool call")

    with h.case("tool_error") as c:
        question = "What is the status of order ABC?"
        script(Reply.tool_calls(("order_status", {"order_id": "ABC"}), prompt_tokens=90),
               Reply.chat("I could not find order ABC; please check the order number.", prompt_tokens=120))
        status, text = ask(question)
        c.expect(request=question, response=text, context=list(_retrieved), tools=list(_ran),
                 note=f"HTTP {status}; the tool raised KeyError, the model saw the error and answered")

    with h.case("model_error_caught") as c:
        question = "Can I return a gift card?"
        script(Reply.error(500, "upstream exploded"))
        status, text = ask(question)
        c.expect(request=question, response=text, context=list(_retrieved), tools=list(_ran), failed=True,
                 note=f"HTTP {status} with the apology as the answer (response = the apology the user "
                      "got); the handler caught the model's 500 and set its AGENT span ERROR; the SERVER "
                      "span is UNSET")

    with h.case("model_error_unhandled") as c:
        question = "How long do returns take?"
        script(Reply.error(500, "upstream exploded"))
        status, text = ask(question, catch_errors=False)
        c.expect(request=question, response=text, context=list(_retrieved), tools=list(_ran), failed=True,
                 note=f"HTTP {status}: the model's 500 propagated out of the handler; response None")
