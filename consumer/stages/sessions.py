"""`tracejudge sessions`: gather the turns of each conversation from the trace results, close it when
it goes quiet, evaluate it as a whole, publish one session result.

A stage on the consumer runtime (`consumer/runtime/loop.py`), consumer group `tracejudge-sessions` unless
`sessions.group_id` says otherwise:

    trace results ──poll──▶ SessionStage.process: `decode_turn` (only the fields a session needs)
    (sessions.input_topic,        │  not a result / newer schema ──▶ dead-letter topic (counted)
     default stream.results_topic)│  no session id, a session line, a duplicate ──▶ ticket released
                                  ▼
            Sessionizer: per partition, open sessions by id, turns in timestamp order, stream time
                                  │ close: quiet for inactivity_s (stream time or wall clock) -> complete;
                                  │        max_turns / max_duration_s / a memory cap -> incomplete
                                  ▼
            session_metrics + SessionJudgeRunner ──▶ SessionResult ──▶ sessions.results_topic
                                                                          │ broker ack
                                        every turn's ticket released ◀────┘ ──▶ commit (runtime)

Why it works on one partition at a time: `tracejudge run` keys the result of a turn by its session
key, so every turn of a session lands on one partition of the results topic (the results topic is
the repartition topic). State is per partition: a revoked partition's sessions are dropped.

Closing. A session is due when its partition's stream time (the latest turn time seen on the
partition; turns placed by arrival do not move it) is `inactivity_s` past the session's last turn,
or when `inactivity_s` of wall clock have passed since its last turn arrived (a quiet partition
still closes its sessions). At `max_turns` turns, or once its turns span `max_duration_s`, it is
closed at once as incomplete. Past a memory cap (`max_open_sessions`, `max_turns_held`,
`max_bytes_held`; bytes are estimated from the texts' lengths plus `TURN_OVERHEAD_BYTES` a turn)
remembered closed sessions are forgotten first, then the least recently active open sessions are
closed early (`close_reason` evicted), each counted by the cap that caused it.

Reopening. A session closed as complete is remembered with its turns (the `max_closed_sessions`
most recent, within the memory caps). A turn for it reopens it: the earlier turns and the new ones
are gathered again and the next result says `evaluation` n+1 (it replaces the earlier one). A
session closed incomplete is not remembered (that would undo its cap). A rebalance that gives a
partition back to this consumer keeps its remembered sessions; after a restart, once the partition
moved to another consumer, or once forgotten, a late turn starts a new session whose result says
`evaluation` 1. A turn the session (open or remembered) already holds, by trace id and request id,
is ignored (counted): a result published twice upstream, or read again after a rewind.

Offsets. A turn's ticket is released only when its session's result is acknowledged by the broker,
so the committed offset of a partition never passes a turn of a session not yet published. On
revocation and shutdown the open sessions are dropped uncommitted; the partition's next owner (or
this process after a restart, or after SIGKILL) reads their turns again and rebuilds them: no
session is lost. Delivery is at least once: a session published but not yet committed when the
process died is published again, and one whose turns straddle the committed offset (published
while an older session on its partition was still open) may be published again with only its
later turns, as `evaluation` 1. Readers keep the result with the most turns per evaluation.

Neighbours: the pure `Sessionizer` is `consumer/stages/sessionizer.py`, the command's arguments
`consumer/commands/sessions.py`, the stage's Prometheus series `metrics/telemetry/sessions.py`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from kafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import ConfigError, Settings
from tracejudge.consumer.runtime import gc_policy
from tracejudge.consumer.runtime.logs import suppress_logged
from tracejudge.consumer.runtime.loop import ConsumerRuntime
from tracejudge.consumer.runtime.offsets import Export, Exports, Ticket
from tracejudge.consumer.runtime.producer import Outputs, Producing
from tracejudge.consumer.runtime.producing import RESULT_REJECTED, RateLimitedLog
from tracejudge.consumer.runtime.stage import NO_LIMIT, Runtime, Stage
from tracejudge.consumer.stages.sessionizer import (
    TURN_OVERHEAD_BYTES,
    ClosedSession,
    Sessionizer,
)
from tracejudge.metrics.telemetry.sessions import SessionMetrics
from tracejudge.schemas.result import Assessment, SourceRef, session_key
from tracejudge.schemas.results_line import (
    KNOWN_SCHEMA_VERSION,
    NOT_A_RESULT,
    RESULT_FORMAT,
    UNKNOWN_SCHEMA_VERSION,
    BadResult,
    decode_result,
)
from tracejudge.schemas.session import (
    CLOSE_REASONS,
    SESSION_KIND,
    decode_turn,
)

__all__ = ["DEFAULT_GROUP", "TURN_OVERHEAD_BYTES", "ClosedSession", "SessionPlan", "SessionRunner",
           "SessionStage", "Sessionizer", "build_judges", "plan_sessions", "shown_setting"]

log = logging.getLogger("tracejudge.sessions")

DEFAULT_GROUP = "tracejudge-sessions"
# -- the stage --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """What `tracejudge sessions` reads and writes, resolved from the settings."""

    input_topic: str
    results_topic: str
    dead_letter_topic: str | None
    group_id: str


def plan_sessions(settings: Settings) -> SessionPlan:
    """Resolve the `sessions:` section; `ConfigError` naming the key when the stage cannot run."""
    s = settings.sessions
    source = s.input_topic or settings.stream.results_topic
    problems: list[tuple[str, str]] = []
    if not source:
        problems.append(("sessions.input_topic", "is required: the trace results topic to read (or "
                                                 "stream.results_topic, which it defaults to)"))
    if not s.results_topic:
        problems.append(("sessions.results_topic", "is required: the topic the session results go to"))
    elif s.results_topic == source:
        problems.append(("sessions.results_topic", f"is the input topic {source!r}; session results go to "
                                                   "a topic of their own"))
    if s.dead_letter_topic is not None and s.dead_letter_topic in (source, s.results_topic):
        problems.append(("sessions.dead_letter_topic", f"is {s.dead_letter_topic!r}, also the input or the "
                                                       "results topic"))
    if problems:
        raise ConfigError(problems)
    assert source is not None and s.results_topic is not None
    return SessionPlan(source, s.results_topic, s.dead_letter_topic, s.group_id or DEFAULT_GROUP)


class _Tickets:
    """The tickets of a session's turns read this time, released together (the result's ack)."""

    __slots__ = ("tickets",)

    def __init__(self, tickets: list[Ticket]) -> None:
        self.tickets = tickets

    def release(self) -> None:
        for ticket in self.tickets:
            ticket.release()


class SessionStage(Stage):
    """Decodes turns, feeds the `Sessionizer`, judges and publishes the sessions it closes, releases
    their turns' tickets on the broker's ack."""

    name = "sessions"

    def __init__(self, plan: SessionPlan, settings: Settings, metrics: SessionMetrics, judges: Any,
                 *, tune_gc: bool = False) -> None:
        self.plan = plan
        self.settings = settings
        self.metrics = metrics
        self.judges = judges
        self.tune_gc = tune_gc
        # Session results being judged or awaiting the broker's ack; past the cap fetching pauses.
        self.max_in_flight = settings.stream.max_in_flight
        self.exports = Exports()
        self.runtime: Runtime | None = None
        self.sessionizer = Sessionizer(settings.sessions, metrics, self._closed)
        # Sessions whose judges finished (any thread), published by the poll loop.
        self._judged: deque[tuple[ClosedSession, concurrent.futures.Future[list[Assessment]], Export]] = \
            deque()
        self._no_session = metrics.ignored.labels("no_session")
        self._session_line = metrics.ignored.labels("session_result")
        self._log = RateLimitedLog(log)

    # -- start-up -------------------------------------------------------------------------------------

    def topics(self) -> list[str]:
        return [self.plan.input_topic]

    def subscription(self) -> str:
        judges = f"; session judges: {', '.join(self.judges.judge_names())}" if self.judges else ""
        return f"{self.plan.input_topic} (trace results) -> {self.plan.results_topic}{judges}"

    def outputs(self) -> Outputs:
        # Session results and dead letters leave through the runtime's producer; the series count
        # through results_published, count_dead_letter and dead_letter_publish_failures.
        return Outputs(metrics=self.metrics, results_topic=self.plan.results_topic,
                       dead_letter_topic=self.plan.dead_letter_topic, record_format=RESULT_FORMAT)

    def prepare(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def open(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def started(self) -> None:
        if self.tune_gc:
            gc_policy.apply()

    # -- the loop -------------------------------------------------------------------------------------

    def process(self, tp: TopicPartition, records: list[Any]) -> None:
        assert self.runtime is not None
        track = self.runtime.tracker.track
        add = self.sessionizer.add
        arrival, now = time.time(), time.monotonic()
        for record in records:
            offset = record.offset
            ticket = track(tp, offset)
            value = record.value
            try:
                line = decode_turn(value)
            except (msgspec.DecodeError, TypeError):  # ValidationError is a DecodeError; None: TypeError
                self._dead_letter(record, _why_not(value), ticket)
                continue
            if line.kind is not None or line.schema_version != KNOWN_SCHEMA_VERSION:
                if line.kind == SESSION_KIND and 1 <= line.schema_version <= KNOWN_SCHEMA_VERSION:
                    self._session_line.inc()
                    ticket.release()
                    continue
                if line.schema_version > KNOWN_SCHEMA_VERSION:
                    self._dead_letter(record, BadResult(UNKNOWN_SCHEMA_VERSION, f"schema_version "
                                      f"{line.schema_version} is newer than this tracejudge reads "
                                      f"({KNOWN_SCHEMA_VERSION}); upgrade it"), ticket)
                    continue
                if line.kind is not None or line.schema_version < 1:
                    self._dead_letter(record, BadResult(NOT_A_RESULT, f"not a trace result (kind "
                                      f"{line.kind!r}, schema_version {line.schema_version})"), ticket)
                    continue
            if line.trace_id is None and line.request_id is None:
                self._dead_letter(record, _why_not(value), ticket)
                continue
            if not line.session_id:
                self._no_session.inc()
                ticket.release()
                continue
            if b'"assessments"' not in value:  # every result line has them; a look-alike does not
                self._dead_letter(record, _why_not(value), ticket)
                continue
            add(tp, line, ticket, offset, arrival, now)

    def tick(self, now: float) -> None:
        self.sessionizer.due(now)
        self._publish_judged()
        self.sessionizer.update_gauges()

    def polled(self, now: float) -> None:
        self.sessionizer.due(now)
        self._publish_judged()
        self.sessionizer.update_gauges()

    def room(self) -> int:
        return NO_LIMIT if self.exports.count < self.max_in_flight else 0

    def wait_hint(self, now: float) -> float | None:
        if self._judged:
            return 0.0
        return self.sessionizer.next_due(now)

    def busy(self) -> int:
        return self.exports.count

    # -- a closed session -----------------------------------------------------------------------------

    def _closed(self, closed: ClosedSession) -> None:
        turns = closed.turns
        last = turns[-1]
        duration = max(0.0, last.timestamp + (last.latency_seconds or 0.0) - turns[0].timestamp)
        self.metrics.session(closed.app, CLOSE_REASONS[closed.close_reason], len(turns), duration)
        export = self.exports.start(_Tickets(closed.tickets))
        if self.judges is None:
            self._publish(closed, [], export)
            return
        from tracejudge.metrics.judges.sessions import Conversation

        try:
            future = self.judges.submit(Conversation(closed.session_id, closed.app, turns))
        except Exception:
            log.exception("starting the session judges failed; publishing the session without assessments")
            self._publish(closed, [], export)
            return
        if future.done():  # only heuristics ran, or nothing was sampled: no need to wait for a poll
            self._judged.append((closed, future, export))
            self._publish_judged()
            return
        judged = self._judged
        future.add_done_callback(lambda f: judged.append((closed, f, export)))

    def _publish_judged(self) -> None:
        judged = self._judged
        while judged:
            closed, future, export = judged.popleft()
            try:
                assessments = future.result()
            except Exception as exc:
                self._log.warning("session judges failed", "the session judges failed (%s: %s); publishing "
                                  "the session without assessments", type(exc).__name__, exc)
                assessments = []
            self._publish(closed, list(assessments), export)

    def _publish(self, closed: ClosedSession, assessments: list[Assessment], export: Export) -> None:
        result = closed.result(assessments)
        key, hashed = session_key(closed.session_id)
        if hashed:
            self.metrics.ids_hashed.inc()
        source = SourceRef(format=RESULT_FORMAT, topic=closed.tp.topic, partition=closed.tp.partition,
                           offset=closed.turns[0].offset)
        try:
            value = result.to_json()
        except Exception as exc:  # what custom judges put in an assessment: never hold the offsets back
            log.exception("writing the session result of %s[%d] failed", closed.tp.topic, closed.tp.partition)
            self._producing().dead_letter(None, RESULT_REJECTED, f"session result could not be written: "
                                          f"{type(exc).__name__}: {exc}", export, source=source)
            return
        # Retried until acked; one the broker refuses as too large becomes a dead letter.
        self._producing().results.send(
            value, key.encode("utf-8", "surrogatepass"), [("content-type", b"application/json")], export,
            source=source, kind="session result", waits="its turns' offsets wait",
            where=f"a session result of {source.topic}[{source.partition}]")

    def _dead_letter(self, record: Any, exc: BadResult, ticket: Ticket) -> None:
        self._producing().dead_letter(record, exc.reason, exc.message, ticket)

    def _producing(self) -> Producing:
        assert self.runtime is not None
        return self.runtime.producing

    # -- rebalance (IO thread) ------------------------------------------------------------------------

    async def revoke(self, tps: set[TopicPartition], deadline: float, sleep: Any) -> str:
        # Open sessions are dropped uncommitted: the next owner rebuilds them from their turns.
        # Results on their way (judged or awaiting acks) get until the deadline.
        dropped = self.sessionizer.drop(tps, park=True)
        await self._producing().settle_revoked(deadline, sleep, lambda: self.exports.count,
                                               step=self._publish_judged)
        self.sessionizer.update_gauges()
        return f"dropped {dropped} open sessions" if dropped else ""

    def lose(self, tps: set[TopicPartition]) -> None:
        self.sessionizer.drop(tps)
        self.sessionizer.update_gauges()

    def assigned(self, tps: set[TopicPartition]) -> None:
        self.sessionizer.assigned(tps)
        self.sessionizer.update_gauges()

    # -- shutdown -------------------------------------------------------------------------------------

    def stopping(self) -> None:
        dropped = self.sessionizer.drop_all()
        self.sessionizer.update_gauges()
        if dropped:
            log.info("stopping: %d open sessions dropped uncommitted; their turns are read again on restart",
                     dropped)

    def drain(self, deadline: float) -> None:
        """Until `deadline`: publish what the judges finish, let the acks arrive (the runtime then
        waits for the dead letters)."""
        self._producing().settle(deadline, lambda: self.exports.count, step=self._publish_judged,
                                 wait=self.exports.wait_idle)
        self._publish_judged()

    def close(self) -> None:
        if self.judges is not None:
            with suppress_logged(log, "closing the session judges"):
                self.judges.close(0.0)


def _why_not(value: bytes | None) -> BadResult:
    """Why a line that `decode_turn` refused (or that names no trace) is not a trace result, as the
    sink says it (`decode_result`: invalid_json, not_a_result, unknown_schema_version)."""
    try:
        decode_result(value)
    except BadResult as exc:
        return exc
    except Exception as exc:  # pragma: no cover - decode_result raises BadResult only
        return BadResult(NOT_A_RESULT, f"not a trace result: {exc}")
    try:
        decode_turn(value)  # type: ignore[arg-type]
    except (msgspec.DecodeError, TypeError) as exc:
        return BadResult(NOT_A_RESULT, f"not a trace result: {exc}")
    return BadResult(NOT_A_RESULT, "not a trace result: neither trace_id nor request_id")


class SessionRunner(ConsumerRuntime):
    """`tracejudge sessions` embedded: the session stage on the consumer runtime. Same embedding API as
    `StreamRunner`: `start()`, `stop()`, `join()`, `run()`, `http_port`, `registry`, `assignment`,
    `wait_assigned()`, `error`. `judges=False` runs without session judges whatever `judges:` says;
    without `judges` they are built from the `judges:` section (none without it). Raises
    `ConfigError` for a configuration that cannot work."""

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None, judges: Any = None,
                 tune_gc: bool = False) -> None:
        plan = plan_sessions(settings)
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        metrics = SessionMetrics(registry, max_apps=settings.prometheus.max_apps)
        self.judges = None if judges is False else judges or build_judges(settings, registry, metrics.apps)
        self.plan = plan
        self.session_metrics = metrics
        stage = SessionStage(plan, settings, metrics, self.judges, tune_gc=tune_gc)
        super().__init__(settings, stage, metrics, registry, log=log, title="tracejudge sessions",
                         group_id=plan.group_id, show_setting=shown_setting)
        self.sessionizer = stage.sessionizer
        self.exports = stage.exports


def build_judges(settings: Settings, registry: CollectorRegistry,
                 app_label: Callable[[str | None], str] | None = None) -> Any:
    """The `SessionJudgeRunner` of the `judges:` section (None without one: no session judges; with
    one but no endpoint, the heuristic `user_frustration`). Its series go to `registry`, their `app`
    bounded by `app_label` (the stage's cap). `ConfigError` names the key of a bad section."""
    if settings.judges is None:
        return None
    from tracejudge.metrics.judges.sessions import SessionJudgeRunner

    # A bad section raises `JudgeConfigError`, a `ConfigError` naming the key.
    return SessionJudgeRunner(settings.judges, registry, app_label=app_label)


# The settings the session stage uses (the start-up summary and --check-config show only these).
_STREAM_KEYS = ("stream.results_topic", "stream.poll_timeout_ms", "stream.commit_interval_ms",
                "stream.shutdown_grace_seconds", "stream.lag_interval_seconds", "stream.max_in_flight")


def shown_setting(key: str) -> bool:
    """Whether `--check-config` and the start-up summary show `key`: the keys this stage reads."""
    if key.startswith(("sessions.", "http.", "logging.", "producer.", "prometheus.", "judges.")):
        return True
    if key.startswith("kafka."):
        return key != "kafka.group_id"
    return key in _STREAM_KEYS
