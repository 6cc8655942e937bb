"""From production back to the test suite, the whole loop with real parts (issue 27 item 5):

planted failures in a stream of OpenTelemetry-SDK traces on the Tansu broker -> `tracejudge run` (a
process) judges them with the loopback judge server and a `collections:` rule collects the failing ones
to a file and a topic -> a labels file gives the right answers and `tracejudge dataset merge-labels`
makes the regression set -> `tracejudge eval REGRESSION_SET --app` fails for the app as it was (it
reproduces the failure) and passes for the fixed app; the broken app against the fixed app's results
with `--fail-if-worse-than` fails too.

The plant (tests/support/regression_loop.py): four questions answered from a stale page of the
knowledge base, in the second half of the stream only. The production judge says "no" to an answer
holding stale text; the dataset judge decides correctness by the numbers of the expected answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from support.eval_apps import ANSWERS, KNOWLEDGE, correctness_responder
from support.kafka import RunnerProcess, committed_offsets, ends, produce, read_topic, unique, wait_until
from support.openai_stub import OpenAIStub
from support.otel_producers import Producer, genai_trace, kafka_messages
from support.regression_loop import STALE, production_answer, stale_judge_responder

from tracejudge.schemas.result import EvaluationResult

REPO = Path(__file__).resolve().parents[1]
TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]
APPS = "tests.support.regression_loop"
RULE = "stale_answers"


@pytest.fixture
def judges() -> Iterator[tuple[OpenAIStub, OpenAIStub]]:
    """The production judge (groundedness, by stale text) and the dataset judge (correctness)."""
    with OpenAIStub(stale_judge_responder) as production, OpenAIStub(correctness_responder) as dataset:
        yield production, dataset


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("TRACEJUDGE_", "MLFLOW_"))}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TRACEJUDGE, *args], capture_output=True, text=True, timeout=300, check=False,
                          cwd=REPO, env=_env())


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _judges(base_url: str, judge: str) -> dict[str, Any]:
    return {"endpoints": {"default": {"base_url": base_url, "model": "judge-model",
                                      "backoff_initial_seconds": 0.01}},
            "sample_rate": 1.0, "builtin": {judge: {}}}


def _stream() -> tuple[list[tuple[bytes | None, bytes]], set[str], dict[str, str]]:
    """Two rounds of the twelve questions traced by the SDK; in the second round the four stale
    questions are answered from the stale page. Returns the records (three spans a record, so a
    trace spans records), the planted trace ids, and each trace's question."""
    producer = Producer("shop-assistant")
    planted: set[str] = set()
    questions: dict[str, str] = {}
    for round_ in range(2):
        for question, _, _ in KNOWLEDGE:
            stale = round_ == 1 and question in STALE
            recorded = genai_trace(producer.tracer, question, production_answer(question, stale=stale))
            questions[recorded.trace_id] = question
            if stale:
                planted.add(recorded.trace_id)
    return kafka_messages(producer.finished(), per_message=3), planted, questions


def _committed_to_the_end(bs: str, group: str, topic: str, placed: list[tuple[int, int]]) -> bool:
    got = committed_offsets(bs, group, topic)
    return all(got.get(p) == end for p, end in ends(placed).items())


def _results(path: Path) -> list[dict[str, Any]]:
    """An eval output's per-trace results (the SDK traces share a session: its line follows them)."""
    return [r for r in _lines(path) if r.get("kind") != "session"]


def _correctness(path: Path) -> list[str]:
    return [EvaluationResult.from_dict(r).statuses.get("correctness", "-") for r in _results(path)]


