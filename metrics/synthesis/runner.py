"""`SynthesisRunner`: questions, reference answers and the answerability check for one chunk at a time,
on the judges' machinery.

It is a `JudgeRunner` whose configured judges are the two generation steps (`prompts`) and the check
(the built-in `context_sufficiency` or `groundedness` judge), all on one endpoint; a subject is a `Step`
(which of the three, on which record), so every call goes through the runner as a judgement does:
the endpoint's request/token budget reserved first, its spend caps, its circuit breaker, redaction of
every message at egress, usage and cost on each assessment. Nothing is sampled: every step runs.

For one chunk (`synthesize`):
1. N questions (a malformed answer is asked again once; a second is counted `malformed`, no rows);
2. near-duplicates of an accepted question or of an earlier question of the chunk are dropped;
3. a reference answer per question from the chunk alone (malformed twice: dropped, `malformed`);
4. a question that quotes its answer is dropped (`quotes_answer`);
5. the check judge, with the chunk as context and the answer as the expected response, keeps only the
   questions the chunk answers (`unanswerable` otherwise).
A call the endpoint failed (HTTP errors after the client's retries, a timeout) fails the chunk
(`ChunkFailed`): it has no outcome, so a later run does it again. A "budget" skip waits while the
request/token budget refills (up to `budget_wait_seconds`); when it does not refill, or the spend cap
refused, and when the circuit is open, the run stops (`Stopped`) with the chunks done so far.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from tracejudge.metrics.judges.base import Judge
from tracejudge.metrics.judges.config import CustomJudgeConfig, JudgesConfig, JudgeSettings
from tracejudge.metrics.judges.planning import Configured, Plan
from tracejudge.metrics.judges.registry import BUILTIN_FACTORIES
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.sampling import TraceFilter
from tracejudge.metrics.synthesis.chunks import Chunk
from tracejudge.metrics.synthesis.filters import NearDuplicates, quotes_answer
from tracejudge.metrics.synthesis.prompts import QuestionWriter, ReferenceAnswerer
from tracejudge.schemas.errors import JudgeConfigError
from tracejudge.schemas.record import Document, EvalRecord
from tracejudge.schemas.result import Assessment

__all__ = [
    "CHECKS",
    "ChunkFailed",
    "ChunkOutcome",
    "Step",
    "Stopped",
    "SynthesisRunner",
    "SynthesisSettings",
    "Tally",
]

CHECKS = ("context_sufficiency", "groundedness")
QUESTIONS, ANSWER = QuestionWriter.name, ReferenceAnswerer.name
_ANSWER_ERRORS = ("unparseable", "invalid_answer")


@dataclass(frozen=True)
class SynthesisSettings:
    questions_per_chunk: int = 3
    check: str = "context_sufficiency"
    near_duplicate_threshold: float = 0.8
    quote_words: int = 8
    budget_wait_seconds: float = 120.0
    # The `judges.endpoints` name; None: the section's default endpoint.
    endpoint: str | None = None


@dataclass(frozen=True)
class Step:
    """One step of one chunk: the configured judge's name and the record it runs on."""

    judge: str
    record: EvalRecord


class Stopped(Exception):
    """The run cannot go on (spend cap, budget, open circuit): stop with what is done."""


class ChunkFailed(Exception):
    """A call of this chunk failed at the endpoint: the chunk has no outcome and is done again later."""


