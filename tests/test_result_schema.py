"""The result line's shape: the schema version, the record's fields at the top level, then the MLflow
trace id, source, metrics, assessments; its version rule, its round trip, and `mlflow_trace_id` for
every source format, from records the real parsers made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import orjson
import pytest

from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.record import Document, EvalRecord, TokenUsage, ToolCall
from tracejudge.schemas.result import (
    SCHEMA_VERSION,
    Assessment,
    EvaluationResult,
    JudgeIdentity,
    SourceRef,
    mlflow_trace_id,
    schema_version_of,
)

FIXTURES = Path(__file__).parent / "fixtures"
ASSESSMENT_FIELDS = ["name", "value", "score", "passed", "rationale", "error", "skipped", "source",
                     "duration_seconds", "judge", "span_id", "input_tokens", "output_tokens",
                     "sample_rate", "shadow_of", "cost_usd", "redacted", "threshold"]


def test_to_json_is_the_documented_flat_shape():
    result = EvaluationResult(
        record=EvalRecord(request_id="r", trace_id="t", request="q", response="a", tokens=TokenUsage(1, 2, 3),
                          retrieved_context=[Document("c", "u")], trajectory=[ToolCall("s", {"x": [1]})],
                          tags={"env": "prod"}),
        source=SourceRef(format="mlflow_v3", topic="traces", partition=2, offset=41),
        metrics={"latency_seconds": None, "retrieved_documents": 1.0},
        metric_errors={"mine": "ValueError: no"},
        assessments=[Assessment("groundedness", value="yes", score=1.0, passed=True, source="heuristic")],
    )
    out = orjson.loads(result.to_json())
    assert out == result.to_dict()
    assert list(out) == list(result.to_dict())
    record_fields = list(EvalRecord.__struct_fields__)
    assert list(out) == ["schema_version", *record_fields, "mlflow_trace_id", "source", "metrics",
                         "metric_errors", "assessments"]
    assert out["schema_version"] == SCHEMA_VERSION == 6
    assert out["session_id"] is None and out["user_id"] is None
    assert out["mlflow_trace_id"] is None  # "t" came from no trace format
    assert out["source"]["offset"] == 41 and out["tokens"] == {"input": 1, "output": 2, "total": 3,
                                                                    "cached_input": None}
    assert list(out["assessments"][0]) == ASSESSMENT_FIELDS
    assert out["assessments"][0]["skipped"] is None
    assert out["assessments"][0]["judge"] is None and out["assessments"][0]["input_tokens"] is None
    assert result.key == "t"
    assert result.assessment("groundedness").passed and result.passed


def test_to_json_writes_what_a_payload_or_custom_metric_can_hold():
    # Payloads are decoded JSON (integers of any size) and custom code may put other objects in a
    # record: the result line is still written, odd objects as their str().
    class Ticket:
        def __str__(self) -> str:
            return "ticket-7"

    record = EvalRecord(request_id="r", trajectory=[ToolCall("s", {"n": 2**70, "ref": Ticket()})])
    result = EvaluationResult(record=record, source=SourceRef(format="agent_eval"))
    out = json.loads(result.to_json())
    assert out["trajectory"] == [{"tool_name": "s", "tool_input": {"n": 2**70, "ref": "ticket-7"},
                                  "error": None}]


def full_result() -> EvaluationResult:
    trace_id = "fbc0f5ad6ca73f8513acf8d6068d4397"
    return EvaluationResult(
        record=EvalRecord(request_id="client-1", trace_id=trace_id, app="shop", source_format="otlp_proto",
                          request="q", response="a", retrieved_context=[Document("c", "kb://1")],
                          trajectory=[ToolCall("search", {"q": "x"})], latency_seconds=1.25, failed=False,
                          tokens=TokenUsage(10, 5, 15), expected_facts=["f"], timestamp=1795306935.9,
                          tags={"env": "prod"}, complete=False, session_id="conv-7", user_id="u-3"),
        source=SourceRef(format="otlp_proto", topic="tracejudge-traces", partition=3, offset=17),
        metrics={"latency_seconds": 1.25, "retrieved_documents": 1.0, "document_recall": None},
        metric_errors={"mine": "ValueError: no"},
        assessments=[
            Assessment("groundedness", value="no", score=0.5, passed=False, rationale="1/2 supported",
                       source="llm:gpt-4o-mini", duration_seconds=0.25,
                       judge=JudgeIdentity("default", "gpt-4o-mini", "0123456789ab"), input_tokens=812,
                       output_tokens=64, sample_rate=0.25),
            Assessment("relevance_to_query", value=0.75, score=0.75, passed=True, rationale="3/4 words",
                       source="heuristic", duration_seconds=0.0001,
                       judge=JudgeIdentity(None, None, "ba9876543210")),
            Assessment("safety", skipped="not_sampled", source="llm:gpt-4o-mini",
                       judge=JudgeIdentity("default", "gpt-4o-mini", "aaaaaaaaaaaa")),
            Assessment("correctness", error="http_5xx: 503", source="llm:gpt-4o-mini",
                       judge=JudgeIdentity("default", "gpt-4o-mini", "bbbbbbbbbbbb")),
        ],
    )


def test_a_results_line_round_trips():
    result = full_result()
    line = result.to_json()
    decoded = orjson.loads(line)
    assert decoded["mlflow_trace_id"] == "tr-fbc0f5ad6ca73f8513acf8d6068d4397"
    assert decoded["session_id"] == "conv-7" and decoded["user_id"] == "u-3"
    # A turn of a session is keyed by its session id, so every turn lands on one partition.
    assert result.key == "conv-7"
    assert decoded["assessments"][0]["judge"] == {"endpoint": "default", "model": "gpt-4o-mini",
                                                  "version": "0123456789ab"}
    assert decoded["assessments"][1]["judge"] == {"endpoint": None, "model": None, "version": "ba9876543210"}
    again = EvaluationResult.from_dict(decoded)
    assert again == result
    assert again.to_json() == line
    # Readers ignore fields they do not know (a later minor addition, or a producer's own extras).
    decoded["added_later"] = {"x": 1}
    decoded["assessments"][0]["added_later"] = 1
    decoded["assessments"][0]["judge"]["added_later"] = 1
    assert EvaluationResult.from_dict(decoded).to_json() == line


def test_the_version_rule():
    line = orjson.loads(full_result().to_json())
    assert schema_version_of(line) == 6
    # A version 3 line (no labels, cost, shadow or backfill fields) still reads, with those None.
    v3 = {k: v for k, v in line.items() if k not in ("human_labels", "model_usage", "cost", "backfill")}
    v3["schema_version"] = 3
    v3["assessments"] = [{k: v for k, v in a.items() if k not in ("shadow_of", "cost_usd", "redacted")}
                         for a in v3["assessments"]]
    old3 = EvaluationResult.from_dict(v3)
    assert old3.record.cost is None and old3.record.human_labels is None and old3.backfill is None
    assert old3.assessments == full_result().assessments
    # A version 2 line (no session or user id) still reads: both None, keyed by trace id again.
    v2 = {k: v for k, v in line.items() if k not in ("session_id", "user_id")}
    v2["schema_version"] = 2
    old2 = EvaluationResult.from_dict(v2)
    assert old2.record.session_id is None and old2.record.user_id is None
    assert old2.key == "fbc0f5ad6ca73f8513acf8d6068d4397"
    assert old2.assessments == full_result().assessments
    # A line without `schema_version` is version 1 (written before this field existed) and still reads.
    v1 = {k: v for k, v in line.items()
          if k not in ("schema_version", "mlflow_trace_id", "session_id", "user_id")}
    v1["assessments"] = [{k: v for k, v in a.items()
                          if k not in ("judge", "span_id", "input_tokens", "output_tokens", "sample_rate")}
                         for a in v1["assessments"]]
    assert schema_version_of(v1) == 1
    old = EvaluationResult.from_dict(v1)
    assert old.assessments[0].judge is None and old.assessments[0].input_tokens is None
    assert old.mlflow_trace_id == "tr-fbc0f5ad6ca73f8513acf8d6068d4397"  # recomputed from the record
    # A newer version than this reader knows is refused, not half-read.
    with pytest.raises(ValueError, match="schema_version 7 is newer than this reader's 6"):
        EvaluationResult.from_dict({**line, "schema_version": 7})
    for bad in ("4", 4.0, True, 0, None):
        with pytest.raises(ValueError, match="schema_version must be a positive integer"):
            schema_version_of({"schema_version": bad})
    with pytest.raises(msgspec.ValidationError):
        EvaluationResult.from_dict({**line, "assessments": [{"value": "yes"}]})  # no name


def _mlflow_v3_trace() -> str:
    return (FIXTURES / "examples" / "mlflow_trace_v3_example.json").read_text()


def _mlflow_v2_trace() -> str:
    return json.loads((FIXTURES / "mlflow2" / "traces.jsonl").read_text().splitlines()[0])["trace"]


def test_mlflow_trace_id_of_each_source_format():
    v3 = _mlflow_v3_trace()
    v2 = _mlflow_v2_trace()
    v2_request_id = json.loads(v2)["info"]["request_id"]
    assert json.loads(v3)["info"]["trace_id"] == "tr-fbc0f5ad6ca73f8513acf8d6068d4397"

    # MLflow 3: the trace's own id.
    assert mlflow_trace_id(normalise(v3)) == "tr-fbc0f5ad6ca73f8513acf8d6068d4397"
    # MLflow 2: its request id, which MLflow keeps as the trace id (not the spans' OTel trace id).
    record = normalise(v2)
    assert record.source_format == "mlflow_v2"
    assert mlflow_trace_id(record) == v2_request_id == "02a92a6654a74f0dbaf5e8b93f17e290"
    # Agent-evaluation rows: the id of the trace they carry; none without one.
    assert mlflow_trace_id(normalise({"request": "q", "response": "a"})) is None
    with_trace = normalise({"request": "q", "trace": json.loads(v3)})
    assert with_trace.source_format == "agent_eval"
    assert mlflow_trace_id(with_trace) == "tr-fbc0f5ad6ca73f8513acf8d6068d4397"
    # Inference-log rows likewise (the trace sits in the response's `databricks_output`).
    row = {"databricks_request_id": "d-1", "status_code": 200, "request": {"messages": []},
           "response": {"choices": [{"message": {"role": "assistant", "content": "hi"}}]}}
    assert mlflow_trace_id(normalise(row)) is None
    row["response"]["databricks_output"] = {"trace": json.loads(v3)}
    served = normalise(row)
    assert served.source_format == "inference_log" and served.request_id == "d-1"
    assert mlflow_trace_id(served) == "tr-fbc0f5ad6ca73f8513acf8d6068d4397"
    # OTLP spans: "tr-" + the 32-hex OTel trace id, as MLflow's OTLP ingest stores them.
    for fmt in ("otlp_proto", "otlp_json"):
        otlp = EvalRecord(trace_id="0af7651916cd43dd8448eb211c80319c", source_format=fmt)
        assert mlflow_trace_id(otlp) == "tr-0af7651916cd43dd8448eb211c80319c"
    # A record from no known trace format, or without a trace id: none.
    assert mlflow_trace_id(EvalRecord(trace_id="abc", source_format="unknown")) is None
    assert mlflow_trace_id(EvalRecord(source_format="mlflow_v3")) is None


def test_eval_writes_version_3_lines_with_the_mlflow_trace_id_of_each_format(tmp_path):
    """`tracejudge eval` on one file mixing every format, heuristic judges on: each line says version 3,
    its MLflow trace id, and who judged it."""
    from support.mlflow_apps import run as run_app
    from support.otel_producers import Producer, genai_trace, kafka_messages

    producer = Producer("geo-agent")
    otel = genai_trace(producer.tracer, "What is the capital of France?", "Paris.")
    otlp_lines = [v.decode() for _, v in kafka_messages(producer.finished(), per_message=10, fmt="otlp_json")]
    mlflow3 = run_app("rag")
    mlflow3_id = json.loads(mlflow3)["info"]["trace_id"]
    v2 = _mlflow_v2_trace()
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join([
        *otlp_lines, mlflow3, v2,
        json.dumps({"request_id": "row-1", "request": "What is MLflow?", "response": "A platform."}),
    ]) + "\n")
    config = tmp_path / "tracejudge.yaml"
    config.write_text("judges:\n  builtin:\n    groundedness: {provider: heuristic}\n"
                      "    relevance_to_query: {provider: heuristic}\n")
    proc = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "eval", str(src),
                           "--config",
                           str(config), "--quiet"], capture_output=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    # Trace result lines only (a session's own result line, `"kind": "session"`, is another shape).
    lines = [x for x in map(orjson.loads, proc.stdout.splitlines()) if x.get("kind") != "session"]
    by_format = {x["source_format"]: x for x in lines}
    assert sorted(by_format) == ["agent_eval", "mlflow_v2", "mlflow_v3", "otlp_json"]
    assert all(x["schema_version"] == 6 for x in lines)
    # The OTel producer's root span states `session.id`; the others state no conversation, and
    # none states a user: nothing is guessed.
    assert {f: x["session_id"] for f, x in by_format.items()} == {
        "otlp_json": "sess-1", "mlflow_v3": None, "mlflow_v2": None, "agent_eval": None}
    assert all(x["user_id"] is None for x in lines)
    assert by_format["otlp_json"]["mlflow_trace_id"] == "tr-" + otel.trace_id
    assert by_format["mlflow_v3"]["mlflow_trace_id"] == mlflow3_id and mlflow3_id.startswith("tr-")
    assert by_format["mlflow_v2"]["mlflow_trace_id"] == json.loads(v2)["info"]["request_id"]
    assert by_format["agent_eval"]["mlflow_trace_id"] is None
    versions = set()
    for x in lines:
        for a in x["assessments"]:
            assert list(a) == ASSESSMENT_FIELDS
            assert a["judge"]["endpoint"] is None and a["judge"]["model"] is None
            assert a["span_id"] is None and a["input_tokens"] is None and a["output_tokens"] is None
            assert a["sample_rate"] == 1.0
            versions.add((a["name"], a["judge"]["version"]))
    # One version per judge, the same on every line; the two judges' versions differ.
    assert len(versions) == 2 and len({v for _, v in versions}) == 2
