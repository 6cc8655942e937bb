"""Where evaluated records go: the results topic and the dead-letter topic.

Both release the record's `Ticket` only when the broker has acknowledged the write (acks=all), so an
offset is never committed before its output is durable. A write the producer gives up on (after its
own retries, `producer.delivery_timeout_ms`) is counted and sent again after a back-off, from the
poll thread; the offset waits meanwhile, which stalls the commit rather than losing the record. A
write the broker can never accept (too large) is not retried forever: a result becomes a dead letter
(reason `result_rejected`, the value omitted), a dead letter is re-sent without its value.

Dead letters carry the original key, value and headers, plus headers naming why and where from:

    tracejudge-reason             invalid_json | too_large | ... (the `reason` label)
    tracejudge-error              the human-readable error (field path and position, the bad value's
                                  type, never its content), <= 2000 chars
    tracejudge-source-topic       topic, partition, offset and timestamp of the original record
    tracejudge-source-partition
    tracejudge-source-offset
    tracejudge-source-timestamp
    tracejudge-format             the format configured for the topic (auto, mlflow, ...)
    tracejudge-value-omitted      present (original size in bytes) when the value was too large to copy
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kafka.errors import MessageSizeTooLargeError, RecordListTooLargeError

from tracejudge.consumer.runtime.offsets import Releasable
from tracejudge.metrics.judges.redaction import Redactor
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.errors import exception_text
from tracejudge.schemas.result import EvaluationResult, SourceRef, session_key

__all__ = [
    "HEADER_ERROR",
    "HEADER_FORMAT",
    "HEADER_OFFSET",
    "HEADER_PARTITION",
    "HEADER_REASON",
    "HEADER_TIMESTAMP",
    "HEADER_TOPIC",
    "HEADER_VALUE_OMITTED",
    "PROCESSING_ERROR",
    "RESULT_REJECTED",
    "DeadLetterSink",
    "Publisher",
    "ResultSink",
]

log = logging.getLogger(__name__)

HEADER_REASON = "tracejudge-reason"
HEADER_ERROR = "tracejudge-error"
HEADER_TOPIC = "tracejudge-source-topic"
HEADER_PARTITION = "tracejudge-source-partition"
HEADER_OFFSET = "tracejudge-source-offset"
HEADER_TIMESTAMP = "tracejudge-source-timestamp"
HEADER_FORMAT = "tracejudge-format"
HEADER_VALUE_OMITTED = "tracejudge-value-omitted"

# Reasons the runner adds to the parsers' closed set (tracejudge.schemas.errors.REASONS).
# A parser or metric raised something other than RecordError: a bug, but the stream goes on.
PROCESSING_ERROR = "processing_error"
# The record's result could not be published: the broker refused it (larger than its limit), or
# what custom code put in the record cannot be written as JSON.
RESULT_REJECTED = "result_rejected"

_ERROR_HEADER_MAX = 2000
# Room for the key, the headers and the record overhead next to a copied value.
_ENVELOPE_BYTES = 16 * 1024
_SIZE_ERRORS = (MessageSizeTooLargeError, RecordListTooLargeError)

Header = tuple[str, bytes]


class RateLimitedLog:
    """At most `burst` lines per key per `window` seconds, then one line saying how many were dropped:
    a flood of identical dead letters must not bury the one line that explains it."""

    def __init__(self, logger: logging.Logger, burst: int = 5, window: float = 60.0) -> None:
        self._log = logger
        self._burst = burst
        self._window = window
        self._state: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            state = self._state.setdefault(key, [now, 0, 0])  # window start, logged, suppressed
            if now - state[0] >= self._window:
                if state[2]:
                    self._log.warning("%d more %s messages suppressed in the last %.0f s", state[2], key,
                                      now - state[0])
                state[:] = [now, 0, 0]
            if state[1] >= self._burst:
                state[2] += 1
                return
            state[1] += 1
        self._log.warning(msg, *args)


class Publisher:
    """A producer that reports acks and failures and re-sends on the poll thread.

    Producer callbacks run on the producer's network thread, where a blocking `send()` (waiting for
    metadata) could deadlock it; re-sends are therefore queued and run by `run_due_retries()`, which
    the poll loop calls every turn.
    """

    def __init__(self, producer: Any, *, retry_backoff: float = 1.0, max_backoff: float = 30.0) -> None:
        self.producer = producer
        self.retry_backoff = retry_backoff
        self.max_backoff = max_backoff
        self._retries: collections.deque[tuple[float, Callable[[], None]]] = collections.deque()

    def send(self, topic: str, *, value: bytes | None, key: bytes | None, headers: list[Header],
             on_ack: Callable[[], None], on_error: Callable[[Exception], None]) -> None:
        try:
            future = self.producer.send(topic, value=value, key=key, headers=headers)
        except Exception as exc:  # size checked client-side, metadata timeout, closed producer
            on_error(exc)
            return
        future.add_callback(lambda _metadata: on_ack())
        future.add_errback(on_error)

    def retry_later(self, attempt: int, fn: Callable[[], None]) -> None:
        delay = min(self.max_backoff, self.retry_backoff * (2 ** min(attempt, 10)))
        self._retries.append((time.monotonic() + delay, fn))

    def run_due_retries(self) -> int:
        """Run the re-sends whose back-off has passed; returns how many ran."""
        if not self._retries:
            return 0
        now = time.monotonic()
        ran = 0
        for _ in range(len(self._retries)):
            due, fn = self._retries.popleft()
            if due <= now:
                fn()
                ran += 1
            else:
                self._retries.append((due, fn))
        return ran

    @property
    def pending_retries(self) -> int:
        return len(self._retries)

    def flush(self, timeout: float | None) -> None:
        self.producer.flush(timeout=timeout)


# The built-in detectors (no metrics: nothing here goes to a judge), shared: a Redactor is thread-safe.
_ERROR_REDACTOR = Redactor()


def _scrubbed(error: str) -> str:
    """A dead letter's error as its header and log line show it. The messages that name a record's
    bad value give its type, never its content (`schemas.errors.describe_value`); this catches what
    slipped through anyway (an exception's message from a library): e-mail addresses, card, phone,
    IBAN and social security numbers, IP addresses and keys become placeholders (`<EMAIL_1>`)."""
    return _ERROR_REDACTOR.session().text(error)


class DeadLetterSink:
    """Routes rejected records to the dead-letter topic, or only logs and counts them without one."""

    def __init__(self, publisher: Publisher | None, topic: str | None, metrics: PrometheusExporter, *,
                 max_request_size: int = 1_048_576) -> None:
        if topic is not None and publisher is None:
            raise ValueError("a dead-letter topic needs a publisher")
        self.publisher = publisher
        self.topic = topic
        self.metrics = metrics
        self.max_value_bytes = max(0, max_request_size - _ENVELOPE_BYTES)
        self._log = RateLimitedLog(log)

    def send(self, *, source: SourceRef, reason: str, error: str, ticket: Releasable, value: bytes | None,
             key: bytes | None = None, headers: Sequence[Header] = (), timestamp_ms: int | None = None,
             count_record: bool = True) -> None:
        """Dead-letter one record; `ticket` is released when the dead letter is acknowledged."""
        routed = self.topic is not None
        if count_record:
            self.metrics.count_dead_letter(source.topic or "", reason, routed)
        else:
            self.metrics.dead_letters.labels(reason).inc()
            if not routed:
                self.metrics.dead_letters_unrouted.labels(reason).inc()
        where = f"{source.topic}[{source.partition}]@{source.offset}"
        error = _scrubbed(error)
        if not routed:
            self._log.warning(f"dead letter ({reason})", "dead letter %s (%s): %s; no dead-letter topic "
                              "configured, record dropped", where, reason, error)
            ticket.release()
            return
        self._log.warning(f"dead letter ({reason})", "dead letter %s -> %s (%s): %s", where, self.topic,
                          reason, error)
        ours: list[Header] = [
            (HEADER_REASON, reason.encode()),
            (HEADER_ERROR, error[:_ERROR_HEADER_MAX].encode("utf-8", "replace")),
            (HEADER_TOPIC, (source.topic or "").encode()),
            (HEADER_PARTITION, str(source.partition).encode()),
            (HEADER_OFFSET, str(source.offset).encode()),
            (HEADER_FORMAT, source.format.encode()),
        ]
        if timestamp_ms is not None:
            ours.append((HEADER_TIMESTAMP, str(timestamp_ms).encode()))
        # Keep the producer's own headers (trace context, content type), minus stale copies of ours.
        kept = [(k, v) for k, v in headers if not k.startswith("tracejudge-")]
        if value is not None and len(value) > self.max_value_bytes:
            ours.append((HEADER_VALUE_OMITTED, str(len(value)).encode()))
            value = None
        self._send(kept + ours, key, value, ticket, where, attempt=0)

    def dead_letter(self, record: Any, reason: str, detail: str, ticket: Releasable, *,
                    source: SourceRef | None = None, record_format: str = "auto",
                    count_record: bool = True) -> None:
        """Dead-letter one consumed record (a `ConsumerRecord`: its key, value, headers and timestamp
        are copied), or, with `record` None, what `source` names (a record known only by its
        coordinates: an assembled trace, a result that could not be written). `source` defaults to
        the record's coordinates with `record_format`. `ticket` is released on the broker's ack."""
        if source is None:
            source = SourceRef(format=record_format, topic=record.topic, partition=record.partition,
                               offset=record.offset)
        if record is None:
            self.send(source=source, reason=reason, error=detail, ticket=ticket, value=None,
                      count_record=count_record)
            return
        self.send(source=source, reason=reason, error=detail, ticket=ticket, value=record.value,
                  key=record.key, headers=record.headers, timestamp_ms=record.timestamp,
                  count_record=count_record)

    def _send(self, headers: list[Header], key: bytes | None, value: bytes | None, ticket: Releasable,
              where: str, attempt: int) -> None:
        assert self.publisher is not None and self.topic is not None
        publisher, topic = self.publisher, self.topic

        def failed(exc: Exception) -> None:
            self.metrics.dead_letter_publish_failures.inc()
            if isinstance(exc, _SIZE_ERRORS) and value is not None:
                log.warning("dead letter for %s rejected as too large (%s); re-sending without its value",
                            where, exc)
                omitted = [*headers, (HEADER_VALUE_OMITTED, str(len(value)).encode())]
                publisher.retry_later(0, lambda: self._send(omitted, key, None, ticket, where, attempt + 1))
                return
            self._log.warning("dead-letter publish failure", "cannot publish dead letter for %s to %s "
                              "(attempt %d): %s: %s; retrying, the offset waits", where, topic,
                              attempt + 1, type(exc).__name__, exc)
            publisher.retry_later(attempt, lambda: self._send(headers, key, value, ticket, where,
                                                              attempt + 1))

        # The producer refuses a record with neither key nor value.
        publisher.send(topic, value=value if value is not None or key is not None else b"", key=key,
                       headers=headers, on_ack=ticket.release, on_error=failed)


class ResultSink:
    """Publishes one JSON result per evaluated record, keyed by its session id when the record has
    one (every turn of a conversation on one partition, for the session stage; an id over 256 bytes
    by its hash, counted), else by trace id (else request id): `EvaluationResult.key`."""

    def __init__(self, publisher: Publisher | None, topic: str | None, metrics: PrometheusExporter,
                 dead_letters: DeadLetterSink) -> None:
        if topic is not None and publisher is None:
            raise ValueError("a results topic needs a publisher")
        self.publisher = publisher
        self.topic = topic
        self.metrics = metrics
        self.dead_letters = dead_letters
        self._log = RateLimitedLog(log)

    def publish(self, result: EvaluationResult, ticket: Releasable) -> None:
        """Hands the ticket's reference over: released on the broker's ack (at once without a topic)."""
        if self.topic is None:
            ticket.release()
            return
        session = result.record.session_id
        if session:
            key, hashed = session_key(session)
            if hashed:
                self.metrics.session_ids_hashed.inc()
        else:
            key = result.key
        src = result.source
        headers: list[Header] = [
            ("content-type", b"application/json"),
            (HEADER_TOPIC, (src.topic or "").encode()),
            (HEADER_PARTITION, str(src.partition).encode()),
            (HEADER_OFFSET, str(src.offset).encode()),
        ]
        try:
            value, key_bytes = result.to_json(), key.encode() if key else None
        except Exception as exc:  # what custom code put in a record: never hold the offset back for it
            log.exception("writing the result of %s[%s]@%s failed", src.topic, src.partition, src.offset)
            self.dead_letters.send(source=src, reason=RESULT_REJECTED, ticket=ticket, value=None,
                                   error=f"result could not be written: {exception_text(exc)}",
                                   count_record=False)
            return
        self.send(value, key_bytes, headers, ticket, source=src)

    def send(self, value: bytes, key: bytes | None, headers: list[Header], ticket: Releasable, *,
             source: SourceRef, kind: str = "result", where: str | None = None,
             waits: str = "the offset waits") -> None:
        """Publish one serialised result (a trace's, a session's: `kind`) to the results topic; `ticket`
        is released on the broker's ack. A failed write is retried after a back-off (`waits` says what
        is held meanwhile); one the broker refuses as too large becomes a dead letter
        (`result_rejected`). `where` names it in the log (default: its source record)."""
        if where is None:
            where = f"the {kind} of {source.topic}[{source.partition}]@{source.offset}"
        self._send(_Outgoing(value, key, headers, ticket, source, kind, where, waits), attempt=0)

    def _send(self, out: _Outgoing, attempt: int) -> None:
        assert self.publisher is not None and self.topic is not None
        publisher, topic, metrics = self.publisher, self.topic, self.metrics

        def acked() -> None:
            metrics.results_published.inc()
            out.ticket.release()

        def failed(exc: Exception) -> None:
            metrics.result_publish_failures.inc()
            if isinstance(exc, _SIZE_ERRORS):
                self.dead_letters.send(source=out.source, reason=RESULT_REJECTED, ticket=out.ticket,
                                       value=None, key=out.key, error=f"{out.kind} of {len(out.value)} "
                                       f"bytes rejected by the broker: {exc}", count_record=False)
                return
            self._log.warning(f"{out.kind} publish failure", "cannot publish %s to %s (attempt %d): %s: %s; "
                              "retrying, %s", out.where, topic, attempt + 1, type(exc).__name__, exc,
                              out.waits)
            publisher.retry_later(attempt, lambda: self._send(out, attempt + 1))

        publisher.send(topic, value=out.value, key=out.key, headers=out.headers, on_ack=acked,
                       on_error=failed)


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """A result on its way to the results topic, and how its log lines name it."""

    value: bytes
    key: bytes | None
    headers: list[Header]
    ticket: Releasable
    source: SourceRef
    kind: str
    where: str
    waits: str
