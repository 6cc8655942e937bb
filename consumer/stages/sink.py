"""`tracejudge sink <kind>`: write the judges' verdicts from the results topic back where people look.

The write-back stage on the consumer runtime (`consumer/runtime/loop.py`), one consumer group per kind
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
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import logging
import re
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import msgspec
import orjson
from kafka import KafkaProducer
from kafka.structs import TopicPartition
from prometheus_client import CollectorRegistry, Counter, Gauge

from tracejudge.consumer.config import BUILTIN_SINKS, ConfigError, Settings, load_settings
from tracejudge.consumer.runtime.arguments import with_command_port
from tracejudge.consumer.runtime.exit_status import SERVICE_FAILED
from tracejudge.consumer.runtime.loop import (
    NO_LIMIT,
    ConsumerMetrics,
    ConsumerRuntime,
    Exports,
    Stage,
    StartupError,
    add_runtime_arguments,
    cannot_connect,
    configure_logging,
    run_until_signalled,
    runtime_overrides,
    suppress_logged,
)
from tracejudge.consumer.runtime.offsets import Ticket
from tracejudge.consumer.runtime.producing import DeadLetterSink, Publisher, RateLimitedLog
from tracejudge.consumer.sinks.base import RetryLater, Sink, SinkBatch, SinkRecord, WriteReport
from tracejudge.schemas import result as result_schema
from tracejudge.schemas.result import SourceRef
from tracejudge.schemas.session import SESSION_KIND, SessionResult

__all__ = ["INVALID_JSON", "NOT_A_RESULT", "UNKNOWN_SCHEMA_VERSION", "BadResult", "SinkMetrics",
           "SinkPlan", "SinkRunner", "SinkStage", "add_arguments", "build_sink", "decode_line",
           "decode_result", "load_sink_class", "main", "plan_sink"]

log = logging.getLogger("tracejudge.sink")

# The dead-letter reasons of a sink (the `reason` label of tracejudge_sink_dead_letters_total).
INVALID_JSON = "invalid_json"
NOT_A_RESULT = "not_a_result"
UNKNOWN_SCHEMA_VERSION = "unknown_schema_version"

# The result schema this code reads (`schemas/result.py`); a line without `schema_version` is version 1.
KNOWN_SCHEMA_VERSION: int = getattr(result_schema, "SCHEMA_VERSION", 1)
# The format dead letters carry in their `tracejudge-format` header.
RESULT_FORMAT = "tracejudge_result"
_KIND = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


# -- decoding -------------------------------------------------------------------------------------


class BadResult(ValueError):
    """A results-topic record that is not a tracejudge result this code can read."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def decode_result(value: bytes | None) -> dict[str, Any]:
    """One results-topic record as the result dict (`EvaluationResult.to_dict()`'s shape, or
    `SessionResult.to_dict()`'s for a `"kind": "session"` line), or `BadResult` saying why it is not
    one: not JSON, not an object with the result's keys (`trace_id`, `request_id`, an `assessments`
    list of objects with a `name`; a session result's fields, `schemas.session`), a field of the wrong
    type, an unknown `kind`, or a `schema_version` newer than `KNOWN_SCHEMA_VERSION`."""
    return decode_line(value)[0]


def decode_line(value: bytes | None) -> tuple[dict[str, Any], SessionResult | None]:
    """`decode_result`, plus the `SessionResult` of a session line (None for a trace result)."""
    if value is None:
        raise BadResult(NOT_A_RESULT, "the record has no value (a tombstone)")
    try:
        line = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise BadResult(INVALID_JSON, f"not JSON: {exc}") from None
    if not isinstance(line, dict):
        raise BadResult(NOT_A_RESULT, f"a JSON {type(line).__name__}, not an object")
    version = line.get("schema_version", 1)
    if type(version) is not int or version < 1:
        raise BadResult(NOT_A_RESULT, f"schema_version must be a positive integer, got {version!r}")
    if version > KNOWN_SCHEMA_VERSION:
        raise BadResult(UNKNOWN_SCHEMA_VERSION, f"schema_version {version} is newer than this tracejudge "
                        f"reads ({KNOWN_SCHEMA_VERSION}); upgrade the sink")
    kind = line.get("kind")
    if kind == SESSION_KIND:
        return line, _session(line)
    if kind is not None:
        raise BadResult(NOT_A_RESULT, f"unknown result kind {kind!r:.80} (known: a trace result, without "
                        f"kind, and {SESSION_KIND!r})")
    missing = [k for k in ("trace_id", "request_id", "assessments") if k not in line]
    if missing:
        raise BadResult(NOT_A_RESULT, f"not a tracejudge result: no {', '.join(missing)}")
    for key in ("trace_id", "request_id"):
        if line[key] is not None and not isinstance(line[key], str):
            raise BadResult(NOT_A_RESULT, f"{key} must be a string or null, got {line[key]!r:.80}")
    assessments = line["assessments"]
    if not isinstance(assessments, list):
        raise BadResult(NOT_A_RESULT, f"assessments must be a list, got {type(assessments).__name__}")
    for i, a in enumerate(assessments):
        if not isinstance(a, dict) or not isinstance(a.get("name"), str):
            raise BadResult(NOT_A_RESULT, f"assessments[{i}] must be an object with a string name")
    from_dict = getattr(result_schema.EvaluationResult, "from_dict", None)
    if from_dict is not None:  # every field's type, as the schema says
        try:
            from_dict(line)
        except (msgspec.ValidationError, ValueError, TypeError) as exc:
            raise BadResult(NOT_A_RESULT, f"not a tracejudge result: {exc}") from None
    return line, None


