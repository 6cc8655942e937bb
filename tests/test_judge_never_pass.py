"""A judge that did not judge is never a pass.

Offline (`evaluate`, `Evaluator`, `evaluate_session`, `tracejudge eval`) judges every eligible record
unless a sample rate is configured; `passed` is true only when the judges judged and every verdict
passed; a skip, an error or a failed trace is told apart by `judged`, `statuses` and
`why_not_passed`; the `--fail-under` gate fails when errors or skips leave too little evidence. The
stream keeps its sampled default and says so at start-up. All against the real loopback OpenAI stub.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.openai_stub import OpenAIStub, Reply, StubRequest

from tracejudge import EvalRecord, Evaluator, evaluate, evaluate_session
from tracejudge.consumer.config import load_settings
from tracejudge.consumer.stages.run import StreamRunner
from tracejudge.metrics.judges.config import DEFAULT_LLM_SAMPLE_RATE, JudgeConfigError, JudgeSettings
from tracejudge.metrics.judges.sampling import sample_point

CONTEXT = ["Refunds are accepted within 30 days of purchase."]
TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]


def _schema_name(req: StubRequest) -> str:
    rf = req.body.get("response_format") if isinstance(req.body, dict) else None
    schema = rf.get("json_schema") if isinstance(rf, dict) else None
    return str(schema.get("name", "")) if isinstance(schema, dict) else ""


def answer(result: str):
    """A responder giving `result` in whatever shape the judge asked for (one verdict, or one per
    numbered statement for groundedness)."""

    def respond(req: StubRequest) -> Reply:
        if _schema_name(req).endswith("_verdicts"):
            return Reply.verdicts({1: result})
        return Reply.verdict(result, rationale=f"scripted {result}")

    return respond


def endpoint(stub: OpenAIStub, **extra: object) -> dict[str, object]:
    return {"base_url": stub.base_url, "model": "judge-model", **extra}


@pytest.fixture
def stub() -> Iterator[OpenAIStub]:
    with OpenAIStub() as s:
        yield s


# -- the test-suite pattern (docs/pages/guides/test-suite.md): an endpoint, no sample_rate -------


def test_twenty_evaluate_calls_with_an_endpoint_and_no_sample_rate_all_call_the_judge_and_fail(stub):
    """The judge always answers "no": every call judges (no 10% sample offline), none passes."""
    stub.responder = answer("no")
    judges = {"endpoints": {"default": endpoint(stub)}}  # the default model judges, no sample_rate
    results = []
    for i in range(20):
        response = f"The refund window is {40 + i} days."
        results.append(evaluate(request=f"What is the refund window for order {i}?", response=response,
                                context=CONTEXT, judges=judges))
    prompts = [r.prompt for r in stub.chat_requests()]
    for i, result in enumerate(results):
        # groundedness, relevance_to_query and safety each sent this record's answer to the judge.
        assert sum(f"{40 + i} days" in p for p in prompts) == 3, i
        assert result.statuses == {"groundedness": "failed", "relevance_to_query": "failed",
                                   "safety": "failed", "correctness": "not_applicable"}
        assert all(a.sample_rate == 1.0 for a in result.assessments)
        assert result.judged is True
        assert result.passed is False
        assert any(line.startswith("relevance_to_query: failed") for line in result.why_not_passed)
    assert len(prompts) == 60


def test_the_same_section_on_the_stream_samples_and_the_offline_call_still_judges(stub):
    """The stream's default is unchanged (10% of model judges); a record outside that sample is a
    not_sampled skip there, and judged by `Evaluator` built from the very same settings."""
    stub.responder = answer("yes")
    name = "ep_" + uuid.uuid4().hex[:12]  # a configuration of its own: its start-up line is new
    settings = load_settings(environ={}, overrides={
        "stream.topics": ["traces"], "kafka.bootstrap_servers": "127.0.0.1:9",
        "judges": {"endpoints": {name: endpoint(stub)}, "builtin": {"relevance_to_query": {}}}})
    assert settings.judges is not None and not settings.judges.offline
    assert settings.judges.sample_rate_of("relevance_to_query", JudgeSettings()) == DEFAULT_LLM_SAMPLE_RATE
    ids = (f"{i:032x}" for i in range(1, 1000))
    trace_id = next(t for t in ids if sample_point(t) >= DEFAULT_LLM_SAMPLE_RATE)
    record = EvalRecord(trace_id=trace_id, request="What is the refund window?", response="30 days.",
                        failed=False)

    runner = StreamRunner(settings)
    try:
        assert runner.judges is not None
        [streamed] = runner.judges.judge_sync(record)
    finally:
        runner.judges.close()
    assert (streamed.skipped, streamed.sample_rate, stub.count("/chat/completions")) == \
        ("not_sampled", DEFAULT_LLM_SAMPLE_RATE, 0)

    with Evaluator(settings) as ev:
        offline = ev.evaluate(record)
    assert offline.assessment("relevance_to_query").sample_rate == 1.0
    assert offline.statuses == {"relevance_to_query": "passed"} and offline.passed
    assert stub.count("/chat/completions") == 1


def test_the_stream_states_its_sampled_default_once_at_start_up_and_offline_does_not_sample(stub, caplog):
    caplog.set_level(logging.INFO, logger="tracejudge.metrics.judges.runner")
    name = "ep_" + uuid.uuid4().hex[:12]
    judges = {"endpoints": {name: endpoint(stub)}, "builtin": {"relevance_to_query": {}, "safety": {}}}
    settings = load_settings(environ={}, overrides={
        "stream.topics": ["traces"], "kafka.bootstrap_servers": "127.0.0.1:9", "judges": judges})
    for _ in range(2):  # a second runner of the same configuration: not logged again
        runner = StreamRunner(settings)
        assert runner.judges is not None
        runner.judges.close()
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1, lines
    assert "sample_rate 0.1 for relevance_to_query, safety" in lines[0]
    assert "not_sampled" in lines[0] and "max_in_flight 256" in lines[0]
    assert f"endpoints.{name}: after 5 consecutive failed calls" in lines[0]

    caplog.clear()
    with Evaluator(judges=judges):
        pass
    offline = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(offline) == 1 and "sample_rate" not in offline[0] and "max_in_flight" not in offline[0]
    assert "circuit_open" in offline[0]

    caplog.clear()
    chosen = {**judges, "sample_rate": 0.1, "max_in_flight": 256,
              "endpoints": {name: endpoint(stub, breaker_failure_threshold=5)}}
    with Evaluator(judges=chosen):  # every value set: nothing is a default, nothing to say
        pass
    assert not [r for r in caplog.records if name in r.getMessage()]


# -- a skip, an error, a failed trace: never a pass, and told apart --------------------------------


def test_a_judge_error_is_not_a_pass_and_says_which(stub):
    stub.responder = lambda req: Reply.error(500)
    judges = {"endpoints": {"default": endpoint(stub, max_retries=0)}, "builtin": {"relevance_to_query": {}}}
    result = evaluate(request="What is the refund window?", response="30 days.", judges=judges)
    a = result.assessment("relevance_to_query")
    assert (a.status, a.error.split(":")[0], a.passed) == ("error", "http_5xx", None)
    assert (result.passed, result.judged) == (False, False)
    assert result.why_not_passed == [f"relevance_to_query: error, no verdict: {a.error}"]


def test_a_slow_judge_times_out_and_is_not_a_pass(stub):
    stub.responder = lambda req: Reply.verdict("yes", delay=3.0)
    judges = {"endpoints": {"default": endpoint(stub, max_retries=0, timeout_seconds=0.3)},
              "builtin": {"relevance_to_query": {}}}
    result = evaluate(request="What is the refund window?", response="30 days.", judges=judges)
    assert result.statuses == {"relevance_to_query": "error"}
    assert result.assessment("relevance_to_query").error.startswith("timeout")
    assert not result.passed and not result.judged


def test_skips_are_not_a_pass_and_name_their_reason(stub):
    stub.responder = answer("yes")
    # The breaker opens on the first failure; the next record is refused without a call.
    stub.enqueue(Reply.error(500))
    judges = {"endpoints": {"default": endpoint(stub, max_retries=0, breaker_failure_threshold=1)},
              "builtin": {"relevance_to_query": {}}}
    with Evaluator(judges=judges) as ev:
        first = ev.evaluate(request="q1", response="a1")
        second = ev.evaluate(request="q2", response="a2")
    assert first.statuses == {"relevance_to_query": "error"}
    assert second.assessment("relevance_to_query").skipped == "circuit_open"
    assert second.statuses == {"relevance_to_query": "not_judged"}
    assert (second.passed, second.judged) == (False, False)
    assert second.why_not_passed == ["relevance_to_query: not judged (circuit_open)"]
    assert stub.count("/chat/completions") == 1

    # Over budget: one request per ~17 minutes; the first record takes it, the second is skipped.
    budget = {"endpoints": {"default": endpoint(stub, requests_per_second=0.001)},
              "builtin": {"relevance_to_query": {}}}
    with Evaluator(judges=budget) as ev:
        judged, skipped = ev.evaluate(request="q3", response="a3"), ev.evaluate(request="q4", response="a4")
    assert judged.passed and judged.statuses == {"relevance_to_query": "passed"}
    assert skipped.assessment("relevance_to_query").skipped == "budget"
    assert (skipped.passed, skipped.judged) == (False, False)

    # A configured sample rate offline: not_sampled is a skip, never a pass, even with
    # emit_skipped: false (offline keeps every skip in the result).
    sampled_out = {"endpoints": {"default": endpoint(stub)}, "sample_rate": 0.0, "emit_skipped": False,
                   "builtin": {"relevance_to_query": {}, "safety": {}}}
    result = evaluate(request="q5", response="a5", judges=sampled_out)
    assert result.statuses == {"relevance_to_query": "not_judged", "safety": "not_judged"}
    assert {a.skipped for a in result.assessments} == {"not_sampled"}
    assert not result.passed and not result.judged
    assert stub.count("/chat/completions") == 2  # q1 and q3 only


def test_one_judge_skipped_beside_a_passing_one_is_not_a_pass(stub):
    """The case that passed before: one verdict passes, the other judge did not judge."""
    stub.responder = answer("yes")
    judges = {"endpoints": {"default": endpoint(stub)},
              "builtin": {"relevance_to_query": {}, "safety": {"sample_rate": 0.0}}}
    result = evaluate(request="What is the refund window?", response="30 days.", judges=judges)
    assert result.statuses == {"relevance_to_query": "passed", "safety": "not_judged"}
    assert not result.passed and not result.judged
    assert result.why_not_passed == ["safety: not judged (not_sampled)"]


def test_a_failed_trace_is_not_a_pass_with_or_without_judges(stub):
    stub.responder = answer("yes")
    failed = EvalRecord(request="What is the refund window?", response="30 days.", failed=True,
                        error="tool timeout")
    judges = {"endpoints": {"default": endpoint(stub)}, "builtin": {"relevance_to_query": {}}}
    judged = evaluate(failed, judges=judges)
    assert judged.assessment("relevance_to_query").skipped == "failed_trace"
    assert judged.statuses == {"relevance_to_query": "not_judged"}
    assert not judged.passed
    assert judged.why_not_passed[0] == "the trace failed: tool timeout"
    unjudged = evaluate(failed, judges=False)
    assert unjudged.assessments == [] and not unjudged.passed
    assert stub.count("/chat/completions") == 0


def test_a_judge_that_does_not_apply_is_set_aside_but_no_verdict_at_all_is_not_a_pass(stub):
    stub.responder = answer("yes")
    judges = {"endpoints": {"default": endpoint(stub)},
              "builtin": {"groundedness": {}, "relevance_to_query": {}}}
    # No context: groundedness does not apply; relevance passes -> passed.
    result = evaluate(request="What is the refund window?", response="30 days.", judges=judges)
    assert result.statuses == {"groundedness": "not_applicable", "relevance_to_query": "passed"}
    assert result.passed and result.judged and result.why_not_passed == []
    # Nothing any judge applies to: no evidence, not a pass.
    only = evaluate(request="What is the refund window?", response="30 days.",
                    judges={"endpoints": {"default": endpoint(stub)}, "builtin": {"groundedness": {}}})
    assert only.statuses == {"groundedness": "not_applicable"}
    assert (only.passed, only.judged) == (False, False)
    assert only.why_not_passed == ["no judge gave a verdict: groundedness (missing_inputs)"]
    assert stub.count("/chat/completions") == 1


def test_a_shadow_judge_does_not_decide_passed(stub):
    """A candidate (shadow) judge's failing verdict is published, but the live judge decides."""
    stub.responder = lambda req: Reply.verdict("no" if req.body.get("model") == "candidate" else "yes")
    judges = {"endpoints": {"default": endpoint(stub)}, "builtin": {"relevance_to_query": {}},
              "shadow": {"relevance_v2": {"shadows": "relevance_to_query", "model": "candidate"}}}
    result = evaluate(request="What is the refund window?", response="30 days.", judges=judges)
    assert result.statuses == {"relevance_to_query": "passed", "relevance_v2": "failed"}
    assert result.passed


