"""The Kafka side of fleet-wide spend caps (`judges.fleet_spend`): one thread per ledger that reads
partition 0 of the spend topic from the beginning (no group), hands every record to the ledger in log
order, sends the ledger's claims, and publishes its spend every `publish_interval_s`.

The ledgers (`tracejudge.metrics.judges.fleet_spend.FleetSpendLedger`) are made by the judge runners;
`ConsumerRuntime` (and `tracejudge backfill`) attaches this transport to those of its process once the
stage's clients are open, and closes it after the stage, publishing a last spend record; a board also
stops on its own (publishing that record) once its ledger is closed with its runner. A broker that
cannot be reached does not stop the stage: the ledger falls back to its local share after
`stale_after_s`, and the thread keeps reconnecting.

Threads: the board's thread is the only one using its Kafka clients; it hands the ledger what it reads
through the ledger's thread-safe methods, which wake the judgements waiting on the runner's event loop
(`FleetSpendLedger.charge`) by `loop.call_soon_threadsafe`, never by touching the loop's objects.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition

from tracejudge.consumer.config import Settings
from tracejudge.metrics.judges.fleet_spend import FleetSpendLedger, unattached_ledgers

__all__ = ["FleetSpendBoard", "FleetSpendBoards", "start_fleet_spend"]

log = logging.getLogger("tracejudge.runtime")

PARTITION = 0
POLL_MS = 50
RECONNECT_SECONDS = 1.0


class FleetSpendBoard:
    """Serves one ledger: reads the topic into it, sends what it queues. See the module docstring."""

    def __init__(self, settings: Settings, ledger: FleetSpendLedger) -> None:
        self.settings = settings
        self.ledger = ledger
        self.config = ledger.config
        self.tp = TopicPartition(self.config.topic, PARTITION)
        self._stop = threading.Event()
        self._consumer: KafkaConsumer | None = None
        self._producer: KafkaProducer | None = None
        self._error: str | None = None
        ledger.attached = True
        self._thread = threading.Thread(target=self._run, name="tracejudge-fleet-spend", daemon=True)

    def start(self) -> FleetSpendBoard:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop reading; publish the last spend record (best effort) and close the clients."""
        self._stop.set()
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether its thread still serves the ledger."""
        return self._thread.is_alive()

    # -- the thread ---------------------------------------------------------------------------------
    def _stopping(self) -> bool:
        """Closed by the runtime, or its ledger closed with its runner."""
        return self._stop.is_set() or self.ledger.closed

    def _run(self) -> None:
        while not self._stopping():
            try:
                self._connect()
                self._serve()
            except Exception as exc:  # the broker went away: the ledger falls back when it stays away
                self._report(f"{type(exc).__name__}: {exc}")
                self._stop.wait(RECONNECT_SECONDS)
            finally:
                self._disconnect()

    def _report(self, error: str | None) -> None:
        """Log a change of the connection's state once."""
        if error != self._error:
            if error is not None:
                log.warning("fleet spend: cannot use topic %r (%s); retrying", self.config.topic, error)
            else:
                log.info("fleet spend: reading topic %r as replica %r", self.config.topic,
                         self.ledger.replica)
            self._error = error

    def _connect(self) -> None:
        client = self.settings.kafka.client_config()
        self._producer = KafkaProducer(**client, acks="all", linger_ms=0)
        # A first record makes the topic where brokers create topics on first use.
        self._producer.send(self.config.topic, key=f"hello|{self.ledger.replica}".encode(), value=b"{}",
                            partition=PARTITION).get(timeout=self.settings.kafka.request_timeout_ms / 1000)
        self._consumer = KafkaConsumer(**client, group_id=None, enable_auto_commit=False,
                                       auto_offset_reset="earliest")
        self._consumer.assign([self.tp])
        self._consumer.seek_to_beginning(self.tp)
        self.ledger.reread()

    def _serve(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        end = consumer.end_offsets([self.tp])[self.tp]
        self._report(None)
        next_publish = time.monotonic() + self.config.publish_interval_s
        synced = False
        while not self._stopping():
            for records in consumer.poll(timeout_ms=POLL_MS).values():
                for rec in records:
                    self.ledger.apply(rec.key.decode("utf-8", "replace") if rec.key else None, rec.value)
            if not synced and consumer.position(self.tp) >= end:  # read what was there at start
                self.ledger.synced()
                synced = True
            self._send(self.ledger.take_outbox())
            now = time.monotonic()
            if synced and now >= next_publish:
                # Fresh when it has read what the topic held one interval ago and the broker answers.
                read_all = consumer.position(self.tp) >= end
                end = consumer.end_offsets([self.tp])[self.tp]
                if read_all:
                    self.ledger.fresh()
                self.ledger.release_idle()
                self._send(self.ledger.take_outbox())
                self._send(self.ledger.spend_records())
                next_publish = now + self.config.publish_interval_s
            self.ledger.in_fallback()  # keeps the fallback gauge current while idle
        self._send(self.ledger.spend_records())
        assert self._producer is not None
        self._producer.flush(timeout=2.0)

    def _send(self, records: list[tuple[str, bytes]]) -> None:
        assert self._producer is not None
        for key, value in records:
            future: Any = self._producer.send(self.config.topic, key=key.encode(), value=value,
                                              partition=PARTITION)
            future.add_errback(lambda exc, key=key: log.debug("fleet spend: %s not sent: %s", key, exc))

    def _disconnect(self) -> None:
        for client in (self._consumer, self._producer):
            if client is not None:
                try:
                    client.close(timeout=2)
                except Exception as exc:
                    log.debug("fleet spend: closing a client: %s", exc)
        self._consumer = self._producer = None


class FleetSpendBoards:
    """The boards a runtime started; `close` stops them all."""

    def __init__(self, boards: list[FleetSpendBoard]) -> None:
        self.boards = boards

    def close(self) -> None:
        for board in self.boards:
            board.close()


def start_fleet_spend(settings: Settings) -> FleetSpendBoards:
    """Attach a board to every ledger of this process that has none (none without `fleet_spend`)."""
    return FleetSpendBoards([FleetSpendBoard(settings, ledger).start() for ledger in unattached_ledgers()])
