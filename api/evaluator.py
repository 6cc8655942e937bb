"""`Evaluator`: the pipeline and the judges behind one call, for tests and scripts.

    from tracejudge import evaluate

    result = evaluate(request="What is the refund window?", response="30 days.",
                      context=["Refunds are accepted within 30 days."], judges={})
    assert result.assessment("groundedness").passed

It is the code path of `tracejudge eval` and `tracejudge run`: `Pipeline.normalise` → computed
metrics → `JudgeRunner` — so a threshold asserted in a test means what the dashboard shows.

A conversation is evaluated as one session with `evaluate_session`, the code path of `tracejudge eval`
and `tracejudge sessions`: each turn through the pipeline → `Turn` → `session_metrics` →
`SessionJudgeRunner` → a `SessionResult`:

    from tracejudge import evaluate_session

    session = evaluate_session([
        {"request": "How do I reset my password?", "response": "Use the link on the sign-in page."},
        {"request": "How do I reset my password??", "response": "Use the link on the sign-in page."},
        {"request": "Forget it, I will call support.", "response": "Sorry to hear that."},
    ], judges={})
    assert session.assessment("user_frustration").value == "unresolved"
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tracejudge.consumer.config import Settings, load_settings
from tracejudge.consumer.pipeline import Pipeline, build_judges, build_pipeline, with_judgements
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import EvaluationResult, SourceRef
from tracejudge.schemas.session import SessionResult, SessionSource, Turn
from tracejudge.sessions import (
    GroupedSession,
    SessionEvaluation,
    api_session_id,
    build_session_judges,
    common_id,
)

if TYPE_CHECKING:
    from tracejudge.metrics.judges.sessions import SessionJudgeRunner

RecordLike = EvalRecord | Mapping[str, Any] | str | bytes


class Evaluator:
    """Evaluates records with the configured metrics and judges; reuse one for many records.

    `config` is the YAML file `tracejudge run` reads (a path), already-loaded `Settings`, or None for
    the built-in metrics only. `judges` overrides the config's `judges:` section: a mapping in that
    section's shape (`{}` runs the model-free heuristic judges), a `JudgeRunner` you built, or
    `False` for none. Close it (or use `with`) to release the judge endpoint's connections.

    As `tracejudge eval`, it judges every eligible record unless the `judges:` section sets a
    `sample_rate` (the stream samples model judges at 10% by default), and keeps every skip in the
    result. `result.passed` is true only when the judges judged the record and every verdict passed;
    `result.judged`, `result.statuses` and `result.why_not_passed` tell a failed verdict from a
    judge that did not judge. A `JudgeRunner` you pass is used as you built it.

    The session judges (`evaluate_session`) come from the same `judges:` section (its `sessions:`
    key; without an endpoint the heuristic `user_frustration`), built on the first session.
    """

    def __init__(self, config: str | os.PathLike[str] | Settings | None = None, *,
                 judges: Mapping[str, Any] | JudgeRunner | bool | None = None) -> None:
        settings = config if isinstance(config, Settings) else load_settings(config, offline=True)
        if isinstance(judges, Mapping):
            settings = _with_judges(settings, judges)
        # Offline whatever made the settings: every eligible record judged unless a rate is set.
        if settings.judges is not None and not settings.judges.offline:
            settings = settings.model_copy(update={"judges": settings.judges.for_offline()})
        self.settings = settings
        self.pipeline: Pipeline = build_pipeline(settings)
        self._owns_judges = not isinstance(judges, JudgeRunner)
        if isinstance(judges, JudgeRunner):
            self.judges: JudgeRunner | None = judges
        elif judges is False:
            self.judges = None
        else:
            self.judges = build_judges(settings)
        # The judges' configuration, for the session judges built on the first `evaluate_session`.
        self._judges_config = None if judges is False else (
            judges.config if isinstance(judges, JudgeRunner) else settings.judges)
        self._session_judges: SessionJudgeRunner | None = None

    def evaluate(self, record: RecordLike | None = None, **fields: Any) -> EvaluationResult:
        """One record: an `EvalRecord`, any supported input (agent-eval dict, MLflow trace JSON,
        inference-log row, as a dict or JSON text), or the agent-eval fields as keywords
        (`request=`, `response=`, `context=` for `retrieved_context`, `expected_response=`, …).
        Raises `RecordError` naming the field for input that cannot be normalised."""
        return next(self.evaluate_many([_record_from(record, fields)]))

    def evaluate_many(self, records: Iterable[RecordLike]) -> Iterator[EvaluationResult]:
        """Results in input order; judges run concurrently up to the runner's in-flight window."""
        results = (self._computed(r, i) for i, r in enumerate(records, start=1))
        if self.judges is None:
            return results
        return with_judgements(results, self.judges)

    def evaluate_session(self, turns: Iterable[RecordLike], session_id: str | None = None, *,
                         user_id: str | None = None) -> SessionResult:
        """A conversation's turns, as one session: a `SessionResult` with the session metrics
        (turns, duration, failed turns, tokens, tool calls, turns until the first failure, whether
        the last turn failed) and the session judges' assessments (`session.assessment(name)`).

        Each turn is any input `evaluate` takes: an `EvalRecord`, an agent-eval dict (with
        `request`/`response`, and `context=` as for `evaluate`), an MLflow trace, an inference-log
        row. Turns are ordered by their timestamps; turns without one keep the order given.
        `session_id` defaults to the one the turns state (ValueError when they state several), else
        an id derived from the turns' content, so the same turns get the same id (and the same
        sampling decision) in every run. `user_id` likewise. The session is closed as at the end of an
        input file (`close_reason` "end_of_input", status "complete"). The turns' own judges do not
        run here (their verdicts are not part of a session result): `evaluate_many(turns)` gives
        those."""
        results = [self._computed(_session_turn(t), i) for i, t in enumerate(turns, start=1)]
        if not results:
            raise ValueError("a session needs at least one turn")
        arrival = time.time()
        held = [Turn.from_result(r, arrival=arrival) for r in results]
        sid = (session_id or common_id((r.record.session_id for r in results), "session_id")
               or api_session_id(held))
        uid = user_id or common_id((r.record.user_id for r in results), "user_id")
        app = next((r.record.app for r in results if r.record.app), None)
        session = GroupedSession(sid, uid, app, SessionSource(format=results[0].record.source_format), held)
        return next(SessionEvaluation(self.session_judges, window=1).results([session]))

    @property
    def session_judges(self) -> SessionJudgeRunner | None:
        """The session judges `evaluate_session` runs (None when judges are off)."""
        if self._session_judges is None and self._judges_config is not None:
            self._session_judges = build_session_judges(self.settings, config=self._judges_config)
        return self._session_judges

    def _computed(self, record: RecordLike, index: int) -> EvaluationResult:
        rec = record if isinstance(record, EvalRecord) else self.pipeline.normalise(record)
        return self.pipeline.evaluate(rec, SourceRef(format=rec.source_format, line=index))

    def close(self) -> None:
        if self.judges is not None and self._owns_judges:
            self.judges.close()
        if self._session_judges is not None:
            self._session_judges.close()
            self._session_judges = None

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def evaluate(record: RecordLike | None = None, *, config: str | os.PathLike[str] | Settings | None = None,
             judges: Mapping[str, Any] | JudgeRunner | bool | None = None, **fields: Any) -> EvaluationResult:
    """Evaluate one record with a throwaway `Evaluator`; see `Evaluator.evaluate`."""
    with Evaluator(config, judges=judges) as evaluator:
        return evaluator.evaluate(record, **fields)


