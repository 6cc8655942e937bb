"""The two MLflow readers read alike: the msgspec path for `Trace.to_json()`'s exact shape and the
general reader for every shape.

`normalise()` reads JSON bytes or text with `parser.parse_canonical_json` (msgspec typed structs),
which gives None for anything not in the exact shape MLflow writes; that input, dicts, and every
error go to `parser.parse_trace`, which reads every form and names what is wrong. The two must
give the same `Trace` but for what `parse_canonical_json` documents it trims, the same record, and
the msgspec path must give up on every input the general reader rejects, so that the error is the
general reader's. Checked on real traces from the `mlflow` package, as written and mutated at
random where the two readers' checks differ (ids, times, status, attributes, events, missing keys),
and for traces embedded as JSON text in agent-evaluation and inference-log records.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import msgspec
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import mlflow_apps

from tracejudge.schemas import errors
from tracejudge.schemas import mlflow as parser
from tracejudge.schemas.derive import HTTP_STATUS_KEYS, derive, documents_from_output, top_level_retrievers
from tracejudge.schemas.detect import normalise
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.trace import Span, SpanKind, Trace

TRACES = {name: json.loads(text) for name, text in mlflow_apps.run_all().items()}
# Traces with every kind of span the msgspec path treats specially: retrievers (nested too),
# tools, chat spans with usage, a failed root with an exception event.
BASES = [TRACES[name] for name in ("rag", "multi_retriever", "tools", "wrapper_llm", "failing")]

_VALUES = st.sampled_from([
    None, "", 0, 1, -1, 1.0, 1.5, True, "12", " 42 ", "abc", [], {}, [{}], {"a": 1},
    # ids: base64 of 8 bytes, hex, 0x-hex, base64 of other lengths (12 characters of 7 bytes too),
    # not base64
    "AAAAAAAAAAA=", "AAAAAAAAAAB=", "a795c45134ad7ba0", "0xa795c45134ad7ba0", "AAAAAAAAAAAAAAAA",
    "AAAAAAAAAA==", "!!!!!!!!!!!=",
    # status codes and span types as MLflow and others write them
    "STATUS_CODE_ERROR", "ERROR", "OK", '"RETRIEVER"', '"TOOL"', '"CHAT_MODEL"', '"WORKFLOW"', "RETRIEVER",
    '"UNKNOWN"', "null", '{"input_tokens": 3}', '{"call": {"tool_name": "t"}}', '[{"page_content": "x"}]',
    '{"input_tokens": "x"}', "NaN",
    [{"name": "exception", "attributes": {"exception.message": "m"}}],
    [{"name": "exception", "time_unix_nano": "12"}], [{"name": 1}], [{"name": "e", "attributes": []}],
])
_SPAN_KEYS = ("span_id", "parent_span_id", "name", "start_time_unix_nano", "end_time_unix_nano", "status",
              "attributes", "events")
_ATTRIBUTES = ("mlflow.spanType", "mlflow.spanInputs", "mlflow.spanOutputs", "mlflow.chat.tokenUsage",
               "custom.key")
_DELETE = object()


@st.composite
def _mutated(draw: st.DrawFn) -> dict[str, Any]:
    doc = copy.deepcopy(draw(st.sampled_from(BASES)))
    spans = doc["data"]["spans"]
    for _ in range(draw(st.integers(1, 3))):
        span = spans[draw(st.integers(0, len(spans) - 1))]
        where = draw(st.sampled_from(["span", "span", "status", "attribute"]))
        value = draw(st.one_of(_VALUES, st.just(_DELETE)))
        if where == "span":
            target, key = span, draw(st.sampled_from(_SPAN_KEYS))
        elif where == "status" and isinstance(span.get("status"), dict):
            target, key = span["status"], draw(st.sampled_from(["code", "message"]))
        elif isinstance(span.get("attributes"), dict):
            target, key = span["attributes"], draw(st.sampled_from(_ATTRIBUTES))
        else:
            continue
        if value is _DELETE:
            target.pop(key, None)
        else:
            target[key] = copy.deepcopy(value)
    if draw(st.booleans()):  # a span id that repeats, or a parent that comes after its child
        i, j = draw(st.integers(0, len(spans) - 1)), draw(st.integers(0, len(spans) - 1))
        if draw(st.booleans()):
            spans[i]["span_id"] = copy.deepcopy(spans[j].get("span_id"))
        else:
            spans[i], spans[j] = spans[j], spans[i]
    return doc


def _general(doc: dict[str, Any]) -> Any:
    try:
        return parser.parse_trace(copy.deepcopy(doc), everything=False)
    except Exception as exc:  # the exception itself is what is compared
        return (type(exc), str(exc))


def _result(normalise_: Callable[[], Any]) -> Any:
    try:
        return normalise_()
    except RecordError as exc:
        return (exc.reason, exc.field, exc.detail)


def _read_by_derive(general: Trace) -> list[Span]:
    """The spans `derive()` reads of a trace that states its usage: those without a parent, TOOL
    spans and the RETRIEVER spans `top_level_retrievers` picks."""
    top = {id(span) for span in top_level_retrievers(general.spans)}
    return [span for span in general.spans
            if span.parent_id is None or span.kind == SpanKind.TOOL or id(span) in top]


def _assert_same_trace(lean: Trace, general: Trace, *, pruned: bool | None = None) -> None:
    """Equal but for what `parse_canonical_json` documents: a non-root retriever's MLflow documents
    are in `documents` rather than `outputs`, the root's `attributes` hold only its HTTP status, and
    when the trace states its own usage, span usage is left unread and only the spans derivation
    reads are kept (all of them when the span list cannot be pruned safely). `pruned` says which
    of the two span lists is expected, when the caller knows."""
    assert msgspec.structs.replace(lean, spans=[]) == msgspec.structs.replace(general, spans=[])
    references = general.spans
    if general.token_usage is not None and (pruned or len(lean.spans) != len(general.spans)):
        references = _read_by_derive(general)
    elif pruned:
        raise AssertionError("expected the spans derivation reads only: the trace states no usage")
    if pruned is False:
        assert len(lean.spans) == len(general.spans)
    for span, reference in zip(lean.spans, references, strict=True):
        if span.documents is not None:
            assert span.parent_id is not None and span.outputs is None and reference.documents is None
            assert span.documents == documents_from_output(reference.outputs)
            span = msgspec.structs.replace(span, documents=None, outputs=reference.outputs)
        if span.parent_id is None:
            assert span.attributes == {k: v for k, v in reference.attributes.items() if k in HTTP_STATUS_KEYS}
            span = msgspec.structs.replace(span, attributes=reference.attributes)
        if general.token_usage is not None:
            assert span.token_usage is None
            span = msgspec.structs.replace(span, token_usage=reference.token_usage)
        assert span == reference


def _embedded(trace: Any) -> list[dict[str, Any]]:
    """The records that carry an MLflow trace (object or JSON text) inside them."""
    return [{"request": "q", "expected_response": "a", "trace": trace},
            {"databricks_request_id": "r", "status_code": 200, "request": {"messages": []},
             "response": {"choices": [], "databricks_output": {"trace": trace}}}]


@pytest.mark.parametrize("name", sorted(TRACES))
def test_real_traces_read_alike(name: str) -> None:
    doc = TRACES[name]
    payload = orjson.dumps(doc)
    general = parser.parse_trace(doc, everything=False)
    for text in (payload, payload.decode()):
        lean = parser.parse_canonical_json(text)
        assert lean is not None  # the shape MLflow writes is read by the msgspec path
        # MLflow lists parents first: with usage stated, only the spans derivation reads are kept.
        _assert_same_trace(lean, general, pruned=general.token_usage is not None)
    record = derive(general)
    assert derive(lean) == record == normalise(payload) == normalise(doc)
    # Decoding only what derivation reads leaves the record as decoding everything does.
    assert derive(parser.parse_trace(doc, everything=True)) == record
    for as_object, as_text in zip(_embedded(doc), _embedded(payload.decode()), strict=True):
        assert normalise(as_text) == normalise(as_object)


@pytest.mark.parametrize("edit", [
    lambda spans: spans[-1]["status"].update(code="STATUS_CODE_ERROR", message="boom"),
    lambda spans: spans[-1]["attributes"].update({"custom.key": '"x"', "mlflow.spanType": '"TOOL"'}),
    lambda spans: spans[-1]["attributes"].update({"mlflow.chat.tokenUsage": '{"input_tokens": 3}'}),
    lambda spans: spans[-1]["attributes"].update({"mlflow.spanType": '"WORKFLOW"'}),
    lambda spans: spans[-1].update(end_time_unix_nano=0),
    lambda spans: spans.reverse(),  # children before their parents
    lambda spans: spans[-1].update(span_id=spans[0]["span_id"]),  # a repeated span id
    lambda spans: spans[-1].update(parent_span_id="AAAAAAAAAAA="),  # a parent no span has
])
def test_edits_that_keep_the_exact_shape_stay_on_the_msgspec_path(edit: Callable[[list[Any]], None]) -> None:
    doc = copy.deepcopy(TRACES["rag"])
    edit(doc["data"]["spans"])
    lean = parser.parse_canonical_json(orjson.dumps(doc))
    assert lean is not None
    general = parser.parse_trace(doc, everything=False)
    _assert_same_trace(lean, general)
    assert derive(lean) == derive(general)


@pytest.mark.parametrize("edit", [
    lambda spans: spans.reverse(),
    lambda spans: spans[-1].update(span_id=spans[0]["span_id"]),
    lambda spans: spans[-1].update(parent_span_id="AAAAAAAAAAA="),
], ids=["children first", "repeated id", "unknown parent"])
def test_span_lists_the_lean_walk_cannot_prune_keep_every_span(edit: Callable[[list[Any]], None]) -> None:
    doc = copy.deepcopy(TRACES["rag"])
    edit(doc["data"]["spans"])
    general = parser.parse_trace(doc, everything=False)
    assert general.token_usage is not None  # so only the span list's shape stops the pruning
    lean = parser.parse_canonical_json(orjson.dumps(doc))
    assert lean is not None
    _assert_same_trace(lean, general, pruned=False)
    assert derive(lean) == derive(general)


def test_spans_derivation_does_not_read_are_dropped_only_when_the_trace_states_usage() -> None:
    # multi_retriever: a retriever wrapping another, chat spans with usage, the trace's own usage.
    doc = TRACES["multi_retriever"]
    general = parser.parse_trace(doc, everything=False)
    assert general.token_usage is not None
    lean = parser.parse_canonical_json(orjson.dumps(doc))
    assert lean is not None
    kinds = [span.kind for span in lean.spans]
    assert SpanKind.CHAT_MODEL not in kinds and len(lean.spans) < len(general.spans)
    nested = [s for s in general.spans if s.kind == SpanKind.RETRIEVER and s not in
              top_level_retrievers(general.spans)]
    assert nested and not {s.span_id for s in nested} & {s.span_id for s in lean.spans}
    assert derive(lean) == derive(general)
    # Without a trace-level usage, derivation sums the spans' own: every span is kept.
    unstated = copy.deepcopy(doc)
    del unstated["info"]["trace_metadata"]["mlflow.trace.tokenUsage"]
    every = parser.parse_canonical_json(orjson.dumps(unstated))
    assert every is not None and len(every.spans) == len(general.spans)
    assert derive(every) == derive(parser.parse_trace(unstated, everything=False))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated())
def test_mutated_traces_read_alike(doc: dict[str, Any]) -> None:
    general = _general(doc)
    payload = orjson.dumps(doc)
    lean = parser.parse_canonical_json(payload)
    if isinstance(general, tuple):
        assert lean is None  # the general reader names what is wrong
    elif lean is not None:
        _assert_same_trace(lean, general)
        assert derive(lean) == derive(general)
    assert _result(lambda: normalise(payload)) == _result(lambda: normalise(doc))
    for as_object, as_text in zip(_embedded(doc), _embedded(payload.decode()), strict=True):
        assert _result(lambda: normalise(as_text)) == _result(lambda: normalise(as_object))  # noqa: B023


def _with_span_attribute(value: bytes) -> bytes:
    """The RAG trace's JSON with `value` as the raw JSON of an attribute of a span no one reads."""
    doc = copy.deepcopy(TRACES["rag"])
    chat = next(s for s in doc["data"]["spans"] if s["parent_span_id"] is not None
                and s["attributes"].get("mlflow.spanType") not in ('"RETRIEVER"', '"TOOL"'))
    chat["attributes"]["custom.key"] = "PLACEHOLDER"
    return orjson.dumps(doc).replace(b'"PLACEHOLDER"', value)


