"""A LangGraph tool-calling agent traced by OpenInference's LangChain instrumentor.

Framework: LangGraph, through the agent LangChain 1.x builds on it (`langchain.agents.create_agent`,
the successor of the deprecated `langgraph.prebuilt.create_react_agent`): a compiled StateGraph with
a `model` node calling `langchain-openai` ChatOpenAI with two tools bound and a `tools` node (a
LangGraph ToolNode). The graph is invoked with `{"messages": [question]}`, the question given in a
different one of the three forms LangGraph accepts in each case (a `("user", text)` tuple, a
`HumanMessage`, an OpenAI-style `{"role": "user", "content": text}` dict), since the graph's span
records its input as given; the answer is the content of the last AIMessage in the result's
`messages`. (create_react_agent traces the same way plus four more spans per model turn, which
made this fixture too big.)

Instrumentor: `openinference-instrumentation-langchain` (`LangChainInstrumentor`): LangGraph runs
through LangChain's callback system, so the graph (span `LangGraph`), each node, the chat model and
each tool get a span (`openinference.span.kind` CHAIN / LLM / TOOL). No settings matter: it
records content by default.

Settings that matter: ToolNode's default error handler only turns argument-validation errors into
a ToolMessage and re-raises anything else, so the agent gets `ToolRetryMiddleware(max_retries=0,
on_failure="continue")`: a tool that raises becomes an error ToolMessage the model sees, and the
agent answers anyway. ChatOpenAI runs with `max_retries=0`, so a 500 from the stub fails the run.
Nothing here counts tokens, so tiktoken downloads nothing.
"""

from __future__ import annotations

from typing import Any

SERVICE = "langgraph-agent"
PACKAGES = (
    "langchain",
    "langgraph",
    "langgraph-prebuilt",
    "langchain-core",
    "langchain-openai",
    "openai",
    "openinference-instrumentation-langchain",
    "openinference-instrumentation",
    "openinference-semantic-conventions",
    "opentelemetry-sdk",
)


def instrument(tracer_provider: Any, logger_provider: Any) -> None:
    from openinference.instrumentation.langchain import LangChainInstrumentor

    LangChainInstrumentor().instrument(tracer_provider=tracer_provider)


def _build(h: Any, ran: list[str]) -> Any:
    from langchain.agents import create_agent
    from langchain.agents.middleware import ToolRetryMiddleware
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        ran.append("get_weather")
        return f"Sunny, 21 C in {city}."

    @tool
    def get_population(city: str) -> str:
        """The population of a city."""
        ran.append("get_population")
        raise ValueError(f"no population data for {city}")

    llm = ChatOpenAI(model="gpt-4o-mini", base_url=h.base_url, api_key="sk-fake", max_retries=0,
                     temperature=0)
    # Without it a tool that raises fails the whole run (the ToolNode default re-raises).
    recover = ToolRetryMiddleware(max_retries=0, on_failure="continue")
    return create_agent(llm, [get_weather, get_population], middleware=[recover],
                        system_prompt="You are a helpful assistant. Use the tools.")


def _answer(result: dict[str, Any]) -> str:
    from langchain_core.messages import AIMessage

    return next(m.content for m in reversed(result["messages"]) if isinstance(m, AIMessage))


def run(h: Any) -> None:
    from langchain_core.messages import HumanMessage
    from support.openai_stub import Reply

    ran: list[str] = []
    agent = _build(h, ran)

    with h.case("tool_then_answer") as c:
        question = "What is the weather in Paris?"
        h.stub.enqueue(Reply.tool_calls(("get_weather", {"city": "Paris"}), prompt_tokens=61,
                                        completion_tokens=17),
                       Reply.chat("It is sunny and 21 C in Paris.", prompt_tokens=92, completion_tokens=12))
        ran.clear()
        answer = _answer(agent.invoke({"messages": [("user", question)]}))
        c.expect(request=question, response=answer, tools=list(ran), note="input as a (role, text) tuple")

    with h.case("tool_error_recovered") as c:
        question = "How many people live in Atlantis?"
        h.stub.enqueue(Reply.tool_calls(("get_population", {"city": "Atlantis"}), prompt_tokens=63,
                                        completion_tokens=18),
                       Reply.chat("Sorry, I could not find population data for Atlantis.",
                                  prompt_tokens=104, completion_tokens=13))
        ran.clear()
        answer = _answer(agent.invoke({"messages": [HumanMessage(question)]}))
        c.expect(request=question, response=answer, tools=list(ran), failed=False,
                 note="input as a HumanMessage; get_population raised, "
                      "the middleware sent the error to the model")

    with h.case("model_error") as c:
        question = "What is the weather in Rome?"
        h.stub.enqueue(Reply.error(500, "boom"))
        ran.clear()
        try:
            answer = _answer(agent.invoke({"messages": [{"role": "user", "content": question}]}))
        except Exception:
            answer = None
        c.expect(request=question, response=answer, tools=list(ran), failed=True,
                 note="input as a role/content dict; the first chat model call got a 500 "
                      "(max_retries=0), the graph raised")
