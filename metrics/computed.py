"""Metrics computed for every record, with no model: timing, failure, tokens, retrieval, trajectory,
and the user's own metric functions.

Definitions follow ../shared/notes/metrics.md (Databricks / Vertex names in
docs/pages/concepts/computed-metrics.md). A metric whose inputs are absent is left out of the result
rather than reported as 0: "no reference trajectory" and "a trajectory that matched nothing" must not
look the same on a dashboard.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator

from tracejudge.metrics.plugins import load_plugin
from tracejudge.metrics.retrieval import RETRIEVAL_RANK_METRICS, retrieval_ranks
from tracejudge.metrics.sections import Section
from tracejudge.metrics.signals import (
    CACHE_HIT_RATIO,
    SIGNALS,
    AppNorms,
    SignalsConfig,
    call_key,
    record_signals,
)
from tracejudge.schemas.errors import ConfigError, MetricLoadError
from tracejudge.schemas.record import EvalRecord, ToolCall

# Metrics whose value is a ratio in [0, 1]: these are what `tracejudge_metric_value` histograms.
RATIO_METRICS = frozenset({
    "document_recall",
    "trajectory_exact_match",
    "trajectory_in_order_match",
    "trajectory_any_order_match",
    "trajectory_precision",
    "trajectory_recall",
    "trajectory_single_tool_use",
    CACHE_HIT_RATIO,
}) | RETRIEVAL_RANK_METRICS


class CustomMetricConfig(Section):
    """`metrics.custom[]` in the configuration file."""

    # The metric's name in results (a dict-valued function's values are `<name>.<key>`).
    name: str = Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$")
    # "package.module:function" or "package.module.function".
    function: str
    # Declares the values to lie in [0, 1], so they are exported to `tracejudge_metric_value`.
    ratio: bool = False


class TrajectoryConfig(Section):
    """`metrics.trajectory` in the configuration file."""

    # The tool whose use `trajectory_single_tool_use` checks; the metric is off when unset.
    single_tool_use: str | None = None
    # A default reference trajectory for records that state none.
    reference: list[ToolCallConfig] | None = None


class ToolCallConfig(Section):
    """One tool call of `metrics.trajectory.reference`."""

    # The tool called.
    tool_name: str
    # The arguments it is called with (compared as canonical JSON: key order aside).
    tool_input: Any = None


class MetricsConfig(Section):
    """The `metrics:` section of the configuration file."""

    # Your own metric functions, computed for every record.
    custom: list[CustomMetricConfig] = Field(default_factory=list)
    # The trajectory metrics' options.
    trajectory: TrajectoryConfig = Field(default_factory=TrajectoryConfig)
    # Cheap signals without a judge (`tracejudge.metrics.signals`).
    signals: SignalsConfig = Field(default_factory=SignalsConfig)

    @field_validator("custom")
    @classmethod
    def _unique_names(cls, v: list[CustomMetricConfig]) -> list[CustomMetricConfig]:
        seen: set[str] = set()
        for m in v:
            if m.name in seen or m.name in BUILTIN_METRICS:
                raise ValueError(f"custom metric name {m.name!r} is already taken")
            seen.add(m.name)
        return v


BUILTIN_METRICS = frozenset({
    "latency_seconds", "failed", "input_tokens", "output_tokens", "total_tokens", "retrieved_documents",
}) | RATIO_METRICS | frozenset(SIGNALS)


@dataclass(frozen=True, slots=True)
class CustomMetric:
    """A user function `f(record: EvalRecord) -> float | dict[str, float] | None`."""

    name: str
    fn: Callable[[EvalRecord], Any]
    ratio: bool = False

    @classmethod
    def load(cls, config: CustomMetricConfig) -> CustomMetric:
        """Import the function (`tracejudge.metrics.plugins`); `MetricLoadError` (a `ConfigError`) names
        `metrics.custom[<name>].function` when it cannot be had."""
        key = f"metrics.custom[{config.name}].function"
        try:
            fn = load_plugin(config.function, key=key, noun="callable", accept=callable, dotted=True)
        except ConfigError as exc:
            raise MetricLoadError(exc.problems) from None
        return cls(config.name, fn, config.ratio)


class ComputedMetrics:
    """Computes every applicable metric for a record; never raises for a metric's own failure.

    `signals` configures the cheap signals: the per-record ones are computed here, the ones relative to
    an app's norm by `norms` (an `AppNorms`, None when they are off), which the pipeline applies in
    record order."""

    def __init__(self, *, custom: Sequence[CustomMetric] = (), single_tool: Sequence[str] | str = (),
                 reference_trajectory: Sequence[ToolCall] | None = None,
                 signals: SignalsConfig | None = None) -> None:
        self.signals = signals if signals is not None else SignalsConfig()
        s = self.signals
        self.norms = (AppNorms(s) if s.enabled and (s.answer_overlong or s.tool_result_oversized
                                                    or s.repeated_answer) else None)
        self.custom = list(custom)
        self.single_tool = [single_tool] if isinstance(single_tool, str) else list(single_tool)
        self.reference_trajectory = list(reference_trajectory) if reference_trajectory is not None else None
        self.ratio_metrics = RATIO_METRICS | {m.name for m in self.custom if m.ratio}

    @classmethod
    def from_config(cls, config: MetricsConfig) -> ComputedMetrics:
        ref = config.trajectory.reference
        reference = [ToolCall(t.tool_name, t.tool_input) for t in ref] if ref is not None else None
        return cls(
            custom=[CustomMetric.load(c) for c in config.custom],
            single_tool=config.trajectory.single_tool_use or (),
            reference_trajectory=reference,
            signals=config.signals,
        )

    def compute(self, record: EvalRecord) -> tuple[dict[str, float | None], dict[str, str]]:
        # Runs once per consumed record: the dict is built in one literal (same key order as the result
        # JSON always had) and the recall helper is only called when there is something to recall.
        errors: dict[str, str] = {}
        failed = record.failed
        tokens = record.tokens
        if tokens is not None:
            n_in, n_out, n_total = tokens.input, tokens.output, tokens.total
            input_tokens = None if n_in is None else float(n_in)
            output_tokens = None if n_out is None else float(n_out)
            total_tokens = None if n_total is None else float(n_total)
        else:
            input_tokens = output_tokens = total_tokens = None
        retrieved = record.retrieved_context
        values: dict[str, float | None] = {
            "latency_seconds": record.latency_seconds,
            "failed": None if failed is None else float(failed),
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "total_tokens": total_tokens,
            "retrieved_documents": None if retrieved is None else float(len(retrieved)),
        }
        if record.expected_retrieved_context:
            recall = document_recall(record)
            if recall is not None:
                values["document_recall"] = recall
                values.update(retrieval_ranks(record))
        reference = record.reference_trajectory
        if reference is None:
            reference = self.reference_trajectory
        if record.trajectory is not None:
            if reference is not None:
                values.update(trajectory_metrics(record.trajectory, reference))
            for tool in self.single_tool:
                values["trajectory_single_tool_use"] = trajectory_single_tool_use(record.trajectory, tool)
        if self.signals.enabled:
            record_signals(record, self.signals, values)
        for metric in self.custom:
            _run_custom(metric, record, values, errors)
        return values, errors


def _num(v: int | float | None) -> float | None:
    return None if v is None else float(v)


def _run_custom(metric: CustomMetric, record: EvalRecord, values: dict[str, float | None],
                errors: dict[str, str]) -> None:
    # A user function must never take the consumer down: its failure is that metric's error.
    try:
        out = metric.fn(record)
    except Exception as exc:
        values[metric.name] = None
        errors[metric.name] = f"{type(exc).__name__}: {exc}"[:500]
        return
    items: Iterable[tuple[str, Any]]
    if isinstance(out, Mapping):
        items = ((f"{metric.name}.{k}", v) for k, v in out.items())
    else:
        items = ((metric.name, out),)
    for name, v in items:
        if v is None:
            values[name] = None
        elif isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            values[name] = None
            errors[name] = f"returned {type(v).__name__} {v!r:.80}, expected a finite number"
        else:
            values[name] = float(v)


def document_recall(record: EvalRecord) -> float | None:
    """Share of expected `doc_uri`s found among the retrieved ones; None without expected URIs."""
    expected = {d.doc_uri for d in record.expected_retrieved_context or () if d.doc_uri}
    if not expected:
        return None
    retrieved = {d.doc_uri for d in record.retrieved_context or () if d.doc_uri}
    return len(expected & retrieved) / len(expected)


_call_key = call_key  # inputs compared as canonical JSON: {"a":1,"b":2} equals {"b":2,"a":1}


def trajectory_metrics(predicted: Sequence[ToolCall], reference: Sequence[ToolCall]) -> dict[str, float]:
    """The five reference-based trajectory metrics (Vertex AI's definitions).

    Calls are matched as a multiset: a reference call is matched by at most one predicted call, so
    calling a tool twice when the reference calls it once costs precision. Empty cases: an empty
    reference is matched by anything in order (in-order/any-order = 1, recall = 1); an empty
    prediction has precision 1 when the reference is empty too, else 0.
    """
    p = [_call_key(c) for c in predicted]
    r = [_call_key(c) for c in reference]
    matched = sum((Counter(p) & Counter(r)).values())
    return {
        "trajectory_exact_match": float(p == r),
        "trajectory_in_order_match": float(_is_subsequence(r, p)),
        "trajectory_any_order_match": float(not (Counter(r) - Counter(p))),
        "trajectory_precision": matched / len(p) if p else float(not r),
        "trajectory_recall": matched / len(r) if r else 1.0,
    }


def _is_subsequence(needle: Sequence[Any], haystack: Sequence[Any]) -> bool:
    it = iter(haystack)
    return all(any(x == y for y in it) for x in needle)


def trajectory_single_tool_use(predicted: Sequence[ToolCall], tool_name: str) -> float:
    return float(any(c.tool_name == tool_name for c in predicted))


TrajectoryConfig.model_rebuild()
