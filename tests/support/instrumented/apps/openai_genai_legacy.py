"""A tool-calling agent loop written directly on the `openai` SDK, traced by the OpenTelemetry GenAI
instrumentor in its older default mode (semantic conventions v1.30): message content as one log
record (event) per message.

Framework: none — `openai` (chat.completions with `tools=`; the app runs the tools and sends their
results back until the model answers). Instrumentor: `opentelemetry-instrumentation-openai-v2`
2.3b0, the last release whose only mode is v1.30 (later releases with `opentelemetry-util-genai`
>= 1.0b0 always use the latest conventions), with `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`
and no `OTEL_SEMCONV_STABILITY_OPT_IN`: one `chat {model}` CLIENT span per chat call (model, token
usage, no content) and, in the chat span's context, one log record per input message
(`gen_ai.system.message`, `gen_ai.user.message`, `gen_ai.assistant.message`, `gen_ai.tool.message`)
and one `gen_ai.choice` per answer choice, the content in the record's body. The app's own spans
are plain OpenTelemetry ones named as the GenAI conventions say: `invoke_agent {name}` around the
request (no messages) and `execute_tool {name}` per tool run (no arguments or result).
"""

from __future__ import annotations

import json
import os

from _openai_cases import run_cases

SERVICE = "openai-genai-legacy"
PACKAGES = ("openai", "opentelemetry-instrumentation-openai-v2", "opentelemetry-semantic-conventions",
            "opentelemetry-sdk")

MODEL = "gpt-4o-mini"
TOOL_SPECS = [
    {"type": "function", "function": {"name": name, "description": text, "parameters": {
        "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    for name, text, arg in (("get_weather", "Current weather of a city.", "city"),
                            ("lookup_faq", "The FAQ entry closest to a question.", "query"))
]
FAQ = ["Umbrellas are lent at the front desk.", "Breakfast is served from 7 to 10."]

_tracer = None
_ran: list[str] = []


def instrument(tracer_provider, logger_provider) -> None:
    global _tracer
    os.environ.pop("OTEL_SEMCONV_STABILITY_OPT_IN", None)
    os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "true"
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

    OpenAIInstrumentor().instrument(tracer_provider=tracer_provider, logger_provider=logger_provider)
    _tracer = tracer_provider.get_tracer(__name__)


def _tools(client):
    def get_weather(city: str) -> str:
        if city == "Atlantis":
            raise ValueError(f"unknown city: {city}")
        return f"{city}: 18C, light rain"

    def lookup_faq(query: str) -> str:
        vectors = [d.embedding for d in client.embeddings.create(
            model="text-embedding-3-small", input=[query, *FAQ]).data]
        scores = [sum(a * b for a, b in zip(vectors[0], v, strict=True)) for v in vectors[1:]]
        return FAQ[scores.index(max(scores))]

    return {"get_weather": get_weather, "lookup_faq": lookup_faq}


def run_tool(tools, call) -> str:
    """One `execute_tool` span per tool run; a tool that raises fails its span, the agent goes on."""
    name, args = call.function.name, json.loads(call.function.arguments)
    _ran.append(name)
    attributes = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                  "gen_ai.tool.call.id": call.id, "gen_ai.tool.type": "function"}
    try:  # the span records the exception and ends ERROR, then the agent goes on
        with _tracer.start_as_current_span(f"execute_tool {name}", attributes=attributes):
            return tools[name](**args)
    except Exception as exc:
        return f"error: {exc}"


def agent(client, question: str, *, stream: bool = False) -> str:
    tools = _tools(client)
    attributes = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather-agent",
                  "gen_ai.system": "openai", "gen_ai.request.model": MODEL}
    with _tracer.start_as_current_span("invoke_agent weather-agent", attributes=attributes):
        messages = [{"role": "system", "content": "You are a helpful hotel concierge."},
                    {"role": "user", "content": question}]
        for _ in range(4):
            if stream:  # a streamed turn: no tools, the answer arrives in chunks
                chunks = client.chat.completions.create(
                    model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True})
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            resp = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOL_SPECS)
            msg = resp.choices[0].message
            if not msg.tool_calls:
                return msg.content
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(tools, call)})
        raise RuntimeError("agent did not finish")


def run(h) -> None:
    run_cases(h, agent, _ran,
              tool_error_note="the tool raised (execute_tool span ERROR); "
                              "the agent sent the error back and answered",
              model_error_note="the first chat call got HTTP 500 (max_retries=0); "
                               "the invoke_agent span failed")
