"""The consumer runtime: everything a Kafka consumer stage needs except its own work.

`tracejudge run` (the evaluation stage, `consumer/stages/run.py`) and `tracejudge sink <kind>` (the
write-back stage, `consumer/stages/sink.py`) are small `Stage`s on this one runtime:

    Kafka ──poll──▶ Stage.process(tp, records) ──▶ the stage's outputs (results, dead letters, a sink)
                         │ one Ticket per record                │
                         ▼                                      ▼
                    OffsetTracker ◀──── Ticket.release() when the record's work is done
                         │
                         └──lowest incomplete offset──▶ commit (poll loop, revocation, shutdown)

The runtime owns the consumer and its group: the poll loop, offset tracking and commits (a record's
offset is committed only once its ticket is released: at-least-once), the rebalance listener (a
revoked partition's finished work is committed, its unfinished records are read again by whoever
owns it next), backpressure (`Stage.room()`; pausing every partition together), partitions a stage
holds (`Stage.held()`, paused one by one, e.g. a sink waiting to retry a write), consumer lag, the
broker watch (one line when the broker is lost, one when it is back), the HTTP operations server
(`/metrics`, `/healthz`, `/readyz`), and the shutdown: stop fetching, let the stage drain for
`stream.shutdown_grace_seconds`, commit, leave the group. A stage keeps its state per partition and
never touches the consumer.

Threads: the poll loop (the caller of `run()`) fetches, calls the stage and commits. kafka-python 3.x
runs rebalance callbacks on its IO thread while the poll thread is blocked in `poll()` or `close()`,
where a blocking `commit()` raises, so the listener is an `AsyncConsumerRebalanceListener` that
awaits `commit_async` (and `Stage.revoke`). The HTTP server answers from its own threads.

Embedding (`ConsumerRuntime` and its subclasses `StreamRunner`, `SinkRunner`): `start()` runs in a
daemon thread, `stop()` asks it to stop (safe from signal handlers), `join()` waits; `.error` keeps
the exception that ended it, `.http_port` is the bound port, `.registry` the Prometheus registry.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from types import FrameType
from typing import Any, Protocol

from kafka import AsyncConsumerRebalanceListener, KafkaConsumer
from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import ConfigError, LoggingSettings, Settings
from tracejudge.consumer.runtime.arguments import (
    GROUP_METAVAR,
    TOPIC_METAVAR,
    add_stage_arguments,
    with_command_port,
)
from tracejudge.consumer.runtime.exit_status import SERVICE_FAILED
from tracejudge.consumer.runtime.http import OperationsServer
from tracejudge.consumer.runtime.logs import KAFKA_CONNECTION_LOGS, configure_library_logs
from tracejudge.consumer.runtime.offsets import OffsetTracker, Releasable
from tracejudge.metrics.telemetry.consumer import ConsumerMetrics

__all__ = ["ConsumerMetrics", "ConsumerRuntime", "Exports", "RuntimeMetrics", "Stage", "StartupError",
           "configure_logging", "describe_partitions", "run_until_signalled", "stage_main"]

# A stage's way to wait on the IO thread (revocation): yields to kafka-python's loop, heartbeats go on.
IoSleep = Callable[[float], Awaitable[None]]

NO_LIMIT = 1 << 30


class StartupError(RuntimeError):
    """The runtime could not start (broker unreachable, port taken); the message says what to fix."""


# -- metrics --------------------------------------------------------------------------------------


class RuntimeMetrics(Protocol):
    """The consumer's own series. `PrometheusExporter` (the evaluation stage's) has them; a stage
    without one uses `ConsumerMetrics`."""

    commits: Any
    commit_failures: Any
    rebalances: Any
    assigned_partitions: Any
    revoked_unfinished: Any
    backpressure_pauses: Any
    backpressure_seconds: Any
    in_flight: Any

    def set_lag(self, topic: str, partition: int, lag: int) -> None: ...

    def remove_lag(self, topic: str, partition: int) -> None: ...


# -- work in flight -------------------------------------------------------------------------------


class Exports:
    """Work handed on that finishes by itself (a result awaiting the broker's ack, a judge running, a
    dead letter being sent), so a revocation or a shutdown waits for it; also the measure of a
    stage's in-flight cap. `start(ticket)` wraps a `Releasable`; its `release()` ends the work."""

    def __init__(self) -> None:
        self._count = 0
        self._waiters = 0
        self._cond = threading.Condition(threading.Lock())

    def start(self, inner: Releasable) -> _Export:
        with self._cond:
            self._count += 1
        return _Export(self, inner)

    def _done(self) -> None:
        with self._cond:
            self._count -= 1
            if self._count == 0 and self._waiters:
                self._cond.notify_all()

    @property
    def count(self) -> int:
        return self._count

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            self._waiters += 1
            try:
                return self._cond.wait_for(lambda: self._count == 0, timeout)
            finally:
                self._waiters -= 1


