"""What reaches the log below DEBUG: tracejudge's own lines, not a line per HTTP request or per failed
Kafka connection attempt (`tracejudge.consumer.runtime.logs`). The `tracejudge run` process against an
unreachable broker is in test_stream_process.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from kafka.errors import KafkaConnectionError, KafkaTimeoutError, TopicAuthorizationFailedError
from support.openai_stub import OpenAIStub

from tracejudge.consumer.config import LoggingSettings
from tracejudge.consumer.runtime.logs import KAFKA_CONNECTION_LOGS, KafkaConnectionLogs
from tracejudge.consumer.stages.run import configure_logging
from tracejudge.metrics.judges.client import JudgeClient
from tracejudge.metrics.judges.endpoints import EndpointConfig

_TOUCHED = ("", "httpx", "httpcore", "kafka", "kafka.net.manager", "kafka.net.connection",
            "kafka.net.transport", "kafka.net.inet", "kafka.cluster", "kafka.coordinator",
            "kafka.coordinator.heartbeat", "kafka.coordinator.consumer", "kafka.consumer.fetcher",
            "kafka.producer.sender", "kafka.producer.kafka")


@pytest.fixture
def cli_logging() -> Iterator[None]:
    """Let a test apply the command's logging configuration; put the process's back afterwards."""
    loggers = [logging.getLogger(name) for name in _TOUCHED]
    saved = [(logger, logger.level, list(logger.filters)) for logger in loggers]
    show = KAFKA_CONNECTION_LOGS.show
    yield
    for logger, level, filters in saved:
        logger.setLevel(level)
        logger.filters[:] = filters
    KAFKA_CONNECTION_LOGS.show = show


def _judge_call(stub: OpenAIStub) -> None:
    client = JudgeClient("default", EndpointConfig(base_url=stub.base_url, model="judge-model"))

    async def go() -> None:
        try:
            await client.chat([{"role": "user", "content": "Is the sky blue?"}])
        finally:
            await client.aclose()

    asyncio.run(go())


@pytest.mark.usefixtures("cli_logging")
def test_a_judge_call_through_httpx_logs_no_request_line_below_debug(
        stub: OpenAIStub, caplog: pytest.LogCaptureFixture) -> None:
    configure_logging(LoggingSettings(level="INFO"))  # what `tracejudge run` applies
    caplog.set_level(logging.INFO)
    _judge_call(stub)
    assert stub.count("/chat/completions") == 1
    assert not [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))], caplog.text
    assert "HTTP Request" not in caplog.text

    configure_logging(LoggingSettings(level="DEBUG"))  # asked for: every library line
    caplog.set_level(logging.DEBUG)
    _judge_call(stub)
    assert any(r.name == "httpx" and "HTTP Request: POST" in r.getMessage() for r in caplog.records)


def _record(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.getLogger(name).makeRecord(name, level, __file__, 1, msg, args, None)


def test_kafka_connection_failures_are_demoted_and_the_last_cause_is_kept() -> None:
    logs = KafkaConnectionLogs()
    refused = KafkaConnectionError("111 ECONNREFUSED")
    for record in (_record("kafka.net.manager", logging.ERROR, "Connection failed: %s", refused),
                   _record("kafka.net.manager", logging.WARNING, "Bootstrap %s not ready; waiting %.2f secs",
                           "bootstrap-0", 0.1),
                   _record("kafka.cluster", logging.WARNING,
                           "No node available for metadata refresh - backoff/retry"),
                   _record("kafka.coordinator", logging.ERROR, "Error sending %s to node %s [%s]",
                           "HeartbeatRequest", "coordinator-1", refused),
                   # a timeout is the symptom, not the cause: the cause before it is kept
                   _record("kafka.net.manager", logging.ERROR, "Bootstrap failed: %s",
                           KafkaTimeoutError("Unable to bootstrap"))):
        assert logs.filter(record) is False
        assert (record.levelno, record.levelname) == (logging.DEBUG, "DEBUG")
    assert logs.last_error() == "KafkaConnectionError: 111 ECONNREFUSED"
    assert logs.last_error(since=float("inf")) is None
    # Shown (as DEBUG) when the level is DEBUG.
    logs.show = True
    assert logs.filter(_record("kafka.net.connection", logging.ERROR, "%s: Connection lost: %s", "conn",
                               refused)) is True
    # What is not about reaching the broker stays as it is.
    for record in (_record("kafka.cluster", logging.ERROR, "Topic %s is not authorized for this client", "t"),
                   _record("kafka.coordinator", logging.ERROR, "Error sending %s to node %s [%s]",
                           "OffsetCommitRequest", 1, TopicAuthorizationFailedError("t")),
                   _record("kafka.net.manager", logging.INFO, "Bootstrap complete")):
        level = record.levelno
        assert logs.filter(record) is True and record.levelno == level
