"""The judge endpoint's circuit breaker keeps its word (issue 24, item 4), against the real loopback
OpenAI stub and the real httpx client: once the circuit opens no request leaves before the reset, then
exactly one probe; a judgement that sent requests reports the error they got, only one refused before
sending anything is skipped as `circuit_open`; a 429 with a Retry-After the client waits for is
back-pressure, not a failure. Time that the breaker measures is a `FakeClock` the test moves."""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from support.clock import FakeClock
from support.openai_stub import OpenAIStub, Reply, StubRequest, wait_until

from tracejudge.metrics.judges.breaker import CircuitBreaker
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.schemas.record import Document, EvalRecord
from tracejudge.schemas.result import Assessment

JUDGE = "relevance_to_query"
_INDEX = re.compile(r"question number (\d+)\?")


def record(i: int) -> EvalRecord:
    return EvalRecord(
        trace_id=f"{i:032x}",
        app="shop",
        failed=False,
        request=f"How long is the return window, question number {i}?",
        response="Items can be returned within 30 days.",
        retrieved_context=[Document("Items can be returned within 30 days of delivery.")],
    )


def runner(stub: OpenAIStub, clock: FakeClock, **endpoint: Any) -> JudgeRunner:
    ep = {"base_url": stub.base_url, "model": "judge-model", "backoff_initial_seconds": 0.01,
          "backoff_max_seconds": 0.02, "timeout_seconds": 5.0, **endpoint}
    config = {"endpoints": {"default": ep}, "sample_rate": 1.0, "builtin": {JUDGE: {}}, "max_in_flight": 512}
    return JudgeRunner(config, registry=CollectorRegistry(), clock=clock)


def value(r: JudgeRunner, name: str, **labels: str) -> float:
    return r.metrics.registry.get_sample_value(name, labels) or 0.0


def judge_all(r: JudgeRunner, indices: range) -> dict[int, Assessment]:
    """Submit every record at once (as the stream does), then collect: index -> the judge's assessment."""
    futures = {i: r.submit(record(i)) for i in indices}
    return {i: f.result(timeout=60)[0] for i, f in futures.items()}


def sent_indices(requests: list[StubRequest]) -> set[int]:
    """The records whose judgement reached the endpoint (the prompt carries the record's number)."""
    return {int(m.group(1)) for req in requests if (m := _INDEX.search(req.prompt))}


def reason(a: Assessment) -> str:
    return a.error.split(":")[0] if a.error else f"skipped:{a.skipped}" if a.skipped else f"value:{a.value}"


class BreakerLog(logging.Handler):
    """Takes the stub's request count at the moment the client logs "circuit opened" (the moment the
    breaker opens: the client logs it synchronously from the state change)."""

    def __init__(self, stub: OpenAIStub) -> None:
        super().__init__(logging.INFO)
        self.stub = stub
        self.opened_at: list[int] = []
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.lines.append(message)
        if "circuit opened" in message:
            self.opened_at.append(self.stub.total)