class _Export:
    __slots__ = ("_exports", "_inner", "_released")

    def __init__(self, exports: Exports, inner: Releasable) -> None:
        self._exports = exports
        self._inner = inner
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            raise RuntimeError("export released twice")
        self._released = True
        self._exports._done()
        self._inner.release()


# -- the stage interface --------------------------------------------------------------------------


class Stage:
    """One consumer's work on the runtime. Only `topics` and `process` are required.

    Every hook but `revoke`/`lose`/`assigned` runs on the poll thread; those three run on
    kafka-python's IO thread while the poll thread is blocked in `poll()` or `close()`, so they never
    overlap `process`, `tick` or `drain`. A stage tracks each record it receives with
    `runtime.tracker.track(tp, offset)` and releases the ticket when the record's work is done.
    """

    #: Names the stage in thread names and log lines ("run", "sink-mlflow").
    name = "stage"

    def topics(self) -> list[str]:
        raise NotImplementedError

    def subscription(self) -> str:
        """How the subscription is described in the log ("traces:mlflow, spans:otlp_proto")."""
        return ", ".join(self.topics())

    def prepare(self, runtime: ConsumerRuntime) -> None:
        """Before `/metrics` is served and Kafka is reached: start helpers, check configuration
        (raise `ConfigError` or `StartupError`)."""

    def open(self, runtime: ConsumerRuntime) -> None:
        """Create the stage's own clients (a producer) before the consumer; `StartupError` when the
        broker cannot be reached."""

    def started(self) -> None:
        """Subscribed; the poll loop starts next."""

    def tick(self, now: float) -> None:
        """Every loop turn, before the poll: due retries, checkpoints, timers."""

    def room(self) -> int:
        """How many more records may be fetched now; 0 or less pauses every assigned partition."""
        return NO_LIMIT

    def held(self) -> Collection[TopicPartition]:
        """Partitions to keep paused (e.g. waiting to retry); the others are fetched."""
        return ()

    def wait_hint(self, now: float) -> float | None:
        """Seconds until the stage has something due (the poll waits at most that long)."""
        return None

    def process(self, tp: TopicPartition, records: list[Any]) -> None:
        """The records one poll returned for `tp`, in offset order. Never raises for a record."""
        raise NotImplementedError

    def polled(self, now: float) -> None:
        """After a poll's records went through `process`."""

    async def revoke(self, tps: set[TopicPartition], deadline: float, sleep: IoSleep) -> str:
        """Partitions are being revoked (IO thread): finish what can finish by `deadline` (yield with
        `await sleep(s)`), give up the rest (its tickets stay unreleased: re-read later). Returns a
        note for the log line."""
        return ""

    def lose(self, tps: set[TopicPartition]) -> None:
        """Partitions were lost (already someone else's): drop their state."""

    def assigned(self, tps: set[TopicPartition]) -> None:
        """Partitions were assigned."""

    def busy(self) -> int:
        """Work in flight that a shutdown waits for (for the log)."""
        return 0

    def stopping(self) -> None:
        """The runtime stopped fetching; give up what cannot finish without the poll loop."""

    def drain(self, deadline: float) -> None:
        """Finish in-flight work until `deadline` (the shutdown's grace period)."""

    def close(self) -> None:
        """Release the stage's clients; called once, after the consumer left the group. Must not
        raise."""


# -- the runtime ----------------------------------------------------------------------------------


