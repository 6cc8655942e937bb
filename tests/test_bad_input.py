"""Bad input gives a `RecordError` that names what is wrong and where; nothing else escapes.

Also: the MLflow trace parser's inline checks and the pydantic schemas (`tracejudge.schemas.formats.inputs`,
the documented source of truth) accept and reject exactly the same traces, checked on real traces
(mlflow 3.17 and 2.22) mutated at random.
"""

from __future__ import annotations

import copy
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import mlflow_apps

from tracejudge.schemas.errors import REASONS, RecordError
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.formats.inputs import MlflowTraceV2, MlflowTraceV3, ValidationError
from tracejudge.schemas.formats.mlflow import parse_trace
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import EvaluationResult, SourceRef

MLFLOW2 = pathlib.Path(__file__).parent / "fixtures" / "mlflow2" / "traces.jsonl"

V3_RAG = json.loads(mlflow_apps.run("rag"))
V3_TOOLS = json.loads(mlflow_apps.run("tools"))
V2_TOOLS = json.loads(next(json.loads(line)["trace"] for line in MLFLOW2.read_text().splitlines()
                           if json.loads(line)["app"] == "tools"))
AGENT_EVAL = {"request_id": "r1", "request": {"messages": [{"role": "user", "content": "q"}]},
              "response": "a", "retrieved_context": [{"content": "c", "doc_uri": "u"}],
              "expected_facts": ["f"], "reference_trajectory": [{"tool_name": "t", "tool_input": {"x": 1}}],
              "trace": V3_RAG}
INFERENCE_ROW = {"databricks_request_id": "d1", "status_code": 200, "execution_duration_ms": 10,
                 "request_time": "2026-11-22T10:00:00Z", "served_entity_id": "e",
                 "request": json.dumps({"messages": [{"role": "user", "content": "q"}]}),
                 "response": json.dumps({"choices": [{"message": {"role": "assistant", "content": "a"}}],
                                         "databricks_output": {"trace": V3_RAG}})}


def _error(payload: Any, fmt: str | None = None) -> RecordError:
    with pytest.raises(RecordError) as err:
        normalise(payload, fmt)
    return err.value


# --------------------------------------------------------------------------------------------
# clear errors


@pytest.mark.parametrize(("payload", "reason", "detail"), [
    (b"", "invalid_json", "not JSON: it is empty (zero length)"),
    (b'{"request": "q"', "invalid_json", None),
    (b'\xff{"request": "q"}', "not_utf8", "not valid UTF-8 at byte 0"),
    (b"[1, 2]", "invalid_record", "a record must be a JSON object, got an array"),
    (b'"text"', "invalid_record", "a record must be a JSON object, got a string"),
    (b'{"foo": 1, "bar": 2}', "unknown_format",
     "not an MLflow trace, inference-log row or agent-evaluation record (keys: bar, foo)"),
])
def test_undecodable_records(payload: bytes, reason: str, detail: str | None) -> None:
    err = _error(payload)
    assert err.reason == reason and err.field is None
    if detail is not None:
        assert err.detail == detail


def test_otlp_export_request_is_pointed_at_the_span_formats() -> None:
    err = _error({"resourceSpans": []})
    assert err.reason == "unknown_format" and "--format otlp_json" in err.detail
    assert _error({"request": "q"}, "otlp_json").reason == "unknown_format"
    with pytest.raises(ValueError, match="unknown format 'csv'"):
        normalise({"request": "q"}, "csv")


def _unescaped(row: bytes) -> str:
    return json.dumps(json.loads(row), ensure_ascii=False)  # the surrogates as characters


@pytest.mark.parametrize("as_given", [bytes, bytes.decode, _unescaped, json.loads],
                         ids=["bytes", "text", "unescaped-text", "mapping"])
