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
             sink.checkpoint_interval_ms)          ├─ RetryLater(after_s): the partition is paused and
                    ▲                                  │  the same batch offered again after a capped
                    │                                  │  exponential back-off; nothing past it committed
                    │                                  └─ report.defer(record, after_s): the other records
                    └── due: offered again, on its own ◀── are done; the deferred one is parked (ticket
                                                           kept: no commit past it), the partition flows

Parked results (`consumer/stages/parking.py`): a sink defers a record it cannot write yet (the MLflow
sink: its trace has not reached the server) rather than holding the partition. The record waits in a
bounded set (`sink.max_parked_records` over all partitions) with its ticket unreleased, so the partition
is committed only up to its lowest parked record, and is offered again in a batch of its own when due;
the sink chooses each wait (a growing back-off) and gives up in the end (a skip, counted). When the set
is full the records that do not fit are held the old way: the partition paused, the batch of them
offered again after a back-off (`tracejudge_sink_park_full_total`). Series: `tracejudge_sink_parked_records`,
`tracejudge_sink_parked_total`, `tracejudge_sink_parked_retries_total`, `tracejudge_sink_given_up_total`.

Session results: when a session results topic is configured (`sink.session_results_topic`, default
`sessions.results_topic`; `sink.write_sessions: false` turns it off) and the sink handles sessions
(`Sink.accepts_sessions`, true for `mlflow` and `otlp`), the stage subscribes to it as well, in the same
group: a `"kind": "session"` line is decoded into a `schemas.session.SessionResult` (`SinkRecord.session`)
and batched, written and committed like any result. A session line met by a sink that does not handle
sessions (a session topic shared with the results topic) is skipped, counted (`session_unsupported`).

