"""The tool-call judges: exact comparison and repeats by code, the model through the loopback stub, the
config, the `expected_tool_calls` input, `tracejudge eval`, and parity with MLflow's own exact scorer on
a real traced trajectory."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from support import mlflow_apps
from support.openai_stub import OpenAIStub, Reply

from tracejudge.consumer.commands.cli import main
from tracejudge.consumer.pipeline import Pipeline
from tracejudge.metrics.judges.config import JudgeConfigError, load_judges_config
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.tool_calls import compare_exact, find_repeats
from tracejudge.schemas.formats.agent_eval import normalise_agent_eval
from tracejudge.schemas.record import EvalRecord, ToolCall
from tracejudge.schemas.result import Assessment

TRAJECTORY = [ToolCall("search", {"query": "refund policy", "top_k": 3}), ToolCall("summarize", {"max": 100})]


def record(**kw: Any) -> EvalRecord:
    base: dict[str, Any] = dict(trace_id="0af7651916cd43dd8448eb211c80319c", failed=False,
                                request="What is the refund policy?", response="30 days.",
                                trajectory=list(TRAJECTORY))
    base.update(kw)
    return EvalRecord(**base)


def judged(config: dict[str, Any], rec: EvalRecord) -> dict[str, Assessment]:
    runner = JudgeRunner(config, registry=CollectorRegistry())
    try:
        return {a.name: a for a in runner.judge_sync(rec)}
    finally:
        runner.close()


def code_config(**correctness: Any) -> dict[str, Any]:
    return {"builtin": {"tool_call_correctness": correctness, "tool_call_efficiency": {}}}


def stub_config(stub: OpenAIStub, **correctness: Any) -> dict[str, Any]:
    return {"endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model",
                                      "backoff_initial_seconds": 0.01, "timeout_seconds": 5.0}},
            "sample_rate": 1.0, **code_config(**correctness)}


def test_exact_ordered_and_unordered_with_arguments_compared_as_json_values():
    expected = [ToolCall("search", {"top_k": 3.0, "query": "refund policy"}),
                ToolCall("summarize", {"max": 100})]
    swapped = list(reversed(expected))
    ok = judged(code_config(ordered=True), record(reference_trajectory=expected))["tool_call_correctness"]
    assert (ok.value, ok.score, ok.passed, ok.source) == ("yes", 1.0, True, "heuristic")
    assert ok.rationale == "All tool calls match expected sequence exactly."
    assert ok.judge is not None and ok.judge.endpoint is None and len(ok.judge.version) == 12

    out_of_order = judged(code_config(ordered=True), record(reference_trajectory=swapped))
    a = out_of_order["tool_call_correctness"]
    assert (a.value, a.passed) == ("no", False)
    assert a.rationale == ('Tool calls do not match in order: position 1: expected summarize({"max":100}), '
                           'got search({"query":"refund policy","top_k":3}) '
                           '(and 1 more mismatched positions)')
    # Unordered (the default, as MLflow's): the same calls in another order pass.
    assert judged(code_config(), record(reference_trajectory=swapped))["tool_call_correctness"].passed is True
    # The version follows the verdict settings (ordered or not), as every judge's does.
    assert a.judge == ok.judge
    unordered = judged(code_config(), record(reference_trajectory=swapped))["tool_call_correctness"]
    assert unordered.judge != ok.judge


def test_argument_mismatch_names_the_first_one_and_names_only_expectations_ignore_arguments():
    wrong = [ToolCall("search", {"query": "shipping", "top_k": 3}), ToolCall("summarize", {"max": 100})]
    a = judged(code_config(), record(reference_trajectory=wrong))["tool_call_correctness"]
    assert a.value == "no"
    assert a.rationale == ('Missing: search({"query":"shipping","top_k":3}); '
                           'Unexpected: search({"query":"refund policy","top_k":3})')
    # compare_arguments: false, or expectations that give no arguments, compare names only.
    assert judged(code_config(compare_arguments=False),
                  record(reference_trajectory=wrong))["tool_call_correctness"].passed is True
    names = [ToolCall("summarize"), ToolCall("search")]
    assert judged(code_config(), record(reference_trajectory=names))["tool_call_correctness"].passed is True
    # A count mismatch says so, then names the first difference.
    short = judged(code_config(ordered=True), record(reference_trajectory=[ToolCall("search")]))
    assert short["tool_call_correctness"].rationale == (
        "Expected 1 tool call(s), but got 2 tool call(s); Tool calls do not match in order: "
        'position 2: expected no call, got summarize({"max":100})')


def test_multiset_matching_and_repeats_in_code():
    a, a1, b = ToolCall("a"), ToolCall("a", {"x": 1}), ToolCall("b")
    # Repeats count (MLflow's sets would call [a, a, b] equal to [a, b, b]).
    assert not compare_exact([a, b, b], [a, a, b], ordered=False, compare_arguments=True).ok
    # A name-only expectation never takes the call a specific one needs.
    assert compare_exact([a1, ToolCall("a", {"x": 2})], [a, a1], ordered=False, compare_arguments=True).ok
    # No arguments and {} are the same call; key order and 1 vs 1.0 do not matter.
    assert find_repeats([ToolCall("t"), ToolCall("t", {}), ToolCall("u", {"k": 1, "j": 2.0}),
                         ToolCall("u", {"j": 2, "k": 1.0})]) == [(1, 0), (3, 2)]


def test_efficiency_flags_exact_repeats_by_code_and_missing_inputs_skip():
    repeated = [*TRAJECTORY, ToolCall("search", {"top_k": 3, "query": "refund policy"})]
    out = judged(code_config(), record(trajectory=repeated))
    eff = out["tool_call_efficiency"]
    assert (eff.value, eff.passed, eff.source) == ("no", False, "heuristic")
    assert eff.rationale == ('Call 3 search({"query":"refund policy","top_k":3}) repeats call 1 '
                             "with the same arguments")
    assert judged(code_config(), record())["tool_call_efficiency"].value == "yes"
    # Without expectations (and no endpoint) correctness is skipped; without a trajectory both are.
    assert out["tool_call_correctness"].skipped == "missing_inputs"
    assert out["tool_call_correctness"].rationale == "missing: expected_tool_calls"
    none = judged(code_config(), record(trajectory=None, reference_trajectory=TRAJECTORY))
    assert none["tool_call_correctness"].rationale == "missing: trajectory"
    assert none["tool_call_efficiency"].skipped == "missing_inputs"
    # An empty trajectory is an answer: no calls were made.
    empty = judged(code_config(), record(trajectory=[], reference_trajectory=TRAJECTORY))
    assert empty["tool_call_correctness"].rationale.startswith("Expected 2 tool call(s), but got 0")
    assert empty["tool_call_efficiency"].value == "yes"


def test_without_expectations_the_model_judges_with_mlflows_prompts(stub: OpenAIStub):
    def answer(req: Any) -> Reply:  # the two judges ask concurrently: answer by prompt
        if "Need for tools" in req.prompt:
            return Reply.verdict("no", "Let's think step by step. summarize was not needed.")
        if "<expected_tool_calls>" in req.prompt:
            return Reply.chat("Yes, looks right.")
        return Reply.verdict("yes")

    stub.responder = answer
    out = judged(stub_config(stub), record())
    a = out["tool_call_correctness"]
    assert (a.value, a.passed, a.source) == ("no", False, "llm:judge-model")
    assert a.rationale == "summarize was not needed."
    assert a.judge is not None and a.judge.endpoint == "default" and a.input_tokens == 40
    prompts = [r.prompt for r in stub.requests]
    assert len(prompts) == 2
    correctness = next(p for p in prompts if "Need for tools" in p)
    assert "<expected_tool_calls>" not in correctness and "What is the refund policy?" in correctness
    assert '1. search({"query":"refund policy","top_k":3})' in correctness
    assert any("Consider the agent's tool usage for redundancy" in p for p in prompts)
    assert out["tool_call_efficiency"].source == "llm:judge-model"

    # With expectations the default is exact code, even with an endpoint: no request is made.
    before = len(stub.requests)
    out = judged(stub_config(stub), record(reference_trajectory=list(TRAJECTORY),
                                           trajectory=[*TRAJECTORY, TRAJECTORY[0]]))
    assert out["tool_call_correctness"].source == "heuristic" and out["tool_call_correctness"].value == "no"
    assert out["tool_call_efficiency"].source == "heuristic" and out["tool_call_efficiency"].value == "no"
    assert len(stub.requests) == before

    # mode: llm compares with the expectations semantically (MLflow's fuzzy mode); an answer that is
    # not the JSON verdict is an error, never a verdict.
    out = judged(stub_config(stub, mode="llm", ordered=True), record(reference_trajectory=list(TRAJECTORY)))
    fuzzy = next(r.prompt for r in list(stub.requests)[before:] if "<expected_tool_calls>" in r.prompt)
    assert "<expected_tool_calls>\nExpected Tool Call 1: search" in fuzzy and "3) Ordering" in fuzzy
    assert out["tool_call_correctness"].error is not None and out["tool_call_correctness"].error.startswith(
        "unparseable")


def test_config_checks():
    cfg = load_judges_config(code_config(mode="exact"))
    settings = cfg.judge_settings()["tool_call_correctness"]
    assert cfg.provider_of("tool_call_correctness", settings) == "heuristic"
    with pytest.raises(JudgeConfigError, match=r"builtin.tool_call_correctness: needs a judge endpoint"):
        load_judges_config(code_config(mode="llm"))
    with pytest.raises(JudgeConfigError, match=r"judges.builtin.tool_call_correctness.ordred: unknown key"):
        load_judges_config(code_config(ordred=True))
    # The defaults of `judges: {}` stay the two heuristic judges.
    assert list(load_judges_config({}).judge_settings()) == ["groundedness", "relevance_to_query"]


def test_expected_tool_calls_input_and_tracejudge_eval(tmp_path, capsys):
    row = {"request_id": "r1", "request": "Weather in Paris?", "response": "Sunny.",
           "trace": mlflow_apps.run("tools"),
           "expected_tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                   {"name": "lookup_order"}, {"name": "get_weather"}, {"name": "flaky_tool"}]}
    rec = normalise_agent_eval(row)
    assert rec.reference_trajectory is not None
    assert rec.reference_trajectory[0].tool_input == {"city": "Paris"}
    assert rec.reference_trajectory[1].tool_input is None
    via_expectations = normalise_agent_eval({"request": "q", "expectations": {
        "expected_tool_calls": [{"name": "a", "arguments": {}}]}})
    assert via_expectations.reference_trajectory == [ToolCall("a", {})]
    assert normalise_agent_eval({"request": "q", "expectations": {
        "expected_tool_calls": [{"name": "a"}, {"arguments": {}}]}}).reference_trajectory is None

    wrong = {**row, "request_id": "r2", "expected_tool_calls": [{"name": "get_weather"}]}
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in (row, wrong)))
    config = tmp_path / "tracejudge.yaml"
    config.write_text("judges:\n  builtin:\n    tool_call_correctness: {ordered: true}\n"
                      "    tool_call_efficiency: {}\n")
    assert main(["eval", str(src), "--config", str(config), "--quiet"]) == 0
    results = {r["request_id"]: r for r in map(orjson.loads, capsys.readouterr().out.splitlines())}
    verdicts = {rid: {a["name"]: a for a in r["assessments"]} for rid, r in results.items()}
    assert verdicts["r1"]["tool_call_correctness"]["value"] == "yes"
    assert verdicts["r1"]["tool_call_efficiency"]["value"] == "yes"
    rationale = verdicts["r2"]["tool_call_correctness"]["rationale"]
    assert rationale.startswith("Expected 1 tool call(s), but got 4")


@pytest.mark.parametrize("ordered", [False, True])
def test_a_real_traced_trajectory_lines_up_with_mlflows_exact_scorer(ordered, monkeypatch):
    from mlflow.entities import Trace
    from mlflow.genai.scorers import ToolCallCorrectness

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # MLflow's tool listing must not reach out
    text = mlflow_apps.run("tools")
    rec = Pipeline().normalise(text)
    assert [c.tool_name for c in rec.trajectory or ()] == ["get_weather", "lookup_order", "get_weather",
                                                             "flaky_tool"]
    cases = [
        [{"name": "get_weather", "arguments": {"city": "Paris"}},
         {"name": "lookup_order", "arguments": {"order_id": "A-17", "include_items": True}},
         {"name": "get_weather", "arguments": {"city": "Oslo"}},
         {"name": "flaky_tool", "arguments": {"x": 3}}],
        [{"name": "get_weather"}, {"name": "get_weather"}, {"name": "lookup_order"}, {"name": "flaky_tool"}],
        [{"name": "get_weather", "arguments": {"city": "Rome"}},
         {"name": "lookup_order", "arguments": {"order_id": "A-17", "include_items": True}},
         {"name": "get_weather", "arguments": {"city": "Oslo"}},
         {"name": "flaky_tool", "arguments": {"x": 3}}],
        [{"name": "get_weather"}, {"name": "lookup_order"}],
    ]
    scorer = ToolCallCorrectness(should_exact_match=True, should_consider_ordering=ordered)
    seen = set()
    for expected in cases:
        theirs = scorer(trace=Trace.from_json(text), expectations={"expected_tool_calls": expected})
        mine = judged(code_config(ordered=ordered), normalise_agent_eval(
            {"trace": text, "expected_tool_calls": expected}))["tool_call_correctness"]
        assert mine.value == theirs.value, (expected, mine.rationale, theirs.rationale)
        seen.add(mine.value)
    assert seen == {"yes", "no"}