def test_half_a_surrogate_pair_becomes_the_replacement_character(as_given: Any) -> None:
    # `json.dumps` escapes every non-ASCII character, so a broken UTF-16 string reaches us as "\\ud83d".
    row = json.dumps({"request_id": "r", "request": "smile \ud83d", "response": "\ud83d\ude00 ok",
                      "retrieved_context": [{"content": "c\udc00", "doc_uri": "u"}],
                      "tags": {"app\ud800": "x\udfff"}}).encode()
    record = normalise(as_given(row))
    assert record.request == "smile \ufffd" and record.response == "\U0001f600 ok"  # a whole pair is kept
    assert record.retrieved_context[0].content == "c\ufffd"
    assert record.tags == {"app\ufffd": "x\ufffd"}
    EvaluationResult(record=record, source=SourceRef(format="auto")).to_json()


def test_half_a_surrogate_pair_in_a_span_attribute_becomes_the_replacement_character() -> None:
    trace = copy.deepcopy(V3_RAG)
    root = next(s for s in trace["data"]["spans"] if not s.get("parent_span_id"))
    root["attributes"]["mlflow.spanOutputs"] = json.dumps("half \udc00 an answer")
    record = normalise(json.dumps(trace).encode())
    assert record.response == "half \ufffd an answer" and record.retrieved_context


def test_python_nan_is_read() -> None:
    """Python producers (`json.dumps`) write NaN, which is not JSON; the record is still read."""
    assert normalise(b'{"request": "q", "response": "a", "score": NaN}').response == "a"