class ConsumerRuntime:
    """Runs one `Stage` on one consumer until `stop()` (or the `stop_event` given to `run`) is set.

    `log` is the stage's logger (its lines read `tracejudge.run: ...`), `title` names the command in
    the start-up summary. `group_id` overrides `kafka.group_id` (a sink's own group). With
    `lag_counts_unfinished`, a partition's lag also counts the records fetched but not finished
    (a sink's unwritten records), and partitions the stage holds paused are measured against the
    broker's end offset, since a paused partition's high watermark is not refreshed by fetches.
    """

    def __init__(self, settings: Settings, stage: Stage, metrics: RuntimeMetrics, registry: CollectorRegistry,
                 *, log: logging.Logger | None = None, title: str = "tracejudge", group_id: str | None = None,
                 lag_counts_unfinished: bool = False,
                 show_setting: Callable[[str], bool] | None = None) -> None:
        self.settings = settings
        self.stage = stage
        self.metrics = metrics
        self.registry = registry
        self.log = log or logging.getLogger("tracejudge.runtime")
        self.title = title
        self.group_id = group_id or settings.kafka.group_id
        self.tracker = OffsetTracker()
        self.metrics.in_flight.set_function(lambda: self.tracker.in_flight)
        self.http_port: int | None = None
        self.error: BaseException | None = None
        self._lag_counts_unfinished = lag_counts_unfinished
        self._show_setting = show_setting

        self._stop = threading.Event()
        self._assigned_event = threading.Event()
        self._consumer: KafkaConsumer | None = None
        self._http: OperationsServer | None = None
        self._assigned: frozenset[TopicPartition] = frozenset()
        # Partitions revoked with unfinished records, and where to rewind if they come back to us
        # (kafka-python keeps the in-memory position of a partition re-assigned to the same member).
        self._rewind: dict[TopicPartition, int] = {}
        self._assignment_changed = False
        self._paused_since: float | None = None
        # Partitions paused one by one (held by the stage) at some point: the fetcher workaround runs.
        self._partial_pauses = False
        self._pausing = False
        self._commit_requested = False
        self._closing = False
        self._last_loop: float | None = None
        # Since when the broker has not answered, once that has been reported (`_watch_broker`).
        self._broker_lost_since: float | None = None
        self._thread: threading.Thread | None = None
        self._external_stop: threading.Event | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the runtime to stop: it stops fetching, lets the stage finish in-flight work within the
        grace period, commits, and leaves the group. Safe from any thread and from signal handlers."""
        self._stop.set()

    def start(self) -> threading.Thread:
        """Run in a daemon thread (for embedding: the demo, tests). Join it after `stop()`; an exception
        that ended it (e.g. `StartupError`) is kept in `.error`."""

        def target() -> None:
            try:
                self.run()
            except BaseException as exc:
                self.error = exc
                self.log.error("%s stopped on %s: %s", self.title, type(exc).__name__, exc)

        self._thread = threading.Thread(target=target, name=f"tracejudge-{self.stage.name}", daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread started by `start()`; True once it has ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_assigned(self, timeout: float) -> bool:
        """Block until partitions are assigned for the first time; True when they are."""
        return self._assigned_event.wait(timeout)

    @property
    def assignment(self) -> frozenset[TopicPartition]:
        return self._assigned

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_commit(self) -> None:
        """Commit at the end of this loop turn rather than at the next commit interval (poll thread)."""
        self._commit_requested = True

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Consume until stopped. Raises `StartupError` when the broker or the port is unusable."""
        s = self.settings
        self._external_stop = stop_event
        self._log_effective_config()
        try:
            self.stage.prepare(self)
            if s.http.enabled:
                try:
                    self._http = OperationsServer(self.registry, host=s.http.bind_address, port=s.http.port,
                                                  liveness=self.liveness, readiness=self.readiness).start()
                except OSError as exc:
                    raise StartupError(f"cannot serve metrics on {s.http.bind_address}:{s.http.port} "
                                       f"(http.port): {exc.strerror or exc}") from exc
                self.http_port = self._http.port
                self.log.info("serving /metrics, /healthz, /readyz on http://%s:%d", s.http.bind_address,
                              self.http_port)
            self._connect()
            self.stage.started()
            self._loop()
        finally:
            self._shutdown()

    def _connect(self) -> None:
        s = self.settings
        started = time.monotonic()
        self.stage.open(self)
        config = s.kafka.consumer_config()
        config["group_id"] = self.group_id
        try:
            self._consumer = KafkaConsumer(**config)
        except Exception as exc:
            raise StartupError(cannot_connect("create the consumer", s, exc, started)) from exc
        self._consumer.subscribe(topics=list(self.stage.topics()), listener=_RebalanceListener(self))
        self.log.info("subscribed to %s as group %r; waiting for partitions", self.stage.subscription(),
                      self.group_id)

    def _loop(self) -> None:
        s = self.settings.stream
        consumer = self._consumer
        assert consumer is not None
        stage = self.stage
        tick, room_for, process, polled = stage.tick, stage.room, stage.process, stage.polled
        held, wait_hint = stage.held, stage.wait_hint
        max_poll = self.settings.kafka.max_poll_records
        poll_timeout = s.poll_timeout_ms
        commit_every = s.commit_interval_ms / 1000
        lag_every = s.lag_interval_seconds
        next_commit = next_lag = time.monotonic()
        external = self._external_stop
        while not self._stop.is_set():
            if external is not None and external.is_set():
                break
            now = self._last_loop = time.monotonic()
            tick(now)
            room = room_for()
            self._apply_pauses(consumer, full=room <= 0, held=held(), now=now)
            if self._partial_pauses:
                _restore_parked_records(consumer)
            timeout = poll_timeout if room > 0 else 20
            hint = wait_hint(now)
            if hint is not None:
                timeout = max(0, min(timeout, int(hint * 1000)))
            batch = consumer.poll(timeout_ms=timeout, max_records=max(1, min(max_poll, room)))
            for tp, records in batch.items():
                process(tp, records)
            now = time.monotonic()
            polled(now)
            if now >= next_commit or self._commit_requested:
                self._commit_requested = False
                self._commit()
                next_commit = now + commit_every
            if now >= next_lag:
                self._update_lag(consumer)
                self._watch_broker(consumer, now)
                next_lag = now + lag_every

    def _apply_pauses(self, consumer: KafkaConsumer, *, full: bool, held: Collection[TopicPartition],
                      now: float) -> None:
        # Backpressure pauses and resumes ALL assigned partitions together: pausing a subset can starve
        # a partition for good in kafka-python 3.0.12 (a fetcher bug; `_restore_parked_records` works
        # around it for the partitions a stage holds). Re-checked every turn because a rebalance
        # brings new, unpaused partitions and keeps the paused flag of retained ones.
        if full:
            if self._paused_since is None:
                self._paused_since = now
                self.metrics.backpressure_pauses.inc()
                self.log.info("in-flight cap reached (%d in flight); pausing fetches", self.stage.busy()
                              or self.tracker.in_flight)
            want = consumer.assignment()
        else:
            if self._paused_since is not None:
                self.metrics.backpressure_seconds.inc(now - self._paused_since)
                self._paused_since = None
                self._assignment_changed = True
            if not held and not self._pausing and not self._assignment_changed:
                return
            want = set(held) & consumer.assignment()
            if want:
                self._partial_pauses = True
        self._assignment_changed = False
        self._pausing = bool(want)
        paused = consumer.paused()
        if want - paused:
            consumer.pause(*(want - paused))
        if paused - want:
            consumer.resume(*(paused - want))

    def _commit(self) -> None:
        consumer = self._consumer
        offsets = self.tracker.committable()
        if consumer is None or not offsets:
            return
        try:
            consumer.commit(offsets, timeout_ms=self.settings.kafka.commit_timeout_ms)
        except Exception as exc:
            self.metrics.commit_failures.inc()
            # While the broker is reported unreachable, each retry's failure is no news.
            self.log.log(logging.DEBUG if self._broker_lost_since is not None else logging.WARNING,
                         "offset commit failed (%s: %s); the records are re-delivered unless a later "
                         "commit succeeds: %s", type(exc).__name__, exc, describe_partitions(offsets))
            return
        self.tracker.mark_committed(offsets)
        self.metrics.commits.inc()
        if self.log.isEnabledFor(logging.DEBUG):
            self.log.debug("committed %s", {f"{tp.topic}[{tp.partition}]": o.offset
                                            for tp, o in offsets.items()})

    def _watch_broker(self, consumer: KafkaConsumer, now: float) -> None:
        """One line when the group coordinator has not answered a heartbeat for longer than the session
        timeout and kafka-python has lost it (it retries meanwhile; its own lines about it are at DEBUG,
        see `consumer/runtime/logs.py`), and one when it answers again. (A slow rebalance also pauses
        heartbeats, but the coordinator stays known.)"""
        age = _heartbeat_age(consumer)
        if age is None:
            return
        limit = self.settings.kafka.session_timeout_ms / 1000
        servers = ",".join(self.settings.kafka.bootstrap_servers)
        if self._broker_lost_since is None:
            if age > limit and not _coordinator_known(consumer) and not self._stop.is_set():
                self._broker_lost_since = now - age
                cause = KAFKA_CONNECTION_LOGS.last_error(since=now - age)
                self.log.warning("Kafka at %s (kafka.bootstrap_servers) has not answered for %.0f s (more "
                                 "than kafka.session_timeout_ms)%s; retrying until it answers, consuming and "
                                 "committing nothing meanwhile (kafka-python's detail with --log-level "
                                 "DEBUG)", servers, age, f"; last error: {cause}" if cause else "")
        elif age <= limit:
            self.log.info("Kafka at %s answers again, after %.0f s", servers, now - self._broker_lost_since)
            self._broker_lost_since = None

    def _update_lag(self, consumer: KafkaConsumer) -> None:
        assignment = consumer.assignment()
        ends: dict[TopicPartition, int] = {}
        if self._lag_counts_unfinished and self._pausing:
            # A paused partition is not fetched, so its high watermark stands still: ask the broker.
            paused = consumer.paused() & assignment
            if paused:
                try:
                    ends = consumer.end_offsets(list(paused), timeout_ms=5000) or {}
                except Exception:  # the broker is away: the high watermarks will do
                    ends = {}
        for tp in assignment:
            try:
                high = consumer.highwater(tp)
                end = ends.get(tp)
                if end is not None:
                    high = end if high is None else max(high, end)
                if high is None:
                    continue
                position = consumer.position(tp, timeout_ms=0)
            except Exception:  # revoked between assignment() and here, or no position yet
                continue
            # position() can run a rebalance (and our listener) inside it: set only what is still ours.
            if position is not None and tp in self._assigned:
                lag = max(0, high - position)
                if self._lag_counts_unfinished:
                    lag += self.tracker.in_flight_for((tp,))
                self.metrics.set_lag(tp.topic, tp.partition, lag)

    def _shutdown(self) -> None:
        s = self.settings
        consumer = self._consumer
        self._stop.set()
        try:
            if consumer is not None:
                with _suppress_logged(self.log, "pausing fetches"):
                    if consumer.assignment():
                        consumer.pause(*consumer.assignment())
                with _suppress_logged(self.log, "stopping the stage"):
                    self.stage.stopping()
                if busy := self.stage.busy():
                    self.log.info("stopping: waiting up to %.1f s (stream.shutdown_grace_seconds) for %d "
                                  "in flight", s.stream.shutdown_grace_seconds, busy)
                with _suppress_logged(self.log, "draining the stage"):
                    self.stage.drain(time.monotonic() + s.stream.shutdown_grace_seconds)
                self._commit()
                unfinished = self.tracker.incomplete()
                if unfinished:
                    self.metrics.revoked_unfinished.inc(sum(unfinished.values()))
                    self.log.warning("stopping with %d records unfinished; they will be re-delivered: %s",
                                     sum(unfinished.values()), describe_partitions(unfinished))
                self._closing = True
                with _suppress_logged(self.log, "closing the consumer"):
                    # Runs the listener's on_partitions_revoked (a last commit) and leaves the group.
                    consumer.close(autocommit=False, timeout_ms=s.kafka.commit_timeout_ms)
        finally:
            with _suppress_logged(self.log, "closing the stage"):
                self.stage.close()
            if self._http is not None:
                self._http.stop()
                self._http = None
            self.log.info("stopped")

    # -- rebalance (kafka IO thread, while the poll thread is blocked in poll() or close()) ------------

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        consumer = self._consumer
        assert consumer is not None
        tracker = self.tracker
        grace = 0.0 if self._closing else self.settings.stream.shutdown_grace_seconds

        async def sleep(seconds: float) -> None:
            await _io_sleep(consumer, seconds)

        note = await self.stage.revoke(revoked, time.monotonic() + grace, sleep)
        offsets = tracker.committable(revoked)
        if offsets:
            try:
                await consumer.commit_async(offsets)
            except Exception as exc:
                self.metrics.commit_failures.inc()
                self.log.warning("commit on revocation failed (%s: %s); those records are re-delivered",
                                 type(exc).__name__, exc)
            else:
                tracker.mark_committed(offsets)
                self.metrics.commits.inc()
        left = tracker.in_flight_for(revoked)
        unfinished = tracker.revoke(revoked)
        if unfinished:
            self.metrics.revoked_unfinished.inc(left)
            self._rewind.update(unfinished)
            self.log.warning("%d records of revoked partitions unfinished%s; re-delivered from %s", left,
                             f" ({note})" if note else "",
                             {f"{tp.topic}[{tp.partition}]": o for tp, o in unfinished.items()})
        self._drop_partitions(revoked, "revoked")
        committed = {f"{tp.topic}[{tp.partition}]": om.offset for tp, om in offsets.items()}
        self.log.info("partitions revoked: %s (%scommitted %s)", describe_partitions(revoked),
                      f"{note}; " if note else "", committed or "nothing new")

    def _on_lost(self, lost: set[TopicPartition]) -> None:
        # The group already gave them to someone else: committing would fail; the new owner re-reads
        # from the last commit.
        self.stage.lose(lost)
        left = self.tracker.in_flight_for(lost)
        unfinished = self.tracker.revoke(lost)
        if unfinished:
            self.metrics.revoked_unfinished.inc(left)
            self._rewind.update(unfinished)
        self._drop_partitions(lost, "lost")
        self.log.warning("partitions lost (session expired or fenced): %s; %d unfinished records will be "
                         "re-delivered", describe_partitions(lost), left)

    def _drop_partitions(self, tps: set[TopicPartition], event: str) -> None:
        self._assigned = self._assigned - tps
        for tp in tps:
            self.metrics.remove_lag(tp.topic, tp.partition)
        self.metrics.rebalances.labels(event).inc()
        self.metrics.assigned_partitions.set(len(self._assigned))
        self._assignment_changed = True

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        consumer = self._consumer
        assert consumer is not None
        for tp in assigned:
            offset = self._rewind.pop(tp, None)
            if offset is not None:
                # Ours again, but its unfinished records were given up on: read them again.
                consumer.seek(tp, offset)
                self.log.info("re-reading %s[%d] from offset %d (unfinished when revoked)", tp.topic,
                              tp.partition, offset)
        self._assigned = self._assigned | assigned
        self.stage.assigned(assigned)
        self.metrics.rebalances.labels("assigned").inc()
        self.metrics.assigned_partitions.set(len(self._assigned))
        self._assignment_changed = True
        self.log.info("partitions assigned: %s (now %d)", describe_partitions(assigned) if assigned
                      else "none", len(self._assigned))
        if self._assigned:
            self._assigned_event.set()

    # -- health ---------------------------------------------------------------------------------------

    def liveness(self) -> tuple[bool, str]:
        last = self._last_loop
        if last is None:
            return True, "starting"
        age = time.monotonic() - last
        limit = self.settings.kafka.max_poll_interval_ms / 1000
        if age > limit and not self._stop.is_set():
            return False, f"poll loop stalled for {age:.0f} s (more than kafka.max_poll_interval_ms)"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        if self._stop.is_set():
            return False, "stopping"
        if self._consumer is None:
            return False, "connecting to Kafka"
        if not self._assigned:
            return False, "no partitions assigned (joining the group, or more consumers than partitions)"
        age = _heartbeat_age(self._consumer)
        limit = self.settings.kafka.session_timeout_ms / 1000
        if age is not None and age > limit:
            return False, f"broker unreachable: no heartbeat answered for {age:.0f} s"
        return True, f"ok: {len(self._assigned)} partitions assigned"

    def _log_effective_config(self) -> None:
        show = self._show_setting
        lines = [f"  {k} = {v}" for k, v in self.settings.redacted().items()
                 if v is not None and (show is None or show(k))]
        self.log.info("starting %s with (unset keys omitted, secrets redacted):\n%s", self.title,
                      "\n".join(lines))