def evaluate_session(turns: Iterable[RecordLike], session_id: str | None = None, *,
                     user_id: str | None = None, config: str | os.PathLike[str] | Settings | None = None,
                     judges: Mapping[str, Any] | JudgeRunner | bool | None = None) -> SessionResult:
    """Evaluate a conversation as one session with a throwaway `Evaluator`; see
    `Evaluator.evaluate_session`. `judges={}` runs the heuristic `user_frustration` judge."""
    with Evaluator(config, judges=judges) as evaluator:
        return evaluator.evaluate_session(turns, session_id, user_id=user_id)


def _with_judges(settings: Settings, judges: Mapping[str, Any]) -> Settings:
    from tracejudge.metrics.judges.config import load_judges_config

    return settings.model_copy(update={"judges": load_judges_config(judges)})


def _record_from(record: RecordLike | None, fields: Mapping[str, Any]) -> RecordLike:
    if record is not None and fields:
        raise TypeError("pass either a record or its fields as keywords, not both")
    if record is not None:
        return record
    if not fields:
        raise TypeError("nothing to evaluate: pass a record or request=/response=/context=")
    data = dict(fields)
    if "context" in data:
        data["retrieved_context"] = _documents(data.pop("context"))
    return data


def _session_turn(turn: RecordLike) -> RecordLike:
    """A turn given as a dict of `evaluate`'s keywords (`context=`) becomes an agent-eval row."""
    if isinstance(turn, Mapping) and "context" in turn and "retrieved_context" not in turn:
        return _record_from(None, turn)
    return turn


def _documents(context: Any) -> Any:
    """`context=` accepts plain strings as well as `{content, doc_uri}` dicts."""
    if isinstance(context, str):
        return [{"content": context}]
    if isinstance(context, Sequence):
        return [{"content": c} if isinstance(c, str) else c for c in context]
    return context


__all__ = ["Evaluator", "evaluate", "evaluate_session"]
