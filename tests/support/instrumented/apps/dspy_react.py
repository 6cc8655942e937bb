"""DSPy (`dspy`) `dspy.ReAct` agent with two tools, traced by OpenInference's DSPy instrumentor
(`openinference-instrumentation-dspy`, `DSPyInstrumentor`).

The LM is `dspy.LM("openai/gpt-4o-mini", api_base=<stub>, num_retries=0, cache=False)` with DSPy's
default engine (in DSPy 3.4 that is its native lm15 engine, not LiteLLM: LiteLLM is not even
imported, so an OpenInference LiteLLM instrumentor would see nothing); DSPy's caches are off. The
stub answers in DSPy's ChatAdapter format (`[[ ## field ## ]]` sections ending with
`[[ ## completed ## ]]`; a JSON object if DSPy falls back to its JSONAdapter): each ReAct step calls a
tool or ReAct's internal `finish`, then ReAct's extract step (a ChainOfThought) gives the answer.
The instrumentor traces `Module.__call__` (ReAct), `Predict.forward`, `Adapter.__call__`,
`LM.__call__` and `Tool.__call__` (span `<tool name>.__call__`, `finish` included). It records no
token counts. Instrumentor settings: `TraceConfig(hide_input_messages=True,
hide_llm_invocation_parameters=True)` keeps the fixture under 200 KB (the LM span's `input.value`
still holds the same messages; the invocation parameters hold the stub's random port).
"""

from __future__ import annotations

import json
import os
import re

# In case anything loads LiteLLM: its bundled model-cost map, no telemetry.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")

SERVICE = "dspy-react"
PACKAGES = ("dspy", "openinference-instrumentation-dspy", "openinference-instrumentation",
            "opentelemetry-sdk")

RAN: list[str] = []


def weather(city: str) -> str:
    """Weather in a city."""
    RAN.append("weather")
    return f"Sunny and 22 C in {city}."


def stock_price(ticker: str) -> str:
    """Stock price of a ticker."""
    RAN.append("stock_price")
    raise RuntimeError(f"no quote for {ticker}")


def _fields(**fields: str) -> str:
    return "".join(f"[[ ## {k} ## ]]\n{v}\n\n" for k, v in fields.items()) + "[[ ## completed ## ]]"


def responder(req):
    from support.openai_stub import Reply, default_responder

    if not req.path.endswith("/chat/completions"):
        return default_responder(req)
    msgs = req.body.get("messages", [])
    system, user = str(msgs[0].get("content", "")), str(msgs[-1].get("content", ""))
    as_json = "JSON object" in system or req.response_format != "none"
    question = (re.findall(r"\[\[ ## question ## \]\]\n(.+)", user) or [""])[0]
    if "next_tool_name" in system:  # a ReAct step: call the tool the question needs once, then finish
        if "observation_0" in user:
            out = {"next_thought": "Done.", "next_tool_name": "finish", "next_tool_args": {}}
        elif "Stock" in question:
            out = {"next_thought": "Check it.", "next_tool_name": "stock_price",
                   "next_tool_args": {"ticker": "ACME"}}
        else:
            city = (re.findall(r"[Ww]eather in (\w+)", question) or ["Paris"])[0]
            out = {"next_thought": "Check it.", "next_tool_name": "weather",
                   "next_tool_args": {"city": city}}
        tokens = (120, 20)
    else:  # the extract step: answer from the trajectory
        if "Execution error" in user:
            answer = "No quote for ACME is available right now."
        else:
            answer = "It is sunny and 22 C in Paris."
        out = {"reasoning": "From the observation.", "answer": answer}
        tokens = (150, 25)
    if as_json:
        return Reply.chat(json.dumps(out), prompt_tokens=tokens[0], completion_tokens=tokens[1])
    text = _fields(**{k: json.dumps(v) if isinstance(v, dict) else v for k, v in out.items()})
    return Reply.chat(text, prompt_tokens=tokens[0], completion_tokens=tokens[1])


def instrument(tracer_provider, logger_provider) -> None:
    from openinference.instrumentation import TraceConfig
    from openinference.instrumentation.dspy import DSPyInstrumentor

    config = TraceConfig(hide_input_messages=True, hide_llm_invocation_parameters=True)
    DSPyInstrumentor().instrument(tracer_provider=tracer_provider, config=config)


def run(h) -> None:
    import dspy
    from support.openai_stub import Reply

    dspy.configure_cache(enable_disk_cache=False, enable_memory_cache=False)
    lm = dspy.LM("openai/gpt-4o-mini", api_base=h.base_url, api_key="sk-test-not-a-real-key",
                 num_retries=0, cache=False)
    dspy.configure(lm=lm)
    agent = dspy.ReAct("question -> answer", tools=[weather, stock_price], max_iters=4)
    h.stub.responder = responder

    def ask(c, question: str, note: str, **kw) -> None:
        RAN.clear()
        try:
            answer = agent(question=question, **kw).answer
        except Exception as exc:  # the request failed as the user saw it
            c.expect(request=question, response=None, tools=list(RAN), failed=True,
                     note=f"{note} ({type(exc).__name__})")
            return
        c.expect(request=question, response=answer, tools=list(RAN), note=note)

    with h.case("tool_then_answer") as c:
        ask(c, "Weather in Paris?", "weather, then finish, then the extract step")
    with h.case("tool_error_recovered") as c:
        ask(c, "Stock price of ACME?", "stock_price raises; ReAct records the error as "
            "the observation; max_iters=1 so no finish step; the extract step still answers", max_iters=1)
    with h.case("model_error") as c:
        h.stub.enqueue(Reply.error(500, "boom"))
        ask(c, "Weather in Rome?", "the first model call answers HTTP 500 (no retries)")
