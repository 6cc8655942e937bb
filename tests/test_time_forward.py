"""Time only moves forward: a negative or non-finite duration, a root span that ends before it starts,
a negative token count and spans whose parents loop are set aside in every input format, the same way:
the value is null, the record names why (`warnings`), `tracejudge_record_anomalies_total{reason}`
counts it, and no latency percentile or histogram ever sees a negative or non-finite value."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import CollectorRegistry
from support.kafka import RunnerProcess, produce, read_topic, unique, wait_until

from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats import mlflow_wire, otlp
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.formats.mlflow import parse_trace
from tracejudge.schemas.record import ANOMALIES, EvalRecord, TokenUsage
from tracejudge.schemas.result import EvaluationResult, SourceRef

FIXTURES = Path(__file__).parent / "fixtures"
V3 = json.loads((FIXTURES / "examples" / "mlflow_trace_v3_example.json").read_text())
V2_ROW = json.loads((FIXTURES / "mlflow2" / "traces.jsonl").read_text().splitlines()[0])
TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]


def v3(**info: Any) -> dict[str, Any]:
    """The captured MLflow 3 trace with `info` keys replaced (None: removed)."""
    doc = copy.deepcopy(V3)
    for key, value in info.items():
        if value is None:
            doc["info"].pop(key, None)
        else:
            doc["info"][key] = value
    return doc


def both_readers(doc: dict[str, Any]) -> EvalRecord:
    """The record of an MLflow trace as `normalise()` reads its JSON (the msgspec reader when it is in
    `Trace.to_json()`'s shape, else the general one after Python's json, as for NaN), checked equal to
    the general reader's record of the decoded dict."""
    payload = json.dumps(doc).encode()  # Python's encoder: NaN and Infinity as Python producers write them
    record = normalise(payload)
    general = derive(parse_trace(json.loads(payload), everything=False))
    assert record == general
    return record


# -- MLflow 3, both readers ---------------------------------------------------------------------------


@pytest.mark.parametrize(("info", "reason", "fast"), [
    ({"execution_duration_ms": -5000}, "negative_duration", True),
    ({"execution_duration_ms": None, "execution_duration": "-5s"}, "negative_duration", True),
    ({"execution_duration_ms": float("inf")}, "non_finite", False),
    ({"execution_duration_ms": float("-inf")}, "non_finite", False),
    ({"execution_duration_ms": float("nan")}, "non_finite", False),
    ({"execution_duration_ms": None, "execution_duration": "infs"}, "non_finite", True),
    ({"execution_duration_ms": None, "execution_duration": "nans"}, "non_finite", True),
])
def test_an_mlflow_duration_that_cannot_be_is_null_and_named(info, reason, fast):
    doc = v3(**info)
    assert (mlflow_wire.derive_canonical_json(json.dumps(doc)) is not None) is fast
    record = both_readers(doc)
    assert record.latency_seconds is None
    assert record.warnings == [reason]
    # Nothing else is lost: the trace is still read.
    assert record.request and record.tokens == TokenUsage(42, 9, 51)


def test_an_mlflow_root_ending_before_it_starts_is_null_and_named():
    doc = v3(execution_duration_ms=None)
    root = doc["data"]["spans"][0]
    root["end_time_unix_nano"] = root["start_time_unix_nano"] - 1
    record = both_readers(doc)
    assert record.latency_seconds is None and record.warnings == ["end_before_start"]


def test_a_sound_mlflow_trace_has_no_warning():
    record = both_readers(v3())
    assert record.latency_seconds == 0.026 and record.warnings is None


@pytest.mark.parametrize("loop", ["two spans", "itself"])
def test_mlflow_spans_whose_parents_loop_are_named(loop):
    doc = v3()
    spans = doc["data"]["spans"]
    spans[0]["parent_span_id"] = spans[1]["span_id"] if loop == "two spans" else spans[0]["span_id"]
    record = both_readers(doc)
    assert record.warnings == ["parent_cycle"]
    assert record.request is None and record.root_span_id is None


def test_mlflow_spans_without_a_root_but_no_loop_are_not_called_a_cycle():
    doc = v3()
    spans = doc["data"]["spans"]
    spans[0]["parent_span_id"] = "AAAAAAAAAAE="  # a parent this trace does not hold: part of a trace
    assert both_readers(doc).warnings is None


def test_negative_mlflow_token_usage_is_null_and_named():
    doc = v3()
    doc["info"]["trace_metadata"]["mlflow.trace.tokenUsage"] = json.dumps(
        {"input_tokens": -42, "output_tokens": 9, "total_tokens": -33})
    record = both_readers(doc)
    assert record.tokens is None and record.warnings == ["negative_tokens"]


