"""`Evaluator`: the pipeline and the judges behind one call, for tests and scripts.

    from tracejudge import evaluate

    result = evaluate(request="What is the refund window?", response="30 days.",
                      context=["Refunds are accepted within 30 days."], judges={})
    assert result.assessment("groundedness").passed

It is the code path of `tracejudge eval` and `tracejudge run`: `Pipeline.normalise` → computed
metrics → `JudgeRunner` — so a threshold asserted in a test means what the dashboard shows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from tracejudge.consumer.config import Settings, load_settings
from tracejudge.consumer.pipeline import Pipeline, build_judges, build_pipeline, with_judgements
from tracejudge.metrics.judging import JudgeRunner
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import EvaluationResult, SourceRef

RecordLike = EvalRecord | Mapping[str, Any] | str | bytes


class Evaluator:
    """Evaluates records with the configured metrics and judges; reuse one for many records.

    `config` is the YAML file `tracejudge run` reads (a path), already-loaded `Settings`, or None for
    the built-in metrics only. `judges` overrides the config's `judges:` section: a mapping in that
    section's shape (`{}` runs the model-free heuristic judges), a `JudgeRunner` you built, or
    `False` for none. Close it (or use `with`) to release the judge endpoint's connections.
    """

    def __init__(self, config: str | os.PathLike[str] | Settings | None = None, *,
                 judges: Mapping[str, Any] | JudgeRunner | bool | None = None) -> None:
        settings = config if isinstance(config, Settings) else load_settings(config, offline=True)
        if isinstance(judges, Mapping):
            settings = _with_judges(settings, judges)
        self.settings = settings
        self.pipeline: Pipeline = build_pipeline(settings)
        self._owns_judges = not isinstance(judges, JudgeRunner)
        if isinstance(judges, JudgeRunner):
            self.judges: JudgeRunner | None = judges
        elif judges is False:
            self.judges = None
        else:
            self.judges = build_judges(settings)

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

    def _computed(self, record: RecordLike, index: int) -> EvaluationResult:
        rec = record if isinstance(record, EvalRecord) else self.pipeline.normalise(record)
        return self.pipeline.evaluate(rec, SourceRef(format=rec.source_format, line=index))

    def close(self) -> None:
        if self.judges is not None and self._owns_judges:
            self.judges.close()

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


def _with_judges(settings: Settings, judges: Mapping[str, Any]) -> Settings:
    from tracejudge.metrics.judge_config import load_judges_config

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


def _documents(context: Any) -> Any:
    """`context=` accepts plain strings as well as `{content, doc_uri}` dicts."""
    if isinstance(context, str):
        return [{"content": context}]
    if isinstance(context, Sequence):
        return [{"content": c} if isinstance(c, str) else c for c in context]
    return context


__all__ = ["Evaluator", "evaluate"]
