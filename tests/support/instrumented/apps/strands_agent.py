"""Strands Agents (`strands-agents`) agent with two `@tool`s on Strands' OpenAI model provider
(`strands.models.openai.OpenAIModel`, streaming chat completions), traced by Strands' own native
OpenTelemetry GenAI instrumentation (`strands.telemetry`).

There is no separate instrumentor: Strands' tracer takes the global tracer provider (the harness sets
it) when the first agent is built, so `instrument` only fixes the telemetry mode. The app uses
Strands' DEFAULT mode: `OTEL_SEMCONV_STABILITY_OPT_IN` unset, so message content goes to span
events (`gen_ai.user.message`, `gen_ai.assistant.message`, `gen_ai.tool.message`, `gen_ai.choice`)
and not to span attributes; `gen_ai_latest_experimental` would switch to one
`gen_ai.client.inference.operation.details` event holding `gen_ai.input.messages` /
`gen_ai.output.messages`. Each case builds a fresh agent, so no conversation carries over.
"""

from __future__ import annotations

import os

SERVICE = "strands-agent"
PACKAGES = ("strands-agents", "openai", "opentelemetry-sdk", "opentelemetry-api")

RAN: list[str] = []


def instrument(tracer_provider, logger_provider) -> None:
    # The default (legacy event) mode: no opt-in tokens.
    os.environ.pop("OTEL_SEMCONV_STABILITY_OPT_IN", None)


def _tools():
    from strands import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather for a city.

        Args:
            city: The city name.
        """
        RAN.append("get_weather")
        return f"Sunny and 22 C in {city}."

    @tool
    def get_stock_price(ticker: str) -> str:
        """Latest stock price for a ticker symbol.

        Args:
            ticker: The ticker symbol.
        """
        RAN.append("get_stock_price")
        raise RuntimeError(f"quote service unavailable for {ticker}")

    return [get_weather, get_stock_price]


def run(h) -> None:
    from strands import Agent
    from strands.models.openai import OpenAIModel
    from support.openai_stub import Reply

    model = OpenAIModel(
        client_args={"base_url": h.base_url, "api_key": "sk-test-not-a-real-key", "max_retries": 0},
        model_id="gpt-4o-mini",
    )
    tools = _tools()

    def ask(c, question: str, note: str) -> None:
        RAN.clear()
        agent = Agent(model=model, tools=tools, callback_handler=None,
                      system_prompt="You answer briefly, using the tools.")
        try:
            answer = str(agent(question)).strip()
        except Exception as exc:  # the request failed as the user saw it
            c.expect(request=question, response=None, tools=list(RAN), failed=True,
                     note=f"{note} ({type(exc).__name__})")
            return
        c.expect(request=question, response=answer, tools=list(RAN), note=note)

    with h.case("tool_then_answer") as c:
        h.stub.enqueue(Reply.tool_calls(("get_weather", {"city": "Paris"}), prompt_tokens=90),
                       Reply.chat("It is sunny and 22 C in Paris.", prompt_tokens=130,
                                  completion_tokens=12))
        ask(c, "What is the weather in Paris?", "get_weather, then the final answer")
    with h.case("tool_error_recovered") as c:
        h.stub.enqueue(Reply.tool_calls(("get_stock_price", {"ticker": "ACME"}), prompt_tokens=95),
                       Reply.chat("The quote service is unavailable right now.", prompt_tokens=160,
                                  completion_tokens=11))
        ask(c, "What is the stock price of ACME?",
            "get_stock_price raises; Strands returns an error tool result and the model still answers")
    with h.case("model_error") as c:
        h.stub.enqueue(Reply.error(500, "boom"))
        ask(c, "What is the weather in Rome?", "the first model call answers HTTP 500 (max_retries=0)")