def test_several_reasons_are_each_named_once():
    doc = v3(execution_duration_ms=-1)
    doc["info"]["trace_metadata"]["mlflow.trace.tokenUsage"] = json.dumps({"input_tokens": -1})
    assert both_readers(doc).warnings == ["negative_duration", "negative_tokens"]


@pytest.mark.parametrize(("where", "field", "value"), [
    ("info", "request_time", float("inf")),
    ("span", "start_time_unix_nano", float("inf")),
    ("span", "end_time_unix_nano", float("-inf")),
    ("span", "start_time_unix_nano", float("nan")),
])
def test_a_non_finite_time_is_reported_as_non_finite_not_as_null(where, field, value):
    doc = v3()
    (doc["info"] if where == "info" else doc["data"]["spans"][1])[field] = value
    with pytest.raises(RecordError) as caught:
        normalise(json.dumps(doc).encode())
    err = caught.value
    assert err.field == (f"info.{field}" if where == "info" else f"data.spans[1].{field}")
    assert "non-finite" in err.detail and "null" not in err.detail
    assert ("NaN" if value != value else "Infinity") in err.detail


# -- MLflow 2 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "reason"), [(-6, "negative_duration"), (float("nan"), "non_finite")])
def test_an_mlflow2_duration_that_cannot_be_is_null_and_named(value, reason):
    doc = json.loads(V2_ROW["trace"])
    doc["info"]["execution_time_ms"] = value
    record = both_readers(doc)
    assert record.source_format == "mlflow_v2"
    assert record.latency_seconds is None and record.warnings == [reason]


# -- OTLP, JSON and protobuf ----------------------------------------------------------------------------

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
ROOT, CHILD = "b7ad6b7169203331", "c8be7c8270314442"


def otlp_json(spans: list[dict[str, Any]]) -> dict[str, Any]:
    return {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name",
                                                             "value": {"stringValue": "shop"}}]},
                               "scopeSpans": [{"spans": spans}]}]}


def otlp_span(span_id: str, start: int, end: int, parent: str | None = None) -> dict[str, Any]:
    span = {"traceId": TRACE_ID, "spanId": span_id, "name": f"span {span_id[:4]}",
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(end),
            "attributes": [{"key": "openinference.span.kind", "value": {"stringValue": "AGENT"}},
                           {"key": "input.value", "value": {"stringValue": "what is the refund window?"}}]}
    if parent:
        span["parentSpanId"] = parent
    return span


def otlp_proto(doc: dict[str, Any]) -> bytes:
    """The same spans as OTLP protobuf (ids as bytes)."""
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "shop"
    scope = rs.scope_spans.add()
    for sp in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        span = scope.spans.add(trace_id=bytes.fromhex(sp["traceId"]), span_id=bytes.fromhex(sp["spanId"]),
                               name=sp["name"], start_time_unix_nano=int(sp["startTimeUnixNano"]),
                               end_time_unix_nano=int(sp["endTimeUnixNano"]))
        if "parentSpanId" in sp:
            span.parent_span_id = bytes.fromhex(sp["parentSpanId"])
        for kv in sp["attributes"]:
            span.attributes.add(key=kv["key"]).value.string_value = kv["value"]["stringValue"]
    return request.SerializeToString()


def otlp_records(doc: dict[str, Any]) -> list[EvalRecord]:
    """The record of the trace from its OTLP/JSON and its OTLP protobuf encoding."""
    out = []
    for fmt, groups in (("otlp_json", otlp.decode_json(json.dumps(doc))),
                        ("otlp_proto", otlp.decode_proto(otlp_proto(doc)))):
        (group,) = groups
        trace = otlp.build_trace(group.trace_id, group.spans, source_format=fmt, app=group.service)
        out.append(derive(trace))
    return out


def test_an_otlp_root_ending_before_it_starts_is_null_and_named():
    doc = otlp_json([otlp_span(ROOT, 2_000_000_000, 1_000_000_000),
                     otlp_span(CHILD, 1_100_000_000, 1_200_000_000, ROOT)])
    for record in otlp_records(doc):
        assert record.latency_seconds is None and record.warnings == ["end_before_start"]
        assert record.request == "what is the refund window?"  # the rest is read


def test_a_sound_otlp_root_has_its_latency_and_no_warning():
    doc = otlp_json([otlp_span(ROOT, 1_000_000_000, 3_500_000_000)])
    for record in otlp_records(doc):
        assert record.latency_seconds == 2.5 and record.warnings is None


