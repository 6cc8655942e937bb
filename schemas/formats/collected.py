"""A collected trace as a row of the agent-evaluation schema (`agent_eval.py` reads it back).

`tracejudge run` and `tracejudge eval` route the traces a `collections:` rule matches into a topic or
a JSON Lines file as these rows; `tracejudge dataset merge-labels` fills their expectations from
people's labels, so a collection grows into a regression set `tracejudge eval` runs as it stands.

    {"trace_id": "…", "request_id": "…", "request": "…", "response": "…",
     "retrieved_context": [{"content": "…", "doc_uri": "…"}],
     "trajectory": [{"tool_name": "…", "tool_input": {…}}],      (+ "error": "…" on a failed call)
     "expected_response": null, "expected_facts": null, "expected_retrieved_context": null,
     "assessments": [{"name": "groundedness", "status": "failed", "value": "no", "score": 0.0,
                      "passed": false, "rationale": "…"}],
     "collection": "ungrounded", "app": "…", "version": "…", "session_id": "…", "user_id": "…"}

The expectations are null unless the trace stated them (an eval input that had them). Guidelines and
a reference trajectory the record carries are kept too: they are expectations as well. Keys stay in
this order, and a row is written as one line (orjson), so the rows of one trace are byte-identical
whichever process collected them.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from tracejudge.schemas.record import EvalRecord, ToolCall
from tracejudge.schemas.result import Assessment, EvaluationResult, assessment_status
from tracejudge.schemas.trace import Document

__all__ = ["EXPECTATION_FIELDS", "collected_row", "row_bytes", "row_key"]

# The expectations a label can fill (`tracejudge dataset merge-labels`).
EXPECTATION_FIELDS = ("expected_response", "expected_facts", "expected_retrieved_context")


def row_key(record: EvalRecord) -> str | None:
    """What identifies a collected trace (its row's Kafka key, what collections deduplicate on): the
    trace id, else the request id; None when the record has neither."""
    return record.trace_id or record.request_id


def collected_row(result: EvaluationResult, collection: str) -> dict[str, Any]:
    """The agent-evaluation row of one evaluated trace, for `collection`."""
    r = result.record
    row: dict[str, Any] = {
        "trace_id": r.trace_id,
        "request_id": r.request_id,
        "request": r.request,
        "response": r.response,
        "retrieved_context": _documents(r.retrieved_context),
        "trajectory": _calls(r.trajectory),
        "expected_response": r.expected_response,
        "expected_facts": list(r.expected_facts) if r.expected_facts is not None else None,
        "expected_retrieved_context": _documents(r.expected_retrieved_context),
        "assessments": [_assessment(a) for a in result.assessments],
        "collection": collection,
        "app": r.app,
        "version": r.version,
        "session_id": r.session_id,
        "user_id": r.user_id,
    }
    if r.guidelines:
        row["guidelines"] = list(r.guidelines)
    if r.reference_trajectory:
        row["reference_trajectory"] = _calls(r.reference_trajectory)
    return row


def row_bytes(row: dict[str, Any]) -> bytes:
    """One row as a JSON line, without the newline."""
    return orjson.dumps(row, default=_plain)


def _documents(docs: list[Document] | None) -> list[dict[str, Any]] | None:
    if docs is None:
        return None
    return [{"content": d.content, "doc_uri": d.doc_uri} for d in docs]


def _calls(calls: list[ToolCall] | None) -> list[dict[str, Any]] | None:
    if calls is None:
        return None
    # A call's `error` only when it failed: a row without failures reads as before schema 6.
    return [{"tool_name": c.tool_name, "tool_input": c.tool_input, **({"error": c.error} if c.error else {})}
            for c in calls]


def _assessment(a: Assessment) -> dict[str, Any]:
    """A verdict with its rationale: what a person labelling the row reads first."""
    out: dict[str, Any] = {"name": a.name, "status": assessment_status(a), "value": a.value, "score": a.score,
                           "passed": a.passed, "rationale": a.rationale}
    if a.error is not None:
        out["error"] = a.error
    if a.skipped is not None:
        out["skipped"] = a.skipped
    if a.shadow_of is not None:
        out["shadow_of"] = a.shadow_of
    return out


def _plain(value: Any) -> Any:
    """What orjson cannot write by itself (a msgspec struct inside a tool input): plain values."""
    return msgspec.to_builtins(value, enc_hook=str)
