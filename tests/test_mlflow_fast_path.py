"""The two MLflow readers read alike: the msgspec path for `Trace.to_json()`'s exact shape and the
general reader for every shape.

`normalise()` reads JSON bytes or text with `wire.derive_canonical_json` (msgspec typed structs),
which gives None for anything not in the exact shape MLflow writes; that input, dicts, and every
error go to `parser.parse_trace`, which reads every form and names what is wrong. The two must
give the same record, `wire.parse_canonical_json` the same `Trace` but for what it documents it
leaves unread, and the msgspec path must give up on every input the general reader rejects, so that
the error is the general reader's. Checked on real traces from the `mlflow` package, as written and
mutated at random where the two readers' checks differ (ids, times, status, attributes, events,
missing keys, span nesting, the trace's info), and for traces embedded as JSON text in
agent-evaluation and inference-log records.
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
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats import mlflow as parser
from tracejudge.schemas.formats import mlflow_wire as wire
from tracejudge.schemas.formats.derive import HTTP_STATUS_KEYS, derive, documents_from_output, root_span
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.trace import SpanKind, Trace

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
_INFO_KEYS = ("trace_id", "client_request_id", "trace_location", "request_time", "state",
              "execution_duration_ms", "execution_duration", "trace_metadata", "tags", "assessments",
              "request_id")
_INFO_VALUES = st.sampled_from([
    "tr-a795c45134ad7ba0a795c45134ad7ba0", "2026-01-02T03:04:05.678Z", "2026-01-02 03:04:05", "1767322800000",
    1767322800000, 2**63, 1.5e12, "0.25s", "12",
    {"type": "MLFLOW_EXPERIMENT", "mlflow_experiment": {"experiment_id": "5"}},
    {"mlflow_experiment": {"experiment_id": 5}}, {"type": 1},
    {"mlflow.trace.session": "s", "k": "v"},
    {"mlflow.trace.tokenUsage": '{"input_tokens": 1, "output_tokens": 2}'}, {"k": 1}, "IN_PROGRESS",
    [{"assessment_name": "expected_response", "expectation": {"value": "a"}}], [{"name": 1}],
])
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
    if draw(st.booleans()):  # a repeated span id, a parent after its child, or another parent
        i, j = draw(st.integers(0, len(spans) - 1)), draw(st.integers(0, len(spans) - 1))
        change = draw(st.sampled_from(["id", "swap", "parent"]))
        if change == "id":
            spans[i]["span_id"] = copy.deepcopy(spans[j].get("span_id"))
        elif change == "swap":
            spans[i], spans[j] = spans[j], spans[i]
        else:
            spans[i]["parent_span_id"] = copy.deepcopy(spans[j].get("span_id"))
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(_INFO_KEYS))
        value = draw(st.one_of(_VALUES, _INFO_VALUES, st.just(_DELETE)))
        if value is _DELETE:
            doc["info"].pop(key, None)
        else:
            doc["info"][key] = copy.deepcopy(value)
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


def _assert_same_trace(lean: Trace, general: Trace) -> None:
    """Equal but for what `parse_canonical_json` documents it leaves unread: a non-root retriever's
    documents are in `documents` and its `outputs` is None, and the root's `attributes` hold only its
    HTTP status and model-call attributes."""
    assert msgspec.structs.replace(lean, spans=[]) == msgspec.structs.replace(general, spans=[])
    for span, reference in zip(lean.spans, general.spans, strict=True):
        if span.documents is not None:
            assert span.parent_id is not None and span.outputs is None and reference.documents is None
            assert span.documents == documents_from_output(reference.outputs)
            span = msgspec.structs.replace(span, documents=None, outputs=reference.outputs)
        if span.parent_id is None:
            kept = (*HTTP_STATUS_KEYS, "mlflow.llm.model", "mlflow.llm.cost")
            assert span.attributes == {k: v for k, v in reference.attributes.items() if k in kept}
            span = msgspec.structs.replace(span, attributes=reference.attributes)
        assert span == reference


def _lean_parts(payload: bytes) -> Any:
    """What the one-pass walk makes of a trace's spans."""
    decoded = wire._decode(payload)
    assert decoded is not None
    return wire._lean_parts(decoded.data.spans)


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
    record = derive(general)
    for text in (payload, payload.decode()):
        lean = wire.parse_canonical_json(text)
        assert lean is not None  # the shape MLflow writes is read by the msgspec path
        _assert_same_trace(lean, general)
        assert derive(lean) == record == wire.derive_canonical_json(text)
    assert normalise(payload) == record == normalise(doc)
    # With the trace's usage stated, the one-pass walk reads the spans MLflow lists parents first.
    if general.token_usage is not None:
        root, retrieved, trajectory, *_ = _lean_parts(payload)
        assert root is not None and root.span_id == root_span(general.spans).span_id
        assert (retrieved, trajectory) == (record.retrieved_context, record.trajectory)
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
    lambda spans: spans[-1].update(parent_span_id=spans[-1]["span_id"]),  # its own parent
])
def test_edits_that_keep_the_exact_shape_stay_on_the_msgspec_path(edit: Callable[[list[Any]], None]) -> None:
    doc = copy.deepcopy(TRACES["rag"])
    edit(doc["data"]["spans"])
    payload = orjson.dumps(doc)
    lean = wire.parse_canonical_json(payload)
    assert lean is not None
    general = parser.parse_trace(doc, everything=False)
    _assert_same_trace(lean, general)
    assert derive(lean) == derive(general) == wire.derive_canonical_json(payload)