@pytest.mark.parametrize("loop", ["two spans", "itself"])
def test_otlp_spans_whose_parents_loop_are_named(loop):
    spans = ([otlp_span(ROOT, 1, 2, CHILD), otlp_span(CHILD, 1, 2, ROOT)] if loop == "two spans"
             else [otlp_span(ROOT, 1, 2, ROOT)])
    for record in otlp_records(otlp_json(spans)):
        assert record.warnings == ["parent_cycle"] and record.latency_seconds is None


def test_a_non_finite_otlp_time_in_a_decoded_document_is_reported_as_non_finite():
    span = otlp_span(ROOT, 1, 2)
    span["startTimeUnixNano"] = float("inf")
    with pytest.raises(RecordError) as caught:
        otlp.decode_json(otlp_json([span]))
    assert caught.value.field.endswith("startTimeUnixNano") and "non-finite" in caught.value.detail


# -- inference-log and agent-evaluation rows ------------------------------------------------------------

SERVING_ROW = {"databricks_request_id": "d-1", "status_code": 200, "served_entity_id": "chat",
               "request": {"messages": [{"role": "user", "content": "q"}]},
               "response": {"choices": [{"message": {"role": "assistant", "content": "a"}}],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 2}}}


@pytest.mark.parametrize(("key", "value", "reason"), [
    ("execution_duration_ms", -5000, "negative_duration"),
    ("execution_time_ms", -1, "negative_duration"),
    ("execution_duration_ms", float("nan"), "non_finite"),
    ("execution_duration_ms", float("inf"), "non_finite"),
])
def test_an_inference_log_duration_that_cannot_be_is_null_and_named(key, value, reason):
    for payload in ({**SERVING_ROW, key: value}, json.dumps({**SERVING_ROW, key: value}).encode()):
        record = normalise(payload)
        assert record.source_format == "inference_log"
        assert record.latency_seconds is None and record.warnings == [reason]
        assert record.response == "a"


def test_negative_inference_log_usage_is_null_and_named():
    row = copy.deepcopy(SERVING_ROW)
    row["response"]["usage"]["completion_tokens"] = -2
    record = normalise(row)
    assert record.tokens is None and record.model_usage is None and record.warnings == ["negative_tokens"]


def test_an_inference_log_rows_trace_names_its_own_reason():
    trace = v3(execution_duration_ms=None)
    root = trace["data"]["spans"][0]
    root["end_time_unix_nano"] = root["start_time_unix_nano"] - 5
    row = {**SERVING_ROW, "execution_duration_ms": -3}
    row["response"] = {**row["response"], "databricks_output": {"trace": trace}}
    record = normalise(row)
    assert record.latency_seconds is None
    assert record.warnings == ["negative_duration", "end_before_start"]


def test_an_agent_eval_rows_trace_carries_its_reason():
    for trace in (v3(execution_duration_ms=-5000), json.dumps(v3(execution_duration_ms=-5000))):
        record = normalise({"request": "q", "response": "a", "trace": trace})
        assert record.source_format == "agent_eval"
        assert record.latency_seconds is None and record.warnings == ["negative_duration"]


def test_a_stated_null_and_a_real_null_differ_only_by_the_warning():
    stated = normalise(v3(execution_duration_ms=-5000))
    unstated = normalise(v3(execution_duration_ms=None, execution_duration=None))
    # No stated duration: the root's own timing gives the latency; a bad stated one is set aside.
    assert unstated.warnings is None and unstated.latency_seconds is not None
    assert stated.latency_seconds is None


# -- the result line, Prometheus -----------------------------------------------------------------------


def test_the_result_line_names_the_reason():
    record = normalise(v3(execution_duration_ms=-5000))
    line = orjson.loads(EvaluationResult(record=record, source=SourceRef(format="mlflow")).to_json())
    assert line["latency_seconds"] is None and line["warnings"] == ["negative_duration"]
    assert EvaluationResult.from_dict(line).record.warnings == ["negative_duration"]
    sound = EvaluationResult(record=normalise(v3()), source=SourceRef(format="mlflow"))
    assert orjson.loads(sound.to_json())["warnings"] is None


