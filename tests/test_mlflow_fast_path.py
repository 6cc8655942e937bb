"""The MLflow parser's fast paths for `Trace.to_json()`'s exact shape read what the general span
reader reads.

`tracejudge.schemas.mlflow` reads the spans of an MLflow 3 trace with a tight loop that accepts only
the exact shape MLflow writes and hands anything else to the general reader (`_span`). Both must
give the same `Trace` (or the same error) for every input: checked on real traces from the `mlflow`
package, as written and mutated at random where the two readers' checks differ (ids, times, status,
attributes, events, missing keys).

`normalise()` reads JSON bytes in that shape with msgspec (`parser.parse_canonical_json`) before
any of this: its record must be the general reader's record, and it must give up (None) on every
input the general reader rejects, so that the error is the general reader's.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import mlflow_apps

from tracejudge.schemas import errors
from tracejudge.schemas import mlflow as parser
from tracejudge.schemas.derive import derive
from tracejudge.schemas.detect import normalise
from tracejudge.schemas.errors import RecordError

TRACES = {name: json.loads(text) for name, text in mlflow_apps.run_all().items()}
# Traces with every kind of span the fast path treats specially: retrievers (nested too), tools,
# chat spans with usage, a failed root with an exception event.
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


def _outcome(doc: dict[str, Any], everything: bool, canonical: bool) -> Any:
    try:
        return parser._parse(copy.deepcopy(doc), None, everything, canonical=canonical)
    except Exception as exc:  # the exception itself is what is compared
        return (type(exc), str(exc))


@pytest.mark.parametrize("name", sorted(TRACES))
def test_real_traces_read_alike(name: str) -> None:
    for everything in (False, True):
        fast, general = (parser._parse(TRACES[name], None, everything, canonical=c) for c in (True, False))
        assert fast == general
        assert derive(fast) == derive(general)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated(), st.booleans())
def test_mutated_traces_read_alike(doc: dict[str, Any], everything: bool) -> None:
    fast, general = _outcome(doc, everything, True), _outcome(doc, everything, False)
    assert fast == general
    if not isinstance(fast, tuple):
        assert derive(fast) == derive(general)


def _general_record(doc: dict[str, Any]) -> Any:
    try:
        return derive(parser._parse(copy.deepcopy(doc), None, everything=False, canonical=False))
    except Exception as exc:
        return (type(exc), str(exc))


@pytest.mark.parametrize("name", sorted(TRACES))
def test_real_traces_read_from_bytes_alike(name: str) -> None:
    payload = orjson.dumps(TRACES[name])
    trace = parser.parse_canonical_json(payload)
    assert trace is not None  # the shape MLflow writes is read by the msgspec path
    assert derive(trace) == _general_record(TRACES[name]) == normalise(payload)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated())
def test_mutated_traces_read_from_bytes_alike(doc: dict[str, Any]) -> None:
    general = _general_record(doc)
    trace = parser.parse_canonical_json(orjson.dumps(doc))
    if isinstance(general, tuple):
        assert trace is None  # the general path names what is wrong
    elif trace is not None:
        assert derive(trace) == general


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


def test_bytes_left_unread_are_still_checked() -> None:
    # msgspec does not look inside the attributes it skips; the general path rejects these.
    with pytest.raises(RecordError) as bad_utf8:
        normalise(_with_span_attribute(b'"\xff"'))
    assert bad_utf8.value.reason == errors.NOT_UTF8
    with pytest.raises(RecordError) as too_deep:
        normalise(_with_span_attribute(b"[" * 5000 + b"]" * 5000))
    assert too_deep.value.reason == errors.INVALID_JSON
