"""The planner: which configured judges judge a subject, decided before anything is spent.

One path for traces and sessions. A subject is seen through its `Scope` (what the judges judge, its
app, its sampling key, whether it failed and which filters admit it): `record_scope` makes the scope of
an `EvalRecord`, the session judges (`tracejudge.metrics.judges.sessions`) make one of a conversation's
transcript. For each configured judge, in order, `Planner.plan` decides a skip (failed, filtered,
missing inputs, not sampled; each counted) or the judge to run; a shadow judge
(`tracejudge.metrics.judges.trust.shadows`) runs on exactly the subjects its live judge sampled.

`Configured` is one judge with what it runs with (sample rate, filter, clients, budget); `Plan` is the
decision for one subject. The runner (`tracejudge.metrics.judges.runner`) executes plans.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tracejudge.metrics.judges.base import Judge
from tracejudge.metrics.judges.budget import EndpointBudget
from tracejudge.metrics.judges.client import JudgeClient
from tracejudge.metrics.judges.config import JudgesConfig, JudgeSettings
from tracejudge.metrics.judges.heuristic import HeuristicJudge
from tracejudge.metrics.judges.sampling import TraceFilter, sample_point, sampling_key, trace_status
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment

__all__ = ["Configured", "Plan", "Planner", "Scope", "placement", "record_scope"]


@dataclass
class Configured:
    """One configured judge with what it runs with."""

    judge: Judge
    rate: float
    filter: TraceFilter
    client: JudgeClient | None = None
    embeddings: JudgeClient | None = None
    budget: EndpointBudget | None = None
    # A shadow (candidate) judge: the live judge it may replace (tracejudge.metrics.judges.trust.shadows).
    shadow_of: str | None = None
    # A canary judgement's copy of a live judge: observed only in the canary series.
    canary: bool = False

    @property
    def name(self) -> str:
        return self.judge.name

    @property
    def local(self) -> bool:
        return isinstance(self.judge, HeuristicJudge)


def placement(config: JudgesConfig, name: str, settings: JudgeSettings) -> tuple[float, TraceFilter]:
    """A configured judge's sample rate and filter: its own, else the section's."""
    filters = settings.filters if settings.filters is not None else config.filters
    return config.sample_rate_of(name, settings), TraceFilter(filters)


@dataclass
class Plan:
    """The decisions for one subject."""

    # What the judges judge: an EvalRecord; a session's prepared transcript for the session judges.
    subject: Any
    app: str
    # Per configured judge, in order: the decided Assessment (a skip) or the judge to run.
    slots: list[Assessment | Configured]
    # Redaction's memo of the lines this subject's prompts held and what was found in them, shared by its
    # judgements (each judge sends the same request, response and context) and gone with the plan: no
    # state outlives one record (tracejudge.metrics.judges.redaction).
    redaction_memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def remote(self) -> bool:
        return any(isinstance(s, Configured) and not s.local for s in self.slots)


@dataclass(frozen=True, slots=True)
class Scope:
    """One subject as the planner sees it."""

    subject: Any
    app: str | None
    # Sampling is `sample_point(key, seed)`: the same decision in every replica and re-evaluation.
    key: str
    # Does a judge's filter admit the subject?
    admits: Callable[[TraceFilter], bool]
    # A failed trace: every live judge skips it ("failed_trace").
    failed: bool = False


def record_scope(record: EvalRecord) -> Scope:
    """A trace's scope: its status decides failure and (with app and tags) its filters."""
    status = trace_status(record)
    return Scope(
        record,
        record.app,
        sampling_key(record),
        lambda flt: flt.matches(record, status),
        failed=status == "failed",
    )


class Planner:
    """Sampling, filters and shadows over the configured judges; skips counted in `metrics`."""

    def __init__(self, judges: list[Configured], metrics: Any, sampling_seed: str):
        self.judges = judges
        self.metrics = metrics
        self.sampling_seed = sampling_seed

    def skip(
        self,
        app: str,
        cj: Configured,
        reason: str,
        rationale: str | None = None,
        duration: float | None = None,
    ) -> Assessment:
        """A judgement skipped for `reason`, counted (a canary's in the canary series only)."""
        if cj.canary:
            self.metrics.observe_canary_skipped(cj.name, reason)
        else:
            self.metrics.observe_skipped(app, cj.name, reason)
        return Assessment(
            name=cj.name,
            skipped=reason,
            rationale=rationale,
            source=cj.judge.source,
            duration_seconds=duration,
            judge=cj.judge.identity,
            sample_rate=cj.rate,
            shadow_of=cj.shadow_of,
        )

    def _missing(self, app: str, cj: Configured, subject: Any) -> Assessment | None:
        missing = cj.judge.missing_inputs(subject)
        return self.skip(app, cj, "missing_inputs", "missing: " + ", ".join(missing)) if missing else None

    def plan(self, scope: Scope) -> Plan:
        app = self.metrics.app_label(scope.app)
        point: float | None = None
        slots: list[Assessment | Configured] = []
        sampled: set[str] = set()
        for cj in self.judges:
            if cj.shadow_of is not None:
                # A shadow judge sees exactly the subjects its live judge sampled (it comes after it).
                if cj.shadow_of in sampled:
                    slots.append(self._missing(app, cj, scope.subject) or cj)
                continue
            if scope.failed:
                slots.append(self.skip(app, cj, "failed_trace"))
                continue
            if not scope.admits(cj.filter):
                slots.append(self.skip(app, cj, "filtered"))
                continue
            missing = self._missing(app, cj, scope.subject)
            if missing is not None:
                slots.append(missing)
                continue
            self.metrics.observe_eligible(app, cj.name)
            if cj.rate < 1.0:
                if point is None:
                    point = sample_point(scope.key, self.sampling_seed)
                if not point < cj.rate:
                    slots.append(self.skip(app, cj, "not_sampled"))
                    continue
            self.metrics.observe_sampled(app, cj.name)
            sampled.add(cj.name)
            slots.append(cj)
        return Plan(scope.subject, app, slots)
