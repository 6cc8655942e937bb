"""A hand-written RAG function over Chroma and the OpenAI SDK, traced by OpenLLMetry (Traceloop).

Framework: none but the libraries: an in-memory `chromadb.EphemeralClient` (anonymized_telemetry off)
with a tiny bag-of-words embedding function (no model download), and the `openai` client pointed at
the loopback stub (max_retries=0). Instrumentors: `opentelemetry-instrumentation-chromadb`
(ChromaInstrumentor: a `chroma.query` span with one `db.query.result` span event per returned
document) and `opentelemetry-instrumentation-openai` (OpenAIInstrumentor: the chat span).
TRACELOOP_TRACE_CONTENT=true (also the default) records prompts and completions. Without the
traceloop-sdk there is no `@workflow` decorator, so the app opens its own plain root span, as an
application instrumented by hand does: it carries no GenAI attributes at all.
"""

from __future__ import annotations

import os

SERVICE = "traceloop-vectordb"
PACKAGES = (
    "chromadb",
    "openai",
    "opentelemetry-instrumentation-chromadb",
    "opentelemetry-instrumentation-openai",
    "opentelemetry-semantic-conventions-ai",
)

DOCS = [
    ("Refunds are issued within 14 days of a return being received.", "https://docs.example.com/refunds"),
    ("Refunds go back to the original card of the return.", "https://docs.example.com/returns"),
    ("Shipping to Canada takes 5 to 7 business days.", "https://docs.example.com/shipping"),
]


def instrument(tracer_provider, logger_provider) -> None:
    os.environ["TRACELOOP_TRACE_CONTENT"] = "true"
    from opentelemetry.instrumentation.chromadb import ChromaInstrumentor
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor

    ChromaInstrumentor().instrument(tracer_provider=tracer_provider)
    OpenAIInstrumentor().instrument(tracer_provider=tracer_provider, logger_provider=logger_provider)


def _embedding_function():
    from chromadb.api.types import EmbeddingFunction
    from support.openai_stub import bag_of_words_vector

    class BagOfWords(EmbeddingFunction):
        def __init__(self) -> None:
            pass

        def __call__(self, input):  # chromadb's protocol names it `input`
            return [bag_of_words_vector(t, dims=32) for t in input]

        @staticmethod
        def name() -> str:
            return "bag-of-words"

        def get_config(self) -> dict:
            return {}

        @staticmethod
        def build_from_config(config):
            return BagOfWords()

    return BagOfWords()


def run(h) -> None:
    import chromadb
    import openai
    from opentelemetry import trace
    from support.openai_stub import Reply

    client = openai.OpenAI(base_url=h.base_url, api_key="sk-test", max_retries=0)
    db = chromadb.EphemeralClient(settings=chromadb.Settings(anonymized_telemetry=False))
    # Indexing happens outside any case (its `chroma.add` span is a trace of its own, not kept).
    kb = db.create_collection("knowledge-base", embedding_function=_embedding_function())
    kb.add(ids=[f"doc{i}" for i in range(len(DOCS))], documents=[t for t, _ in DOCS],
           metadatas=[{"source": u} for _, u in DOCS])
    tracer = trace.get_tracer("traceloop_vectordb.app")

    def answer(question: str, found: list) -> str:
        with tracer.start_as_current_span("answer_question"):
            hits = kb.query(query_texts=[question], n_results=2)
            docs = hits["documents"][0]
            found.extend(zip(docs, [m["source"] for m in hits["metadatas"][0]], strict=True))
            reply = client.chat.completions.create(model="gpt-4o-mini", messages=[
                {"role": "system", "content": "Answer from the context.\n" + "\n".join(docs)},
                {"role": "user", "content": question}])
            return reply.choices[0].message.content

    question = "How long do refunds of a return take?"
    with h.case("rag_answer") as c:
        h.stub.enqueue(Reply.chat("Refunds are issued within 14 days.", prompt_tokens=70,
                                  completion_tokens=9))
        found: list = []
        text = answer(question, found)
        c.expect(request=question, response=text, context=found,
                 note="plain root span > chroma query (db.query.result events) > openai chat")

    with h.case("model_error") as c:
        h.stub.enqueue(Reply.error(500, "boom"))
        found = []
        try:
            answer(question, found)
            raise AssertionError("the request should have failed")
        except openai.InternalServerError:  # the stub's 500, not retried
            pass
        c.expect(request=question, response=None, context=found, failed=True,
                 note="the query ran, the chat call failed; the app's root span records the exception")
