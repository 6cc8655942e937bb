"""The real `tracejudge run` process: SIGKILL mid-stream loses nothing; SIGTERM drains, commits, leaves;
a broker that cannot be reached is one line of its own, not kafka-python's pages."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
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

from tracejudge.consumer.demo.broker import LocalBroker, free_port
from tracejudge.consumer.stages.decoding import auto_workers, available_cpus


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
    # Keyed by session (the agent's turns state one), else trace id; one result per trace.
    lines = [orjson.loads(r.value) for r in out]
    assert [r.key.decode() for r in out] == [x["session_id"] or x["trace_id"] for x in lines]
    assert {x["trace_id"] for x in lines} == {t.trace_id.removeprefix("tr-") for t in traces}
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


# -- a broker that cannot be reached ----------------------------------------------------------------

_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<logger>[\w.]+): "
                         r"(?P<message>.*)$")


def _records(log: str) -> list[dict[str, str]]:
    return [m.groupdict() for line in log.splitlines() if (m := _LOG_RECORD.match(line))]


def _run_unreachable(*run_args: str, log_level: str | None = None) -> tuple[int, str, str]:
    """`tracejudge run` against a loopback port where nothing listens; (status, address, stderr)."""
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}
    env.update({"TRACEJUDGE_KAFKA__BOOTSTRAP_TIMEOUT_MS": "2000", "TRACEJUDGE_STREAM__DECODE_WORKERS": "0"})
    level = ("--log-level", log_level) if log_level else ()
    cmd = [sys.executable, "-m", "tracejudge.consumer.commands.cli", *level, "run", "--bootstrap-servers",
           address,
           "--topic", "traces", "--metrics-port", "0", "--metrics-bind-address", "127.0.0.1", *run_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, env=env)
    return proc.returncode, address, proc.stderr


@pytest.mark.parametrize("publish", [(), ("--results-topic", "results")], ids=["consumer", "producer"])
def test_a_broker_that_cannot_be_reached_at_start_is_one_line_then_exit_4(publish):
    status, address, stderr = _run_unreachable(*publish)  # with a results topic the producer connects first
    assert status == 4, stderr  # SERVICE_FAILED
    records = _records(stderr)
    # kafka-python tried ~5 times in those 2 s, 3-4 lines each: none of them is shown.
    assert not [r for r in records if r["logger"].startswith("kafka")], stderr
    assert "Traceback" not in stderr
    [problem] = [r for r in records if r["level"] in ("WARNING", "ERROR")]
    assert (problem["level"], problem["logger"]) == ("ERROR", "tracejudge.run")
    assert problem["message"] == (
        f"cannot reach Kafka at {address} (kafka.bootstrap_servers): no broker answered within 2 s "
        "(kafka.bootstrap_timeout_ms); last error: KafkaConnectionError: 111 ECONNREFUSED; "
        "exiting with status 4")
    # Bounded: the start-up summary (its settings on indented lines), a few lines of progress, the error.
    assert len(records) <= 6, stderr
    assert all(_LOG_RECORD.match(line) or line.startswith("  ") for line in stderr.splitlines()), stderr


def test_with_log_level_debug_kafka_pythons_connection_detail_is_shown_as_debug():
    status, _, stderr = _run_unreachable(log_level="DEBUG")
    assert status == 4  # SERVICE_FAILED
    records = _records(stderr)
    refused = "Connection failed: KafkaConnectionError: 111 ECONNREFUSED"
    assert any(r["level"] == "DEBUG" and r["logger"] == "kafka.net.manager" and r["message"] == refused
               for r in records)
    assert not [r for r in records if r["logger"].startswith("kafka") and r["level"] in ("WARNING", "ERROR")]
    assert [r["logger"] for r in records if r["level"] == "ERROR"] == ["tracejudge.run"]


def test_a_broker_lost_mid_run_is_one_line_and_its_return_another():
    own = LocalBroker().start()  # stopped and restarted here: not the shared broker
    again: LocalBroker | None = None
    bs = own.bootstrap_servers
    topic = unique("lost")
    produce(bs, topic, [t.payload for t in agent_traces(5, seed=41)])
    runner = RunnerProcess(bs, "--topic", f"{topic}:mlflow", env={"TRACEJUDGE_STREAM__DECODE_WORKERS": "0"})
    try:
        runner.wait_ready()
        wait_until(lambda: runner.metric("tracejudge_records_total") == 5, 60)
        start = len(runner.log)
        own.stop()
        wait_until(lambda: "has not answered" in runner.log[start:], 60,
                   message=lambda: f"the lost broker reported; log:\n{runner.log[start:][-3000:]}")
        # By now (more than kafka.session_timeout_ms later) kafka-python has logged dozens of failures.
        down = _records(runner.log[start:])
        assert not [r for r in down if r["logger"].startswith("kafka")], runner.log[start:]
        [lost] = [r for r in down if r["level"] in ("WARNING", "ERROR")]
        assert lost["logger"] == "tracejudge.run"
        assert lost["message"].startswith(f"Kafka at {bs} (kafka.bootstrap_servers) has not answered for ")
        assert ("; last error: KafkaConnectionError: 111 ECONNREFUSED; retrying until it answers"
                in lost["message"])
        again = LocalBroker(port=own.port).start()  # back at the same address (its topics are gone)
        wait_until(lambda: f"tracejudge.run: Kafka at {bs} answers again" in runner.log[start:], 90,
                   message=lambda: f"the broker's return reported; log:\n{runner.log[start:][-3000:]}")
        runner.signal(signal.SIGTERM)
        assert runner.finish(timeout=60) == 0, runner.log[-3000:]
    finally:
        runner.kill()
        own.stop()
        if again is not None:
            again.stop()
    assert runner.log.count("has not answered") == 1
