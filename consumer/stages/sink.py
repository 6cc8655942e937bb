"""`tracejudge sink <kind>`: write the judges' verdicts from the results topic back where people look.

The write-back stage on the consumer runtime (`consumer/runtime/loop.py`; its producer, which sends
the dead letters, is `consumer/runtime/producer.py`), one consumer group per kind
(`tracejudge-sink-<kind>` unless `sink.group_id` says otherwise), so several sinks read every result
side by side and each fails and lags on its own:

    results topic ──poll──▶ SinkStage.process: decode each record as a tracejudge result
                                │  not JSON, not a result, a newer schema_version
                                │      └──▶ dead-letter topic (tracejudge_sink_dead_letters_total)
                                ▼
            per-partition batch ──checkpoint──▶ Sink.write(batch) ──returns──▶ tickets released ──▶ commit
            (sink.max_batch_records, or            │
             sink.checkpoint_interval_ms)          └─ RetryLater(after_s): the partition is paused and
                                                      the same batch offered again after a capped
                                                      exponential back-off; nothing past it committed

Session results: when a session results topic is configured (`sink.session_results_topic`, default
`sessions.results_topic`; `sink.write_sessions: false` turns it off) and the sink handles sessions
(`Sink.accepts_sessions`, true for `mlflow` and `otlp`), the stage subscribes to it as well, in the same
group: a `"kind": "session"` line is decoded into a `schemas.session.SessionResult` (`SinkRecord.session`)
and batched, written and committed like any result. A session line met by a sink that does not handle
sessions (a session topic shared with the results topic) is skipped, counted (`session_unsupported`).

A sink is one small class (`consumer/sinks/base.py`): `write(batch) -> WriteReport`. Built-in
kinds are `mlflow` and `otlp`; `sink.plugins: {kind: "package.module:Class"}` adds more. The sink's
own section (`sink.<kind>`) is handed to its settings class's `from_mapping(mapping, "sink.<kind>")`
(the class named by the sink's `settings_class` attribute, else the annotation of its constructor's
first parameter; without one the sink gets the mapping itself), then `Sink(settings, registry)`.

Delivery is at least once: a batch written and not yet committed when the process dies or the
partition moves is written again by the next owner, so sinks make their writes idempotent. A
rebalance drops the batches not yet written, uncommitted. SIGTERM stops fetching, offers the pending
batches once more within `stream.shutdown_grace_seconds`, commits what was written, and leaves the
group. Any exception from `write` other than `RetryLater` stops the process (status 4), committing
nothing past the failed batch.

Neighbours: the command's arguments are `consumer/commands/sink.py`, the stage's Prometheus series
(`SinkMetrics`) `metrics/telemetry/sinks.py`.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from kafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import ConfigError, Settings
from tracejudge.consumer.runtime.logs import suppress_logged
from tracejudge.consumer.runtime.loop import ConsumerRuntime
from tracejudge.consumer.runtime.offsets import Ticket
from tracejudge.consumer.runtime.producer import Outputs
from tracejudge.consumer.runtime.producing import RateLimitedLog
from tracejudge.consumer.runtime.stage import NO_LIMIT, Runtime, Stage
from tracejudge.consumer.sinks.base import RetryLater, Sink, SinkBatch, SinkRecord, WriteReport
from tracejudge.metrics.plugins import load_plugin
from tracejudge.metrics.telemetry.sinks import SinkMetrics
from tracejudge.schemas.results_line import RESULT_FORMAT, BadResult, decode_line

__all__ = ["SinkPlan", "SinkRunner", "SinkStage", "build_sink", "load_sink_class",
           "plan_sink", "shown_for"]

log = logging.getLogger("tracejudge.sink")

_KIND = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


# -- metrics --------------------------------------------------------------------------------------


# -- the stage ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Partition:
    """One assigned partition's records not written yet, in offset order."""

    tp: TopicPartition
    records: list[SinkRecord] = field(default_factory=list)
    tickets: list[Ticket] = field(default_factory=list)
    # When the oldest of `records` arrived (its checkpoint is due `checkpoint_interval_ms` later).
    since: float = 0.0
    # The batch being offered and its tickets; kept while the sink asks to retry it.
    batch: SinkBatch | None = None
    batch_tickets: list[Ticket] = field(default_factory=list)
    attempts: int = 0
    due: float = 0.0
    reason: str = ""

    def unwritten(self) -> int:
        return len(self.records) + (len(self.batch.records) if self.batch is not None else 0)