def _loop(spans: list[Any]) -> None:
    # The last two spans each other's parent: neither is reached from the root.
    spans[-1]["parent_span_id"], spans[-2]["parent_span_id"] = spans[-2]["span_id"], spans[-1]["span_id"]


@pytest.mark.parametrize("edit", [
    lambda spans: spans.reverse(),
    lambda spans: spans[-1].update(span_id=spans[0]["span_id"]),
    lambda spans: spans[1].update(span_id=spans[-1]["span_id"]),
    lambda spans: spans[-1].update(parent_span_id="AAAAAAAAAAA="),
    lambda spans: spans[-1].update(parent_span_id=spans[-1]["span_id"]),
    lambda spans: spans[1].update(parent_span_id=None),
    lambda spans: spans[1].update(span_id=spans[0]["span_id"], parent_span_id=spans[0]["span_id"]),
    _loop,
], ids=["children first", "repeated id", "repeated id, the first", "unknown parent", "own parent",
        "second root", "the root's id, as its own parent", "loop"])
@pytest.mark.parametrize("name", ["multi_retriever", "wrapper_llm", "tools"])
def test_odd_span_lists_are_read_in_one_pass_as_derive_reads_them(
        edit: Callable[[list[Any]], None], name: str) -> None:
    # multi_retriever: a retriever wrapping another; wrapper_llm: usage on a wrapper and the call
    # inside it, and calls naming different models (None and one); tools: tool calls in order.
    doc = copy.deepcopy(TRACES[name])
    edit(doc["data"]["spans"])
    general = parser.parse_trace(doc, everything=False)
    assert general.token_usage is not None  # so the one-pass walk reads it
    payload = orjson.dumps(doc)
    record = derive(general)
    root, retrieved, trajectory, *_ = _lean_parts(payload)
    assert (root, retrieved, trajectory) == (root_span(general.spans), record.retrieved_context,
                                             record.trajectory)
    assert wire.derive_canonical_json(payload) == record == normalise(payload)


