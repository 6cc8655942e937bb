"""What a stage is to the consumer runtime: the `Stage` hooks, and the `Runtime` a stage sees.

`ConsumerRuntime` (`loop.py`) owns the consumer, the commits and the producer (`producer.py`); a
`Stage` (`consumer/stages/`: run, sink, sessions, agreement) does its own work in these hooks and
never touches a Kafka client. Offsets and the work handed on are `offsets.py`'s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any, Protocol

from kafka.structs import TopicPartition

from tracejudge.consumer.config import Settings
from tracejudge.consumer.runtime.offsets import OffsetTracker
from tracejudge.consumer.runtime.producer import Outputs, Producing

__all__ = ["NO_LIMIT", "IoSleep", "Runtime", "Stage"]

# A stage's way to wait on the IO thread (revocation): yields to kafka-python's loop, heartbeats go on.
IoSleep = Callable[[float], Awaitable[None]]

NO_LIMIT = 1 << 30


class Runtime(Protocol):
    """What a stage sees of the runtime that runs it (`ConsumerRuntime`)."""

    settings: Settings
    tracker: OffsetTracker
    producing: Producing

    def request_commit(self) -> None: ...



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

    def outputs(self) -> Outputs:
        """Where the stage's results and dead letters go and which series count them; the runtime's
        producer (`runtime.producing`) is made only when a topic is named."""
        return Outputs()

    def prepare(self, runtime: Runtime) -> None:
        """Before `/metrics` is served and Kafka is reached: start helpers, check configuration
        (raise `ConfigError` or `StartupError`)."""

    def open(self, runtime: Runtime) -> None:
        """Create the stage's own clients before the consumer (`runtime.producing` is open by now);
        `StartupError` when they cannot be made."""

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
        `await sleep(s)`, or `runtime.producing.settle_revoked`), give up the rest (its tickets stay
        unreleased: re-read later). The runtime then waits for the dead letters in flight. Returns a
        note for the log line."""
        return ""

    def lose(self, tps: set[TopicPartition]) -> None:
        """Partitions were lost (already someone else's): drop their state."""

    def assigned(self, tps: set[TopicPartition]) -> None:
        """Partitions were assigned."""

    def busy(self) -> int:
        """Work in flight that a shutdown waits for (for the log), besides the dead letters."""
        return 0

    def stopping(self) -> None:
        """The runtime stopped fetching; give up what cannot finish without the poll loop."""

    def drain(self, deadline: float) -> None:
        """Finish in-flight work until `deadline` (the shutdown's grace period; `producing.settle`
        runs the re-sends meanwhile). The runtime then waits for the dead letters in flight."""

    def close(self) -> None:
        """Release the stage's clients; called once, after the consumer left the group and before the
        runtime closes the producer. Must not raise."""
