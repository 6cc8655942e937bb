"""Session judges on whole conversations: the built-in judges against the loopback OpenAI stub (real
httpx client), strict parsing, deterministic sampling by session id, custom `{conversation}` judges,
the long-conversation policy, the model-free user_frustration, metrics and configuration errors."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from support.clock import FakeClock
from support.openai_stub import OpenAIStub, Reply

from tracejudge.metrics.judges.budget import estimate_tokens
from tracejudge.metrics.judges.config import SESSION_JUDGES, JudgeConfigError, load_judges_config
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.sampling import sample_point
from tracejudge.metrics.judges.sessions import Conversation, SessionJudgeRunner
from tracejudge.schemas.session import Turn

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "config" / "judges.example.yaml"


def turn(request: str | None, response: str | None, *, failed: bool = False, error: str | None = None,
         i: int = 0) -> Turn:
    return Turn(trace_id=f"{i:032x}", request_id=None, mlflow_trace_id=None, root_span_id=None,
                timestamp=1_750_000_000.0 + i, placed_by_arrival=False, request=request, response=response,
                failed=failed, error=error, input_tokens=None, output_tokens=None, tool_calls=0,
                latency_seconds=None)


def conversation(*pairs: tuple[str, str], session_id: str = "sess-1", app: str | None = "shop",
                 failed_last: bool = False) -> Conversation:
    turns = [turn(q, a, i=i) for i, (q, a) in enumerate(pairs)]
    if failed_last:
        last = turns[-1]
        turns[-1] = turn(last.request, None, failed=True, error="TimeoutError: upstream", i=len(turns) - 1)
    return Conversation(session_id, app, turns)


SHOP = conversation(
    ("My name is Ada and my order number is 5521. Where is it?", "Order 5521 ships tomorrow, Ada."),
    ("Can I change the delivery address?", "Yes, I updated it for order 5521."),
)


def runner(stub: OpenAIStub, sessions: dict[str, Any] | None = None, *, custom: dict[str, Any] | None = None,
           top: dict[str, Any] | None = None, registry: CollectorRegistry | None = None,
           clock: Any = None, **endpoint: Any) -> SessionJudgeRunner:
    ep = {"base_url": stub.base_url, "model": "judge-model", "backoff_initial_seconds": 0.01, **endpoint}
    config: dict[str, Any] = {"endpoints": {"default": ep}, "sample_rate": 1.0, **(top or {})}
    if sessions is not None:
        config["sessions"] = sessions
    if custom:
        config["custom"] = custom
    kw: dict[str, Any] = {} if clock is None else {"clock": clock}
    return SessionJudgeRunner(config, registry if registry is not None else CollectorRegistry(), **kw)


def value(r: SessionJudgeRunner, name: str, **labels: str) -> float:
    return r.metrics.registry.get_sample_value(name, labels) or 0.0


# -- the built-in model judges ----------------------------------------------------------------------

YES_NO_JUDGES = ("conversation_completeness", "knowledge_retention", "conversational_role_adherence",
                 "conversational_safety")


@pytest.mark.parametrize("name", YES_NO_JUDGES)
@pytest.mark.parametrize("answer", ["yes", "no"])
def test_yes_no_session_judges_parse_strict_answers(stub: OpenAIStub, name: str, answer: str) -> None:
    r = runner(stub, {name: {}})
    stub.enqueue(Reply.verdict(answer, "Every request was handled."))
    [a] = r.judge_sync(SHOP)
    r.close()
    assert (a.name, a.value, a.score, a.passed) == (name, answer, float(answer == "yes"), answer == "yes")
    assert a.rationale == "Every request was handled."  # the whole conversation fitted: no note
    assert a.source == "llm:judge-model" and a.judge is not None and a.judge.endpoint == "default"
    assert (a.input_tokens, a.output_tokens, a.sample_rate) == (40, 10, 1.0)
    [req] = stub.chat_requests()
    assert (
        "User: My name is Ada and my order number is 5521. Where is it?\n"
        "Assistant: Order 5521 ships tomorrow, Ada.\n\n"
        "User: Can I change the delivery address?\nAssistant: Yes, I updated it for order 5521."
    ) in req.prompt
    assert req.body["response_format"]["type"] == "json_schema"
    verdict = "pass" if answer == "yes" else "fail"
    assert value(r, "tracejudge_session_judge_verdicts_total", app="shop", judge=name, verdict=verdict) == 1
    assert value(r, "tracejudge_session_judge_score_count", app="shop", judge=name) == 1


@pytest.mark.parametrize(("label", "score", "passed"),
                         [("none", 1.0, True), ("resolved", 0.5, True), ("unresolved", 0.0, False)])
def test_user_frustration_model_judge_reads_the_three_labels(
    stub: OpenAIStub, label: str, score: float, passed: bool
) -> None:
    r = runner(stub, {"user_frustration": {}})
    stub.enqueue(Reply.chat({"rationale": 'The user wrote "forget it".', "result": label.upper()}))
    conv = conversation(("Where is my parcel?", "Checking."), ("Where is my parcel??", "No idea."),
                        failed_last=True)
    [a] = r.judge_sync(conv)
    r.close()
    assert (a.name, a.value, a.score, a.passed) == ("user_frustration", label, score, passed)
    prompt = stub.chat_requests()[0].prompt
    assert "Assistant: [this turn failed: TimeoutError: upstream]" in prompt  # failed turns are marked
    schema = stub.chat_requests()[0].body["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["result"]["enum"] == ["none", "resolved", "unresolved"]
    assert value(r, "tracejudge_session_judge_verdicts_total", app="shop", judge="user_frustration",
                 verdict=label) == 1


def test_conversational_guidelines_gives_one_verdict_per_guideline(stub: OpenAIStub) -> None:
    r = runner(stub, {"conversational_guidelines": {"guidelines": ["Use the customer's name.",
                                                                   "Never promise a delivery date."]}})
    stub.enqueue(Reply.verdicts({1: "yes", 2: "no"}, "It promised tomorrow."))
    [a] = r.judge_sync(SHOP)
    r.close()
    assert (a.value, a.score, a.passed) == ("no", 0.5, False)
    assert a.rationale == ("1/2 guidelines followed; not followed: [2] Never promise a delivery date. "
                           "It promised tomorrow.")
    prompt = stub.chat_requests()[0].prompt
    assert "[1] Use the customer's name.\n[2] Never promise a delivery date." in prompt


@pytest.mark.parametrize(("judge", "reply", "reason"), [
    ("conversation_completeness", Reply.chat("Yes, every request was handled."), "unparseable"),
    ("conversation_completeness", Reply.chat({"rationale": "ok", "result": "mostly"}), "invalid_answer"),
    ("user_frustration", Reply.chat({"rationale": "meh", "result": "yes"}), "invalid_answer"),
    ("user_frustration", Reply.chat("```json\n{\"result\": \"none\"}\n```\n```{}```"), "unparseable"),
    ("conversational_guidelines", Reply.verdicts({1: "yes"}), "invalid_answer"),  # guideline 2 unanswered
])
def test_an_answer_that_is_not_a_verdict_is_an_error_never_a_verdict(
    stub: OpenAIStub, judge: str, reply: Reply, reason: str
) -> None:
    settings = {"guidelines": ["a", "b"]} if judge == "conversational_guidelines" else {}
    r = runner(stub, {judge: settings})
    stub.enqueue(reply)
    [a] = r.judge_sync(SHOP)
    r.close()
    assert a.error is not None and a.error.startswith(reason + ":")
    assert (a.value, a.score, a.passed) == (None, None, None)
    assert value(r, "tracejudge_session_judge_errors_total", judge=judge, reason=reason) == 1
    assert value(r, "tracejudge_session_judge_score_count", app="shop", judge=judge) == 0


# -- sampling, filters, skips ---------------------------------------------------------------------

def test_sampling_is_deterministic_by_session_id(stub: OpenAIStub) -> None:
    top = {"sampling_seed": "s1"}
    ids = [f"session-{i}" for i in range(60)]
    convs = [conversation(("hello", "hi"), session_id=s) for s in ids]
    expected = [s for s in ids if sample_point(s, "s1") < 0.5]
    assert 15 < len(expected) < 45

    def sampled(r: SessionJudgeRunner) -> list[str]:
        out = [c.session_id for c, [a] in zip(convs, r.judge_many(convs), strict=True) if a.skipped is None]
        r.close()
        return out

    first = runner(stub, {"conversation_completeness": {"sample_rate": 0.5}}, top=top)
    assert sampled(first) == expected
    assert stub.total == len(expected)
    # Another replica (a fresh runner) and the heuristic provider make the same decision.
    assert sampled(runner(stub, {"conversation_completeness": {"sample_rate": 0.5}}, top=top)) == expected
    heuristic = SessionJudgeRunner({"sessions": {"user_frustration": {"sample_rate": 0.5}},
                                    "sampling_seed": "s1"}, CollectorRegistry())
    assert sampled(heuristic) == expected
    assert value(first, "tracejudge_session_judge_eligible_total", judge="conversation_completeness") == 60
    assert value(first, "tracejudge_session_judge_sampled_total",
                 judge="conversation_completeness") == len(expected)
    assert value(first, "tracejudge_session_judge_skipped_total", judge="conversation_completeness",
                 reason="not_sampled") == 60 - len(expected)
    # Another seed looks at another slice.
    other = SessionJudgeRunner({"sessions": {"user_frustration": {"sample_rate": 0.5}},
                                "sampling_seed": "s2"}, CollectorRegistry())
    assert sampled(other) != expected


def test_app_filter_missing_text_and_budget_skips_are_counted(stub: OpenAIStub) -> None:
    clock = FakeClock()  # frozen: the request bucket does not refill during the test
    r = runner(stub, {"conversation_completeness": {"filters": {"apps": ["shop"]}},
                      "conversational_safety": {}}, requests_per_second=1, clock=clock)
    other_app = r.judge_sync(conversation(("hi", "hello"), app="bank"))
    assert [(a.name, a.skipped) for a in other_app] == [("conversation_completeness", "filtered"),
                                                        ("conversational_safety", None)]
    empty = r.judge_sync(Conversation("empty", "shop", [turn(None, None), turn("  ", "")]))
    assert [a.skipped for a in empty] == ["missing_inputs", "missing_inputs"]
    assert empty[0].rationale == "missing: conversation"
    over_budget = r.judge_sync(SHOP)
    assert [a.skipped for a in over_budget] == ["budget", "budget"]
    r.close()
    assert stub.total == 1
    for judge, reason, n in [("conversation_completeness", "filtered", 1),
                             ("conversation_completeness", "missing_inputs", 1),
                             ("conversational_safety", "missing_inputs", 1),
                             ("conversational_safety", "budget", 1),
                             ("conversation_completeness", "budget", 1)]:
        assert value(r, "tracejudge_session_judge_skipped_total", judge=judge, reason=reason) == n


# -- custom session judges -------------------------------------------------------------------------

CUSTOM = {
    "polite_throughout": {
        "prompt": "Rate how polite the assistant is across the whole conversation.\n\n{conversation}",
        "scale": "numeric", "min_score": 1, "max_score": 5, "pass_threshold": 4,
    },
    "short_answers": {"prompt": "Are the answers short?\nRequest: {request}\nResponse: {response}"},
}


def test_custom_conversation_judge_is_a_session_judge_only(stub: OpenAIStub) -> None:
    r = runner(stub, {}, custom=CUSTOM)
    assert r.judge_names() == ["polite_throughout"]
    stub.enqueue(Reply.chat({"rationale": "Courteous in every turn.", "score": 4}))
    [a] = r.judge_sync(SHOP)
    r.close()
    assert (a.name, a.value, a.score, a.passed) == ("polite_throughout", 4, 0.75, True)
    req = stub.chat_requests()[0]
    assert req.prompt.count("User: ") == 2 and "{conversation}" not in req.prompt
    # The trace judges of the same configuration never run it, and run the trace custom judge.
    trace = JudgeRunner({"endpoints": {"default": {"base_url": stub.base_url, "model": "m"}},
                         "builtin": {}, "custom": CUSTOM}, registry=CollectorRegistry())
    assert trace.judge_names() == ["short_answers"]
    trace.close()


# -- long conversations ----------------------------------------------------------------------------

def test_long_conversation_is_judged_on_its_most_recent_turns_and_says_so(stub: OpenAIStub) -> None:
    r = runner(stub, {"conversation_completeness": {}}, max_input_tokens=1200)
    turns = [(f"Question {i:02d}: " + "about the parcel " * 12,
              f"Answer {i:02d}: " + "it is on its way " * 12) for i in range(30)]
    stub.enqueue(Reply.verdict("yes", "All recent requests were answered."))
    [a] = r.judge_sync(conversation(*turns))
    prompt = stub.chat_requests()[0].prompt
    kept = [i for i in range(30) if f"Question {i:02d}:" in prompt]
    assert kept == list(range(30 - len(kept), 30)) and 3 <= len(kept) < 30  # a suffix of whole turns
    assert all(f"Answer {i:02d}:" in prompt for i in kept)
    assert f"[{30 - len(kept)} earlier turns omitted]" in prompt
    assert estimate_tokens(prompt) <= 1200
    assert a.rationale == f"All recent requests were answered. (judged the last {len(kept)} of 30 turns)"

    # A last turn longer than the whole budget is clipped, and the rationale says so.
    long_turns = [("Hi", "Hello"), ("Please summarise: " + "word " * 3000, "Summary: " + "text " * 3000)]
    stub.enqueue(Reply.verdict("no", "The summary is missing."))
    [b] = r.judge_sync(conversation(*long_turns, session_id="sess-long"))
    r.close()
    prompt = stub.chat_requests()[1].prompt
    assert "[1 earlier turns omitted]" in prompt and "User: Please summarise: word" in prompt
    assert prompt.count("[… clipped]") == 2 and "Assistant: Summary: text" in prompt
    assert estimate_tokens(prompt) <= 1200
    assert b.rationale == "The summary is missing. (judged the last 1 of 2 turns, last turn clipped)"


def test_a_budget_too_small_for_any_transcript_is_skipped_too_large(stub: OpenAIStub) -> None:
    guidelines = {"conversational_guidelines": {"guidelines": ["Be brief. " * 100]}}
    r = runner(stub, guidelines, max_input_tokens=300)
    [a] = r.judge_sync(SHOP)
    r.close()
    assert a.skipped == "too_large" and stub.total == 0
    assert value(r, "tracejudge_session_judge_skipped_total", judge="conversational_guidelines",
                 reason="too_large") == 1


# -- the model-free user_frustration ---------------------------------------------------------------

def heuristic_runner(registry: CollectorRegistry | None = None) -> SessionJudgeRunner:
    # No endpoint: the section's default is the heuristic user_frustration.
    return SessionJudgeRunner({}, registry if registry is not None else CollectorRegistry())


@pytest.mark.parametrize(("pairs", "failed_last", "expected", "why"), [
    ([("Where is my order 5521?", "Let me look."),
      ("Where is my order 5521??", "I could not find it."),
      ("Forget it, this is useless. Let me talk to a human.", "I am sorry to hear that.")],
     False, "unresolved", 'turn 2: repeats turn 1; turn 3: "forget it"'),
    ([("How do I reset my router password?", "Open settings."),
      ("I already told you, there is no settings page! How do I reset the router password?",
       "Hold the reset button for 10 seconds."),
      ("Great, that worked. Can you also show me how to rename the network?", "Open the admin page.")],
     False, "resolved", 'turn 2: repeats turn 1, "i already told"; the last turn is fine'),
    ([("What are your opening hours?", "9 to 5."), ("Do you ship to Norway?", "Yes, in 5 days.")],
     False, "none", "no frustration signal in 2 turns"),
    ([("Cancel my subscription", "Done."), ("And refund the last payment", None)],
     True, "unresolved", "turn 2: failed"),
])
def test_heuristic_user_frustration_on_crafted_conversations(
    pairs: list[tuple[str, str]], failed_last: bool, expected: str, why: str
) -> None:
    registry = CollectorRegistry()
    r = heuristic_runner(registry)
    assert r.judge_names() == ["user_frustration"] and not r.needs_event_loop
    future = r.submit(conversation(*pairs, failed_last=failed_last, session_id="sess-h"))
    assert future.done()  # heuristic plans complete inline
    [a] = future.result()
    assert (a.name, a.value, a.source) == ("user_frustration", expected, "heuristic")
    assert a.passed is (expected != "unresolved")
    assert a.score == {"none": 1.0, "resolved": 0.5, "unresolved": 0.0}[expected]
    assert why in (a.rationale or "")
    assert a.judge is not None and a.judge.endpoint is None and len(a.judge.version) == 12
    assert a.judge == heuristic_runner().judge_sync(conversation(("hi", "hello")))[0].judge  # stable version
    om = generate_openmetrics(registry).decode()
    series = f'{{app="shop",judge="user_frustration",verdict="{expected}"}}'
    assert f'tracejudge_session_judge_verdicts_total{series} 1.0 # {{session_id="sess-h"}} 1.0' in om


def test_heuristic_needs_a_user_message() -> None:
    r = heuristic_runner()
    [a] = r.judge_sync(Conversation("s", None, [turn(None, "Hello, how can I help?")]))
    assert a.skipped == "missing_inputs"
    assert value(r, "tracejudge_session_judge_skipped_total", judge="user_frustration",
                 reason="missing_inputs") == 1


def test_metrics_lint_and_long_session_ids_become_short_exemplars(stub: OpenAIStub) -> None:
    registry = CollectorRegistry()
    r = runner(stub, {"user_frustration": {}, "knowledge_retention": {}}, registry=registry)
    stub.responder = lambda req: (Reply.chat({"rationale": "calm", "result": "none"})
                                  if "frustration" in req.prompt else Reply.verdict("yes"))
    long_id = "conversation/" + "x" * 200
    r.judge_sync(conversation(("hi", "hello"), session_id=long_id, app=None))
    r.close()
    om = generate_openmetrics(registry).decode()
    assert 'judge="knowledge_retention",verdict="pass"} 1.0 # {session_id="sha256:' in om
    assert 'app="unknown"' in om and long_id not in om
    text = generate_latest(registry).decode()
    for name in ("tracejudge_session_judge_verdicts_total", "tracejudge_session_judge_score_bucket",
                 "tracejudge_session_judge_eligible_total", "tracejudge_session_judge_sampled_total",
                 "tracejudge_session_judge_duration_seconds_bucket", "tracejudge_session_judge_tokens_total",
                 "tracejudge_session_judge_requests_total", "tracejudge_session_judge_circuit_open"):
        assert name in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool is installed on the project machines (Debian's prometheus package)"
    lint = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True,
                          timeout=30)
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()


def test_trace_and_session_runners_share_a_registry() -> None:
    registry = CollectorRegistry()
    trace = JudgeRunner({}, registry=registry)
    sessions = SessionJudgeRunner({}, registry)
    assert trace.judge_names() == ["groundedness", "relevance_to_query"]
    assert sessions.judge_names() == ["user_frustration"]


# -- configuration ---------------------------------------------------------------------------------

def test_default_session_judges() -> None:
    ep = {"base_url": "http://127.0.0.1:9/v1", "model": "m"}
    assert list(load_judges_config({}).session_judge_settings()) == ["user_frustration"]
    with_model = load_judges_config({"endpoints": {"default": ep}})
    assert list(with_model.session_judge_settings()) == ["user_frustration", "conversation_completeness"]
    # Several endpoints, none the default, trace judges naming theirs: still valid, heuristic sessions.
    two = load_judges_config({"endpoints": {"a": ep, "b": ep},
                              "builtin": {"safety": {"endpoint": "a"}}})
    frustration = two.session_judge_settings()["user_frustration"]
    assert two.provider_of("user_frustration", frustration) == "heuristic"
    assert list(load_judges_config({"sessions": {}}).session_judge_settings()) == []


@pytest.mark.parametrize(("section", "key", "words"), [
    ({"sessions": {"role_adherence": {}}}, "judges.sessions.role_adherence",
     "did you mean conversational_role_adherence"),
    ({"sessions": {"user_frustation": {}}}, "judges.sessions.user_frustation",
     "session judges: user_frustration"),
    ({"custom": {"x": {"prompt": "{conversation} and {request}"}}}, "judges.custom.x.prompt",
     "cannot also name {request}"),
    ({"custom": {"x": {"prompt": "{conversation} {history}"}}}, "judges.custom.x.prompt",
     "unknown placeholder {history}"),
    ({"sessions": {"conversation_completeness": {}}}, "judges.sessions.conversation_completeness",
     "needs a judge endpoint"),
    ({"sessions": {"conversational_safety": {"provider": "heuristic"}}},
     "judges.sessions.conversational_safety.provider", "only user_frustration"),
    ({"sessions": {"user_frustration": {"filters": {"status": ["ok"]}}}},
     "judges.sessions.user_frustration.filters", "apps only"),
    ({"sessions": {"conversational_guidelines": {"provider": "heuristic"}}},
     "judges.sessions.conversational_guidelines.guidelines", "Field required"),
    ({"custom": {"user_frustration": {"prompt": "{conversation}"}}}, "judges.custom.user_frustration",
     "not a built-in judge's name"),
])
def test_configuration_errors_name_the_key(section: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(JudgeConfigError) as err:
        load_judges_config(section)
    assert err.value.key == key
    assert words in err.value.detail


def test_submit_judges_in_the_background_and_close_skips_later_sessions(stub: OpenAIStub) -> None:
    r = runner(stub, {"conversational_safety": {}})
    futures = [r.submit(conversation(("hi", "hello"), session_id=f"s{i}")) for i in range(8)]
    assert [a.value for f in futures for a in f.result(timeout=30)] == ["yes"] * 8
    r.close(drain_seconds=5)
    [late] = r.submit(SHOP).result(timeout=60)
    assert late.skipped == "closed" and stub.total == 8
    assert value(r, "tracejudge_session_judge_in_flight") == 0


def test_the_example_config_builds_every_session_judge() -> None:
    section = yaml.safe_load(EXAMPLE.read_text())["judges"]
    env = {"OPENAI_API_KEY": "k", "AZURE_OPENAI_API_KEY": "a"}
    r = SessionJudgeRunner(section, CollectorRegistry(), env)
    assert r.judge_names() == [*SESSION_JUDGES, "polite_throughout"]
    assert "polite_throughout" not in JudgeRunner(section, env=env).judge_names()
