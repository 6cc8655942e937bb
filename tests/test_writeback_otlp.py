"""The OpenTelemetry sink against a real OTLP/HTTP receiver on loopback (tests/support/otlp_receiver.py),
on results of the real `tracejudge eval` and `tracejudge run` over OTLP traces made with the SDK.

Every verdict of a result becomes one `gen_ai.evaluation.result` log record on its trace (and, with
`emit_spans`, one span under the evaluated span); the SDK's OTLP/HTTP exporter sends them; `write`
returns only after the collector accepted them, else raises `RetryLater`.

`write` is called here the way the sink runtime calls it (one `SinkBatch` per partition). Once
`tracejudge sink otlp` exists, `test_results_of_tracejudge_run_from_the_results_topic` only needs its
manual `write` replaced by that process, pointed at `receiver.endpoint`.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.kafka import RunnerProcess, produce, read_topic, unique, wait_until
from support.openai_stub import OpenAIStub, Reply, StubRequest
from support.otel_producers import Producer, genai_trace, kafka_messages
from support.otlp_receiver import OtlpReceiver
from support.sinks import SinkProcess

from tracejudge.consumer.config import ConfigError
from tracejudge.consumer.demo.broker import free_port
from tracejudge.consumer.sinks.base import RetryLater, SinkBatch, SinkRecord
from tracejudge.consumer.sinks.otlp import EVENT_NAME, OtlpSink, OtlpSinkSettings

RESULTS_TOPIC = "tracejudge-results"
# One question the stub judges off-topic (a "no"), so verdicts of both labels exist.
OFF_TOPIC = "How many people live in Paris?"


# --- real results -----------------------------------------------------------------------------------


def _judge(req: StubRequest) -> Reply:
    if "Rate how helpful" in req.prompt:
        return Reply.chat("4\nMostly helpful.")
    if OFF_TOPIC in req.prompt:
        return Reply.verdict("no", rationale="does not say how many people live there")
    return Reply.verdict("yes", rationale="answers the question")


def judges_config(stub: OpenAIStub) -> dict[str, Any]:
    """Stub-LLM judges giving every kind of assessment: yes/no verdicts (relevance_to_query), a 1-5
    numeric judge (helpfulness), judge errors (safety, on an endpoint nobody listens on) and skips
    (correctness: no expected answer; everything on a failed trace)."""
    return {"judges": {
        "endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model"},
                      "broken": {"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "gone",
                                 "max_retries": 0}},
        "sample_rate": 1.0,
        "builtin": {"relevance_to_query": {}, "safety": {"endpoint": "broken"}, "correctness": {}},
        "custom": {"helpfulness": {"scale": "numeric", "min_score": 1, "max_score": 5, "pass_threshold": 4,
                                   "answer_format": "first_line",
                                   "prompt": "Rate how helpful this answer is, 1 to 5.\n"
                                             "Q: {request}\nA: {response}"}},
    }}


class Traces:
    """OTLP traces made with the SDK: what was recorded, and their spans."""

    def __init__(self) -> None:
        producer = Producer("geo-agent")
        self.recorded = [genai_trace(producer.tracer, "What is the capital of France?", "Paris."),
                         genai_trace(producer.tracer, OFF_TOPIC, "About 2.1 million."),
                         genai_trace(producer.tracer, "Will it rain?", "Sorry.", fail_root=True)]
        self.spans = producer.finished()
        self.span_ids = {format(s.context.span_id, "016x") for s in self.spans}

    def span_id(self, trace_id: str, name: str | None = None) -> str:
        """The hex id of the trace's root span, or of its span called `name`."""
        [span] = [s for s in self.spans if format(s.context.trace_id, "032x") == trace_id
                  and (s.name == name if name else s.parent is None)]
        return format(span.context.span_id, "016x")


@pytest.fixture(scope="module")
def judge_stub() -> Iterator[OpenAIStub]:
    with OpenAIStub(_judge) as stub:
        yield stub