class SinkStage(Stage):
    """Decodes results, batches them per partition, calls `Sink.write` at each checkpoint, releases
    the batch's tickets (so the runtime commits them) when it returns; holds a partition paused while
    the sink asks to retry."""

    def __init__(self, sink: Sink, plan: SinkPlan, settings: Settings, metrics: SinkMetrics) -> None:
        self.sink = sink
        self.plan = plan
        self.kind = plan.kind
        self.name = f"sink-{plan.kind}"
        self.settings = settings
        self.metrics = metrics
        self.max_batch = settings.sink.max_batch_records
        self.interval = settings.sink.checkpoint_interval_ms / 1000
        self.max_backoff = settings.sink.max_retry_backoff_s
        # Records fetched and not written, not counting held partitions (they are paused anyway).
        self.max_in_flight = max(settings.stream.max_in_flight, self.max_batch)
        self.runtime: Runtime | None = None
        # The exception that stopped the sink (a write that raised something other than RetryLater).
        self.failure: BaseException | None = None
        self._parts: dict[TopicPartition, _Partition] = {}
        self._log = RateLimitedLog(log)
        # Session results are offered only to a sink that handles them (`Sink.accepts_sessions`).
        self.sessions = bool(getattr(sink, "accepts_sessions", False))
        self.session_topic = plan.session_results_topic if self.sessions else None

    # -- start-up -------------------------------------------------------------------------------------

    def topics(self) -> list[str]:
        topics = [self.plan.results_topic]
        if self.session_topic and self.session_topic not in topics:
            topics.append(self.session_topic)
        return topics

    def subscription(self) -> str:
        if self.session_topic and self.session_topic != self.plan.results_topic:
            return (f"{self.plan.results_topic} (results) and {self.session_topic} (session results), for "
                    f"the {self.kind} sink")
        return f"{self.plan.results_topic} (results, for the {self.kind} sink)"

    def prepare(self, runtime: ConsumerRuntime) -> None:
        self.runtime = runtime
        # Connect and check the configuration before the first poll (`ConfigError` ends with status 2).
        self.sink.setup()

    def outputs(self) -> Outputs:
        # Dead letters only (counted through `count_dead_letter` and `dead_letter_publish_failures`);
        # the runtime's producer sends them, waits for them on revocation and at shutdown.
        return Outputs(metrics=self.metrics, dead_letter_topic=self.plan.dead_letter_topic,
                       record_format=RESULT_FORMAT)

    def open(self, runtime: Runtime) -> None:
        self.runtime = runtime

    # -- the loop -------------------------------------------------------------------------------------

    def process(self, tp: TopicPartition, records: list[Any]) -> None:
        assert self.runtime is not None
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Partition(tp)
        track = self.runtime.tracker.track
        now = time.monotonic()
        for record in records:
            ticket = track(tp, record.offset)
            try:
                result, session = decode_line(record.value)
            except BadResult as exc:
                self.runtime.producing.dead_letter(record, exc.reason, exc.message, ticket)
                continue
            if session is not None and not self.sessions:
                self._unsupported_session(ticket)
                continue
            if not part.records:
                part.since = now
            part.records.append(SinkRecord(record.topic, record.partition, record.offset, record.key, result,
                                           session))
            part.tickets.append(ticket)

    def _unsupported_session(self, ticket: Ticket) -> None:
        """A session result for a sink that does not handle sessions: skipped (counted), its offset
        released for the next commit."""
        report = WriteReport()
        report.skip("session_unsupported")
        self.metrics.count_skipped(report)
        ticket.release()
        assert self.runtime is not None
        self.runtime.request_commit()

    def tick(self, now: float) -> None:
        self._checkpoints(now)

    def polled(self, now: float) -> None:
        self._checkpoints(now)

    def room(self) -> int:
        assert self.runtime is not None
        in_flight = self.runtime.tracker.in_flight
        if in_flight == 0:
            return NO_LIMIT
        held = sum(p.unwritten() for p in self._parts.values() if p.attempts)
        return self.max_in_flight - (in_flight - held)

    def held(self) -> Collection[TopicPartition]:
        return [p.tp for p in self._parts.values() if p.attempts]

    def wait_hint(self, now: float) -> float | None:
        hint: float | None = None
        for part in self._parts.values():
            if part.attempts:
                due = part.due - now
            elif part.records:
                due = 0.0 if len(part.records) >= self.max_batch else part.since + self.interval - now
            else:
                continue
            hint = due if hint is None else min(hint, due)
        return None if hint is None else max(0.0, hint)

    def _checkpoints(self, now: float) -> None:
        for part in list(self._parts.values()):
            if part.attempts:
                if now >= part.due and not self._offer(part):
                    continue
                if part.attempts:
                    continue
            while part.records and (len(part.records) >= self.max_batch or now - part.since >= self.interval):
                self._take(part)
                if not self._offer(part):
                    break

    def _take(self, part: _Partition) -> None:
        """The next batch of the partition: its oldest `max_batch_records` records."""
        n = self.max_batch
        records, part.records = part.records[:n], part.records[n:]
        tickets, part.tickets = part.tickets[:n], part.tickets[n:]
        part.batch = SinkBatch(part.tp.topic, part.tp.partition, records)
        part.batch_tickets = tickets

    def _offer(self, part: _Partition) -> bool:
        """Write the partition's batch; True when written (its tickets released)."""
        batch = part.batch
        assert batch is not None
        try:
            report = self.sink.write(batch)
        except RetryLater as exc:
            self._hold(part, exc)
            return False
        except BaseException as exc:
            self.failure = exc
            first, last = batch.records[0].offset, batch.records[-1].offset
            log.error("the %s sink failed writing %s[%d] offsets %d-%d (%s: %s); stopping, nothing past "
                      "it is committed", self.kind, batch.topic, batch.partition, first, last,
                      type(exc).__name__, exc, exc_info=exc)
            raise
        if part.attempts:
            log.info("%s[%d]: the %s sink wrote the held batch after %d retries (%s); fetching it again",
                     batch.topic, batch.partition, self.kind, part.attempts, part.reason)
        part.batch, part.attempts, part.reason = None, 0, ""
        tickets, part.batch_tickets = part.batch_tickets, []
        for ticket in tickets:
            ticket.release()
        self.metrics.written(report if isinstance(report, WriteReport) else WriteReport())
        assert self.runtime is not None
        self.runtime.request_commit()
        return True

    def _hold(self, part: _Partition, exc: RetryLater) -> None:
        part.attempts += 1
        part.reason = exc.reason
        after = max(0.0, float(exc.after_s))
        backoff = min(self.max_backoff, max(after, 0.05) * 2 ** min(part.attempts - 1, 20))
        delay = max(after, backoff)
        part.due = time.monotonic() + delay
        self.metrics.retried(exc.reason)
        assert part.batch is not None
        self._log.warning(f"retry {exc.reason}", "%s[%d]: the %s sink cannot write %d results now (%s); "
                          "partition paused, offering the batch again in %.1f s (attempt %d), nothing "
                          "past offset %d committed", part.tp.topic, part.tp.partition, self.kind,
                          len(part.batch.records), exc.reason, delay, part.attempts + 1,
                          part.batch.records[0].offset)

    def busy(self) -> int:
        return sum(p.unwritten() for p in self._parts.values())

    # -- rebalance (IO thread) ------------------------------------------------------------------------

    async def revoke(self, tps: set[TopicPartition], deadline: float, sleep: Any) -> str:
        # Batches not written are dropped, uncommitted: the next owner reads them again. Dead letters
        # on their way get until the deadline (the runtime waits for them).
        dropped = self._drop(tps)
        return f"dropped {dropped} unwritten results" if dropped else ""

    def lose(self, tps: set[TopicPartition]) -> None:
        self._drop(tps)

    def _drop(self, tps: set[TopicPartition]) -> int:
        dropped = 0
        for tp in tps:
            part = self._parts.pop(tp, None)
            if part is not None:
                dropped += part.unwritten()
        return dropped

    # -- shutdown -------------------------------------------------------------------------------------

    def drain(self, deadline: float) -> None:
        """Offer every pending batch once more (a held one too, whatever its back-off) while the grace
        period lasts; what the sink still cannot write stays uncommitted."""
        if self.failure is None:
            try:
                for part in list(self._parts.values()):
                    if time.monotonic() >= deadline:
                        break
                    if part.batch is not None and not self._offer(part):
                        continue
                    while part.records and time.monotonic() < deadline:
                        self._take(part)
                        if not self._offer(part):
                            break
            except Exception:  # logged by _offer; the process exits non-zero
                pass

    def close(self) -> None:
        with suppress_logged(log, f"closing the {self.kind} sink"):
            self.sink.close()