def _session(line: dict[str, Any]) -> SessionResult:
    """A session result line, every field typed as `SessionResult` says."""
    if not isinstance(line.get("session_id"), str) or not line["session_id"]:
        raise BadResult(NOT_A_RESULT, "not a tracejudge session result: no session_id")
    assessments = line.get("assessments", [])
    if not isinstance(assessments, list) or not all(
            isinstance(a, dict) and isinstance(a.get("name"), str) for a in assessments):
        raise BadResult(NOT_A_RESULT, "not a tracejudge session result: assessments must be a list of "
                                      "objects with a string name")
    try:
        return SessionResult.from_dict(line)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise BadResult(NOT_A_RESULT, f"not a tracejudge session result: {exc}") from None


# -- metrics --------------------------------------------------------------------------------------


class SinkMetrics(ConsumerMetrics):
    """The runtime's series plus the sink stage's, labelled `sink=<kind>`. The sink's own outcome
    series (`tracejudge_sink_writes_total`, `_skipped_total`, `_retries_total`) are counted here from
    its `WriteReport`s and `RetryLater`s unless the sink registered them itself (it then counts them)."""

    def __init__(self, registry: CollectorRegistry, kind: str) -> None:
        super().__init__(registry, partition_lag=False)
        r = registry
        self.kind = kind
        self._lags: dict[tuple[str, int], int] = {}
        self.lag = Gauge("tracejudge_sink_lag_records", "Results on the results topic this sink has not "
                         "written yet (fetched or not), summed over its partitions.", ["sink"],
                         registry=r).labels(kind)
        self.batches = Counter("tracejudge_sink_batches", "Batches the sink wrote (one write per partition "
                               "per checkpoint).", ["sink"], registry=r).labels(kind)
        self.dead_letters = Counter("tracejudge_sink_dead_letters", "Results-topic records that are not "
                                    "tracejudge results this sink can read, by reason.", ["sink", "reason"],
                                    registry=r)
        self.dead_letter_publish_failures = Counter(
            "tracejudge_sink_dead_letter_publish_failures", "Dead letters the producer failed to deliver "
            "(retried; the offset waits).", ["sink"], registry=r).labels(kind)
        self.writes = _counter_unless_registered(
            r, "tracejudge_sink_writes", "Verdicts a sink wrote, or found already written (a redelivered "
            "result).", ["sink", "outcome"])
        self.skipped = _counter_unless_registered(
            r, "tracejudge_sink_skipped", "Verdicts a sink deliberately did not write, by reason.",
            ["sink", "reason"])
        self.retries = _counter_unless_registered(
            r, "tracejudge_sink_retries", "Batches a sink could not write and asked to be offered again, "
            "by reason.", ["sink", "reason"])
        if self.writes is not None:
            for outcome in ("written", "already_written"):
                self.writes.labels(kind, outcome)

    def set_lag(self, topic: str, partition: int, lag: int) -> None:
        self._lags[(topic, partition)] = lag
        self.lag.set(sum(self._lags.values()))

    def remove_lag(self, topic: str, partition: int) -> None:
        self._lags.pop((topic, partition), None)
        self.lag.set(sum(self._lags.values()))

    # What `DeadLetterSink` counts.
    def count_dead_letter(self, topic: str, reason: str, routed: bool) -> None:
        self.dead_letters.labels(self.kind, reason).inc()

    def count_skipped(self, report: WriteReport) -> None:
        """Skips the stage decided itself (no batch written)."""
        if self.skipped is not None:
            for reason, n in report.skipped.items():
                self.skipped.labels(self.kind, reason).inc(n)

    def written(self, report: WriteReport) -> None:
        self.batches.inc()
        if self.writes is not None:
            if report.written:
                self.writes.labels(self.kind, "written").inc(report.written)
            if report.already_written:
                self.writes.labels(self.kind, "already_written").inc(report.already_written)
        if self.skipped is not None:
            for reason, n in report.skipped.items():
                self.skipped.labels(self.kind, reason).inc(n)

    def retried(self, reason: str) -> None:
        if self.retries is not None:
            self.retries.labels(self.kind, reason).inc()