def test_one_model_calls_are_counted_only_when_reached_from_a_root() -> None:
    # Every span stating usage names the same model, but the first of them sits in a loop of
    # parents: `usage_spans` never reaches it, and the walk must not count it either.
    doc = copy.deepcopy(TRACES["rag"])
    spans = doc["data"]["spans"]
    chat = next(span for span in spans if "mlflow.chat.tokenUsage" in span["attributes"])
    looped = copy.deepcopy(chat)
    looped["span_id"], looped["parent_span_id"] = "AAAAAAAAAAE=", "AAAAAAAAAAI="
    partner = copy.deepcopy(looped)
    partner["span_id"], partner["parent_span_id"] = "AAAAAAAAAAI=", "AAAAAAAAAAE="
    partner["attributes"] = {"mlflow.spanType": '"CHAIN"'}
    spans[:0] = [looped, partner]  # listed first, so the walk meets it first
    spans.remove(chat)
    general = parser.parse_trace(doc, everything=False)
    record = derive(general)
    assert general.token_usage is not None and record.model_usage is None  # nothing counted
    assert wire.derive_canonical_json(orjson.dumps(doc)) == record


def test_calls_of_one_model_are_the_traces_usage_though_an_uncounted_one_names_another() -> None:
    # The wrapper and the second call name one model; the call inside the wrapper, not counted
    # (its wrapper's usage holds it), names another: the counted calls are of one model, so that
    # model's usage is the trace's, as `derive()` reads it.
    doc = copy.deepcopy(TRACES["wrapper_llm"])
    for span in doc["data"]["spans"]:
        if span["name"] == "llm_wrapper":
            span["attributes"]["mlflow.llm.model"] = '"gpt-4o-mini"'
        elif span["name"] == "inner_chat":
            span["attributes"]["mlflow.llm.model"] = '"another-model"'
    general = parser.parse_trace(doc, everything=False)
    record = derive(general)
    assert record.model_usage == {"gpt-4o-mini": general.token_usage.with_total()}
    assert wire.derive_canonical_json(orjson.dumps(doc)) == record


def test_nested_retrievers_are_left_out_whatever_lies_between() -> None:
    # A retriever below a RETRIEVER root, with a chain between them: `top_level_retrievers` leaves
    # it out, so the one-pass walk must too, though it never builds the chain's span.
    doc = copy.deepcopy(TRACES["tools"])
    spans = doc["data"]["spans"]
    names = {span["span_id"]: span["name"] for span in spans}
    nested = next(span for span in spans if names.get(span["parent_span_id"]) == "planner")
    spans[0]["attributes"]["mlflow.spanType"] = '"RETRIEVER"'
    nested["attributes"]["mlflow.spanType"] = '"RETRIEVER"'
    nested["attributes"]["mlflow.spanOutputs"] = json.dumps(
        [{"page_content": "nested", "metadata": {"doc_uri": "kb://nested"}}])
    payload = orjson.dumps(doc)
    expected = derive(parser.parse_trace(doc, everything=False))
    assert expected.retrieved_context is not None
    assert "nested" not in [d.content for d in expected.retrieved_context]
    assert wire.derive_canonical_json(payload) == expected == normalise(payload)


def test_only_a_trace_that_states_its_usage_is_read_in_one_pass() -> None:
    # multi_retriever: a retriever wrapping another, chat spans with usage, the trace's own usage.
    doc = TRACES["multi_retriever"]
    payload = orjson.dumps(doc)
    general = parser.parse_trace(doc, everything=False)
    record = derive(general)
    _, retrieved, trajectory, *_ = _lean_parts(payload)
    assert len(retrieved) < len([d for s in general.spans if s.kind == SpanKind.RETRIEVER
                                 for d in documents_from_output(s.outputs)])  # the nested one is left out
    assert (retrieved, trajectory) == (record.retrieved_context, record.trajectory)
    assert wire.derive_canonical_json(payload) == record
    # Without a trace-level usage, derivation sums the spans' own: every span is read.
    unstated = copy.deepcopy(doc)
    del unstated["info"]["trace_metadata"]["mlflow.trace.tokenUsage"]
    every = parser.parse_trace(unstated, everything=False)
    assert every.token_usage is None
    derived = wire.derive_canonical_json(orjson.dumps(unstated))
    assert derived == derive(every) and derived is not None and derived.tokens is not None


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated())
def test_mutated_traces_read_alike(doc: dict[str, Any]) -> None:
    general = _general(doc)
    payload = orjson.dumps(doc)
    lean = wire.parse_canonical_json(payload)
    record = wire.derive_canonical_json(payload)
    if isinstance(general, tuple):
        assert lean is None and record is None  # the general reader names what is wrong
    else:
        if lean is not None:
            _assert_same_trace(lean, general)
            assert derive(lean) == derive(general)
        if record is not None:
            assert record == derive(general)
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


