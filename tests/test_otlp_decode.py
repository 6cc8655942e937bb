"""OTLP decoding: protobuf and OTLP/JSON records as the Collector's Kafka exporter writes them."""

from __future__ import annotations

import json

import pytest
from google.protobuf.json_format import Parse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support.otel_producers import (
    Producer,
    encode,
    genai_trace,
    interleave,
    openinference_trace,
    to_otlp_json,
)

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats import otlp
from tracejudge.schemas.trace import SpanKind, SpanStatus


@pytest.fixture(scope="module")
def mixed_request():
    """One export request mixing two services and three traces, spans interleaved."""
    a, b = Producer("geo-agent"), Producer("docs-agent")
    rec1 = genai_trace(a.tracer, "What is the capital of France?", "Paris.")
    rec2 = genai_trace(a.tracer, "Population of Paris?", "2.1M.", tool_fails=True)
    spans_a = a.finished()
    rec3 = openinference_trace(b.tracer, "What is MLflow?", "An MLOps platform.")
    spans_b = b.finished()
    sdk_spans = interleave(spans_a, spans_b)
    return encode(sdk_spans), sdk_spans, (rec1, rec2, rec3)


def test_proto_and_otlp_json_decode_to_the_same_spans(mixed_request):
    request, sdk_spans, recs = mixed_request
    fmt_p, from_proto = otlp.decode(request.SerializeToString())
    fmt_j, from_json = otlp.decode(to_otlp_json(request))
    assert (fmt_p, fmt_j) == ("otlp_proto", "otlp_json")
    assert from_proto == from_json
    by_trace = {}
    for group in from_proto:
        by_trace.setdefault(group.trace_id, set()).add(group.service)
        for span in group.spans:
            assert len(span.span_id) == 16
    # Groups are per (resource, trace): each trace here comes from one service.
    assert by_trace == {recs[0].trace_id: {"geo-agent"}, recs[1].trace_id: {"geo-agent"},
                        recs[2].trace_id: {"docs-agent"}}
    assert sum(len(g.spans) for g in from_proto) == len(sdk_spans)
    sdk_ids = {format(s.context.span_id, "016x") for s in sdk_spans}
    assert {s.span_id for g in from_proto for s in g.spans} == sdk_ids


def test_hex_ids_are_not_read_as_base64(mixed_request):
    """The trap: protobuf's JSON parser reads a 32-char hex traceId as base64 and gets 24 bytes."""
    request, _, recs = mixed_request
    otlp_json = to_otlp_json(request)
    first_span = json.loads(otlp_json)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(first_span["traceId"]) == 32 and int(first_span["traceId"], 16)
    assert isinstance(first_span["kind"], int) and isinstance(first_span["startTimeUnixNano"], str)

    naive = Parse(otlp_json, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    naive_id = naive.resource_spans[0].scope_spans[0].spans[0].trace_id
    assert len(naive_id) == 24  # silently wrong: this is what a plain protobuf JSON parse gives

    groups = otlp.decode_json(otlp_json)
    assert {g.trace_id for g in groups} == {r.trace_id for r in recs}
    expected = request.resource_spans[0].scope_spans[0].spans[0]
    decoded = next(s for g in groups for s in g.spans if s.span_id == expected.span_id.hex())
    assert decoded.parent_id == (expected.parent_span_id.hex() or None)


def test_protobuf_canonical_json_with_base64_ids_and_enum_names_is_accepted(mixed_request):
    from google.protobuf.json_format import MessageToJson

    request, _, _ = mixed_request
    canonical = MessageToJson(request)  # base64 ids, "SPAN_KIND_CLIENT", "STATUS_CODE_ERROR"
    assert "STATUS_CODE_ERROR" in canonical
    snake = MessageToJson(request, preserving_proto_field_name=True)  # trace_id, start_time_unix_nano
    assert otlp.decode_json(canonical) == otlp.decode_proto(request.SerializeToString())
    assert otlp.decode_json(snake) == otlp.decode_proto(request.SerializeToString())


def test_attribute_values_of_every_type_and_structured_messages():
    producer = Producer("svc")
    rec = genai_trace(producer.tracer, "Q?", "A.", structured=True)
    with producer.tracer.start_as_current_span("typed", attributes={
            "gen_ai.operation.name": "x", "s": "v", "i": 2**62, "d": 0.5, "b": True, "arr": [1, 2],
            "by": b"\x00\xff"}):
        pass
    request = encode(producer.finished())
    for payload in (request.SerializeToString(), to_otlp_json(request)):
        _, groups = otlp.decode(payload)
        spans = {s.name: s for g in groups for s in g.spans}
        typed = spans["typed"].attributes
        assert typed["i"] == 2**62 and typed["d"] == 0.5 and typed["b"] is True
        assert typed["arr"] == [1, 2] and typed["by"] == "AP8="
        chat = spans["chat gpt-4o"]
        # Structured (kvlist) message values become the same chat payload as JSON-string ones.
        assert chat.inputs["messages"][-1] == {"role": "user", "content": "Q?"}
        assert chat.outputs["choices"][0]["message"]["content"] == "A."
        assert {g.trace_id for g in groups} >= {rec.trace_id}


def test_status_error_type_and_exception_events():
    producer = Producer("svc")
    genai_trace(producer.tracer, "Q?", "A.", tool_fails=True)
    request = encode(producer.finished())
    spans = {s.name: s for g in otlp.decode_proto(request.SerializeToString()) for s in g.spans}
    tool = spans["execute_tool population"]
    assert tool.kind is SpanKind.TOOL and tool.status is SpanStatus.ERROR
    assert tool.status_message == "population service timed out"
    assert spans["chat gpt-4o"].status is SpanStatus.UNSET


def test_detect_format():
    assert otlp.detect_format(b' \t{"resourceSpans": []}') == "otlp_json"
    assert otlp.detect_format(b"\x0a\x02") == "otlp_proto"
    assert otlp.detect_format('{"resourceSpans": []}') == "otlp_json"
    assert otlp.is_otlp_json({"resourceSpans": []}) and not otlp.is_otlp_json({"info": {}})
    assert otlp.looks_like_otlp_json(b' {"resourceSpans": [{"resource": {}}]}')
    assert otlp.looks_like_otlp_json('{ "resource_spans": []}')
    assert not otlp.looks_like_otlp_json(b'{"info": {"trace_id": "tr-1"}, "resourceSpans": []}')
    assert not otlp.looks_like_otlp_json(b"\x0a\x02")
    # A newline before the JSON still decodes (detection falls back from protobuf to JSON).
    assert otlp.decode(b'\n{"resourceSpans": []}') == ("otlp_json", [])


def test_protobuf_starting_like_newline_brace_is_protobuf():
    """0x0A 0x7B: field 1 of 123 bytes. Whitespace-stripping detection would call it JSON."""
    producer = Producer("svc")
    with producer.tracer.start_as_current_span("s"):
        pass
    (span,) = producer.finished()
    request = encode([span])
    request.resource_spans[0].scope_spans[0].ClearField("scope")
    resource = request.resource_spans[0].resource
    del resource.attributes[:]
    pad = resource.attributes.add(key="pad")
    for n in range(200):
        pad.value.string_value = "x" * n
        if request.SerializeToString()[:2] == b"\x0a\x7b":
            break
    payload = request.SerializeToString()
    assert payload[:2] == b"\n{"
    fmt, groups = otlp.decode(payload)
    assert fmt == "otlp_proto" and groups[0].spans[0].name == "s"


def _one_span_json(**span_fields):
    span = {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174", "name": "x",
            "startTimeUnixNano": "1", "endTimeUnixNano": "2"}
    span.update(span_fields)
    return json.dumps({"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": [span]}]}]})