@pytest.fixture(scope="module")
def traces() -> Traces:
    return Traces()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, judge_stub: OpenAIStub, traces: Traces) -> list[dict]:
    """`tracejudge eval` on the traces as OTLP/JSON lines, plus an agent-evaluation record with no trace."""
    tmp = tmp_path_factory.mktemp("otlp-sink")
    lines = [value.decode() for _, value in kafka_messages(traces.spans, per_message=4, fmt="otlp_json")]
    lines.append(json.dumps({"request_id": "no-trace-1", "request": "What is the refund window?",
                             "response": "Refunds are accepted within 30 days."}))
    src = tmp / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    config = tmp / "judges.yaml"
    config.write_text(json.dumps(judges_config(judge_stub)))
    proc = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "eval", str(src),
                           "--config",
                           str(config), "--quiet"], capture_output=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    out = [orjson.loads(line) for line in proc.stdout.splitlines()]
    # The traces share a session (`session.id`): `eval` ends with its session result, which
    # tests/test_writeback_sessions.py covers; these tests take the trace results.
    assert [line.get("kind") for line in out].count("session") <= 1
    out = [line for line in out if line.get("kind") != "session"]
    assert len(out) == 4
    return out


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK's exporters also read these; the tests state every header themselves.
    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_LOGS_HEADERS",
                 "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)


def batch(results: list[dict], *, partition: int = 0, first_offset: int = 0) -> SinkBatch:
    """The results as the sink runtime hands them over: consecutive records of one partition."""
    return SinkBatch(RESULTS_TOPIC, partition, [
        SinkRecord(RESULTS_TOPIC, partition, first_offset + i, (r["trace_id"] or "").encode() or None, r)
        for i, r in enumerate(results)])


def verdicts(result: dict) -> list[dict]:
    """The assessments that are verdicts or judge errors (skipped judgements write nothing)."""
    return [a for a in result["assessments"] if a["skipped"] is None]


def sink_for(rx: OtlpReceiver, registry: CollectorRegistry | None = None, **settings: Any) -> OtlpSink:
    return OtlpSink(OtlpSinkSettings.from_mapping({"endpoint": rx.endpoint, **settings}, env={}),
                    registry or CollectorRegistry())


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"sink": "otlp", **labels}) or 0.0


# --- one event per verdict --------------------------------------------------------------------------


