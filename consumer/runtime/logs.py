"""What the libraries tracejudge uses may say in its log, for the `tracejudge` command.

Below DEBUG (`--log-level`, `logging.level`, `TRACEJUDGE_LOGGING__LEVEL`), a log line is tracejudge's:

- httpx and httpcore log one INFO line per HTTP request ("HTTP Request: POST … 200 OK"), that is one
  per judge call: their loggers are set to WARNING. Failed judge calls are tracejudge's to report
  (`tracejudge_judge_errors_total` and its own rate-limited lines).
- kafka-python narrates connections and group membership at INFO (its loggers are set to WARNING),
  and while a broker cannot be reached it logs every failed connection attempt, metadata refresh,
  fetch and heartbeat at ERROR or WARNING, several lines a second for as long as the broker is away.
  Those records are demoted to DEBUG by `KafkaConnectionLogs`: tracejudge reports an unreachable
  broker itself, in one line naming the bootstrap servers, the time it waited and what happens next
  (`consumer/runtime/loop.py`), and quotes kafka-python's last connection error in it. So are a request
  cancelled because its own client is closing (`kafka.cluster`'s "Metadata refresh: failed Cancelled"
  at shutdown) and its event loop's "… is blocking the event loop" warning (`kafka.net.selector`: a
  task that ran over 0.1 s on a busy process). kafka-python's other warnings and errors
  (authorisation, fencing, a crashed IO thread) are left as they are.

`configure_logging` sets up the root logger of a stage's process (`tracejudge run`, `sink`, ...): a
stderr handler, JSON lines when `logging.format` says so, the level. `suppress_logged` is how the
runtime's shutdown steps log a failure and go on. `cannot_connect` is the one line that says why a
stage could not reach Kafka at start-up, quoting kafka-python's last connection error.

With DEBUG every library line is shown, kafka-python's connection failures as DEBUG records.
The Python API (`tracejudge.evaluate`, `Evaluator`, an embedded `StreamRunner`) leaves its host's
logging configuration alone.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
import time
from typing import Any, Final

from tracejudge.consumer.config import LoggingSettings, Settings

__all__ = ["KAFKA_CONNECTION_LOGS", "KafkaConnectionLogs", "cannot_connect", "configure_library_logs",
           "configure_logging", "suppress_logged"]

# One INFO line per request.
HTTP_LOGGERS: Final = ("httpx", "httpcore")
# kafka-python's network layer: each of its warnings and errors is about reaching a broker (refused or
# lost connections, DNS, SASL handshakes), so all of them are demoted.
_NETWORK_LOGGERS: Final = ("kafka.net.manager", "kafka.net.connection", "kafka.net.transport",
                           "kafka.net.inet")
# kafka-python's client layer: only records about a broker that cannot be reached are demoted (those
# carrying a connection error, and the fixed messages below); the rest stays as it is.
_CLIENT_LOGGERS: Final = ("kafka.cluster", "kafka.coordinator", "kafka.coordinator.heartbeat",
                          "kafka.coordinator.consumer", "kafka.consumer.fetcher", "kafka.producer.sender",
                          "kafka.producer.kafka")
_CONNECTION_MESSAGES: Final = ("No node available for metadata refresh",
                               "Heartbeat session expired",
                               "Heartbeat failed for group %s: coordinator")
# kafka-python's event loop warns when one of its tasks ran longer than 0.1 s ("... is blocking the
# event loop"): on a busy process the GIL, not a bug, and nothing a user can act on. Demoted to DEBUG.
_SCHEDULER_LOGGER: Final = "kafka.net.selector"
_SCHEDULER_MESSAGES: Final = ("blocking the event loop",)


@functools.cache
def _kafka_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(the errors of a broker that cannot be reached, the symptoms among them that name no cause),
    imported on first use: a filter on kafka-python's loggers only runs once kafka-python is imported
    (`tracejudge eval` never is). `Cancelled` is a request in flight when its own client closes (a
    metadata refresh racing `close()`, logged at ERROR by `kafka.cluster`): nothing is wrong, and it
    must not replace the real cause quoted in tracejudge's "cannot reach Kafka" line."""
    from kafka import errors as e

    return ((e.KafkaConnectionError, e.NodeNotReadyError, e.RequestTimedOutError, e.KafkaTimeoutError,
             e.CoordinatorNotAvailableError, e.NotCoordinatorError, e.Cancelled, OSError),
            (e.KafkaTimeoutError, e.Cancelled))


