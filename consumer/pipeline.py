"""The one code path every record takes, offline or live.

    payload ──normalise──▶ EvalRecord ──computed metrics──▶ EvaluationResult ──judges──▶ sinks

`tracejudge eval` (files), `tracejudge run` (Kafka) and the Python API (`tracejudge.evaluate`) all call
`Pipeline`, so a score means the same thing wherever it was computed. The pipeline knows nothing about
where records come from or where results go: sources and sinks live beside it in `consumer/`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from tracejudge.metrics.computed import ComputedMetrics
from tracejudge.metrics.cost import COST_ERROR_KEY, PriceTable, trace_cost
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import EvaluationResult, SourceRef

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from tracejudge.consumer.config import Settings
    from tracejudge.metrics.judges.runner import JudgeRunner
    from tracejudge.metrics.version_labels import VersionLabelLimiter


class Pipeline:
    """Normalise and score records.

    `metrics` defaults to the built-in computed metrics; build it with `ComputedMetrics.from_config`
    to add custom metric functions and trajectory settings. `app_tag` names the trace tag whose value
    becomes the record's `app` (else the source's own notion: MLflow experiment, OTel service.name);
    `session_tag` the one whose value is its session id and `version_tag` its version, the app's release
    (else the source's conventions: `tracejudge.schemas.formats.release_version`).
    """

    def __init__(self, *, metrics: ComputedMetrics | None = None, app_tag: str | None = None,
                 session_tag: str | None = None, prices: PriceTable | None = None,
                 version_tag: str | None = None) -> None:
        self.metrics = metrics or ComputedMetrics()
        # The agent's cost per trace (`tracejudge.metrics.cost`): stated, else priced, else unknown.
        self.prices = prices
        self.app_tag = app_tag
        self.session_tag = session_tag
        self.version_tag = version_tag

    def normalise(self, payload: bytes | str | Mapping[str, Any], fmt: str | None = None) -> EvalRecord:
        """Decode one record of a single-record format; raises `RecordError` naming what is wrong."""
        return normalise(payload, fmt, app_tag=self.app_tag, session_tag=self.session_tag,
                         version_tag=self.version_tag)

    def evaluate(self, record: EvalRecord, source: SourceRef, *, norms: bool = True) -> EvaluationResult:
        """Computed metrics for one record, and its cost. Never raises for a metric's failure: it is
        recorded (a stated cost or token count set aside as bad input under `metric_errors["cost"]`).
        `norms=False` leaves out the signals relative to the app's norm: a decode worker's results are
        given them by `apply_norms` in the consumer process, which holds the one state per app."""
        values, errors = self.metrics.compute(record)
        priced = trace_cost(record, self.prices)
        record.cost = priced.cost
        if priced.ignored is not None:
            errors[COST_ERROR_KEY] = priced.ignored
        if norms:
            app_norms = getattr(self.metrics, "norms", None)
            if app_norms is not None:
                app_norms.apply(record, values)
        return EvaluationResult(record=record, source=source, metrics=values, metric_errors=errors)

    def apply_norms(self, result: EvaluationResult) -> None:
        """Add the signals relative to the app's norm (`tracejudge.metrics.signals.AppNorms`) to a result
        evaluated with `norms=False`, learning its values; in the order results are given."""
        norms = getattr(self.metrics, "norms", None)  # a custom `ComputedMetrics` may predate them
        if norms is not None:
            norms.apply(result.record, result.metrics)


def build_pipeline(settings: Settings) -> Pipeline:
    """The pipeline the settings describe (computed-metric options, custom metric functions, app tag).
    Raises `ConfigError` naming the key when a custom metric function cannot be loaded."""
    # A function that cannot be loaded raises `MetricLoadError`, a `ConfigError` naming its key.
    metrics = ComputedMetrics.from_config(settings.metrics)
    return Pipeline(metrics=metrics, app_tag=settings.stream.app_tag, session_tag=settings.stream.session_tag,
                    version_tag=settings.stream.version_tag)


def build_judges(settings: Settings, registry: CollectorRegistry | None = None,
                 app_label: Callable[[str | None], str] | None = None,
                 version_label: VersionLabelLimiter | None = None) -> JudgeRunner | None:
    """A `JudgeRunner` when the settings have a `judges:` section, else None. Its metrics go to
    `registry` (a private one by default) with `app_label` bounding the app values and `version_label`
    (a `VersionLabelLimiter`) the versions of the verdict series."""
    if settings.judges is None:
        return None
    from tracejudge.metrics.judges.runner import JudgeRunner

    # A bad section raises `JudgeConfigError`, a `ConfigError` naming the key.
    return JudgeRunner(settings.judges, registry=registry, app_label=app_label, version_label=version_label)


def with_judgements(results: Iterable[EvaluationResult], judges: JudgeRunner) -> Iterator[EvaluationResult]:
    """Attach each result's assessments, in input order, while up to the runner's window of records
    is being judged concurrently (offline evaluation and the Python API; the stream judges per record)."""
    pending: deque[EvaluationResult] = deque()

    def records() -> Iterator[EvalRecord]:
        for result in results:
            pending.append(result)
            yield result.record

    for assessments in judges.judge_many(records()):
        result = pending.popleft()
        result.assessments = assessments
        yield result
