"""No log line shows a secret or a record's personal data: the HTTP libraries' own lines at DEBUG (a
real judge request to the loopback stub, with secret query parameters and headers on the wire), the
start-up listing of `tracejudge run`, kafka-python's DEBUG dumps of the bytes it sends, and the dead
letters (their headers and the warnings) for records holding an e-mail address and a card number in a
wrongly typed field."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from support.kafka import RunnerProcess, produce, read_topic, unique, wait_until
from support.openai_stub import OpenAIStub

from tracejudge.consumer.runtime import producing as sinks
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.secrets import HTTP_LOGGERS
from tracejudge.schemas.record import EvalRecord

QUERY_SECRET = "QP-SECRET-4d2f9a"
HEADER_SECRET = "HDR-SECRET-8b1e07"
ENV_HEADER_SECRET = "ENVHDR-SECRET-c3a5"
API_KEY = "sk-test-APIKEY-SECRET-77aa55bb33"
USER, PASSWORD = "judge-user-q7", "judge-pw-q7"
SECRETS = (QUERY_SECRET, HEADER_SECRET, ENV_HEADER_SECRET, API_KEY, USER, PASSWORD)
EMAIL, CARD = "alice.smith@example.com", "4111 1111 1111 1111"
PII = f"{EMAIL} card {CARD}"
PII_MARKS = ("alice", "smith", "example.com", "4111")
ENV = {"JUDGE_KEY_VAR": API_KEY, "TENANT_VAR": ENV_HEADER_SECRET}


def endpoint(stub: OpenAIStub) -> dict[str, Any]:
    return {"base_url": stub.base_url, "model": "judge-model", "api_key_env": "JUDGE_KEY_VAR",
            "headers": {"X-Plain": HEADER_SECRET}, "headers_from_env": {"X-Tenant": "TENANT_VAR"},
            "query_params": {"sig": QUERY_SECRET, "api-version": "2024-06-01"},
            "max_tokens_param": "max_completion_tokens"}


@pytest.fixture
def http_debug(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every HTTP library logger at DEBUG (whatever an earlier test set them to), captured."""
    levels = {name: logging.getLogger(name).level for name in HTTP_LOGGERS}
    caplog.set_level(logging.DEBUG)
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_a_judge_request_carries_its_secrets_but_no_library_logs_them(
        stub: OpenAIStub, http_debug: pytest.LogCaptureFixture) -> None:
    config = {"endpoints": {"default": endpoint(stub)}, "sample_rate": 1.0,
              "custom": {"asks": {"prompt": "Is this answered? {request}"}}, "builtin": {}}
    with JudgeRunner(config, env=ENV) as runner:
        [verdict] = runner.judge_sync(EvalRecord(trace_id=f"{1:032x}", request="Where is my refund?",
                                                 response="On its way."))
    assert verdict.error is None, verdict.error
    # The secrets were on the wire, so a library that logs the request could have shown them ...
    [req] = stub.chat_requests()
    assert f"sig={QUERY_SECRET}" in req.headers["x-query"]
    assert req.headers["x-plain"] == HEADER_SECRET and req.headers["x-tenant"] == ENV_HEADER_SECRET
    assert req.headers["authorization"] == f"Bearer {API_KEY}"
    # ... and httpx and httpcore did log it, at INFO and DEBUG ...
    names = {r.name for r in http_debug.records}
    assert "httpx" in names and any(n.startswith("httpcore") for n in names), names
    request_lines = [r.getMessage() for r in http_debug.records if "HTTP Request" in r.getMessage()]
    assert request_lines and "sig=**********" in request_lines[0], request_lines
    # ... with none of the secrets, in any record.
    assert not [s for s in SECRETS if s in http_debug.text]


