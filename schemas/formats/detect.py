"""Detect a record's format and normalise it into an `EvalRecord`: the one entry point every
single-record input takes (files, Kafka values, the Python API).

Detection rules, applied per record when the format is "auto" (first match wins):

1. an object with `info` (and `data`): an MLflow trace, `Trace.to_json()`; 2.x when `info` has
   `request_id` and no `trace_id`, else 3.x;
2. an object with a serving-log column (`databricks_request_id`, `served_entity_id`,
   `request_metadata`, `status_code`, `execution_duration_ms`, `execution_time_ms`,
   `logging_error_codes`, `sampling_fraction`): an inference-log row;
3. an object with `request`, `response`, `trace`, `inputs`, `outputs`, `expected_response` or
   `retrieved_context`: an agent-evaluation record;
4. anything else is rejected (`unknown_format`), naming the keys it had. OTLP export requests
   (`resourceSpans`) are spans, not records: they go through trace assembly
   (`--format otlp_json` / `otlp_proto`), never through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import orjson

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.agent_eval import is_agent_eval_record, normalise_agent_eval
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.inference_log import is_inference_log_row, normalise_row
from tracejudge.schemas.formats.mlflow import is_mlflow_trace, parse_trace
from tracejudge.schemas.formats.mlflow_wire import derive_canonical_json
from tracejudge.schemas.record import EvalRecord, python_json, with_valid_text

__all__ = ["BINARY_FORMATS", "FORMATS", "INPUT_FORMATS", "OTLP_JSON_FORMATS", "SPAN_FORMATS", "decode",
           "detect", "normalise"]

# Single-record formats this module normalises ("auto" detects one of the others per record).
FORMATS: Final = frozenset({"auto", "agent_eval", "mlflow", "inference_log"})
_PARSER_BUGS = (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, RecursionError)
# Span formats: records are spans of many traces, assembled elsewhere.
SPAN_FORMATS: Final = frozenset({"otlp_proto", "otlp_json"})
# What `--format` of `tracejudge eval`/`calibrate` names: every format a topic may have
# (`stream.topics[].format`). The JSON ones are read from JSON Lines files (OTLP/JSON lines through trace
# assembly); protobuf is binary, one message per Kafka record, and has no line form (`BINARY_FORMATS`).
INPUT_FORMATS: Final = ("auto", "agent_eval", "mlflow", "inference_log", "otlp_json", "otlp_logs_json",
                        "otlp_proto", "otlp_logs_proto")
BINARY_FORMATS: Final = frozenset({"otlp_proto", "otlp_logs_proto"})
OTLP_JSON_FORMATS: Final = frozenset({"otlp_json", "otlp_logs_json"})


def decode(payload: bytes | str | Mapping[str, Any]) -> Mapping[str, Any]:
    """JSON bytes/text -> an object; raises `RecordError` (invalid_json / not_utf8 / invalid_record)."""
    if isinstance(payload, Mapping):
        return payload
    if isinstance(payload, (bytes, bytearray, memoryview, str)):
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            obj = _decode_slow(payload, exc)
    else:
        raise RecordError(errors.INVALID_RECORD,
                          f"expected JSON bytes, text or a mapping, got {type(payload).__name__}")
    if not isinstance(obj, dict):
        raise RecordError(errors.INVALID_RECORD, f"a record must be a JSON object, got {_kind(obj)}")
    return obj


def _decode_slow(payload: bytes | bytearray | memoryview | str, exc: orjson.JSONDecodeError) -> Any:
    """Python's json module as a fallback: it reads the NaN/Infinity that Python producers write."""
    if isinstance(payload, str):
        text = payload
    else:
        try:
            text = bytes(payload).decode("utf-8")
        except UnicodeDecodeError as utf8:
            raise RecordError(errors.NOT_UTF8, f"not valid UTF-8 at byte {utf8.start}") from None
    try:
        return python_json(text)
    except (ValueError, RecursionError):
        pass
    raise RecordError(errors.INVALID_JSON, errors.not_json(exc)) from None