class KafkaConnectionLogs(logging.Filter):
    """Demotes kafka-python's records about an unreachable broker from WARNING/ERROR to DEBUG, shown
    only when `show` (the level is DEBUG), and keeps the last connection error they carried for
    tracejudge's own line (`last_error()`). Installed on kafka-python's loggers by
    `configure_library_logs`; a filter on a logger sees only that logger's own records."""

    def __init__(self) -> None:
        super().__init__()
        self.show = False
        self._lock = threading.Lock()
        self._last: tuple[float, str] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not self._about_connections(record):
            return True
        cause = _cause(record)
        if cause is not None:
            with self._lock:
                self._last = (time.monotonic(), cause)
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return self.show

    @staticmethod
    def _about_connections(record: logging.LogRecord) -> bool:
        if record.name in _NETWORK_LOGGERS:
            return True
        if record.name == _SCHEDULER_LOGGER:
            return isinstance(record.msg, str) and any(m in record.msg for m in _SCHEDULER_MESSAGES)
        if _connection_error(record) is not None:
            return True
        return isinstance(record.msg, str) and record.msg.startswith(_CONNECTION_MESSAGES)

    def last_error(self, since: float | None = None) -> str | None:
        """kafka-python's last connection error ("KafkaConnectionError: 111 ECONNREFUSED"), if one was
        logged at or after `since` (a `time.monotonic()` value)."""
        with self._lock:
            last = self._last
        if last is None or (since is not None and last[0] < since):
            return None
        return last[1]


def _errors_in(record: logging.LogRecord) -> list[Any]:
    args = list(record.args) if isinstance(record.args, tuple) else []
    if record.exc_info:
        args.append(record.exc_info[1])
    return args


def _connection_error(record: logging.LogRecord) -> BaseException | None:
    connection_errors = _kafka_errors()[0]
    return next((a for a in _errors_in(record) if isinstance(a, connection_errors)), None)


def _cause(record: logging.LogRecord) -> str | None:
    """The error a record reports, as text; not a timeout (the symptom of the others) nor a
    cancellation (the client closing)."""
    symptoms = _kafka_errors()[1]
    for exc in _errors_in(record):
        if isinstance(exc, BaseException) and not isinstance(exc, symptoms):
            text, name = str(exc), type(exc).__name__
            text = text if text.startswith(name) else f"{name}: {text}" if text else name
            return text[:200]
    if record.name == "kafka.net.inet":  # "DNS lookup failed for kafka-1:9092, gaierror(-2, ...)"
        return record.getMessage()[:200]
    return None


# One filter for the process: the stream runner asks it for the last connection error.
KAFKA_CONNECTION_LOGS: Final = KafkaConnectionLogs()


def configure_library_logs(level: str | int) -> None:
    """Keep library chatter out of a log at `level` (see the module docstring); at DEBUG show it.
    Idempotent: `tracejudge run` calls it again once its configuration has set the level."""
    if isinstance(level, str):
        level = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    debug = level <= logging.DEBUG
    quiet = logging.NOTSET if debug else logging.WARNING
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
    # kafka-python narrates every connection and join at INFO; our own lines say what matters.
    logging.getLogger("kafka").setLevel(quiet)
    KAFKA_CONNECTION_LOGS.show = debug
    for name in (*_NETWORK_LOGGERS, *_CLIENT_LOGGERS, _SCHEDULER_LOGGER):
        logger = logging.getLogger(name)
        if KAFKA_CONNECTION_LOGS not in logger.filters:
            logger.addFilter(KAFKA_CONNECTION_LOGS)



def cannot_connect(what: str, settings: Settings, exc: BaseException, started: float) -> str:
    """The one line that says why a stage could not start on Kafka."""
    from kafka.errors import KafkaTimeoutError  # kafka-python only for a stage, not for every command

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


# -- a stage's process ------------------------------------------------------------------------------



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
