"""A tool-calling agent loop written directly on the `openai` SDK, traced by the OpenTelemetry GenAI
instrumentor with message content on its spans.

Framework: none — `openai` (chat.completions with `tools=`; the app runs the tools and sends their
results back until the model answers). Instrumentor: `opentelemetry-instrumentation-openai-v2`
(`OpenAIInstrumentor`), with `OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental` and
`OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY`: one `chat {model}` CLIENT span per
chat call with the conversation as JSON in `gen_ai.input.messages` / `gen_ai.output.messages`, one
`embeddings {model}` span per embeddings call, no log records. The app's own spans come from
`opentelemetry-util-genai`'s `TelemetryHandler`, as frameworks built on it emit them: an
`invoke_agent {name}` span around the request (agent name and model only, no messages: the request
and the answer are only in the chat spans) and an `execute_tool {name}` span per tool run.
"""

from __future__ import annotations

import json
import os

from _openai_cases import run_cases

SERVICE = "openai-genai"
PACKAGES = ("openai", "opentelemetry-instrumentation-openai-v2", "opentelemetry-util-genai",
            "opentelemetry-semantic-conventions", "opentelemetry-sdk")

MODEL = "gpt-4o-mini"
TOOL_SPECS = [
    {"type": "function", "function": {"name": name, "description": text, "parameters": {
        "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    for name, text, arg in (("get_weather", "Current weather of a city.", "city"),
                            ("lookup_faq", "The FAQ entry closest to a question.", "query"))
]
FAQ = ["Umbrellas are lent at the front desk.", "Breakfast is served from 7 to 10."]

_handler = None
_ran: list[str] = []
# Where the instrumentor writes content, and whether tools run in `execute_tool` spans: the
# log-record variant of this app (openai_genai_events.py) changes both.
CAPTURE = "SPAN_ONLY"
TOOL_SPANS = True


def instrument(tracer_provider, logger_provider) -> None:
    global _handler
    os.environ["OTEL_SEMCONV_STABILITY_OPT_IN"] = "gen_ai_latest_experimental"
    os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = CAPTURE
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
    from opentelemetry.util.genai.handler import TelemetryHandler

    OpenAIInstrumentor().instrument(tracer_provider=tracer_provider, logger_provider=logger_provider)
    _handler = TelemetryHandler(tracer_provider=tracer_provider, logger_provider=logger_provider)


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
    """One `execute_tool` span per tool run (none without TOOL_SPANS); a tool that raises fails its
    span and gives the model the error, the agent goes on."""
    name, args = call.function.name, json.loads(call.function.arguments)
    _ran.append(name)
    try:
        if not TOOL_SPANS:
            return tools[name](**args)
        with _handler.tool(name, tool_call_id=call.id, tool_type="function") as inv:
            inv.arguments = args
            inv.tool_result = tools[name](**args)
            return inv.tool_result
    except Exception as exc:
        return f"error: {exc}"


def agent(client, question: str, *, stream: bool = False) -> str:
    tools = _tools(client)
    with _handler.invoke_local_agent(agent_name="weather-agent", request_model=MODEL):
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
