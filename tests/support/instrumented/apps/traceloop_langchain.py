"""LangChain RAG chain and a tool-calling step, traced by OpenLLMetry (Traceloop).

Framework: langchain-core LCEL with langchain-openai (ChatOpenAI, OpenAIEmbeddings with
check_embedding_ctx_length=False so no tiktoken download) and an InMemoryVectorStore retriever, all
pointed at the loopback stub with max_retries=0. Instrumentors: `opentelemetry-instrumentation-langchain`
(LangchainInstrumentor, a LangChain callback handler) plus `opentelemetry-instrumentation-openai`
(OpenAIInstrumentor), the pair `Traceloop.init()` would enable, without the traceloop-sdk itself
(it exports to a cloud). TRACELOOP_TRACE_CONTENT=true (also the default) records prompts, completions
and chain inputs/outputs.
"""

from __future__ import annotations

import os

SERVICE = "traceloop-langchain"
PACKAGES = (
    "langchain-core",
    "langchain-openai",
    "opentelemetry-instrumentation-langchain",
    "opentelemetry-instrumentation-openai",
    "opentelemetry-semantic-conventions-ai",
    "openai",
)

DOCS = [
    ("Refunds are issued within 14 days of a return being received.", "https://docs.example.com/refunds"),
    ("Refunds go back to the original card of the return.", "https://docs.example.com/returns"),
    ("Shipping to Canada takes 5 to 7 business days.", "https://docs.example.com/shipping"),
]


def instrument(tracer_provider, logger_provider) -> None:
    os.environ["TRACELOOP_TRACE_CONTENT"] = "true"
    from opentelemetry.instrumentation.langchain import LangchainInstrumentor
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor

    LangchainInstrumentor().instrument(tracer_provider=tracer_provider, logger_provider=logger_provider)
    OpenAIInstrumentor().instrument(tracer_provider=tracer_provider, logger_provider=logger_provider)


def _chat_queue(h):
    """Script chat answers only: the stub's own queue would also answer the retriever's /embeddings
    request, so embeddings go to the default bag-of-words responder."""
    from collections import deque

    from support.openai_stub import default_responder

    chat = deque()
    h.stub.responder = lambda req: (default_responder(req) if req.path.endswith("/embeddings")
                                    else chat.popleft())
    return chat


def run(h) -> None:
    import openai
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings
    from support.openai_stub import Reply

    chat = _chat_queue(h)
    llm = ChatOpenAI(model="gpt-4o-mini", base_url=h.base_url, api_key="sk-test", max_retries=0)
    embeddings = OpenAIEmbeddings(model="text-embedding-3-small", base_url=h.base_url, api_key="sk-test",
                                  max_retries=0, check_embedding_ctx_length=False)
    # Indexing embeds outside any case (its spans, if any, are not part of a case's trace).
    store = InMemoryVectorStore.from_documents(
        [Document(page_content=t, metadata={"source": u}) for t, u in DOCS], embeddings)
    retriever = store.as_retriever(search_kwargs={"k": 2})
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer from the context.\n{context}"), ("human", "{question}")])
    rag = ({"context": retriever | (lambda docs: "\n".join(d.page_content for d in docs)),
            "question": RunnablePassthrough()} | prompt | llm | StrOutputParser())

    retrieved: list = []

    class Recorder(BaseCallbackHandler):  # LangChain's own callback: what the retriever returned
        def on_retriever_end(self, documents, **kwargs) -> None:
            retrieved.extend(documents)

    def context():
        return [(d.page_content, d.metadata.get("source")) for d in retrieved]

    question = "How long do refunds of a return take?"
    with h.case("rag_answer") as c:
        chat.append(Reply.chat("Refunds are issued within 14 days.", prompt_tokens=80, completion_tokens=9))
        answer = rag.invoke(question, config={"callbacks": [Recorder()]})
        c.expect(request=question, response=answer, context=context(),
                 note="LCEL: {retriever | format, passthrough} | prompt | ChatOpenAI | StrOutputParser")

    with h.case("model_error") as c:
        retrieved.clear()
        chat.append(Reply.error(500, "boom"))
        try:
            rag.invoke(question, config={"callbacks": [Recorder()]})
            raise AssertionError("the chain should have failed")
        except openai.InternalServerError:  # the stub's 500, not retried
            pass
        c.expect(request=question, response=None, context=context(), failed=True,
                 note="retrieval ran before the chat call failed; the chain raised")

    _tool_cases(h, chat, llm)


def _tool_cases(h, chat, llm) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.runnables import chain as as_runnable
    from langchain_core.tools import tool
    from support.openai_stub import Reply

    ran: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        ran.append("get_weather")
        if city == "Atlantis":
            raise RuntimeError("weather service unavailable")
        return f"Sunny and 21 C in {city}"

    llm_tools = llm.bind_tools([get_weather])

    @as_runnable
    def weather_agent(question: str) -> str:
        """One tool-calling round: the model asks for tools, they run, the model answers."""
        messages = [HumanMessage(question)]
        ai = llm_tools.invoke(messages)
        messages.append(ai)
        for call in ai.tool_calls:
            try:
                messages.append(get_weather.invoke(call))  # a ToolCall in, a ToolMessage out
            except Exception as exc:  # a tool that raised: its error goes back to the model
                messages.append(ToolMessage(f"error: {exc}", tool_call_id=call["id"], status="error"))
        return llm_tools.invoke(messages).content

    for case, city, final in (("agent_tool", "Paris", "It is sunny and 21 C in Paris."),
                              ("agent_tool_error", "Atlantis", "The weather service is unavailable.")):
        ran.clear()
        question = f"What is the weather in {city}?"
        with h.case(case) as c:
            chat.extend((Reply.tool_calls(("get_weather", {"city": city}), prompt_tokens=60,
                                          completion_tokens=12),
                         Reply.chat(final, prompt_tokens=90, completion_tokens=11)))
            answer = weather_agent.invoke(question)
            c.expect(request=question, response=answer, tools=list(ran),
                     note="a @chain runnable: bind_tools model call, the tool, a second model call"
                     + ("; the tool raised and its error went back to the model" if city == "Atlantis"
                        else ""))