# -- choosing and building the sink -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SinkPlan:
    """What `tracejudge sink <kind>` runs, resolved from the settings."""

    kind: str
    # "package.module:Class" (None: unknown kind, only a sink given directly can run).
    spec: str | None
    results_topic: str
    dead_letter_topic: str | None
    group_id: str
    section: dict[str, Any]
    # The session results topic (read too by a sink that handles sessions); None: none configured.
    session_results_topic: str | None = None


def plan_sink(settings: Settings, kind: str) -> SinkPlan:
    """Resolve the sink section for `kind`; `ConfigError` naming the key when it cannot run."""
    s = settings.sink
    problems: list[tuple[str, str]] = []
    kinds = s.kinds()
    if not _KIND.match(kind):
        problems.append(("KIND", f"{kind!r} is not a sink kind (lowercase letters, digits, '_', '-')"))
    topic = s.results_topic or settings.stream.results_topic
    if not topic:
        problems.append(("sink.results_topic", "is required: the results topic to read (or "
                                               "stream.results_topic, which it defaults to)"))
    elif s.dead_letter_topic == topic:
        problems.append(("sink.dead_letter_topic", f"is the results topic {topic!r}; the sink would read "
                                                   "its own dead letters"))
    session_topic = _session_topic(settings)
    if session_topic is not None and s.dead_letter_topic == session_topic:
        problems.append(("sink.dead_letter_topic", f"is the session results topic {session_topic!r}; the "
                                                   "sink would read its own dead letters"))
    if problems:
        raise ConfigError(problems)
    assert topic is not None
    return SinkPlan(kind=kind, spec=kinds.get(kind), results_topic=topic,
                    dead_letter_topic=s.dead_letter_topic, group_id=s.group_id or f"tracejudge-sink-{kind}",
                    section=s.section(kind), session_results_topic=session_topic)