def test_a_url_with_credentials_is_logged_without_them(stub: OpenAIStub,
                                                       http_debug: pytest.LogCaptureFixture) -> None:
    """Whoever hands httpx a URL with credentials and a secret query (the filter guards the library,
    not only tracejudge's own clients)."""
    host = stub.base_url.split("://", 1)[1]
    with httpx.Client() as client:
        client.post(f"http://{USER}:{PASSWORD}@{host}/chat/completions?code={QUERY_SECRET}",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {API_KEY}"})
    [req] = stub.chat_requests()
    assert req.headers["x-query"] == f"code={QUERY_SECRET}"  # sent, then
    lines = [r.getMessage() for r in http_debug.records if r.name == "httpx"]
    assert any("HTTP Request: POST http://**********@" in line for line in lines), lines
    assert not [s for s in SECRETS if s in http_debug.text]


def test_kafka_wire_dumps_are_logged_without_their_bytes(http_debug: pytest.LogCaptureFixture) -> None:
    """kafka-python's DEBUG lines print requests as bytes: a SASL PLAIN handshake holds the password."""
    handshake = b"\x00svc\x00" + PASSWORD.encode()
    for name in ("kafka", "kafka.protocol.parser", "kafka.net.connection"):  # whatever others set them to
        http_debug.set_level(logging.DEBUG, logger=name)
    logging.getLogger("kafka.protocol.parser").debug("node=1 Send: %r", bytearray(handshake))
    logging.getLogger("kafka.net.connection").debug("Request 7: SaslAuthenticateRequest(auth_bytes=%r)",
                                                    handshake)
    messages = [r.getMessage() for r in http_debug.records if r.name.startswith("kafka")]
    assert messages == ["node=1 Send: <bytes>", "Request 7: SaslAuthenticateRequest(auth_bytes=<bytes>)"]
    assert PASSWORD not in http_debug.text


# -- tracejudge run, end to end -------------------------------------------------------------------

GOOD = {"request": "What is the refund window?", "response": "Refunds within 30 days.", "request_id": "ok-1"}
# Each holds an e-mail address and a card number in a field of the wrong type; the field to blame and
# the type the message must name.
BAD: list[tuple[bytes, str, str]] = [
    (orjson.dumps({"request": "q", "response": "r", "retrieved_context": PII}),
     "retrieved_context: expected a list", f"a string of {len(PII)} characters"),
    (orjson.dumps({"request": "q", "response": "r", "session_id": [EMAIL, CARD]}),
     "session_id: expected a string", "a list of 2 items"),
    (orjson.dumps({"request": "q", "response": "r", "guidelines": 4111111111111111}),
     "guidelines: expected a list of strings or an object of lists", "an integer of 16 digits"),
    (orjson.dumps({"info": {"trace_id": "tr-1", "request_time": PII, "state": "OK"},
                   "data": {"spans": []}}),
     "info.request_time: expected an RFC 3339 time or epoch milliseconds",
     f"a string of {len(PII)} characters"),
    (orjson.dumps({"databricks_request_id": {"owner": EMAIL, "card": CARD}, "request": "{}",
                   "response": "{}", "status_code": 200}),
     "databricks_request_id: expected a string", "an object of 2 keys"),
]


def test_tracejudge_run_logs_and_dead_letters_name_fields_and_types_never_secrets_or_values(
        broker: Any, stub: OpenAIStub, tmp_path: Path) -> None:
    bs = broker.bootstrap_servers
    topic, results, dlq = unique("secrets"), unique("results"), unique("dlq")
    config = tmp_path / "tracejudge.yaml"
    config.write_text(yaml.safe_dump({
        "stream": {"topics": [topic], "results_topic": results, "dead_letter_topic": dlq},
        "judges": {"endpoints": {"default": endpoint(stub)}, "sample_rate": 1.0, "builtin": {},
                   "custom": {"asks": {"prompt": "Is this answered? {request}"}}},
    }))
    produce(bs, topic, [v for v, _, _ in BAD] + [orjson.dumps(GOOD)],
            keys=[f"bad-{i}".encode() for i in range(len(BAD))] + [b"good"])
    runner = RunnerProcess(bs, "--config", str(config), "--group-id", unique("group"),
                           env={**ENV, "TRACEJUDGE_LOGGING__LEVEL": "DEBUG"})
    try:
        runner.wait_ready()
        letters = read_topic(bs, dlq, at_least=len(BAD), timeout=60)
        [result] = read_topic(bs, results, at_least=1, timeout=60)
        wait_until(lambda: "HTTP Request: POST" in runner.log, 30, message="httpx logged the judge call")
        runner.signal(signal.SIGTERM)
        assert runner.finish() == 0
    finally:
        runner.kill()
    assert orjson.loads(result.value)["assessments"][0]["value"] is not None  # the judge was asked
    log = runner.log
    # The start-up listing shows the endpoint without its secrets, and non-secrets as they are.
    assert "judges.endpoints.default.query_params.sig = **********" in log
    assert "judges.endpoints.default.max_tokens_param = max_completion_tokens" in log
    assert "sig=**********" in log  # httpx's request line, the query value masked
    assert not [s for s in SECRETS if s in log]
    # Each bad record: one dead letter whose error names the field and the value's type, quoting none of it.
    assert len(letters) == len(BAD)
    for letter in letters:
        index = int(letter.key.decode().split("-")[1])
        value, field, kind = BAD[index]
        headers = dict(letter.headers)
        error = headers[sinks.HEADER_ERROR].decode()
        assert error.startswith(field) and kind in error, error
        assert letter.value == value  # the record itself is kept whole (nothing is lost)
        for name, header in headers.items():
            assert not [m for m in PII_MARKS if m in header.decode(errors="replace").lower()], (name, header)
        assert f"dead letter {topic}" in log and field in log
    # No line quotes the records: not tracejudge's (the dead-letter warnings among them), and not
    # kafka-python's DEBUG dumps of the bytes it produced (the dead letters) and fetched.
    assert "kafka.protocol.parser" in log and "<bytes>" in log
    assert not [line for line in log.splitlines() if any(m in line.lower() for m in PII_MARKS)]