@pytest.fixture
def breaker_log(stub: OpenAIStub) -> Iterator[BreakerLog]:
    handler = BreakerLog(stub)
    logger = logging.getLogger("tracejudge.metrics.judges.client")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_no_request_leaves_while_open_then_exactly_one_probe(
    stub: OpenAIStub, breaker_log: BreakerLog, concurrency: int
) -> None:
    """200 judgements at once against an endpoint answering 500 (the issue's run: 189 of 200 requests
    left after "circuit opened", because the breaker was asked before waiting for a connection slot)."""
    clock = FakeClock()
    threshold = 5
    stub.responder = lambda req: Reply.error(500, "boom")
    r = runner(stub, clock, max_concurrency=concurrency, breaker_failure_threshold=threshold, max_retries=3,
               breaker_reset_seconds=30, breaker_max_reset_seconds=300)
    results = judge_all(r, range(200))

    [at_open] = breaker_log.opened_at
    assert at_open >= threshold
    # Only the requests already in flight when it opened can arrive after it (none with one slot).
    assert stub.total - at_open <= concurrency - 1
    assert stub.total <= threshold + concurrency - 1
    if concurrency == 1:
        assert stub.total == threshold

    # A judgement that sent requests reports the error they got; the others were refused unsent.
    sent = sent_indices(list(stub.requests))
    assert sent and len(sent) <= stub.total
    for i, a in results.items():
        assert reason(a) == ("http_5xx" if i in sent else "skipped:circuit_open"), (i, a)
    refused_retries = sum("not retried: circuit open" in (a.error or "") for a in results.values())
    assert refused_retries >= 1
    assert value(r, "tracejudge_judge_errors_total", judge=JUDGE, reason="http_5xx") == len(sent)
    assert value(r, "tracejudge_judge_errors_total", judge=JUDGE, reason="circuit_open") == 0
    assert value(r, "tracejudge_judge_skipped_total", app="shop", judge=JUDGE,
                 reason="circuit_open") == 200 - len(sent)
    assert value(r, "tracejudge_judge_requests_total", endpoint="default", outcome="http_5xx") == stub.total
    assert value(r, "tracejudge_judge_retries_total", endpoint="default",
                 reason="http_5xx") == stub.total - len(sent)
    assert value(r, "tracejudge_judge_circuit_refusals_total", endpoint="default",
                 attempt="retry") == refused_retries
    assert value(r, "tracejudge_judge_circuit_open", endpoint="default") == 1

    # While open, nothing leaves, however many judgements come.
    before = stub.total
    assert {reason(a) for a in judge_all(r, range(200, 300)).values()} == {"skipped:circuit_open"}
    clock.now += 29.9
    assert {reason(a) for a in judge_all(r, range(300, 350)).values()} == {"skipped:circuit_open"}
    assert stub.total == before

    # The reset elapsed: one probe leaves, and while it is in flight every other judgement is refused.
    clock.now += 0.1
    gate = threading.Event()
    held = Reply.error(500, "still down")
    held.hold = gate
    stub.responder = lambda req: held
    wave = {i: r.submit(record(i)) for i in range(400, 450)}
    wait_until(lambda: stub.total == before + 1)
    wait_until(lambda: sum(f.done() for f in wave.values()) == len(wave) - 1)
    assert stub.total == before + 1
    gate.set()
    probe_wave = {i: f.result(timeout=30)[0] for i, f in wave.items()}
    [probe] = [i for i, a in probe_wave.items() if a.skipped is None]
    assert sent_indices([stub.requests[-1]]) == {probe}
    assert reason(probe_wave[probe]) == "http_5xx" and "still down" in (probe_wave[probe].error or "")
    assert [reason(a) for i, a in probe_wave.items() if i != probe] == ["skipped:circuit_open"] * 49

    # The failed probe reopened it for twice as long: its retry was not sent, nor is anything else.
    assert stub.total == before + 1
    clock.now += 59.9
    assert {reason(a) for a in judge_all(r, range(500, 520)).values()} == {"skipped:circuit_open"}
    assert stub.total == before + 1

    # Then a probe that succeeds closes it, and judgements flow again.
    clock.now += 0.1
    stub.responder = lambda req: Reply.verdict("yes")
    assert reason(r.judge_sync(record(600))[0]) == "value:yes"
    assert {reason(a) for a in judge_all(r, range(601, 640)).values()} == {"value:yes"}
    assert stub.total == before + 1 + 40
    assert value(r, "tracejudge_judge_circuit_open", endpoint="default") == 0
    assert len(breaker_log.opened_at) == 2 and sum("circuit closed" in x for x in breaker_log.lines) == 1
    r.close()


def _hang(gate: threading.Event) -> Callable[[StubRequest], Reply]:
    def reply(req: StubRequest) -> Reply:
        answer = Reply.verdict("yes")
        answer.hold = gate  # never set: the client's timeout fires first
        return answer

    return reply


@pytest.mark.parametrize(
    ("kind", "expected", "endpoint"),
    [
        ("503", "http_5xx", {}),
        ("503 asking for longer than allowed", "http_5xx", {"max_retry_after_seconds": 1}),
        ("429 without Retry-After", "rate_limited", {}),
        ("429 asking for longer than allowed", "rate_limited", {"max_retry_after_seconds": 1}),
        ("timeout", "timeout", {"timeout_seconds": 0.3}),
    ],
)
def test_an_attempted_judgement_reports_the_error_it_got(
    stub: OpenAIStub, breaker_log: BreakerLog, kind: str, expected: str, endpoint: dict[str, Any]
) -> None:
    never = threading.Event()
    responders: dict[str, Callable[[StubRequest], Reply]] = {
        "503": lambda req: Reply.error(503, "overloaded"),
        "503 asking for longer than allowed": lambda req: Reply.error(503, "maintenance", retry_after=120),
        "429 without Retry-After": lambda req: Reply.error(429, "slow down"),
        "429 asking for longer than allowed": lambda req: Reply.error(429, "quota", retry_after=120),
        "timeout": _hang(never),
    }
    stub.responder = responders[kind]
    r = runner(stub, FakeClock(), max_concurrency=4, breaker_failure_threshold=4, max_retries=2, **endpoint)
    try:
        results = judge_all(r, range(40))
    finally:
        never.set()
    sent = sent_indices(list(stub.requests))
    assert breaker_log.opened_at and sent
    for i, a in results.items():
        assert reason(a) == (expected if i in sent else "skipped:circuit_open"), (kind, i, a)
    assert value(r, "tracejudge_judge_errors_total", judge=JUDGE, reason=expected) == len(sent)
    assert value(r, "tracejudge_judge_errors_total", judge=JUDGE, reason="circuit_open") == 0
    assert stub.total <= 4 + 3  # the threshold, and what was in flight when it opened
    r.close()


