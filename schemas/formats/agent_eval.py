"""Agent-evaluation records -> `EvalRecord`.

The Databricks Agent Evaluation / `mlflow.evaluate` row: `request`, `response`,
`retrieved_context`, `expected_response`, `expected_retrieved_context`, `expected_facts`,
`guidelines`, `reference_trajectory`, `session_id`, `user_id` and optionally the MLflow `trace` of
the request; a collected row (`collected.py`) also states its `trace_id` and `trajectory`.
MLflow 3's `mlflow.genai.evaluate` rows (`inputs`, `outputs`, `expectations`) are read the same way.
What the record states wins over what is derived from its trace. A record must state its request
(or `inputs`) or carry a trace; one with neither is rejected, naming `request`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.derive import apply_expectations, derive, documents_from_output, merge
from tracejudge.schemas.formats.derive_text import request_text, response_text
from tracejudge.schemas.formats.inputs import AgentEvalRecord, ValidationError, describe
from tracejudge.schemas.formats.mlflow import parse_trace, tagged_identity
from tracejudge.schemas.formats.mlflow_wire import parse_trace_json
from tracejudge.schemas.formats.session_identity import identity
from tracejudge.schemas.record import EvalRecord, ToolCall

__all__ = ["is_agent_eval_record", "normalise_agent_eval"]

_KEYS = ("request", "response", "trace", "inputs", "outputs", "expected_response", "retrieved_context")


def is_agent_eval_record(obj: Mapping[str, Any]) -> bool:
    return any(key in obj for key in _KEYS)


def normalise_agent_eval(obj: Mapping[str, Any], *, app_tag: str | None = None,
                         session_tag: str | None = None, version_tag: str | None = None) -> EvalRecord:
    """One agent-evaluation record -> `EvalRecord`; raises `RecordError` naming the bad field.

    Session and user: the row's `session_id`/`user_id`, else its trace's. `session_tag` names a
    field of the row, a key of its `tags` or a tag/metadata key of its trace whose value is the
    session id over those. Version likewise: the `version_tag` field or `tags` key, the `version`
    column, the trace's version (`release_version`)."""
    try:
        row = AgentEvalRecord.model_validate(obj)
    except ValidationError as exc:
        path, detail = describe(exc)
        raise RecordError(errors.INVALID_RECORD, detail, path or None) from None
    if row.request is None and row.inputs is None and row.trace is None:
        # Nothing says what was asked: no judge or request metric could use the record.
        got = ("required field is missing" if "request" not in obj
               else "expected a string or an object, got null")
        raise RecordError(errors.INVALID_RECORD, f"{got} (a record without a trace must state its request, "
                          "or mlflow.genai.evaluate's inputs)", "request")

    tags = {k: v for k, v in (row.tags or {}).items() if isinstance(v, str)}
    stated = EvalRecord(request_id=row.request_id, trace_id=row.trace_id or None, source_format="agent_eval",
                        tags=tags)
    if app_tag:
        app = obj.get(app_tag)
        stated.app = app if isinstance(app, str) and app else tags.get(app_tag)
    if row.expectations:
        apply_expectations(stated, row.expectations)
    stated.session_id = identity(row.session_id)
    stated.user_id = identity(row.user_id)
    tagged = None
    if session_tag:
        tagged = identity(obj.get(session_tag))
        if tagged is None and row.tags:
            tagged = identity(row.tags.get(session_tag))
    if tagged is not None:
        stated.session_id = tagged
    tagged_version = None
    if version_tag:
        tagged_version = identity(obj.get(version_tag)) or identity((row.tags or {}).get(version_tag))
    stated.version = tagged_version or identity(row.version)

    request = obj.get("request")
    stated.request = request_text(request if request is not None else row.inputs)
    response = obj.get("response")
    stated.response = response_text(response if response is not None else row.outputs)
    if row.retrieved_context is not None:
        stated.retrieved_context = documents_from_output(obj["retrieved_context"])
    if row.expected_retrieved_context is not None:
        stated.expected_retrieved_context = documents_from_output(obj["expected_retrieved_context"])
    if row.expected_response is not None:
        stated.expected_response = row.expected_response
    if row.expected_facts is not None:
        stated.expected_facts = list(row.expected_facts)
    if row.guidelines is not None:
        guidelines = row.guidelines
        stated.guidelines = (list(guidelines) if isinstance(guidelines, list)
                             else [g for group in guidelines.values() for g in group])
    if row.trajectory is not None:
        # A collected row's tool calls (`collected.py`): what the app did, for the trajectory metrics.
        stated.trajectory = [ToolCall(step.tool_name, step.tool_input, step.error_text())
                             for step in row.trajectory]
    if row.reference_trajectory is not None:
        stated.reference_trajectory = [ToolCall(step.tool_name, step.tool_input or None)
                                       for step in row.reference_trajectory]
    if row.expected_tool_calls is not None:
        # Arguments kept as given: {} (expected without arguments) differs from None (not checked).
        stated.reference_trajectory = [ToolCall(c.name, c.arguments) for c in row.expected_tool_calls]

    trace_obj = row.trace
    if trace_obj is None:
        return stated
    if isinstance(trace_obj, str):
        trace = parse_trace_json(trace_obj, app_tag=app_tag, field="trace", session_tag=session_tag,
                                 version_tag=version_tag)
    else:
        trace = parse_trace(trace_obj, app_tag=app_tag, field="trace", everything=False,
                            session_tag=session_tag, version_tag=version_tag)
    record = merge(stated, derive(trace))
    if session_tag and tagged is None:
        # The tag the configuration names wins over the row's own column, wherever it is stated.
        record.session_id = tagged_identity(trace, session_tag) or record.session_id
    if version_tag and tagged_version is None:
        # As the session: the named tag, on the trace, wins over the row's `version` column.
        record.version = tagged_identity(trace, version_tag) or record.version
    return record
