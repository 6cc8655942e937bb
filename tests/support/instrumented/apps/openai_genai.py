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


def instrument(tracer_provider, logger_provider) -> None:
    global _handler
    os.environ["OTEL_SEMCONV_STABILITY_OPT_IN"] = "gen_ai_latest_experimental"
    os.environ["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] = "SPAN_ONLY"
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
    """One `execute_tool` span per tool run; a tool that raises fails its span, the agent goes on."""
    name, args = call.function.name, json.loads(call.function.arguments)
    _ran.append(name)
    try:
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


def script(h, *replies) -> None:
    """Answer chat calls with `replies` in order; embeddings with the stub's default vectors."""
    from collections import deque

    from support.openai_stub import default_responder

    queue = deque(replies)
    h.stub.responder = lambda req: (default_responder(req) if req.path.endswith("/embeddings")
                                    else queue.popleft())


def run(h) -> None:
    import openai
    from support.openai_stub import Reply

    client = openai.OpenAI(base_url=h.base_url, api_key="sk-test-fake", max_retries=0)

    with h.case("tools") as c:
        _ran.clear()
        question = "What's the weather in Paris, and can I borrow an umbrella?"
        script(h, Reply.tool_calls(("get_weather", {"city": "Paris"}),
                                   ("lookup_faq", {"query": "borrow umbrella"}),
                                   prompt_tokens=61, completion_tokens=23),
               Reply.chat("Paris is 18C with light rain; umbrellas are lent at the front desk.",
                          prompt_tokens=118, completion_tokens=17))
        answer = agent(client, question)
        c.expect(request=question, response=answer, tools=list(_ran),
                 note="two tool calls in one model turn; lookup_faq makes an embeddings call")

    with h.case("tool_error") as c:
        _ran.clear()
        question = "What's the weather in Atlantis?"
        script(h, Reply.tool_calls(("get_weather", {"city": "Atlantis"}), prompt_tokens=52),
               Reply.chat("I could not find a city called Atlantis.", prompt_tokens=80))
        answer = agent(client, question)
        c.expect(request=question, response=answer, tools=list(_ran),
                 note="the tool raised (execute_tool span ERROR); the agent sent the error back and answered")

    with h.case("stream") as c:
        _ran.clear()
        question = "When is breakfast?"
        script(h, Reply.chat("Breakfast is served from 7 to 10.", prompt_tokens=33, completion_tokens=9))
        answer = agent(client, question, stream=True)
        c.expect(request=question, response=answer, tools=[], note="streamed chat completion, no tools")

    with h.case("model_error") as c:
        _ran.clear()
        question = "What's the weather in Rome?"
        script(h, Reply.error(500, "upstream exploded"))
        try:
            answer = agent(client, question)
        except openai.InternalServerError:
            answer = None
        c.expect(request=question, response=answer, tools=list(_ran), failed=True,
                 note="the first chat call got HTTP 500 (max_retries=0); the invoke_agent span failed")
