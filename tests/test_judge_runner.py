"""JudgeRunner behaviour under load and failure: budgets, circuit breaker, in-flight bound, secrets,
Prometheus output, the async/thread APIs, and records built from real MLflow traces."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import threading
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from support import mlflow_apps
from support.clock import FakeClock
from support.openai_stub import OpenAIStub, Reply, wait_until

from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.record import Document, EvalRecord
from tracejudge.schemas.result import EvaluationResult, SourceRef


def record(i: int = 0, **kw: Any) -> EvalRecord:
    base: dict[str, Any] = dict(
        trace_id=f"{i:032x}",
        app="shop",
        failed=False,
        request="How long is the return window?",
        response="Items can be returned within 30 days.",
        retrieved_context=[Document("Items can be returned within 30 days of delivery.")],
    )
    base.update(kw)
    return EvalRecord(**base)


def runner(
    stub: OpenAIStub,
    *,
    judges: tuple[str, ...] = ("relevance_to_query",),
    clock: Any = None,
    env: Any = None,
    top: dict[str, Any] | None = None,
    **endpoint: Any,
) -> JudgeRunner:
    ep = {"base_url": stub.base_url, "model": "judge-model", "backoff_initial_seconds": 0.01, **endpoint}
    config = {
        "endpoints": {"default": ep},
        "sample_rate": 1.0,
        "builtin": {j: {} for j in judges},
        **(top or {}),
    }
    kw: dict[str, Any] = {"registry": CollectorRegistry(), "env": env}
    if clock is not None:
        kw["clock"] = clock
    return JudgeRunner(config, **kw)


def value(r: JudgeRunner, name: str, **labels: str) -> float:
    return r.metrics.registry.get_sample_value(name, labels) or 0.0


def test_request_budget_thins_the_sample_and_counts_it(stub: OpenAIStub) -> None:
    clock = FakeClock()  # frozen: the bucket does not refill until the test moves time
    r = runner(stub, clock=clock, requests_per_second=2)
    outcomes = [a.skipped or a.value for [a] in r.judge_many([record(i) for i in range(10)], window=1)]
    assert outcomes == ["yes", "yes"] + ["budget"] * 8
    assert stub.total == 2
    assert (
        value(r, "tracejudge_judge_skipped_total", app="shop", judge="relevance_to_query", reason="budget")
        == 8
    )
    assert value(r, "tracejudge_judge_sampled_total", app="shop", judge="relevance_to_query") == 10
    clock.now += 1.0  # one second of budget: two more requests
    outcomes = [a.skipped or a.value for [a] in r.judge_many([record(i) for i in range(3)], window=1)]
    assert outcomes == ["yes", "yes", "budget"]
    r.close()


def test_token_budget_is_settled_with_reported_usage(stub: OpenAIStub) -> None:
    clock = FakeClock()
    # 600 tokens/minute = 10/s; the bucket holds 10 s = 100 tokens, less than one judgement's estimate,
    # so a judgement passes only on a full bucket, and the reported usage (50) is what is spent.
    r = runner(stub, clock=clock, tokens_per_minute=600)
    outcomes = [a.skipped or a.value for [a] in r.judge_many([record(i) for i in range(3)], window=1)]
    assert outcomes == ["yes", "budget", "budget"]
    assert r.budgets["default"].tokens is not None
    assert r.budgets["default"].tokens.level == pytest.approx(50)  # 100 - 50 reported, estimate given back
    clock.now += 5.0
    assert [a.value for [a] in r.judge_many([record(7)])] == ["yes"]
    assert value(r, "tracejudge_judge_tokens_total", judge="relevance_to_query", direction="input") == 80
    assert value(r, "tracejudge_judge_tokens_total", judge="relevance_to_query", direction="output") == 20
    r.close()


def test_circuit_breaker_skips_judgements_during_an_outage_then_recovers(stub: OpenAIStub) -> None:
    clock = FakeClock()
    stub.responder = lambda req: Reply.error(503, "overloaded")
    r = runner(stub, clock=clock, max_retries=0, breaker_failure_threshold=2, breaker_reset_seconds=30)
    first = [a for [a] in r.judge_many([record(i) for i in range(6)], window=1)]
    assert [a.error.split(":")[0] if a.error else a.skipped for a in first] == ["http_5xx"] * 2 + [
        "circuit_open"
    ] * 4
    assert stub.total == 2  # nothing sent while open
    assert value(r, "tracejudge_judge_circuit_open", endpoint="default") == 1
    assert value(r, "tracejudge_judge_errors_total", judge="relevance_to_query", reason="http_5xx") == 2
    assert (
        value(
            r, "tracejudge_judge_skipped_total", app="shop", judge="relevance_to_query", reason="circuit_open"
        )
        == 4
    )
    assert value(r, "tracejudge_judge_requests_total", endpoint="default", outcome="http_5xx") == 2

    stub.responder = lambda req: Reply.verdict("yes")
    clock.now += 30  # half-open: the next judgement is the probe, and closes the circuit
    assert [a.value for [a] in r.judge_many([record(10), record(11)], window=1)] == ["yes", "yes"]
    assert value(r, "tracejudge_judge_circuit_open", endpoint="default") == 0
    r.close()


def test_in_flight_bound_thins_instead_of_queueing(stub: OpenAIStub) -> None:
    release = threading.Event()

    def slow(req: Any) -> Reply:
        return Reply.verdict("yes", delay=0.05 if release.is_set() else 1.0)

    stub.responder = slow
    r = runner(stub, top={"max_in_flight": 2})
    futures = [r.submit(record(i)) for i in range(10)]
    # submit() returned at once; beyond the bound, the futures are already complete.
    assert [f.done() for f in futures[2:]] == [True] * 8
    assert all(f.result()[0].skipped == "overloaded" for f in futures[2:])
    assert r.in_flight == 2 and value(r, "tracejudge_judge_in_flight") == 2
    assert [f.result(timeout=60)[0].value for f in futures[:2]] == ["yes", "yes"]
    wait_until(lambda: r.in_flight == 0)
    assert (
        value(
            r, "tracejudge_judge_skipped_total", app="shop", judge="relevance_to_query", reason="overloaded"
        )
        == 8
    )
    release.set()
    assert r.submit(record(99)).result(timeout=60)[0].value == "yes"
    r.close()


def test_judge_outage_with_timeouts_stays_bounded_and_keeps_flowing(stub: OpenAIStub) -> None:
    stub.responder = lambda req: Reply.verdict("yes", delay=5.0)  # every answer later than the timeout
    r = runner(
        stub, timeout_seconds=0.2, max_retries=0, breaker_failure_threshold=3, top={"max_in_flight": 4}
    )
    waves = []
    for wave in range(50):  # what the stream does: keep submitting, collect results as they come
        futures = [r.submit(record(wave * 4 + i)) for i in range(4)]
        waves.append([f.result(timeout=30)[0] for f in futures])
        assert r.in_flight <= 4
    first = {a.error.split(":")[0] if a.error else a.skipped for a in waves[0]}
    assert first == {"timeout"}
    # Once open, the breaker answers at once: no request, no timeout, no queue.
    assert all(a.skipped == "circuit_open" for wave in waves[1:] for a in wave)
    assert stub.total == 4
    wait_until(lambda: r.in_flight == 0)
    r.close()


def test_close_drains_judgements_in_flight_then_refuses_new_ones(stub: OpenAIStub) -> None:
    stub.responder = lambda req: Reply.verdict("yes", delay=0.3)
    r = runner(stub)
    pending = r.submit(record(1))
    wait_until(lambda: stub.total == 1)
    r.close()
    assert pending.done() and pending.result()[0].value == "yes"  # finished, not cut off
    assert r.submit(record(2)).result()[0].skipped == "closed"
    with pytest.raises(RuntimeError, match="closed"):
        r.judge_sync(record(3))
    r.close()  # idempotent


def test_api_key_from_a_file(stub: OpenAIStub, tmp_path: Any) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-from-a-mounted-secret\n")
    r = runner(stub, api_key_file=str(key_file))
    r.judge_sync(record())
    r.close()
    assert stub.requests[0].headers["authorization"] == "Bearer sk-from-a-mounted-secret"


def test_whole_judgement_deadline(stub: OpenAIStub) -> None:
    stub.responder = lambda req: Reply.verdict("yes", delay=2.0)
    r = runner(stub, timeout_seconds=5.0, top={"judgement_timeout_seconds": 0.2})
    [a] = r.judge_sync(record())
    assert a.error == "timeout: judgement exceeded 0.2s"
    r.close()


def test_judge_many_waits_instead_of_thinning_and_keeps_order(stub: OpenAIStub) -> None:
    stub.responder = lambda req: Reply.verdict("no" if "odd" in req.prompt else "yes", delay=0.02)
    r = runner(stub, top={"max_in_flight": 4})
    records = [record(i, request=f"Question {'odd' if i % 2 else 'even'} {i}?") for i in range(24)]
    values = [a.value for [a] in r.judge_many(records)]
    assert values == ["yes", "no"] * 12
    assert (
        value(
            r, "tracejudge_judge_skipped_total", app="shop", judge="relevance_to_query", reason="overloaded"
        )
        == 0
    )
    r.close()


def test_awaitable_from_an_asyncio_loop(stub: OpenAIStub) -> None:
    r = runner(stub, judges=("relevance_to_query", "safety"))

    async def main() -> list[list[Any]]:
        async with r:
            return await asyncio.gather(*(r.judge(record(i)) for i in range(8)))

    results = asyncio.run(main())
    assert [[a.value for a in one] for one in results] == [["yes", "yes"]] * 8
    assert stub.total == 16


def test_a_runner_is_bound_to_one_event_loop(stub: OpenAIStub) -> None:
    r = runner(stub)

    async def once() -> Any:
        return await r.judge(record())

    asyncio.run(once())
    with pytest.raises(RuntimeError, match="bound to another event loop"):
        asyncio.run(once())


def test_submit_from_many_threads(stub: OpenAIStub) -> None:
    r = runner(stub, top={"max_in_flight": 64})
    results: list[str] = []
    lock = threading.Lock()

    def worker(base: int) -> None:
        for i in range(10):
            [a] = r.submit(record(base + i)).result(timeout=60)
            with lock:
                results.append(a.value)

    threads = [threading.Thread(target=worker, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == ["yes"] * 40
    r.close()
    [a] = r.submit(record(1)).result()
    assert a.skipped == "closed"


def test_emit_skipped_false_leaves_skips_out_of_results_but_counts_them(stub: OpenAIStub) -> None:
    r = runner(stub, judges=("relevance_to_query", "correctness"), top={"emit_skipped": False})
    assessments = r.judge_sync(record())
    assert [a.name for a in assessments] == ["relevance_to_query"]
    assert (
        value(r, "tracejudge_judge_skipped_total", app="shop", judge="correctness", reason="missing_inputs")
        == 1
    )
    r.close()


def test_app_label_limiter_is_applied() -> None:
    r = JudgeRunner(
        {"builtin": {"relevance_to_query": {"provider": "heuristic"}}},
        registry=CollectorRegistry(),
        app_label=lambda app: app if app == "shop" else "other",
    )
    r.judge_sync(record(app="a-thousand-apps-42"))
    assert value(r, "tracejudge_judge_eligible_total", app="other", judge="relevance_to_query") == 1
    assert (
        value(r, "tracejudge_judge_eligible_total", app="a-thousand-apps-42", judge="relevance_to_query") == 0
    )


def test_secrets_and_prompts_never_reach_logs_metrics_or_results(
    stub: OpenAIStub, caplog: pytest.LogCaptureFixture
) -> None:
    key = "sk-proj-SECRET-0123456789abcdef"
    token = "tok-SECRET-HEADER-987654"
    marker = "PROMPT-MARKER-a7f3"  # unique text that only a prompt carries
    replies = [
        Reply.error(401, f"Incorrect API key provided: {key}"),
        Reply.error(500, f"upstream failed for key {key}"),
        Reply.error(400, "response_format json_schema unsupported"),
        Reply.chat(f"free text, not JSON, echoing {marker}"),
        Reply.verdict("yes"),
    ]
    stub.responder = lambda req: Reply.verdict("no")
    stub.enqueue(*replies)
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="tracejudge")
    r = runner(
        stub,
        env={"JUDGE_KEY": key, "GATEWAY_TOKEN": token},
        api_key_env="JUDGE_KEY",
        headers_from_env={"X-Gateway-Token": "GATEWAY_TOKEN"},
        max_retries=0,
        breaker_failure_threshold=2,
    )
    results = []
    for i in range(6):
        rec = record(i, request=f"{marker} question {i}?")
        results.append(EvaluationResult(rec, SourceRef("mlflow"), assessments=r.judge_sync(rec)))
    r.close()
    assert stub.requests[0].headers["authorization"] == f"Bearer {key}"
    assert stub.requests[0].headers["x-gateway-token"] == token
    logs = caplog.text
    assert "circuit opened" in logs  # something was logged, at INFO and above
    metrics_text = (
        generate_latest(r.metrics.registry).decode() + generate_openmetrics(r.metrics.registry).decode()
    )
    for secret in (key, token):
        assert secret not in logs
        assert secret not in metrics_text
        for res in results:
            assert secret not in res.to_json().decode().replace(marker, "")
    assert marker not in logs and marker not in metrics_text
    assert any("***" in (a.error or "") for res in results for a in res.assessments)  # masked echo


def test_prometheus_output_lints_and_carries_trace_id_exemplars(stub: OpenAIStub) -> None:
    r = runner(stub, judges=("relevance_to_query", "groundedness"))
    stub.responder = lambda req: (
        Reply.verdicts({1: "yes"}) if "<statements>" in req.prompt else Reply.verdict("yes")
    )
    r.judge_sync(record(42, trace_id="4bf92f3577b34da6a3ce929d0e0e4736"))
    r.close()
    om = generate_openmetrics(r.metrics.registry).decode()
    exemplar = ' # {trace_id="4bf92f3577b34da6a3ce929d0e0e4736"} 1.0 '
    assert (
        'tracejudge_judge_verdicts_total{app="shop",judge="groundedness",verdict="pass",version=""} 1.0'
        + exemplar in om
    )
    assert 'tracejudge_judge_score_bucket{app="shop",judge="groundedness",le="1.0"} 1.0' + exemplar in om
    text = generate_latest(r.metrics.registry).decode()
    for name in (
        "tracejudge_judge_verdicts_total",
        "tracejudge_judge_score_bucket",
        "tracejudge_judge_eligible_total",
        "tracejudge_judge_sampled_total",
        "tracejudge_judge_duration_seconds_bucket",
        "tracejudge_judge_tokens_total",
    ):
        assert name in text
    promtool = shutil.which("promtool")
    assert promtool, "promtool is installed on the project machines (Debian's prometheus package)"
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    assert lint.returncode == 0, lint.stdout.decode() + lint.stderr.decode()


def test_records_from_real_mlflow_traces(stub: OpenAIStub) -> None:
    rag = normalise(mlflow_apps.run("rag"))
    failing = normalise(mlflow_apps.run("failing"))
    stub.responder = lambda req: (
        Reply.verdicts({1: "yes"}) if "<statements>" in req.prompt else Reply.verdict("yes")
    )
    r = runner(stub, judges=("groundedness", "relevance_to_query"))
    ok = {a.name: a for a in r.judge_sync(rag)}
    failed = r.judge_sync(failing)
    r.close()
    assert ok["groundedness"].passed is True and ok["relevance_to_query"].passed is True
    [req] = [x for x in stub.chat_requests() if "<statements>" in x.prompt]
    assert (
        "MLflow is an open source platform for the machine learning lifecycle." in req.prompt
    )  # from the trace
    assert "[1] (https://mlflow.org/docs/index.html)" in req.prompt
    assert [a.skipped for a in failed] == ["failed_trace", "failed_trace"]
    assert stub.total == 2


def test_heuristic_default_shows_groundedness_dropping_for_ungrounded_answers() -> None:
    r = JudgeRunner(None, registry=CollectorRegistry())
    assert r.judge_names() == ["groundedness", "relevance_to_query"] and not r.needs_event_loop
    rag = normalise(mlflow_apps.run("rag"))
    grounded = {a.name: a for a in r.judge_sync(rag)}
    rag.response = "Our premium plan costs 49 dollars per month and includes phone support."
    ungrounded = {a.name: a for a in r.judge_sync(rag)}
    assert grounded["groundedness"].passed is True and grounded["groundedness"].score == 1.0
    assert ungrounded["groundedness"].passed is False and ungrounded["groundedness"].score == 0.0
    assert "[1] Our premium plan costs 49 dollars" in ungrounded["groundedness"].rationale
    assert all(a.source == "heuristic" for a in [*grounded.values(), *ungrounded.values()])
    assert (
        value(r, "tracejudge_judge_verdicts_total", app=rag.app or "", judge="groundedness", verdict="fail",
              version=rag.version or "")  # MLflow records the checkout's commit, where there is one
        == 1
    )


def test_heuristic_relevance_and_not_applicable() -> None:
    r = JudgeRunner(None, registry=CollectorRegistry())
    on_topic = {a.name: a for a in r.judge_sync(record())}
    off_topic = {a.name: a for a in r.judge_sync(record(response="Bananas are rich in potassium."))}
    empty = {a.name: a for a in r.judge_sync(record(request="Hi!", response="Hello!"))}
    assert on_topic["relevance_to_query"].passed is True
    assert off_topic["relevance_to_query"].score == 0.0 and "missing: return, window" in (
        off_topic["relevance_to_query"].rationale or ""
    )
    assert empty["relevance_to_query"].skipped == "not_applicable"
    assert empty["groundedness"].skipped == "not_applicable"