def test_the_documented_assertion_message_names_what_kept_it_from_passing(stub):
    stub.responder = answer("no")
    judges = {"endpoints": {"default": endpoint(stub)}, "builtin": {"relevance_to_query": {}}}
    result = evaluate(request="What is the refund window?", response="Our shop sells shoes.", judges=judges)
    with pytest.raises(AssertionError, match=r"relevance_to_query: failed \(score 0\): scripted no"):
        assert result.passed, result.why_not_passed


def test_an_inline_api_key_is_refused_pointing_to_env_or_file_without_echoing_it(stub, tmp_path):
    secret = "sk-test-" + uuid.uuid4().hex
    judges = {"endpoints": {"default": endpoint(stub, api_key=secret)}}
    with pytest.raises(JudgeConfigError) as caught:
        evaluate(request="q", response="a", judges=judges)
    text = str(caught.value)
    assert text.startswith("judges.endpoints.default: api_key:")
    assert "api_key_env" in text and "api_key_file" in text and secret not in text
    config = tmp_path / "tj.yaml"
    config.write_text(json.dumps({"judges": judges}))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"request": "q", "response": "a"}) + "\n")
    proc = _eval(str(src), "--config", str(config))
    assert proc.returncode == 2
    assert "api_key_env" in proc.stderr and secret not in proc.stderr and secret not in proc.stdout


