"""`tracejudge sessions` on the consumer runtime, against the real broker.

Turns are real result lines (`EvaluationResult(...).to_json()` of records with a session id and a
timestamp) on a three-partition results topic, keyed by session key as `tracejudge run` keys them;
the stage runs in-process (`SessionRunner`) or as the real `tracejudge sessions` process. Covers:
closing on inactivity with turns in timestamp order and the session metrics; interleaved sessions
over three partitions; max_turns / max_duration (incomplete); the memory caps (evicted, counted);
reopening (evaluation 2 with every turn); turns placed by arrival; dead letters; committed offsets
(a published session's turns committed, an open one's not); SIGKILL and restart; a rebalance.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kafka import KafkaProducer
from prometheus_client import CollectorRegistry
from support.kafka import (
    FAST_GROUP,
    RunnerProcess,
    committed_offsets,
    metric,
    read_topic,
    scrape,
    unique,
    wait_until,
)

from tracejudge.consumer.config import Settings, load_settings
from tracejudge.consumer.demo.command import create_topic
from tracejudge.consumer.runtime import producing as headers
from tracejudge.consumer.stages.sessions import TURN_OVERHEAD_BYTES, SessionRunner
from tracejudge.schemas.record import EvalRecord, TokenUsage, ToolCall
from tracejudge.schemas.result import SCHEMA_VERSION, Assessment, EvaluationResult, SourceRef, session_key
from tracejudge.schemas.session import SessionResult

pytestmark = pytest.mark.timeout(240)
PARTITIONS = 3
NOW = time.time()


# -- turns ------------------------------------------------------------------------------------------


def turn(session: str | None, i: int, ts: float | None, *, failed: bool = False, user: str | None = "user-1",
         app: str = "helpdesk", request: str | None = None, tools: int = 0) -> EvaluationResult:
    """The result of turn `i` of `session` as `tracejudge run` publishes it."""
    trace_id = f"{abs(hash((session, i))):032x}"[:32]
    return EvaluationResult(
        record=EvalRecord(request_id=f"{session}-{i}", trace_id=trace_id, app=app, source_format="otlp_proto",
                          request=request or f"question {i} of {session}", response=f"answer {i}",
                          failed=failed, error="boom" if failed else None, timestamp=ts, latency_seconds=0.5,
                          tokens=TokenUsage(input=10 + i, output=20 + i),
                          trajectory=[ToolCall(tool_name="search")] * tools,
                          session_id=session, user_id=user),
        source=SourceRef(format="otlp_proto", topic="traces", partition=0, offset=i),
        assessments=[Assessment(name="groundedness", value="yes", score=1.0, passed=True,
                                source="heuristic")])


def key_of(result: EvaluationResult) -> bytes:
    return (result.key or "").encode()


def produce_to(bootstrap: str, topic: str, items: Iterable[tuple[int | None, bytes | None, bytes | None]]
               ) -> list[tuple[int, int]]:
    """(partition or None for the key's, key, value) each; waits for the acks; (partition, offset)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    try:
        futures = [producer.send(topic, value=v, key=k, partition=p) for p, k, v in items]
        producer.flush(timeout=30)
        return [(md.partition, md.offset) for md in (f.get(timeout=30) for f in futures)]
    finally:
        producer.close(timeout=5)


def produce_turns(bootstrap: str, topic: str, results: Sequence[EvaluationResult],
                  partition: int | None = None) -> list[tuple[int, int]]:
    return produce_to(bootstrap, topic, [(partition, key_of(r), r.to_json()) for r in results])


def new_topic(bootstrap: str, prefix: str) -> str:
    """A fresh topic of `PARTITIONS` partitions."""
    name = unique(prefix)
    create_topic(bootstrap, name, PARTITIONS)
    return name


# -- the stage ----------------------------------------------------------------------------------------


def stage_settings(bootstrap: str, source: str, results: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"kafka.bootstrap_servers": bootstrap, "sessions.input_topic": source,
                              "sessions.results_topic": results, "sessions.inactivity_s": 1.0,
                              "stream.commit_interval_ms": 100, "stream.lag_interval_seconds": 0.2,
                              "http.port": 0, "http.bind_address": "127.0.0.1", **FAST_GROUP}
    values.update(overrides)
    return load_settings(environ={}, overrides=values, require_topics=False)


@contextmanager
def running(settings: Settings, **kwargs: Any) -> Iterator[SessionRunner]:
    """A `SessionRunner` in a thread; stopped (and joined) on exit, failing the test if it crashed."""
    runner = SessionRunner(settings, registry=CollectorRegistry(auto_describe=True), **kwargs)
    runner.start()
    try:
        wait_until(lambda: runner.http_port is not None or runner.error is not None, 30,
                   message="the session stage serves /metrics")
        if runner.error is not None:
            raise AssertionError(f"the session stage failed to start: {runner.error!r}")
        yield runner
    finally:
        runner.stop()
        assert runner.join(60), "the session stage did not stop within 60 s"
    if runner.error is not None:
        raise AssertionError(f"the session stage crashed: {runner.error!r}") from runner.error


def session_results(bootstrap: str, topic: str, at_least: int) -> list[tuple[Any, SessionResult]]:
    """(Kafka record, session result) of every session result line on `topic`."""
    return [(m, SessionResult.from_dict(json.loads(m.value)))
            for m in read_topic(bootstrap, topic, at_least=at_least, timeout=60)]


def latest(results: Iterable[tuple[Any, SessionResult]]) -> dict[str, SessionResult]:
    """The result of the latest evaluation of each session (the most turns among equals)."""
    out: dict[str, SessionResult] = {}
    for _, r in results:
        old = out.get(r.session_id)
        if old is None or (r.evaluation, len(r.turns)) >= (old.evaluation, len(old.turns)):
            out[r.session_id] = r
    return out


def with_all_turns(bootstrap: str, topic: str, want: dict[str, int], timeout: float = 60.0
                   ) -> dict[str, list[SessionResult]]:
    """Every session result per session, once each session in `want` has one with that many turns."""
    got: dict[str, list[SessionResult]] = {}

    def complete() -> bool:
        got.clear()
        for _, r in session_results(bootstrap, topic, at_least=0):
            got.setdefault(r.session_id, []).append(r)
        return all(any(len(r.turns) == n for r in got.get(sid, [])) for sid, n in want.items())

    wait_until(complete, timeout, interval=0.2, message=lambda: f"sessions {want}; have "
               f"{ {k: [len(r.turns) for r in v] for k, v in got.items()} }")
    return got


def committed_to(bootstrap: str, group: str, topic: str, want: dict[int, int | None]) -> bool:
    committed = committed_offsets(bootstrap, group, topic)
    return all(committed.get(p) == o for p, o in want.items())


def promtool_lint(text: bytes) -> None:
    from support.deploy_files import tool

    proc = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=30,
                          check=False)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