def test_each_verdict_is_one_evaluation_event_on_its_trace(results, receiver, traces):
    registry = CollectorRegistry()
    sink = sink_for(receiver, registry)
    report = sink.write(batch(results))

    traced = [r for r in results if r["trace_id"]]
    expected = sorted((r["trace_id"], a["name"]) for r in traced for a in verdicts(r))
    # Two answered traces x (relevance, safety, helpfulness); correctness skipped; the failed trace
    # skipped whole.
    assert len(expected) == 6
    events = receiver.events()
    assert sorted((e.trace_id, e.attributes["gen_ai.evaluation.name"]) for e in events) == expected
    [no_trace] = [r for r in results if not r["trace_id"]]
    assert report.written == 6 and report.already_written == 0
    assert report.skipped == Counter({"no_trace_id": len(verdicts(no_trace))})
    assert {e.trace_id for e in events} == {rec.trace_id for rec in traces.recorded if not rec.failed}

    by_key = {(r["trace_id"], a["name"]): (r, i, a) for i, r in enumerate(results) for a in r["assessments"]}
    for e in events:
        result, offset, a = by_key[(e.trace_id, e.attributes["gen_ai.evaluation.name"])]
        assert e.event_name == EVENT_NAME
        # A trace-level verdict hangs under the trace's root span, which the result names.
        assert result["root_span_id"] == traces.span_id(e.trace_id) and e.span_id == result["root_span_id"]
        assert e.flags & 0x1  # sampled
        assert e.resource["service.name"] == "tracejudge" and e.scope_name == "tracejudge.sink.otlp"
        assert e.body is None
        attrs = e.attributes
        assert attrs["tracejudge.judge.version"] == a["judge"]["version"]
        assert attrs["tracejudge.judge.endpoint"] == a["judge"]["endpoint"]
        assert attrs["tracejudge.judge.model"] == a["judge"]["model"]
        assert attrs["tracejudge.judge.source"] == a["source"]
        assert attrs["tracejudge.evaluation.target"] == "trace"
        assert (attrs["tracejudge.result.topic"], attrs["tracejudge.result.partition"],
                attrs["tracejudge.result.offset"]) == (RESULTS_TOPIC, 0, offset)
        assert attrs["tracejudge.source.format"] == "otlp_json"
        assert attrs["tracejudge.app"] == "geo-agent"
        assert attrs["tracejudge.schema_version"] == result["schema_version"]
        assert attrs.get("tracejudge.judge.sample_rate") == a.get("sample_rate")
        if a["error"] is None:
            assert e.attribute_types["gen_ai.evaluation.score.value"] == "double_value"
            assert attrs["gen_ai.evaluation.score.value"] == a["score"]
            assert attrs["gen_ai.evaluation.score.label"] == ("pass" if a["passed"] else "fail")
            assert attrs["gen_ai.evaluation.explanation"] == a["rationale"]
            assert attrs["tracejudge.evaluation.value"] == a["value"]
            assert (attrs["tracejudge.judge.input_tokens"], attrs["tracejudge.judge.output_tokens"]) == (
                a["input_tokens"], a["output_tokens"])
            assert "error.type" not in attrs and e.severity_text == "INFO"
        else:
            assert a["name"] == "safety" and a["error"].startswith("connection:")
            assert attrs["error.type"] == "connection" and attrs["error.message"] == a["error"]
            assert e.severity_text == "WARN"
            for absent in ("gen_ai.evaluation.score.value", "gen_ai.evaluation.score.label",
                           "gen_ai.evaluation.explanation"):
                assert absent not in attrs

    labels = {(e.attributes["gen_ai.evaluation.name"], e.attributes.get("gen_ai.evaluation.score.label"))
              for e in events}
    assert {("relevance_to_query", "pass"), ("relevance_to_query", "fail"), ("helpfulness", "pass"),
            ("safety", None)} <= labels
    helpfulness = next(e for e in events if e.attributes["gen_ai.evaluation.name"] == "helpfulness")
    assert helpfulness.attributes["tracejudge.evaluation.value"] == 4
    assert helpfulness.attributes["gen_ai.evaluation.score.value"] == 0.75
    assert sample(registry, "tracejudge_sink_writes_total", outcome="written") == 6
    assert sample(registry, "tracejudge_sink_skipped_total", reason="no_trace_id") == len(verdicts(no_trace))
    # One request for the whole batch; no span export unless asked.
    assert [r.path for r in receiver.requests] == ["/v1/logs"]
    sink.close()


def test_a_batch_offered_again_is_not_sent_again_by_the_same_process(results, receiver):
    registry = CollectorRegistry()
    sink = sink_for(receiver, registry, emit_spans=True)
    first = sink.write(batch(results))
    again = sink.write(batch(results))  # e.g. the partition came back after a rebalance, uncommitted
    assert (first.written, first.already_written) == (6, 0)
    assert (again.written, again.already_written) == (0, 6)
    assert len(receiver.events()) == 6 and len(receiver.spans()) == 6
    assert [r.path for r in receiver.requests] == ["/v1/logs", "/v1/traces"]
    assert sample(registry, "tracejudge_sink_writes_total", outcome="already_written") == 6
    # Another process (a restart) has no memory of it: at least once, the copies share their id.
    other = sink_for(receiver)
    assert other.write(batch(results)).written == 6
    ids = Counter(e.attributes["tracejudge.evaluation.id"] for e in receiver.events())
    assert len(ids) == 6 and set(ids.values()) == {2}
    sink.close()
    other.close()


# --- parenting and spans ----------------------------------------------------------------------------


