"""Documents and a scripted teacher/answerer/checker for `tracejudge dataset synthesize` tests.

Every fact in the documents is a sentence "The <subject> is <value>." (or "are"/"lasts"/"costs"), so
what the endpoint should say is decidable from the prompt alone:
- asked for questions, the responder writes "What is the <subject>?" for the first N facts of the
  context (a fact whose subject holds "quoted" gives a question that repeats its whole sentence; a
  context with "MALFORMED" gets an answer that is not JSON);
- asked for an answer, it returns the context's sentence about the question's subject, or "The context
  does not say." (when the subject holds "mystery": the context never says it);
- asked to check statements (the built-in support prompt), it says "yes" for a statement that is a
  sentence of the context and "no" otherwise.
Requests are recorded by the stub; `hold_on` keeps the question request of a context containing a
marker from being answered until an event is set (to interrupt a run there).
"""

from __future__ import annotations

import re
import threading
from typing import Any

from tracejudge.metrics.judges.prompt_safety import decode

from .openai_stub import Reply, StubRequest

__all__ = ["DOCS", "section", "synthesis_responder"]

_FACT = re.compile(r"(The ([^.\n]+?) (?:is|are|lasts|costs) [^.\n]+\.)")
_SECTION = r"<{0}>\n(.*?)\n</{0}>"


def section(prompt: str, name: str) -> str | None:
    """The decoded text of the prompt's first `<name>` section."""
    m = re.search(_SECTION.format(name), prompt, re.S)
    return decode(m.group(1)) if m else None


def _facts(context: str) -> list[tuple[str, str]]:
    return [(sentence, subject) for sentence, subject in _FACT.findall(context)]


def _questions(prompt: str) -> Reply:
    context = section(prompt, "context") or ""
    if "MALFORMED" in context:
        return Reply.chat("Here are some questions: what, why and how?")
    n = int(re.search(r"holding exactly (\d+) questions", prompt).group(1))  # type: ignore[union-attr]
    out = []
    for sentence, subject in _facts(context)[:n]:
        quoted = f"Is it so that {sentence[:-1].lower()}?"
        out.append(quoted if "quoted" in subject else f"What is the {subject}?")
    return Reply.chat({"questions": out or ["What is this about?"]})


def _answer(prompt: str) -> Reply:
    context, question = section(prompt, "context") or "", section(prompt, "request") or ""
    for sentence, subject in _facts(context):
        if subject in question and "mystery" not in subject:
            return Reply.chat({"answer": sentence})
    return Reply.chat({"answer": "The context does not say."})


def _check(prompt: str) -> Reply:
    context = " ".join((section(prompt, "context") or "").split())
    statements = section(prompt, "statements") or ""
    verdicts = {}
    for line in statements.splitlines():
        m = re.match(r"\[(\d+)\]\s*(?:\| )?(.*)", line)
        if m:
            statement = m.group(2).strip()
            verdicts[int(m.group(1))] = "yes" if statement and statement in context else "no"
    return Reply.verdicts(verdicts)


def synthesis_responder(hold_on: dict[str, threading.Event] | None = None) -> Any:
    """The responder; `hold_on` maps a context marker to the event its question request waits for."""

    def respond(req: StubRequest) -> Reply:
        prompt = req.prompt
        if "<statements>" in prompt:
            return _check(prompt)
        if "holding exactly" in prompt:
            reply = _questions(prompt)
            context = section(prompt, "context") or ""
            for marker, event in (hold_on or {}).items():
                if marker in context and not event.is_set():
                    reply.hold = event
            return reply
        if 'Answer with {"answer"' in prompt:
            return _answer(prompt)
        return Reply.error(400, "unexpected prompt")

    return respond


# A small documentation folder: relative path -> text.
DOCS: dict[str, str] = {
    "refunds.md": "# Refunds\n\nThe refund window is 30 days. The refund method is the original card.\n\n"
                  "## Damaged items\n\nThe damaged item window is 60 days.\n",
    "shipping.md": "# Shipping\n\nThe standard delivery time is 5 business days.\n"
                   "The express delivery fee costs 12 euros.\n",
    "guide/warranty.txt": "The warranty of the kettle lasts 24 months. The warranty of a kettle lasts 24 "
                          "months.\n\nThe mystery discount is unknown to everyone here.\n",
    "guide/stores.md": "Stores\n======\n\nThe number of stores is 17. The quoted opening hour of every "
                       "store is eight in the morning on weekdays and ten on weekends.\n",
}