def test_a_burst_of_429s_with_retry_after_loses_no_judgement(
    stub: OpenAIStub, breaker_log: BreakerLog
) -> None:
    """Eight 429s with `Retry-After: 1` (the issue: they opened the breaker and lost 8 of 30 judgements
    for 30 s although the endpoint was fine a second later). Back-pressure is waited for, not counted."""
    clock = FakeClock()
    stub.enqueue(*[Reply.error(429, "rate limit reached", retry_after=1) for _ in range(8)])
    r = runner(stub, clock)  # the endpoint defaults: 5 failures open the circuit, 3 retries
    results = judge_all(r, range(30))

    assert [reason(a) for a in results.values()] == ["value:yes"] * 30
    assert stub.total == 38
    assert not breaker_log.opened_at and r.clients["default"].breaker.state == "closed"
    assert value(r, "tracejudge_judge_circuit_open", endpoint="default") == 0
    assert value(r, "tracejudge_judge_requests_total", endpoint="default", outcome="http_429") == 8
    assert value(r, "tracejudge_judge_retries_total", endpoint="default", reason="rate_limited") == 8
    assert value(r, "tracejudge_judge_skipped_total", app="shop", judge=JUDGE, reason="circuit_open") == 0
    # Each judgement told to wait waited what it was told before asking again.
    arrivals: dict[int, list[float]] = {}
    for req in stub.requests:
        arrivals.setdefault(int(_INDEX.search(req.prompt).group(1)), []).append(req.at)  # type: ignore[union-attr]
    waited = [times[1] - times[0] for times in arrivals.values() if len(times) == 2]
    assert len(waited) == 8 and min(waited) >= 1.0
    r.close()


def test_back_pressure_neither_counts_nor_forgives_failures() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(2, 10.0, clock=clock)
    first = breaker.try_acquire()
    assert first is not None
    breaker.record(first, False)
    for _ in range(5):  # any number of 429s the client waits for: still one failure counted
        permit = breaker.try_acquire()
        assert permit is not None
        breaker.back_pressure(permit)
    assert breaker.state == "closed"
    permit = breaker.try_acquire()
    assert permit is not None
    breaker.record(permit, False)  # the second failure in a row opens it: the 429s forgave nothing
    assert breaker.state == "open" and breaker.refuses_for() == 10.0
    clock.now += 10
    probe = breaker.try_acquire()
    assert probe is not None and probe.probe and breaker.refuses_for() == 0.0
    breaker.back_pressure(probe)  # the endpoint answered: it is up, the circuit closes
    assert breaker.state == "closed"


def test_a_call_waiting_for_a_slot_when_the_circuit_opens_is_refused_unsent(stub: OpenAIStub) -> None:
    """The core of the fix, one slot: a judgement queued behind a failing request does not follow it."""
    clock = FakeClock()
    gate = threading.Event()
    first = Reply.error(500, "boom")
    first.hold = gate
    stub.enqueue(first)
    # A request budget the frozen clock never refills: what a judgement takes from it once it has passed
    # the runner's own breaker check, in the same step as it starts waiting for the connection slot.
    r = runner(stub, clock, max_concurrency=1, breaker_failure_threshold=1, max_retries=0,
               requests_per_second=100)
    bucket = r.budgets["default"].requests
    assert bucket is not None
    holder = r.submit(record(1))
    wait_until(lambda: stub.total == 1)  # the slot is taken, the request in flight
    queued: list[concurrent.futures.Future[list[Assessment]]] = [r.submit(record(i)) for i in range(2, 12)]
    wait_until(lambda: bucket.level == 100 - 11)  # all ten wait for the slot, the breaker still closed
    assert not any(f.done() for f in queued)
    gate.set()
    assert reason(holder.result(timeout=30)[0]) == "http_5xx"
    assert [reason(f.result(timeout=30)[0]) for f in queued] == ["skipped:circuit_open"] * 10
    assert stub.total == 1
    assert value(r, "tracejudge_judge_circuit_refusals_total", endpoint="default", attempt="first") == 10
    r.close()
