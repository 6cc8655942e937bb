"""The line format of the results topic, read back: one record -> the result dict, or `BadResult`.

`tracejudge run` publishes each `EvaluationResult` (`schemas/result.py`) and the sessions stage each
`SessionResult` (`schemas/session.py`) as one JSON line; the stages that read the topic back (the
write-back stage `consumer/stages/sink.py`, the sessions stage `consumer/stages/sessions.py`, the
agreement stage `consumer/stages/agreement.py`) decode a line here, so they agree on what a result is
and name a bad one by the same reason (the `reason` label of their dead-letter counters).
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from tracejudge.schemas import result as result_schema
from tracejudge.schemas.session import SESSION_KIND, SessionResult

__all__ = ["INVALID_JSON", "KNOWN_SCHEMA_VERSION", "NOT_A_RESULT", "RESULT_FORMAT", "UNKNOWN_SCHEMA_VERSION",
           "BadResult", "decode_line", "decode_result"]

# Why a results-topic record is not read (the `reason` label of the stages' dead-letter counters).
INVALID_JSON = "invalid_json"
NOT_A_RESULT = "not_a_result"
UNKNOWN_SCHEMA_VERSION = "unknown_schema_version"

# The result schema this code reads (`schemas/result.py`); a line without `schema_version` is version 1.
KNOWN_SCHEMA_VERSION: int = getattr(result_schema, "SCHEMA_VERSION", 1)
# The format dead letters carry in their `tracejudge-format` header.
RESULT_FORMAT = "tracejudge_result"


class BadResult(ValueError):
    """A results-topic record that is not a tracejudge result this code can read."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def decode_result(value: bytes | None) -> dict[str, Any]:
    """One results-topic record as the result dict (`EvaluationResult.to_dict()`'s shape, or
    `SessionResult.to_dict()`'s for a `"kind": "session"` line), or `BadResult` saying why it is not
    one: not JSON, not an object with the result's keys (`trace_id`, `request_id`, an `assessments`
    list of objects with a `name`; a session result's fields, `schemas.session`), a field of the wrong
    type, an unknown `kind`, or a `schema_version` newer than `KNOWN_SCHEMA_VERSION`."""
    return decode_line(value)[0]


def decode_line(value: bytes | None) -> tuple[dict[str, Any], SessionResult | None]:
    """`decode_result`, plus the `SessionResult` of a session line (None for a trace result)."""
    if value is None:
        raise BadResult(NOT_A_RESULT, "the record has no value (a tombstone)")
    try:
        line = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise BadResult(INVALID_JSON, f"not JSON: {exc}") from None
    if not isinstance(line, dict):
        raise BadResult(NOT_A_RESULT, f"a JSON {type(line).__name__}, not an object")
    version = line.get("schema_version", 1)
    if type(version) is not int or version < 1:
        raise BadResult(NOT_A_RESULT, f"schema_version must be a positive integer, got {version!r}")
    if version > KNOWN_SCHEMA_VERSION:
        raise BadResult(UNKNOWN_SCHEMA_VERSION, f"schema_version {version} is newer than this tracejudge "
                        f"reads ({KNOWN_SCHEMA_VERSION}); upgrade the sink")
    kind = line.get("kind")
    if kind == SESSION_KIND:
        return line, _session(line)
    if kind is not None:
        raise BadResult(NOT_A_RESULT, f"unknown result kind {kind!r:.80} (known: a trace result, without "
                        f"kind, and {SESSION_KIND!r})")
    missing = [k for k in ("trace_id", "request_id", "assessments") if k not in line]
    if missing:
        raise BadResult(NOT_A_RESULT, f"not a tracejudge result: no {', '.join(missing)}")
    for key in ("trace_id", "request_id"):
        if line[key] is not None and not isinstance(line[key], str):
            raise BadResult(NOT_A_RESULT, f"{key} must be a string or null, got {line[key]!r:.80}")
    assessments = line["assessments"]
    if not isinstance(assessments, list):
        raise BadResult(NOT_A_RESULT, f"assessments must be a list, got {type(assessments).__name__}")
    for i, a in enumerate(assessments):
        if not isinstance(a, dict) or not isinstance(a.get("name"), str):
            raise BadResult(NOT_A_RESULT, f"assessments[{i}] must be an object with a string name")
    from_dict = getattr(result_schema.EvaluationResult, "from_dict", None)
    if from_dict is not None:  # every field's type, as the schema says
        try:
            from_dict(line)
        except (msgspec.ValidationError, ValueError, TypeError) as exc:
            raise BadResult(NOT_A_RESULT, f"not a tracejudge result: {exc}") from None
    return line, None


def _session(line: dict[str, Any]) -> SessionResult:
    """A session result line, every field typed as `SessionResult` says."""
    if not isinstance(line.get("session_id"), str) or not line["session_id"]:
        raise BadResult(NOT_A_RESULT, "not a tracejudge session result: no session_id")
    assessments = line.get("assessments", [])
    if not isinstance(assessments, list) or not all(
            isinstance(a, dict) and isinstance(a.get("name"), str) for a in assessments):
        raise BadResult(NOT_A_RESULT, "not a tracejudge session result: assessments must be a list of "
                                      "objects with a string name")
    try:
        return SessionResult.from_dict(line)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise BadResult(NOT_A_RESULT, f"not a tracejudge session result: {exc}") from None