def test_planted_failures_are_collected_labelled_and_gate_the_broken_app(broker, judges, tmp_path):
    production_judge, dataset_judge = judges
    bs = broker.bootstrap_servers
    topic, collected_topic, group = unique("shop-traces"), unique("shop-collected"), unique("shop-g")
    records, planted, questions = _stream()
    assert len(planted) == len(STALE) == 4 and len(questions) == 24

    # -- 1. production: `tracejudge run` judges the stream and collects the failing traces -------------
    collected = tmp_path / "stale.jsonl"
    run_config = tmp_path / "run.yaml"
    run_config.write_text(json.dumps({  # JSON is YAML
        "kafka": {"group_id": group},
        "stream": {"topics": [f"{topic}:otlp_proto"], "commit_interval_ms": 100},
        "otlp": {"assembly": {"quiet_period_s": 0.3}},
        "judges": _judges(production_judge.base_url, "groundedness"),
        "collections": [{"name": RULE, "when": [{"judge": "groundedness", "verdict": "failed"}],
                         "file": str(collected), "topic": collected_topic}]}))
    runner = RunnerProcess(bs, "--config", str(run_config))
    try:
        runner.wait_ready()
        placed = produce(bs, topic, [v for _, v in records])
        wait_until(lambda: _committed_to_the_end(bs, group, topic, placed), 120, interval=0.2,
                   message=lambda: f"committed to the end; log:\n{runner.log[-3000:]}")
        # Committed to the end: each record's result and collected rows were out first (the file
        # appended and fsynced), so they are all there now.
        assert len(_lines(collected)) == len(planted)
        assert runner.metric("tracejudge_collected_total", collection=RULE) == len(planted)
        runner.signal(signal.SIGTERM)
        assert runner.finish(60) == 0, runner.log[-3000:]
    finally:
        runner.kill()
    # The production judge saw every trace once: 24 groundedness judgements, 4 of them on stale text.
    asked = production_judge.chat_requests()
    assert len(asked) == len(questions)
    assert sum(any(s in r.prompt for s in STALE.values()) for r in asked) == len(planted)

    rows = _lines(collected)
    assert sorted(r["trace_id"] for r in rows) == sorted(planted)  # exactly the planted traces, once
    for row in rows:
        question = questions[row["trace_id"]]
        assert row["request"] == question and row["response"] == STALE[question]
        assert row["collection"] == RULE and row["expected_response"] is None
        verdict = next(a for a in row["assessments"] if a["name"] == "groundedness")
        assert verdict["status"] == "failed" and STALE[question] in verdict["rationale"]
    on_topic = read_topic(bs, collected_topic, at_least=len(planted), timeout=30)
    assert sorted(orjson.loads(r.value)["trace_id"] for r in on_topic) == sorted(planted)
    assert {r.key.decode() for r in on_topic} == planted

    # -- 2. people label the collected rows with what the answer should have been ---------------------
    labels = tmp_path / "labels.jsonl"
    labels.write_bytes(b"".join(orjson.dumps({"trace_id": r["trace_id"],
                                              "expected_response": ANSWERS[r["request"]][0]}) + b"\n"
                                for r in rows))
    regression = tmp_path / "regression.jsonl"
    merge = _cli("dataset", "merge-labels", str(collected), str(labels), "--out", str(regression))
    assert merge.returncode == 0, merge.stderr
    merged = _lines(regression)
    assert sorted(r["trace_id"] for r in merged) == sorted(planted)
    assert {r["trace_id"]: r["expected_response"] for r in merged} == {
        t: ANSWERS[questions[t]][0] for t in planted}
    assert all(r["response"] == STALE[r["request"]] for r in merged)  # the rest as collected

    # -- 3. the regression set gates the app: broken fails, fixed passes ------------------------------
    eval_config = tmp_path / "eval.yaml"
    eval_config.write_text(json.dumps({"judges": _judges(dataset_judge.base_url, "correctness")}))

    def gate(app: str, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
        return _cli("eval", str(regression), "--config", str(eval_config), "--app", f"{APPS}:{app}",
                    "-o", str(out), *flags)

    broken = gate("stale_app", tmp_path / "broken.jsonl", "--fail-under", "correctness=1")
    assert broken.returncode == 1, broken.stderr
    assert _correctness(tmp_path / "broken.jsonl") == ["failed"] * len(planted)
    assert "correctness: mean score 0.000 is below --fail-under 1.0" in broken.stderr
    # The broken app reproduces the production failure: the same stale answers.
    assert {r["trace_id"]: r["response"] for r in _results(tmp_path / "broken.jsonl")} == {
        r["trace_id"]: r["response"] for r in rows}

    fixed = gate("fixed_app", tmp_path / "fixed.jsonl", "--fail-under", "correctness=1")
    assert fixed.returncode == 0, fixed.stderr
    fixed_rows = _results(tmp_path / "fixed.jsonl")
    assert sorted(r["trace_id"] for r in fixed_rows) == sorted(planted)
    assert _correctness(tmp_path / "fixed.jsonl") == ["passed"] * len(planted)
    assert all(r["response"] == ANSWERS[r["request"]][0] for r in fixed_rows)
    # Production's tool calls are part of the old answer: the app stated none, so none are judged as its.
    calls = [[(c["tool_name"], c["tool_input"]) for c in r["trajectory"]] for r in merged]
    assert calls == [[("population", {"city": "Paris"})]] * len(planted)
    assert all(r["trajectory"] is None for r in fixed_rows)
    assert "correctness: gate passed" in fixed.stderr

    # The broken app against the fixed app's results as the baseline.
    worse = gate("stale_app", tmp_path / "again.jsonl", "--fail-if-worse-than", str(tmp_path / "fixed.jsonl"))
    assert worse.returncode == 1, worse.stderr
    assert f"{len(planted)} rows paired by request" in worse.stderr
    table = next(line for line in worse.stderr.splitlines() if line.strip().startswith("correctness "))
    assert "100.0% (4/4)" in table and "0.0% (0/4)" in table and table.endswith("worse")
    assert "correctness: worse than the baseline" in worse.stderr
    # And the fixed app against the same baseline is not worse.
    same = gate("fixed_app", tmp_path / "same.jsonl", "--fail-if-worse-than", str(tmp_path / "fixed.jsonl"))
    assert same.returncode == 0, same.stderr
