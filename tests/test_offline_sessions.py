"""Sessions offline and in the Python API: `tracejudge eval` groups a file's turns into sessions (the end
of the input closes them) and writes one session result line per session after the trace results;
`evaluate_session` evaluates a list of turns as one session. Real MLflow traces (real `mlflow`
tracing with the session metadata MLflow documents) and agent-evaluation rows with a session column.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import mlflow
import orjson
import pytest
import yaml
from mlflow.entities import SpanType
from support import mlflow_apps

import tracejudge
from tracejudge import EvalRecord, Evaluator, SessionResult, evaluate_session

TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]

# (session, user, question, answer): a calm conversation, a user who repeats and gives up, and one
# request outside any conversation (session None).
SCRIPT: list[tuple[str | None, str | None, str, str]] = [
    ("calm", "u-1", "How do I reset my password?", "Use the reset link on the sign-in page."),
    ("angry", "u-2", "Can I export my boards to CSV?", "I am not sure."),
    (None, None, "What plans do you offer?", "Free, Team and Enterprise."),
    ("angry", "u-2", "I asked: can I export my boards to CSV?", "I cannot help with that."),
    ("calm", "u-1", "Does the reset link expire?", "Yes, after 24 hours."),
    ("angry", "u-2", "Forget it, this is useless.", "Sorry to hear that."),
]


def _mlflow_traces(script: Sequence[tuple[str | None, str | None, str, str]]) -> list[dict]:
    """One real MLflow 3 trace per turn, each starting a second after the previous one (explicit span
    times: captured traces can share a millisecond), with `mlflow.trace.session`/`mlflow.trace.user`."""
    start = time.time_ns() - 3600 * 10**9
    with mlflow_apps.capture(seed=23) as sink:
        for i, (session, user, question, answer) in enumerate(script):
            metadata = {"mlflow.trace.session": session, "mlflow.trace.user": user} if session else {}
            t0 = start + i * 10**9
            root = mlflow.start_span_no_context("support_agent", span_type=SpanType.AGENT,
                                                inputs={"messages": [{"role": "user", "content": question}]},
                                                metadata=metadata, start_time_ns=t0)
            root.end(outputs=answer, end_time_ns=t0 + 200_000_000)
    assert len(sink) == len(script)
    return [json.loads(t) for t in sink]


def _eval(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*TRACEJUDGE, "eval", *args], capture_output=True, timeout=120, check=False)


def _config(path: Path, body: dict) -> Path:
    path.write_text(yaml.safe_dump(body))
    return path


def _split(out: bytes) -> tuple[list[dict], list[dict]]:
    lines = [orjson.loads(line) for line in out.splitlines()]
    kinds = [line.get("kind") == "session" for line in lines]
    # Every session line comes after every trace result.
    assert kinds == sorted(kinds), kinds
    return [x for x in lines if x.get("kind") != "session"], [x for x in lines if x.get("kind") == "session"]


def test_eval_writes_one_session_line_per_conversation_after_the_trace_results(tmp_path):
    traces = _mlflow_traces(SCRIPT)
    trace_ids = [t["info"]["trace_id"] for t in traces]
    # The file is in the reverse order: the turns of a session are ordered by their timestamps.
    src = tmp_path / "traces.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in reversed(traces)))
    out = tmp_path / "out.jsonl"
    config = _config(tmp_path / "tj.yaml", {"judges": {}})
    proc = _eval(str(src), "--config", str(config), "--output", str(out))
    assert proc.returncode == 0, proc.stderr.decode()

    results, sessions = _split(out.read_bytes())
    assert len(results) == 6
    assert {r["session_id"] for r in results} == {"calm", "angry", None}
    # In the order their first turn appears in the file ("angry" comes first, reversed).
    assert [s["session_id"] for s in sessions] == ["angry", "calm"]
    angry, calm = (SessionResult.from_dict(s) for s in sessions)

    assert angry.user_id == "u-2" and calm.user_id == "u-1"
    assert (angry.status, angry.close_reason, angry.evaluation) == ("complete", "end_of_input", 1)
    assert [t.mlflow_trace_id for t in angry.turns] == [trace_ids[1], trace_ids[3], trace_ids[5]]
    assert [t.mlflow_trace_id for t in calm.turns] == [trace_ids[0], trace_ids[4]]
    assert angry.first_turn.mlflow_trace_id == trace_ids[1]
    assert not any(t.placed_by_arrival for t in angry.turns + calm.turns)
    assert angry.metrics["turns"] == 3.0 and calm.metrics["turns"] == 2.0
    assert angry.metrics["failed_turns"] == 0.0 and angry.metrics["turns_until_first_failure"] is None
    # First turn's start to the last turn's end: 4 s apart plus the last turn's 0.2 s.
    assert angry.metrics["duration_seconds"] == pytest.approx(4.2, abs=0.01)
    assert angry.started_at == pytest.approx(angry.turns[0].timestamp)
    assert angry.source.file == str(src)

    # The heuristic user_frustration judge (no endpoint): the user who repeated and gave up.
    frustration = angry.assessment("user_frustration")
    assert (frustration.value, frustration.passed, frustration.source) == ("unresolved", False, "heuristic")
    assert "repeats turn 1" in frustration.rationale
    assert calm.assessment("user_frustration").value == "none"

    stderr = proc.stderr.decode()
    assert re.search(r"sessions +2 \(5 turns; 1 record without a session id\)", stderr), stderr
    assert re.search(r"session judge user_frustration +unresolved 50\.0% \(n=2; none 1, unresolved 1\)",
                     stderr), stderr


def test_agent_eval_rows_with_a_session_column_without_judges(tmp_path):
    rows = [
        {"request_id": "r1", "session_id": "chat-1", "user_id": "ana", "request": "Hi", "response": "Hello!"},
        {"request_id": "r2", "session_id": "chat-2", "request": "Refund window?", "response": "30 days."},
        {"request_id": "r3", "session_id": "chat-1", "request": "Shipping time?", "response": "3 days."},
        {"request_id": "r4", "request": "No session", "response": "Fine."},
    ]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _eval(str(src))
    assert proc.returncode == 0, proc.stderr.decode()
    results, sessions = _split(proc.stdout)
    assert [r["request_id"] for r in results] == ["r1", "r2", "r3", "r4"]
    assert [(s["session_id"], s["user_id"]) for s in sessions] == [("chat-1", "ana"), ("chat-2", None)]
    chat1 = SessionResult.from_dict(sessions[0])
    # Rows state no time: placed by arrival (one time for the whole run), in input order.
    assert [t.request_id for t in chat1.turns] == ["r1", "r3"]
    assert all(t.placed_by_arrival for t in chat1.turns)
    assert chat1.metrics["turns"] == 2.0 and chat1.assessments == []
    assert chat1.metrics["tool_calls"] == 0.0
    assert "sessions" in proc.stderr.decode()


def test_fail_under_gates_on_a_session_judge(tmp_path):
    src = tmp_path / "traces.jsonl"
    src.write_text("".join(json.dumps(t) + "\n" for t in _mlflow_traces(SCRIPT)))
    config = _config(tmp_path / "tj.yaml", {"judges": {}})
    # Mean user_frustration score: none 1.0 and unresolved 0.0.
    failing = _eval(str(src), "--config", str(config), "--fail-under", "user_frustration=0.9", "-q")
    assert failing.returncode == 1
    assert "user_frustration: mean score 0.500 is below --fail-under 0.9" in failing.stderr.decode()
    passing = _eval(str(src), "--config", str(config), "--fail-under", "user_frustration=0.4", "-q")
    assert passing.returncode == 0, passing.stderr.decode()


def test_a_file_without_sessions_has_no_session_lines_and_no_sessions_block(tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"request": "Hi", "response": "Hello"}) + "\n")
    proc = _eval(str(src))
    assert proc.returncode == 0, proc.stderr.decode()
    results, sessions = _split(proc.stdout)
    assert len(results) == 1 and sessions == []
    assert "sessions" not in proc.stderr.decode()


# -- the Python API --------------------------------------------------------------------------------


def test_evaluate_session_of_plain_turns_judges_the_conversation():
    turns = [
        {"request": "How do I reset my password?", "response": "Use the link on the sign-in page."},
        {"request": "How do I reset my password??", "response": "Use the link on the sign-in page.",
         "context": ["Reset your password with the link on the sign-in page."]},
        {"request": "Forget it, I will call support.", "response": "Sorry to hear that."},
    ]
    session = evaluate_session(turns, judges={})
    assert isinstance(session, tracejudge.SessionResult)
    assert session.metrics["turns"] == 3.0
    assert session.assessment("user_frustration").value == "unresolved"
    assert session.close_reason == "end_of_input" and session.status == "complete"
    # No id stated: one derived from the turns, the same in every run (and so the same sampling).
    assert session.session_id.startswith("session-")
    assert evaluate_session(turns, judges={}).session_id == session.session_id
    assert evaluate_session(turns[:2], judges={}).session_id != session.session_id
    assert evaluate_session(turns, "mine", judges={}).session_id == "mine"
    # Judges off (the default without a config): the metrics only.
    assert evaluate_session(turns).assessments == []


def test_evaluator_evaluate_session_orders_turns_and_takes_ids_from_them():
    t0 = 1_750_000_000.0
    turns = [
        EvalRecord(request_id="b", session_id="s-9", user_id="ana", request="And shipping?",
                   response=None, failed=True, error="timeout", timestamp=t0 + 10, latency_seconds=2.0),
        EvalRecord(request_id="a", session_id="s-9", request="Refund window?", response="30 days.",
                   timestamp=t0, latency_seconds=1.0),
    ]
    with Evaluator(judges={}) as evaluator:
        session = evaluator.evaluate_session(turns)
        assert (session.session_id, session.user_id) == ("s-9", "ana")
        assert [t.request_id for t in session.turns] == ["a", "b"]
        assert session.metrics["duration_seconds"] == 12.0
        assert session.metrics["failed_turns"] == 1.0
        assert session.metrics["turns_until_first_failure"] == 2.0
        assert session.metrics["last_turn_failed"] == 1.0
        # A failed last turn reads as unresolved to the heuristic judge.
        assert session.assessment("user_frustration").value == "unresolved"
        with pytest.raises(ValueError, match="more than one session_id"):
            evaluator.evaluate_session([*turns, EvalRecord(session_id="other", request="x")])
        assert evaluator.evaluate_session([*turns, EvalRecord(session_id="other", request="x")],
                                          "forced").metrics["turns"] == 3.0
        with pytest.raises(ValueError, match="at least one turn"):
            evaluator.evaluate_session([])


def test_evaluate_session_of_real_mlflow_traces_reads_the_session_metadata():
    traces = [t for t, step in zip(_mlflow_traces(SCRIPT), SCRIPT, strict=True) if step[0] == "angry"]
    session = evaluate_session([json.dumps(t) for t in reversed(traces)], judges={})
    assert (session.session_id, session.user_id) == ("angry", "u-2")
    assert [t.mlflow_trace_id for t in session.turns] == [t["info"]["trace_id"] for t in traces]
    assert session.assessment("user_frustration").value == "unresolved"
    # The same as `tracejudge eval` writes for that session.
    assert session.metrics["duration_seconds"] == pytest.approx(4.2, abs=0.01)


def test_evaluate_session_with_a_model_judge_through_a_real_openai_compatible_endpoint():
    from support.openai_stub import OpenAIStub, Reply

    turns = [{"request": "How do I reset my password?", "response": "Use the reset link."},
             {"request": "Thanks, that worked.", "response": "Glad to help!"}]
    with OpenAIStub() as stub:
        stub.enqueue(Reply.verdict("none", rationale="The user got what they asked for."))
        judges = {"endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model"}},
                  "sample_rate": 1.0, "sessions": {"user_frustration": {}}}
        session = evaluate_session(turns, "chat-7", judges=judges)
        verdict = session.assessment("user_frustration")
        assert (verdict.value, verdict.score, verdict.passed) == ("none", 1.0, True)
        assert verdict.source and verdict.source.startswith("llm:")
        assert verdict.rationale.startswith("The user got what they asked for.")
        assert stub.count("/chat/completions") == 1
        prompt = stub.chat_requests()[0].prompt
        assert "How do I reset my password?" in prompt and "Thanks, that worked." in prompt