class _RebalanceListener(AsyncConsumerRebalanceListener):
    # Runs on kafka-python's IO thread while the poll thread is blocked in poll() or close(). An
    # exception here would surface as "User rebalance callback throws an error" from poll(), so
    # every callback logs and swallows.

    def __init__(self, runtime: ConsumerRuntime) -> None:
        self.runtime = runtime

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:  # the first join reports an empty revocation
            try:
                await self.runtime._on_revoked(set(revoked))
            except Exception:
                self.runtime.log.exception("handling revoked partitions failed")

    async def on_partitions_assigned(self, assigned: Any) -> None:
        try:
            self.runtime._on_assigned(set(assigned))
        except Exception:
            self.runtime.log.exception("handling assigned partitions failed")

    async def on_partitions_lost(self, lost: Any) -> None:
        if lost:
            try:
                self.runtime._on_lost(set(lost))
            except Exception:
                self.runtime.log.exception("handling lost partitions failed")


# -- kafka-python helpers ---------------------------------------------------------------------------


def _restore_parked_records(consumer: KafkaConsumer) -> None:
    """Work around kafka-python 3.0.12's pause/resume starvation (still on its master in 2026-08).

    Records already parsed for a partition that gets paused (with some of its fetched batch not yet
    returned by `poll`) are parked; once it is resumed, the fetcher restores them only when its
    in-line slot is None, but a fully consumed batch stays in that slot, and a partition with parked
    records is never fetched again: it starves for good. Free the slot when it only holds a consumed
    batch and parked records wait for a resumed partition: what the one-line upstream fix does
    (`if not self._next_partition_records:`). Only needed when partitions are paused one by one
    (`Stage.held`); a no-op on versions without these attributes. tests/test_sink_runtime.py's
    RetryLater test starves without it."""
    fetcher = getattr(consumer, "_fetcher", None)
    parked = getattr(fetcher, "_paused_partition_records", None)
    if not parked:
        return
    current = getattr(fetcher, "_next_partition_records", None)
    if current is not None and not current:
        paused = consumer.paused()
        if any(tp not in paused for tp in list(parked)):
            fetcher._next_partition_records = None  # type: ignore[union-attr]


