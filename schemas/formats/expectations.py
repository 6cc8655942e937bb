"""People's expectations for collected traces: what `tracejudge dataset merge-labels` puts into a
collected row's `expected_response`, `expected_facts` and `expected_retrieved_context`.

A label line (a JSON Lines file, or one record of the labels topic) names its trace and gives one or
more expectations, in any of three shapes:

    {"trace_id": "…", "expected_response": "…", "expected_facts": ["…"]}      the row's own columns
    {"trace_id": "…", "expectations": {"expected_response": "…"}}              mlflow.genai.evaluate's
    {"trace_id": "…", "name": "expected_response", "value": "…"}               an assessment, flattened

(`request_id` instead of `trace_id` also names a row.) On an MLflow trace, an expectation assessment of
one of those names, or HUMAN feedback of one of those names (a person's correction), is one too
(`from_mlflow_assessments`). Values are read with the agent-evaluation reader's own rules
(`derive.apply_expectations`), so a merged row reads back exactly as it was merged. A verdict label
(`judge` + `label`, `labels.py`) says pass or fail, not what the answer should be: it is counted as
such and skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from tracejudge.schemas.formats.collected import EXPECTATION_FIELDS
from tracejudge.schemas.formats.derive import apply_expectations
from tracejudge.schemas.formats.labels import normalise_id
from tracejudge.schemas.record import EvalRecord

__all__ = ["Expectation", "LabelLineError", "from_label_line", "from_label_object", "from_mlflow_assessments",
           "normalised_value"]


@dataclass(frozen=True, slots=True)
class Expectation:
    """One person's expectation for one field of one row: `ident` is the normalised trace (or
    request) id, `value` the field's JSON value as a row holds it, `where` names its source."""

    ident: str
    field: str
    value: Any
    where: str


class LabelLineError(ValueError):
    """A label line that is not an expectation; `kind` is `verdict_label` (a pass/fail label, valid but
    not an expectation) or `malformed`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def normalised_value(field: str, value: Any) -> Any:
    """`value` for `field` as a collected row holds it (JSON), by the agent-evaluation reader's rules;
    None when it states nothing (an empty answer, no facts, no document)."""
    scratch = EvalRecord()
    apply_expectations(scratch, {field: value})
    got = getattr(scratch, field)
    if field == "expected_retrieved_context":
        return [{"content": d.content, "doc_uri": d.doc_uri} for d in got] if got else None
    if field == "expected_facts":
        return list(got) if got else None
    return got if isinstance(got, str) and got.strip() else None


def from_label_object(obj: Any, where: str) -> list[Expectation]:
    """The expectations of one decoded label line; `LabelLineError` when it holds none."""
    if not isinstance(obj, dict):
        raise LabelLineError("malformed", "expected an object")
    ident = obj.get("trace_id") or obj.get("request_id")
    if not isinstance(ident, str) or not ident:
        raise LabelLineError("malformed", 'expected "trace_id" or "request_id" naming the collected row')
    stated: dict[str, Any] = {}
    nested = obj.get("expectations")
    if isinstance(nested, Mapping):
        stated.update((k, v) for k, v in nested.items() if k in EXPECTATION_FIELDS)
    name = obj.get("name") or obj.get("assessment_name")
    if name in EXPECTATION_FIELDS and "value" in obj:
        stated[name] = obj["value"]
    stated.update((k, obj[k]) for k in EXPECTATION_FIELDS if k in obj)
    if not stated:
        if "judge" in obj and "label" in obj:
            raise LabelLineError("verdict_label", "a pass/fail label, not an expectation")
        raise LabelLineError("malformed", f"no expectation: expected one of {', '.join(EXPECTATION_FIELDS)} "
                                          "(as keys, under \"expectations\", or as \"name\" and \"value\")")
    out = []
    for field, value in stated.items():
        normal = normalised_value(field, value)
        if normal is None:
            raise LabelLineError("malformed", f"{field}: states nothing (empty, or not text)")
        out.append(Expectation(normalise_id(ident), field, normal, where))
    return out


def from_label_line(line: bytes, where: str) -> list[Expectation]:
    """`from_label_object` of one JSON line."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise LabelLineError("malformed", f"not JSON: {exc}") from None
    return from_label_object(obj, where)


def from_mlflow_assessments(trace_id: str, assessments: Any, where: str) -> Iterator[Expectation]:
    """The expectations among an MLflow trace's assessments (REST `trace_info.assessments` or
    `Trace.to_json()`'s): valid expectations, and valid HUMAN feedback, named like a row's field."""
    if not isinstance(assessments, list):
        return
    for a in assessments:
        if not isinstance(a, dict) or a.get("valid") is False:
            continue
        name = a.get("assessment_name") or a.get("name")
        if name not in EXPECTATION_FIELDS:
            continue
        value = _assessment_value(a)
        if value is None:
            continue
        normal = normalised_value(name, value)
        if normal is not None:
            yield Expectation(normalise_id(trace_id), name, normal, f"{where} ({_source(a)})")


def _assessment_value(a: Mapping[str, Any]) -> Any:
    expectation, feedback = a.get("expectation"), a.get("feedback")
    if isinstance(expectation, dict):
        if "value" in expectation:
            return expectation["value"]
        serialized = expectation.get("serialized_value")
        if isinstance(serialized, dict) and isinstance(serialized.get("value"), str):
            try:
                return orjson.loads(serialized["value"])
            except orjson.JSONDecodeError:
                return None
        return None
    source = a.get("source")
    if isinstance(feedback, dict) and isinstance(source, dict) and source.get("source_type") == "HUMAN":
        return feedback.get("value")
    return None


def _source(a: Mapping[str, Any]) -> str:
    source = a.get("source") if isinstance(a.get("source"), dict) else {}
    kind = "expectation" if isinstance(a.get("expectation"), dict) else "feedback"
    return f"{kind} from {source.get('source_type') or 'unknown'}"