# -- in-process -----------------------------------------------------------------------------------------


def test_interleaved_sessions_over_three_partitions_close_on_inactivity_in_timestamp_order(broker):
    bs = broker.bootstrap_servers
    source, results, dlq = new_topic(bs, "turns"), unique("sessions"), unique("sessions-dlq")
    rng = random.Random(3)
    # Twelve sessions of 1-4 turns over three partitions; a session's turns 0.1 s apart.
    plan = {f"conv-{n}": rng.randint(1, 4) for n in range(12)}
    failing = {("conv-1", 1), ("conv-2", 2), ("conv-2", 3)}
    # Every turn within 0.5 s: no session is closed by stream time before all its turns are read.
    turns = {sid: [turn(sid, i, NOW - 60 + 0.01 * n + 0.1 * i, failed=(sid, i) in failing, tools=i)
                   for i in range(count)] for n, (sid, count) in enumerate(plan.items())}
    order = [(sid, i) for sid, count in plan.items() for i in range(count)]
    rng.shuffle(order)  # interleaved, and a session's turns not in timestamp order on the topic
    placed = produce_turns(bs, source, [turns[sid][i] for sid, i in order])
    assert len({p for p, _ in placed}) == PARTITIONS
    newer = json.loads(turns["conv-0"][0].to_json())
    newer["schema_version"] = SCHEMA_VERSION + 1
    session_line = SessionResult("conv-x", None, None, "complete", "inactivity", [], None, None).to_json()
    no_session = turn(None, 0, NOW)
    bad = [b"not json {", b'{"hello": 1}', b"[1, 2]", json.dumps(newer).encode(), None]
    others = produce_to(bs, source, [(0, b"k", v) for v in bad] + [(1, b"k", session_line),
                                                                  (2, b"k", no_session.to_json())])
    s = stage_settings(bs, source, results, **{"sessions.dead_letter_topic": dlq})
    with running(s) as runner:
        port = runner.http_port
        assert runner.group_id == "tracejudge-sessions"
        with_all_turns(bs, results, plan)
        ends: dict[int, int] = defaultdict(int)
        for p, o in placed + others:
            ends[p] = max(ends[p], o + 1)
        wait_until(lambda: committed_to(bs, runner.group_id, source, dict(ends)), 30,
                   message="every turn committed once its session is out")
        wait_until(lambda: metric(port, "tracejudge_sessions_open") == 0
                   and metric(port, "tracejudge_session_turns_held") == 0, 60)
        letters = read_topic(bs, dlq, at_least=len(bad))
        assert metric(port, "tracejudge_sessions_total", app="helpdesk", status="complete") == len(plan)
        assert metric(port, "tracejudge_session_results_published_total") == len(plan)
        assert metric(port, "tracejudge_session_turns_received_total") == len(order)
        assert metric(port, "tracejudge_session_turns_count", app="helpdesk") == len(plan)
        assert metric(port, "tracejudge_session_turns_sum", app="helpdesk") == len(order)
        assert metric(port, "tracejudge_session_duration_seconds_count", app="helpdesk") == len(plan)
        assert metric(port, "tracejudge_session_turns_ignored_total", reason="no_session") == 1
        assert metric(port, "tracejudge_session_turns_ignored_total", reason="session_result") == 1
        assert metric(port, "tracejudge_session_dead_letters_total", reason="invalid_json") == 1
        assert metric(port, "tracejudge_session_dead_letters_total", reason="not_a_result") == 3
        assert metric(port, "tracejudge_session_dead_letters_total", reason="unknown_schema_version") == 1
        assert metric(port, "tracejudge_sessions_closed_early_total") == 0
        assert metric(port, "tracejudge_assigned_partitions") == PARTITIONS
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        promtool_lint(scrape(port).content)

    records = session_results(bs, results, at_least=len(plan))
    assert len(records) == len(plan)  # one result per session, none twice
    for message, result in records:
        sid = result.session_id
        expected = turns[sid]
        assert message.key == sid.encode() == session_key(sid)[0].encode()
        assert (result.status, result.close_reason, result.evaluation) == ("complete", "inactivity", 1)
        assert result.user_id == "user-1" and result.app == "helpdesk"
        # In timestamp order, whatever the order on the topic; each turn names its offset.
        assert [t.request_id for t in result.turns] == [r.record.request_id for r in expected]
        assert all(t.partition == result.source.partition and t.offset is not None for t in result.turns)
        assert result.source.topic == source
        assert result.started_at == expected[0].record.timestamp
        assert result.ended_at == pytest.approx(expected[-1].record.timestamp + 0.5)
        m = result.metrics
        n = len(expected)
        fails = [i for i in range(n) if (sid, i) in failing]
        assert m["turns"] == n and m["failed_turns"] == len(fails)
        assert m["input_tokens"] == sum(10 + i for i in range(n))
        assert m["output_tokens"] == sum(20 + i for i in range(n))
        assert m["tool_calls"] == sum(range(n))
        assert m["turns_until_first_failure"] == (fails[0] + 1 if fails else None)
        assert m["last_turn_failed"] == (1.0 if (sid, n - 1) in failing else 0.0)
        assert m["duration_seconds"] == pytest.approx(0.1 * (n - 1) + 0.5)
        assert result.assessments == []  # no judges: section
    by_offset = {int(dict(r.headers)[headers.HEADER_OFFSET]): dict(r.headers) for r in letters}
    letters_by_offset = {int(dict(r.headers)[headers.HEADER_OFFSET]): r for r in letters}
    for (p, o), value in zip(others, bad, strict=False):
        assert by_offset[o][headers.HEADER_TOPIC] == source.encode() and p == 0
        assert letters_by_offset[o].value == value
    assert b"newer than this tracejudge reads" in by_offset[others[3][1]][headers.HEADER_ERROR]


