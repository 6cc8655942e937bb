"""Pydantic AI (`pydantic-ai-slim[openai]`) agent with two tools, traced by its own OpenTelemetry.

Framework: `pydantic_ai.Agent` on `OpenAIChatModel` (Chat Completions) with an `OpenAIProvider`
wrapping an `AsyncOpenAI` client pointed at the loopback stub, `max_retries=0`.

Instrumentor: Pydantic AI's native instrumentation, `Agent.instrument_all(InstrumentationSettings(
tracer_provider=..., include_content=True))` with the default data format `version` (5 in
pydantic-ai 2.x: GenAI-semconv JSON attributes `gen_ai.input.messages` / `gen_ai.output.messages` /
`gen_ai.system_instructions` on the model-request spans and `pydantic_ai.all_messages` /
`final_result` on the `invoke_agent` span; versions 2-6 all write attributes, the old event format
is gone). `PYDANTIC_AI_INSTRUMENTATION_VERSION` overrides the version (to compare formats).
Usage on the agent span is `gen_ai.aggregated_usage.*` (the default
`use_aggregated_usage_attribute_names=True`); the model-request spans carry `gen_ai.usage.*`.

A tool that raises `ModelRetry` is the idiomatic recoverable tool error: its message goes back to
the model as a retry prompt. (A tool raising any other exception aborts the run.)
"""

from __future__ import annotations

import asyncio
import os

SERVICE = "pydantic-ai"
PACKAGES = ("pydantic-ai-slim", "openai", "opentelemetry-sdk")


def instrument(tracer_provider, logger_provider) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.instrumented import InstrumentationSettings

    version = int(os.environ.get("PYDANTIC_AI_INSTRUMENTATION_VERSION", "0")) or None
    kw = {"version": version} if version else {}
    Agent.instrument_all(InstrumentationSettings(tracer_provider=tracer_provider, include_content=True, **kw))


def run(h) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, ModelRetry
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from support.openai_stub import Reply

    client = AsyncOpenAI(base_url=h.base_url, api_key="sk-test-not-a-real-key", max_retries=0)
    model = OpenAIChatModel("gpt-4o-mini", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, name="travel_agent", instructions="Answer travel questions with the tools.")

    ran: list[str] = []  # async tools: pydantic-ai runs sync ones in threads, in no fixed order

    @agent.tool_plain
    async def get_weather(city: str) -> str:
        """Current weather of a city."""
        ran.append("get_weather")
        if city == "Atlantis":
            raise ModelRetry(f"There is no weather station in {city}.")
        return f"Sunny, 21 C in {city}"

    @agent.tool_plain
    async def get_time(city: str) -> str:
        """Local time of a city."""
        ran.append("get_time")
        return f"14:05 in {city}"

    loop = asyncio.new_event_loop()  # one loop for all cases: the client's connections live on it

    def ask(question: str):
        return loop.run_until_complete(agent.run(question))

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
        c.expect(request=question, response=result.output, tools=list(ran))

    with h.case("tool_error_recovered") as c:
        ran.clear()
        question = "What is the weather in Atlantis?"
        h.stub.enqueue(
            Reply.tool_calls(("get_weather", {"city": "Atlantis"}), prompt_tokens=44, completion_tokens=9),
            Reply.chat("Sorry, I could not get the weather for Atlantis.",
                       prompt_tokens=70, completion_tokens=12),
        )
        result = ask(question)
        c.expect(request=question, response=result.output, tools=list(ran),
                 note="the tool raised ModelRetry; its message went back to the model as a "
                      "retry-prompt and the agent still answered")

    with h.case("model_error") as c:
        ran.clear()
        question = "What time is it in Tokyo?"
        h.stub.enqueue(Reply.error(500, "boom"))
        try:
            ask(question)
        except Exception as exc:  # pydantic_ai.exceptions.ModelHTTPError
            c.expect(request=question, response=None, tools=list(ran), failed=True,
                     note=f"agent.run raised {type(exc).__name__}")
        else:
            raise AssertionError("the run should have raised")
    loop.close()
