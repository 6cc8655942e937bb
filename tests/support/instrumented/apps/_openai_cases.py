"""What the apps on the `openai` SDK share: the stub's script, and the four cases of a small
tool-calling agent loop (`tools`: two tool calls, then the answer; `tool_error`: the tool raises and
the agent answers; `stream`: a streamed answer; `model_error`: the first chat call gets HTTP 500).
Each app brings its own instrumentation and agent loop; the cases and their expectations are these."""

from __future__ import annotations


def script(h, *replies) -> None:
    """Answer chat calls with `replies` in order; embeddings with the stub's default vectors."""
    from collections import deque

    from support.openai_stub import default_responder

    queue = deque(replies)
    h.stub.responder = lambda req: (default_responder(req) if req.path.endswith("/embeddings")
                                    else queue.popleft())


def run_cases(h, agent, ran: list[str], *, tool_error_note: str, model_error_note: str) -> None:
    """The four cases, for an `agent(client, question, stream=False)` that appends every tool it runs
    to `ran`."""
    import openai
    from support.openai_stub import Reply

    client = openai.OpenAI(base_url=h.base_url, api_key="sk-test-fake", max_retries=0)

    with h.case("tools") as c:
        ran.clear()
        question = "What's the weather in Paris, and can I borrow an umbrella?"
        script(h, Reply.tool_calls(("get_weather", {"city": "Paris"}),
                                   ("lookup_faq", {"query": "borrow umbrella"}),
                                   prompt_tokens=61, completion_tokens=23),
               Reply.chat("Paris is 18C with light rain; umbrellas are lent at the front desk.",
                          prompt_tokens=118, completion_tokens=17))
        answer = agent(client, question)
        c.expect(request=question, response=answer, tools=list(ran),
                 note="two tool calls in one model turn; lookup_faq makes an embeddings call")

    with h.case("tool_error") as c:
        ran.clear()
        question = "What's the weather in Atlantis?"
        script(h, Reply.tool_calls(("get_weather", {"city": "Atlantis"}), prompt_tokens=52),
               Reply.chat("I could not find a city called Atlantis.", prompt_tokens=80))
        answer = agent(client, question)
        c.expect(request=question, response=answer, tools=list(ran),
                 note=tool_error_note)

    with h.case("stream") as c:
        ran.clear()
        question = "When is breakfast?"
        script(h, Reply.chat("Breakfast is served from 7 to 10.", prompt_tokens=33, completion_tokens=9))
        answer = agent(client, question, stream=True)
        c.expect(request=question, response=answer, tools=[], note="streamed chat completion, no tools")

    with h.case("model_error") as c:
        ran.clear()
        question = "What's the weather in Rome?"
        script(h, Reply.error(500, "upstream exploded"))
        try:
            answer = agent(client, question)
        except openai.InternalServerError:
            answer = None
        c.expect(request=question, response=answer, tools=list(ran), failed=True,
                 note=model_error_note)