def test_a_published_sessions_turns_are_committed_an_open_ones_are_not_until_a_restart_closes_it(broker):
    bs = broker.bootstrap_servers
    source, results = new_topic(bs, "turns"), unique("sessions")
    group = unique("sessions-group")
    # Partition 0: a session closed at max_turns (offsets 0, 1), then an open one (2).
    # Partition 1: the open session's turn first (0), then a closed session (1, 2).
    done_a = [turn("done-a", i, NOW + i * 0.1) for i in range(2)]
    done_b = [turn("done-b", i, NOW + i * 0.1) for i in range(2)]
    open_a, open_b = turn("open-a", 0, NOW), turn("open-b", 0, NOW)
    produce_turns(bs, source, [*done_a, open_a], partition=0)
    produce_turns(bs, source, [open_b, *done_b], partition=1)
    s = stage_settings(bs, source, results, **{"sessions.group_id": group, "sessions.inactivity_s": 600,
                                                "sessions.max_turns": 2})
    with running(s) as runner:
        port = runner.http_port
        got = with_all_turns(bs, results, {"done-a": 2, "done-b": 2})
        assert {r.close_reason for v in got.values() for r in v} == {"max_turns"}
        assert {r.status for v in got.values() for r in v} == {"incomplete"}
        wait_until(lambda: committed_to(bs, group, source, {0: 2}), 30,
                   message="partition 0 committed up to the open session's turn")
        wait_until(lambda: metric(port, "tracejudge_sessions_open") == 2
                   and metric(port, "tracejudge_session_turns_held") == 2, 60)
        assert metric(port, "tracejudge_sessions_closed_early_total", reason="max_turns") == 2
        # The open session's turn comes first on partition 1: nothing there is committed.
        assert committed_offsets(bs, group, source)[1] is None
        assert metric(port, "tracejudge_in_flight_records") == 2
    # Stopped: the open sessions were dropped uncommitted.
    assert committed_offsets(bs, group, source)[0] == 2
    assert committed_offsets(bs, group, source)[1] is None
    assert metric_value(runner, "tracejudge_sessions_dropped_total") == 2

    # The next run rebuilds them from their uncommitted turns and closes them.
    quick = stage_settings(bs, source, results, **{"sessions.group_id": group, "sessions.max_turns": 2})
    with running(quick):
        got = with_all_turns(bs, results, {"open-a": 1, "open-b": 1})
        wait_until(lambda: committed_to(bs, group, source, {0: 3, 1: 3}), 30)
    assert [r.close_reason for r in got["open-a"]] == ["inactivity"]