@pytest.mark.parametrize("value", [b"NaN", b'"\\ud800"', b"1e400", b"123456789012345678901234567890"])
def test_values_left_unread_read_as_the_general_path_reads_them(value: bytes) -> None:
    payload = _with_span_attribute(value)
    assert normalise(payload) == normalise(json.loads(payload))


@pytest.mark.parametrize("value", [b"NaN", b'"\\ud800"'])
def test_embedded_trace_text_orjson_rejects_is_invalid_json(value: bytes) -> None:
    text = _with_span_attribute(value).decode()
    for record, field in zip(_embedded(text), ("trace", "response.databricks_output.trace"), strict=True):
        with pytest.raises(RecordError) as bad:
            normalise(record)
        assert (bad.value.reason, bad.value.field) == (errors.INVALID_JSON, field)


@pytest.mark.parametrize("value", [b"1e400", b"123456789012345678901234567890"])
def test_embedded_trace_text_with_big_numbers_left_unread_is_read(value: bytes) -> None:
    # msgspec skips what derivation never reads: a number beyond the float range there is read as
    # it is in a whole-payload trace (where orjson's rejection falls back to Python's json).
    payload = _with_span_attribute(value)
    for as_text, as_object in zip(_embedded(payload.decode()), _embedded(json.loads(payload)), strict=True):
        assert normalise(as_text) == normalise(as_object)


def test_bytes_left_unread_are_still_checked() -> None:
    # msgspec does not look inside the attributes it skips; the general path rejects these.
    with pytest.raises(RecordError) as bad_utf8:
        normalise(_with_span_attribute(b'"\xff"'))
    assert bad_utf8.value.reason == errors.NOT_UTF8
    with pytest.raises(RecordError) as too_deep:
        normalise(_with_span_attribute(b"[" * 5000 + b"]" * 5000))
    assert too_deep.value.reason == errors.INVALID_JSON
