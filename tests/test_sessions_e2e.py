"""Conversations end to end, on real traces: real `mlflow` tracing (turns marked with
`mlflow.update_current_trace(metadata={"mlflow.trace.session": ...})`) and OpenTelemetry SDK spans with
`session.id` / `gen_ai.conversation.id`, through the broker, the real `tracejudge run` process (results
keyed by session), and the real `tracejudge sessions` process (one session result per conversation).

Covers: the turns of a session meet on one results partition although their traces are spread over
the partitions of the traces topic; interleaved sessions; a session resumed after it closed (evaluated
again with every turn); a session whose turns span the arrival of a second `tracejudge sessions` in the
group (a rebalance); and the heuristic `user_frustration` judge on a user who repeats and gives up.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
import pytest
import yaml
from mlflow.entities import SpanType
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from support import mlflow_apps
from support.kafka import RunnerProcess, produce, read_topic, unique, wait_until
from support.otel_producers import kafka_messages

from tracejudge.consumer.demo.broker import LocalBroker
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.session import SessionResult

pytestmark = pytest.mark.timeout(300)


@mlflow.trace(span_type=SpanType.AGENT)
def _support_turn(question: str, answer: str, session: str, user: str) -> str:
    mlflow.update_current_trace(metadata={"mlflow.trace.session": session, "mlflow.trace.user": user})
    return answer


def _mlflow_turns(turns: Sequence[tuple[str, str, str, str]]) -> list[str]:
    """One real MLflow trace (`Trace.to_json()`) per (session, user, question, answer), in that order."""
    with mlflow_apps.capture() as sink:
        for session, user, question, answer in turns:
            _support_turn(question, answer, session, user)
    assert len(sink) == len(turns)
    return sink


def _otel_turns(turns: Sequence[tuple[str, str, str, str]]) -> list[Any]:
    """OpenTelemetry SDK spans, one trace per (attribute, session, question, answer): the attribute
    naming the session is `session.id` (OpenInference) or `gen_ai.conversation.id` (GenAI)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tests.sessions")
    for attribute, session, question, answer in turns:
        with tracer.start_as_current_span("invoke_agent helpdesk", kind=SpanKind.INTERNAL, attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helpdesk",
                attribute: session,
                "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [
                    {"type": "text", "content": question}]}]),
                "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
                    {"type": "text", "content": answer}], "finish_reason": "stop"}])}):
            pass
    provider.shutdown()
    return list(exporter.get_finished_spans())


def _config(path: Path, **sessions: Any) -> Path:
    path.write_text(yaml.safe_dump({
        "stream": {"lag_interval_seconds": 0.5, "commit_interval_ms": 100},
        "judges": {},  # heuristic judges: groundedness/relevance on turns, user_frustration on sessions
        "sessions": {"inactivity_s": 1.5, **sessions},
    }))
    return path


def _sessions(bootstrap: str, topic: str, want: dict[str, int],
              timeout: float = 90.0) -> dict[str, SessionResult]:
    """The newest session result per session id once every session in `want` has one with that many
    turns."""
    seen: dict[str, SessionResult] = {}

    def complete() -> bool:
        for message in read_topic(bootstrap, topic, at_least=0, timeout=2.0):
            result = SessionResult.from_dict(json.loads(message.value))
            old = seen.get(result.session_id)
            if old is None or result.evaluation >= old.evaluation:
                seen[result.session_id] = result
        return all(sid in seen and len(seen[sid].turns) == n for sid, n in want.items())

    wait_until(complete, timeout, interval=0.3,
               message=lambda: f"session results for {want}; have "
                               f"{ {k: (len(v.turns), v.evaluation) for k, v in seen.items()} }")
    return seen


