"""Verdicts from other evaluators: `gen_ai.evaluation.result` events read from a logs topic
(`tracejudge.schemas.formats.evaluation_events`) exported to the same series as tracejudge's own.

A pass/fail verdict goes to `tracejudge_judge_verdicts_total{app, judge, verdict, version}` with
`judge="<evaluator>/<name>"`: the recording rules and dashboards that sum by (app, judge) take it as
they take a built-in judge's, and the `/` keeps it apart from tracejudge's own judge names. The score,
in the evaluator's own scale (a 1-5 rating, a distance), is never mixed into `tracejudge_judge_score`
(which is [0, 1], 1 = good); it goes to the summary `tracejudge_external_evaluation_score{app, judge}`,
whose `_sum / _count` is the mean.

Pass or fail: the score label when it is pass/fail, yes/no or true/false (any case); else, when the
event has a score and a threshold is configured for `<evaluator>/<name>` or `<name>`, score >= the
threshold passes; else no verdict (outcome `score_only`, `no_verdict` without a score). Bounded: at most
`max_evaluators` distinct evaluators and `max_names` distinct names, first come first admitted; later
ones are exported as `other` and counted in `tracejudge_external_evaluation_label_overflow_total{label}`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Summary

from tracejudge.metrics.app_labels import OTHER_APP, label_text
from tracejudge.metrics.judges.series import JudgeMetrics
from tracejudge.schemas.formats import evaluation_events
from tracejudge.schemas.formats.evaluation_events import EvaluationEvents, ExternalEvaluation

__all__ = ["OUTCOMES", "ExternalEvaluations", "for_run", "verdict_of"]

# How each event read ended (the `outcome` label).
OUTCOMES: Final = ("verdict", "score_only", "no_verdict", "error", "invalid", "own")
PASS_LABELS: Final = frozenset({"pass", "yes", "true"})
FAIL_LABELS: Final = frozenset({"fail", "no", "false"})
LABEL_VALUE_MAX: Final = 64


def verdict_of(event: ExternalEvaluation, thresholds: Mapping[str, float]) -> bool | None:
    """Pass (True), fail (False) or no verdict (None), as the module docstring says."""
    if event.error_type is not None:
        return None
    label = (event.label or "").lower()
    if label in PASS_LABELS:
        return True
    if label in FAIL_LABELS:
        return False
    if event.score is None:
        return None
    threshold = thresholds.get(f"{event.evaluator}/{event.name}", thresholds.get(event.name))
    return None if threshold is None else event.score >= threshold


class _Capped:
    """At most `limit` distinct label values; the rest are `other`, counted."""

    def __init__(self, limit: int, overflow: Counter) -> None:
        self.limit = limit
        self._overflow = overflow
        self._admitted: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        value = label_text(value[:LABEL_VALUE_MAX])
        if value in self._admitted:
            return value
        with self._lock:
            if value in self._admitted:
                return value
            if len(self._admitted) < self.limit:
                self._admitted.add(value)
                return value
        self._overflow.inc()
        return OTHER_APP


class ExternalEvaluations:
    """Reads the evaluation events of logs records and exports them. `judge_metrics` is the trace
    judges' `JudgeMetrics` (its verdict series, app limiter and version limiter); `app_tag`, when set,
    is the attribute whose value names the app, over the resource's `service.name`."""

    def __init__(self, registry: CollectorRegistry, judge_metrics: Any, *, thresholds: Mapping[str, float],
                 max_evaluators: int, max_names: int, app_tag: str | None = None) -> None:
        self.judge_metrics = judge_metrics
        self.thresholds = dict(thresholds)
        self.app_tag = app_tag
        self.events = Counter("tracejudge_external_evaluations", "gen_ai.evaluation.result events of other "
                              "evaluators read from logs topics, by evaluator and outcome: verdict, "
                              "score_only, no_verdict, error (the evaluator reported error.type), invalid "
                              "(dead-lettered), own (tracejudge's own events, not read again).",
                              ["evaluator", "outcome"], registry=registry)
        self.score = Summary("tracejudge_external_evaluation_score", "Scores of other evaluators' "
                             "evaluations in the evaluator's own scale (judge=<evaluator>/<name>).",
                             ["app", "judge"], registry=registry)
        self.overflow = Counter("tracejudge_external_evaluation_label_overflow", "Evaluation events whose "
                                "evaluator or name was exported as 'other': the distinct-value cap "
                                "(stream.external_evaluations.max_evaluators / max_names) was reached.",
                                ["label"], registry=registry)
        self._evaluators = _Capped(max_evaluators, self.overflow.labels("evaluator"))
        self._names = _Capped(max_names, self.overflow.labels("name"))
        for outcome in OUTCOMES:  # the series exist from the start (a rate of 0 is an answer)
            self.events.labels(evaluation_events.UNKNOWN_EVALUATOR, outcome)

    def take(self, payload: bytes | str, fmt: str) -> EvaluationEvents:
        """Read and export one logs record's evaluation events; returns them (the caller dead-letters
        the record when some are invalid)."""
        read = evaluation_events.decode(payload, fmt)
        if read.own:
            self.events.labels("tracejudge", "own").inc(read.own)
        if read.invalid:
            self.events.labels(evaluation_events.UNKNOWN_EVALUATOR, "invalid").inc(len(read.invalid))
        for event in read.evaluations:
            self.export(event)
        return read

    def export(self, event: ExternalEvaluation) -> None:
        m = self.judge_metrics
        evaluator = self._evaluators(event.evaluator)
        judge = f"{evaluator}/{self._names(event.name)}"
        app = m.app_label(self._app(event))
        passed = verdict_of(event, self.thresholds)
        if passed is not None:
            m.observe_verdict(app, judge, passed=passed, score=None, trace_id=event.trace_id,
                              version=m.version_label(app, event.version))
        if event.score is not None and event.error_type is None:
            self.score.labels(app, judge).observe(event.score)
        outcome = ("error" if event.error_type is not None else "verdict" if passed is not None
                   else "score_only" if event.score is not None else "no_verdict")
        self.events.labels(evaluator, outcome).inc()

    def _app(self, event: ExternalEvaluation) -> str | None:
        if self.app_tag:
            value = event.tags.get(self.app_tag)
            if isinstance(value, str) and value:
                return value
        return event.service



def for_run(exporter: Any, judges: Any, *, thresholds: Mapping[str, float], max_evaluators: int,
            max_names: int, app_tag: str | None = None) -> ExternalEvaluations:
    """The external evaluations of `tracejudge run`, on `exporter`'s registry: into the trace judges'
    verdict series (`judges.metrics`), or, with no judges configured, into the same families registered
    here with the stream's app and version limiters."""
    metrics = getattr(judges, "metrics", None)
    if metrics is None:
        metrics = JudgeMetrics(exporter.registry, exporter.apps)
        metrics.version_label = exporter.versions
        exporter.versions.on_retire(metrics.retire_version)
    return ExternalEvaluations(exporter.registry, metrics, thresholds=thresholds,
                               max_evaluators=max_evaluators, max_names=max_names, app_tag=app_tag)
