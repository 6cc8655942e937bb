"""The model-free provider: `groundedness` and `relevance_to_query` by word overlap.

It runs when no judge endpoint is configured, so the demo and a fresh install show quality signals
without a model. Every assessment it makes says `source="heuristic"`.

groundedness: the response is split into statements (sentences, list items). A statement is supported
when some retrieved chunk contains all of its numbers and at least `WORD_COVERAGE` (60%) of its
content words. score = supported statements / statements with any content word or number; passes at
score >= threshold (default 0.7). Statements without content words are not counted.

relevance_to_query: score = share of the request's content words that appear in the response;
passes at score >= threshold (default 0.4).

Content words: lowercase words of three letters or more that are not English stop words, reduced by
a crude stemmer (plural and -ing/-ed endings removed, then cut to 6 letters, so "configured" and
"configuration" match). Numbers: digit runs with thousands separators removed.

Limits, by design of a word-overlap check: a paraphrase or synonym ("car" for "automobile") counts as
unsupported/irrelevant; a response that copies context words in a false combination ("the refund
takes 30 days" when the context says the *warranty* takes 30 days) counts as supported; negation is
ignored; relevance rewards repeating the question; non-English text gets no stop-word removal. Use a
model judge for real quality decisions; use this to see trends and gross failures (answers unrelated
to the retrieved context).
"""

from __future__ import annotations

import re
from typing import Any

from tracejudge.metrics.judges.base import Job, Judge, NotApplicable, clip_text, split_statements
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment

__all__ = [
    "HEURISTIC_VERSION",
    "WORD_COVERAGE",
    "HeuristicGroundedness",
    "HeuristicJudge",
    "HeuristicRelevance",
    "terms",
]

WORD_COVERAGE = 0.6
# Part of the heuristic judges' version (`JudgeIdentity.version`): bump it when the splitting, the
# stemmer or the scoring changes (the stop words and WORD_COVERAGE are in the version already).
HEURISTIC_VERSION = 1

_STOP_WORDS_TEXT = """
a about above after again against all also am an and any are aren't as at be because
been before being below between both but by can cannot could couldn't did didn't do does
doesn't doing don't down during each either else etc even ever every few for from
further get gets got had hadn't has hasn't have haven't having he her here hers herself
him himself his how however i if in into is isn't it its itself just let like may me
might more most much must my myself no nor not now of off on once one only or other our
ours ourselves out over own per please same shall she should shouldn't so some such than
that the their theirs them themselves then there these they this those through thus to
too under until up upon us use used using very via was wasn't we were weren't what when
where whether which while who whom whose why will with within without won't would
wouldn't yes yet you your yours yourself yourselves hello thanks thank sure okay ok help
know tell give want need make answer question long many kind way
"""
STOP_WORDS = frozenset(_STOP_WORDS_TEXT.split())

_WORD = re.compile(r"[a-z][a-z'’-]*[a-z]|[a-z]")
_NUM = re.compile(r"\d+(?:[.,]\d+)*")


def _stem(w: str) -> str:
    w = w.replace("’", "'")
    if w.endswith("'s"):
        w = w[:-2]
    if len(w) > 4 and w.endswith("ies"):
        w = w[:-3] + "y"
    elif len(w) > 4 and w.endswith(("ches", "shes", "sses", "xes", "zes")):
        w = w[:-2]
    elif len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
        w = w[:-1]
    if len(w) > 5 and w.endswith("ing"):
        w = w[:-3]
    elif len(w) > 4 and w.endswith("ed"):
        w = w[:-2]
    return w[:6]


def terms(text: str) -> tuple[set[str], set[str]]:
    """(content-word stems, normalised numbers) of a text."""
    low = text.lower()
    words = {_stem(w) for w in _WORD.findall(low) if len(w) >= 3 and w not in STOP_WORDS}
    numbers = set()
    for n in _NUM.findall(low):
        n = n.replace(",", "")
        if "." in n:
            n = n.rstrip("0").rstrip(".") or "0"
        numbers.add(n.lstrip("0") or "0")
    return words, numbers


class HeuristicJudge(Judge):
    """A judge answered locally and synchronously; `judge_now` is what the runner calls."""

    def __init__(self, **kw: Any):
        kw.setdefault("needs_endpoint", False)
        super().__init__(**kw)

    @property
    def source(self) -> str:
        return "heuristic"

    @property
    def provider(self) -> str:
        return "heuristic"

    def prompt_material(self) -> tuple[Any, ...]:
        return (HEURISTIC_VERSION, WORD_COVERAGE, sorted(STOP_WORDS))

    def judge_now(self, record: EvalRecord) -> Assessment:
        raise NotImplementedError

    def prepare(self, record: EvalRecord) -> Job:  # pragma: no cover - the runner calls judge_now
        raise TypeError("heuristic judges are synchronous; call judge_now")


class HeuristicGroundedness(HeuristicJudge):
    name = "groundedness"
    inputs = ("response", "retrieved_context")

    def judge_now(self, record: EvalRecord) -> Assessment:
        chunks = [terms(d.content) for d in record.retrieved_context or () if d.content and d.content.strip()]
        checked = 0
        unsupported: list[tuple[int, str]] = []
        for i, sentence in enumerate(split_statements(record.response or ""), 1):
            words, numbers = terms(sentence)
            if not words and not numbers:
                continue
            checked += 1
            if not any(_supported(words, numbers, cw, cn) for cw, cn in chunks):
                unsupported.append((i, sentence))
        if not checked:
            raise NotApplicable("the response has no content words or numbers to check")
        score = (checked - len(unsupported)) / checked
        threshold = self.threshold(0.7)
        passed = score >= threshold
        rationale = (
            f"{checked - len(unsupported)}/{checked} statements have their numbers and at least "
            f"{WORD_COVERAGE:.0%} of their content words in a retrieved chunk"
        )
        if unsupported:
            rationale += "; unsupported: " + "; ".join(f"[{i}] {clip_text(s)}" for i, s in unsupported[:5])
        return self.assessment(value=score, score=score, passed=passed, rationale=rationale,
                               threshold=threshold)


def _supported(words: set[str], numbers: set[str], chunk_words: set[str], chunk_numbers: set[str]) -> bool:
    if not numbers <= chunk_numbers:
        return False
    return not words or len(words & chunk_words) / len(words) >= WORD_COVERAGE


class HeuristicRelevance(HeuristicJudge):
    name = "relevance_to_query"
    inputs = ("request", "response")

    def judge_now(self, record: EvalRecord) -> Assessment:
        req_words, req_numbers = terms(record.request or "")
        wanted = req_words | req_numbers
        if not wanted:
            raise NotApplicable("the request has no content words")
        resp_words, resp_numbers = terms(record.response or "")
        shared = wanted & (resp_words | resp_numbers)
        score = len(shared) / len(wanted)
        threshold = self.threshold(0.4)
        passed = score >= threshold
        missing = _originals(record.request or "", wanted - shared)
        rationale = f"{len(shared)}/{len(wanted)} content words of the request appear in the response"
        if missing:
            rationale += " (missing: " + ", ".join(missing[:8]) + ")"
        return self.assessment(value=score, score=score, passed=passed, rationale=rationale,
                               threshold=threshold)


def _originals(text: str, stems: set[str]) -> list[str]:
    """The words of `text` behind `stems`, for rationales people can read."""
    out: dict[str, None] = {}
    for w in _WORD.findall(text.lower()):
        if len(w) >= 3 and w not in STOP_WORDS and _stem(w) in stems:
            out.setdefault(w)
    out.update((n, None) for n in sorted(stems) if n[:1].isdigit())
    return list(out)