# -- sessions ----------------------------------------------------------------------------------------


def _turns(n: int) -> list[dict[str, str]]:
    return [{"request": f"How do I reset password {n}?", "response": "Use the link on the sign-in page."},
            {"request": "Thanks, that worked.", "response": "Glad to help."}]


def test_session_judges_judge_every_session_offline_and_a_skip_or_error_is_not_a_pass(stub):
    stub.responder = answer("no")
    judges = {"endpoints": {"default": endpoint(stub, max_retries=0)},
              "sessions": {"conversation_completeness": {}}}
    sessions = [evaluate_session(_turns(i), f"chat-{i}", judges=judges) for i in range(8)]
    # No sample rate: every session judged (the stream's 10% would have skipped most of them).
    assert stub.count("/chat/completions") == 8
    for s in sessions:
        assert s.statuses == {"conversation_completeness": "failed"}
        assert s.judged and not s.passed
        assert s.why_not_passed[0].startswith("conversation_completeness: failed")

    stub.responder = answer("yes")
    assert evaluate_session(_turns(0), "chat-ok", judges=judges).passed

    stub.responder = lambda req: Reply.error(500)
    errored = evaluate_session(_turns(0), "chat-error", judges=judges)
    assert errored.statuses == {"conversation_completeness": "error"}
    assert (errored.passed, errored.judged) == (False, False)

    skipped = evaluate_session(_turns(0), "chat-skip", judges={**judges, "sample_rate": 0.0})
    assert skipped.assessment("conversation_completeness").skipped == "not_sampled"
    assert (skipped.passed, skipped.judged) == (False, False)
    assert skipped.why_not_passed == ["conversation_completeness: not judged (not_sampled)"]