# Each tool's `mlflow.spanOutputs` (the attribute's string, itself JSON) -> the largest one's length in
# characters. The msgspec path decodes only the results that could be the largest: a string of n bytes
# on the wire holds at most n - 2 characters. The first cases are those where the longest on the wire
# is not the largest: escapes (a newline is 3 bytes on the wire, 2 characters of JSON text) and
# UTF-8 (2 bytes for "é").
_TOOL_RESULTS = [
    ([json.dumps("\n" * 100), json.dumps("x" * 250), json.dumps("y" * 10)], 252),
    ([json.dumps("x" * 250), json.dumps("y" * 10), json.dumps("\n" * 100)], 252),
    ([json.dumps("é" * 80, ensure_ascii=False), json.dumps("e" * 100)], 102),
    ([json.dumps("é" * 80, ensure_ascii=False), json.dumps("e" * 60), json.dumps({"k": "\u2603" * 5})], 82),
    ([json.dumps("é" * 80), json.dumps("e" * 60)], 482),  # "\u00e9": 6 characters of JSON text
    ([json.dumps("a"), json.dumps("a"), json.dumps("ab")], 4),
    (["", json.dumps("abc"), None], 5),
    ([{"not": "a string " * 20}, ["nor", "this"], json.dumps("short")], 7),
    ([{"not": "a string"}, 12345, ""], None),
    ([None, None, None], None),
]


@pytest.mark.parametrize(("results", "expected"), _TOOL_RESULTS)
def test_the_largest_tool_result_is_measured_alike(results: list[Any], expected: int | None) -> None:
    doc = copy.deepcopy(TRACES["tools"])
    tools = [span for span in doc["data"]["spans"] if span["attributes"].get("mlflow.spanType") == '"TOOL"']
    assert len(tools) > len(results)  # the last tool (flaky_tool) states no result
    for span, result in zip(tools, results, strict=False):
        if result is None:
            span["attributes"].pop("mlflow.spanOutputs", None)
        else:
            span["attributes"]["mlflow.spanOutputs"] = result
    payload = orjson.dumps(doc)
    record = derive(parser.parse_trace(doc, everything=False))
    assert record.max_tool_result_chars == expected
    assert _lean_parts(payload)[4] == expected  # read in one pass, not by the general reader
    assert wire.derive_canonical_json(payload) == record == normalise(payload)


@pytest.mark.parametrize(("code", "message", "events", "expected"), [
    ("STATUS_CODE_OK", "", [], None),
    ("STATUS_CODE_UNSET", "", [], None),
    ("STATUS_CODE_ERROR", "timed out", [], "timed out"),
    ("ERROR", "", [], "span 'get_weather' status is ERROR"),
    # An exception event fails the call whatever its status says.
    ("STATUS_CODE_OK", "", [{"name": "exception", "time_unix_nano": 1,
                             "attributes": {"exception.type": "KeyError", "exception.message": "city"}}],
     "KeyError: city"),
])
def test_a_tool_calls_error_is_read_alike(code: str, message: str, events: list[Any],
                                          expected: str | None) -> None:
    doc = copy.deepcopy(TRACES["tools"])
    first = next(span for span in doc["data"]["spans"] if span["name"] == "get_weather")
    first["status"], first["events"] = {"code": code, "message": message}, events
    payload = orjson.dumps(doc)
    record = derive(parser.parse_trace(doc, everything=False))
    assert record.trajectory is not None and record.trajectory[0].error == expected
    assert record.trajectory[-1].error == "ValueError: tool exploded"  # flaky_tool, as written
    assert _lean_parts(payload)[2] == record.trajectory
    assert wire.derive_canonical_json(payload) == record == normalise(payload)
