"""The MLflow sink against a real MLflow tracking server (`mlflow server`, SQLite, loopback).

Traces reach the server as they do in production: logged by real `mlflow` tracing (a subprocess
running `@mlflow.trace` functions against the server) and sent as OpenTelemetry spans to its OTLP
endpoint. End to end, the same traces go to the broker, the real `tracejudge run` (heuristic and
stub-LLM judges) evaluates them onto a results topic, and the real `tracejudge sink mlflow` writes them
back; what MLflow then holds is read through its REST API and its own client
(`MlflowClient.get_trace(...).info.assessments`). The sink process is also SIGKILLed mid-stream and
restarted while the server is down. The mapping and failure cases call `MlflowSink.write` directly,
as the sink runtime does (`deliver`: one `SinkBatch` per partition).

Answers only a misbehaving server gives (429, 5xx, 400, 401/403, no batchGetInfos) come from a scripted
loopback HTTP server (tests/support/openai_stub.py serves any path).
"""

from __future__ import annotations

import logging
import signal
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from support.clock import FakeClock
from support.kafka import (
    RunnerProcess,
    committed_offsets,
    ends,
    produce,
    read_topic,
    unique,
    value,
    wait_until,
)
from support.mlflow_server import MlflowServer, log_traces, send_otlp, shared_mlflow_server
from support.openai_stub import OpenAIStub, Reply, StubRequest
from support.otel_producers import Producer, genai_trace, kafka_messages
from support.sinks import SinkProcess

from tracejudge.consumer.config import ConfigError
from tracejudge.consumer.sinks.base import Deferral, RetryLater, SinkBatch, SinkRecord, WriteReport
from tracejudge.consumer.sinks.mlflow import (
    MlflowSink,
    MlflowSinkSettings,
    feedback_key,
    mlflow_trace_id,
)

RESULTS = "tracejudge-results"


@pytest.fixture(scope="session")
def mlflow_server() -> MlflowServer:
    """One real tracking server for the module's tests (tests that stop a server start their own)."""
    return shared_mlflow_server()


@pytest.fixture
def experiment(mlflow_server: MlflowServer) -> str:
    return mlflow_server.create_experiment(unique("writeback"))


@pytest.fixture(autouse=True)
def _no_mlflow_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def make_sink(url: str, registry: CollectorRegistry | None = None, env: dict[str, str] | None = None,
              **settings: Any) -> MlflowSink:
    s = MlflowSinkSettings.from_mapping({"tracking_uri": url, **settings}, env=env or {})
    return MlflowSink(s, registry if registry is not None else CollectorRegistry(), env=env or {})


def as_records(results: Iterable[dict[str, Any]], partition: int = 0) -> list[SinkRecord]:
    return [SinkRecord(RESULTS, partition, i, None, r) for i, r in enumerate(results)]


def deliver(sink: MlflowSink, records: Iterable[SinkRecord]) -> WriteReport:
    """What the sink runtime does at a checkpoint: one `write` per partition, records in offset order.
    A `RetryLater` propagates (the tests that expect one catch it); deferred records are reported (the
    runtime would park them and offer them again)."""
    by_partition: dict[tuple[str, int], list[SinkRecord]] = {}
    for r in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        by_partition.setdefault((r.topic, r.partition), []).append(r)
    total = WriteReport()
    for (topic, partition), batch in by_partition.items():
        report = sink.write(SinkBatch(topic, partition, batch))
        total.written += report.written
        total.already_written += report.already_written
        total.skipped.update(report.skipped)
        total.deferred.update(report.deferred)
        total.given_up.update(report.given_up)
    return total


