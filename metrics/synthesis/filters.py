"""The model-free filters of a synthetic dataset: near-duplicate questions and questions that quote their
answer.

Near-duplicates: two questions are near-duplicates when the Jaccard similarity of their normalised
token sets (lower case, letters and digits, a few function words left out) is at least the threshold.
`NearDuplicates` keeps the accepted questions in an inverted index by token, so a new question is
compared only with the questions sharing a token with it, not with every row so far.

Quoting: a question "quotes" its answer when the longest run of consecutive tokens they share is at
least `quote_words` long, or covers most of a short answer (a question that holds its own answer
tests nothing).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from difflib import SequenceMatcher

__all__ = ["NearDuplicates", "quotes_answer", "tokens"]

_WORD = re.compile(r"[^\W_]+", re.UNICODE)
_FUNCTION_WORDS = frozenset({
    "a", "an", "the", "of", "to", "in", "on", "at", "for", "by", "with", "and", "or", "is", "are", "was",
    "were", "be", "been", "does", "do", "did", "what", "which", "who", "whom", "whose", "when", "where",
    "why", "how", "this", "that", "these", "those", "it", "its", "as", "from"})


def tokens(text: str) -> list[str]:
    """The text's words, lower case, in order."""
    return [w.lower() for w in _WORD.findall(text)]


def _shingle(text: str) -> frozenset[str]:
    words = tokens(text)
    content = frozenset(w for w in words if w not in _FUNCTION_WORDS)
    return content or frozenset(words)


class NearDuplicates:
    """The accepted questions, by token, to find a new question's near-duplicate among them."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._sets: list[frozenset[str]] = []
        self._index: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._sets)

    def similar(self, question: str, extra: Sequence[str] = ()) -> bool:
        """True when `question` is a near-duplicate of an accepted question or of one of `extra` (the
        earlier candidates of the same chunk, not accepted yet)."""
        mine = _shingle(question)
        if not mine:
            return False
        shared: Counter[int] = Counter()
        for word in mine:
            shared.update(self._index.get(word, ()))
        for i, n in shared.items():
            if _jaccard_from(n, len(mine), len(self._sets[i])) >= self.threshold:
                return True
        return any(_jaccard(mine, _shingle(other)) >= self.threshold for other in extra)

    def add(self, question: str) -> None:
        mine = _shingle(question)
        i = len(self._sets)
        self._sets.append(mine)
        for word in mine:
            self._index.setdefault(word, []).append(i)


def _jaccard_from(shared: int, a: int, b: int) -> float:
    union = a + b - shared
    return shared / union if union else 1.0


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return _jaccard_from(len(a & b), len(a), len(b)) if a or b else 1.0


def quotes_answer(question: str, answer: str, quote_words: int) -> bool:
    """True when the question holds a run of at least `quote_words` consecutive words of the answer, or
    (an answer of 3 words or more) a run covering 80% of the answer's words."""
    q, a = tokens(question), tokens(answer)
    if not q or not a:
        return False
    match = SequenceMatcher(None, q, a, autojunk=False).find_longest_match(0, len(q), 0, len(a))
    return match.size >= quote_words or (len(a) >= 3 and match.size >= 0.8 * len(a))
