"""Session verdicts written back: the sinks read the session results topic too.

Turns are real MLflow traces: a traced agent (`@mlflow.trace`, `mlflow.update_current_trace(metadata=
{"mlflow.trace.session": ...})`) runs in a subprocess logging to a real `mlflow server`
(tests/support/mlflow_server.py). The session result lines are built here with `schemas.session`, their
turns naming those traces, and produced to a session results topic on the broker; the real
`tracejudge sink mlflow` / `tracejudge sink otlp` processes read them (and a trace result on the results
topic beside them). MLflow must then show each session verdict once, on the session's first trace, with
MLflow's session marks (`mlflow.assessment.onlineScoringSessionId`); a second evaluation replaces the
first; a redelivered line (produced again, or replayed by a new consumer group) changes nothing; a human
assessment and MLflow's own session scorer's feedback are never touched. The OTLP receiver
(tests/support/otlp_receiver.py) must get one `gen_ai.evaluation.result` event per session verdict,
parented to the last turn's root span. Corner cases call `MlflowSink.write` directly, as the runtime does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from support.kafka import FAST_GROUP, committed_offsets, ends, metric, produce, unique, wait_until
from support.mlflow_server import QUIET_ENV, MlflowServer, shared_mlflow_server
from support.otlp_receiver import OtlpReceiver
from support.sinks import RecordingSink, SinkProcess

from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.sinks.base import SinkBatch, SinkRecord
from tracejudge.consumer.sinks.mlflow import SESSION_ID_KEY, MlflowSink, MlflowSinkSettings
from tracejudge.consumer.sinks.otlp import EVENT_NAME, OtlpSink, OtlpSinkSettings
from tracejudge.consumer.stages.sink import SinkRunner, plan_sink
from tracejudge.schemas.result import SCHEMA_VERSION, Assessment, JudgeIdentity
from tracejudge.schemas.results_line import (
    NOT_A_RESULT,
    UNKNOWN_SCHEMA_VERSION,
    BadResult,
    decode_line,
    decode_result,
)
from tracejudge.schemas.session import SessionResult, SessionSource, TurnRef

SESSIONS_TOPIC = "tracejudge-session-results"
HEURISTIC = JudgeIdentity(endpoint=None, model=None, version="f00dfeed0001")
LLM = JudgeIdentity(endpoint="openai", model="gpt-4.1-mini", version="c0ffee000002")

# A traced support agent, one trace per turn, each marked with its session as MLflow documents it.
# MLflow's tracing state is process-global: it runs in a subprocess logging to the test's server.
_TRACED_TURNS = r'''
import json, os, sys
import mlflow
from mlflow.entities import SpanType

mlflow.set_experiment(experiment_id=os.environ["MLFLOW_EXPERIMENT_ID"])


@mlflow.trace(name="retrieve", span_type=SpanType.RETRIEVER)
def retrieve(question):
    return ["Refunds are accepted within 30 days of purchase with a receipt."]


@mlflow.trace(name="support_turn", span_type=SpanType.AGENT)
def support_turn(question, answer, session, user):
    mlflow.update_current_trace(metadata={"mlflow.trace.session": session, "mlflow.trace.user": user})
    retrieve(question)
    return answer


for session, user, question, answer in json.loads(sys.stdin.read()):
    support_turn(question, answer, session, user)
    trace = mlflow.get_trace(mlflow.get_last_active_trace_id())
    print(json.dumps({"trace_id": trace.info.trace_id, "root_span_id": trace.data._get_root_span().span_id,
                      "request_time_ms": trace.info.request_time,
                      "session": trace.info.trace_metadata.get("mlflow.trace.session")}), flush=True)
'''


def log_session_turns(url: str, experiment: str, turns: Sequence[tuple[str, str, str, str]]
                      ) -> list[dict[str, Any]]:
    """One real MLflow trace per (session, user, question, answer), in that order, on the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OTEL_"))}
    env.update(QUIET_ENV)
    env.update({"MLFLOW_TRACKING_URI": url, "MLFLOW_EXPERIMENT_ID": experiment,
                "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING": "false"})
    proc = subprocess.run([sys.executable, "-c", _TRACED_TURNS], input=json.dumps(list(turns)), env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [t["session"] for t in logged] == [t[0] for t in turns]
    return logged


class Conversations:
    """Two interleaved support conversations as real MLflow traces: `refund` (3 turns, the user gives
    up) and `shipping` (2 turns), plus `orphan`: a trace that is not on the server."""

    def __init__(self, server: MlflowServer) -> None:
        self.server = server
        self.experiment = server.create_experiment(unique("sessions"))
        self.refund_id, self.shipping_id = unique("conv-refund"), unique("conv-shipping")
        turns = [(self.refund_id, "u-7", "Can I get a refund?", "Refunds take 30 days."),
                 (self.shipping_id, "u-8", "Where is my parcel?", "It ships in 3 to 5 days."),
                 (self.refund_id, "u-7", "Can I get a refund??", "Refunds take 30 days."),
                 (self.shipping_id, "u-8", "Thanks!", "You're welcome."),
                 (self.refund_id, "u-7", "Forget it.", "Sorry to hear that.")]
        logged = log_session_turns(server.url, self.experiment, turns)
        self.refund = [t for t in logged if t["session"] == self.refund_id]
        self.shipping = [t for t in logged if t["session"] == self.shipping_id]


@pytest.fixture(scope="module")
def mlflow_server() -> MlflowServer:
    return shared_mlflow_server()


@pytest.fixture(scope="module")
def conversations(mlflow_server: MlflowServer) -> Conversations:
    return Conversations(mlflow_server)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_LOGS_HEADERS",
                 "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


# --- session result lines ----------------------------------------------------------------------------


def turn_refs(traces: Sequence[dict[str, Any]], *, first_offset: int = 0) -> list[TurnRef]:
    return [TurnRef(trace_id=t["trace_id"].removeprefix("tr-"), request_id=t["trace_id"],
                    mlflow_trace_id=t["trace_id"], root_span_id=t["root_span_id"],
                    timestamp=t["request_time_ms"] / 1000, failed=False, partition=0, offset=first_offset + i)
            for i, t in enumerate(traces)]


def frustration(value: str) -> Assessment:
    score = {"none": 1.0, "resolved": 0.5}.get(value, 0.0)
    return Assessment(name="user_frustration", value=value, score=score,
                      passed=value != "unresolved", rationale=f"the user's frustration: {value}",
                      source="heuristic", duration_seconds=0.001, judge=HEURISTIC, sample_rate=1.0)


def completeness(value: str, *, error: str | None = None) -> Assessment:
    if error is not None:
        return Assessment(name="conversation_completeness", error=error, source="llm:gpt-4.1-mini", judge=LLM)
    return Assessment(name="conversation_completeness", value=value, score=1.0 if value == "yes" else 0.0,
                      passed=value == "yes", rationale=f"goal met: {value}", source="llm:gpt-4.1-mini",
                      duration_seconds=0.9, judge=LLM, input_tokens=812, output_tokens=41, sample_rate=1.0)


def session_result(session_id: str, turns: list[TurnRef], assessments: list[Assessment], *,
                   evaluation: int = 1, close_reason: str = "inactivity") -> SessionResult:
    return SessionResult(
        session_id=session_id, user_id="u-7", app="support-bot",
        status="complete" if close_reason in ("inactivity", "end_of_input") else "incomplete",
        close_reason=close_reason, turns=turns, started_at=turns[0].timestamp if turns else None,
        ended_at=turns[-1].timestamp if turns else None, metrics={"turns": float(len(turns))},
        assessments=assessments, evaluation=evaluation,
        source=SessionSource(topic="tracejudge-results", partition=0,
                             first_offset=turns[0].offset if turns else None,
                             last_offset=turns[-1].offset if turns else None))


def as_record(session: SessionResult, offset: int, topic: str = SESSIONS_TOPIC) -> SinkRecord:
    line, decoded = decode_line(session.to_json())
    return SinkRecord(topic, 0, offset, session.key.encode(), line, decoded)


def caught_up(bootstrap: str, group: str, topic: str, placed: list[tuple[int, int]]) -> bool:
    """The group has committed every record `produce` placed (partitions without one stay None)."""
    committed = committed_offsets(bootstrap, group, topic)
    return all(committed.get(p) == end for p, end in ends(placed).items())


def ours(assessments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [a for a in assessments if "tracejudge.key" in (a.get("metadata") or {})]


def session_feedback(server: MlflowServer, trace_id: str, session_id: str) -> list[dict[str, Any]]:
    return [a for a in ours(server.assessments(trace_id)) if a["metadata"].get(SESSION_ID_KEY) == session_id]


def mlflow_sink(url: str, registry: CollectorRegistry | None = None, **settings: Any) -> MlflowSink:
    s = MlflowSinkSettings.from_mapping({"tracking_uri": url, **settings}, env={})
    return MlflowSink(s, registry if registry is not None else CollectorRegistry(), env={})


# --- decoding and configuration ----------------------------------------------------------------------


def test_session_lines_decode_to_session_results_and_bad_ones_are_dead_lettered_by_reason():
    hexid = "0af7651916cd43dd8448eb211c80319c"
    turns = [TurnRef(trace_id=hexid, mlflow_trace_id=f"tr-{hexid}", root_span_id="b7ad6b7169203331",
                     timestamp=1_790_000_000.0)]
    session = session_result("conv-1", turns, [frustration("resolved")], evaluation=2)
    line, decoded = decode_line(session.to_json())
    assert decoded is not None and decoded.session_id == "conv-1" and decoded.evaluation == 2
    assert decoded.first_turn == decoded.last_turn == turns[0]
    assert decoded.assessments[0].name == "user_frustration" and decoded.assessments[0].judge == HEURISTIC
    assert line["kind"] == "session" and line["schema_version"] == SCHEMA_VERSION
    assert decode_result(session.to_json()) == line
    # A trace result is still a trace result.
    trace_line = {"schema_version": 2, "trace_id": "ab" * 16, "request_id": "r", "assessments": []}
    assert decode_line(orjson.dumps(trace_line)) == (trace_line, None)

    def reason(value: dict[str, Any]) -> str:
        with pytest.raises(BadResult) as err:
            decode_line(orjson.dumps(value))
        return err.value.reason

    good = session.to_dict()
    assert reason({**good, "schema_version": SCHEMA_VERSION + 1}) == UNKNOWN_SCHEMA_VERSION
    assert reason({k: v for k, v in good.items() if k != "session_id"}) == NOT_A_RESULT
    assert reason({**good, "session_id": ""}) == NOT_A_RESULT
    assert reason({**good, "turns": "three"}) == NOT_A_RESULT
    assert reason({**good, "evaluation": "second"}) == NOT_A_RESULT
    assert reason({**good, "assessments": [{"value": "none"}]}) == NOT_A_RESULT
    assert reason({**trace_line, "kind": "conversation"}) == NOT_A_RESULT


def test_the_session_results_topic_is_sessions_results_topic_unless_the_sink_says_otherwise(
        tmp_path: Path) -> None:
    def plan(config: dict[str, Any]) -> Any:
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps(config))
        return plan_sink(load_settings(str(path), require_topics=False), "mlflow")

    base = {"stream": {"results_topic": "results"}}
    assert plan(base).session_results_topic is None
    assert plan({**base, "sessions": {"results_topic": "sessions"}}).session_results_topic == "sessions"
    assert plan({**base, "sessions": {"results_topic": "sessions"},
                 "sink": {"session_results_topic": "other"}}).session_results_topic == "other"
    assert plan({**base, "sessions": {"results_topic": "sessions"},
                 "sink": {"write_sessions": False}}).session_results_topic is None
    with pytest.raises(ConfigError, match=r"sink\.dead_letter_topic: is the session results topic"):
        plan({**base, "sessions": {"results_topic": "sessions"}, "sink": {"dead_letter_topic": "sessions"}})


def test_a_sink_that_does_not_write_sessions_is_never_offered_one(broker: Any) -> None:
    """A plugin written before sessions (`accepts_sessions` False): the session results topic is not
    subscribed, and a session line on the topic it does read is skipped, counted and committed."""
    bs = broker.bootstrap_servers
    topic, sessions_topic, kind = unique("results"), unique("session-results"), unique("rec")
    hexid = "0af7651916cd43dd8448eb211c80319c"
    session = session_result(unique("conv"), [TurnRef(trace_id=hexid, mlflow_trace_id=f"tr-{hexid}",
                                                      timestamp=1_790_000_000.0)], [frustration("none")])
    trace_line = {"schema_version": 2, "trace_id": hexid, "request_id": hexid,
                  "assessments": [{"name": "groundedness", "value": 1.0, "source": "heuristic"}]}
    # Shared topic: a trace result and a session result side by side; the session topic holds one too.
    placed = produce(bs, topic, [orjson.dumps(trace_line), session.to_json()], keys=[b"k", b"k"])
    produce(bs, sessions_topic, [session.to_json()], keys=[b"k"])
    settings = load_settings(environ={}, require_topics=False, overrides={
        "kafka.bootstrap_servers": bs, "sink.results_topic": topic, "sessions.results_topic": sessions_topic,
        "sink.checkpoint_interval_ms": 100, "http.port": 0, "http.bind_address": "127.0.0.1", **FAST_GROUP})
    sink = RecordingSink()
    runner = SinkRunner(settings, kind, sink, registry=CollectorRegistry(auto_describe=True))
    assert runner.stage.topics() == [topic]
    runner.start()
    try:
        wait_until(lambda: runner.http_port is not None and caught_up(bs, runner.group_id, topic, placed), 60,
                   message="committed past the session line")
        assert metric(runner.http_port, "tracejudge_sink_skipped_total", sink=kind,
                      reason="session_unsupported") == 1
        assert [r.kind for b in sink.written for r in b.records] == ["trace"]
    finally:
        runner.stop()
        assert runner.join(60)
    assert runner.error is None


# --- MLflow: the real `tracejudge sink mlflow` ---------------------------------------------------------


def test_tracejudge_sink_mlflow_writes_each_session_verdict_once_on_the_first_trace_and_replaces_it(
        broker: Any, mlflow_server: MlflowServer, conversations: Conversations) -> None:
    server, c = mlflow_server, conversations
    bs = broker.bootstrap_servers
    results_topic, sessions_topic, group = unique("results"), unique("session-results"), unique("sink-mlflow")
    refund_first = c.refund[0]["trace_id"]
    shipping_first = c.shipping[0]["trace_id"]
    # Already on the refund conversation's first trace: a human's verdict of the same name, and MLflow's
    # own session scorer's (its session mark, no tracejudge key). Neither may be touched.
    human = server.log_assessment(refund_first, {
        "assessment_name": "user_frustration",
        "source": {"source_type": "HUMAN", "source_id": "ann@example.com"},
        "feedback": {"value": "none"}, "metadata": {SESSION_ID_KEY: c.refund_id}})
    mlflow_own = server.log_assessment(refund_first, {
        "assessment_name": "conversation_completeness",
        "source": {"source_type": "LLM_JUDGE", "source_id": "openai:/gpt-4o"},
        "feedback": {"value": "yes"}, "metadata": {SESSION_ID_KEY: c.refund_id}})

    # First evaluations: refund closed after two turns (its third came later), shipping after both.
    refund_1 = session_result(c.refund_id, turn_refs(c.refund[:2]),
                              [frustration("resolved"), completeness("yes")])
    shipping_1 = session_result(c.shipping_id, turn_refs(c.shipping),
                                [frustration("none"), completeness("", error="timeout: no answer in 30 s")])
    # A trace verdict on the results topic beside them: both topics are read by one sink.
    trace_line = {"schema_version": 2, "request_id": c.shipping[1]["trace_id"],
                  "trace_id": c.shipping[1]["trace_id"].removeprefix("tr-"),
                  "mlflow_trace_id": c.shipping[1]["trace_id"], "session_id": c.shipping_id,
                  "source": {"format": "mlflow_v3", "topic": "mlflow-traces", "partition": 0, "offset": 3},
                  "assessments": [{"name": "relevance_to_query", "value": "yes", "score": 1.0, "passed": True,
                                   "source": "heuristic",
                                   "judge": {"endpoint": None, "model": None, "version": "9a8b7c6d5e4f"}}]}
    placed_results = produce(bs, results_topic, [orjson.dumps(trace_line)], keys=[c.shipping_id.encode()])
    placed = produce(bs, sessions_topic, [s.to_json() for s in (refund_1, shipping_1)],
                     keys=[s.key.encode() for s in (refund_1, shipping_1)])
    config = {"stream": {"lag_interval_seconds": 0.5},
              "sessions": {"results_topic": sessions_topic},
              "sink": {"results_topic": results_topic, "checkpoint_interval_ms": 100,
                       "mlflow": {"tracking_uri": server.url, "experiment_id": c.experiment}}}

    def committed(group_id: str, want: list[tuple[int, int]]) -> bool:
        return caught_up(bs, group_id, sessions_topic, want)

    proc = SinkProcess(bs, "mlflow", config, "--group-id", group).wait_ready()
    try:
        wait_until(lambda: committed(group, placed)
                   and caught_up(bs, group, results_topic, placed_results), 90,
                   message=lambda: f"both topics committed; log:\n{proc.log[-3000:]}")
        assert f"{results_topic} (results) and {sessions_topic} (session results)" in proc.log

        # Each session verdict once, on the session's first trace, with MLflow's session marks.
        refund = session_feedback(server, refund_first, c.refund_id)
        assert Counter(a["assessment_name"] for a in refund) == {"user_frustration": 1,
                                                                 "conversation_completeness": 1}
        for a in refund:
            meta = a["metadata"]
            assert meta["mlflow.trace.session"] == c.refund_id
            assert meta["mlflow.assessment.scorerName"] == a["assessment_name"]
            assert (meta["tracejudge.evaluation"], meta["tracejudge.closeReason"],
                    meta["tracejudge.sessionStatus"], meta["tracejudge.turns"]) == ("1", "inactivity",
                                                                                   "complete", "2")
            assert (meta["tracejudge.source.topic"], meta["tracejudge.source.firstOffset"],
                    meta["tracejudge.source.lastOffset"]) == ("tracejudge-results", "0", "1")
            assert a["span_id"] == c.refund[0]["root_span_id"]  # the root span, as MLflow's session scoring
        by_name = {a["assessment_name"]: a for a in refund}
        assert by_name["user_frustration"]["feedback"]["value"] == "resolved"
        assert by_name["user_frustration"]["source"] == {"source_type": "CODE",
                                                         "source_id": "tracejudge.heuristic"}
        assert by_name["conversation_completeness"]["feedback"]["value"] == "yes"
        assert by_name["conversation_completeness"]["source"] == {"source_type": "LLM_JUDGE",
                                                                  "source_id": "openai:/gpt-4.1-mini"}
        assert by_name["conversation_completeness"]["metadata"]["mlflow.assessment.judgeInputTokens"] == "812"
        shipping = {a["assessment_name"]: a for a in session_feedback(server, shipping_first, c.shipping_id)}
        assert shipping["user_frustration"]["feedback"]["value"] == "none"
        assert shipping["conversation_completeness"]["feedback"]["error"]["error_code"] == "TIMEOUT"
        # Nothing on the other turns' traces but the trace verdict the results topic carried.
        for t in c.refund[1:]:
            assert ours(server.assessments(t["trace_id"])) == []
        assert [a["assessment_name"] for a in ours(server.assessments(c.shipping[1]["trace_id"]))] == \
            ["relevance_to_query"]

        # The refund conversation's third turn came after it closed: evaluated again, it replaces the
        # first evaluation's verdicts (logged first, the old ones deleted after), same names.
        refund_2 = session_result(c.refund_id, turn_refs(c.refund), [frustration("unresolved"),
                                                                     completeness("no")], evaluation=2)
        placed += produce(bs, sessions_topic, [refund_2.to_json()], keys=[refund_2.key.encode()])
        wait_until(lambda: committed(group, placed), 60,
                   message=lambda: f"evaluation 2 committed; log:\n{proc.log[-3000:]}")
        refund = session_feedback(server, refund_first, c.refund_id)
        assert sorted((a["assessment_name"], a["metadata"]["tracejudge.evaluation"],
                       a["feedback"].get("value")) for a in refund) == \
            [("conversation_completeness", "2", "no"), ("user_frustration", "2", "unresolved")]
        assert {a["metadata"]["tracejudge.turns"] for a in refund} == {"3"}
        assert proc.metric("tracejudge_sink_deletes_total", sink="mlflow", outcome="deleted") == 2
        left = {a["assessment_id"]: a for a in server.assessments(refund_first)}
        assert left[human["assessment_id"]]["feedback"] == {"value": "none"}
        assert left[mlflow_own["assessment_id"]]["feedback"] == {"value": "yes"}

        # Redelivered: both evaluations produced again (a producer retry upstream). Still once each.
        written = proc.metric("tracejudge_sink_writes_total", sink="mlflow", outcome="written")
        placed += produce(bs, sessions_topic, [refund_1.to_json(), refund_2.to_json()],
                          keys=[refund_1.key.encode()] * 2)
        wait_until(lambda: committed(group, placed), 60,
                   message=lambda: f"redelivery committed; log:\n{proc.log[-3000:]}")
        assert proc.metric("tracejudge_sink_writes_total", sink="mlflow", outcome="written") == written
        assert proc.metric("tracejudge_sink_skipped_total", sink="mlflow", reason="superseded") == 2
        assert proc.metric("tracejudge_sink_writes_total", sink="mlflow", outcome="already_written") >= 2
        proc.signal(signal.SIGTERM)
        assert proc.finish() == 0
    finally:
        proc.kill()

    def snapshot() -> dict[str, list[tuple[str, str, Any]]]:
        return {t["trace_id"]: sorted((a["assessment_id"], a["assessment_name"],
                                       json.dumps(a.get("feedback"), sort_keys=True))
                                      for a in server.assessments(t["trace_id"]))
                for t in c.refund + c.shipping}

    before = snapshot()
    # A sink whose offsets were never committed replays every line from the start (a new group: the
    # same records a restarted sink re-reads after a crash). Nothing is added, nothing deleted.
    replay = unique("sink-mlflow-replay")
    again = SinkProcess(bs, "mlflow", config, "--group-id", replay).wait_ready()
    try:
        wait_until(lambda: committed(replay, placed), 90,
                   message=lambda: f"replay committed; log:\n{again.log[-3000:]}")
        assert again.metric("tracejudge_sink_writes_total", sink="mlflow", outcome="written") == 0
        assert again.metric("tracejudge_sink_deletes_total", sink="mlflow", outcome="deleted") == 0
        again.signal(signal.SIGTERM)
        assert again.finish() == 0
    finally:
        again.kill()
    assert snapshot() == before


# --- MLflow: corner cases, `write` as the runtime calls it -------------------------------------------


def test_one_batch_with_two_evaluations_writes_the_newer_only(mlflow_server, conversations):
    server, c = mlflow_server, conversations
    session_id = unique("conv-batch")
    registry = CollectorRegistry()
    sink = mlflow_sink(server.url, registry)
    try:
        first = session_result(session_id, turn_refs(c.shipping), [frustration("resolved")])
        second = session_result(session_id, turn_refs(c.shipping), [frustration("unresolved")], evaluation=2)
        report = sink.write(SinkBatch(SESSIONS_TOPIC, 0, [as_record(first, 0), as_record(second, 1)]))
        assert (report.written, report.skipped) == (1, Counter({"superseded": 1}))
        [fb] = session_feedback(server, c.shipping[0]["trace_id"], session_id)
        assert (fb["feedback"]["value"], fb["metadata"]["tracejudge.evaluation"]) == ("unresolved", "2")
        # The same batch offered again (a RetryLater elsewhere, a rebalance): nothing new.
        again = sink.write(SinkBatch(SESSIONS_TOPIC, 0, [as_record(first, 0), as_record(second, 1)]))
        assert (again.written, again.already_written) == (0, 1)
        assert registry.get_sample_value("tracejudge_sink_skipped_total",
                                         {"sink": "mlflow", "reason": "superseded"}) == 2
    finally:
        sink.close()


def test_first_turn_without_an_mlflow_trace_and_traces_mlflow_never_had(mlflow_server, conversations):
    server, c = mlflow_server, conversations
    sink = mlflow_sink(server.url, unknown_trace_attempts=2, unknown_trace_retry_s=0)
    try:
        # The first turn is an inference-log row (no MLflow trace): the first turn MLflow knows holds it.
        row = TurnRef(trace_id=None, request_id="row-1", mlflow_trace_id=None, timestamp=1_790_000_000.0)
        mixed_id = unique("conv-mixed")
        mixed = session_result(mixed_id, [row, *turn_refs(c.shipping)], [frustration("none")])
        # No turn MLflow knows: nothing to hang it on.
        rows_only = session_result(unique("conv-rows"), [row], [frustration("none")])
        # A trace that never reached this server: looked for, then skipped, never retried for ever.
        ghost = TurnRef(trace_id="5" * 32, mlflow_trace_id="tr-" + "5" * 32, timestamp=1_790_000_000.0)
        unknown = session_result(unique("conv-ghost"), [ghost], [frustration("none")])
        batch = SinkBatch(SESSIONS_TOPIC, 0, [as_record(mixed, 0), as_record(rows_only, 1),
                                              as_record(unknown, 2)])
        first = sink.write(batch)
        assert first.written == 1 and list(first.deferred) == [2]  # the ghost's record waits, parked
        assert first.deferred[2].reason == "unknown_trace"
        report = sink.write(batch)
        assert report.given_up == Counter({"unknown_trace": 1}) and not report.deferred
        assert report.skipped == Counter({"no_trace_id": 1, "unknown_trace": 1})
        assert report.already_written == 1  # the first offer wrote it
        [fb] = session_feedback(server, c.shipping[0]["trace_id"], mixed_id)
        assert fb["metadata"]["tracejudge.turns"] == "3"
    finally:
        sink.close()


# MLflow's own session-level scoring, run by MLflow itself (`mlflow.genai.evaluate` with a custom scorer
# that takes the session): where it logs a session verdict is where the traces list shows one.
_MLFLOW_SESSION_SCORER = r'''
import json, os, sys
import mlflow
from mlflow.entities import Feedback
from mlflow.genai.scorers import scorer

mlflow.set_experiment(experiment_id=os.environ["MLFLOW_EXPERIMENT_ID"])


@scorer(name="mlflow_session_check")
def mlflow_session_check(session) -> Feedback:
    return Feedback(value="no", rationale=f"{len(session)} turns")


session = sys.stdin.read().strip()
traces = mlflow.search_traces(locations=[os.environ["MLFLOW_EXPERIMENT_ID"]],
                              filter_string=f"metadata.`mlflow.trace.session` = '{session}'")
mlflow.genai.evaluate(data=traces, scorers=[mlflow_session_check])
'''


def test_the_traces_list_shows_a_session_verdict_where_mlflow_shows_its_own(
        broker: Any, mlflow_server: MlflowServer) -> None:
    server, c = mlflow_server, Conversations(mlflow_server)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OTEL_"))}
    env.update(QUIET_ENV)
    env.update({"MLFLOW_TRACKING_URI": server.url, "MLFLOW_EXPERIMENT_ID": c.experiment})
    proc = subprocess.run([sys.executable, "-c", _MLFLOW_SESSION_SCORER], input=c.refund_id, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    bs = broker.bootstrap_servers
    sessions_topic, group = unique("session-results"), unique("sink-mlflow-view")
    verdict = session_result(c.refund_id, turn_refs(c.refund),
                             [frustration("unresolved"), completeness("no")])
    placed = produce(bs, sessions_topic, [verdict.to_json(), verdict.to_json()],  # and a redelivery
                     keys=[verdict.key.encode()] * 2)
    config = {"sessions": {"results_topic": sessions_topic},
              "sink": {"results_topic": unique("results"), "checkpoint_interval_ms": 100,
                       "mlflow": {"tracking_uri": server.url, "experiment_id": c.experiment}}}
    sink = SinkProcess(bs, "mlflow", config, "--group-id", group).wait_ready()
    try:
        wait_until(lambda: caught_up(bs, group, sessions_topic, placed), 90,
                   message=lambda: f"committed; log:\n{sink.log[-3000:]}")
        sink.signal(signal.SIGTERM)
        assert sink.finish() == 0
    finally:
        sink.kill()

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=server.url)
    # The traces list of the conversation, as the UI's session view searches it.
    listed = client.search_traces(locations=[c.experiment],
                                  filter_string=f"metadata.`mlflow.trace.session` = '{c.refund_id}'")
    assert sorted(t.info.trace_id for t in listed) == sorted(t["trace_id"] for t in c.refund)

    def session_verdicts(name: str) -> list[tuple[str, Any]]:
        return [(t.info.trace_id, a) for t in listed for a in t.info.assessments if a.name == name]

    [(mlflow_trace, mlflow_own)] = session_verdicts("mlflow_session_check")
    for name, value in (("user_frustration", "unresolved"), ("conversation_completeness", "no")):
        [(trace, ours_)] = session_verdicts(name)  # once, the redelivery added nothing
        # On the trace, and the span, MLflow put its own session verdict on, with the same session mark.
        assert trace == mlflow_trace == c.refund[0]["trace_id"]
        assert ours_.span_id == mlflow_own.span_id == c.refund[0]["root_span_id"]
        assert ours_.metadata["mlflow.trace.session"] == mlflow_own.metadata["mlflow.trace.session"] \
            == c.refund_id
        assert ours_.value == value
    # Searching the traces list by a session verdict finds every turn of the conversation (MLflow scopes
    # an assessment marked with `mlflow.trace.session` to its session), exactly as for MLflow's own.
    def found(filter_string: str) -> list[str]:
        return sorted(t.info.trace_id for t in client.search_traces(locations=[c.experiment],
                                                                    filter_string=filter_string))

    conversation = sorted(t["trace_id"] for t in c.refund)
    assert found("feedback.mlflow_session_check = 'no'") == conversation
    assert found("feedback.user_frustration = 'unresolved'") == conversation
    assert found("feedback.conversation_completeness = 'no'") == conversation
    assert found("feedback.user_frustration = 'none'") == []  # not the other conversation, not a value


# --- OTLP: the real `tracejudge sink otlp` ---------------------------------------------------------------


def test_tracejudge_sink_otlp_sends_one_event_per_session_verdict_on_the_last_turn(
        broker: Any, conversations: Conversations, receiver: OtlpReceiver) -> None:
    c = conversations
    bs = broker.bootstrap_servers
    results_topic, sessions_topic, group = unique("results"), unique("session-results"), unique("sink-otlp")
    refund = session_result(c.refund_id, turn_refs(c.refund), [frustration("unresolved"), completeness("no")],
                            evaluation=2)
    shipping = session_result(c.shipping_id, turn_refs(c.shipping),
                              [frustration("none"), completeness("", error="timeout: no answer in 30 s")],
                              close_reason="max_turns")
    placed = produce(bs, sessions_topic, [s.to_json() for s in (refund, shipping)],
                     keys=[s.key.encode() for s in (refund, shipping)])
    config = {"sessions": {"results_topic": sessions_topic},
              "sink": {"results_topic": results_topic, "checkpoint_interval_ms": 100,
                       "otlp": {"endpoint": receiver.endpoint, "emit_spans": True}}}
    proc = SinkProcess(bs, "otlp", config, "--group-id", group).wait_ready()
    try:
        wait_until(lambda: caught_up(bs, group, sessions_topic, placed), 60,
                   message=lambda: f"committed; log:\n{proc.log[-3000:]}")
        proc.signal(signal.SIGTERM)
        assert proc.finish() == 0
    finally:
        proc.kill()

    events = receiver.events(EVENT_NAME)
    assert len(events) == 4  # one per session verdict
    for session, traces in ((refund, c.refund), (shipping, c.shipping)):
        last = traces[-1]
        mine = [e for e in events if e.attributes["session.id"] == session.session_id]
        assert sorted(e.attributes["gen_ai.evaluation.name"] for e in mine) == \
            ["conversation_completeness", "user_frustration"]
        for e in mine:
            assert e.trace_id == last["trace_id"].removeprefix("tr-")
            assert e.span_id == last["root_span_id"]
            attrs = e.attributes
            assert attrs["gen_ai.conversation.id"] == session.session_id
            assert attrs["tracejudge.evaluation.target"] == "session"
            assert attrs["tracejudge.session.evaluation"] == session.evaluation
            assert attrs["tracejudge.session.close_reason"] == session.close_reason
            assert attrs["tracejudge.session.turns"] == len(traces)
            assert attrs["tracejudge.app"] == "support-bot"
            assert attrs["tracejudge.result.topic"] == sessions_topic
    by = {(e.attributes["session.id"], e.attributes["gen_ai.evaluation.name"]): e for e in events}
    unresolved = by[(c.refund_id, "user_frustration")].attributes
    assert (unresolved["tracejudge.evaluation.value"], unresolved["gen_ai.evaluation.score.label"]) == \
        ("unresolved", "fail")
    timed_out = by[(c.shipping_id, "conversation_completeness")]
    assert timed_out.attributes["error.type"] == "timeout" and timed_out.severity_text == "WARN"
    # emit_spans: one span per verdict, a child of the last turn's root span.
    spans = receiver.spans()
    assert len(spans) == 4
    assert {(s.trace_id, s.parent_span_id) for s in spans} == {
        (t[-1]["trace_id"].removeprefix("tr-"), t[-1]["root_span_id"]) for t in (c.refund, c.shipping)}


def test_otlp_session_verdict_ids_differ_per_evaluation_and_repeat_on_redelivery(conversations, receiver):
    c = conversations
    settings = OtlpSinkSettings.from_mapping({"endpoint": receiver.endpoint}, env={})
    first = session_result(c.refund_id, turn_refs(c.refund[:2]), [frustration("resolved")])
    second = session_result(c.refund_id, turn_refs(c.refund), [frustration("unresolved")], evaluation=2)
    orphan = session_result(unique("conv-rows"), [TurnRef(request_id="row-1", timestamp=1_790_000_000.0)],
                            [frustration("none")])
    batch = SinkBatch(SESSIONS_TOPIC, 0, [as_record(first, 0), as_record(second, 1), as_record(orphan, 2)])
    one, other = OtlpSink(settings, CollectorRegistry()), OtlpSink(settings, CollectorRegistry())
    try:
        report = one.write(batch)
        assert (report.written, report.skipped) == (2, Counter({"no_trace_id": 1}))
        assert other.write(batch).written == 2  # a restarted process: sent again (at least once)
    finally:
        one.close()
        other.close()
    events = receiver.events(EVENT_NAME)
    ids = Counter(e.attributes["tracejudge.evaluation.id"] for e in events)
    assert len(ids) == 2 and set(ids.values()) == {2}
    # Each evaluation hangs on its own last turn: the second turn, then (re-evaluated) the third.
    assert sorted((e.attributes["tracejudge.session.evaluation"], e.span_id) for e in events) == \
        [(1, c.refund[1]["root_span_id"])] * 2 + [(2, c.refund[2]["root_span_id"])] * 2