def metric_value(runner: SessionRunner, name: str, **labels: str) -> float:
    value = runner.registry.get_sample_value(name, labels)
    return value or 0.0


def test_max_turns_and_max_duration_close_a_session_early_as_incomplete(broker):
    bs = broker.bootstrap_servers
    source, results = new_topic(bs, "turns"), unique("sessions")
    chatty = [turn("chatty", i, NOW + i * 0.1) for i in range(6)]  # max_turns 4: 4 + a new session of 2
    long = [turn("long", i, NOW + i * 1.5) for i in range(3)]  # spans 3 s > max_duration_s 2.5
    produce_turns(bs, source, chatty + long, partition=0)
    s = stage_settings(bs, source, results, **{"sessions.inactivity_s": 2.0, "sessions.max_turns": 4,
                                                "sessions.max_duration_s": 2.5})
    with running(s) as runner:
        with_all_turns(bs, results, {"chatty": 4, "long": 3})
        got = with_all_turns(bs, results, {"chatty": 2})
        port = runner.http_port
        assert metric(port, "tracejudge_sessions_closed_early_total", reason="max_turns") == 1
        assert metric(port, "tracejudge_sessions_closed_early_total", reason="max_duration") == 1
        assert metric(port, "tracejudge_sessions_total", status="incomplete") == 2
        assert metric(port, "tracejudge_sessions_total", status="complete") == 1
    first, rest = sorted(got["chatty"], key=lambda r: r.turns[0].timestamp or 0)
    assert (first.status, first.close_reason, len(first.turns)) == ("incomplete", "max_turns", 4)
    # Not reopened (that would undo the cap): the later turns are a session of their own.
    assert (rest.status, rest.close_reason, rest.evaluation) == ("complete", "inactivity", 1)
    assert [t.request_id for t in rest.turns] == ["chatty-4", "chatty-5"]
    (result,) = got["long"]
    assert (result.status, result.close_reason, len(result.turns)) == ("incomplete", "max_duration", 3)


