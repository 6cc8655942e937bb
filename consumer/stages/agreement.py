"""`tracejudge agreement`: join human labels from a labels topic with the judges' verdicts on the results
topic, and export how often they agree.

A stage on the consumer runtime (`consumer/runtime/loop.py`), consumer group `tracejudge-agreement` unless
`agreement.group_id` says otherwise:

    results topic ──▶ verdicts (trace id / request id, judge) ─┐
    (agreement.results_topic,                                   ├─▶ Joiner: a label meets its verdict
     default stream.results_topic)                              │     ──▶ tracejudge_judge_agreement_total
    labels topic ──▶ labels (trace id / request id, judge) ─────┘         {app, judge, outcome}
    (agreement.labels_topic)

A label is a JSON object: `trace_id` or `request_id`, `name` (the judge's name; `judge` is read too),
`value` ("pass"/"fail", a bool, or a score in [0, 1]), optionally `source`/`source_id`. People label
late, and sometimes before the verdict is published, so both sides wait: a verdict waits `window_s`
for labels (several people may label one trace; each label is compared), a label waits `window_s` for
its verdict and is counted `unmatched` when none came. Each side holds at most `max_pending` entries;
past it the oldest is dropped (`tracejudge_agreement_evicted_total{side}`; a dropped label is also
counted unmatched). Bad records (not JSON, no id, not a result) are counted and logged with their
topic, partition and offset, never fatal.

State is in memory and per process: records are committed once read, and a restart forgets what was
waiting. Run one replica, or key both topics by trace id so a label and its verdict meet on the same
partition number of their topics. Shadow judges' verdicts and backfill results are not compared (they
are not the live judge's verdicts).

Neighbours: the command's arguments are `consumer/commands/agreement.py`, the stage's Prometheus series
(`AgreementMetrics`) `metrics/telemetry/agreement.py`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from kafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import ConfigError, Settings
from tracejudge.consumer.runtime.loop import ConsumerRuntime
from tracejudge.consumer.runtime.stage import Stage
from tracejudge.metrics.telemetry.agreement import AgreementMetrics
from tracejudge.schemas.formats.labels import normalise_id
from tracejudge.schemas.results_line import BadResult, decode_line

__all__ = ["DEFAULT_GROUP", "AgreementPlan", "AgreementRunner", "AgreementStage", "Joiner", "plan_agreement"]

log = logging.getLogger("tracejudge.agreement")
DEFAULT_GROUP = "tracejudge-agreement"


@dataclass(slots=True)
class _Verdict:
    app: str | None
    passed: bool
    expires: float


@dataclass(slots=True)
class _Label:
    value: Any
    expires: float


class Joiner:
    """The bounded join, clock-free (the caller passes `now`, monotonic seconds): verdicts and labels
    keyed by (trace id or request id, judge name), each side an insertion-ordered map so the oldest
    entry (the first to expire, the first to evict) is at the front."""

    def __init__(self, metrics: AgreementMetrics, *, window_s: float, max_pending: int) -> None:
        self.metrics = metrics
        self.trust = metrics.trust
        self.window_s = window_s
        self.max_pending = max_pending
        self.verdicts: OrderedDict[tuple[str, str], _Verdict] = OrderedDict()
        self.labels: OrderedDict[tuple[str, str], _Label] = OrderedDict()

    def add_verdict(self, ids: Iterable[str], app: str | None, judge: str, passed: bool, now: float) -> None:
        for key in {(i, judge) for i in ids if i}:
            waiting = self.labels.pop(key, None)
            if waiting is not None:
                self.trust.observe_label(app, judge, waiting.value, {judge: passed})
            self.verdicts.pop(key, None)
            self.verdicts[key] = _Verdict(app, passed, now + self.window_s)
            self._bound(self.verdicts, "verdict")
        self._gauges()

    def add_label(self, ident: str, judge: str, value: Any, now: float) -> None:
        key = (ident, judge)
        verdict = self.verdicts.get(key)
        if verdict is not None:
            self.trust.observe_label(verdict.app, judge, value, {judge: verdict.passed})
            return
        # Counted now when the label can never match (unknown judge, not a verdict); else it waits.
        rejected = self.trust.rejects(judge, value)
        if rejected is not None:
            self.trust.count_label(rejected)
            return
        if self.labels.pop(key, None) is not None:  # the same person's label again: the newer one counts
            self.trust.count_label("unmatched")
        self.labels[key] = _Label(value, now + self.window_s)
        self._bound(self.labels, "label")
        self._gauges()

    def expire(self, now: float) -> int:
        """Drop what waited its window out; returns the labels counted unmatched."""
        unmatched = 0
        for side in (self.verdicts, self.labels):
            while side:
                key, entry = next(iter(side.items()))
                if entry.expires > now:
                    break
                del side[key]
                if side is self.labels:
                    unmatched += 1
        if unmatched:
            self.trust.count_label("unmatched", unmatched)
        self._gauges()
        return unmatched

    def next_expiry(self) -> float | None:
        heads = [next(iter(side.values())).expires for side in (self.verdicts, self.labels) if side]
        return min(heads) if heads else None

    def _bound(self, side: OrderedDict[tuple[str, str], Any], name: str) -> None:
        while len(side) > self.max_pending:
            side.popitem(last=False)
            self.metrics.evicted.labels(name).inc()
            if name == "label":
                self.trust.count_label("unmatched")

    def _gauges(self) -> None:
        self.metrics.pending.labels("verdict").set(len(self.verdicts))
        self.metrics.pending.labels("label").set(len(self.labels))


# -- the stage ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgreementPlan:
    results_topic: str
    labels_topic: str
    group_id: str
    window_s: float
    max_pending: int


def plan_agreement(settings: Settings) -> AgreementPlan:
    """What the stage reads; ConfigError naming the key when a topic is missing."""
    a = settings.agreement
    results = a.results_topic or settings.stream.results_topic
    problems = []
    if not results:
        problems.append(("agreement.results_topic", "required (or stream.results_topic): the judges' "
                                                    "verdicts are read from it"))
    if not a.labels_topic:
        problems.append(("agreement.labels_topic", "required: the human labels are read from it"))
    if results and results == a.labels_topic:
        problems.append(("agreement.labels_topic", "must differ from the results topic"))
    if problems:
        raise ConfigError(problems)
    assert results is not None and a.labels_topic is not None
    return AgreementPlan(results, a.labels_topic, a.group_id or DEFAULT_GROUP, a.window_s, a.max_pending)


class BadLabel(ValueError):
    """A labels-topic record that is not a label."""


def decode_label(value: bytes | None) -> tuple[str, Any, Any]:
    """(trace id or request id, judge name, value) of one labels-topic record; `BadLabel` says why not.
    The name and value are checked by `TrustMetrics.observe_label` (unknown judge, invalid value)."""
    if value is None:
        raise BadLabel("the record has no value (a tombstone)")
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise BadLabel(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadLabel(f"a JSON {type(obj).__name__}, not an object")
    ident = obj.get("trace_id") or obj.get("request_id")
    if not isinstance(ident, str):
        raise BadLabel("no trace_id or request_id string")
    return normalise_id(ident), obj.get("name", obj.get("judge")), obj.get("value")


class AgreementStage(Stage):
    name = "agreement"

    def __init__(self, plan: AgreementPlan, metrics: AgreementMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = plan
        self.metrics = metrics
        self.joiner = Joiner(metrics, window_s=plan.window_s, max_pending=plan.max_pending)
        self.clock = clock
        self.runtime: ConsumerRuntime | None = None

    def topics(self) -> list[str]:
        return [self.plan.results_topic, self.plan.labels_topic]

    def subscription(self) -> str:
        return f"results {self.plan.results_topic}, labels {self.plan.labels_topic}"

    def prepare(self, runtime: ConsumerRuntime) -> None:
        self.runtime = runtime

    def tick(self, now: float) -> None:
        self.joiner.expire(self.clock())

    def wait_hint(self, now: float) -> float | None:
        due = self.joiner.next_expiry()
        return None if due is None else max(0.0, due - self.clock())

    def process(self, tp: TopicPartition, records: list[Any]) -> None:
        assert self.runtime is not None
        track = self.runtime.tracker.track
        now = self.clock()
        labels = tp.topic == self.plan.labels_topic
        for record in records:
            ticket = track(tp, record.offset)
            try:
                if labels:
                    self._label(record, now)
                else:
                    self._result(record, now)
            finally:
                ticket.release()

    def _label(self, record: Any, now: float) -> None:
        try:
            ident, judge, value = decode_label(record.value)
        except BadLabel as exc:
            self._bad("labels", record, str(exc))
            self.metrics.trust.count_label("invalid")
            return
        self.metrics.records.labels("labels", "ok").inc()
        self.joiner.add_label(ident, judge, value, now)

    def _result(self, record: Any, now: float) -> None:
        try:
            line, session = decode_line(record.value)
        except BadResult as exc:
            self._bad("results", record, exc.message)
            return
        self.metrics.records.labels("results", "ok").inc()
        if session is not None or line.get("backfill"):
            return
        ids = [normalise_id(i) for i in (line.get("trace_id"), line.get("request_id")) if i]
        for a in line["assessments"]:
            if isinstance(a.get("passed"), bool) and not a.get("shadow_of"):
                self.joiner.add_verdict(ids, line.get("app"), a["name"], a["passed"], now)

    def _bad(self, kind: str, record: Any, why: str) -> None:
        self.metrics.records.labels(kind, "invalid").inc()
        log.warning("%s[%s]@%s is not a %s record: %.200s", record.topic, record.partition, record.offset,
                    kind[:-1], why)

    def stopping(self) -> None:
        held = len(self.joiner.labels)
        if held:
            log.info("stopping: %d labels were still waiting for their verdicts", held)


class AgreementRunner(ConsumerRuntime):
    """`tracejudge agreement` embedded (same API as `StreamRunner`: `start()`, `stop()`, `join()`,
    `registry`, `http_port`, `wait_assigned()`). `clock` (monotonic seconds) times the window."""

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        plan = plan_agreement(settings)
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        judges = list(settings.judges.judge_settings()) if settings.judges is not None else None
        metrics = AgreementMetrics(registry, max_apps=settings.prometheus.max_apps, judges=judges)
        self.plan = plan
        self.agreement_metrics = metrics
        stage = AgreementStage(plan, metrics, clock)
        super().__init__(settings, stage, metrics, registry, log=log, title="tracejudge agreement",
                         group_id=plan.group_id)
        self.joiner = stage.joiner