_KINDS = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def _kind(obj: Any) -> str:
    return _KINDS.get(type(obj), "a number")


def detect(obj: Mapping[str, Any]) -> str:
    """The format of one decoded record: "mlflow", "inference_log" or "agent_eval"."""
    if is_mlflow_trace(obj):
        return "mlflow"
    if is_inference_log_row(obj):
        return "inference_log"
    if is_agent_eval_record(obj):
        return "agent_eval"
    if "resourceSpans" in obj or "resource_spans" in obj:
        raise RecordError(errors.UNKNOWN_FORMAT, "an OTLP export request holds spans, not one record: "
                          "read it with --format otlp_json so spans are assembled into traces")
    keys = ", ".join(sorted(str(k) for k in obj)[:8]) or "none"
    raise RecordError(errors.UNKNOWN_FORMAT, "not an MLflow trace, inference-log row or agent-evaluation "
                      f"record (keys: {keys})")


def normalise(payload: bytes | str | Mapping[str, Any], fmt: str | None = None, *,
              app_tag: str | None = None, session_tag: str | None = None,
              version_tag: str | None = None) -> EvalRecord:
    """Decode one record and normalise it into an `EvalRecord`.

    `fmt` is None/"auto" (detect per record), "agent_eval", "mlflow" or "inference_log".
    `app_tag` names a tag/metadata key (or a top-level field) whose value is the record's app;
    `session_tag` likewise its session id and `version_tag` its version (the app's release), over what
    the format's conventions state.
    Every problem with the record raises `RecordError` naming the field; an unknown `fmt` is a
    programming error (`ValueError`).
    """
    record = _normalise(payload, fmt or "auto", app_tag, session_tag, version_tag)
    # Decoded JSON never holds a lone surrogate (see `python_json`); Python objects might.
    # (bytes first: the ABC check costs more than some of the parsing.)
    if type(payload) is bytes or not isinstance(payload, Mapping):
        return record
    return with_valid_text(record)


def _normalise(payload: bytes | str | Mapping[str, Any], fmt: str, app_tag: str | None,
               session_tag: str | None, version_tag: str | None = None) -> EvalRecord:
    if fmt not in FORMATS:
        if fmt in SPAN_FORMATS:
            raise RecordError(errors.UNKNOWN_FORMAT, f"{fmt} records are spans: they are assembled into "
                              "traces by the stream, not normalised one at a time")
        raise ValueError(f"unknown format {fmt!r}; expected one of {sorted(FORMATS | SPAN_FORMATS)}")
    if (fmt == "auto" or fmt == "mlflow") and isinstance(payload, (bytes, str)):
        # Most records of a trace stream are MLflow 3 traces as `Trace.to_json()` writes them; read
        # from the bytes, their large unread payloads are never decoded (~2x less decoding work).
        try:
            record = derive_canonical_json(payload, app_tag=app_tag, session_tag=session_tag,
                                           version_tag=version_tag)
        except _PARSER_BUGS as exc:
            raise _bug(exc) from exc
        if record is not None:
            return record
    obj = decode(payload)
    kind = detect(obj) if fmt == "auto" else fmt
    try:
        if kind == "mlflow":
            return derive(parse_trace(obj, app_tag=app_tag, everything=False, session_tag=session_tag,
                                      version_tag=version_tag))
        if kind == "inference_log":
            return normalise_row(obj, app_tag=app_tag, session_tag=session_tag, version_tag=version_tag)
        return normalise_agent_eval(obj, app_tag=app_tag, session_tag=session_tag, version_tag=version_tag)
    except RecordError:
        raise
    except _PARSER_BUGS as exc:
        raise _bug(exc) from exc


def _bug(exc: BaseException) -> RecordError:
    # A parser bug must not take the stream down: the record is dead-lettered with the cause.
    return RecordError(errors.INVALID_RECORD, f"could not normalise the record: "
                       f"{errors.exception_text(exc, 160)}")