def _session_topic(settings: Settings) -> str | None:
    """`sink.session_results_topic`, else `sessions.results_topic`; None with `sink.write_sessions: false`."""
    s = settings.sink
    if not getattr(s, "write_sessions", True):
        return None
    sessions = getattr(settings, "sessions", None)
    return getattr(s, "session_results_topic", None) or getattr(sessions, "results_topic", None)


def load_sink_class(plan: SinkPlan, settings: Settings | None = None) -> type[Sink]:
    """Import the sink's class, only now: a sink whose module is missing breaks only that kind."""
    plugin = settings is not None and plan.kind in settings.sink.plugins
    where = f"sink.plugins.{plan.kind}" if plugin else "KIND"
    if plan.spec is None:
        known = ", ".join(sorted(settings.sink.kinds() if settings else ("mlflow", "otlp")))
        raise ConfigError([(where, f"unknown sink {plan.kind!r}; known: {known} (add one with "
                                   f"sink.plugins.{plan.kind}: 'package.module:Class')")])
    try:  # the one plug-in loader (tracejudge.metrics.plugins)
        cls = load_plugin(plan.spec, key=where, noun="sink class")
    except ConfigError as exc:
        raise ConfigError(where, f"the {plan.kind} sink is not available: {exc.detail}") from None
    if not (isinstance(cls, type) and issubclass(cls, Sink)):
        raise ConfigError([(where, f"{plan.spec!r} is not a tracejudge sink class (a subclass of "
                                   "tracejudge.consumer.sinks.base.Sink)")])
    return cls