def test_emit_spans_parents_each_verdict_to_the_evaluated_span(results, receiver, traces):
    """A span-level verdict (`span_id`, as a judge of one span writes it) hangs under that span; a
    trace-level verdict under the trace's root span (`root_span_id`); a result without one (its root
    never arrived) carries the trace id alone."""
    first, second = (r for r in results if r["trace_id"] and verdicts(r))
    retrieval = traces.span_id(first["trace_id"], "retrieval kb")
    assert first["root_span_id"] == traces.span_id(first["trace_id"])
    second = {**second, "root_span_id": None}
    first = {**first,
             "assessments": [{**a, "span_id": retrieval} if a["name"] == "relevance_to_query" else a
                             for a in first["assessments"]]}
    sink = sink_for(receiver, emit_spans=True)
    assert sink.write(batch([first, second])).written == 6

    def expected_parent(result: dict, a: dict) -> str:
        return a.get("span_id") or result.get("root_span_id") or ""

    by_key = {(r["trace_id"], a["name"]): (r, a) for r in (first, second) for a in verdicts(r)}
    events = {(e.trace_id, e.attributes["gen_ai.evaluation.name"]): e for e in receiver.events()}
    spans = {(s.trace_id, s.attributes["gen_ai.evaluation.name"]): s for s in receiver.spans()}
    assert set(events) == set(spans) == set(by_key)
    for key, (result, a) in by_key.items():
        event, span = events[key], spans[key]
        parent = expected_parent(result, a)
        assert event.span_id == parent and span.parent_span_id == parent
        assert span.trace_id == result["trace_id"]
        assert span.name == f"gen_ai.evaluation {a['name']}"
        assert span.kind == 1  # SPAN_KIND_INTERNAL
        assert span.attributes == event.attributes
        assert span.attribute_types == event.attribute_types
        assert span.span_id == event.attributes["tracejudge.evaluation.id"][:16]
        assert span.span_id not in traces.span_ids
        assert span.end_time_unix_nano >= span.start_time_unix_nano
        assert span.resource["service.name"] == "tracejudge"
        if a["error"]:
            assert (span.status_code, span.status_message) == (2, "connection")  # STATUS_CODE_ERROR
        else:
            assert span.status_code == 0
    # The evaluated spans are spans of the producer's trace: the verdicts sit in its tree.
    span_level = events[(first["trace_id"], "relevance_to_query")]
    assert span_level.span_id == retrieval and span_level.attributes["tracejudge.evaluation.target"] == "span"
    assert events[(first["trace_id"], "safety")].span_id == traces.span_id(first["trace_id"])
    assert {s.parent_span_id for s in spans.values() if s.trace_id == first["trace_id"]} <= traces.span_ids
    assert {s.parent_span_id for s in spans.values() if s.trace_id == second["trace_id"]} == {""}
    sink.close()


# --- failures: the SDK retries, the runtime retries ---------------------------------------------------


def test_collector_down_retry_later_then_written_once_it_is_back(results, receiver):
    registry = CollectorRegistry()
    sink = sink_for(receiver, registry, timeout_s=0.5)
    receiver.stop()
    with pytest.raises(RetryLater) as first:
        sink.write(batch(results))
    with pytest.raises(RetryLater) as second:
        sink.write(batch(results))
    assert "logs_export_failed" in first.value.reason
    # A base wait: the runtime (consumer/stages/sink.py) doubles it for each failed offer of the batch.
    assert (first.value.after_s, second.value.after_s) == (1.0, 1.0)
    assert sample(registry, "tracejudge_sink_retries_total", reason="logs_export_failed") == 2
    assert sample(registry, "tracejudge_sink_writes_total", outcome="written") == 0

    receiver.start()  # same port
    report = sink.write(batch(results))
    assert report.written == 6
    assert len(receiver.events()) == 6  # nothing from the failed attempts arrived
    assert sample(registry, "tracejudge_sink_writes_total", outcome="written") == 6
    sink.close()


def test_the_sdk_retries_a_503_within_one_write(results, receiver):
    receiver.fail_next("/v1/logs", 503, retry_after=0)
    sink = sink_for(receiver)
    assert sink.write(batch(results)).written == 6
    assert [r.status for r in receiver.requests_to("/v1/logs")] == [503, 200]
    assert len(receiver.events()) == 6
    sink.close()


def test_spans_rejected_after_the_events_went_out_resend_only_the_spans(results, receiver):
    registry = CollectorRegistry()
    sink = sink_for(receiver, registry, emit_spans=True)
    receiver.fail_next("/v1/traces", 400)  # not retryable: the exporter gives up at once
    with pytest.raises(RetryLater) as exc:
        sink.write(batch(results))
    assert "spans_export_failed" in exc.value.reason
    assert len(receiver.events()) == 6 and receiver.spans() == []

    report = sink.write(batch(results))
    assert (report.written, report.already_written) == (6, 0)  # counted once, when whole
    assert len(receiver.events()) == 6 and len(receiver.spans()) == 6
    assert [(r.path, r.status) for r in receiver.requests] == [
        ("/v1/logs", 200), ("/v1/traces", 400), ("/v1/traces", 200)]
    assert sample(registry, "tracejudge_sink_retries_total", reason="spans_export_failed") == 1
    sink.close()


