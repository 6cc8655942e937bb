"""The canonical evaluation record: what every input format is normalised into.

One `EvalRecord` per evaluated request. Metrics and judges read only this, so offline files, the
Kafka stream and the Python API score the same thing the same way. Fields that the input neither
states nor lets us derive are None, never guessed.

msgspec structs, not pydantic models or dataclasses: records are built per trace on the hot path, a
struct's `__init__` runs in C, and msgspec writes them as JSON natively (`EvaluationResult.to_json`);
`msgspec.to_builtins(record)` gives plain dicts. Input validation (with field-naming errors) happens
in the parsers, against the pydantic input schemas in `tracejudge.schemas.formats.inputs`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from tracejudge.schemas.trace import Document, TokenUsage

__all__ = ["ANOMALIES", "END_BEFORE_START", "NEGATIVE_DURATION", "NEGATIVE_TOKENS", "NON_FINITE",
           "PARENT_CYCLE", "TOOL_ERROR_MAX_CHARS", "Cost", "Document", "EvalRecord", "HumanLabel",
           "TokenUsage", "ToolCall",
           "add_warning", "python_json", "with_valid_text"]

# Why a record's value was set aside as impossible (`EvalRecord.warnings`, the `reason` label of
# `tracejudge_record_anomalies_total`): time only moves forward, and a count is never below zero. The
# value is then None, as if the source had not stated it, so no percentile or histogram sees it.
# A closed set: never put free text in a warning.
NEGATIVE_DURATION = "negative_duration"  # a stated duration below zero
END_BEFORE_START = "end_before_start"  # the root span ends before it starts
NON_FINITE = "non_finite"  # a duration that is NaN or infinite (Python producers write both)
NEGATIVE_TOKENS = "negative_tokens"  # a token count below zero
PARENT_CYCLE = "parent_cycle"  # the spans' parents loop (a -> b -> a): the trace has no root
ANOMALIES = (NEGATIVE_DURATION, END_BEFORE_START, NON_FINITE, NEGATIVE_TOKENS, PARENT_CYCLE)


# A tool call's error text longer than this is cut (a stack trace must not bloat every result line).
TOOL_ERROR_MAX_CHARS = 300


class ToolCall(msgspec.Struct, gc=False):
    """One step of a trajectory. Two calls are equal when name, input and error are equal (the
    trajectory metrics and judges compare name and input only).

    `error` (schema 6): why the call failed, as the trace states it (the tool span's exception event,
    else its ERROR status message; an agent-eval row's `error`), cut to `TOOL_ERROR_MAX_CHARS`; None
    when the call succeeded or the source does not say (a stated trajectory, a model's requested
    call). A line of schema 5 or older has no `error`: it reads as None."""

    tool_name: str
    tool_input: Any = None
    error: str | None = None


class HumanLabel(msgspec.Struct, gc=False):
    """A person's verdict for one judge on this record (MLflow `HUMAN` feedback of the judge's name, a
    labels file or topic): `value` is "pass"/"fail", a bool, or a number (a score). Schema 4."""

    name: str
    value: Any
    source: str | None = None
    source_id: str | None = None


class Cost(msgspec.Struct, gc=False):
    """What a trace cost the agent, in `currency` (USD): `source` says where it came from: "stated"
    (the trace says so), "priced" (tokens x the model's price), "unknown". Schema 4."""

    input: float | None = None
    output: float | None = None
    total: float | None = None
    currency: str = "USD"
    source: str = "unknown"


class EvalRecord(msgspec.Struct):
    request_id: str | None = None
    trace_id: str | None = None
    # Bounded later (Prometheus label cap); here it is what the source said.
    app: str | None = None
    # Which parser produced this record: "agent_eval", "mlflow_v3", "mlflow_v2", "inference_log",
    # "otlp_proto", "otlp_json".
    source_format: str = "unknown"
    request: str | None = None
    response: str | None = None
    retrieved_context: list[Document] | None = None
    trajectory: list[ToolCall] | None = None
    latency_seconds: float | None = None
    failed: bool | None = None
    error: str | None = None
    tokens: TokenUsage | None = None
    expected_response: str | None = None
    expected_retrieved_context: list[Document] | None = None
    expected_facts: list[str] | None = None
    guidelines: list[str] | None = None
    reference_trajectory: list[ToolCall] | None = None
    # Request start, seconds since the epoch, when the source states it.
    timestamp: float | None = None
    # Trace tags / attributes usable in sampling filters (string values only).
    tags: dict[str, str] = msgspec.field(default_factory=dict)
    # False when the trace was emitted by assembly before it was known to be whole.
    complete: bool = True
    # The hex id of the trace's root span (what a trace-level verdict is attached to when it is
    # written back as an OpenTelemetry event or span); None without a trace or a root. Schema 2.
    root_span_id: str | None = None
    # The conversation this request belongs to and who made it, as the source states them (MLflow
    # `mlflow.trace.session`/`mlflow.trace.user`, OTel `session.id`/`user.id`,
    # `gen_ai.conversation.id`, Traceloop association properties, a `session_id`/`user_id` column, or
    # the tag `stream.session_tag` names); None when absent, never guessed. Schema 3.
    session_id: str | None = None
    user_id: str | None = None
    # People's verdicts on this record, per judge name (MLflow HUMAN feedback on the trace). Schema 4.
    human_labels: list[HumanLabel] | None = None
    # Token usage per model ("gpt-4o-mini" -> usage) when the trace names the models of its calls, and
    # the trace's cost. Schema 4.
    model_usage: dict[str, TokenUsage] | None = None
    cost: Cost | None = None
    # What the source stated that was set aside as impossible, one of `ANOMALIES` each (the value is
    # None above): a negative or non-finite duration, a root span ending before it starts, a negative
    # token count, spans whose parents loop. None when there was nothing to set aside.
    warnings: list[str] | None = None
    # The app's version (release) as the trace states it: OTel `service.version`, `gen_ai.agent.version`,
    # MLflow's version tags, an inference-log or agent-eval `version` column, or the tag
    # `stream.version_tag` names; None when absent, never guessed. Schema 6.
    version: str | None = None
    # The largest tool result of the trace, in characters of its text as stated (`Span.output_chars`);
    # None when no tool span states one. What `signal_tool_result_oversized` compares. Schema 6.
    max_tool_result_chars: int | None = None


def add_warning(record: EvalRecord, reason: str) -> None:
    """Name `reason` (one of `ANOMALIES`) on the record, once."""
    if record.warnings is None:
        record.warnings = [reason]
    elif reason not in record.warnings:
        record.warnings.append(reason)


_CHECK = msgspec.json.Encoder(enc_hook=str)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def python_json(text: str) -> Any:
    """Python's `json.loads`, for what orjson and msgspec reject: the NaN and Infinity that Python
    producers write, and half a UTF-16 surrogate pair ("\\ud800" alone). Python decodes the latter
    into a str that no UTF-8 writer accepts; left in a record it would fail the result line, a
    Prometheus label and the trip to a decode worker long after the record was accepted, so each
    one becomes U+FFFD here. (Only this fallback lets them in: orjson and msgspec refuse them.)"""
    return _replace_lone_surrogates(json.loads(text))


def with_valid_text(record: EvalRecord) -> EvalRecord:
    """`record`, or a copy with every lone surrogate replaced by U+FFFD: for records built from
    Python objects, which may hold anything."""
    try:
        _CHECK.encode(record)
    except UnicodeEncodeError:
        plain = msgspec.to_builtins(record, enc_hook=str)
        return msgspec.convert(_replace_lone_surrogates(plain), EvalRecord)
    return record


def _replace_lone_surrogates(obj: Any) -> Any:
    if isinstance(obj, str):
        return obj if obj.isascii() else _LONE_SURROGATE.sub("\ufffd", obj)
    if isinstance(obj, dict):
        return {_replace_lone_surrogates(k): _replace_lone_surrogates(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_replace_lone_surrogates(v) for v in obj]
    return obj
