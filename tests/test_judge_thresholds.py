"""Every verdict decided by comparing a score to a threshold states that threshold (`Assessment.threshold`,
schema 6), on the score's [0, 1] scale, so the MLflow sink can write it beside the Pass/Fail: the LLM
judges against the loopback OpenAI-compatible stub (real httpx), the heuristic judges, a numeric custom
judge (its `pass_threshold` mapped to the score's scale), a session judge. A verdict that applies none (a
yes/no answer, a label) states none, and neither does an error."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from support.openai_stub import OpenAIStub, Reply

from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.sessions import Conversation, SessionJudgeRunner
from tracejudge.schemas.record import Document, EvalRecord
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef
from tracejudge.schemas.session import Turn


def rag_record(**kw: Any) -> EvalRecord:
    base: dict[str, Any] = dict(
        trace_id="0af7651916cd43dd8448eb211c80319c", app="shop", failed=False,
        request="What is the return window for items?",
        response="You can return items within 30 days. Refunds go to the original card.",
        retrieved_context=[Document("Items can be returned within 30 days of delivery.", "kb://returns"),
                           Document("Refunds are issued to the original payment method.", "kb://refunds")],
    )
    base.update(kw)
    return EvalRecord(**base)


def judge_one(stub: OpenAIStub, name: str, *, builtin: dict[str, Any] | None = None,
              custom: dict[str, Any] | None = None, record: EvalRecord | None = None) -> Assessment:
    config = {"endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model",
                                        "embedding_model": "embed-model", "backoff_initial_seconds": 0.01,
                                        "timeout_seconds": 5.0}},
              "sample_rate": 1.0, "builtin": builtin or {}, "custom": custom or {}}
    runner = JudgeRunner(config, registry=CollectorRegistry())
    try:
        return next(a for a in runner.judge_sync(record or rag_record()) if a.name == name)
    finally:
        runner.close()


def test_groundedness_states_its_default_threshold_and_a_configured_one(stub: OpenAIStub) -> None:
    stub.responder = lambda req: Reply.verdicts({1: "yes", 2: "no"})
    a = judge_one(stub, "groundedness", builtin={"groundedness": {}})
    assert (a.value, a.score, a.passed, a.threshold) == ("no", 0.5, False, 1.0)
    b = judge_one(stub, "groundedness", builtin={"groundedness": {"threshold": 0.5}})
    assert (b.value, b.score, b.passed, b.threshold) == ("yes", 0.5, True, 0.5)


def test_chunk_relevance_and_guidelines_state_theirs(stub: OpenAIStub) -> None:
    stub.responder = lambda req: Reply.verdict("yes" if "30 days" in req.prompt else "no")
    a = judge_one(stub, "chunk_relevance", builtin={"chunk_relevance": {"threshold": 0.6}})
    assert (a.score, a.passed, a.threshold) == (0.5, False, 0.6)
    stub.responder = lambda req: Reply.verdicts({1: "yes"})
    g = judge_one(stub, "guidelines", builtin={"guidelines": {"guidelines": ["Be polite."]}})
    assert (g.value, g.passed, g.threshold) == ("yes", True, 1.0)


def test_a_yes_no_judge_applies_no_threshold_and_an_error_states_none(stub: OpenAIStub) -> None:
    stub.responder = lambda req: Reply.verdict("no")
    a = judge_one(stub, "fact_check", builtin={"fact_check": {}},
                  record=rag_record(expected_facts=["Returns within 30 days."]))
    assert a.passed is False and a.threshold is None
    stub.responder = lambda req: Reply.chat("no idea")
    e = judge_one(stub, "groundedness", builtin={"groundedness": {}})
    assert e.error is not None and e.passed is None and e.threshold is None


@pytest.mark.parametrize(("pass_threshold", "threshold", "passed"), [(7, 0.7, True), (8, 0.8, False),
                                                                     (None, 0.5, True)])
def test_a_numeric_custom_judge_states_its_pass_threshold_on_the_score_scale(
    stub: OpenAIStub, pass_threshold: int | None, threshold: float, passed: bool
) -> None:
    stub.responder = lambda req: Reply.chat({"rationale": "ok", "score": 7})
    cfg: dict[str, Any] = {"prompt": "Rate the response {response}", "scale": "numeric", "min_score": 0,
                           "max_score": 10}
    if pass_threshold is not None:
        cfg["pass_threshold"] = pass_threshold
    a = judge_one(stub, "helpfulness", custom={"helpfulness": cfg})
    assert (a.value, a.score, a.passed) == (7, 0.7, passed)
    assert a.threshold == pytest.approx(threshold)
    assert (a.score >= a.threshold) is passed  # the stated threshold is the one `passed` applied


def test_heuristic_judges_state_theirs_and_the_result_line_carries_it() -> None:
    runner = JudgeRunner({"builtin": {"groundedness": {"provider": "heuristic", "threshold": 0.9},
                                      "relevance_to_query": {"provider": "heuristic"}}},
                         registry=CollectorRegistry())
    verdicts = {a.name: a for a in runner.judge_sync(rag_record())}
    runner.close()
    assert verdicts["groundedness"].source == "heuristic" and verdicts["groundedness"].threshold == 0.9
    assert verdicts["relevance_to_query"].threshold == 0.4
    for a in verdicts.values():
        assert (a.score >= a.threshold) is a.passed
    line = EvaluationResult(rag_record(), SourceRef("mlflow_v3"),
                            assessments=list(verdicts.values())).to_dict()
    assert {a["name"]: a["threshold"] for a in line["assessments"]} == {"groundedness": 0.9,
                                                                       "relevance_to_query": 0.4}


def _conversation() -> Conversation:
    turns = [Turn(trace_id=f"{i:032x}", request_id=None, mlflow_trace_id=None, root_span_id=None,
                  timestamp=1_750_000_000.0 + i, placed_by_arrival=False, request=q, response=r, failed=False,
                  error=None, input_tokens=None, output_tokens=None, tool_calls=0, latency_seconds=None)
             for i, (q, r) in enumerate([("Where is order 5521?", "It ships tomorrow."),
                                         ("Thanks!", "You are welcome.")])]
    return Conversation("sess-1", "shop", turns)


def test_session_judges_state_theirs_only_when_they_compare_a_score(stub: OpenAIStub) -> None:
    ep = {"base_url": stub.base_url, "model": "judge-model", "backoff_initial_seconds": 0.01}
    r = SessionJudgeRunner({"endpoints": {"default": ep}, "sample_rate": 1.0, "sessions": {
        "conversational_guidelines": {"guidelines": ["Be polite.", "No dates."], "threshold": 0.5},
        "conversation_completeness": {}, "user_frustration": {"provider": "heuristic"}}}, CollectorRegistry())
    stub.responder = lambda req: (Reply.verdicts({1: "yes", 2: "no"}) if "[2] No dates." in req.prompt
                                  else Reply.verdict("yes"))
    verdicts = {a.name: a for a in r.judge_sync(_conversation())}
    r.close()
    guidelines = verdicts["conversational_guidelines"]
    assert (guidelines.score, guidelines.passed, guidelines.threshold) == (0.5, True, 0.5)
    assert verdicts["conversation_completeness"].passed is True
    assert verdicts["conversation_completeness"].threshold is None  # a yes/no answer
    assert verdicts["user_frustration"].passed is True and verdicts["user_frustration"].threshold is None