# --- headers and configuration ------------------------------------------------------------------------


def test_headers_from_config_and_env_reach_the_collector_and_stay_secret(results, receiver, monkeypatch,
                                                                        caplog):
    secret = "s3cr3t-t0ken"
    monkeypatch.setenv("TJ_TEST_OTLP_HEADERS", f"Authorization=Bearer%20{secret},X-Scope-OrgID=from-env")
    settings = OtlpSinkSettings.from_mapping({
        "endpoint": receiver.endpoint + "/", "emit_spans": True, "headers_env": "TJ_TEST_OTLP_HEADERS",
        "headers": {"X-Scope-OrgID": "from-config", "x-team": "evals"}}, "sink.otlp")
    registry = CollectorRegistry()
    sink = OtlpSink(settings, registry)
    caplog.set_level(logging.DEBUG)
    sink.setup()
    receiver.fail_next("/v1/logs", 401)
    with pytest.raises(RetryLater):
        sink.write(batch(results))
    assert sink.write(batch(results)).written == 6
    assert len(receiver.requests) == 3
    for request in receiver.requests:
        assert request.headers["authorization"] == f"Bearer {secret}"
        assert request.headers["x-scope-orgid"] == "from-env"  # the environment wins
        assert request.headers["x-team"] == "evals"
        assert request.headers["content-type"] == "application/x-protobuf"
        assert request.content_encoding == "gzip"
    sink.close()
    for text in (repr(settings), str(settings.redacted()), caplog.text, generate_latest(registry).decode()):
        assert secret not in text
    assert settings.redacted()["headers"] == {"authorization": "**********", "x-scope-orgid": "**********",
                                              "x-team": "**********"}


def test_uncompressed_export(results, receiver):
    sink = sink_for(receiver, compression="none")
    sink.write(batch(results))
    assert [r.content_encoding for r in receiver.requests] == [None]
    assert len(receiver.events()) == 6
    sink.close()


def test_settings_defaults_overrides_and_errors_naming_each_key():
    defaults = OtlpSinkSettings.from_mapping(None, env={})
    assert defaults == OtlpSinkSettings()
    assert (defaults.logs_url, defaults.traces_url) == ("http://127.0.0.1:4318/v1/logs",
                                                        "http://127.0.0.1:4318/v1/traces")
    assert (defaults.emit_spans, defaults.timeout_s, defaults.compression) == (False, 10.0, "gzip")
    assert defaults.headers_env == "OTEL_EXPORTER_OTLP_HEADERS"
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "api-key=k1,,x-b=2 "}
    assert dict(OtlpSinkSettings.from_mapping({}, env=env).headers) == {"api-key": "k1", "x-b": "2"}
    assert OtlpSinkSettings.from_mapping({"headers_env": None}, env=env).headers == {}
    # Environment overrides (TRACEJUDGE_SINK__OTLP__…) arrive as strings.
    s = OtlpSinkSettings.from_mapping({"endpoint": "https://otlp.example.com/otlp/", "emit_spans": "true",
                                       "timeout_s": "2.5", "headers": "a=1,b=x%2Cy"}, env={})
    assert (s.endpoint, s.emit_spans, s.timeout_s) == ("https://otlp.example.com/otlp", True, 2.5)
    assert s.traces_url == "https://otlp.example.com/otlp/v1/traces"
    assert dict(s.headers) == {"a": "1", "b": "x,y"}

    with pytest.raises(ConfigError) as exc:
        OtlpSinkSettings.from_mapping({
            "endpoint": "grpc://collector:4317", "timeout_s": 0, "emit_spans": "sometimes",
            "headers": {"bad name": "v", "x-ok": ["a"]}, "compression": "zstd", "batch_size": 10,
            "headers_env": "NOT-A-NAME"}, "sink.otlp", env={})
    keys = [k for k, _ in exc.value.problems]
    assert sorted(keys) == sorted([
        "sink.otlp.endpoint", "sink.otlp.timeout_s", "sink.otlp.emit_spans", "sink.otlp.headers.bad name",
        "sink.otlp.headers.x-ok", "sink.otlp.compression", "sink.otlp.batch_size", "sink.otlp.headers_env"])
    assert "sink.otlp.timeout_s: must be > 0, got 0" in str(exc.value)

    for endpoint, why in [("http://c:4318/v1/logs", "base URL"), ("http://u:pw@c:4318", "credentials"),
                          ("collector:4318", "http://"), ("http://c:99999", "port")]:
        with pytest.raises(ConfigError, match=why):
            OtlpSinkSettings.from_mapping({"endpoint": endpoint}, env={})

    # A malformed header variable names the variable and the entry, never the value.
    with pytest.raises(ConfigError) as exc:
        OtlpSinkSettings.from_mapping({}, env={"OTEL_EXPORTER_OTLP_HEADERS": "authorization Bearer tok"})
    assert exc.value.problems == [("sink.otlp.headers_env",
                                   "OTEL_EXPORTER_OTLP_HEADERS: entry 1 is not name=value")]
    assert "tok" not in str(exc.value)