@pytest.mark.parametrize(("fields", "path", "reason_text"), [
    ({"traceId": "not-hex"}, "resourceSpans[0].scopeSpans[0].spans[0].traceId", "32 hex characters"),
    ({"traceId": "0" * 32}, "resourceSpans[0].scopeSpans[0].spans[0].traceId", "all zeros"),
    ({"spanId": None}, "resourceSpans[0].scopeSpans[0].spans[0].spanId", "missing"),
    ({"parentSpanId": "abc"}, "resourceSpans[0].scopeSpans[0].spans[0].parentSpanId", "16 hex"),
    ({"startTimeUnixNano": "soon"}, "resourceSpans[0].scopeSpans[0].spans[0].startTimeUnixNano",
     "integer"),
    ({"attributes": {"k": "v"}}, "resourceSpans[0].scopeSpans[0].spans[0].attributes", "array"),
    ({"attributes": [{"key": "k", "value": {"boolValue": "yes"}}]},
     "resourceSpans[0].scopeSpans[0].spans[0].attributes[0].value", "true/false"),
    ({"status": {"code": 7}}, "resourceSpans[0].scopeSpans[0].spans[0].status.code", "status code"),
])
def test_bad_otlp_json_names_the_field(fields, path, reason_text):
    with pytest.raises(RecordError) as info:
        otlp.decode_json(_one_span_json(**fields))
    assert info.value.reason == errors.INVALID_RECORD
    assert info.value.field == path
    assert reason_text in info.value.detail


def test_bad_records_are_record_errors():
    with pytest.raises(RecordError) as info:
        otlp.decode(b'{"resourceSpans": [', None)
    assert info.value.reason == errors.INVALID_JSON
    with pytest.raises(RecordError) as info:
        otlp.decode_json('{"spans": []}')
    assert info.value.field == "resourceSpans"
    with pytest.raises(RecordError) as info:
        otlp.decode(b'{"resourceSpans": []}', "otlp_proto")  # JSON on a topic configured as protobuf
    assert info.value.reason == errors.INVALID_PROTOBUF and "otlp_json" in info.value.detail
    with pytest.raises(RecordError) as info:
        otlp.decode(b"\xff\xff\xff\xff", "otlp_proto")
    assert info.value.reason == errors.INVALID_PROTOBUF


def test_bad_protobuf_span_ids_name_the_span():
    producer = Producer("svc")
    genai_trace(producer.tracer, "Q?", "A.")
    request = encode(producer.finished())
    request.resource_spans[0].scope_spans[0].spans[2].trace_id = b"\x01" * 12
    with pytest.raises(RecordError) as info:
        otlp.decode_proto(request.SerializeToString())
    assert info.value.field == "resourceSpans[0].scopeSpans[0].spans[2].traceId"
    assert "16 bytes, got 12" in info.value.detail


def test_unknown_service_placeholder_is_no_app():
    producer = Producer(None)  # the SDK's default resource: service.name = "unknown_service"
    genai_trace(producer.tracer, "Q?", "A.")
    request = encode(producer.finished())
    attrs = {kv.key: kv.value.string_value for kv in request.resource_spans[0].resource.attributes}
    assert attrs["service.name"].startswith("unknown_service")
    assert {g.service for g in otlp.decode_proto(request.SerializeToString())} == {None}