@dataclass
class Tally:
    """What calls used: judgements made, reported tokens and their price (None: some were unpriced)."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = 0.0

    def add(self, a: Assessment) -> None:
        if a.skipped is not None:
            return
        self.calls += 1
        self.input_tokens += a.input_tokens or 0
        self.output_tokens += a.output_tokens or 0
        if a.cost_usd is None:
            self.cost_usd = None
        elif self.cost_usd is not None:
            self.cost_usd = round(self.cost_usd + a.cost_usd, 9)

    def merge(self, other: Mapping[str, Any]) -> None:
        self.calls += int(other.get("calls") or 0)
        self.input_tokens += int(other.get("input_tokens") or 0)
        self.output_tokens += int(other.get("output_tokens") or 0)
        cost = other.get("cost_usd")
        self.cost_usd = None if cost is None or self.cost_usd is None else round(self.cost_usd + cost, 9)

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "cost_usd": self.cost_usd}


@dataclass
class ChunkOutcome:
    rows: list[dict[str, Any]] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    tally: Tally = field(default_factory=Tally)


class SynthesisRunner(JudgeRunner):
    """The generation steps and the check on one endpoint; see the module docstring."""

    def __init__(self, config: JudgesConfig, settings: SynthesisSettings, *,
                 env: Mapping[str, str] | None = None, registry: CollectorRegistry | None = None):
        self.synthesis = settings
        super().__init__(config.for_offline(), registry=registry, env=env)
        self.steps = {c.name: c for c in self._judges}
        self.spent = Tally()
        # Steps refused for budget and judged again once the request/token budget had refilled.
        self.budget_waits = 0
        self._wait = threading.Event()

    # ------------------------------------------------------------------------ the JudgeRunner hooks
    def _configure_all(self, env: Mapping[str, str] | None) -> list[Configured]:
        cfg, s = self.config, self.synthesis
        name = s.endpoint or cfg.default_endpoint_name
        if name is None or name not in cfg.endpoints:
            known = ", ".join(sorted(cfg.endpoints)) or "none"
            raise JudgeConfigError("judges.endpoints", f"no endpoint {name or '(default)'} to synthesize "
                                   f"with (defined: {known}); add one or name it with --endpoint")
        client = self._client(name, env)
        judges: list[Judge] = [
            QuestionWriter(endpoint=client.config, endpoint_name=name,
                           questions_per_chunk=s.questions_per_chunk),
            ReferenceAnswerer(endpoint=client.config, endpoint_name=name),
            BUILTIN_FACTORIES[s.check](settings=self._check_settings(), endpoint=client.config,
                                       endpoint_name=name),
        ]
        for judge in judges:
            judge.identity  # noqa: B018 - computed once, here
        return [Configured(j, 1.0, TraceFilter(), client, None, self.budgets[name]) for j in judges]

    def _check_settings(self) -> JudgeSettings:
        """The check judge's configured settings (threshold, ...) when it is configured as a model judge,
        on the synthesis endpoint; else the defaults."""
        check = self.synthesis.check
        settings = self.config.judge_settings().get(check)
        if settings is None or isinstance(settings, CustomJudgeConfig) or (
                self.config.provider_of(check, settings) == "heuristic"):
            return JudgeSettings()
        return settings.model_copy(update={"endpoint": None, "sample_rate": None})

    def _plan(self, subject: Step) -> Plan:  # type: ignore[override]
        return Plan(subject.record, self.metrics.app_label(None), [self.steps[subject.judge]])

    def _observe_verdict(self, plan: Plan, cj: Configured, a: Assessment) -> None:
        """Not an app's quality: no verdict series."""

    # ------------------------------------------------------------------------------ identity
    @property
    def endpoint(self) -> str:
        client = self.steps[QUESTIONS].client
        assert client is not None
        return client.name

    def versions(self) -> dict[str, str]:
        """Each step's judge version (its prompts, schema, model, temperature): what made the rows."""
        return {name: c.judge.identity.version for name, c in self.steps.items()}

    # ------------------------------------------------------------------------------ one chunk
    def synthesize(self, chunk: Chunk, accepted: NearDuplicates) -> ChunkOutcome:
        """The rows of one chunk and what was dropped; `accepted` is read, never changed (the caller adds
        the rows once the chunk's outcome is kept). Raises `ChunkFailed` or `Stopped`."""
        out = ChunkOutcome()
        doc = Document(chunk.content, chunk.doc_uri)
        base = EvalRecord(request_id=f"synth-{chunk.key}", retrieved_context=[doc])
        asked = self._run([Step(QUESTIONS, base)], out)[0]
        if asked is None:
            return out
        questions: list[str] = []
        for q in asked.value:
            if accepted.similar(q, questions):
                out.dropped["near_duplicate"] += 1
            else:
                questions.append(q)
        records = [EvalRecord(request_id=_row_id(chunk, q), request=q, retrieved_context=[doc])
                   for q in questions]
        answers = self._run([Step(ANSWER, r) for r in records], out)
        pairs = []
        for q, a in zip(questions, answers, strict=True):
            if a is None:
                continue
            if quotes_answer(q, a.value, self.synthesis.quote_words):
                out.dropped["quotes_answer"] += 1
                continue
            pairs.append((q, a.value))
        checks = [EvalRecord(request_id=_row_id(chunk, q), request=q, response=ans, expected_response=ans,
                             retrieved_context=[doc]) for q, ans in pairs]
        verdicts = self._run([Step(self.synthesis.check, r) for r in checks], out)
        for (q, ans), v in zip(pairs, verdicts, strict=True):
            if v is None:
                continue
            if v.passed is not True:
                out.dropped["unanswerable"] += 1
                continue
            out.rows.append({"request_id": _row_id(chunk, q), "request": q, "expected_response": ans,
                             "expected_retrieved_context": [chunk.document()]})
        return out

    def _run(self, steps: Sequence[Step], out: ChunkOutcome) -> list[Assessment | None]:
        """Each step's assessment in order (None: dropped and counted in `out`)."""
        window = self.steps[QUESTIONS].client.config.max_concurrency  # type: ignore[union-attr]
        # All of them first: a step refused for budget while the others held reservations is judged again
        # alone, so a refusal that stops the run is the cap's, not the concurrency's.
        first = [got[0] for got in self.judge_many(steps, window=window)]  # type: ignore[arg-type]
        results: list[Assessment | None] = []
        for step, got in zip(steps, first, strict=True):
            a = self._settled(step, got, out)
            if a.error is not None and a.error.startswith(_ANSWER_ERRORS):  # asked once more
                a = self._settled(step, self.judge_sync(step)[0], out)  # type: ignore[arg-type]
            results.append(self._kept(a, out))
        return results

    def _settled(self, step: Step, a: Assessment, out: ChunkOutcome) -> Assessment:
        """`a`, or once the request/token budget has refilled, the step judged again (see `Stopped`)."""
        deadline = time.monotonic() + self.synthesis.budget_wait_seconds
        delay = 0.05
        while a.skipped == "budget":
            if not self._rate_limited():
                raise Stopped(f"the spend cap of endpoint {self.endpoint!r} (usd_per_hour/usd_per_day) has "
                              "no room left")
            if time.monotonic() > deadline:
                raise Stopped(f"the request/token budget of endpoint {self.endpoint!r} left no room for "
                              f"{self.synthesis.budget_wait_seconds:g}s")
            self.budget_waits += 1
            self._wait.wait(delay)  # the bucket refills continuously: a short wait, then ask again
            delay = min(1.0, delay * 2)
            a = self.judge_sync(step)[0]  # type: ignore[arg-type]
        if a.skipped == "circuit_open":
            raise Stopped(f"endpoint {self.endpoint!r} is failing: its circuit breaker is open")
        out.tally.add(a)
        self.spent.add(a)
        return a

    def _rate_limited(self) -> bool:
        budget = self.budgets[self.endpoint]
        return any(b is not None and b.level < b.capacity for b in (budget.requests, budget.tokens))

    @staticmethod
    def _kept(a: Assessment, out: ChunkOutcome) -> Assessment | None:
        if a.skipped is not None:
            out.dropped[a.skipped] += 1
            return None
        if a.error is None:
            return a
        if a.error.startswith(_ANSWER_ERRORS):
            out.dropped["malformed"] += 1
            return None
        raise ChunkFailed(a.error)


def _row_id(chunk: Chunk, question: str) -> str:
    return "synth-" + hashlib.sha256(f"{chunk.key}\x00{question}".encode()).hexdigest()[:20]