def _mutate(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(("base", "path", "value", "field", "detail"), [
    (V3_RAG, ("data", "spans", 2, "start_time_unix_nano"), "abc",
     "data.spans[2].start_time_unix_nano", 'expected an integer, got a string of 3 characters'),
    (V3_RAG, ("data", "spans", 1, "span_id"), "not an id!", "data.spans[1].span_id",
     'expected a hex or base64 id, got a string of 10 characters'),
    (V3_RAG, ("data", "spans", 0, "name"), _DELETE, "data.spans[0].name", "required field is missing"),
    (V3_RAG, ("data", "spans", 0, "attributes"), ["x"], "data.spans[0].attributes",
     'expected an object, got a list of 1 item'),
    (V3_RAG, ("data", "spans", 0, "events"), [{"time_unix_nano": 1}], "data.spans[0].events[0].name",
     "required field is missing"),
    (V3_RAG, ("data", "spans"), {"0": {}}, "data.spans", 'expected a list, got an object of 1 key'),
    (V3_RAG, ("info", "trace_id"), 7, "info.trace_id", "expected a string, got 7"),
    (V3_RAG, ("info", "request_time"), "noon", "info.request_time",
     'expected an RFC 3339 time or epoch milliseconds, got a string of 4 characters'),
    (V3_RAG, ("info", "trace_location", "mlflow_experiment"), "1", "info.trace_location.mlflow_experiment",
     'expected an object, got a string of 1 character'),
    (V3_RAG, ("data",), _DELETE, "data", "required field is missing"),
    (V2_TOOLS, ("data", "spans", 1, "context"), _DELETE, "data.spans[1].context",
     "required field is missing"),
    (V2_TOOLS, ("data", "spans", 1, "start_time"), 1.5, "data.spans[1].start_time",
     "expected an integer, got 1.5"),
    (V2_TOOLS, ("info", "status"), 1, "info.status", "expected a string, got 1"),
])
def test_bad_mlflow_trace_names_the_field(base: dict[str, Any], path: tuple[Any, ...], value: Any,
                                          field: str, detail: str) -> None:
    err = _error(_mutate(base, path, value))
    assert (err.reason, err.field, err.detail) == ("invalid_record", field, detail)
    assert err.message == f"{field}: {detail}"


@pytest.mark.parametrize(("path", "value", "field", "detail"), [
    (("request",), 5, "request", "expected a string or an object, got 5"),
    (("request", "messages", 0, "role"), _DELETE, "request.messages[0].role", "required field is missing"),
    (("request", "messages"), [], "request.messages", "must not be empty, got an empty list"),
    (("retrieved_context", 0, "content"), 3, "retrieved_context[0].content", "expected a string, got 3"),
    (("expected_facts",), "one fact", "expected_facts", 'expected a list, got a string of 8 characters'),
    (("reference_trajectory", 0, "tool_name"), None, "reference_trajectory[0].tool_name",
     "expected a string, got null"),
    (("trace",), "{not json", "trace", None),
    (("trace", "data", "spans", 1, "end_time_unix_nano"), "later", "trace.data.spans[1].end_time_unix_nano",
     'expected an integer, got a string of 5 characters'),
])
def test_bad_agent_eval_record_names_the_field(path: tuple[Any, ...], value: Any, field: str,
                                               detail: str | None) -> None:
    err = _error(_mutate(AGENT_EVAL, path, value))
    assert err.field == field
    if detail is None:
        assert err.reason == "invalid_json"
    else:
        assert (err.reason, err.detail) == ("invalid_record", detail)


_NO_REQUEST = "(a record without a trace must state its request, or mlflow.genai.evaluate's inputs)"


@pytest.mark.parametrize(("record", "detail"), [
    ({"request_id": "r1", "response": "a"}, f"required field is missing {_NO_REQUEST}"),
    ({k: v for k, v in AGENT_EVAL.items() if k not in ("request", "trace")},
     f"required field is missing {_NO_REQUEST}"),
    ({"request": None, "response": "a", "trace": None},
     f"expected a string or an object, got null {_NO_REQUEST}"),
    ({"expected_response": "a", "inputs": None}, f"required field is missing {_NO_REQUEST}"),
])
def test_agent_eval_record_without_request_or_trace_names_request(record: dict[str, Any],
                                                                  detail: str) -> None:
    for payload in (record, _dumps(record)):
        err = _error(payload)
        assert (err.reason, err.field, err.detail) == ("invalid_record", "request", detail)
    assert _error(record, "agent_eval").field == "request"


@pytest.mark.parametrize("record", [
    {"request": "", "response": "a"},                              # an empty question is still stated
    {"inputs": {"question": "q"}, "outputs": "a"},                 # mlflow.genai.evaluate's shape
    {"response": "a", "trace": V3_RAG},                            # the request comes from the trace
    {"request": {"query": "q"}},                                   # no response: nothing to judge yet
])
def test_agent_eval_record_with_a_request_or_a_trace_flows(record: dict[str, Any]) -> None:
    assert isinstance(normalise(record), EvalRecord)


@pytest.mark.parametrize(("column", "body", "detail"), [
    ("request", '{"messages": [{"role": "user", "content": "q"',
     "unexpected end of data at line 1 column 46"),
    ("request", '[{"role": "user", "content": "q"}', "unexpected end of data at line 1 column 34"),
    ("request", '  \n {"messages": [}', "unexpected character, expected a JSON value at line 2 column 16"),
    ("response", '{"choices": [{"message": {"content": "a"}}]', "unexpected end of data at line 1 column 44"),
    ("response", '{"choices": [], trailing}',
     "unexpected character, expected a string key at line 1 column 17"),
])
@pytest.mark.parametrize("status", [200, 500])
def test_inference_log_body_that_looks_like_json_but_does_not_parse_names_the_column(
        column: str, body: str, detail: str, status: int) -> None:
    row = {**INFERENCE_ROW, column: body, "status_code": status}
    for payload in (row, _dumps(row)):
        err = _error(payload)
        assert (err.reason, err.field) == ("invalid_json", column)
        assert err.detail == f"looks like JSON but does not parse: {detail}"
        assert err.message == f"{column}: {err.detail}"


def test_inference_log_bodies_that_are_text_or_python_json_flow() -> None:
    # Plain text is taken as it is (it does not look like JSON), whatever it contains.
    record = normalise({**INFERENCE_ROW, "request": "what is {x} in [brackets", "response": "plain: {answer"})
    assert (record.request, record.response) == ("what is {x} in [brackets", "plain: {answer")
    # JSON with the NaN that Python producers write is JSON, not text.
    body = '{"messages": [{"role": "user", "content": "q"}], "temperature": NaN}'
    assert normalise({**INFERENCE_ROW, "request": body}).request == "q"
    # A JSON string body is decoded; one that does not parse is text (only objects and arrays look like JSON).
    assert normalise({**INFERENCE_ROW, "request": '"quoted"', "response": '"half'}).request == "quoted"
    assert normalise({**INFERENCE_ROW, "response": '"half'}).response == '"half'


def test_explicit_format_that_does_not_fit() -> None:
    err = _error({"request": "q"}, "mlflow")
    assert (err.field, err.detail) == ("info", "required field is missing")


# --------------------------------------------------------------------------------------------
# nothing but EvalRecord or RecordError, whatever comes in

_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**66), 2**66), st.floats(allow_nan=True),
    st.text(max_size=12),
    st.text(st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=3),  # lone surrogates
    st.sampled_from(["", "abc", "123", " 42 ", "-7", "0x1f", "AAAAAAAAAAA=", "0xBRIvI26L8=",
                     "a795c45134ad7ba0", "STATUS_CODE_ERROR", "OK", "2026-11-22T00:00:00Z",
                     "2026-11-22 00:00:00", "{}", "[]",
                     '"RETRIEVER"', '"TOOL"', "null", '{"input_tokens": "x"}', "0.5s"]),
)
_JSON = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield (*prefix, i)
            yield from _paths(value, (*prefix, i))


