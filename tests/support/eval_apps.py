"""Apps for `tracejudge eval --app` / `--app-endpoint` tests: a tiny shop assistant over a knowledge base,
as Python functions and as an OpenAI-compatible chat endpoint (an `OpenAIStub` responder), plus a
correctness judge that decides by the facts of the expected answer.

Every question has one source document and one number in its answer, so what is right is checkable by
hand: `good_app` answers from the right document and retrieves it first; `second_rank_app` answers
right but retrieves the right document second (MRR 0.5); `broken_app` answers "I am not sure." and
retrieves an unrelated document; `mostly_good_app` is `good_app` except on `FLIPPED` (two questions it
gets wrong: noise, not a regression).
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import orjson

from .openai_stub import Reply, StubRequest

__all__ = ["DATASET", "FLIPPED", "KNOWLEDGE", "app_responder", "broken_app", "correctness_responder",
           "dataset_rows", "good_app", "mostly_good_app", "question_of"]

# (question, answer, doc_uri)
KNOWLEDGE: list[tuple[str, str, str]] = [
    ("What is the refund window?", "Refunds are accepted within 30 days of purchase.", "kb://refunds"),
    ("How long does standard shipping take?", "Standard shipping takes 5 business days.", "kb://shipping"),
    ("How many items can one order hold?", "One order holds at most 40 items.", "kb://orders"),
    ("How long is the warranty?", "The warranty lasts 24 months.", "kb://warranty"),
    ("How much does express shipping cost?", "Express shipping costs 12 euros.", "kb://express"),
    ("How many stores are there?", "There are 17 stores in the country.", "kb://stores"),
    ("When does support open?", "Support opens at 8 in the morning.", "kb://support"),
    ("How many loyalty points per euro?", "Each euro earns 3 loyalty points.", "kb://loyalty"),
    ("How long is a gift card valid?", "A gift card is valid for 36 months.", "kb://giftcards"),
    ("What is the minimum order for free delivery?", "Delivery is free from 50 euros.", "kb://delivery"),
    ("How many days to return a damaged item?", "Damaged items can be returned within 60 days.", "kb://damaged"),
    ("How many people work in support?", "Support has 85 people.", "kb://team"),
]
ANSWERS = {q: (a, uri) for q, a, uri in KNOWLEDGE}
FLIPPED = frozenset({KNOWLEDGE[3][0], KNOWLEDGE[7][0]})
UNRELATED = {"content": "Our company was founded by two friends.", "doc_uri": "kb://history"}


def dataset_rows() -> list[dict[str, Any]]:
    """One dataset row per question: the request and what is expected of the answer and the retrieval."""
    return [{"request": q, "expected_response": a,
             "expected_retrieved_context": [{"content": a, "doc_uri": uri}]} for q, a, uri in KNOWLEDGE]


DATASET = dataset_rows()


def question_of(request: Any) -> str:
    """The question in a request as the app receives it: a string, or chat messages."""
    if isinstance(request, str):
        return request
    messages = request["messages"] if isinstance(request, dict) else request
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


def _answer(question: str, *, right: bool, rank: int = 1) -> dict[str, Any]:
    answer, uri = ANSWERS.get(question, ("I only know about the shop.", "kb://none"))
    if not right:
        return {"response": "I am not sure.", "retrieved_context": [UNRELATED]}
    right_doc = {"content": answer, "doc_uri": uri}
    docs = [right_doc, UNRELATED] if rank == 1 else [UNRELATED, right_doc]
    return {"response": answer, "retrieved_context": docs}


def good_app(request: Any) -> dict[str, Any]:
    return _answer(question_of(request), right=True)


def second_rank_app(request: Any) -> dict[str, Any]:
    return _answer(question_of(request), right=True, rank=2)


def broken_app(request: Any) -> dict[str, Any]:
    return _answer(question_of(request), right=False)


def mostly_good_app(request: Any) -> dict[str, Any]:
    question = question_of(request)
    return _answer(question, right=question not in FLIPPED)


async def async_good_app(request: Any) -> dict[str, Any]:
    await asyncio.sleep(0)
    return good_app(request)


def plain_text_app(request: Any) -> str:
    return good_app(request)["response"]


def raising_app(request: Any) -> dict[str, Any]:
    """Fails on the warranty question with an exception, answers the rest."""
    if question_of(request) == KNOWLEDGE[3][0]:
        raise RuntimeError("the warranty service is down")
    return good_app(request)


# Set by a test to let the held question through; the app waits on it (a call that outlives the timeout).
RELEASE = threading.Event()


def hanging_app(request: Any) -> dict[str, Any]:
    """Never answers the refund question (until RELEASE is set), answers the rest."""
    if question_of(request) == KNOWLEDGE[0][0]:
        RELEASE.wait()
    return good_app(request)


def bad_answer_app(request: Any) -> Any:
    """Returns something that is not an answer for the shipping question."""
    if question_of(request) == KNOWLEDGE[1][0]:
        return 42
    return good_app(request)


def app_responder(app: Any, *, holds: dict[str, threading.Event] | None = None,
                  failing: dict[str, Reply] | None = None) -> Any:
    """An `OpenAIStub` responder serving `app` as a chat completions endpoint: the answer as the
    message content, the retrieved documents in the `retrieved_context` extension field. `holds` keeps
    a question's answer back until its event is set (later questions are answered first); `failing`
    answers a question with a scripted reply (an error) instead."""

    def respond(req: StubRequest) -> Reply:
        question = question_of(req.body["messages"])
        if failing and question in failing:
            return failing[question]
        out = app(req.body)
        body = {"id": "chatcmpl-app", "object": "chat.completion", "created": 0, "model": req.body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": out["response"]}}],
                "usage": {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28},
                "retrieved_context": out["retrieved_context"]}
        return Reply(body=orjson.dumps(body), hold=(holds or {}).get(question))

    return respond


_SECTION = re.compile(r"<(expected|response)>\s*(.*?)\s*</\1>", re.S)


def correctness_responder(req: StubRequest) -> Reply:
    """The judge: "yes" when every number of the expected answer is in the response, else "no"."""
    sections = dict(_SECTION.findall(req.prompt))
    expected, response = sections.get("expected", ""), sections.get("response", "")
    numbers = re.findall(r"\d+", expected)
    ok = bool(numbers) and all(re.search(rf"\b{n}\b", response) for n in numbers)
    return Reply.verdict("yes" if ok else "no", rationale="numbers " + ("match" if ok else "differ"))
