"""Google ADK (`google-adk`) `LlmAgent` with two function tools on ADK's LiteLLM model wrapper
(`google.adk.models.lite_llm.LiteLlm("openai/gpt-4o-mini", api_base=<stub>)`), run by an
`InMemoryRunner`, traced by ADK's own built-in OpenTelemetry spans (`google.adk.telemetry`).

There is no separate instrumentor: ADK's tracer comes from the global tracer provider (the harness
sets it). ADK 2's default telemetry schema is kept (`ADK_TELEMETRY_SCHEMA_VERSION_OPT_IN` unset:
GenAI-semconv-aligned spans `invoke_workflow` > `invoke_agent` > `generate_content` /
`execute_tool`, no `call_llm` span). By default ADK 2 records no message content at all, so
`instrument` sets `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY`: messages go to
`gen_ai.input.messages` / `gen_ai.output.messages` span attributes of `generate_content` and tool
arguments/results to `gen_ai.tool.call.arguments` / `gen_ai.tool.call.result` of `execute_tool` (a
truthy value would mean EVENT_ONLY: log records instead). LiteLLM reads its bundled model-cost map
(no network); no retries (`num_retries=0`). Each case runs in a new session. ADK fails the run when
a tool raises unless an `on_tool_error_callback` turns the error into the tool's result: the app
sets one.
"""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")

SERVICE = "google-adk"
PACKAGES = ("google-adk", "google-genai", "litellm", "openai", "opentelemetry-sdk", "opentelemetry-api")

RAN: list[str] = []


def get_weather(city: str) -> str:
    """Current weather for a city."""
    RAN.append("get_weather")
    return f"Sunny and 22 C in {city}."


def get_stock_price(ticker: str) -> str:
    """Latest stock price for a ticker symbol."""
    RAN.append("get_stock_price")
    raise RuntimeError(f"quote service unavailable for {ticker}")


def tool_error_as_result(tool, args, tool_context, error):
    """ADK lets a raising tool fail the run; this `on_tool_error_callback` hands the model the error
    as the tool's result instead, so the agent can recover."""
    return {"error": f"{type(error).__name__}: {error}"}


def instrument(tracer_provider, logger_provider) -> None:
    # ADK reads these when a run starts: its default schema, message content on the spans.
    for var in ("ADK_TELEMETRY_SCHEMA_VERSION_OPT_IN", "OTEL_SEMCONV_STABILITY_OPT_IN",
                "ADK_CAPTURE_MESSAGE_CONTENT_IN_SPANS"):
        os.environ.pop(var, None)
    os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "SPAN_ONLY"


async def _ask(runner, question: str) -> str | None:
    from google.genai import types

    session = await runner.session_service.create_session(app_name=runner.app_name, user_id="u1")
    answer = None
    message = types.Content(role="user", parts=[types.Part(text=question)])
    async for event in runner.run_async(user_id="u1", session_id=session.id, new_message=message):
        if event.is_final_response() and event.content and event.content.parts:
            answer = "".join(p.text or "" for p in event.content.parts)
    return answer


def run(h) -> None:
    from google.adk.agents import LlmAgent
    from google.adk.models.lite_llm import LiteLlm
    from google.adk.runners import InMemoryRunner
    from support.openai_stub import Reply

    model = LiteLlm(model="openai/gpt-4o-mini", api_base=h.base_url, api_key="sk-test-not-a-real-key",
                    num_retries=0)
    agent = LlmAgent(name="assistant", model=model, instruction="You answer briefly, using the tools.",
                     tools=[get_weather, get_stock_price], on_tool_error_callback=tool_error_as_result)
    runner = InMemoryRunner(agent=agent, app_name="tj-adk")

    def ask(c, question: str, note: str) -> None:
        RAN.clear()
        try:
            answer = asyncio.run(_ask(runner, question))
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
            "get_stock_price raises; on_tool_error_callback gives the model the error as the tool result "
            "and the model still answers")
    with h.case("model_error") as c:
        h.stub.enqueue(Reply.error(500, "boom"))
        ask(c, "What is the weather in Rome?", "the first model call answers HTTP 500 (num_retries=0)")
