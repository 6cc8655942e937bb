"""The runtime's producer: the one way every stage's output leaves.

A stage names where its output goes (`Stage.outputs()`: a results topic, a dead-letter topic, the
series that count them); `ConsumerRuntime` (`loop.py`) makes one `Producing` from that, opens it
before the consumer (no `KafkaProducer` at all when the stage names neither topic), runs its due
re-sends every loop turn, waits for what it has in flight on revocation and at shutdown, and closes
it after the stage. `tracejudge backfill`, which runs its own consumer, uses it the same way. So a
stage only says what to send:

    producing.dead_letter(record, reason, detail, ticket)   the one way out for a rejected record
    producing.results.publish(result, ticket)                a trace's result (`ResultSink`)
    producing.results.send(value, key, headers, ticket, ...) any serialised result (a session's)
    producing.settle(deadline, busy, ...)                    wait for the stage's own work (judges),
                                                             running the re-sends it may need

At-least-once: the ticket handed over is released on the broker's ack (acks=all), never earlier, so
a record's offset is committed only once its output is durable (`offsets.py`). A write the producer
gives up on is retried from the poll thread (`Publisher`); the offset waits meanwhile. The
publishers themselves (headers, retries, size limits) are in `producing.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer

from tracejudge.consumer.config import Settings
from tracejudge.consumer.runtime.logs import cannot_connect, suppress_logged
from tracejudge.consumer.runtime.offsets import Exports, Releasable
from tracejudge.consumer.runtime.producing import DeadLetterSink, Publisher, ResultSink
from tracejudge.schemas.errors import StartupError
from tracejudge.schemas.result import SourceRef

__all__ = ["Outputs", "Producing"]

log = logging.getLogger("tracejudge.runtime")

# Makes the results publisher from the producer's `Publisher` (None without a producer) and the
# dead letters; makes the dead-letter publisher from the `Publisher`.
MakeResults = Callable[[Publisher | None, DeadLetterSink], ResultSink]
MakeDeadLetters = Callable[[Publisher | None], DeadLetterSink]


@dataclass(frozen=True, slots=True)
class Outputs:
    """Where a stage's output goes (`Stage.outputs()`).

    `metrics` counts results and dead letters (`results_published`, `count_dead_letter`, ...: a
    `PrometheusExporter`, `SessionMetrics` or `SinkMetrics`); `record_format` is the format a dead
    letter's `tracejudge-format` header names when the stage does not say (`tracejudge_result` for
    the stages that read results). `make_results`/`make_dead_letters` replace the publishers (the
    backfill marks its results and only counts its rejects). `extra_topics`: other topics the stage's
    results publisher writes to (the run stage's collections), which need the producer too."""

    metrics: Any = None
    results_topic: str | None = None
    dead_letter_topic: str | None = None
    record_format: str = "auto"
    make_results: MakeResults | None = None
    make_dead_letters: MakeDeadLetters | None = None
    extra_topics: tuple[str, ...] = ()


class Producing:
    """One stage's producer, its publishers, its re-sends and the dead letters it has in flight."""

    def __init__(self, settings: Settings, outputs: Outputs, *, logger: logging.Logger | None = None) -> None:
        self.settings = settings
        self.outputs = outputs
        self.log = logger or log
        self.producer: KafkaProducer | None = None
        self.publisher: Publisher | None = None
        # Dead letters sent through `dead_letter` and not acknowledged yet.
        self.letters = Exports()
        self.dead_letters = DeadLetterSink(None, None, outputs.metrics)
        self.results = ResultSink(None, None, outputs.metrics, self.dead_letters)

    def open(self) -> None:
        """Create the producer when the stage names a topic; `StartupError` when it cannot be made."""
        s, out = self.settings, self.outputs
        if out.results_topic or out.dead_letter_topic or out.extra_topics:
            started = time.monotonic()
            try:
                self.producer = KafkaProducer(**s.kafka.client_config(), **s.producer.producer_config())
            except Exception as exc:
                raise StartupError(cannot_connect("create the producer", s, exc, started)) from exc
            self.publisher = Publisher(self.producer, retry_backoff=s.producer.retry_backoff_seconds)
        if out.make_dead_letters is not None:
            self.dead_letters = out.make_dead_letters(self.publisher)
        else:
            self.dead_letters = DeadLetterSink(self.publisher, out.dead_letter_topic, out.metrics,
                                               max_request_size=s.producer.max_request_size)
        if out.make_results is not None:
            self.results = out.make_results(self.publisher, self.dead_letters)
        else:
            self.results = ResultSink(self.publisher, out.results_topic, out.metrics, self.dead_letters)

    # -- sending -------------------------------------------------------------------------------------

    def dead_letter(self, record: Any, reason: str, detail: str, ticket: Releasable, *,
                    source: SourceRef | None = None, count_record: bool = True) -> None:
        """Dead-letter a consumed record (`DeadLetterSink.dead_letter`); `ticket` is released on the
        broker's ack, and until then a revocation or a shutdown waits for it."""
        self.dead_letters.dead_letter(record, reason, detail, self.letters.start(ticket), source=source,
                                      record_format=self.outputs.record_format, count_record=count_record)

    def run_due_retries(self) -> int:
        """The re-sends whose back-off has passed (poll thread); how many ran."""
        return self.publisher.run_due_retries() if self.publisher is not None else 0

    @property
    def busy(self) -> int:
        """Dead letters sent and not acknowledged yet."""
        return self.letters.count

    # -- waiting -------------------------------------------------------------------------------------

    def settle(self, deadline: float, busy: Callable[[], int] | None = None, *,
               step: Callable[[], object] | None = None,
               wait: Callable[[float], object] | None = None) -> None:
        """Until `busy()` is 0 (default: the dead letters in flight) or `deadline` passes, run `step`
        (e.g. publish what judges finished) and the due re-sends: at shutdown the poll loop no longer
        turns. `wait(seconds)` waits between turns (default: on the dead letters)."""
        if busy is None:
            busy, wait = (lambda: self.letters.count), self.letters.wait_idle
        pause = wait or time.sleep
        while busy() and (left := deadline - time.monotonic()) > 0:
            if step is not None:
                step()
            self.run_due_retries()
            pause(min(0.05, left))

    async def settle_revoked(self, deadline: float, sleep: Callable[[float], Awaitable[None]],
                             busy: Callable[[], int] | None = None, *,
                             step: Callable[[], object] | None = None) -> None:
        """`settle` on kafka-python's IO thread (a revocation): `sleep` yields to its event loop, so
        heartbeats go on meanwhile."""
        if busy is None:
            busy = lambda: self.letters.count  # noqa: E731
        while busy() and time.monotonic() < deadline:
            if step is not None:
                step()
            self.run_due_retries()
            await sleep(0.01)

    def flush(self, timeout: float) -> None:
        """Send what the producer still buffers (the backfill's end)."""
        if self.publisher is not None:
            self.publisher.flush(timeout)

    def close(self) -> None:
        """Close the producer (it sends what it buffers, up to 5 s). Never raises."""
        if self.producer is not None:
            with suppress_logged(self.log, "closing the producer"):
                self.producer.close(timeout=5)
