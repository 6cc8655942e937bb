"""The `collections:` section: rules that route matching traces into collections, the first step from
production back to the test suite (`tracejudge.consumer.collecting` applies them).

    collections:
      - name: ungrounded                # [a-z][a-z0-9_]*, unique; the `collection` label and row field
        when:                           # every condition must hold (`match: any`: one is enough)
          - judge: groundedness         # a configured trace judge (or shadow judge) ...
            verdict: failed             # ... whose status is one of these (passed, failed, error, ...)
          - metric: {name: latency_seconds, op: ">", value: 5}
          - app: [support-bot]          # the record's app is one of these
          - version: ["1.4.2"]          # the record's version (release) is one of these
          - finding: {judge: groundedness, dimension: doc_uri}  # shares a value with a current finding
        sample_rate: 0.5                # deterministic by trace id, independent of the judges' sampling
        max_per_window: 100             # at most this many rows per window_s (tumbling), per process
        window_s: 3600
        topic: tracejudge-collected     # and/or
        file: collected/ungrounded.jsonl

Structured conditions, not an expression language: nothing in the file is evaluated as code, and each
key is checked when the configuration loads. A condition naming a judge that is not configured, or a
metric that is neither built in nor a `metrics.custom` name, is a `ConfigError` naming the rule's index
and key (`collections[0].when[1].judge`), before anything connects.

`finding: {judge, dimension, verdict}` holds when the trace's verdict of `judge` is one of `verdict`
(default `failed`) and one of its values of `dimension` (any of `FINDING_DIMENSIONS` when omitted) is the
value of a current finding (`tracejudge.metrics.findings`) for the trace's app and that judge. The judge
must be a live trace judge (findings count no shadow verdicts). `request_cluster` is refused: a cluster
id is the id one clusterer gave in one window, and another process (or a second pass) numbers them
differently, so it would match the wrong traces. Where the current findings come from: `tracejudge
eval`, the run's own findings (`consumer/commands/collect_files.py`); `tracejudge run`, the findings topic
(`consumer/collecting.py`, `FindingsFeed`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from tracejudge.consumer.config.common import Section, optional_topic
from tracejudge.metrics.computed import BUILTIN_METRICS
from tracejudge.schemas.errors import ConfigError

if TYPE_CHECKING:
    from tracejudge.metrics.computed import MetricsConfig
    from tracejudge.metrics.judges.config import JudgesConfig

__all__ = ["FINDING_DIMENSIONS", "OPS", "VERDICTS", "CollectionRule", "Condition", "FindingCondition",
           "MetricCondition", "check_collections"]

# The statuses of an assessment (`tracejudge.schemas.result.assessment_status`).
VERDICTS = ("passed", "failed", "error", "not_judged", "not_applicable", "no_verdict")
OPS = ("<", "<=", ">", ">=", "==", "!=")
NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
# The dimensions a `finding` condition matches on (`metrics/findings/dimensions.py` less request_cluster).
FINDING_DIMENSIONS = ("doc_uri", "tool", "tool_error", "version", "model", "signal")
Verdict = Literal["passed", "failed", "error", "not_judged", "not_applicable", "no_verdict"]


class MetricCondition(Section):
    """`metric: {name, op, value}`: a computed metric compared with a number; a record without the
    metric does not match."""

    # The computed metric (`document_recall`, a custom metric, ...).
    name: str
    # How the metric's value is compared with `value`.
    op: Literal["<", "<=", ">", ">=", "==", "!="]
    # The number compared with.
    value: float


class FindingCondition(Section):
    """`finding: {judge, dimension, verdict}`: the trace's `verdict` of `judge` (default failed) and one
    of its `dimension` values (default: any dimension) is a current finding's for its app and judge."""

    # The judge whose verdict on the trace, and whose current findings, count.
    judge: str
    # The findings dimension a value of the trace must be a finding's on; unset: any dimension.
    dimension: str | None = None
    # The trace's verdicts of `judge` that match (one or a list).
    verdict: list[Verdict] = Field(default_factory=lambda: ["failed"])

    @field_validator("verdict", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("verdict")
    @classmethod
    def _some(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError(f"one or more of {', '.join(VERDICTS)}")
        return v

    @field_validator("dimension")
    @classmethod
    def _dimension(cls, v: str | None) -> str | None:
        if v == "request_cluster":
            raise ValueError("request_cluster cannot be matched: a cluster id is one clusterer's name for "
                             "one window's requests, and this process numbers them differently; use "
                             f"one of {', '.join(FINDING_DIMENSIONS)}")
        if v is not None and v not in FINDING_DIMENSIONS:
            raise ValueError(f"{v!r} is not a findings dimension ({', '.join(FINDING_DIMENSIONS)})")
        return v


class Condition(Section):
    """One condition of a rule's `when`: exactly one of `judge` (with `verdict`), `metric`, `app`,
    `version`, `finding`."""

    # A judge whose verdict on the trace is one of `verdict`.
    judge: str | None = None
    # With `judge`: the verdicts that match (one or a list).
    verdict: list[Verdict] | None = None
    # A computed metric compared with a number.
    metric: MetricCondition | None = None
    # The apps whose traces match (one or a list).
    app: list[str] | None = None
    # The app versions whose traces match (one or a list).
    version: list[str] | None = None
    # The trace has a value a current finding names (read from `findings.findings_topic`).
    finding: FindingCondition | None = None

    @field_validator("verdict", "app", "version", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _exactly_one(self) -> Condition:
        kinds = [k for k in ("judge", "metric", "app", "version", "finding") if getattr(self, k) is not None]
        if len(kinds) != 1:
            got = f"got {', '.join(kinds)}" if kinds else "got none"
            raise ValueError(f"a condition states exactly one of judge, metric, app, version, finding "
                             f"({got})")
        if self.judge is not None and not self.verdict:
            raise ConfigError("verdict", f"required with judge: one or more of {', '.join(VERDICTS)}")
        if self.verdict is not None and self.judge is None:
            raise ConfigError("verdict", "applies to a judge condition: add judge: NAME")
        return self


class CollectionRule(Section):
    """One rule of `collections:`."""

    # The collection's name (the `collection` label), a lowercase identifier.
    name: str
    # The conditions a trace must meet (combined by `match`).
    when: list[Condition] = Field(default_factory=list)
    # all: every condition holds; any: at least one does. No conditions: every trace.
    match: Literal["all", "any"] = "all"
    # The share of matching traces collected.
    sample_rate: float = Field(default=1.0, ge=0, le=1)
    # Traces collected per window, at most; unset: no cap.
    max_per_window: int | None = Field(default=None, ge=1)
    # The window of `max_per_window`.
    window_s: float = Field(default=3600.0, gt=0)
    # The topic the collected rows are published to (a topic, a file, or both).
    topic: str | None = None
    # The JSON Lines file the collected rows are appended to (a topic, a file, or both).
    file: str | None = None

    _topic = field_validator("topic")(optional_topic)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError(f"{v!r}: a collection name is a lowercase identifier ([a-z][a-z0-9_]*, "
                             "at most 63 characters)")
        return v

    @field_validator("file")
    @classmethod
    def _file(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        return v or None

    @model_validator(mode="after")
    def _somewhere(self) -> CollectionRule:
        if self.topic is None and self.file is None:
            raise ConfigError("topic", "a collection needs a topic, a file, or both")
        return self


def check_collections(rules: list[CollectionRule], judges: JudgesConfig | None,
                      metrics: MetricsConfig) -> None:
    """The checks across sections: unique names, judges that are configured (a finding's: a live one),
    metrics that exist.
    Raises `ConfigError` with every problem, keys relative to the whole configuration."""
    problems: list[tuple[str, str]] = []
    seen: set[str] = set()
    judge_names = _trace_judges(judges)
    live = set(judges.judge_settings()) if judges is not None else set()
    metric_names = set(BUILTIN_METRICS) | {m.name for m in metrics.custom}
    for i, rule in enumerate(rules):
        if rule.name in seen:
            problems.append((f"collections[{i}].name", f"{rule.name!r} is used by an earlier rule"))
        seen.add(rule.name)
        for j, cond in enumerate(rule.when):
            where = f"collections[{i}].when[{j}]"
            if cond.judge is not None and cond.judge not in judge_names:
                known = ", ".join(sorted(judge_names)) or "none: add a judges: section"
                problems.append((f"{where}.judge",
                                 f"{cond.judge!r} is not a configured trace judge ({known})"))
            if cond.finding is not None and cond.finding.judge not in live:
                known = ", ".join(sorted(live)) or "none: add a judges: section"
                problems.append((f"{where}.finding.judge", f"{cond.finding.judge!r} is not a configured "
                                 f"live trace judge; findings count no shadow verdicts ({known})"))
            if cond.metric is not None and not _metric_known(cond.metric.name, metric_names):
                problems.append((f"{where}.metric.name", f"{cond.metric.name!r} is not a computed metric "
                                 f"({', '.join(sorted(metric_names))})"))
    if problems:
        raise ConfigError(problems)


def _metric_known(name: str, known: set[str]) -> bool:
    # A custom function returning a mapping exports "<name>.<key>".
    return name in known or ("." in name and name.partition(".")[0] in known)


def _trace_judges(judges: JudgesConfig | None) -> set[str]:
    """The judges whose assessments a trace result carries: the live ones and their shadows."""
    if judges is None:
        return set()
    return set(judges.judge_settings()) | set(judges.shadow)
