"""Fleet-wide spend caps (`judges.fleet_spend`): the caps hold across replicas through leases on a Kafka
partition (tracejudge.metrics.judges.fleet_spend, tracejudge.consumer.runtime.fleet_spend).

Real parts only: the Tansu broker, the loopback OpenAI-compatible stub billing large usage, three real
`tracejudge run` processes, SIGKILL; a port nothing listens on for the unreachable broker.
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from prometheus_client import CollectorRegistry
from support.kafka import RunnerProcess, produce, shared_broker, unique, wait_until
from support.openai_stub import OpenAIStub, Reply, StubRequest

from tracejudge.consumer.config import load_settings
from tracejudge.consumer.demo.broker import free_port
from tracejudge.consumer.runtime.fleet_spend import FleetSpendBoard
from tracejudge.metrics.judges.config import load_judges_config
from tracejudge.metrics.judges.fleet_spend import FleetSpendConfig, FleetSpendLedger, unattached_ledgers
from tracejudge.schemas.errors import JudgeConfigError

PRICE = {"input_per_mtok": 1000.0, "output_per_mtok": 2000.0}  # dear: a few judgements reach the cap
CAP = 30.0
MAX_REPLICAS = 3
LEASE = CAP / (4 * MAX_REPLICAS)


# -- configuration ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fleet", "key"), [
    ({"max_replicas": 0}, "judges.fleet_spend.max_replicas"),
    ({"publish_interval_s": 5, "stale_after_s": 5}, "judges.fleet_spend.stale_after_s"),
    ({"topic": "has space"}, "judges.fleet_spend.topic"),
    ({"replica_id": "a|b"}, "judges.fleet_spend.replica_id"),
    ({"replicas": 3}, "judges.fleet_spend.replicas"),
])
def test_a_bad_fleet_spend_setting_is_a_config_error_naming_the_key(fleet: dict[str, Any], key: str) -> None:
    with pytest.raises(JudgeConfigError) as err:
        load_judges_config({"fleet_spend": fleet})
    assert str(err.value).startswith(key)


def test_without_a_kafka_transport_the_caps_stay_per_process() -> None:
    """`tracejudge eval`, `calibrate` and the API run no Kafka client: the same configuration judges
    at once under the process's own cap instead of waiting for leases nobody serves."""
    from tracejudge.metrics.judges.runner import JudgeRunner
    from tracejudge.schemas.record import EvalRecord

    with OpenAIStub(_largest_usage) as stub:
        config = {"endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model", "price": PRICE,
                                            "usd_per_hour": 3.0, "max_output_tokens": 256}},
                  "sample_rate": 1.0, "builtin": {"relevance_to_query": {}},
                  "fleet_spend": {"topic": unique("spend"), "max_replicas": 3}}
        with JudgeRunner(config) as runner:
            results = [runner.judge_sync(EvalRecord(trace_id=f"{i:032x}", request=f"question {i}?",
                                                    response="answer"))[0] for i in range(5)]
    judged = [a for a in results if a.skipped is None]
    assert judged and all(a.passed for a in judged)
    assert [a.skipped for a in results[len(judged):]] == ["budget"] * (5 - len(judged))
    assert _billed(stub) <= 3.0


# -- the lease protocol, three ledgers on the real broker ---------------------------------------------

def _settings(bootstrap: str) -> Any:
    return load_settings(environ={}, require_topics=False,
                         overrides={"kafka.bootstrap_servers": bootstrap, "kafka.request_timeout_ms": 3000,
                                    "kafka.bootstrap_timeout_ms": 2000})