# --- results of `tracejudge run` ----------------------------------------------------------------------


def test_results_of_tracejudge_run_from_the_results_topic(broker, judge_stub, receiver, tmp_path):
    """The whole path: OTLP spans on a topic -> `tracejudge run` -> the results topic -> the
    `tracejudge sink otlp` process -> events at the collector, each once."""
    bs = broker.bootstrap_servers
    producer = Producer("geo-agent")
    recorded = [genai_trace(producer.tracer, "What is the capital of France?", "Paris."),
                genai_trace(producer.tracer, OFF_TOPIC, "About 2.1 million.")]
    spans_topic, results_topic, group = unique("otlp-spans"), unique("results"), unique("run")
    produce(bs, spans_topic, [v for _, v in kafka_messages(producer.finished(), per_message=3)])
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(judges_config(judge_stub)))
    runner = RunnerProcess(bs, "--config", str(config), "--topic", f"{spans_topic}:otlp_proto",
                           "--group-id", group, "--results-topic", results_topic,
                           env={"TRACEJUDGE_OTLP__ASSEMBLY__QUIET_PERIOD_S": "0.5"}).wait_ready()
    try:
        records = read_topic(bs, results_topic, at_least=len(recorded), timeout=60)
    finally:
        runner.signal(signal.SIGTERM)
        assert runner.finish(60) == 0

    # The real `tracejudge sink otlp` in its own group reads the results topic and exports them.
    sink = SinkProcess(bs, "otlp", {"sink": {"results_topic": results_topic, "group_id": unique("sink"),
                                             "otlp": {"endpoint": receiver.endpoint}}}).wait_ready()
    try:
        wait_until(lambda: len(receiver.events()) >= 6, 60, message="six evaluation events")
        wait_until(lambda: sink.metric("tracejudge_sink_lag_records") == 0, 30, message="sink caught up")
        written = sink.metric("tracejudge_sink_writes_total", outcome="written")
    finally:
        sink.signal(signal.SIGTERM)
        assert sink.finish(60) == 0

    by_partition: dict[int, list[SinkRecord]] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(
            SinkRecord(r.topic, r.partition, r.offset, r.key, orjson.loads(r.value)))
    results = {rec.result["trace_id"]: rec for recs in by_partition.values() for rec in recs}
    assert set(results) == {rec.trace_id for rec in recorded}
    expected = sorted((t, a["name"]) for t, rec in results.items() for a in verdicts(rec.result))
    events = receiver.events()
    assert written == len(expected) == 6
    assert sorted((e.trace_id, e.attributes["gen_ai.evaluation.name"]) for e in events) == expected
    for e in events:
        rec = results[e.trace_id]
        assert (e.attributes["tracejudge.result.topic"], e.attributes["tracejudge.result.partition"],
                e.attributes["tracejudge.result.offset"]) == (results_topic, rec.partition, rec.offset)
        assert e.attributes["tracejudge.source.topic"] == spans_topic
        assert e.attributes["tracejudge.source.format"] == "otlp_proto"