def sink_settings_type(cls: type[Sink]) -> Any:
    """The sink's settings class: `cls.settings_class`, else the annotation of the constructor's first
    parameter when it has `from_mapping`; None when the sink takes the mapping itself."""
    explicit = getattr(cls, "settings_class", None)
    if explicit is not None:
        return explicit
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if not params:
        return None
    annotation = params[0].annotation
    if isinstance(annotation, str):  # `from __future__ import annotations`: a name in its module
        annotation = getattr(sys.modules.get(cls.__module__), annotation.strip(), None)
    return annotation if isinstance(annotation, type) and hasattr(annotation, "from_mapping") else None


def build_sink(plan: SinkPlan, cls: type[Sink], registry: CollectorRegistry) -> Sink:
    """`cls(settings, registry)`, the settings validated from `sink.<kind>` (`ConfigError` names the key)."""
    settings_type = sink_settings_type(cls)
    if settings_type is not None:
        sink_settings = settings_type.from_mapping(plan.section, f"sink.{plan.kind}")
    else:
        sink_settings = dict(plan.section)
    try:
        return cls(sink_settings, registry)  # type: ignore[call-arg]
    except TypeError as exc:
        if "argument" not in str(exc):
            raise
        raise ConfigError([(f"sink.plugins.{plan.kind}", f"{plan.spec}: a sink class takes (settings, "
                                                         f"registry): {exc}")]) from None


class SinkRunner(ConsumerRuntime):
    """`tracejudge sink <kind>` embedded: the write-back stage on the consumer runtime.

    Without `sink`, the kind's class is imported and built from the settings (`sink.<kind>`); a sink
    given directly registers its metrics on `registry` (pass the same one). Same embedding API as
    `StreamRunner`: `start()`, `stop()`, `join()`, `run()`, `http_port`, `registry`, `assignment`,
    `wait_assigned()`, `error`. Raises `ConfigError` for a configuration that cannot work.
    """

    def __init__(self, settings: Settings, kind: str, sink: Sink | None = None, *,
                 registry: CollectorRegistry | None = None) -> None:
        plan = plan_sink(settings, kind)
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        if sink is None:
            sink = build_sink(plan, load_sink_class(plan, settings), registry)
        self.kind = kind
        self.sink = sink
        self.plan = plan
        metrics = SinkMetrics(registry, kind)
        stage = SinkStage(sink, plan, settings, metrics)
        super().__init__(settings, stage, metrics, registry, log=log, title=f"tracejudge sink {kind}",
                         group_id=plan.group_id, lag_counts_unfinished=True,
                         show_setting=shown_for(settings, kind))
        self.sink_metrics = metrics

    def run(self, stop_event: Any = None) -> None:
        """Consume until stopped; raises what a failed write raised (after committing what was written)."""
        super().run(stop_event)
        stage = self.stage
        assert isinstance(stage, SinkStage)
        if stage.failure is not None:
            raise stage.failure


# The settings a sink uses (the start-up summary and --check-config show only these).
_SINK_STREAM_KEYS = ("sessions.results_topic", "stream.poll_timeout_ms", "stream.commit_interval_ms",
                     "stream.shutdown_grace_seconds", "stream.lag_interval_seconds", "stream.max_in_flight")


def shown_for(settings: Settings, kind: str) -> Any:
    """Whether `--check-config` and the start-up summary show a key: the keys the `kind` sink reads."""
    others = tuple(f"sink.{k}." for k in settings.sink.kinds() if k != kind) + tuple(
        f"sink.{k}" for k in ("mlflow", "otlp") if k != kind)

    def show(key: str) -> bool:
        if key.startswith(("sink.", "http.", "logging.", "producer.")):
            return not (key.startswith(others) or key in others)
        if key.startswith("kafka."):
            return key != "kafka.group_id"
        return key in _SINK_STREAM_KEYS

    return show
