"""The real `tracejudge run` process: SIGKILL mid-stream loses nothing; SIGTERM drains, commits, leaves."""

from __future__ import annotations

import pathlib
import signal
import threading

import orjson
import pytest
from support.kafka import (
    RunnerProcess,
    agent_traces,
    committed_offsets,
    ends,
    produce,
    read_topic,
    unique,
    wait_until,
)

from tracejudge.consumer.decode_workers import auto_workers, available_cpus


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc)."""
    return [int(c) for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def running(pid: int) -> bool:
    """Neither gone nor a zombie (exited, waiting for whoever adopted it to reap it)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_consumer_killed_mid_stream_and_restarted_loses_no_trace(broker):
    bs = broker.bootstrap_servers
    topic, results, group = unique("kill"), unique("results"), unique("group")
    traces = agent_traces(200, seed=31)
    payloads = [t.payload for t in traces]
    keys = [t.trace_id.encode() for t in traces]
    placed = produce(bs, topic, payloads[:100], keys=keys[:100])
    args = ("--topic", f"{topic}:mlflow", "--group-id", group, "--results-topic", results)
    first = RunnerProcess(bs, *args, env={"TRACEJUDGE_STREAM__COMMIT_INTERVAL_MS": "300"}).wait_ready()
    try:
        wait_until(lambda: first.metric("tracejudge_records_total") >= 100
                   and first.metric("tracejudge_commits_total") >= 1, 60, message="first half done")

        def second_half() -> None:
            for i in range(100, 200, 10):
                placed.extend(produce(bs, topic, payloads[i:i + 10], keys=keys[i:i + 10]))

        producer = threading.Thread(target=second_half)
        producer.start()
        wait_until(lambda: first.metric("tracejudge_records_total") > 100, 60, message="second half started")
        # The default (stream.decode_workers: auto) runs a decode worker beside the consumer here.
        assert first.metric("tracejudge_decode_workers") == auto_workers(available_cpus())
        workers = children(first.proc.pid)
        assert len(workers) == auto_workers(available_cpus())
        first.signal(signal.SIGKILL)
        killed_after = first.finish(timeout=30)
        producer.join(60)
        # An orphaned worker sees its pipe close and exits: nothing is left running.
        wait_until(lambda: not any(running(pid) for pid in workers), 30,
                   message="the killed consumer's workers exit")
    finally:
        first.kill()
    assert killed_after == -signal.SIGKILL
    restarted = RunnerProcess(bs, *args).wait_ready(timeout=90)
    try:
        # Committed to the end means every result was acked first. Read the results only then: the
        # topic holds duplicates of what was redone after the kill, so `at_least` alone could be
        # met before the last results are written.
        wait_until(lambda: all(committed_offsets(bs, group, topic).get(p) == end
                               for p, end in ends(placed).items()),
                   90, message="the restarted consumer commits to the end")
        out = read_topic(bs, results, at_least=len(traces), timeout=30)
        restarted.signal(signal.SIGTERM)
        assert restarted.finish(timeout=60) == 0, restarted.log[-3000:]
    finally:
        restarted.kill()
    keys_seen = {r.key.decode() for r in out}
    assert keys_seen == {t.trace_id.removeprefix("tr-") for t in traces}
    sources = {(orjson.loads(r.value)["source"]["partition"], orjson.loads(r.value)["source"]["offset"])
               for r in out}
    assert sources == set(placed)


# Decode workers are spawned processes that ignore SIGTERM: the consumer process drains them.
@pytest.mark.parametrize("workers", ["0", "1"], ids=["in-process", "decode-worker"])
def test_sigterm_drains_commits_and_leaves_so_a_restart_reprocesses_nothing(broker, workers):
    bs = broker.bootstrap_servers
    topic, results, group = unique("term"), unique("results"), unique("group")
    traces = agent_traces(40, seed=33)
    placed = produce(bs, topic, [t.payload for t in traces], keys=[t.trace_id.encode() for t in traces])
    args = ("--topic", f"{topic}:mlflow", "--group-id", group, "--results-topic", results)
    # No periodic commits: what is committed is committed by the shutdown.
    env = {"TRACEJUDGE_STREAM__COMMIT_INTERVAL_MS": "3600000", "TRACEJUDGE_STREAM__DECODE_WORKERS": workers}
    first = RunnerProcess(bs, *args, env=env).wait_ready()
    try:
        wait_until(lambda: first.metric("tracejudge_results_published_total") == len(traces), 60)
        assert first.metric("tracejudge_commits_total") == 0
        first.signal(signal.SIGTERM)
        assert first.finish(timeout=60) == 0, first.log[-3000:]
    finally:
        first.kill()
    log = first.log
    assert "SIGTERM received: stopping" in log and "partitions revoked" in log and log.rstrip().endswith(
        "tracejudge.run: stopped")
    assert ("decode workers ready: 1" in log) == (workers == "1")
    committed = committed_offsets(bs, group, topic)
    assert all(committed[p] == end for p, end in ends(placed).items()), committed

    restarted = RunnerProcess(bs, *args, env=env).wait_ready()
    try:
        # Positions known (lag reported) on every partition with data: nothing was fetched again.
        wait_until(lambda: all(restarted.series("tracejudge_consumer_lag_records", topic=topic,
                                                partition=str(p)) == [0.0] for p in ends(placed))
                   and restarted.metric("tracejudge_assigned_partitions") >= len(ends(placed)), 30,
                   message="the restarted consumer reports its lag")
        assert restarted.metric("tracejudge_records_total") == 0
        fresh = agent_traces(3, seed=34)
        produce(bs, topic, [t.payload for t in fresh])
        wait_until(lambda: restarted.metric("tracejudge_records_total") == 3, 30)
        restarted.signal(signal.SIGTERM)
        assert restarted.finish(timeout=60) == 0
    finally:
        restarted.kill()
    out = read_topic(bs, results, at_least=len(traces) + 3)
    assert len(out) == len(traces) + 3  # every trace once: nothing re-delivered by the restart