def test_sessions_from_real_traces_through_run_and_the_session_stage(broker: LocalBroker,
                                                                     tmp_path: Path) -> None:
    bs = broker.bootstrap_servers
    traces, spans, results, session_results = (unique("s-traces"), unique("s-spans"), unique("s-results"),
                                               unique("s-sessions"))
    rng = random.Random(5)
    # Three MLflow conversations, interleaved turn by turn; one user repeats and gives up.
    script = {
        "chat-a": [("How do I reset my password?", "Use the reset link on the sign-in page."),
                   ("Does the link expire?", "Yes, after 24 hours.")],
        "chat-b": [("Can I export my boards to CSV?", "I am not sure."),
                   ("Can I export my boards to CSV?", "I cannot help with that."),
                   ("Forget it, this is useless.", "Sorry to hear that.")],
        "chat-c": [("What plans do you offer?", "Free, Team and Enterprise.")],
    }
    order = [(sid, i) for sid, turns in script.items() for i in range(len(turns))]
    order.sort(key=lambda t: (t[1], rng.random()))  # interleaved, each session's turns in order
    mlflow_lines = _mlflow_turns([(sid, f"user-{sid[-1]}", *script[sid][i]) for sid, i in order])
    # Two OpenTelemetry conversations: OpenInference's session.id and the GenAI conversation id.
    otel = _otel_turns([("session.id", "otel-1", "Where is my order?", "It ships tomorrow."),
                        ("gen_ai.conversation.id", "otel-2", "Hi", "Hello! How can I help?"),
                        ("session.id", "otel-1", "And the tracking number?", "TRK-123."),
                        ("gen_ai.conversation.id", "otel-2", "Bye", "Goodbye.")])
    produce(bs, traces, [line.encode() for line in mlflow_lines],
            keys=[str(i).encode() for i in range(len(mlflow_lines))])  # spread over the partitions
    produce(bs, spans, [value for _, value in kafka_messages(otel, per_message=1)])

    config = _config(tmp_path / "tj.yaml", results_topic=session_results)
    run = RunnerProcess(bs, "--config", str(config), "--topic", f"{traces}:mlflow", "--topic",
                        f"{spans}:otlp_proto", "--group-id", unique("run"), "--results-topic", results)
    stage = RunnerProcess(bs, "--group-id", unique("sessions"),
                          command=("sessions", "--config", str(config), "--input-topic", results))
    try:
        run.wait_ready()
        stage.wait_ready()
        got = _sessions(bs, session_results,
                        {"chat-a": 2, "chat-b": 3, "chat-c": 1, "otel-1": 2, "otel-2": 2})

        # The turns of each session met on one partition of the results topic.
        by_session: dict[str, set[int]] = defaultdict(set)
        for message in read_topic(bs, results, at_least=len(mlflow_lines) + 4):
            line = json.loads(message.value)
            assert line["schema_version"] == 6
            by_session[line["session_id"]].add(message.partition)
            assert message.key == line["session_id"].encode()
        assert all(len(parts) == 1 for parts in by_session.values()), by_session

        a, b = got["chat-a"], got["chat-b"]
        assert a.user_id == "user-a" and a.status == "complete" and a.close_reason == "inactivity"
        # Each session holds the turns it was asked, ordered by when each trace started as the trace
        # itself states it (not by the partition or the order the traces arrived in). Turns traced
        # within the same millisecond tie, and a tie may come out either way.
        asked: dict[str, dict[str, float]] = defaultdict(dict)
        for (sid, _), line in zip(order, mlflow_lines, strict=True):
            record = normalise(line)
            assert record.timestamp is not None
            asked[sid]["tr-" + str(record.trace_id)] = record.timestamp
        for sid in script:
            ids = [t.mlflow_trace_id for t in got[sid].turns]
            assert sorted(ids) == sorted(asked[sid]), sid
            started = [asked[sid][i] for i in ids]
            assert started == sorted(started), (sid, started)
        assert a.metrics["turns"] == 2 and a.metrics["failed_turns"] == 0
        frustration = {sid: got[sid].assessment("user_frustration") for sid in ("chat-a", "chat-b")}
        assert frustration["chat-a"].value == "none" and frustration["chat-a"].source == "heuristic"
        assert frustration["chat-b"].value == "unresolved" and frustration["chat-b"].passed is False
        assert b.metrics["turns"] == 3
        assert {got[s].user_id for s in ("otel-1", "otel-2")} == {None}

        # Resumed: a turn for chat-c after it closed -> evaluated again, with both turns.
        more = _mlflow_turns([("chat-c", "user-c", "And the Team price?", "10 dollars per seat.")])
        produce(bs, traces, [more[0].encode()])
        again = _sessions(bs, session_results, {"chat-c": 2})["chat-c"]
        assert again.evaluation == 2 and len(again.turns) == 2

    finally:
        stage.signal(15)
        assert stage.finish() == 0, stage.log[-3000:]

    # A session spanning a rebalance: chat-d's first turn is held by one `tracejudge sessions` when a
    # second one joins the group (the partitions are revoked and reassigned: the open session is dropped
    # uncommitted and rebuilt by the partition's next owner from the uncommitted turns); its later turns
    # arrive after the rebalance, and one session result holds all three. A new group reads the results
    # topic from the start; inactivity is longer here than a join takes.
    slow = _config(tmp_path / "slow.yaml", results_topic=session_results, inactivity_s=15)
    group = unique("sessions-rebalance")
    args = ("sessions", "--config", str(slow), "--input-topic", results)
    first = RunnerProcess(bs, "--group-id", group, command=args)
    second = None
    try:
        first.wait_ready()
        turn = _mlflow_turns([("chat-d", "user-d", "Is there an API?", "Yes, a REST API.")])
        produce(bs, traces, [turn[0].encode()])
        wait_until(lambda: _on_topic(bs, results, "chat-d"), 60, message="chat-d on the results topic")
        wait_until(lambda: first.metric("tracejudge_session_turns_held") >= 1, 60,
                   message="chat-d's first turn held")
        second = RunnerProcess(bs, "--group-id", group, command=args).wait_ready()
        assert first.metric("tracejudge_rebalances_total", event="revoked") >= 1
        rest = _mlflow_turns([("chat-d", "user-d", "Rate limits?", "100 requests per minute."),
                              ("chat-d", "user-d", "Thanks", "You are welcome.")])
        produce(bs, traces, [line.encode() for line in rest])
        d = _sessions(bs, session_results, {"chat-d": 3})["chat-d"]
        assert d.metrics["turns"] == 3 and d.evaluation == 1 and d.user_id == "user-d"
    finally:
        for proc in (first, second, run):
            if proc is not None:
                if proc.proc.poll() is None:
                    proc.signal(15)
                assert proc.finish() == 0, proc.log[-3000:]


def _on_topic(bootstrap: str, topic: str, session: str) -> bool:
    return any(json.loads(m.value).get("session_id") == session
               for m in read_topic(bootstrap, topic, at_least=0, timeout=2.0))