def test_the_exporter_counts_each_reason_and_never_observes_an_impossible_latency():
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry)
    for duration in (-5000, float("nan"), 26):
        record = normalise(v3(execution_duration_ms=duration))
        exporter.export(EvaluationResult(record=record, source=SourceRef(format="mlflow")))
    # Records built by hand (the Python API, a custom format handler) are guarded too.
    for latency in (-5.0, math.inf, math.nan):
        hand = EvalRecord(request_id="h", app="hand", latency_seconds=latency, tokens=TokenUsage(-3, -1, -4),
                          warnings=["negative_duration", "free text never becomes a label"])
        exporter.export(EvaluationResult(record=hand, source=SourceRef(format="agent_eval")))

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert sample("tracejudge_record_anomalies_total", reason="negative_duration") == 4
    assert sample("tracejudge_record_anomalies_total", reason="non_finite") == 1
    reasons = {s.labels["reason"] for m in registry.collect() if m.name == "tracejudge_record_anomalies"
               for s in m.samples}
    assert reasons <= set(ANOMALIES)
    app = exporter.apps(normalise(v3()).app)
    assert sample("tracejudge_trace_latency_seconds_count", app=app) == 1
    assert sample("tracejudge_trace_latency_seconds_sum", app=app) == 0.026
    assert sample("tracejudge_trace_latency_seconds_count", app="hand") == 0
    assert sample("tracejudge_trace_latency_seconds_sum", app="hand") == 0
    assert sample("tracejudge_tokens_total", app="hand", direction="input") == 0
    assert sample("tracejudge_traces_total", app="hand", status="ok") == 3


# -- the real `tracejudge eval` --------------------------------------------------------------------------


def test_tracejudge_eval_never_prints_a_negative_percentile(tmp_path):
    end_before_start = v3(execution_duration_ms=None)
    root = end_before_start["data"]["spans"][0]
    root["end_time_unix_nano"] = root["start_time_unix_nano"] - 10
    lines = [v3(execution_duration_ms=-5000), v3(execution_duration_ms=-7000),
             v3(execution_duration_ms=float("inf")), end_before_start,
             {**SERVING_ROW, "execution_duration_ms": -900},
             otlp_json([otlp_span(ROOT, 2_000_000_000, 1_000_000_000)]), v3()]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--output", str(out)], capture_output=True,
                          timeout=120, check=False)
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    written = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    # The captured trace is a turn of a session: its session line follows the results.
    sessions = [r for r in written if r.get("kind") == "session"]
    assert sessions and all(v is None or v >= 0 for s in sessions for v in s["metrics"].values())
    # OTLP spans are assembled into their trace before they are evaluated: results come in line order
    # but for that one.
    results = sorted((r for r in written if r.get("kind") != "session"), key=lambda r: r["source"]["line"])
    assert len(results) == len(lines)
    assert all(r["latency_seconds"] is None or r["latency_seconds"] >= 0 for r in results)
    assert [r["warnings"] for r in results] == [["negative_duration"], ["negative_duration"], ["non_finite"],
                                                ["end_before_start"], ["negative_duration"],
                                                ["end_before_start"], None]
    assert all(r["metrics"]["latency_seconds"] is None for r in results[:-1])
    # Only the sound trace's latency is summarised; the set-aside values are counted beside it.
    assert re.search(r"latency p50 +0\.026 s\n", stderr), stderr
    assert re.search(r"latency p95 +0\.026 s\n", stderr), stderr
    assert not re.search(r"latency p\d+ +-", stderr)
    assert re.search(r"values set aside +end_before_start 2, negative_duration 3, non_finite 1\n", stderr), \
        stderr


# -- the stream: the real `tracejudge run` on a real broker ---------------------------------------------


def test_the_stream_publishes_the_reason_and_counts_it(broker):
    bs = broker.bootstrap_servers
    topic, results, group = unique("time"), unique("results"), unique("group")
    payloads = [json.dumps(v3(execution_duration_ms=-5000)).encode(),
                json.dumps(v3(execution_duration_ms=float("nan"))).encode(),
                json.dumps(v3()).encode()]
    produce(bs, topic, payloads)
    runner = RunnerProcess(bs, "--topic", f"{topic}:mlflow", "--group-id", group,
                           "--results-topic", results).wait_ready()
    try:
        out = [orjson.loads(r.value) for r in read_topic(bs, results, at_least=len(payloads), timeout=60)]
        wait_until(lambda: runner.metric("tracejudge_records_total", outcome="ok") >= len(payloads), 30)
        assert runner.metric("tracejudge_record_anomalies_total", reason="negative_duration") == 1
        assert runner.metric("tracejudge_record_anomalies_total", reason="non_finite") == 1
        assert runner.metric("tracejudge_trace_latency_seconds_count") == 1
        assert runner.metric("tracejudge_trace_latency_seconds_sum") == 0.026
    finally:
        runner.signal(2)
        runner.finish()
    assert sorted(map(str, (r["warnings"] for r in out))) == sorted(map(str, (["negative_duration"],
                                                                                ["non_finite"], None)))
    assert all(r["latency_seconds"] in (None, 0.026) for r in out)