Findings: likewise the findings topic (`sink.findings_topic`, default `findings.findings_topic`;
`sink.write_findings: false` turns it off) for a sink with `Sink.accepts_findings` (`mlflow`, `otlp`):
each line is checked by `consumer/sinks/findings.decode_finding` (a bad one is dead-lettered, reason
`invalid_json` or `not_a_finding`) and batched, written, parked and committed like any result.

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
from tracejudge.consumer.sinks.findings import FINDING_FORMAT, decode_finding
from tracejudge.consumer.stages.parking import Parked, ParkedSet
from tracejudge.metrics.plugins import load_plugin
from tracejudge.metrics.telemetry.sinks import SinkMetrics
from tracejudge.schemas.result import SourceRef
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
        # Records the sink deferred, waiting to be offered again (bounded over every partition).
        self.parked = ParkedSet(getattr(settings.sink, "max_parked_records", 10_000))
        self._log = RateLimitedLog(log)
        # Session results are offered only to a sink that handles them (`Sink.accepts_sessions`).
        self.sessions = bool(getattr(sink, "accepts_sessions", False))
        self.session_topic = plan.session_results_topic if self.sessions else None
        # Finding lines likewise, only to a sink that handles them (`Sink.accepts_findings`).
        self.findings_topic = plan.findings_topic if getattr(sink, "accepts_findings", False) else None

    # -- start-up -------------------------------------------------------------------------------------

    def topics(self) -> list[str]:
        topics = [self.plan.results_topic]
        if self.session_topic and self.session_topic not in topics:
            topics.append(self.session_topic)
        if self.findings_topic and self.findings_topic not in topics:
            topics.append(self.findings_topic)
        return topics

    def subscription(self) -> str:
        extra = "".join(f" and {topic} ({what})" for topic, what in (
            (self.session_topic, "session results"), (self.findings_topic, "findings"))
            if topic and topic != self.plan.results_topic)
        if extra:
            return f"{self.plan.results_topic} (results){extra}, for the {self.kind} sink"
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
            finding = record.topic == self.findings_topic
            try:
                result, session = (decode_finding(record.value), None) if finding \
                    else decode_line(record.value)
            except BadResult as exc:
                source = SourceRef(format=FINDING_FORMAT, topic=record.topic, partition=record.partition,
                                   offset=record.offset) if finding else None
                self.runtime.producing.dead_letter(record, exc.reason, exc.message, ticket, source=source)
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
        return self.max_in_flight - (in_flight - held - len(self.parked))

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
        if (parked_due := self.parked.next_due()) is not None:
            hint = parked_due - now if hint is None else min(hint, parked_due - now)
        return None if hint is None else max(0.0, hint)

    def _checkpoints(self, now: float) -> None:
        parked_due = self.parked.next_due()
        if parked_due is not None and parked_due <= now:
            for tp in self.parked.partitions():
                if tp in self._parts:
                    self._offer_parked(self._parts[tp], self.parked.take_due(tp, now, self.max_batch))
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

    def _write(self, batch: SinkBatch) -> WriteReport:
        """`Sink.write`; `RetryLater` passes through, anything else stops the sink (logged, kept)."""
        try:
            report = self.sink.write(batch)
        except RetryLater:
            raise
        except BaseException as exc:
            self.failure = exc
            first, last = batch.records[0].offset, batch.records[-1].offset
            log.error("the %s sink failed writing %s[%d] offsets %d-%d (%s: %s); stopping, nothing past "
                      "it is committed", self.kind, batch.topic, batch.partition, first, last,
                      type(exc).__name__, exc, exc_info=exc)
            raise
        return report if isinstance(report, WriteReport) else WriteReport()

    def _offer(self, part: _Partition) -> bool:
        """Write the partition's batch; True when written (its tickets released, what the sink deferred
        parked); False when the partition holds (the sink asked to retry, or the parked set is full)."""
        batch = part.batch
        assert batch is not None
        try:
            report = self._write(batch)
        except RetryLater as exc:
            self._hold(part, exc)
            return False
        attempts, reason = part.attempts, part.reason
        part.batch, part.attempts, part.reason = None, 0, ""
        tickets, part.batch_tickets = part.batch_tickets, []
        self._settle(part, [(r, t, None) for r, t in zip(batch.records, tickets, strict=True)], report,
                     attempts)
        if part.batch is not None:
            return False  # held again: the parked set is still full
        if attempts:
            log.info("%s[%d]: the %s sink wrote the held batch after %d retries (%s); fetching it again",
                     batch.topic, batch.partition, self.kind, attempts, reason)
        return True

    def _offer_parked(self, part: _Partition, items: list[Parked]) -> None:
        """Offer parked records again, in a batch of their own. Whatever the sink defers again is parked
        again (their places were just freed); a `RetryLater` parks them all again after its wait."""
        if not items:
            return
        self.metrics.parked_retried(len(items))
        batch = SinkBatch(part.tp.topic, part.tp.partition, [p.record for p in items])
        try:
            report = self._write(batch)
        except RetryLater as exc:
            self.metrics.retried(exc.reason)
            now = time.monotonic()
            for p in items:
                p.offers += 1
                wait = max(float(exc.after_s), 0.05) * 2 ** min(p.offers - 1, 20)
                p.due = now + min(self.max_backoff, wait)
                self.parked.park(part.tp, p)
            self.metrics.set_parked(len(self.parked))
            return
        self._settle(part, [(p.record, p.ticket, p) for p in items], report)

    def _settle(self, part: _Partition, done: list[tuple[SinkRecord, Ticket, Parked | None]],
                report: WriteReport, attempts: int = 0) -> None:
        """After a write returned: release the tickets of the records it finished, park the deferred
        ones (a parked record taken out for this offer always fits again), hold the partition with
        those that do not fit (`attempts`: how often the batch was held already), count, and ask for a
        commit."""
        now = time.monotonic()
        overflow: list[tuple[SinkRecord, Ticket]] = []
        first_parked = 0
        for record, ticket, was in done:
            deferral = report.deferred.get(record.offset)
            if deferral is None:
                ticket.release()
            elif was is not None:
                was.offers += 1
                was.due, was.reason = now + deferral.after_s, deferral.reason
                self.parked.park(part.tp, was)
            elif self.parked.room() > 0:
                item = Parked(record, ticket, now + deferral.after_s, deferral.reason, now)
                self.parked.park(part.tp, item)
                first_parked += 1
            else:
                overflow.append((record, ticket))
        self.metrics.written(report)
        self.metrics.parked_now(first_parked, len(self.parked), report.given_up)
        if overflow:
            self._hold_overflow(part, overflow, report, attempts)
        assert self.runtime is not None
        self.runtime.request_commit()

    def _hold_overflow(self, part: _Partition, overflow: list[tuple[SinkRecord, Ticket]],
                       report: WriteReport, attempts: int) -> None:
        """The parked set is full: hold the partition with the deferred records that did not fit, as
        for `RetryLater` (offered again after the back-off, growing per hold; the partition paused)."""
        assert part.batch is None  # only a fresh batch's records are new to the parked set
        self.metrics.park_full(len(overflow))
        first = report.deferred[overflow[0][0].offset]
        part.batch = SinkBatch(part.tp.topic, part.tp.partition, [r for r, _ in overflow])
        part.batch_tickets = [t for _, t in overflow]
        part.attempts = attempts
        self._log.warning("parked set full", "the %s sink's parked set is full (sink.max_parked_records = "
                          "%d); holding %s[%d] with %d deferred results instead", self.kind,
                          self.parked.limit, part.tp.topic, part.tp.partition, len(overflow))
        self._hold(part, RetryLater(first.reason, after_s=first.after_s), counted=False)

    def _hold(self, part: _Partition, exc: RetryLater, *, counted: bool = True) -> None:
        part.attempts += 1
        part.reason = exc.reason
        after = max(0.0, float(exc.after_s))
        backoff = min(self.max_backoff, max(after, 0.05) * 2 ** min(part.attempts - 1, 20))
        delay = max(after, backoff)
        part.due = time.monotonic() + delay
        if counted:
            self.metrics.retried(exc.reason)
        assert part.batch is not None
        self._log.warning(f"retry {exc.reason}", "%s[%d]: the %s sink cannot write %d results now (%s); "
                          "partition paused, offering the batch again in %.1f s (attempt %d), nothing "
                          "past offset %d committed", part.tp.topic, part.tp.partition, self.kind,
                          len(part.batch.records), exc.reason, delay, part.attempts + 1,
                          part.batch.records[0].offset)

    def busy(self) -> int:
        return sum(p.unwritten() for p in self._parts.values()) + len(self.parked)

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
            dropped += self.parked.drop(tp)
        self.metrics.set_parked(len(self.parked))
        return dropped

    # -- shutdown -------------------------------------------------------------------------------------

    def drain(self, deadline: float) -> None:
        """Offer every pending batch once more (a held one too, whatever its back-off, and the parked
        records) while the grace period lasts; what the sink still cannot write stays uncommitted."""
        if self.failure is None:
            try:
                for part in list(self._parts.values()):
                    if time.monotonic() >= deadline:
                        break
                    self._offer_parked(part, self.parked.take_all(part.tp, self.max_batch))
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
    # The findings topic (read too by a sink that handles findings); None: none configured.
    findings_topic: str | None = None


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
    findings_topic = _findings_topic(settings)
    if findings_topic is not None and findings_topic in (topic, session_topic, s.dead_letter_topic):
        problems.append(("sink.findings_topic", f"{findings_topic!r} is also the results, session results or "
                                                "dead-letter topic; findings need a topic of their own"))
    if problems:
        raise ConfigError(problems)
    assert topic is not None
    return SinkPlan(kind=kind, spec=kinds.get(kind), results_topic=topic,
                    dead_letter_topic=s.dead_letter_topic, group_id=s.group_id or f"tracejudge-sink-{kind}",
                    section=s.section(kind), session_results_topic=session_topic,
                    findings_topic=findings_topic)


