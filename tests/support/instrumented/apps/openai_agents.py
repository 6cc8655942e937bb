"""OpenAI Agents SDK (`openai-agents`) agent with two function tools, traced by OpenInference.

Framework: `agents.Agent` + `Runner.run`, on the Chat Completions API (`set_default_openai_api(
"chat_completions")`) through an `AsyncOpenAI` client pointed at the loopback stub (max_retries=0;
the SDK's own runner-managed model retries are opt-in and left off).

Instrumentor: `openinference-instrumentation-openai-agents` (`OpenAIAgentsInstrumentor`). It is a
`TracingProcessor` of the SDK's own tracing, turning the SDK's trace/spans into OTel spans; with the
default `exclusive_processor=True` it REPLACES the SDK's processors, so the SDK's exporter to
api.openai.com is gone. (`set_tracing_disabled(True)` would switch off the SDK tracing the
instrumentor is built on, so it is not used; the client is also not used for trace export.)
Content capture is on by default (OpenInference `TraceConfig`).
"""

from __future__ import annotations

import asyncio

SERVICE = "openai-agents"
PACKAGES = ("openai-agents", "openinference-instrumentation-openai-agents", "openai",
            "openinference-instrumentation", "openinference-semantic-conventions",
            "opentelemetry-sdk")


def instrument(tracer_provider, logger_provider) -> None:
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    OpenAIAgentsInstrumentor().instrument(tracer_provider=tracer_provider)


def run(h) -> None:
    from agents import Agent, Runner, function_tool, set_default_openai_api, set_default_openai_client
    from openai import AsyncOpenAI
    from support.openai_stub import Reply

    set_default_openai_client(AsyncOpenAI(base_url=h.base_url, api_key="sk-test-not-a-real-key",
                                          max_retries=0), use_for_tracing=False)
    set_default_openai_api("chat_completions")

    ran: list[str] = []  # async tools: the SDK runs sync ones in threads, in no fixed order

    @function_tool
    async def get_weather(city: str) -> str:
        """Current weather of a city."""
        ran.append("get_weather")
        if city == "Atlantis":
            raise ValueError(f"no weather station in {city}")
        return f"Sunny, 21 C in {city}"

    @function_tool
    async def get_time(city: str) -> str:
        """Local time of a city."""
        ran.append("get_time")
        return f"14:05 in {city}"

    agent = Agent(name="Travel assistant", instructions="Answer travel questions with the tools.",
                  model="gpt-4o-mini", tools=[get_weather, get_time])

    loop = asyncio.new_event_loop()  # one loop for all cases: the client's connections live on it

    def ask(question: str):
        return loop.run_until_complete(Runner.run(agent, question))

    with h.case("tool_then_answer") as c:
        ran.clear()
        question = "What is the weather and the time in Paris?"
        h.stub.enqueue(
            Reply.tool_calls(("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"}),
                             prompt_tokens=52, completion_tokens=18),
            Reply.chat("It is sunny and 21 C in Paris, and the time is 14:05.",
                       prompt_tokens=95, completion_tokens=16),
        )
        result = ask(question)
        c.expect(request=question, response=result.final_output, tools=list(ran))

    with h.case("tool_error_recovered") as c:
        ran.clear()
        question = "What is the weather in Atlantis?"
        h.stub.enqueue(
            Reply.tool_calls(("get_weather", {"city": "Atlantis"}), prompt_tokens=44, completion_tokens=9),
            Reply.chat("Sorry, I could not get the weather for Atlantis.",
                       prompt_tokens=70, completion_tokens=12),
        )
        result = ask(question)
        c.expect(request=question, response=result.final_output, tools=list(ran),
                 note="the tool raised; the SDK's default failure_error_function gave the model an "
                      "error string and the agent still answered")

    with h.case("model_error") as c:
        ran.clear()
        question = "What time is it in Tokyo?"
        h.stub.enqueue(Reply.error(500, "boom"))
        try:
            ask(question)
        except Exception as exc:  # openai.InternalServerError
            c.expect(request=question, response=None, tools=list(ran), failed=True,
                     note=f"Runner.run raised {type(exc).__name__}")
        else:
            raise AssertionError("the run should have raised")
    loop.close()