def test_three_ledgers_charging_at_once_never_grant_more_than_the_cap() -> None:
    bootstrap = shared_broker().bootstrap_servers
    config = FleetSpendConfig(topic=unique("spend"), max_replicas=MAX_REPLICAS, publish_interval_s=0.2,
                              stale_after_s=30)
    ledgers = [FleetSpendLedger(config.model_copy(update={"replica_id": f"r{i}"})) for i in range(3)]
    for ledger in ledgers:
        ledger.track("judge", {"hour": CAP})
    boards = [FleetSpendBoard(_settings(bootstrap), ledger).start() for ledger in ledgers]
    charged = [0.0, 0.0, 0.0]
    done = threading.Event()

    def spend(i: int) -> None:
        rng = random.Random(i)
        while not done.is_set():
            usd = rng.uniform(0.05, 1.5)
            if ledgers[i].try_charge("judge", usd) is not None:
                charged[i] += usd
            else:
                done.wait(0.005)

    threads = [threading.Thread(target=spend, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        # Every replica reads the same log, so all see the same granted total: the whole cap.
        wait_until(lambda: all(ledger.granted("judge", "hour")[1] >= CAP - 0.01 for ledger in ledgers), 60,
                   message="the cap granted as leases")
        wait_until(lambda: sum(charged) >= CAP - 3 * 1.5, 30, message="the leases spent")
        done.set()
        for t in threads:
            t.join()
        assert sum(charged) <= CAP + 1e-9, charged
        own = [ledger.granted("judge", "hour")[0] for ledger in ledgers]
        assert sum(own) <= CAP + 1e-9 and all(c <= g + 1e-9 for c, g in zip(charged, own, strict=True))
        # Every replica got leases (no replica starved while the others were busy).
        assert all(c > 0 for c in charged), charged
        # The published spend adds up to the same fleet total on every replica.
        wait_until(lambda: all(abs(ledger.fleet_spent("judge", "hour") - sum(charged)) < 1e-6
                               for ledger in ledgers), 30, message="the fleet total on every replica")
        assert not any(ledger.in_fallback() for ledger in ledgers)
    finally:
        done.set()
        for board in boards:
            board.close()


def test_an_idle_replica_gives_its_lease_back_to_a_busy_one() -> None:
    bootstrap = shared_broker().bootstrap_servers
    config = FleetSpendConfig(topic=unique("spend"), max_replicas=MAX_REPLICAS, publish_interval_s=0.2,
                              stale_after_s=30)
    idle, busy = (FleetSpendLedger(config.model_copy(update={"replica_id": r})) for r in ("idle", "busy"))
    for ledger in (idle, busy):
        ledger.track("judge", {"hour": CAP})
    boards = [FleetSpendBoard(_settings(bootstrap), ledger).start() for ledger in (idle, busy)]
    try:
        wait_until(lambda: idle.try_charge("judge", 0.5) is not None, 30,
                   message="the idle replica's first lease")
        assert idle.granted("judge", "hour")[0] >= 0.5
        spent = [0.0]

        def busy_spends() -> bool:
            while busy.try_charge("judge", 1.0) is not None:
                spent[0] += 1.0
            return spent[0] >= CAP - 0.5 - 1.0  # all but the idle one's spend and a part judgement

        wait_until(busy_spends, 60, message="the busy replica spends the rest of the cap")
        assert spent[0] + 0.5 <= CAP + 1e-9
        assert idle.granted("judge", "hour")[0] == pytest.approx(0.5)  # it kept only what it spent
    finally:
        for board in boards:
            board.close()


def test_reading_the_log_again_after_a_reconnect_counts_no_claim_or_release_twice() -> None:
    now = [1000.0]
    config = FleetSpendConfig(replica_id="me", max_replicas=2, publish_interval_s=1, stale_after_s=60,
                              claim_wait_s=0)
    ledger = FleetSpendLedger(config, wall=lambda: 7200.0, clock=lambda: now[0])
    ledger.attached = True  # this test is the transport: it hands the ledger its own records back
    ledger.track("e", {"hour": 8.0})
    ledger.synced()
    log: list[tuple[str, bytes]] = []

    def deliver() -> None:  # what the broker would hand back, in log order
        for key, value in ledger.take_outbox():
            log.append((key, value))
            ledger.apply(key, value)

    assert ledger.try_charge("e", 0.5) is None  # claims a lease (8 / (4 x 2) = 1.0)
    deliver()
    charged = ledger.try_charge("e", 0.6)
    assert charged == {"hour": 2}
    deliver()  # the next lease, claimed when half of the first was spent
    assert ledger.granted("e", "hour") == (2.0, 2.0)
    now[0] += 10  # idle for more than two publish intervals: the unspent part goes back
    ledger.release_idle()
    deliver()
    before = (ledger.granted("e", "hour"), ledger.fleet_spent("e", "hour"))
    assert before == (pytest.approx((0.6, 0.6)), pytest.approx(0.6))
    ledger.reread()
    for key, value in log:
        ledger.apply(key, value)
    ledger.synced()
    assert (ledger.granted("e", "hour"), ledger.fleet_spent("e", "hour")) == before
    ledger.settle("e", charged, 0.6, 0.25)  # the judgement cost less than its estimate
    assert ledger.fleet_spent("e", "hour") == pytest.approx(0.25)


def test_an_unreachable_broker_falls_back_to_the_local_share_and_says_so() -> None:
    registry = CollectorRegistry()
    config = FleetSpendConfig(topic=unique("spend"), max_replicas=4, publish_interval_s=0.1,
                              stale_after_s=2.0)
    ledger = FleetSpendLedger(config, registry)
    ledger.track("judge", {"day": 20.0})
    board = FleetSpendBoard(_settings(f"127.0.0.1:{free_port()}"), ledger)
    assert ledger.try_charge("judge", 1.0) is None  # no lease yet, and not stale yet: nothing is spent
    board.start()
    try:
        wait_until(ledger.in_fallback, 30, message="the fallback")
        assert registry.get_sample_value("tracejudge_judge_spend_fleet_fallback", {"endpoint": "judge"}) == 1
        accepted = sum(1 for _ in range(10) if ledger.try_charge("judge", 1.0) is not None)
        assert accepted == 5  # the local share: cap / max_replicas = 20 / 4
        assert registry.get_sample_value("tracejudge_judge_spend_fleet_usd",
                                         {"endpoint": "judge", "window": "day"}) == 5.0
    finally:
        board.close()


# -- three `tracejudge run` processes against the stub billing large usage ----------------------------

def _largest_usage(req: StubRequest) -> Reply:
    """The largest usage a judgement can be billed within its estimate (as test_cost does)."""
    return Reply.verdict("yes", prompt_tokens=(len(req.prompt) // 4 + 1) * 2,
                         completion_tokens=req.body["max_tokens"])


def _billed(stub: OpenAIStub) -> float:
    """What the endpoint billed, counted at the server from its own answers."""
    total = 0.0
    for _, reply in list(stub.answered):
        usage = orjson.loads(reply.body)["usage"]
        total += (usage["prompt_tokens"] * PRICE["input_per_mtok"]
                  + usage["completion_tokens"] * PRICE["output_per_mtok"]) / 1e6
    return total


def _fleet_usd(proc: RunnerProcess) -> float:
    return proc.metric("tracejudge_judge_spend_fleet_usd", endpoint="default", window="hour")


def _config(path: Path, stub: OpenAIStub, topic: str, group: str, spend_topic: str, replica: str) -> Path:
    path.write_text(yaml.safe_dump({
        "kafka": {"group_id": group},
        "stream": {"topics": [{"name": topic, "format": "agent_eval"}]},
        "judges": {
            "endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model", "max_retries": 0,
                                      "price": PRICE, "usd_per_hour": CAP, "max_output_tokens": 256}},
            "sample_rate": 1.0, "builtin": {"relevance_to_query": {}},
            "fleet_spend": {"topic": spend_topic, "replica_id": replica, "max_replicas": MAX_REPLICAS,
                            "publish_interval_s": 0.3, "stale_after_s": 60},
        },
    }))
    return path


def _rows(prefix: str, n: int) -> list[bytes]:
    return [orjson.dumps({"request_id": f"{prefix}{i}", "request": f"How long is return window {i}?",
                          "response": "Items can be returned within 30 days."}) for i in range(n)]


def test_three_replicas_hold_the_cap_across_a_kill_and_one_busy_partition_gets_the_rest(tmp_path: Path
                                                                                         ) -> None:
    bootstrap = shared_broker().bootstrap_servers
    topic, group, spend = unique("fleet-traces"), unique("fleet"), unique("fleet-spend")
    produce(bootstrap, topic, [b"{}"], keys=[b"warm"])  # makes the topic (several partitions on Tansu)
    with OpenAIStub(_largest_usage) as stub:
        configs = [_config(tmp_path / f"r{i}.yaml", stub, topic, group, spend, f"replica-{i}")
                   for i in range(3)]
        procs = [RunnerProcess(bootstrap, "--config", str(c)) for c in configs]
        try:
            for p in procs:
                p.wait_ready()
            # Phase 1: a few judgements spread over the partitions, well under the cap.
            produce(bootstrap, topic, _rows("a", 6), keys=[f"k{i}".encode() for i in range(6)])
            wait_until(lambda: stub.total >= 6, 90, message=lambda: f"six judgements; {procs[0].log[-3000:]}")
            one = _billed(stub) / stub.total
            # Every replica publishes what it spent; the fleet total is what the endpoint billed.
            wait_until(lambda: all(abs(_fleet_usd(p) - _billed(stub)) < 1e-6 for p in procs), 60,
                       message="the fleet total on every replica")
            # SIGKILL mid-window a replica that spent, and restart it under the same replica id (a pod
            # name): its spend stays counted once, and its leases are not freed.
            own = [p.metric("tracejudge_judge_cost_usd_total", judge="relevance_to_query") for p in procs]
            victim = own.index(max(own))
            assert own[victim] > 0
            procs[victim].kill()
            procs[victim] = RunnerProcess(bootstrap, "--config", str(configs[victim])).wait_ready()
            wait_until(lambda: abs(_fleet_usd(procs[victim]) - _billed(stub)) < 1e-6, 60,
                       message="the restarted replica resumes the fleet total (no double count)")
            # Phase 2: far more than the cap, all in one partition: one replica works, two are idle.
            rows = _rows("b", int(3 * CAP / one))
            placed = produce(bootstrap, topic, rows, keys=[b"one-partition"] * len(rows))
            assert len({p for p, _ in placed}) == 1
            before = stub.total

            def budget_skips() -> float:
                return sum(sum(p.series("tracejudge_judge_skipped_total", reason="budget")) for p in procs)

            # Every record of phase 2 judged or skipped as budget.
            wait_until(lambda: budget_skips() + stub.total - before >= len(rows), 180,
                       message="phase 2 judged or skipped")
            assert budget_skips() > 0
            wait_until(lambda: all(abs(_fleet_usd(p) - _billed(stub)) < 1e-6 for p in procs), 60,
                       message="the fleet total settled")
            billed = _billed(stub)
            print(f"fleet spend: cap ${CAP:g}/h, 3 replicas, billed ${billed:.3f} by {stub.total} calls "
                  f"(${one:.3f} each), {budget_skips():.0f} skipped as budget")
            # The bound: every replica reached the topic, so the fleet spent within the cap.
            assert billed <= CAP + 1e-9
            # Not starved: the idle replicas gave their leases back; the busy one used the cap but for
            # the killed incarnation's unspent lease (at most 1.5, never freed) and its last judgement.
            assert billed >= CAP - 1.5 * LEASE - 2 * one, (billed, one)
            assert all(p.metric("tracejudge_judge_spend_fleet_fallback", endpoint="default") == 0
                       for p in procs)
        finally:
            for p in procs:
                p.kill()


# -- the wait for a lease, on the runner's event loop -------------------------------------------------

def _capped_runner(stub: OpenAIStub, registry: CollectorRegistry, replica: str | None = None,
                   **fleet: Any) -> Any:
    from tracejudge.metrics.judges.runner import JudgeRunner

    spend = {"topic": unique("spend"), "max_replicas": MAX_REPLICAS, "publish_interval_s": 0.2,
             "stale_after_s": 60, "replica_id": replica, **fleet}
    endpoint = {"base_url": stub.base_url, "model": "judge-model", "price": PRICE, "usd_per_hour": CAP,
                "max_output_tokens": 256}
    return JudgeRunner({"endpoints": {"default": endpoint}, "sample_rate": 1.0,
                        "builtin": {"relevance_to_query": {}}, "fleet_spend": spend}, registry=registry)


def _record(i: int) -> Any:
    from tracejudge.schemas.record import EvalRecord

    return EvalRecord(trace_id=f"{i:032x}", request=f"How long is return window {i}?",
                      response="Items can be returned within 30 days.")


def _ledger_of(runner: Any) -> FleetSpendLedger:
    ledger = runner.spending.fleet
    assert isinstance(ledger, FleetSpendLedger)
    return ledger


def _read_then_cut(ledger: FleetSpendLedger) -> None:
    """Serve `ledger` until it has read the topic to its end, then stop its board: the claims it makes
    from now on are never sent, so never decided (a broker that stopped answering, not yet for
    `stale_after_s`: no fallback)."""
    board = FleetSpendBoard(_settings(shared_broker().bootstrap_servers), ledger).start()
    try:
        wait_until(lambda: ledger.ready, 30, message="the spend topic read")
    finally:
        board.close()
    assert not board.running and not ledger.in_fallback()


async def _until(predicate: Any, timeout: float = 30.0) -> None:
    """Yield to the loop until `predicate` holds (fail after `timeout` seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not met"
        await asyncio.sleep(0.005)


def _skipped(registry: CollectorRegistry, reason: str) -> float:
    return sum(s.value for m in registry.collect() for s in m.samples
               if s.name == "tracejudge_judge_skipped_total" and s.labels.get("reason") == reason)


def test_a_judgement_waiting_for_a_lease_leaves_the_event_loop_to_the_other_judgements() -> None:
    """Judgements run concurrently on one event loop: one waiting for a lease (here one that never
    comes, with claim_wait_s longer than the test) must not hold up the others."""
    from tracejudge.metrics.judges.runner import JudgeRunner

    registry = CollectorRegistry()
    with OpenAIStub() as stub:
        capped = _capped_runner(stub, registry, claim_wait_s=30)
        ledger = _ledger_of(capped)
        _read_then_cut(ledger)
        free = JudgeRunner({"endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model"}},
                            "sample_rate": 1.0, "builtin": {"relevance_to_query": {}}})
        ticks: list[int] = []

        async def tick() -> None:
            while True:
                ticks.append(ledger.waiting)
                await asyncio.sleep(0.005)

        async def scenario() -> tuple[Any, tuple[bool, int], Any]:
            ticker = asyncio.create_task(tick())
            waiting = asyncio.create_task(capped.judge(_record(0)))
            await _until(lambda: ledger.waiting == 1)
            others = await asyncio.gather(*(free.judge(_record(i)) for i in range(1, 4)))
            during = (not waiting.done(), ledger.waiting)
            await free.aclose()
            await capped.aclose(drain_seconds=0)  # closing the runner ends the wait: skipped as budget
            ticker.cancel()
            return others, during, await waiting

        others, during, waited = asyncio.run(scenario())
    # The other judgements completed, and the ticker ran, while the first still waited for its lease.
    assert during == (True, 1)
    assert [a.passed for result in others for a in result] == [True, True, True]
    assert ticks.count(1) >= 1
    assert stub.total == 3  # only the others called the endpoint
    assert [a.skipped for a in waited] == ["budget"]
    assert _skipped(registry, "budget") == 1
    assert capped.spend_caps["default"].remaining()["hour"] == pytest.approx(CAP)  # the estimate given back


def test_a_lease_that_never_comes_ends_the_wait_after_claim_wait_s_as_a_counted_budget_skip() -> None:
    registry = CollectorRegistry()
    with OpenAIStub() as stub:
        capped = _capped_runner(stub, registry)  # claim_wait_s: the default, 1 s
        ledger = _ledger_of(capped)
        _read_then_cut(ledger)
        seen: list[int] = []

        async def scenario() -> Any:
            both = asyncio.gather(capped.judge(_record(0)), capped.judge(_record(1)))
            while not both.done():  # this coroutine runs during the waits: the loop is free
                seen.append(ledger.waiting)
                await asyncio.sleep(0.01)
            return await both

        waited = asyncio.run(scenario())
        capped.close()
    assert [a.skipped for result in waited for a in result] == ["budget", "budget"]
    assert _skipped(registry, "budget") == 2
    # Ticks during the waits; one judgement waits at a time, the other queues behind it.
    assert seen.count(1) >= 1 and max(seen) == 1
    assert stub.total == 0 and ledger.waiting == 0
    assert capped.spend_caps["default"].remaining()["hour"] == pytest.approx(CAP)
    assert ledger.fleet_spent("default", "hour") == 0.0


def test_a_judgement_waiting_for_its_first_lease_is_woken_by_the_board_and_judged() -> None:
    registry = CollectorRegistry()
    with OpenAIStub() as stub:
        # Ends as soon as the claim is decided. A long publish interval: an idle replica gives its
        # lease back after two of them, which on a loaded machine could come before the checks below.
        capped = _capped_runner(stub, registry, claim_wait_s=30, publish_interval_s=20)
        ledger = _ledger_of(capped)
        board = FleetSpendBoard(_settings(shared_broker().bootstrap_servers), ledger).start()
        try:
            wait_until(lambda: ledger.ready, 30, message="the spend topic read")
            assert ledger.granted("default", "hour") == (0.0, 0.0)  # no lease yet: the judgement claims one
            [judged] = asyncio.run(capped.judge(_record(0)))
        finally:
            capped.close()
            board.close()
    assert judged.skipped is None and judged.passed
    assert stub.total == 1 and ledger.waiting == 0
    assert ledger.granted("default", "hour")[0] >= LEASE - 1e-9
    assert _skipped(registry, "budget") == 0


def test_a_closed_runner_s_ledger_leaves_the_registry_and_its_board_stops() -> None:
    pod = unique("pod")
    with OpenAIStub() as stub:
        runners = [_capped_runner(stub, CollectorRegistry(), replica=pod) for _ in range(2)]
        first, second = (_ledger_of(r) for r in runners)
        assert (first.replica, second.replica) == (pod, f"{pod}~1")  # a second runner: a replica of its own
        assert {first, second} <= set(unattached_ledgers())
        board = FleetSpendBoard(_settings(shared_broker().bootstrap_servers), first).start()
        try:
            wait_until(lambda: first.ready, 30, message="the spend topic read")
            runners[0].close()
            wait_until(lambda: not board.running, 30, message="the board stopped with its ledger")
        finally:
            board.close()
        assert first.closed and first.try_charge("default", 0.01) is None  # charges nothing more
        # A runner made now never takes a name a ledger of this process had (its last record may be on
        # the topic), nor one an open ledger has.
        third = _ledger_of(_capped_runner(stub, CollectorRegistry(), replica=pod))
        assert third.replica == f"{pod}~2"
        runners[1].close()
        assert second not in unattached_ledgers() and third in unattached_ledgers()
        third.close()
        assert third not in unattached_ledgers()
