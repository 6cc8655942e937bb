"""Verdicts from other evaluators: `gen_ai.evaluation.result` events made with the OpenTelemetry SDK's
logs API, serialized as the Collector's Kafka exporter writes them (an `ExportLogsServiceRequest` in
protobuf), read by the real `tracejudge run` from a logs topic on the real broker, exported to the
judge verdict series as `judge="<evaluator>/<name>"`; malformed ones dead-lettered and counted; the
sink's own events not read again; the evaluator/name caps counted. And the OTLP sink's
`evaluator_attributes` option against the loopback OTLP receiver.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf.json_format import MessageToJson
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
from support.kafka import produce, read_topic, running, scrape, settings, unique, value, wait_until
from support.otlp_receiver import OtlpReceiver

# The OTLP sink's fixtures: real `tracejudge eval` results judged by the stub LLM.
from test_writeback_otlp import batch, judge_stub, results, sink_for, traces  # noqa: F401

from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.schemas.formats import evaluation_events

EVENT = evaluation_events.EVENT_NAME
TRACE = 0x0AF7651916CD43DD8448EB211C80319C
SPAN = 0xB7AD6B7169203331


def logs_record(events: list[dict[str, Any]], *, service: str | None = "shop-agent", scope: str = "deepeval",
                version: str | None = "2.1", trace_id: int = TRACE, span_id: int = SPAN) -> bytes:
    """One Kafka record of the logs topic: `events` (attribute maps) emitted through the SDK's logs API
    as `gen_ai.evaluation.result` events parented to the evaluated span, encoded as the Collector's
    Kafka exporter writes them."""
    exporter = InMemoryLogExporter()
    attrs = {k: v for k, v in (("service.name", service), ("service.version", version)) if v is not None}
    provider = LoggerProvider(resource=Resource.create(attrs))
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    context = set_span_in_context(NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=True,
                                                               trace_flags=TraceFlags(1))))
    logger = provider.get_logger(scope)
    for attributes in events:
        logger.emit(event_name=EVENT, attributes=attributes, context=context)
    return encode_logs(exporter.get_finished_logs()).SerializeToString()


def ev(name: str | None, score: Any = None, label: str | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {} if name is None else {"gen_ai.evaluation.name": name}
    if score is not None:
        out["gen_ai.evaluation.score.value"] = score
    if label is not None:
        out["gen_ai.evaluation.score.label"] = label
    return {**out, **extra}


def promtool_lint(text: bytes) -> None:
    from support.deploy_files import tool

    proc = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=30,
                          check=False)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


# --- reading the events ---------------------------------------------------------------------------------


def test_decode_reads_the_conventions_attributes_and_falls_back_for_the_evaluator():
    payload = logs_record([
        ev("answer_relevancy", 0.9, "Pass", **{"gen_ai.evaluation.evaluator.id": "deepeval-rel",
                                              "gen_ai.evaluation.explanation": "on topic",
                                              "gen_ai.response.id": "chatcmpl-1"}),
        ev("coherence", 4),  # an int score is a number too
    ])
    read = evaluation_events.decode(payload, "otlp_logs_proto")
    assert not read.invalid and read.own == 0
    first, second = read.evaluations
    assert (first.name, first.evaluator, first.score, first.label, first.explanation, first.response_id) == (
        "answer_relevancy", "deepeval-rel", 0.9, "Pass", "on topic", "chatcmpl-1")
    assert (first.trace_id, first.span_id) == (f"{TRACE:032x}", f"{SPAN:016x}")
    assert (first.service, first.version) == ("shop-agent", "2.1")
    assert (second.evaluator, second.score) == ("deepeval", 4.0)  # the scope's name

    # No provenance attribute and no scope name: the resource's service.name, else "unknown".
    request = ExportLogsServiceRequest.FromString(logs_record([ev("x", 1.0)], service="strands-evals"))
    request.resource_logs[0].scope_logs[0].scope.name = ""
    [event] = evaluation_events.decode(request.SerializeToString(), "otlp_logs_proto").evaluations
    assert event.evaluator == "strands-evals"
    request.resource_logs[0].resource.ClearField("attributes")
    [event] = evaluation_events.decode(request.SerializeToString(), "otlp_logs_proto").evaluations
    assert event.evaluator == "unknown" and event.service is None


def test_otlp_json_reads_the_same_as_protobuf():
    payload = logs_record([ev("answer_relevancy", 0.9, "pass"), ev(None, 1.0),
                           ev("x", 1.0, **{"tracejudge.app": "shop-agent"})])
    doc = MessageToJson(ExportLogsServiceRequest.FromString(payload))
    from_proto = evaluation_events.decode(payload, "otlp_logs_proto")
    from_json = evaluation_events.decode(doc, "otlp_logs_json")
    assert from_json.evaluations == from_proto.evaluations and len(from_json.evaluations) == 1
    assert from_json.invalid == from_proto.invalid and len(from_json.invalid) == 1
    assert from_json.own == from_proto.own == 1
    # Ordinary logs are not parsed again.
    assert not evaluation_events.may_hold(logs_record([]))


def test_settings_of_the_section_and_errors_naming_the_key():
    s = load_settings(environ={}, overrides={"stream.topics": ["logs:otlp_logs_proto"]})
    ext = s.stream.external_evaluations
    assert (ext.enabled, ext.thresholds, ext.max_evaluators, ext.max_names) == (True, {}, 20, 100)
    with pytest.raises(ConfigError) as exc:
        load_settings(environ={}, overrides={"stream.topics": ["t"], "stream.external_evaluations": {
            "thresholds": {"faithfulness": "high", "ok": 0.5}, "max_names": 0}})
    keys = [key.split(" ")[0] for key, _ in exc.value.problems]
    assert "stream.external_evaluations.thresholds.faithfulness" in keys
    assert "stream.external_evaluations.max_names" in keys


# --- through `tracejudge run` ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(broker) -> Iterator[dict[str, Any]]:
    """One `tracejudge run` on a logs topic: every kind of event, then the scrape once all records are
    read."""
    bs = broker.bootstrap_servers
    logs, results_topic, dlq = unique("eval-logs"), unique("eval-results"), unique("eval-dlq")
    records = [
        # DeepEval through the Collector: labels decide; a threshold decides an unlabelled score.
        logs_record([ev("answer_relevancy", 0.9, "Pass"), ev("answer_relevancy", 0.2, "FAIL"),
                     ev("faithfulness", 0.8, "faithful"), ev("faithfulness", 0.5),
                     ev("coherence", 4.0, "good"), ev("toxicity", **{"error.type": "timeout"})]),
        # OpenLIT: the scope names the evaluator; yes/no and true/false labels.
        logs_record([ev("hallucination", 0.0, "no"), ev("bias", None, "True")], scope="openlit.evals"),
        # Strands with the proposed provenance attribute; another app.
        logs_record([ev("helpfulness", 1.0, "yes", **{"gen_ai.evaluation.evaluator.id": "strands"})],
                    service="travel-agent", scope="strands.telemetry"),
        # Malformed events beside a good one: the record is dead-lettered, the good one still counts.
        logs_record([ev(None, 0.5, "pass"), ev("goal_success", "high"), ev("goal_success", 1.0, "pass")],
                    scope="agentcore"),
        logs_record([ev("goal_success", float("nan"))], scope="agentcore"),
        # tracejudge's own event (the OTLP sink's attributes): not read again.
        logs_record([ev("relevance_to_query", 1.0, "pass", **{"tracejudge.evaluation.id": "ab" * 16})],
                    scope="tracejudge.sink.otlp", service="tracejudge"),
        # Past max_evaluators (4) and max_names (9): "other", counted.
        logs_record([ev("answer_relevancy", 1.0, "pass")], scope="ragas"),
        logs_record([ev("new_name", 1.0, "pass"), ev("newer_name", 1.0, "pass")], scope="deepeval"),
    ]
    cfg = settings(bs, [f"{logs}:otlp_logs_proto"], **{
        "stream.results_topic": results_topic, "stream.dead_letter_topic": dlq,
        "stream.external_evaluations": {"thresholds": {"deepeval/faithfulness": 0.7, "faithfulness": 0.99},
                                        "max_evaluators": 4, "max_names": 9}})
    with running(cfg, judges=False) as runner:
        produce(bs, logs, records, keys=[b"k"] * len(records))  # one partition: first come, first admitted
        wait_until(lambda: value(scrape(runner.http_port).text, "tracejudge_records_total",
                                 outcome="ok") >= len(records), 60, message="all records read")
        text = scrape(runner.http_port).text
        dead = read_topic(bs, dlq, at_least=2)
    yield {"text": text, "dead": dead, "records": len(records)}


def test_verdicts_reach_the_judge_verdict_series_by_evaluator(run):
    text = run["text"]

    def verdicts(judge: str, verdict: str, app: str = "shop-agent") -> float:
        return value(text, "tracejudge_judge_verdicts_total", app=app, judge=judge, verdict=verdict)

    assert verdicts("deepeval/answer_relevancy", "pass") == 1
    assert verdicts("deepeval/answer_relevancy", "fail") == 1
    # Not a pass/fail label: the evaluator's own threshold (0.7) over the bare name's (0.99).
    assert verdicts("deepeval/faithfulness", "pass") == 1 and verdicts("deepeval/faithfulness", "fail") == 1
    # No threshold for coherence: a score only; an evaluator error: no verdict.
    assert verdicts("deepeval/coherence", "pass") + verdicts("deepeval/coherence", "fail") == 0
    assert value(text, "tracejudge_external_evaluation_score_sum", judge="deepeval/coherence") == 4.0
    assert value(text, "tracejudge_external_evaluation_score_count", judge="deepeval/coherence") == 1
    assert value(text, "tracejudge_judge_verdicts_total", judge="deepeval/toxicity") == 0
    assert verdicts("openlit.evals/hallucination", "fail") == 1
    assert verdicts("openlit.evals/bias", "pass") == 1
    assert verdicts("strands/helpfulness", "pass", app="travel-agent") == 1
    assert verdicts("agentcore/goal_success", "pass") == 1
    # The resource's service.version is the verdict's release.
    assert value(text, "tracejudge_judge_verdicts_total", judge="strands/helpfulness", version="2.1") == 1

    outcomes = {o: value(text, "tracejudge_external_evaluations_total", outcome=o)
                for o in ("verdict", "score_only", "no_verdict", "error", "invalid", "own")}
    assert outcomes == {"verdict": 11, "score_only": 1, "no_verdict": 0, "error": 1, "invalid": 3, "own": 1}
    assert value(text, "tracejudge_external_evaluations_total", evaluator="deepeval", outcome="error") == 1


def test_own_events_are_not_read_again_and_nothing_becomes_a_trace(run):
    text = run["text"]
    assert not [k for k in run["text"].splitlines() if "relevance_to_query" in k]
    assert value(text, "tracejudge_external_evaluations_total", evaluator="tracejudge", outcome="own") == 1
    # Records of evaluation events only: read and committed, never an (empty) trace to judge.
    assert value(text, "tracejudge_records_total", outcome="ok") == run["records"]
    assert value(text, "tracejudge_traces_total") == 0
    assert value(text, "tracejudge_assembly_open_traces") == 0


def test_malformed_events_are_dead_lettered_with_a_clear_reason(run):
    dead = sorted(run["dead"], key=lambda r: r.offset)
    assert len(dead) == 2
    headers = [dict(r.headers) for r in dead]
    reasons = [h.get("tracejudge-reason", b"").decode() for h in headers]
    errors = [h.get("tracejudge-error", b"").decode() for h in headers]
    assert reasons == ["invalid_evaluation_event"] * 2, headers
    assert errors[0].startswith("resourceLogs[0].scopeLogs[0].logRecords[0]: gen_ai.evaluation.name is "
                                "missing") and "(1 more invalid evaluation events)" in errors[0]
    assert errors[1] == "resourceLogs[0].scopeLogs[0].logRecords[0]: gen_ai.evaluation.score.value is not " \
                        "finite (nan)"
    assert value(run["text"], "tracejudge_dead_letters_total", reason="invalid_evaluation_event") == 2


def test_label_caps_are_counted_and_the_exposition_is_clean(run):
    text = run["text"]
    # Evaluators admitted: deepeval, openlit.evals, strands, agentcore; ragas is the fifth.
    assert value(text, "tracejudge_judge_verdicts_total", judge="other/answer_relevancy", verdict="pass") == 1
    assert value(text, "tracejudge_external_evaluation_label_overflow_total", label="evaluator") == 1
    # Names admitted: the first nine (new_name the last); newer_name is the tenth.
    assert value(text, "tracejudge_judge_verdicts_total", judge="deepeval/new_name") == 1
    assert value(text, "tracejudge_judge_verdicts_total", judge="deepeval/other") == 1
    assert value(text, "tracejudge_external_evaluation_label_overflow_total", label="name") == 1
    promtool_lint(text.encode())


# --- the sink's provenance attributes -------------------------------------------------------------------


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


PROVENANCE = ("gen_ai.evaluation.evaluator.id", "gen_ai.evaluation.evaluator.version",
              "gen_ai.evaluation.evaluator.type")


def test_sink_adds_evaluator_attributes_only_when_asked(results, receiver):  # noqa: F811
    sink_for(receiver).write(batch(results))
    assert receiver.events() and not any(k in e.attributes for e in receiver.events() for k in PROVENANCE)

    receiver.clear()
    sink = sink_for(receiver, evaluator_attributes=True)
    sink.write(batch(results))
    events = receiver.events()
    by_name = {a["name"]: a for r in results for a in r["assessments"]}
    assert events
    for e in events:
        a = by_name[e.attributes["gen_ai.evaluation.name"]]
        assert e.attributes["gen_ai.evaluation.evaluator.id"] == a["name"]
        assert e.attributes["gen_ai.evaluation.evaluator.version"] == a["judge"]["version"]
        assert e.attributes["gen_ai.evaluation.evaluator.type"] == a["source"].split(":")[0]
    assert {e.attributes["gen_ai.evaluation.evaluator.type"] for e in events} == {"llm"}
    sink.close()


def test_with_judges_configured_the_verdicts_share_the_judges_series():
    from tracejudge.consumer.stages.run import StreamRunner

    cfg = load_settings(environ={}, overrides={"stream.topics": ["logs:otlp_logs_proto"], "judges": {},
                                               "http.port": 0})
    runner = StreamRunner(cfg)
    external = runner.stage.external
    assert runner.judges is not None and external.judge_metrics is runner.judges.metrics
    external.take(logs_record([ev("answer_relevancy", 0.9, "pass")]), "otlp_logs_proto")
    assert runner.exporter.registry.get_sample_value("tracejudge_judge_verdicts_total", {
        "app": "shop-agent", "judge": "deepeval/answer_relevancy", "verdict": "pass", "version": "2.1"}) == 1
    # Disabled, or no logs topic: nothing is read.
    off = load_settings(environ={}, overrides={"stream.topics": ["logs:otlp_logs_proto"], "http.port": 0,
                                               "stream.external_evaluations.enabled": False})
    assert StreamRunner(off, judges=False).stage.external is None
    spans = load_settings(environ={}, overrides={"stream.topics": ["spans:otlp_proto"], "http.port": 0})
    assert StreamRunner(spans, judges=False).stage.external is None