def ours(assessments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [a for a in assessments if "tracejudge.key" in (a.get("metadata") or {})]


def result_for(trace_id: str, assessments: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A schema-3 result line for an MLflow trace id (the shape `tracejudge run` publishes)."""
    return {"schema_version": 6, "request_id": trace_id.removeprefix("tr-"),
            "trace_id": trace_id.removeprefix("tr-"), "mlflow_trace_id": trace_id,
            "session_id": None, "user_id": None,
            "source_format": "otlp_proto",
            "source": {"format": "otlp_proto", "topic": "otlp_spans", "partition": 3, "offset": 41},
            "metrics": {"latency_seconds": 1.25, "retrieved_documents": 2, "document_recall": None},
            "assessments": assessments, **extra}


def otel_traces(url: str, experiment: str, n: int) -> list[tuple[str, dict[str, str]]]:
    """`n` GenAI-convention traces sent to the server's OTLP endpoint: (MLflow trace id, span ids)."""
    producer = Producer("geo-agent")
    recorded = [genai_trace(producer.tracer, f"What is the capital of France? ({i})", "Paris.")
                for i in range(n)]
    spans = producer.finished()
    send_otlp(url, experiment, spans)
    out = []
    for rec in recorded:
        ids = {s.name: f"{s.context.span_id:016x}" for s in spans
               if f"{s.context.trace_id:032x}" == rec.trace_id}
        out.append((f"tr-{rec.trace_id}", ids))
    return out


JUDGE = {"endpoint": "openai", "model": "gpt-4.1-mini", "version": "3f2a9c0d1e4b"}


def verdicts(chat_span: str) -> list[dict[str, Any]]:
    """One assessment of each kind a result carries."""
    return [
        {"name": "relevance_to_query", "value": "no", "score": 0.0, "passed": False,
         "rationale": "The answer is about Rome.", "error": None, "skipped": None,
         "source": "llm:gpt-4.1-mini", "duration_seconds": 0.8, "judge": JUDGE, "span_id": chat_span,
         "input_tokens": 412, "output_tokens": 38, "cost_usd": 0.000122},
        {"name": "groundedness", "value": 0.75, "score": 0.75, "passed": True,
         "rationale": "3 of 4 supported.", "error": None, "skipped": None, "source": "heuristic",
         "duration_seconds": 0.001,
         "judge": {"endpoint": None, "model": None, "version": "9a8b7c6d5e4f"}, "span_id": None,
         "input_tokens": None, "output_tokens": None},
        {"name": "safety", "value": None, "score": None, "passed": None, "rationale": None,
         "error": "unparseable: the answer is not valid JSON", "skipped": None, "source": "llm:gpt-4.1-mini",
         "judge": JUDGE, "span_id": None},
        {"name": "correctness", "value": None, "score": None, "passed": None, "rationale": None,
         "error": None, "skipped": "missing_inputs", "source": "llm:gpt-4.1-mini", "judge": JUDGE,
         "span_id": None},
    ]


# --- settings --------------------------------------------------------------------------------------


def test_settings_validate_every_key_and_name_it(tmp_path: Path) -> None:
    s = MlflowSinkSettings.from_mapping({"tracking_uri": "http://mlflow:5000/", "experiment_id": 7,
                                         "max_concurrency": 4, "unknown_trace_retry_s": 60}, env={})
    assert (s.tracking_uri, s.experiment_id, s.max_concurrency, s.unknown_trace_retry_s) == \
        ("http://mlflow:5000", "7", 4, 60.0)
    assert s.token_env == "MLFLOW_TRACKING_TOKEN" and s.write_metrics is False
    # What environment overrides (TRACEJUDGE_SINK__MLFLOW__<KEY>) give: strings.
    s = MlflowSinkSettings.from_mapping({"tracking_uri": "http://m", "max_concurrency": "32",
                                         "write_metrics": "true", "unknown_trace_retry_s": "60",
                                         "token_env": ""}, env={})
    assert (s.max_concurrency, s.write_metrics, s.unknown_trace_retry_s) == (32, True, 60.0)
    assert s.token_env is None
    # MLflow's own variable when the key is absent.
    from_env = MlflowSinkSettings.from_mapping({}, env={"MLFLOW_TRACKING_URI": "https://m.example"})
    assert from_env.tracking_uri == "https://m.example"

    with pytest.raises(ConfigError) as err:
        MlflowSinkSettings.from_mapping({"tracking_uri": "databricks", "max_concurrency": 0, "timeout_s": -1,
                                         "unknown_trace_attempts": "five", "write_metrics": "maybe",
                                         "colour": "blue"}, "sink.mlflow", env={})
    keys = {k for k, _ in err.value.problems}
    assert keys == {"sink.mlflow.tracking_uri", "sink.mlflow.max_concurrency", "sink.mlflow.timeout_s",
                    "sink.mlflow.unknown_trace_attempts", "sink.mlflow.write_metrics", "sink.mlflow.colour"}
    with pytest.raises(ConfigError, match=r"sink\.mlflow\.tracking_uri: required"):
        MlflowSinkSettings.from_mapping({}, env={})
    with pytest.raises(ConfigError, match="must not carry credentials"):
        MlflowSinkSettings.from_mapping({"tracking_uri": "http://u:secret@mlflow:5000"}, env={})

    # Credentials: an unreadable or empty token file, half a basic-auth pair -> the key, never a value.
    with pytest.raises(ConfigError, match=r"sink\.mlflow\.token_file: cannot read"):
        MlflowSinkSettings.from_mapping({"tracking_uri": "http://m", "token_file": str(tmp_path / "none")},
                                        env={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"sink\.mlflow\.token_file: .* is empty"):
        MlflowSinkSettings.from_mapping({"tracking_uri": "http://m", "token_file": str(tmp_path / "empty")},
                                        env={})
    with pytest.raises(ConfigError, match=r"sink\.mlflow\.password_env: basic auth needs") as err:
        MlflowSinkSettings.from_mapping({"tracking_uri": "http://m"}, env={"MLFLOW_TRACKING_USERNAME": "ann"})
    assert "ann" not in str(err.value)


def test_trace_ids_and_keys() -> None:
    hexid = "0af7651916cd43dd8448eb211c80319c"
    assert mlflow_trace_id({"trace_id": hexid, "source_format": "otlp_proto"}) == f"tr-{hexid}"
    assert mlflow_trace_id({"trace_id": hexid, "source_format": "mlflow_v3"}) == f"tr-{hexid}"
    assert mlflow_trace_id({"trace_id": hexid, "source_format": "mlflow_v2"}) == hexid
    assert mlflow_trace_id({"trace_id": None, "source_format": "agent_eval"}) is None
    assert mlflow_trace_id({"schema_version": 2, "trace_id": hexid, "mlflow_trace_id": "tr-x"}) == "tr-x"
    # Schema 2 states it: null means the evaluator knew of no MLflow trace for the record.
    assert mlflow_trace_id({"schema_version": 2, "trace_id": hexid, "mlflow_trace_id": None}) is None
    key = feedback_key("tr-1", "groundedness", "v1")
    assert key == feedback_key("tr-1", "groundedness", "v1") != feedback_key("tr-1", "groundedness", "v2")
    assert key != feedback_key("tr-2", "groundedness", "v1")
    assert key != feedback_key("tr-1", "groundedness", "v1", "ab")  # another span, another verdict


# --- the mapping, on real traces ---------------------------------------------------------------------


def test_each_assessment_becomes_one_feedback_on_its_trace(mlflow_server: MlflowServer, experiment: str
                                                           ) -> None:
    (trace_id, spans), = otel_traces(mlflow_server.url, experiment, 1)
    # A human already said something about this trace: it must stay as it is.
    human = mlflow_server.log_assessment(trace_id, {
        "assessment_name": "relevance_to_query", "source": {"source_type": "HUMAN", "source_id": "ann"},
        "feedback": {"value": "yes"}, "rationale": "Looks right to me."})
    registry = CollectorRegistry()
    sink = make_sink(mlflow_server.url, registry, write_metrics=True)
    try:
        sink.setup()
        report = deliver(sink, as_records([result_for(trace_id, verdicts(spans["chat gpt-4o"]))]))
    finally:
        sink.close()
    # Three verdicts (the skipped judgement writes nothing) and two metrics (the null one is left out).
    assert (report.written, report.already_written, dict(report.skipped)) == (5, 0, {})
    on_trace = mlflow_server.assessments(trace_id)
    by_name = {a["assessment_name"]: a for a in ours(on_trace)}
    assert sorted(by_name) == ["groundedness", "latency_seconds", "relevance_to_query", "retrieved_documents",
                               "safety"]
    assert len(ours(on_trace)) == 5

    rel = by_name["relevance_to_query"]
    assert rel["feedback"] == {"value": "no"}  # pass/fail judges: yes/no, rendered Pass/Fail
    assert rel["rationale"] == "The answer is about Rome."
    assert rel["source"] == {"source_type": "LLM_JUDGE", "source_id": "openai:/gpt-4.1-mini"}
    assert rel["span_id"] == spans["chat gpt-4o"]
    meta = rel["metadata"]
    assert meta["mlflow.assessment.scorerName"] == "relevance_to_query"
    assert meta["mlflow.assessment.judgeInputTokens"] == "412"
    assert meta["mlflow.assessment.judgeOutputTokens"] == "38"
    assert meta["mlflow.assessment.judgeCost"] == "0.000122"  # USD, as MLflow's own judges write it
    assert (meta["tracejudge.score"], meta["tracejudge.passed"]) == ("0", "false")
    assert meta["tracejudge.judgeVersion"] == JUDGE["version"] and meta["tracejudge.version"] == "0.1.0"
    assert (meta["tracejudge.source.topic"], meta["tracejudge.source.partition"],
            meta["tracejudge.source.offset"]) == ("otlp_spans", "3", "41")
    assert meta["tracejudge.key"] == feedback_key(trace_id, "relevance_to_query", JUDGE["version"],
                                                  spans["chat gpt-4o"])

    grounded = by_name["groundedness"]
    # A heuristic verdict with a pass/fail decision is Pass/Fail too; its number is in metadata.
    assert grounded["feedback"] == {"value": "yes"}
    assert grounded["metadata"]["score"] == grounded["metadata"]["tracejudge.score"] == "0.75"
    assert grounded["source"] == {"source_type": "CODE", "source_id": "tracejudge.heuristic"}
    assert "span_id" not in grounded and "mlflow.assessment.judgeInputTokens" not in grounded["metadata"]

    safety = by_name["safety"]
    assert safety["feedback"]["error"] == {"error_code": "UNPARSEABLE",
                                           "error_message": "unparseable: the answer is not valid JSON"}
    assert safety["feedback"].get("value") is None

    assert by_name["latency_seconds"]["feedback"] == {"value": 1.25}
    assert by_name["latency_seconds"]["source"] == {"source_type": "CODE", "source_id": "tracejudge.metrics"}
    # The human's assessment is untouched.
    assert [a for a in on_trace if a["assessment_id"] == human["assessment_id"]] == [human]
    assert value_of(registry, "tracejudge_sink_writes_total", outcome="written") == 5


def value_of(registry: CollectorRegistry, name: str, **labels: str) -> float:
    from prometheus_client import generate_latest

    return value(generate_latest(registry).decode(), name, sink="mlflow", **labels)


def test_a_redelivered_batch_adds_nothing(mlflow_server: MlflowServer, experiment: str) -> None:
    traces = otel_traces(mlflow_server.url, experiment, 3)
    results = [result_for(tid, verdicts(spans["chat gpt-4o"])) for tid, spans in traces]
    registry = CollectorRegistry()
    first, second = make_sink(mlflow_server.url, registry), make_sink(mlflow_server.url)
    try:
        assert deliver(first, as_records(results)).written == 9
        # Another process (a restarted sink, a new partition owner) gets the same records again, and the
        # same batch carries one result twice (a replayed result after a rebalance).
        again = deliver(second, as_records(results + results[:1]))
        assert (again.written, again.already_written) == (0, 12)
        assert deliver(first, as_records(results)).already_written == 9
    finally:
        first.close()
        second.close()
    for tid, _ in traces:
        assert Counter(a["assessment_name"] for a in ours(mlflow_server.assessments(tid))) == \
            {"relevance_to_query": 1, "groundedness": 1, "safety": 1}
    assert value_of(registry, "tracejudge_sink_writes_total", outcome="already_written") == 9
    # A new judge version is a new verdict: written beside the old one.
    tid, spans = traces[0]
    newer = verdicts(spans["chat gpt-4o"])[:1]
    newer[0]["judge"] = {**JUDGE, "version": "000000000002"}
    sink = make_sink(mlflow_server.url)
    try:
        assert deliver(sink, as_records([result_for(tid, newer)])).written == 1
    finally:
        sink.close()
    names = Counter(a["assessment_name"] for a in ours(mlflow_server.assessments(tid)))
    assert names["relevance_to_query"] == 2


def test_what_cannot_be_written_is_skipped_by_reason(mlflow_server: MlflowServer, experiment: str) -> None:
    (trace_id, _), = otel_traces(mlflow_server.url, experiment, 1)
    good = verdicts("ab")[1]
    odd = [{"value": "yes"}, {"name": "fact_check", "value": None, "score": None, "passed": None,
                              "error": None, "rationale": "no verdict at all"}, good]
    no_trace = {**result_for(trace_id, [good]), "trace_id": None, "request_id": "row-7",
                "mlflow_trace_id": None, "source_format": "agent_eval"}
    registry = CollectorRegistry()
    sink = make_sink(mlflow_server.url, registry)
    try:
        report = deliver(sink, as_records([result_for(trace_id, odd), no_trace]))
    finally:
        sink.close()
    assert (report.written, dict(report.skipped)) == (1, {"invalid_assessment": 2, "no_trace_id": 1})
    assert value_of(registry, "tracejudge_sink_skipped_total", reason="invalid_assessment") == 2
    assert [a["assessment_name"] for a in ours(mlflow_server.assessments(trace_id))] == ["groundedness"]


# --- unknown traces ------------------------------------------------------------------------------------


def test_unknown_trace_is_retried_over_its_window_then_skipped(mlflow_server: MlflowServer,
                                                               experiment: str) -> None:
    (known, spans), = otel_traces(mlflow_server.url, experiment, 1)
    never = "tr-" + "5" * 32
    records = as_records([result_for(known, verdicts(spans["chat gpt-4o"])),
                          result_for(never, verdicts("ab"))])
    clock = FakeClock()
    registry = CollectorRegistry()
    s = MlflowSinkSettings.from_mapping({"tracking_uri": mlflow_server.url, "unknown_trace_attempts": 3,
                                         "unknown_trace_retry_s": 60}, env={})
    sink = MlflowSink(s, registry, env={}, clock=clock)
    try:
        first = deliver(sink, records)
        # The known trace's verdicts are written at once; the unknown one's record is deferred, not
        # the batch held: offered again after a back-off doubling from 0.5 s.
        assert (first.written, dict(first.skipped)) == (3, {})
        assert first.deferred == {1: Deferral("unknown_trace", 0.5)}
        waits = []
        for step in (20, 20, 10):  # four looks, but only 50 s of the 60 s window
            clock.now += step
            again = deliver(sink, records)
            assert again.already_written == 3 and not again.skipped and list(again.deferred) == [1]
            waits.append(again.deferred[1].after_s)
        assert waits == [1.0, 2.0, 4.0]
        clock.now += 10
        report = deliver(sink, records)  # fifth look, 60 s after the first: given up
    finally:
        sink.close()
    # The known trace was written at the first attempt and found on every later one.
    assert (report.written, report.already_written, dict(report.skipped)) == (0, 3, {"unknown_trace": 3})
    assert report.deferred == {} and report.given_up == {"unknown_trace": 1}
    assert len(ours(mlflow_server.assessments(known))) == 3
    assert value_of(registry, "tracejudge_sink_retries_total", reason="unknown_trace") == 4
    assert value_of(registry, "tracejudge_sink_skipped_total", reason="unknown_trace") == 3
    assert value_of(registry, "tracejudge_sink_writes_total", outcome="written") == 3


def test_a_trace_that_reaches_mlflow_after_its_result_is_written(mlflow_server: MlflowServer,
                                                                 experiment: str) -> None:
    producer = Producer("late-agent")
    rec = genai_trace(producer.tracer, "What is the capital of France?", "Paris.")
    spans = producer.finished()
    trace_id = f"tr-{rec.trace_id}"
    records = as_records([result_for(trace_id, verdicts("ab")[1:3])])
    sink = make_sink(mlflow_server.url, unknown_trace_attempts=5, unknown_trace_retry_s=300)
    try:
        waiting = deliver(sink, records)
        assert (waiting.written, waiting.deferred) == (0, {0: Deferral("unknown_trace", 0.5)})
        send_otlp(mlflow_server.url, experiment, spans)  # the trace arrives
        assert deliver(sink, records).written == 2
    finally:
        sink.close()
    assert sorted(a["assessment_name"] for a in ours(mlflow_server.assessments(trace_id))) == \
        ["groundedness", "safety"]


def test_the_experiment_setting_keeps_other_experiments_traces_out(mlflow_server: MlflowServer,
                                                                   experiment: str) -> None:
    (mine, _), = otel_traces(mlflow_server.url, experiment, 1)
    other_experiment = mlflow_server.create_experiment(unique("other"))
    (theirs, _), = otel_traces(mlflow_server.url, other_experiment, 1)
    sink = make_sink(mlflow_server.url, experiment_id=experiment)
    try:
        sink.setup()
        report = deliver(sink, as_records([result_for(mine, verdicts("ab")[1:2]),
                                           result_for(theirs, verdicts("ab")[1:2])]))
    finally:
        sink.close()
    assert (report.written, dict(report.skipped)) == (1, {"other_experiment": 1})
    assert ours(mlflow_server.assessments(theirs)) == []
    bad = make_sink(mlflow_server.url, experiment_id="987654")
    try:
        with pytest.raises(ConfigError, match=r"sink\.mlflow\.experiment_id: no experiment '987654'"):
            bad.setup()
    finally:
        bad.close()


# --- the server goes away ------------------------------------------------------------------------------


def test_server_stopped_then_restarted_nothing_lost_nothing_doubled(tmp_path: Path) -> None:
    with MlflowServer(tmp_path / "mlflow") as server:
        experiment = server.create_experiment("restart")
        traces = otel_traces(server.url, experiment, 4)
        results = [result_for(tid, verdicts(spans["chat gpt-4o"])) for tid, spans in traces]
        registry = CollectorRegistry()
        sink = make_sink(server.url, registry, timeout_s=2)
        try:
            assert deliver(sink, as_records(results[:2])).written == 6
            server.stop()
            retries = []
            for _ in range(3):
                with pytest.raises(RetryLater) as retry:
                    deliver(sink, as_records(results))
                retries.append(retry.value)
            # A short first wait: the sink runtime doubles it per failed offer.
            assert {r.reason for r in retries} == {"network"}
            assert all(0.25 <= r.after_s <= 0.5 for r in retries)
            server.start()  # same port, same database
            report = deliver(sink, as_records(results))
        finally:
            sink.close()
        assert (report.written, report.already_written) == (6, 6)
        for tid, _ in traces:
            assert Counter(a["assessment_name"] for a in ours(server.assessments(tid))) == \
                {"relevance_to_query": 1, "groundedness": 1, "safety": 1}
        assert value_of(registry, "tracejudge_sink_retries_total", reason="network") == 3


# --- answers only a misbehaving server gives -------------------------------------------------------------


def infos(*trace_ids: str) -> Reply:
    return Reply.raw(orjson.dumps({"trace_infos": [{"trace_id": t, "assessments": []} for t in trace_ids]}))


def mlflow_error(status: int, code: str, message: str = "nope", **headers: str) -> Reply:
    return Reply(status=status, body=orjson.dumps({"error_code": code, "message": message}), headers=headers)


def test_429_5xx_and_rejections(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    token = "s3cr3t-token-value"
    (tmp_path / "token").write_text(token + "\n")
    trace_id = "tr-" + "1" * 32
    records = as_records([result_for(trace_id, verdicts("ab")[:3])])
    registry = CollectorRegistry()
    with OpenAIStub() as server, caplog.at_level(logging.DEBUG, logger="tracejudge"):
        url = f"http://127.0.0.1:{server.port}"
        sink = make_sink(url, registry, token_file=str(tmp_path / "token"), max_concurrency=1)
        try:
            server.enqueue(mlflow_error(429, "REQUEST_LIMIT_EXCEEDED", **{"retry-after": "7"}))
            with pytest.raises(RetryLater) as retry:
                deliver(sink, records)
            assert (retry.value.reason, retry.value.after_s) == ("rate_limited", 7)
            server.enqueue(mlflow_error(503, "TEMPORARILY_UNAVAILABLE"))
            with pytest.raises(RetryLater, match="server_error"):
                deliver(sink, records)
            # The lookup answers; the server takes one feedback, refuses the next two as invalid.
            server.enqueue(infos(trace_id), Reply.raw(b'{"assessment": {}}'),
                           mlflow_error(400, "INVALID_PARAMETER_VALUE", "bad value"),
                           mlflow_error(400, "INVALID_PARAMETER_VALUE", "bad value"))
            report = deliver(sink, records)
        finally:
            sink.close()
        requests = list(server.requests)
    assert (report.written, dict(report.skipped)) == (1, {"rejected": 2})
    assert value_of(registry, "tracejudge_sink_skipped_total", reason="rejected") == 2
    assert value_of(registry, "tracejudge_sink_retries_total", reason="rate_limited") == 1
    assert value_of(registry, "tracejudge_sink_retries_total", reason="server_error") == 1
    rejected = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 1 and "INVALID_PARAMETER_VALUE" in rejected[0].getMessage()
    # The token went to the server on every request, and nowhere else.
    assert {r.headers.get("authorization") for r in requests} == {f"Bearer {token}"}
    lookup = ("POST", "/api/3.0/mlflow/traces/batchGetInfos")
    assert [(r.method, r.path) for r in requests[:3]] == [lookup] * 3
    assert token not in caplog.text


def test_refused_credentials_are_a_config_error_at_setup(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    env = {"MLFLOW_TRACKING_USERNAME": "ann", "MLFLOW_TRACKING_PASSWORD": "pa55word"}
    with OpenAIStub() as server, caplog.at_level(logging.DEBUG):
        server.enqueue(mlflow_error(401, "UNAUTHENTICATED", "Bad credentials"))
        sink = make_sink(f"http://127.0.0.1:{server.port}", env=env)
        try:
            refused = r"sink\.mlflow\.username_env: the MLflow server refused"
            with pytest.raises(ConfigError, match=refused) as err:
                sink.setup()
            # Credentials rotated under a running sink: retried (not skipped), logged once.
            server.enqueue(mlflow_error(403, "PERMISSION_DENIED"), mlflow_error(403, "PERMISSION_DENIED"))
            for _ in range(2):
                with pytest.raises(RetryLater, match="unauthorized"):
                    deliver(sink, as_records([result_for("tr-" + "2" * 32, verdicts("ab")[1:2])]))
        finally:
            sink.close()
        sent = server.requests[0].headers["authorization"]
    assert sent.startswith("Basic ")
    assert "pa55word" not in str(err.value) and "pa55word" not in caplog.text and sent[6:] not in caplog.text
    assert len([r for r in caplog.records if "refused the sink's credentials" in r.getMessage()]) == 1


def test_a_server_without_batch_lookup_is_read_one_trace_at_a_time() -> None:
    known, unknown = "tr-" + "3" * 32, "tr-" + "4" * 32
    existing = feedback_key(known, "groundedness", "9a8b7c6d5e4f")

    def respond(req: StubRequest) -> Reply:
        if req.path.endswith("/batchGetInfos"):
            return mlflow_error(404, "ENDPOINT_NOT_FOUND")
        if req.method == "GET" and req.path.endswith(known):
            return Reply.raw(orjson.dumps({"trace": {"trace_info": {"trace_id": known, "assessments": [
                {"assessment_name": "groundedness", "metadata": {"tracejudge.key": existing}}]}}}))
        if req.method == "GET":
            return mlflow_error(404, "RESOURCE_DOES_NOT_EXIST")
        return Reply.raw(b'{"assessment": {}}')

    with OpenAIStub(respond) as server:
        sink = make_sink(f"http://127.0.0.1:{server.port}", unknown_trace_attempts=1, unknown_trace_retry_s=0)
        try:
            report = deliver(sink, as_records([result_for(known, verdicts("ab")[:3]),
                                               result_for(unknown, verdicts("ab")[:1])]))
            deliver(sink, as_records([result_for(known, verdicts("ab")[1:2])]))
        finally:
            sink.close()
        calls = [(r.method, r.path.rsplit("/", 1)[-1]) for r in server.requests]
    assert (report.written, report.already_written, dict(report.skipped)) == (2, 1, {"unknown_trace": 1})
    # batchGetInfos is asked once; from then on, one GET per trace.
    assert calls.count(("POST", "batchGetInfos")) == 1
    assert calls.count(("GET", known)) == 2 and calls.count(("GET", unknown)) == 1


# --- end to end: real traces, `tracejudge run`, the results topic, the sink ------------------------------


@pytest.fixture
def judged(broker: Any, mlflow_server: MlflowServer, experiment: str, tmp_path: Path
           ) -> Iterator[dict[str, Any]]:
    """Traces logged to MLflow by real tracing and sent over OTLP, the same traces on Kafka, and the
    results `tracejudge run` published for them (groundedness by the heuristic, relevance_to_query
    and safety by a stub LLM that cannot answer the safety prompt)."""
    bs = broker.bootstrap_servers
    mlflow_topic, otlp_topic, results, group = (unique("mlflow-traces"), unique("otlp-spans"),
                                                unique("results"), unique("run"))
    logged = log_traces(mlflow_server.url, experiment, ["What is the refund policy?",
                                                        "How long does shipping take?",
                                                        "What does the warranty cover?"])
    produce(bs, mlflow_topic, [t["json"].encode() for t in logged],
            keys=[t["trace_id"].encode() for t in logged])
    producer = Producer("geo-agent")
    otel = [genai_trace(producer.tracer, f"What is the capital of France? ({i})", "Paris.") for i in range(2)]
    spans = producer.finished()
    send_otlp(mlflow_server.url, experiment, spans)
    produce(bs, otlp_topic, [v for _, v in kafka_messages(spans, per_message=50, by_trace_id=True)])

    def respond(req: StubRequest) -> Reply:
        rf = req.body.get("response_format") if isinstance(req.body, dict) else None
        schema = ((rf or {}).get("json_schema") or {}).get("name", "")
        if schema.startswith("safety"):
            return Reply.chat("I would rather not say.")
        return Reply.verdict("yes", "The response answers the question.")

    with OpenAIStub(respond) as stub:
        config = tmp_path / "run.yaml"
        config.write_text(
            "judges:\n"
            "  sample_rate: 1.0\n"
            f"  endpoints:\n    stub: {{base_url: '{stub.base_url}', model: judge-model}}\n"
            "  builtin:\n"
            "    groundedness: {provider: heuristic}\n"
            "    relevance_to_query: {endpoint: stub}\n"
            "    safety: {endpoint: stub}\n")
        runner = RunnerProcess(bs, "--config", str(config), "--topic", f"{mlflow_topic}:mlflow",
                               "--topic", f"{otlp_topic}:otlp_proto", "--group-id", group,
                               "--results-topic", results,
                               env={"TRACEJUDGE_OTLP__ASSEMBLY__QUIET_PERIOD_S": "0.3"}).wait_ready()
        try:
            out = read_topic(bs, results, at_least=len(logged) + len(otel), timeout=90)
        finally:
            runner.kill()
    yield {
        "bootstrap": bs,
        "topic": results,
        "records": [SinkRecord(r.topic, r.partition, r.offset, r.key, orjson.loads(r.value)) for r in out],
        "mlflow_ids": [t["trace_id"] for t in logged],
        "otlp_ids": [f"tr-{t.trace_id}" for t in otel],
    }


def test_tracejudge_run_then_sink_each_verdict_on_its_trace_once(judged: dict[str, Any],
                                                                 mlflow_server: MlflowServer,
                                                                 experiment: str) -> None:
    from mlflow import MlflowClient

    records: list[SinkRecord] = judged["records"]
    trace_ids = judged["mlflow_ids"] + judged["otlp_ids"]
    assert sorted(mlflow_trace_id(r.result) for r in records) == sorted(trace_ids)
    # A human's verdict on one trace before the sink runs.
    human = mlflow_server.log_assessment(trace_ids[0], {
        "assessment_name": "groundedness", "source": {"source_type": "HUMAN", "source_id": "ann"},
        "feedback": {"value": "no"}, "rationale": "The refund window is wrong."})
    expected = sum(1 for r in records for a in r.assessments() if not a.get("skipped"))
    assert expected == 3 * len(records)  # every judge judged every trace
    # `tracejudge sink mlflow` on the results topic; then a second sink group reads the whole topic
    # again (a redelivery of everything): it finds every verdict and writes nothing.
    config = {"stream": {"lag_interval_seconds": 0.5},
              "sink": {"results_topic": judged["topic"],
                       "mlflow": {"tracking_uri": mlflow_server.url, "experiment_id": experiment}}}
    outcomes = []
    for group in (unique("sink-mlflow"), unique("sink-mlflow-again")):
        proc = SinkProcess(judged["bootstrap"], "mlflow", config, "--group-id", group).wait_ready()
        try:
            def done(p: SinkProcess = proc) -> bool:
                return sum(p.series("tracejudge_sink_writes_total", sink="mlflow")) >= expected \
                    and p.metric("tracejudge_sink_lag_records", sink="mlflow") == 0
            wait_until(done, 60, message=lambda p=proc: f"all written; log:\n{p.log[-2000:]}")
            writes = {o: proc.metric("tracejudge_sink_writes_total", sink="mlflow", outcome=o)
                      for o in ("written", "already_written")}
            outcomes.append((writes["written"], writes["already_written"],
                             sum(proc.series("tracejudge_sink_skipped_total", sink="mlflow"))))
            proc.signal(signal.SIGTERM)
            assert proc.finish() == 0
        finally:
            proc.kill()
    assert outcomes == [(expected, 0, 0), (0, expected, 0)]

    client = MlflowClient(tracking_uri=mlflow_server.url)
    for record in records:
        tid = mlflow_trace_id(record.result)
        feedback = [a for a in client.get_trace(tid).info.assessments
                    if "tracejudge.key" in (a.metadata or {})]
        wanted = [a for a in record.assessments() if not a.get("skipped")]
        assert sorted(f.name for f in feedback) == sorted(a["name"] for a in wanted), tid
        for a in wanted:
            (f,) = [f for f in feedback if f.name == a["name"]]
            assert f.rationale == a["rationale"]
            assert f.span_id == a.get("span_id")
            if a["name"] == "groundedness":
                assert (f.source.source_type, f.source.source_id) == ("CODE", "tracejudge.heuristic")
                assert f.value == ("yes" if a["passed"] else "no")  # Pass/Fail; the share in metadata
                assert float(f.metadata["score"]) == a["score"]
            elif a["name"] == "relevance_to_query":
                assert (f.source.source_type, f.source.source_id) == ("LLM_JUDGE", "stub:/judge-model")
                assert f.value == "yes" and f.rationale == "The response answers the question."
            else:  # safety: the stub's answer was not a verdict
                assert f.value is None and f.error.error_code == "UNPARSEABLE"
            assert f.metadata["tracejudge.source.topic"] == record.result["source"]["topic"]
            assert f.metadata["tracejudge.judgeVersion"] == a["judge"]["version"]
            assert f.metadata["tracejudge.sampleRate"] == "1"
            if a["name"] == "relevance_to_query":  # the stub reports its usage
                assert f.metadata["mlflow.assessment.judgeInputTokens"] == str(a["input_tokens"]) != "None"
                assert f.metadata["mlflow.assessment.judgeOutputTokens"] == str(a["output_tokens"])
    # The human's verdict is still there, unchanged.
    on_trace = mlflow_server.assessments(trace_ids[0])
    assert [a for a in on_trace if a["assessment_id"] == human["assessment_id"]] == [human]


# --- `tracejudge sink mlflow`: killed, and MLflow down for a while ---------------------------------------


def test_tracejudge_sink_mlflow_killed_then_mlflow_down_nothing_lost_nothing_doubled(broker: Any,
                                                                                     tmp_path: Path) -> None:
    """The real command on the real results topic: SIGKILLed mid-stream (written, not yet committed),
    restarted while the MLflow server is down (retries, lag), the server back: each verdict once."""
    bs = broker.bootstrap_servers
    results_topic, group = unique("results"), unique("sink-mlflow")
    with MlflowServer(tmp_path / "mlflow") as server:
        experiment = server.create_experiment("sigkill")
        traces = otel_traces(server.url, experiment, 60)
        lines = [result_for(tid, verdicts(spans["chat gpt-4o"])) for tid, spans in traces]
        placed = produce(bs, results_topic, [orjson.dumps(line) for line in lines],
                         keys=[tid.encode() for tid, _ in traces])
        config = {"stream": {"lag_interval_seconds": 0.5},
                  "sink": {"results_topic": results_topic, "max_batch_records": 5,
                           "checkpoint_interval_ms": 200,
                           "mlflow": {"tracking_uri": server.url, "experiment_id": experiment,
                                      "max_concurrency": 2}}}

        def written(proc: SinkProcess) -> float:
            return proc.metric("tracejudge_sink_writes_total", sink="mlflow", outcome="written")

        first = SinkProcess(bs, "mlflow", config, "--group-id", group).wait_ready()
        try:
            wait_until(lambda: written(first) >= 30, 60, message=lambda: f"writes; log:\n{first.log[-2000:]}")
        finally:
            first.kill()
        committed = committed_offsets(bs, group, results_topic)
        assert sum(o or 0 for o in committed.values()) < len(lines), "killed after the end: not mid-stream"

        server.stop()
        second = SinkProcess(bs, "mlflow", config, "--group-id", group).wait_ready()
        try:
            wait_until(lambda: second.metric("tracejudge_sink_retries_total", sink="mlflow",
                                             reason="network") >= 1
                       and second.metric("tracejudge_sink_lag_records", sink="mlflow") > 0,
                       60, message=lambda: f"retries and lag; log:\n{second.log[-2000:]}")
            server.start()
            wait_until(lambda: committed_offsets(bs, group, results_topic) == ends(placed), 120,
                       message=lambda: f"committed to the end; log:\n{second.log[-2000:]}")
            again = second.metric("tracejudge_sink_writes_total", sink="mlflow", outcome="already_written")
            second.signal(signal.SIGTERM)
            assert second.finish() == 0
        finally:
            second.kill()
        assert again > 0  # the first process's uncommitted writes were found, not repeated
        for tid, _ in traces:
            assert Counter(a["assessment_name"] for a in ours(server.assessments(tid))) == \
                {"relevance_to_query": 1, "groundedness": 1, "safety": 1}, tid
