"""A rejected record is described, never quoted: the reject message names the field and the type (and
size) of its bad value, whatever the format, so an e-mail address or a card number in a wrongly typed
field reaches no message, log line or dead-letter header. (tests/test_secrets_logs.py checks the dead
letters of a running `tracejudge run`.)"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from tracejudge.schemas.errors import RecordError, describe_value, exception_text
from tracejudge.schemas.formats import otlp
from tracejudge.schemas.formats.detect import normalise

EMAIL, CARD = "alice.smith@example.com", "4111 1111 1111 1111"
PII = f"{EMAIL}, card {CARD}"
MARKS = ("alice", "smith", "example.com", "4111")
AGENT_EVAL = {"request": "Where is my refund?", "response": "On its way.", "request_id": "r-1"}
MLFLOW = {"info": {"trace_id": "tr-7f1", "request_time": "2026-01-01T00:00:00Z", "state": "OK",
                   "execution_duration_ms": 5},
          "data": {"spans": []}}
INFERENCE_LOG = {"databricks_request_id": "d-1", "status_code": 200, "request": '{"messages": []}',
                 "response": '{"choices": []}'}
# (record, the field made wrong, its value, the field as the message names it, the type it names)
CASES: list[tuple[dict[str, Any], tuple[Any, ...], Any, str, str]] = [
    (AGENT_EVAL, ("retrieved_context",), PII, "retrieved_context", f"a string of {len(PII)} characters"),
    (AGENT_EVAL, ("retrieved_context",), {"email": EMAIL, "card": CARD}, "retrieved_context",
     "an object of 2 keys"),
    (AGENT_EVAL, ("expected_facts",), PII, "expected_facts", f"a string of {len(PII)} characters"),
    (AGENT_EVAL, ("session_id",), [EMAIL, CARD], "session_id", "a list of 2 items"),
    (AGENT_EVAL, ("guidelines",), 4111111111111111, "guidelines", "an integer of 16 digits"),
    (MLFLOW, ("info", "request_time"), PII, "info.request_time", f"a string of {len(PII)} characters"),
    (MLFLOW, ("info", "request_time"), [EMAIL], "info.request_time", "a list of 1 item"),
    (MLFLOW, ("info", "trace_id"), {"email": EMAIL}, "info.trace_id", "an object of 1 key"),
    (MLFLOW, ("info", "execution_duration_ms"), CARD, "info.execution_duration_ms",
     f"a string of {len(CARD)} characters"),
    (INFERENCE_LOG, ("databricks_request_id",), {"email": EMAIL, "card": CARD}, "databricks_request_id",
     "an object of 2 keys"),
    (INFERENCE_LOG, ("status_code",), PII, "status_code", f"a string of {len(PII)} characters"),
    (INFERENCE_LOG, ("request_time",), EMAIL, "request_time", f"a string of {len(EMAIL)} characters"),
]


def with_value(record: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(record)
    node = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


def quoted(text: str) -> list[str]:
    return [m for m in MARKS if m in text.lower()]


@pytest.mark.parametrize(("record", "path", "value", "field", "kind"), CASES,
                         ids=[f"{c[3]}-{type(c[2]).__name__}" for c in CASES])
def test_a_wrongly_typed_field_is_named_with_its_type_never_its_value(
        record: dict[str, Any], path: tuple[Any, ...], value: Any, field: str, kind: str) -> None:
    bad = with_value(record, path, value)
    for payload in (bad, orjson.dumps(bad)):  # a decoded object and the bytes off Kafka
        with pytest.raises(RecordError) as exc:
            normalise(payload)
        message = exc.value.message
        assert message.startswith(f"{field}: "), message
        assert kind in message, message
        assert not quoted(message), message


@pytest.mark.parametrize(("where", "value", "kind"), [
    (("traceId",), PII, f"a string of {len(PII)} characters"),
    (("spanId",), EMAIL, f"a string of {len(EMAIL)} characters"),
    (("startTimeUnixNano",), {"email": EMAIL}, "an object of 1 key"),
    (("status", "code"), 4111111111111111, "an integer of 16 digits"),
    (("parentSpanId",), [CARD], "got list"),
    (("endTimeUnixNano",), EMAIL, f"a string of {len(EMAIL)} characters"),
])
def test_otlp_json_fields_are_described_not_quoted(where: tuple[Any, ...], value: Any, kind: str) -> None:
    span: dict[str, Any] = {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174",
                            "name": "root", "startTimeUnixNano": "1", "endTimeUnixNano": "2",
                            "status": {"code": 1}}
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [with_value(span, where, value)]}]}]}
    with pytest.raises(RecordError) as exc:
        otlp.decode_json(orjson.dumps(doc))
    assert (exc.value.field or "").startswith("resourceSpans[0].scopeSpans[0].spans[0].")
    assert kind in exc.value.detail and not quoted(exc.value.message), exc.value.message


def test_values_are_described_by_type_and_size() -> None:
    assert [describe_value(v) for v in (None, True, 1.5, -1, 7, "", "noon", [], {}, b"\x00\x01")] == [
        "null", "true", "1.5", "-1", "7", "an empty string", "a string of 4 characters", "an empty list",
        "an empty object", "2 bytes of binary data"]
    # Long numbers may be card, account or phone numbers: their digits are counted, not shown.
    assert describe_value(4111111111111111) == "an integer of 16 digits"
    assert describe_value(4155552671.0) == "a number of 11 digits"
    assert describe_value(float("nan")) == "NaN (a non-finite number)"


def test_a_librarys_own_message_has_its_quoted_input_described() -> None:
    for exc in (ValueError(f"invalid literal for int() with base 10: '{EMAIL}'"), KeyError(CARD),
                ValueError(f'Invalid isoformat string: "{PII}"')):
        text = exception_text(exc)
        assert text.startswith(type(exc).__name__) and "<a string of" in text and not quoted(text), text


def test_tracejudge_eval_reports_rejected_lines_without_their_content(tmp_path: Path) -> None:
    lines = [orjson.dumps(with_value(AGENT_EVAL, ("retrieved_context",), {"doc": PII})),
             orjson.dumps(with_value(MLFLOW, ("info", "request_time"), PII)),
             orjson.dumps(AGENT_EVAL)]
    data = tmp_path / "records.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    proc = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "eval", str(data), "-o",
                           str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=120,
                          check=False)
    assert "records.jsonl:1: rejected (invalid_record): retrieved_context: expected a list, got an object " \
           "of 1 key" in proc.stderr, proc.stderr
    assert "records.jsonl:2: rejected (invalid_record): info.request_time: expected an RFC 3339 time or " \
           f"epoch milliseconds, got a string of {len(PII)} characters" in proc.stderr, proc.stderr
    assert not quoted(proc.stderr + proc.stdout), proc.stderr