async def _io_sleep(consumer: KafkaConsumer, seconds: float) -> None:
    # Yield to kafka-python's event loop (heartbeats keep flowing) instead of blocking its thread.
    net = getattr(consumer, "_net", None)
    if net is not None and hasattr(net, "sleep"):
        await net.sleep(seconds)
    else:  # pragma: no cover - other kafka-python versions
        time.sleep(seconds)


def cannot_connect(what: str, settings: Settings, exc: BaseException, started: float) -> str:
    """The one line that says why a stage could not start on Kafka."""
    servers = ",".join(settings.kafka.bootstrap_servers)
    timeout_ms = settings.kafka.bootstrap_timeout_ms
    if isinstance(exc, KafkaTimeoutError):  # no bootstrap server answered in time
        cause = KAFKA_CONNECTION_LOGS.last_error(since=started)
        return (f"cannot reach Kafka at {servers} (kafka.bootstrap_servers): no broker answered within "
                f"{timeout_ms / 1000:g} s (kafka.bootstrap_timeout_ms)"
                + (f"; last error: {cause}" if cause else ""))
    text, name = str(exc), type(exc).__name__
    return f"cannot {what} for Kafka at {servers} (kafka.bootstrap_servers): " + (
        text if text.startswith(name) else f"{name}: {text}")


