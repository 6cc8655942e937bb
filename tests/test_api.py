"""The public API a user's test suite calls: `from tracejudge import evaluate, Evaluator`."""

from __future__ import annotations

import pytest
from support.mlflow_apps import run as run_app
from support.openai_stub import OpenAIStub, Reply

import tracejudge
from tracejudge import Evaluator, RecordError, evaluate

CONTEXT = ["Refunds are accepted within 30 days of purchase.", "Shipping takes 3 to 5 business days."]


def test_heuristic_judges_from_keywords_pass_grounded_and_fail_made_up_answers():
    good = evaluate(request="What is the refund window?", response="Refunds are accepted within 30 days.",
                    context=CONTEXT, judges={})
    assert good.assessment("groundedness").passed is True
    assert good.assessment("groundedness").source == "heuristic"
    assert good.passed
    bad = evaluate(request="What is the refund window?", response="Refunds take 90 days and cost 15 euros.",
                   context=CONTEXT, judges={})
    assert bad.assessment("groundedness").passed is False
    assert "90 days" in bad.assessment("groundedness").rationale
    assert not bad.passed


def test_llm_judge_through_a_real_openai_compatible_endpoint():
    with OpenAIStub() as stub:
        stub.enqueue(Reply.verdict("no", rationale="The answer says 90 days; the document says 30."))
        judges = {"endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model"}},
                  "sample_rate": 1.0, "builtin": {"relevance_to_query": {}}}
        result = evaluate(request="What is the refund window?", response="Refunds take 90 days.",
                          context=CONTEXT, judges=judges)
        verdict = result.assessment("relevance_to_query")
        assert verdict.passed is False and verdict.score == 0.0
        assert verdict.rationale == "The answer says 90 days; the document says 30."
        assert verdict.source and verdict.source.startswith("llm:")
        assert stub.count("/chat/completions") == 1
        assert "What is the refund window?" in stub.chat_requests()[0].prompt


def test_any_input_format_and_many_records_keep_order():
    trace_json = run_app("rag")  # a real MLflow 3 trace
    with Evaluator(judges={}) as evaluator:
        results = list(evaluator.evaluate_many([
            trace_json,
            {"request": "q2", "response": "a2", "request_id": "second"},
            tracejudge.EvalRecord(request_id="third", request="q3", response="a3"),
        ]))
    assert [r.record.source_format for r in results] == ["mlflow_v3", "agent_eval", "unknown"]
    assert results[1].record.request_id == "second" and results[2].record.request_id == "third"
    assert results[0].record.retrieved_context  # derived from the trace's retriever span
    assert results[0].metrics["latency_seconds"] is not None


def test_same_scores_as_the_offline_command(tmp_path):
    """The API and `tracejudge eval` share the pipeline: identical metrics and assessments."""
    import json
    import subprocess
    import sys

    record = {"request_id": "r", "request": "What is the refund window?",
              "response": "Refunds are accepted within 30 days.",
              "retrieved_context": [{"content": c} for c in CONTEXT]}
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "c.yaml").write_text("judges: {}\n")
    cmd = [sys.executable, "-m", "tracejudge.consumer.commands.cli", "eval", str(tmp_path / "in.jsonl"),
           "--config", str(tmp_path / "c.yaml"), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, check=True, timeout=120)
    offline = json.loads(proc.stdout)
    api = evaluate(record, config=str(tmp_path / "c.yaml")).to_dict()
    strip = ("duration_seconds",)
    assert [{k: v for k, v in a.items() if k not in strip} for a in api["assessments"]] == \
        [{k: v for k, v in a.items() if k not in strip} for a in offline["assessments"]]
    assert api["metrics"] == offline["metrics"]


def test_bad_input_and_misuse_are_named():
    with pytest.raises(RecordError, match="request"):
        evaluate({"request": 42, "response": "x"})
    with pytest.raises(TypeError, match="nothing to evaluate"):
        evaluate()
    with pytest.raises(tracejudge.JudgeConfigError, match="judges"):
        evaluate(request="q", response="a", judges={"builtin": {"no_such_judge": {}}})
