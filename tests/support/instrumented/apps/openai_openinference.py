"""A tool-calling agent loop written directly on the `openai` SDK, traced by OpenInference.

Framework: none — `openai` (chat.completions with `tools=`; the app runs the tools and sends their
results back until the model answers). Instrumentor: `openinference-instrumentation-openai`
(`OpenAIInstrumentor`): one LLM span per chat call (`llm.input_messages.*`, `llm.output_messages.*`,
`llm.token_count.*`) and one EMBEDDING span per embeddings call. The app's own spans follow
OpenInference's manual-instrumentation docs: an `OITracer` over the harness's provider, the request
in an AGENT span (`start_as_current_span(..., openinference_span_kind="agent")` with
`set_input`/`set_output`) and each tool a TOOL span (`@tracer.tool`). No settings: OpenInference
captures content by default (`OPENINFERENCE_ENABLE_GENAI_SEMCONV` left off).
"""

from __future__ import annotations

import json

from _openai_cases import run_cases

SERVICE = "openai-openinference"
PACKAGES = ("openai", "openinference-instrumentation-openai", "openinference-instrumentation",
            "openinference-semantic-conventions", "opentelemetry-sdk")

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
    from openinference.instrumentation import OITracer, TraceConfig
    from openinference.instrumentation.openai import OpenAIInstrumentor

    OpenAIInstrumentor().instrument(tracer_provider=tracer_provider)
    _tracer = OITracer(tracer_provider.get_tracer(__name__), config=TraceConfig())


def _tools(client):
    @_tracer.tool(name="get_weather", description="Current weather of a city.")
    def get_weather(city: str) -> str:
        _ran.append("get_weather")
        if city == "Atlantis":
            raise ValueError(f"unknown city: {city}")
        return f"{city}: 18C, light rain"

    @_tracer.tool(name="lookup_faq", description="The FAQ entry closest to a question.")
    def lookup_faq(query: str) -> str:
        _ran.append("lookup_faq")
        vectors = [d.embedding for d in client.embeddings.create(
            model="text-embedding-3-small", input=[query, *FAQ]).data]
        scores = [sum(a * b for a, b in zip(vectors[0], v, strict=True)) for v in vectors[1:]]
        return FAQ[scores.index(max(scores))]

    return {"get_weather": get_weather, "lookup_faq": lookup_faq}


def agent(client, question: str, *, stream: bool = False) -> str:
    from opentelemetry.trace import Status, StatusCode

    tools = _tools(client)
    with _tracer.start_as_current_span("weather-agent", openinference_span_kind="agent") as span:
        span.set_input(question)
        messages = [{"role": "system", "content": "You are a helpful hotel concierge."},
                    {"role": "user", "content": question}]
        for _ in range(4):
            if stream:  # a streamed turn: no tools, the answer arrives in chunks
                chunks = client.chat.completions.create(
                    model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True})
                answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                span.set_output(answer)
                span.set_status(Status(StatusCode.OK))
                return answer
            resp = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOL_SPECS)
            msg = resp.choices[0].message
            if not msg.tool_calls:
                span.set_output(msg.content)
                span.set_status(Status(StatusCode.OK))
                return msg.content
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls:
                try:
                    result = tools[call.function.name](**json.loads(call.function.arguments))
                except Exception as exc:  # the model sees the error and recovers
                    result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        raise RuntimeError("agent did not finish")


def run(h) -> None:
    run_cases(h, agent, _ran,
              tool_error_note="the tool raised (TOOL span ERROR); "
                              "the agent sent the error back and answered",
              model_error_note="the first chat call got HTTP 500 (max_retries=0); "
                               "the agent span raised")
