"""A LangChain RAG chain traced by OpenInference's LangChain instrumentor.

Framework: LangChain (langchain-core LCEL, `langchain-openai` ChatOpenAI and OpenAIEmbeddings, the
in-memory vector store of langchain-core). The chain is the usual LCEL shape

    {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | parser

Instrumentor: `openinference-instrumentation-langchain` (`LangChainInstrumentor`), which adds its
callback tracer to every LangChain callback manager; a span per LangChain run (chain, retriever,
prompt, chat model, parser), OpenInference attributes (`openinference.span.kind`, `input.value`,
`retrieval.documents.*`, `llm.*`). No settings matter: it records content by default.

The embeddings client runs with `check_embedding_ctx_length=False`, so it sends the texts as they
are and never needs tiktoken's encoding files (which it would download). Retries are off
(`max_retries=0`), so a 500 from the stub fails the chain at once.
"""

from __future__ import annotations

from typing import Any

SERVICE = "langchain-rag"
PACKAGES = (
    "langchain-core",
    "langchain-openai",
    "openai",
    "openinference-instrumentation-langchain",
    "openinference-instrumentation",
    "openinference-semantic-conventions",
    "opentelemetry-sdk",
)

DOCS = [
    ("Tracejudge reads OpenTelemetry spans of LLM agents and derives one evaluation record per trace.",
     "https://docs.example.com/tracejudge/overview"),
    ("Tracejudge exports evaluation quality metrics to Prometheus for dashboards and alerts.",
     "https://docs.example.com/tracejudge/metrics"),
    ("The Kafka consumer of tracejudge reads spans from a topic in batches.",
     "/srv/docs/kafka-consumer.md"),
    ("Bananas are rich in potassium and grow in tropical climates.",
     "https://docs.example.com/misc/bananas"),
]


def instrument(tracer_provider: Any, logger_provider: Any) -> None:
    from openinference.instrumentation.langchain import LangChainInstrumentor

    LangChainInstrumentor().instrument(tracer_provider=tracer_provider)


def _build(h: Any, retrieved: list[Any]) -> Any:
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model="text-embedding-3-small", base_url=h.base_url, api_key="sk-fake",
                                  max_retries=0, check_embedding_ctx_length=False)
    docs = [Document(page_content=text, metadata={"source": uri}) for text, uri in DOCS]
    store = InMemoryVectorStore.from_documents(docs, embeddings)  # outside any case: no span
    retriever = store.as_retriever(search_kwargs={"k": 2})

    def format_docs(found: list[Any]) -> str:
        retrieved[:] = found  # what the retriever returned, in order
        return "\n\n".join(d.page_content for d in found)

    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only this context:\n{context}"),
        ("human", "{question}"),
    ])
    llm = ChatOpenAI(model="gpt-4o-mini", base_url=h.base_url, api_key="sk-fake", max_retries=0,
                     temperature=0)
    return ({"context": retriever | RunnableLambda(format_docs), "question": RunnablePassthrough()}
            | prompt | llm | StrOutputParser())


def run(h: Any) -> None:
    from support.openai_stub import Reply, default_responder

    # `h.stub.enqueue` would answer the retriever's embedding request too: script chat answers only.
    chat_replies: list[Reply] = []
    h.stub.responder = lambda req: (default_responder(req) if req.path.endswith("/embeddings")
                                    else chat_replies.pop(0))
    retrieved: list[Any] = []
    chain = _build(h, retrieved)

    def context() -> list[tuple[str, str | None]]:
        return [(d.page_content, d.metadata.get("source")) for d in retrieved]

    with h.case("rag_answer") as c:
        question = "What does tracejudge derive from OpenTelemetry spans?"
        chat_replies.append(Reply.chat("It derives one evaluation record per trace.",
                                  prompt_tokens=83, completion_tokens=11))
        retrieved.clear()
        answer = chain.invoke(question)
        c.expect(request=question, response=answer, context=context(), tools=[])

    with h.case("rag_model_error") as c:
        question = "Where does tracejudge export its quality metrics?"
        chat_replies.append(Reply.error(500, "boom"))
        retrieved.clear()
        try:
            answer = chain.invoke(question)
        except Exception:
            answer = None
        c.expect(request=question, response=answer, context=context(), tools=[], failed=True,
                 note="retrieval succeeded, then the chat model call got a 500 (max_retries=0)")