def _session_topic(settings: Settings) -> str | None:
    """`sink.session_results_topic`, else `sessions.results_topic`; None with `sink.write_sessions: false`."""
    s = settings.sink
    if not getattr(s, "write_sessions", True):
        return None
    sessions = getattr(settings, "sessions", None)
    return getattr(s, "session_results_topic", None) or getattr(sessions, "results_topic", None)


def _findings_topic(settings: Settings) -> str | None:
    """`sink.findings_topic`, else `findings.findings_topic`; None with `sink.write_findings: false`."""
    s = settings.sink
    if not getattr(s, "write_findings", True):
        return None
    findings = getattr(settings, "findings", None)
    return getattr(s, "findings_topic", None) or getattr(findings, "findings_topic", None)


def load_sink_class(plan: SinkPlan, settings: Settings | None = None) -> type[Sink]:
    """Import the sink's class, only now: a sink whose module is missing breaks only that kind."""
    plugin = settings is not None and plan.kind in settings.sink.plugins
    where = f"sink.plugins.{plan.kind}" if plugin else "KIND"
    if plan.spec is None:
        known = ", ".join(sorted(settings.sink.kinds() if settings else ("mlflow", "otlp", "phoenix")))
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
_SINK_STREAM_KEYS = ("sessions.results_topic", "findings.findings_topic", "stream.poll_timeout_ms",
                     "stream.commit_interval_ms",
                     "stream.shutdown_grace_seconds", "stream.lag_interval_seconds", "stream.max_in_flight")


def shown_for(settings: Settings, kind: str) -> Any:
    """Whether `--check-config` and the start-up summary show a key: the keys the `kind` sink reads."""
    others = tuple(f"sink.{k}." for k in settings.sink.kinds() if k != kind) + tuple(
        f"sink.{k}" for k in ("mlflow", "otlp", "phoenix") if k != kind)

    def show(key: str) -> bool:
        if key.startswith(("sink.", "http.", "logging.", "producer.")):
            return not (key.startswith(others) or key in others)
        if key.startswith("kafka."):
            return key != "kafka.group_id"
        return key in _SINK_STREAM_KEYS

    return show