def _counter_unless_registered(registry: CollectorRegistry, name: str, doc: str,
                               labels: list[str]) -> Counter | None:
    try:
        return Counter(name, doc, labels, registry=registry)
    except ValueError:  # "Duplicated timeseries": the sink has its own and counts it
        return None


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
        self.runtime: ConsumerRuntime | None = None
        self.producer: KafkaProducer | None = None
        self.publisher: Publisher | None = None
        self.dead_letters: DeadLetterSink | None = None
        # Dead letters awaiting the broker's ack.
        self.letters = Exports()
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

    def open(self, runtime: ConsumerRuntime) -> None:
        self.runtime = runtime
        s = self.settings
        started = time.monotonic()
        if self.plan.dead_letter_topic:
            try:
                self.producer = KafkaProducer(**s.kafka.client_config(), **s.producer.producer_config())
            except Exception as exc:
                raise StartupError(cannot_connect("create the producer", s, exc, started)) from exc
            self.publisher = Publisher(self.producer, retry_backoff=s.producer.retry_backoff_seconds)
        # DeadLetterSink counts through `count_dead_letter` and `dead_letter_publish_failures`.
        metrics: Any = self.metrics
        self.dead_letters = DeadLetterSink(self.publisher, self.plan.dead_letter_topic, metrics,
                                           max_request_size=s.producer.max_request_size)

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
                self._dead_letter(record, exc, ticket)
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
        if self.publisher is not None:
            self.publisher.run_due_retries()
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

    def _dead_letter(self, record: Any, exc: BadResult, ticket: Ticket) -> None:
        assert self.dead_letters is not None
        source = SourceRef(format=RESULT_FORMAT, topic=record.topic, partition=record.partition,
                           offset=record.offset)
        self.dead_letters.send(source=source, reason=exc.reason, error=exc.message,
                               ticket=self.letters.start(ticket), value=record.value, key=record.key,
                               headers=record.headers, timestamp_ms=record.timestamp)

    def busy(self) -> int:
        return sum(p.unwritten() for p in self._parts.values()) + self.letters.count

    # -- rebalance (IO thread) ------------------------------------------------------------------------

    async def revoke(self, tps: set[TopicPartition], deadline: float, sleep: Any) -> str:
        # Batches not written are dropped, uncommitted: the next owner reads them again. Dead letters
        # on their way get until the deadline.
        dropped = self._drop(tps)
        while self.letters.count and time.monotonic() < deadline:
            if self.publisher is not None:
                self.publisher.run_due_retries()
            await sleep(0.01)
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
        while self.letters.count and (left := deadline - time.monotonic()) > 0:
            if self.publisher is not None:
                self.publisher.run_due_retries()
            self.letters.wait_idle(min(0.05, left))

    def close(self) -> None:
        with suppress_logged(log, f"closing the {self.kind} sink"):
            self.sink.close()
        if self.producer is not None:
            with suppress_logged(log, "closing the producer"):
                self.producer.close(timeout=5)


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
    module_name, _, attr = plan.spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError([(where, f"the {plan.kind} sink is not available: cannot import {module_name!r}: "
                                   f"{exc}")]) from None
    cls: Any = module
    for part in attr.split("."):
        cls = getattr(cls, part, None)
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
                         show_setting=_shown_for(settings, kind))
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


def _shown_for(settings: Settings, kind: str) -> Any:
    others = tuple(f"sink.{k}." for k in settings.sink.kinds() if k != kind) + tuple(
        f"sink.{k}" for k in ("mlflow", "otlp") if k != kind)

    def show(key: str) -> bool:
        if key.startswith(("sink.", "http.", "logging.", "producer.")):
            return not (key.startswith(others) or key in others)
        if key.startswith("kafka."):
            return key != "kafka.group_id"
        return key in _SINK_STREAM_KEYS

    return show


# -- command line ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `tracejudge sink`; each flag overrides its configuration key."""
    parser.add_argument("kind", metavar="KIND", action=_SinkKind,
                        help="mlflow (MLflow assessments on the traces), otlp (OpenTelemetry "
                             "gen_ai.evaluation.result events to a collector), or a kind named in "
                             "sink.plugins; `tracejudge sink KIND --help` describes that sink and its "
                             "sink.KIND: settings")
    add_runtime_arguments(
        parser, command="sink", config_help="YAML configuration file (its sink: section)",
        group=("sink.group_id", "consumer group (sink.group_id, default tracejudge-sink-KIND)"),
        results=("sink.results_topic",
                 "the results topic to read (sink.results_topic, default stream.results_topic)"),
        dead_letters=("sink.dead_letter_topic",
                      "route records that are not results here (sink.dead_letter_topic)"))