def _coordinator_known(consumer: KafkaConsumer) -> bool:
    """Whether kafka-python still has a group coordinator (it forgets it when the broker is lost);
    False when this kafka-python does not say."""
    coordinator = getattr(consumer, "_coordinator", None)
    return getattr(coordinator, "coordinator_id", None) is not None


def _heartbeat_age(consumer: KafkaConsumer) -> float | None:
    """Seconds since the group coordinator last answered a heartbeat, when kafka-python exposes it."""
    heartbeat = getattr(getattr(consumer, "_coordinator", None), "heartbeat", None)
    last = getattr(heartbeat, "last_receive", None)
    if not isinstance(last, float) or last == float("-inf"):
        return None
    return time.monotonic() - last


def describe_partitions(tps: Iterable[TopicPartition]) -> str:
    """"topic[0, 2], other[1]" for a log line."""
    by_topic: dict[str, list[int]] = {}
    for tp in tps:
        by_topic.setdefault(tp.topic, []).append(tp.partition)
    return ", ".join(f"{t}{sorted(p)}" for t, p in sorted(by_topic.items())) or "none"


class _suppress_logged:
    """Shutdown steps: log a failure and go on to the next step."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.log = logger
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and isinstance(exc, Exception):
            self.log.warning("%s failed: %s: %s", self.what, type(exc).__name__, exc)
            return True
        return False


def suppress_logged(logger: logging.Logger, what: str) -> _suppress_logged:
    """`with suppress_logged(log, "closing the producer"): ...`: log a failure, go on."""
    return _suppress_logged(logger, what)


# -- the process ------------------------------------------------------------------------------------


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(settings: LoggingSettings) -> None:
    """Root logging for a `tracejudge run` / `tracejudge sink` process: a stderr handler unless one is
    configured already (the `tracejudge` command's), JSON lines when `logging.format` says so, and
    `logging.level`."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    if settings.format == "json":
        for handler in root.handlers:
            handler.setFormatter(_JsonFormatter())
    root.setLevel(settings.level)
    # httpx's line per judge call, kafka-python's narration and its connection failures: DEBUG only.
    configure_library_logs(settings.level)


def run_until_signalled(runtime: ConsumerRuntime) -> int:
    """Run in this thread until SIGTERM/SIGINT (the first one drains and commits, a second exits at
    once without committing). 0 after a clean stop, 4 (`SERVICE_FAILED`) when it cannot start (logged in
    one line).
    Other exceptions propagate."""
    log = runtime.log
    signals = {"n": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            log.error("second %s: exiting now without committing", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s received: stopping", signal.Signals(signum).name)
        runtime.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        runtime.run()
    except StartupError as exc:
        log.error("%s; exiting with status %d", exc, SERVICE_FAILED)
        return SERVICE_FAILED
    return 0


def stage_main(name: str, args: Any, settings_from_args: Callable[[Any], Settings],
               make_runner: Callable[[Settings], ConsumerRuntime], *,
               plan: Callable[[Settings], Any] | None = None, show: Callable[[str], bool] | None = None,
               effective: Callable[[Any], Mapping[str, Any]] | None = None) -> int:
    """The entry point of a stage's command (`tracejudge run`, `sessions`, `agreement`): load the
    settings and the stage's `plan` (a `ConfigError` is reported before anything connects: status 2);
    with `--check-config` print the settings `show` picks (secrets redacted) and the `effective`
    values the plan resolved, status 0; else run until signalled (0 after a clean stop, 1 when it
    cannot start)."""
    try:
        # The stage's own default metrics port unless http.port was given (`cli_args.METRICS_PORTS`).
        settings = with_command_port(settings_from_args(args), name)
        planned = plan(settings) if plan is not None else None
    except ConfigError as exc:
        print(f"tracejudge {name}: {exc.report()}", file=sys.stderr)
        return 2
    configure_logging(settings.logging)
    if getattr(args, "check_config", False):
        for key, value in settings.redacted().items():
            if show is None or show(key):
                print(f"{key} = {json.dumps(value)}")
        for key, value in (effective(planned) if effective is not None else {}).items():
            print(f"{key} (effective) = {json.dumps(value)}")
        return 0
    try:
        runner = make_runner(settings)
    except ConfigError as exc:
        print(f"tracejudge {name}: {exc.report()}", file=sys.stderr)
        return 2
    return run_until_signalled(runner)


# -- command-line flags every stage shares ----------------------------------------------------------


def add_runtime_arguments(parser: Any, *, command: str, config_help: str, group: tuple[str, str],
                          results: tuple[str, str], dead_letters: tuple[str, str]) -> None:
    """The flags of every command on the runtime: the common stage flags (`cli_args`), then `group`,
    `results` and `dead_letters`, each the configuration key the flag overrides and its help text
    (`runtime_overrides` reads them back)."""
    add_stage_arguments(parser, command, config_help=config_help)
    parser.add_argument("--group-id", metavar=GROUP_METAVAR, help=group[1])
    parser.add_argument("--results-topic", metavar=TOPIC_METAVAR, help=results[1])
    parser.add_argument("--dead-letter-topic", metavar=TOPIC_METAVAR, help=dead_letters[1])
    parser.set_defaults(runtime_keys={"group_id": group[0], "results_topic": results[0],
                                      "dead_letter_topic": dead_letters[0]})


def runtime_overrides(args: Any) -> dict[str, Any]:
    """The configuration keys the shared flags set (None where a flag was not given)."""
    keys = getattr(args, "runtime_keys", {})
    overrides = {keys[flag]: getattr(args, flag, None) for flag in keys}
    overrides.update({
        "kafka.bootstrap_servers": getattr(args, "bootstrap_servers", None),
        "http.port": getattr(args, "metrics_port", None),
        "http.bind_address": getattr(args, "metrics_bind_address", None),
        "logging.level": getattr(args, "log_level", None),
    })
    return overrides