@st.composite
def _mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    doc = base
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        if not paths:  # every key deleted: {} is the mutated record
            break
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "add":
            parent = _get(doc, path[:-1])
            if isinstance(parent, dict):
                doc = _mutate(doc, (*path[:-1], draw(st.text(max_size=6))), draw(_JSON))
                continue
            action = "replace"
        if action == "delete" and isinstance(_get(doc, path[:-1]), dict):
            doc = _mutate(doc, path, _DELETE)
        else:
            doc = _mutate(doc, path, draw(_JSON))
    return doc


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _outcome(payload: Any) -> EvalRecord | RecordError:
    try:
        record = normalise(payload)
    except RecordError as err:
        assert err.reason in REASONS
        assert err.detail and len(err.detail) <= 300
        return err
    # An accepted record can always be written out.
    EvaluationResult(record=record, source=SourceRef(format="auto")).to_json()
    return record


def _dumps(value: Any) -> bytes:
    # Python's encoder, as a Python producer would: it writes NaN and integers beyond 64 bits.
    return json.dumps(value).encode()


_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes(payload: bytes) -> None:
    _outcome(payload)


@_FUZZ
@given(_JSON)
def test_arbitrary_json(value: Any) -> None:
    _outcome(_dumps(value))
    if isinstance(value, dict):
        _outcome(value)


@_FUZZ
@given(st.sampled_from([V3_RAG, V3_TOOLS, V2_TOOLS, AGENT_EVAL, INFERENCE_ROW]).flatmap(_mutated))
def test_mutated_records(record: dict[str, Any]) -> None:
    assert isinstance(_outcome(record), EvalRecord | RecordError)
    assert isinstance(_outcome(_dumps(record)), EvalRecord | RecordError)


def _schema_accepts(doc: dict[str, Any]) -> bool:
    info = doc.get("info")
    v2 = isinstance(info, dict) and "request_id" in info and "trace_id" not in info
    try:
        (MlflowTraceV2 if v2 else MlflowTraceV3).model_validate(doc)
    except ValidationError:
        return False
    return True


def _parser_accepts(doc: dict[str, Any]) -> bool:
    try:
        parse_trace(doc, everything=False)
    except RecordError as err:
        assert err.field is not None or err.detail  # always says something
        return False
    return True


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([V3_RAG, V3_TOOLS, V2_TOOLS]).flatmap(_mutated))
def test_parser_and_schema_agree_on_what_is_valid(doc: dict[str, Any]) -> None:
    assert _parser_accepts(doc) == _schema_accepts(doc)


def test_real_traces_are_valid_under_both() -> None:
    for doc in (V3_RAG, V3_TOOLS, V2_TOOLS):
        assert _parser_accepts(doc) and _schema_accepts(doc)
