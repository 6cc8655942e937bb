"""LlamaIndex RAG query engine (and a FunctionAgent with a tool), traced by OpenInference.

Framework: llama-index-core with llama-index-llms-openai / llama-index-embeddings-openai pointed at
the loopback stub (max_retries=0). Instrumentor: `openinference-instrumentation-llama-index`
(`LlamaIndexInstrumentor`, the new llama_index.core.instrumentation dispatcher handler, default
TraceConfig: inputs, outputs and messages captured). Nothing is downloaded: `Settings.tokenizer` is a
plain whitespace splitter (no tiktoken BPE file) and the node parser splits on tokens of that
tokenizer, so NLTK data is never needed.
"""

from __future__ import annotations

import asyncio

SERVICE = "llamaindex-rag"
PACKAGES = (
    "llama-index-core",
    "llama-index-llms-openai",
    "llama-index-embeddings-openai",
    "llama-index-workflows",
    "openinference-instrumentation-llama-index",
    "openinference-instrumentation",
    "openinference-semantic-conventions",
    "openai",
)

DOCS = [
    ("Refunds are issued within 14 days of a return being received.", {"file_path": "/kb/refunds.md"}),
    ("Refunds go back to the original card of the return.",
     {"source": "https://docs.example.com/returns"}),
    ("Shipping to Canada takes 5 to 7 business days.", {"source": "https://docs.example.com/shipping"}),
    ("Gift cards never expire and cannot be refunded.", {"file_path": "/kb/gift-cards.md"}),
]


def instrument(tracer_provider, logger_provider) -> None:
    from openinference.instrumentation.llama_index import LlamaIndexInstrumentor

    LlamaIndexInstrumentor().instrument(tracer_provider=tracer_provider)


def _setup(h):
    from llama_index.core import Settings
    from llama_index.core.node_parser import TokenTextSplitter
    from llama_index.embeddings.openai import OpenAIEmbedding
    from llama_index.llms.openai import OpenAI

    Settings.tokenizer = str.split  # no tiktoken download
    Settings.node_parser = TokenTextSplitter(chunk_size=256, chunk_overlap=0, tokenizer=str.split)
    Settings.llm = OpenAI(model="gpt-4o-mini", api_base=h.base_url, api_key="sk-test", max_retries=0,
                          timeout=10)
    Settings.embed_model = OpenAIEmbedding(model="text-embedding-3-small", api_base=h.base_url,
                                           api_key="sk-test", max_retries=0, timeout=10)


def _chat_queue(h):
    """Script chat answers only: the stub's own queue also answers /embeddings requests, which the
    query engine makes before its chat call. Embeddings get short (32-dim) bag-of-words vectors: the
    instrumentor records every vector as a span attribute, and the fixture must stay small."""
    from collections import deque

    from support.openai_stub import Reply, bag_of_words_vector

    chat = deque()

    def respond(req):
        if req.path.endswith("/embeddings"):
            inputs = req.body["input"]
            inputs = [inputs] if isinstance(inputs, str) else inputs
            return Reply.embeddings([bag_of_words_vector(str(t), dims=32) for t in inputs])
        return chat.popleft()

    h.stub.responder = respond
    return chat


def _record_retrievals() -> list:
    """The nodes each retrieval returned, from LlamaIndex's own RetrievalEndEvent: the failing
    query raises after retrieving, so its source nodes never reach the app otherwise."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent

    retrieved: list = []

    class Recorder(BaseEventHandler):
        def handle(self, event, **kwargs) -> None:
            if isinstance(event, RetrievalEndEvent):
                retrieved.extend(event.nodes)

    get_dispatcher().add_event_handler(Recorder())
    return retrieved


def _context(nodes) -> list[tuple[str, str | None]]:
    return [(n.node.get_content(), n.node.metadata.get("source") or n.node.metadata.get("file_path"))
            for n in nodes]


def run(h) -> None:
    import openai
    from llama_index.core import Document, PromptTemplate, VectorStoreIndex
    from support.openai_stub import Reply

    _setup(h)
    chat = _chat_queue(h)
    # Build the index outside any case: its embedding calls make traces of their own.
    index = VectorStoreIndex.from_documents([Document(text=t, metadata=m) for t, m in DOCS])
    # A short QA prompt and the one-call synthesizer keep the fixture small (the default "compact"
    # mode nests refine spans; the default QA prompt adds a long system message to every trace).
    # simple_summarize passes context_str as a one-element list, so the prompt shows "['...']".
    qa = PromptTemplate("Answer from the context.\n{context_str}\nQuestion: {query_str}\nAnswer: ")
    engine = index.as_query_engine(similarity_top_k=2, response_mode="simple_summarize",
                                   text_qa_template=qa)
    retrieved = _record_retrievals()

    question = "How long do refunds of a return take?"
    with h.case("rag_answer") as c:
        chat.append(Reply.chat("Refunds are issued within 14 days.", prompt_tokens=120,
                                  completion_tokens=9))
        resp = engine.query(question)
        assert _context(retrieved) == _context(resp.source_nodes)
        c.expect(request=question, response=resp.response, context=_context(resp.source_nodes),
                 note="query engine: retrieve top-2 then one synthesis chat call")

    with h.case("model_error") as c:
        retrieved.clear()
        chat.append(Reply.error(500, "boom"))
        try:
            engine.query(question)
            raise AssertionError("the query should have failed")
        except openai.InternalServerError:  # the stub's 500, not retried
            pass
        c.expect(request=question, response=None, context=_context(retrieved), failed=True,
                 note="retrieval ran (2 nodes) before the synthesis call failed; the run raised")

    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.tools import FunctionTool

    ran: list[str] = []

    def get_weather(city: str) -> str:
        """Current weather of a city."""
        ran.append("get_weather")
        raise RuntimeError("weather service unavailable")

    agent = FunctionAgent(tools=[FunctionTool.from_defaults(get_weather)],
                          system_prompt="Use the tool.")

    question = "What is the weather in Atlantis?"
    with h.case("agent_tool_error") as c:
        chat.extend((Reply.tool_calls(("get_weather", {"city": "Atlantis"}), prompt_tokens=60,
                                      completion_tokens=12),
                     Reply.chat("The weather service is unavailable.", prompt_tokens=90,
                                completion_tokens=11)))
        result = asyncio.run(_run_agent(agent, question))
        assert str(result) == result.response.content
        c.expect(request=question, response=str(result), tools=list(ran),
                 note="FunctionAgent workflow (streams its chat calls): the tool raised, its error "
                 "went back to the model as the tool result, the agent answered")



async def _run_agent(agent, question: str):
    return await agent.run(user_msg=question)  # the workflow needs a running event loop