class _SinkKind(argparse.Action):
    """Stores KIND and makes the help the chosen sink's: argparse takes the positional before a later
    `--help`, so `tracejudge sink mlflow --help` describes the MLflow sink and its `sink.mlflow:` keys."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        description = sink_help(values)
        if description is not None:
            parser.description, parser.epilog = description


def sink_help(kind: str) -> tuple[str, str] | None:
    """(what the built-in sink `kind` does, its settings section and keys) for `--help`, read off the
    sink's module docstring and settings class so the help cannot drift from them; None for a kind
    that is not built in (a plugin's class is named in the configuration, unread at `--help`)."""
    spec = BUILTIN_SINKS.get(kind)
    if spec is None:
        return None
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        return f"the {kind} sink (not available here: {exc})", ""
    doc = sys.modules[cls.__module__].__doc__ or ""
    summary = " ".join(doc.strip().split("\n\n", 1)[0].split())
    settings_type = sink_settings_type(cls)
    keys = []
    if settings_type is not None and dataclasses.is_dataclass(settings_type):
        for f in dataclasses.fields(settings_type):
            shown = f.default if f.default is not dataclasses.MISSING else None
            if isinstance(shown, bool):
                shown = "true" if shown else "false"  # as written in the YAML file
            keys.append(f.name if shown is None else f"{f.name} (default {shown})")
    settings = (f"Settings: the sink.{kind}: section of --config: {', '.join(keys)}. "
                if keys else f"Settings: the sink.{kind}: section of --config. ")
    epilog = (settings + "It reads sink.results_topic (default stream.results_topic) as its own consumer "
              f"group (sink.group_id, default tracejudge-sink-{kind}); see the README, "
              "\"Writing verdicts back\".")
    return summary or f"the {kind} sink", epilog


def settings_from_args(args: argparse.Namespace) -> Settings:
    return load_settings(getattr(args, "config", None), overrides=runtime_overrides(args),
                         require_topics=False)


def main(args: argparse.Namespace) -> int:
    """Entry point of `tracejudge sink KIND`: 0 after a clean stop, 1 when it cannot start or a write
    fails, 2 on bad configuration (reported before anything connects)."""
    kind = args.kind
    try:
        # The sink's own default metrics port unless http.port was given (`cli_args.METRICS_PORTS`).
        settings = with_command_port(settings_from_args(args), "sink")
        plan = plan_sink(settings, kind)
        cls = load_sink_class(plan, settings)
        own: Any = None  # the sink's validated section, shown by its own `redacted()` (secrets masked)
        if getattr(args, "check_config", False):
            settings_type = sink_settings_type(cls)
            if settings_type is not None:
                own = settings_type.from_mapping(plan.section, f"sink.{kind}")
    except ConfigError as exc:
        print(f"tracejudge sink: {exc.report()}", file=sys.stderr)
        return 2
    configure_logging(settings.logging)
    if getattr(args, "check_config", False):
        show = _shown_for(settings, kind)
        for key, value in settings.redacted().items():
            if show(key):
                print(f"{key} = {json.dumps(value)}")
        print(f"sink.group_id (effective) = {json.dumps(plan.group_id)}")
        print(f"sink.results_topic (effective) = {json.dumps(plan.results_topic)}")
        reads_sessions = plan.session_results_topic if getattr(cls, "accepts_sessions", False) else None
        print(f"sink.session_results_topic (effective) = {json.dumps(reads_sessions)}")
        if callable(getattr(own, "redacted", None)):
            print(f"sink.{kind} (effective) = {json.dumps(own.redacted())}")
        return 0
    try:
        registry = CollectorRegistry(auto_describe=True)
        runner = SinkRunner(settings, kind, build_sink(plan, cls, registry), registry=registry)
    except ConfigError as exc:
        print(f"tracejudge sink: {exc.report()}", file=sys.stderr)
        return 2
    try:
        return run_until_signalled(runner)
    except ConfigError as exc:  # the sink's own check at start-up (`Sink.setup`)
        print(f"tracejudge sink: {exc.report()}", file=sys.stderr)
        log.error("the %s sink's configuration cannot work (above); exiting with status 2", kind)
        return 2
    except Exception:  # a failed write, logged where it failed
        log.error("the %s sink stopped on an error; exiting with status %d", kind, SERVICE_FAILED)
        return SERVICE_FAILED


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tracejudge sink", description=__doc__.splitlines()[0])
    _parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (logging.level)")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