@pytest.mark.parametrize(("cap", "value", "evicted"), [
    ("max_open_sessions", 2, ["s0", "s1", "s2"]),
    ("max_turns_held", 5, ["s0", "s1", "s2"]),
    # A turn here: the fixed overhead plus 24 characters of text.
    ("max_bytes_held", 5 * (TURN_OVERHEAD_BYTES + 40), ["s0", "s1", "s2"]),
])
def test_past_a_memory_cap_the_least_recently_active_sessions_are_evicted_and_counted(broker, cap, value,
                                                                                      evicted):
    bs = broker.bootstrap_servers
    source, results, group = new_topic(bs, "turns"), unique("sessions"), unique("sessions-group")
    # Five sessions of two turns, one after the other on one partition; none goes quiet in the test.
    lines = [turn(f"s{n}", i, NOW + n + 0.1 * i) for n in range(5) for i in range(2)]
    produce_turns(bs, source, lines, partition=0)
    s = stage_settings(bs, source, results, **{"sessions.inactivity_s": 600, f"sessions.{cap}": value,
                                                "sessions.group_id": group})
    with running(s) as runner:
        port = runner.http_port
        got = with_all_turns(bs, results, {sid: 2 for sid in evicted})
        wait_until(lambda: metric(port, "tracejudge_session_turns_received_total") == len(lines), 60)
        assert metric(port, "tracejudge_sessions_closed_early_total", reason=cap) == len(evicted)
        assert metric(port, "tracejudge_sessions_open") == 5 - len(evicted)
        assert metric(port, "tracejudge_session_turns_held") == 2 * (5 - len(evicted))
        held = metric(port, "tracejudge_session_bytes_held")
        assert 0 < held <= (value if cap == "max_bytes_held" else 1e9)
        # Nothing past the first open session's turns is committed.
        wait_until(lambda: committed_to(bs, group, source, {0: 2 * len(evicted)}), 30)
    assert sorted(got) == evicted
    for sid in evicted:
        (result,) = got[sid]
        assert (result.status, result.close_reason) == ("incomplete", "evicted")


def test_a_late_turn_reopens_a_closed_session_and_turns_without_a_sane_time_are_placed_by_arrival(broker):
    bs = broker.bootstrap_servers
    source, results = new_topic(bs, "turns"), unique("sessions")
    first = [turn("resumed", 0, NOW - 30), turn("resumed", 1, NOW - 29.8)]
    produce_turns(bs, source, first)
    s = stage_settings(bs, source, results, judges={})
    with running(s) as runner:
        port = runner.http_port
        (one,) = with_all_turns(bs, results, {"resumed": 2})["resumed"]
        assert one.evaluation == 1
        assert one.assessment("user_frustration").value == "none"  # the heuristic session judge
        # Later: a turn of the closed session, then turns whose timestamps are missing or absurd.
        produce_turns(bs, source, [turn("resumed", 2, NOW - 29.6)])
        again = max(with_all_turns(bs, results, {"resumed": 3})["resumed"], key=lambda r: r.evaluation)
        assert again.evaluation == 2 and [t.request_id for t in again.turns] == [
            "resumed-0", "resumed-1", "resumed-2"]
        assert metric(port, "tracejudge_sessions_reopened_total") == 1
        # The same result line again (published twice upstream): ignored, the session not reopened.
        produce_turns(bs, source, [turn("resumed", 1, NOW - 29.8)])
        wait_until(lambda: metric(port, "tracejudge_session_turns_ignored_total", reason="duplicate") == 1,
                   30, message="the duplicate ignored")
        assert metric(port, "tracejudge_sessions_reopened_total") == 1
        odd = [turn("odd", 0, NOW - 5), turn("odd", 1, None), turn("odd", 2, 100.0),
               turn("odd", 3, NOW + 10 * 86_400)]
        produce_turns(bs, source, odd)
        (placed,) = with_all_turns(bs, results, {"odd": 4})["odd"]
        assert metric(port, "tracejudge_session_turns_placed_by_arrival_total", reason="missing") == 1
        assert metric(port, "tracejudge_session_turns_placed_by_arrival_total", reason="absurd") == 2
    assert [t.placed_by_arrival for t in placed.turns] == [False, True, True, True]
    # Placed at their arrival, after the timestamped turn, in the order they were read.
    assert [t.request_id for t in placed.turns] == ["odd-0", "odd-1", "odd-2", "odd-3"]
    assert all(t.timestamp and t.timestamp >= NOW - 1 for t in placed.turns[1:])


