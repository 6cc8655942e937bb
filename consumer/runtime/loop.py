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
`stream.shutdown_grace_seconds`, commit, leave the group. It owns the producer as well
(`producer.py`'s `Producing`, made from `Stage.outputs()`): set up before the consumer, its re-sends
run every loop turn, its dead letters waited for on revocation and at shutdown, closed last. A stage
keeps its state per partition and never touches a Kafka client.

Neighbours: the `Stage` interface is `stage.py`; offsets and the work handed on (`Exports`) are
`offsets.py`'s; a stage's process (signals, `stage_main`, the shared flags) is `process.py`; logging
set-up is `logs.py`.

Threads: the poll loop (the caller of `run()`) fetches, calls the stage and commits. kafka-python 3.x
runs rebalance callbacks on its IO thread while the poll thread is blocked in `poll()` or `close()`,
where a blocking `commit()` raises, so the listener is an `AsyncConsumerRebalanceListener` that
awaits `commit_async` (and `Stage.revoke`). The HTTP server answers from its own threads.

Embedding (`ConsumerRuntime` and its subclasses `StreamRunner`, `SinkRunner`): `start()` runs in a
daemon thread, `stop()` asks it to stop (safe from signal handlers), `join()` waits; `.error` keeps
the exception that ended it, `.http_port` is the bound port, `.registry` the Prometheus registry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any, Protocol

from kafka import AsyncConsumerRebalanceListener, KafkaConsumer
from kafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import Settings
from tracejudge.consumer.runtime.fleet_spend import FleetSpendBoards, start_fleet_spend
from tracejudge.consumer.runtime.http import OperationsServer
from tracejudge.consumer.runtime.logs import KAFKA_CONNECTION_LOGS, cannot_connect, suppress_logged
from tracejudge.consumer.runtime.offsets import OffsetTracker
from tracejudge.consumer.runtime.producer import Producing
from tracejudge.consumer.runtime.stage import Stage
from tracejudge.schemas.errors import StartupError

__all__ = ["ConsumerRuntime", "RuntimeMetrics", "describe_partitions"]


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
        # The stage's producer, opened in `_connect` (none when the stage names no output topic).
        self.producing = Producing(settings, stage.outputs(), logger=self.log)
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
        self._fleet_spend: FleetSpendBoards | None = None

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
        self.producing.open()
        self.stage.open(self)
        # Fleet-wide spend caps (judges.fleet_spend): the ledgers of the stage's judge runners.
        self._fleet_spend = start_fleet_spend(s)
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
        resend = self.producing.run_due_retries
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
            resend()
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
                with suppress_logged(self.log, "pausing fetches"):
                    if consumer.assignment():
                        consumer.pause(*consumer.assignment())
                with suppress_logged(self.log, "stopping the stage"):
                    self.stage.stopping()
                if busy := self.stage.busy() + self.producing.busy:
                    self.log.info("stopping: waiting up to %.1f s (stream.shutdown_grace_seconds) for %d "
                                  "in flight", s.stream.shutdown_grace_seconds, busy)
                deadline = time.monotonic() + s.stream.shutdown_grace_seconds
                with suppress_logged(self.log, "draining the stage"):
                    self.stage.drain(deadline)
                with suppress_logged(self.log, "sending the dead letters"):
                    self.producing.settle(deadline)
                self._commit()
                unfinished = self.tracker.incomplete()
                if unfinished:
                    self.metrics.revoked_unfinished.inc(sum(unfinished.values()))
                    self.log.warning("stopping with %d records unfinished; they will be re-delivered: %s",
                                     sum(unfinished.values()), describe_partitions(unfinished))
                self._closing = True
                with suppress_logged(self.log, "closing the consumer"):
                    # Runs the listener's on_partitions_revoked (a last commit) and leaves the group.
                    consumer.close(autocommit=False, timeout_ms=s.kafka.commit_timeout_ms)
        finally:
            with suppress_logged(self.log, "closing the stage"):
                self.stage.close()
            if self._fleet_spend is not None:
                self._fleet_spend.close()
            self.producing.close()
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

        deadline = time.monotonic() + grace
        note = await self.stage.revoke(revoked, deadline, sleep)
        await self.producing.settle_revoked(deadline, sleep)  # dead letters on their way
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
