"""The shop assistant of tests/support/eval_apps.py before and after a fix, for the whole-loop test
(tests/test_regression_loop.py): in production some questions were answered from a stale page of the
knowledge base (an old policy with other numbers); the fix reindexed it.

- `STALE`: question -> the stale answer, for the questions whose source page was stale.
- `stale_app` is the app as it was (it reproduces the failure: the stale answer and the stale page for
  those questions, the right answer for the rest); the fixed app is `eval_apps.good_app`.
- `stale_judge_responder`: the production judge (groundedness): "no" when the judged response holds a
  stale answer, "yes" otherwise — a verdict decided by the content it is shown.
"""

from __future__ import annotations

import re
from typing import Any

from .eval_apps import ANSWERS, KNOWLEDGE, good_app, question_of
from .openai_stub import Reply, StubRequest

__all__ = ["STALE", "fixed_app", "stale_app", "stale_judge_responder"]

# Four questions whose page was stale: the same sentences with the old numbers.
STALE: dict[str, str] = {
    KNOWLEDGE[0][0]: "Refunds are accepted within 14 days of purchase.",
    KNOWLEDGE[2][0]: "One order holds at most 25 items.",
    KNOWLEDGE[5][0]: "There are 11 stores in the country.",
    KNOWLEDGE[9][0]: "Delivery is free from 75 euros.",
}
STALE_PAGE_URI = "kb://archive/policies-2019"


def stale_app(request: Any) -> dict[str, Any]:
    """The app before the fix: a stale question is answered from the stale page."""
    question = question_of(request)
    if question in STALE:
        return {"response": STALE[question],
                "retrieved_context": [{"content": STALE[question], "doc_uri": STALE_PAGE_URI}]}
    return good_app(request)


def fixed_app(request: Any) -> dict[str, Any]:
    """The app after the fix: every question answered from its current page."""
    return good_app(request)


def production_answer(question: str, *, stale: bool) -> str:
    """What the app in production answered: the stale answer when the stale page was hit."""
    return STALE[question] if stale else ANSWERS[question][0]


_STATEMENTS = re.compile(r"<statements>\n(.*?)\n</statements>", re.S)
_STATEMENT = re.compile(r"^\[(\d+)\] (.*)$")


def stale_judge_responder(req: StubRequest) -> Reply:
    """Groundedness as the production judge saw it: each statement of the response is judged, and a
    statement of the stale page ("no") is not supported; any other is ("yes")."""
    found = _STATEMENTS.search(req.prompt)
    assert found, "a groundedness prompt has a <statements> section"
    verdicts: dict[int, str] = {}
    for line in found.group(1).splitlines():
        numbered = _STATEMENT.match(line)
        if numbered:
            stale = any(numbered.group(2).strip() in text for text in STALE.values())
            verdicts[int(numbered.group(1))] = "no" if stale else "yes"
    stale_any = "no" in verdicts.values()
    return Reply.verdicts(verdicts, rationale="an outdated policy" if stale_any else "supported")