def test_a_session_spanning_a_rebalance_is_evaluated_with_every_turn(broker):
    bs = broker.bootstrap_servers
    source, results, group = new_topic(bs, "turns"), unique("sessions"), unique("sessions-group")
    sids = [f"span-{n}" for n in range(9)]
    produce_turns(bs, source, [turn(sid, 0, NOW + 0.1 * n) for n, sid in enumerate(sids)])
    # Quiet for longer than the rebalance takes; the sessions are closed by stream time below.
    s = stage_settings(bs, source, results, **{"sessions.group_id": group, "sessions.inactivity_s": 30.0})
    with running(s) as one:
        wait_until(lambda: metric(one.http_port, "tracejudge_session_turns_held") == len(sids), 30,
                   message="the first turns held")
        with running(s) as two:
            wait_until(lambda: len(one.assignment) + len(two.assignment) == PARTITIONS
                       and one.assignment and two.assignment, 60, message="both stages share the partitions")
            produce_turns(bs, source, [turn(sid, 1, NOW + 0.1 * n + 0.5) for n, sid in enumerate(sids)])
            # A later turn on every partition moves its stream time past the sessions' inactivity.
            for p in range(PARTITIONS):
                produce_turns(bs, source, [turn(f"tick-{p}", 0, NOW + 100)], partition=p)
            got = with_all_turns(bs, results, {sid: 2 for sid in sids}, timeout=90)
    final = latest((None, r) for v in got.values() for r in v)
    for sid in sids:
        assert [t.request_id for t in final[sid].turns] == [f"{sid}-0", f"{sid}-1"]
        assert final[sid].close_reason == "inactivity"


# -- the process --------------------------------------------------------------------------------------


def write_config(path: Path, source: str, results: str, **sessions: Any) -> Path:
    path.write_text(yaml.safe_dump({
        "stream": {"commit_interval_ms": 100, "lag_interval_seconds": 0.5},
        "sessions": {"input_topic": source, "results_topic": results, **sessions},
    }))
    return path


def test_a_sigkilled_stage_restarts_and_every_session_is_published_with_all_its_turns(broker, tmp_path):
    bs = broker.bootstrap_servers
    source, results, group = new_topic(bs, "turns"), unique("sessions"), unique("sessions-group")
    # Sessions of two turns close at max_turns before the kill; sessions of one turn are open then.
    closed = [f"closed-{n}" for n in range(6)]
    pending = [f"open-{n}" for n in range(6)]
    lines = [turn(sid, i, NOW + n + 0.1 * i) for n, sid in enumerate(closed) for i in range(2)]
    lines += [turn(sid, 0, NOW + n) for n, sid in enumerate(pending)]
    produce_turns(bs, source, lines)
    config = write_config(tmp_path / "tj.yaml", source, results, max_turns=2, inactivity_s=600)
    first = RunnerProcess(bs, "--group-id", group, command=("sessions", "--config", str(config)))
    try:
        first.wait_ready()
        wait_until(lambda: first.metric("tracejudge_session_results_published_total") == len(closed)
                   and first.metric("tracejudge_session_turns_held") == len(pending), 60,
                   message=lambda: f"closed sessions out, open ones held; log:\n{first.log[-2000:]}")
        first.signal(signal.SIGKILL)
        first.finish()
    finally:
        first.kill()
    # The restarted stage closes on inactivity quickly; the open sessions' turns were never committed.
    restarted = RunnerProcess(bs, "--group-id", group, env={"TRACEJUDGE_SESSIONS__INACTIVITY_S": "1"},
                              command=("sessions", "--config", str(config)))
    try:
        restarted.wait_ready()
        got = with_all_turns(bs, results, {**{sid: 2 for sid in closed}, **{sid: 1 for sid in pending}})
        restarted.signal(signal.SIGTERM)
        assert restarted.finish() == 0, restarted.log[-3000:]
    finally:
        restarted.kill()
    assert all(any(r.close_reason == "inactivity" for r in got[sid]) for sid in pending)
    assert "stopped" in restarted.log


@pytest.mark.parametrize(("args", "env", "expected"), [
    ((), {}, "sessions.results_topic"),
    (("--results-topic", "same", "--input-topic", "same"), {}, "is the input topic"),
    (("--results-topic", "out"), {"TRACEJUDGE_SESSIONS__INACTIVITY_S": "0"},
     "sessions.inactivity_s (from TRACEJUDGE_SESSIONS__INACTIVITY_S)"),
])
def test_configuration_errors_exit_2_naming_the_key(args, env, expected):
    environ = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TRACEJUDGE_")}
    proc = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "sessions",
                           "--input-topic",
                           "results", *args], capture_output=True, text=True, timeout=60,
                          env={**environ, **env}, check=False)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
