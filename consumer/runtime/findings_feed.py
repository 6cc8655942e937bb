"""The current findings for `tracejudge run`'s `finding:` collection conditions: one thread that reads
every partition of `findings.findings_topic` from the beginning (no consumer group, nothing committed)
into a `FindingIndex` (per (app, judge) the values of its latest window's findings, bounded), the
`FindingSource` of the run's `Collector`.

Available (finding conditions can hold) once the topic has been read to the end offsets it had when the
feed connected, and for as long as the broker answers; while the topic does not exist or cannot be read,
`available()` is False, the collector counts each trace a finding rule could have taken as dropped
(`no_findings`), and the state is logged once per change. Precedent: `fleet_spend.py`. Reconnecting
re-reads the topic from the beginning into a fresh index (a compacted or short-retention topic keeps
that cheap).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping
from typing import Any

import orjson
from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from tracejudge.consumer.collecting import FindingIndex
from tracejudge.consumer.config import Settings

__all__ = ["FindingsFeed"]

log = logging.getLogger("tracejudge.collections")

POLL_MS = 200
RECONNECT_SECONDS = 2.0


class FindingsFeed:
    """Reads the findings topic in a daemon thread; `values`/`available` are thread-safe."""

    def __init__(self, settings: Settings, topic: str) -> None:
        self.settings = settings
        self.topic = topic
        self.index = FindingIndex()
        self.read = 0  # finding lines read (this connection)
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: str | None = None  # the state last logged: "" read, else the error
        self._thread = threading.Thread(target=self._run, name="tracejudge-findings-feed", daemon=True)

    def start(self) -> FindingsFeed:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # -- FindingSource ------------------------------------------------------------------------------
    def available(self) -> bool:
        return self._ready.is_set()

    def values(self, app: str, judge: str) -> Mapping[str, Collection[str]] | None:
        return self.index.values(app, judge)

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            consumer: KafkaConsumer | None = None
            try:
                consumer = KafkaConsumer(**self.settings.kafka.client_config(), group_id=None,
                                         enable_auto_commit=False, auto_offset_reset="earliest")
                self._serve(consumer)
            except Exception as exc:  # the broker or the topic went away: finding conditions pause
                self._ready.clear()
                self._report(f"{type(exc).__name__}: {exc}")
                self._stop.wait(RECONNECT_SECONDS)
            finally:
                if consumer is not None:
                    try:
                        consumer.close(timeout=2)
                    except Exception as exc:
                        log.debug("findings feed: closing the consumer: %s", exc)

    def _serve(self, consumer: KafkaConsumer) -> None:
        partitions = consumer.partitions_for_topic(self.topic)
        if not partitions:
            raise LookupError(f"topic {self.topic!r} does not exist (nothing has published findings yet)")
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        self.index, self.read = FindingIndex(), 0
        while not self._stop.is_set():
            for records in consumer.poll(timeout_ms=POLL_MS).values():
                for rec in records:
                    self._apply(rec.value)
            if not self._ready.is_set() and all(consumer.position(tp) >= end[tp] for tp in tps):
                self._ready.set()
                self._report(None)

    def _apply(self, value: bytes | None) -> None:
        try:
            line: Any = orjson.loads(value or b"")
        except orjson.JSONDecodeError:
            return
        if isinstance(line, dict) and self.index.add(line):
            self.read += 1

    def _report(self, error: str | None) -> None:
        """Log a change of the feed's state once."""
        if (error or "") == self._error:
            return
        if error is not None:
            log.warning("findings feed: cannot read %r (%s); finding: collection conditions match nothing "
                        "until it can be read; retrying", self.topic, error)
        else:
            log.info("findings feed: read %r (%d findings, %d app/judge pairs, %d over the bounds "
                     "ignored)", self.topic, self.read, len(self.index), self.index.ignored)
        self._error = error or ""
