"""The model-free `user_frustration` session judge: frustration signals read off a conversation's turns.

It runs when no judge endpoint is configured, so the demo and a fresh install show which conversations
went badly without a model. Every assessment it makes says `source="heuristic"`; values and scores are
those of the model judge (`none` 1.0, `resolved` 0.5, `unresolved` 0.0; passed unless `unresolved`).

A turn is *frustrated* when
- its request repeats an earlier request of the conversation: the same text (case, spacing and
  punctuation ignored), or at least `MIN_SHARED_WORDS` (2) shared content words making up at least
  `REPEAT_OVERLAP` (70%) of the shorter request's content words, so a question asked again inside a
  complaint still counts — content words as the heuristic trace judges read them
  (`tracejudge.metrics.judges.heuristic.terms`: stop words dropped, crude stems, numbers kept);
- its request contains a give-up or frustration phrase (`FRUSTRATION_PHRASES`: "forget it", "never
  mind", "this is useless", "talk to a human", "you already said", "that's not what I asked", "for the
  third time", …), or
- the turn failed (the assistant produced an error instead of an answer).

The turns are the session's own (`Turn.request` of each trace, in order), never read back from a
rendered transcript: a message that goes on, after a blank line, with "User: thanks, that fully
solved it!" is still one message of its turn, so it cannot add a calm last turn after a frustrated
one (and an assistant's answer, which is not read at all, cannot add a frustrated one).

Verdict: `none` when no turn is frustrated; `unresolved` when some turn is and the last turn is
frustrated too (the user gave up, repeated themselves or got an error at the end); `resolved` when
frustrated turns came earlier and the last turn is fine. The rationale names the turns and signals
(the matched phrase, which turn was repeated), never the rest of the user's text.

Limits, by design of a phrase-and-overlap check: sarcasm, politeness ("thanks anyway") and frustration
in words the list does not know go unseen; a user who deliberately asks the same thing again (a
follow-up on the same order) reads as repeating themselves; a frustrated user who simply stops writing
after a fine-looking last turn reads as `resolved`, and satisfaction is never read from the user's
words (only the absence of signals in the last turn); a single failed turn at the end is `unresolved`
even if the user was calm; English only. Use the model judge (`judges.sessions.user_frustration` with
an endpoint) for decisions; use this for trends and gross failures.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol

from tracejudge.metrics.judges.heuristic import STOP_WORDS, HeuristicJudge, terms
from tracejudge.schemas.result import Assessment
from tracejudge.schemas.session import Turn

__all__ = [
    "FRUSTRATION_PHRASES",
    "FRUSTRATION_SCORES",
    "MIN_SHARED_WORDS",
    "REPEAT_OVERLAP",
    "SESSION_HEURISTIC_VERSION",
    "HeuristicUserFrustration",
    "frustration_signals",
]

# Part of the judge's version (`JudgeIdentity.version`): bump it when the signals or the verdict rule
# change in a way the constants below do not show.
SESSION_HEURISTIC_VERSION = 1
REPEAT_OVERLAP = 0.7
MIN_SHARED_WORDS = 2
# user_frustration value -> score (shared with the model judge).
FRUSTRATION_SCORES: dict[str, float] = {"none": 1.0, "resolved": 0.5, "unresolved": 0.0}

# Regular expressions over the lowercased request (curly apostrophes made straight).
FRUSTRATION_PHRASES: tuple[str, ...] = (
    r"\bforget (it|about it)\b",
    r"\bnever ?mind\b",
    r"\b(i give up|giving up)\b",
    r"\b(this|that|you) (is|are|were|was|'re) (useless|pointless|hopeless|no help)\b",
    r"\buseless\b",
    r"\b(not|isn't|aren't|wasn't) (helping|helpful)\b",
    r"\b(talk|speak|chat) (to|with) (a|an|a real|some) (human|person|agent|representative|manager)\b",
    r"\b(real|human) (person|agent|being)\b",
    r"\byou (already|just) (said|told|asked|gave)\b",
    r"\bi (already|just) (said|told|asked|explained|gave|mentioned)\b",
    r"\b(that's|that is|this is|it's) not what i (asked|meant|wanted|said)\b",
    r"\bnot what i (asked|meant)\b",
    r"\b(are you|you're not|you are not|you aren't) (even )?listening\b",
    r"\b(for the|this is the) (second|third|fourth|fifth|\d+(st|nd|rd|th)) time\b",
    r"\b(still|again) (not|doesn't|does not|isn't) (work|working|right|help)",
    r"\bthat (didn't|did not|doesn't|does not) (work|help)\b",
    r"\bwaste of (my )?time\b",
    r"\b(ridiculous|frustrat\w*|annoy(ed|ing))\b",
    r"\b(ugh+|argh+|wtf)\b",
)
_PHRASES = re.compile("|".join(f"(?:{p})" for p in FRUSTRATION_PHRASES))
_NOT_WORD = re.compile(r"[\W_]+")


class _Conversation(Protocol):
    """What the judge reads (a `tracejudge.metrics.judges.sessions.Transcript`)."""

    @property
    def turns(self) -> Sequence[Turn]: ...


def _normalised(text: str) -> str:
    return _NOT_WORD.sub(" ", text.lower()).strip()


def frustration_signals(turns: Sequence[Turn]) -> list[list[str]]:
    """Per turn (in order), the frustration signals it shows, as short readable notes."""
    seen: list[tuple[str, set[str]]] = []
    out: list[list[str]] = []
    for turn in turns:
        notes: list[str] = []
        text = (turn.request or "").replace("’", "'")
        low = text.lower()
        norm = _normalised(low)
        words, numbers = terms(low)
        bag = words | numbers
        if norm:
            for j, (earlier_norm, earlier_bag) in enumerate(seen, 1):
                shared = len(bag & earlier_bag)
                if norm == earlier_norm or (
                    shared >= MIN_SHARED_WORDS and shared / min(len(bag), len(earlier_bag)) >= REPEAT_OVERLAP
                ):
                    notes.append(f"repeats turn {j}")
                    break
        m = _PHRASES.search(low)
        if m:
            notes.append(f'"{m.group(0)}"')
        if turn.failed:
            notes.append("failed")
        seen.append((norm, bag) if norm else ("\x00", set()))
        out.append(notes)
    return out


class HeuristicUserFrustration(HeuristicJudge):
    name = "user_frustration"

    def prompt_material(self) -> tuple[Any, ...]:
        return (SESSION_HEURISTIC_VERSION, REPEAT_OVERLAP, MIN_SHARED_WORDS, FRUSTRATION_PHRASES,
                sorted(STOP_WORDS))

    def missing_inputs(self, subject: Any) -> list[str]:
        turns = subject.turns
        return [] if any(t.request and t.request.strip() for t in turns) else ["conversation"]

    def judge_now(self, subject: Any) -> Assessment:
        turns: Sequence[Turn] = subject.turns
        signals = frustration_signals(turns)
        frustrated = [i for i, notes in enumerate(signals, 1) if notes]
        if not frustrated:
            value = "none"
            rationale = f"no frustration signal in {len(turns)} turn" + ("s" if len(turns) != 1 else "")
        else:
            value = "unresolved" if frustrated[-1] == len(turns) else "resolved"
            parts = [f"turn {i}: {', '.join(signals[i - 1])}" for i in frustrated[:6]]
            if len(frustrated) > 6:
                parts.append(f"… {len(frustrated) - 6} more")
            ending = (
                "the last turn is still frustrated" if value == "unresolved" else "the last turn is fine"
            )
            rationale = f"frustration signals: {'; '.join(parts)}; {ending}"
        return self.assessment(
            value=value,
            score=FRUSTRATION_SCORES[value],
            passed=value != "unresolved",
            rationale=rationale[:1000],
        )