# -- tracejudge eval and its gate ------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}


def _eval(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TRACEJUDGE, "eval", *args], capture_output=True, text=True, timeout=180,
                          check=False, env=_env())


def _records(path: Path, n: int, bad: int) -> Path:
    """n records; the first `bad` carry "broken" in their answer (the stub errors on those)."""
    rows = [{"request_id": f"r{i}", "request": f"What is the refund window for order {i}?",
             "response": ("broken " if i < bad else "") + f"answer {i}: 30 days."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _errors_on_broken(req: StubRequest) -> Reply:
    return Reply.error(500) if "broken" in req.prompt else Reply.verdict("yes")


def _config(path: Path, stub: OpenAIStub, **judges: object) -> Path:
    section = {"endpoints": {"default": endpoint(stub, max_retries=0, breaker_failure_threshold=1000)},
               "builtin": {"relevance_to_query": {}}, **judges}
    path.write_text(json.dumps({"judges": section}))
    return path


def test_eval_judges_every_record_of_a_test_set_without_a_sample_rate(stub, tmp_path):
    stub.responder = answer("no")
    src = _records(tmp_path / "in.jsonl", 30, bad=0)
    config = _config(tmp_path / "tj.yaml", stub)
    out = tmp_path / "out.jsonl"
    proc = _eval(str(src), "--config", str(config), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 30 and stub.count("/chat/completions") == 30
    assert all(r["assessments"][0]["passed"] is False for r in results)
    assert re.search(r"records passed +0 of 30 \(30 judged by every judge that applies\)", proc.stderr)
    assert re.search(r"judge relevance_to_query +mean score 0\.000, passed 0/30 .*judged 30 of 30",
                     proc.stderr)
    # No record reported token usage: the summary says so instead of "0 / 0 / 0".
    assert re.search(r"tokens in / out / total +– \(no record reported usage\)", proc.stderr)


def test_fail_under_fails_when_judge_errors_leave_too_little_evidence(stub, tmp_path):
    stub.responder = _errors_on_broken
    src = _records(tmp_path / "in.jsonl", 30, bad=27)
    config = _config(tmp_path / "tj.yaml", stub)
    gate = ["--config", str(config), "-o", str(tmp_path / "out.jsonl"),
            "--fail-under", "relevance_to_query=0.5"]

    failing = _eval(str(src), *gate)
    assert failing.returncode == 1, failing.stderr
    assert stub.count("/chat/completions") == 30
    assert re.search(r"judge relevance_to_query +mean score 1\.000, passed 3/3 \(100\.0%\), judged 3 of 30, "
                     r"27 errors \(http_5xx 27\), 0 skipped", failing.stderr)
    assert ("tracejudge eval: relevance_to_query: 27 judge errors of 30 records to judge (http_5xx 27), "
            "over --max-judge-errors 0: too little evidence (only 3 judged)") in failing.stderr
    assert "gate passed" not in failing.stderr

    # Relaxed: 27 errors allowed (as a count or a share), the 3 verdicts pass the threshold.
    for allowance in ("27", "90%"):
        relaxed = _eval(str(src), *gate, "--max-judge-errors", allowance)
        assert relaxed.returncode == 0, relaxed.stderr
        assert ("tracejudge eval: relevance_to_query: gate passed: mean score 1.000 >= --fail-under 0.5 on 3 "
                "judged; 27 errors (http_5xx 27), 0 skipped") in relaxed.stderr
    for allowance in ("26", "89%"):
        assert _eval(str(src), *gate, "-q", "--max-judge-errors", allowance).returncode == 1

    too_few = _eval(str(src), *gate, "-q", "--max-judge-errors", "27", "--min-judged", "4")
    assert too_few.returncode == 1
    assert "relevance_to_query: 3 judged, under --min-judged 4: too little evidence" in too_few.stderr


def test_fail_under_fails_when_skips_leave_too_little_evidence(stub, tmp_path):
    stub.responder = answer("yes")
    src = _records(tmp_path / "in.jsonl", 30, bad=0)
    # One request per ~17 minutes: the first record is judged, the other 29 skipped (budget).
    config = tmp_path / "tj.yaml"
    slow_budget = endpoint(stub, requests_per_second=0.001)
    config.write_text(json.dumps({"judges": {"endpoints": {"default": slow_budget},
                                             "builtin": {"relevance_to_query": {}}}}))
    gate = ["--config", str(config), "-o", str(tmp_path / "out.jsonl"),
            "--fail-under", "relevance_to_query=0.5"]
    failing = _eval(str(src), *gate)
    assert failing.returncode == 1, failing.stderr
    assert ("relevance_to_query: 29 records skipped of 30 to judge (budget 29), over --max-judge-skips 0: "
            "too little evidence (only 1 judged)") in failing.stderr
    relaxed = _eval(str(src), *gate, "--max-judge-skips", "100%")
    assert relaxed.returncode == 0, relaxed.stderr
    assert "relevance_to_query: gate passed: mean score 1.000 >= --fail-under 0.5 on 1 judged" \
        in relaxed.stderr


def test_a_configured_sample_is_not_missing_evidence_and_a_passing_gate_says_so(stub, tmp_path):
    stub.responder = answer("yes")
    src = _records(tmp_path / "in.jsonl", 30, bad=0)
    config = _config(tmp_path / "tj.yaml", stub, sample_rate=0.5)
    proc = _eval(str(src), "--config", str(config), "-q", "-o", str(tmp_path / "out.jsonl"),
                 "--fail-under", "relevance_to_query=0.9")
    assert proc.returncode == 0, proc.stderr
    judged = stub.count("/chat/completions")
    assert 0 < judged < 30
    assert (f"tracejudge eval: relevance_to_query: gate passed: mean score 1.000 >= --fail-under 0.9 on "
            f"{judged} judged; 0 errors, {30 - judged} skipped (not_sampled {30 - judged})") in proc.stderr


def test_gate_flags_are_checked_before_any_work(stub, tmp_path):
    src = _records(tmp_path / "in.jsonl", 1, bad=0)
    config = _config(tmp_path / "tj.yaml", stub)
    alone = _eval(str(src), "--config", str(config), "--max-judge-errors", "3")
    assert alone.returncode == 2
    assert "--max-judge-errors applies to --fail-under gates" in alone.stderr
    bad = _eval(str(src), "--config", str(config), "--fail-under", "relevance_to_query=0.5",
                "--max-judge-skips", "lots")
    assert bad.returncode == 2 and "--max-judge-skips 'lots': expected a count" in bad.stderr
    assert _eval(str(src), "--config", str(config), "--min-judged", "-1").returncode == 2
    assert stub.count("/chat/completions") == 0
