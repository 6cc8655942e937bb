"""The decode worker pool on its own (no Kafka): a worker process answers exactly what the consumer
process would, says why a record failed, and a worker that cannot start is a startup error that names
the cause. The Kafka-level behaviour (at-least-once with workers, a worker killed mid-stream) is in
test_stream_kafka.py."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import threading

import pytest
from kafka.consumer.fetcher import ConsumerRecord
from kafka.structs import TopicPartition
from support.kafka import agent_traces, wait_until

from tracejudge.consumer.config import load_settings
from tracejudge.consumer.pipeline import Pipeline, build_pipeline
from tracejudge.consumer.runtime.offsets import OffsetTracker
from tracejudge.consumer.runtime.producing import DeadLetterSink, ResultSink
from tracejudge.consumer.stages.decoding import (
    _PIPE_BUFFER_BYTES,
    DECODE,
    Decoded,
    DecodePool,
    WorkerPoolDecoder,
    WorkerStartError,
    _batch,
    _batch_parts,
    _widen,
    _write_parts,
    auto_workers,
    available_cpus,
    decode_one,
)
from tracejudge.consumer.stages.processing import RecordProcessor
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter


class Collected:
    """on_decoded / on_lost for a pool, with a condition to wait on."""

    def __init__(self, expected: int) -> None:
        self.decoded: dict[int, Decoded] = {}
        self.lost: list[int] = []
        self.expected = expected
        self.all_in = threading.Event()

    def on_decoded(self, item: int, decoded: Decoded) -> None:
        self.decoded[item] = decoded
        if len(self.decoded) >= self.expected:
            self.all_in.set()

    def on_lost(self, items: list[int]) -> None:
        self.lost.extend(items)


def settings_with(**overrides):
    return load_settings(environ={}, overrides={"stream.topics": ["t"], **overrides})


def decode_in_pool(settings, values):
    got = Collected(len(values))
    pool = DecodePool(settings, 1, on_decoded=got.on_decoded, on_lost=got.on_lost).start(timeout=60)
    try:
        assert pool.alive
        # Two batches, as two polls would hand them over: answers come back for each item.
        half = len(values) // 2
        assert pool.submit(list(range(half)), values[:half])
        assert pool.submit(list(range(half, len(values))), values[half:])
        assert got.all_in.wait(60), f"{len(got.decoded)} of {len(values)} answered"
    finally:
        pool.close()
    assert not pool.alive and got.lost == []
    return got.decoded


def test_a_worker_answers_what_the_consumer_process_would():
    values = [(t.payload, None) for t in agent_traces(8, seed=3)]
    values += [(b"{not json", None), (b'{"request": 5}', "agent_eval"), (b"[1, 2]", "mlflow")]
    s = settings_with()
    decoded = decode_in_pool(s, values)
    pipeline = build_pipeline(s)
    for i, (value, fmt) in enumerate(values):
        here, there = decode_one(pipeline, value, fmt), decoded[i]
        assert (there.record, there.metrics, there.metric_errors, there.source_format) == \
               (here.record, here.metrics, here.metric_errors, here.source_format), f"record {i}"
        assert (there.failed_at, there.reason, there.message) == (here.failed_at, here.reason, here.message)
        assert not there.redo and there.seconds > 0
    assert all(decoded[i].record is not None and decoded[i].record.response for i in range(8))
    for i in range(8, 11):
        assert decoded[i].record is None and decoded[i].failed_at == DECODE and decoded[i].reason
        assert decoded[i].message


def test_a_result_that_cannot_cross_the_process_boundary_is_redone_by_the_consumer():
    # The NaN sends this record to Python's json module, which keeps the integer beyond 64 bits
    # that msgpack cannot carry back from the worker.
    big = (b'{"request_id": "big", "request": "hi", "response": "yo", "reference_trajectory": '
           b'[{"tool_name": "t", "tool_input": {"n": 1180591620717411303424, "x": NaN}}]}')
    values = [(big, None), (agent_traces(1, seed=4)[0].payload, None)]
    decoded = decode_in_pool(settings_with(), values)
    # Only the record that cannot be sent is handed back, whole, for the consumer process.
    assert decoded[0].redo and decoded[0].record is None and decoded[0].failed_at is None
    assert not decoded[1].redo and decoded[1].record is not None
    here = decode_one(build_pipeline(settings_with()), big, None)
    assert here.record.reference_trajectory[0].tool_input["n"] == 2**70


@pytest.fixture
def main_only_metrics(tmp_path, monkeypatch):
    (tmp_path / "main_only_metrics.py").write_text(textwrap.dedent("""
        import os

        if os.environ["CONSUMER_PID"] != str(os.getpid()):
            raise ImportError("this module needs the consumer process's environment")

        def words(record):
            return 1
    """))
    monkeypatch.setenv("CONSUMER_PID", str(os.getpid()))
    monkeypatch.syspath_prepend(str(tmp_path))  # workers are given the consumer process's sys.path
    yield
    sys.modules.pop("main_only_metrics", None)


def test_a_worker_that_cannot_build_its_pipeline_is_a_startup_error(main_only_metrics):
    s = settings_with(**{"metrics.custom": [{"name": "words", "function": "main_only_metrics:words"}]})
    build_pipeline(s)  # fine here, in the consumer process
    got = Collected(0)
    pool = DecodePool(s, 2, on_decoded=got.on_decoded, on_lost=got.on_lost)
    with pytest.raises(WorkerStartError) as exc:
        pool.start(timeout=60)
    message = str(exc.value)
    assert message.startswith("decode worker 0 could not build the pipeline")
    assert "metrics.custom[words].function" in message and "consumer process's environment" in message
    assert not pool.alive
    assert all(w.process is None or w.process.poll() is not None for w in pool._workers)


def test_the_pipe_to_a_worker_has_wide_socket_buffers():
    # Batches of ~20 KB records cross in a few large writes instead of dozens of ~200 KB ones.
    ours, theirs = socket.socketpair()
    with ours, theirs:
        before = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        _widen(ours)
        cap = min(int(pathlib.Path(f"/proc/sys/net/core/{name}").read_text())
                  for name in ("wmem_max", "rmem_max"))
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            # Linux reports twice what was set (its bookkeeping overhead), capped by the sysctl.
            assert ours.getsockopt(socket.SOL_SOCKET, option) >= min(_PIPE_BUFFER_BYTES, cap)
        assert ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > before or cap <= before


def test_batches_larger_than_the_socket_buffers_cross_whole():
    big = "context " * 40_000  # ~320 KB a record, ~10 MB a batch: many writes even with wide buffers
    values = [(f'{{"request": "q{i}", "response": "{big}"}}'.encode(), "agent_eval") for i in range(32)]
    decoded = decode_in_pool(settings_with(), values)
    assert [decoded[i].record.request for i in range(32)] == [f"q{i}" for i in range(32)]
    assert all(decoded[i].record.response == big for i in range(32))


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "decode-worker"])
def test_a_record_that_fails_past_decoding_is_dead_lettered_and_its_offset_released(workers):
    # A judge hook with a bug (what it returns is not a future) fails every record after it was
    # decoded and evaluated: each is dead-lettered, and the partition's offset moves on.
    exporter, tracker = PrometheusExporter(), OffsetTracker()
    dead_letters = DeadLetterSink(None, None, exporter)
    results = ResultSink(None, None, exporter, dead_letters)
    pool = WorkerPoolDecoder(settings_with(), 1).start(timeout=60) if workers else None
    processor = RecordProcessor(Pipeline(), tracker, exporter, results, dead_letters, {"t": "mlflow"},
                                max_record_bytes=1 << 20, judge=lambda record: None, decoder=pool)
    tp = TopicPartition("t", 0)
    try:
        for offset, trace in enumerate(agent_traces(5, seed=8)):
            processor.process(tp, ConsumerRecord("t", 0, -1, offset, 0, 0, b"k", trace.payload, [], None,
                                                 1, len(trace.payload), 0))
        processor.flush()
        wait_until(lambda: tracker.in_flight == 0, 60, message="every record released")
    finally:
        if pool is not None:
            pool.close()
    assert tracker.committable()[tp].offset == 5
    assert exporter.dead_letters.labels(reason="processing_error")._value.get() == 5


def cgroup_tree(tmp_path: pathlib.Path, proc: str, files: dict[str, str]) -> tuple[pathlib.Path, ...]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(proc)
    return root, tmp_path / "self-cgroup"


def test_available_cpus_is_the_affinity_lowered_to_a_whole_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    cases = [
        # cgroup v2 in a container's namespace: the quota on the mount itself.
        ("0::/\n", {"cpu.max": "max 100000\n"}, affinity),
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 1),  # 1.5 CPUs: not two whole ones
        ("0::/\n", {"cpu.max": "100000000 100000\n"}, affinity),  # 1000 CPUs: the affinity binds
        # v2 outside a namespace: the tightest of the process's cgroup and its ancestors.
        ("0::/kubepods/pod1/app\n", {"kubepods/pod1/cpu.max": "100000 100000\n",
                                     "kubepods/pod1/app/cpu.max": "max 100000\n"}, 1),
        # cgroup v1: cpu,cpuacct controller, unlimited (-1) and limited.
        ("4:cpu,cpuacct:/\n1:memory:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                                           "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, affinity),
        ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "50000\n",
                               "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 1),  # half a CPU: still 1
        ("2:cpuacct:/\n1:cpu:/job\n", {"cpu/job/cpu.cfs_quota_us": "100000\n",
                                        "cpu/job/cpu.cfs_period_us": "100000\n"}, 1),
        # Unreadable or garbled files: no quota known.
        ("0::/\n", {"cpu.max": "lots\n"}, affinity),
    ]
    for i, (proc, files, expected) in enumerate(cases):
        root, proc_file = cgroup_tree(tmp_path / str(i), proc, files)
        assert available_cpus(root, proc_file) == min(expected, affinity), (proc, files)
    assert available_cpus(tmp_path / "none", tmp_path / "none") == affinity


def test_auto_starts_one_worker_from_two_cpus_up():
    assert [auto_workers(n) for n in (1, 2, 3, 64)] == [0, 1, 1, 1]


def test_the_runner_sizes_its_workers_from_the_setting_the_topics_and_the_cpus(caplog):
    from tracejudge.consumer.stages.run import StreamRunner

    def size(topics, workers="auto", **kwargs):
        s = settings_with(**{"stream.topics": topics, "stream.decode_workers": workers})
        return StreamRunner(s, judges=False, **kwargs)._decode_workers

    assert size(["t"]) == auto_workers(available_cpus())
    assert size(["t:mlflow", "spans:otlp_proto"]) == auto_workers(available_cpus())
    assert size(["t"], 3) == 3 and size(["t"], 0) == 0
    # OTLP spans go through trace assembly, which stays in the consumer process.
    assert size(["spans:otlp_proto", "more:otlp_json"]) == 0
    caplog.clear()
    assert size(["spans:otlp_json"], 2) == 0
    assert "every topic is OTLP spans" in caplog.text
    # A pipeline given to the runner is not the workers' to build.
    assert size(["t"], pipeline=Pipeline()) == 0
    assert size(["t"], 2, pipeline=Pipeline()) == 0 and "given its own Pipeline" in caplog.text


def test_a_script_without_a_main_guard_can_start_workers(tmp_path):
    # A multiprocessing child would re-run this script's top level; a worker never imports it.
    script = tmp_path / "embed.py"
    script.write_text(textwrap.dedent("""
        import threading
        from tracejudge.consumer.config import load_settings
        from tracejudge.consumer.stages.decoding import DecodePool

        got, done = [], threading.Event()
        def decoded(item, result):
            got.append(result.record.request)
            done.set()
        settings = load_settings(environ={}, overrides={"stream.topics": ["t"]})
        pool = DecodePool(settings, 1, on_decoded=decoded, on_lost=print).start(timeout=60)
        pool.submit([0], [(b'{"request": "hi", "response": "yo"}', None)])
        assert done.wait(60)
        pool.close()
        print("answered:", got)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "answered: ['hi']"


def test_a_worker_that_dies_is_replaced_and_one_that_keeps_dying_is_not(caplog):
    values = [(t.payload, None) for t in agent_traces(4, seed=12)]
    got = Collected(len(values))
    deaths: list[int] = []
    pool = DecodePool(settings_with(), 1, on_decoded=got.on_decoded, on_lost=got.on_lost,
                      on_worker_lost=lambda: deaths.append(1), max_restarts=1).start(timeout=60)
    try:
        first = pool._workers[0].process
        first.kill()
        wait_until(lambda: pool.live() == 1 and pool._workers[0].process is not first, 60,
                   message="a new worker in place")
        assert len(deaths) == 1 and "starting a new one" in caplog.text
        wait_until(lambda: not any(t.name.endswith("-restart") for t in threading.enumerate()), 30,
                   message="the restart finished")
        # The new worker decodes like the first.
        assert pool.submit(list(range(len(values))), values)
        assert got.all_in.wait(60)
        assert all(got.decoded[i].record is not None for i in range(len(values)))

        second = pool._workers[0].process
        second.kill()
        wait_until(lambda: len(deaths) == 2, 30, message="the second death seen")
        # One restart allowed in the window, and it was used: the decision is made before the
        # death is reported, so no restart can be under way now.
        assert not any(t.name.endswith("-restart") for t in threading.enumerate())
        assert pool._workers[0].process is second and not pool.alive and pool.live() == 0
        assert not pool.submit([99], values[:1])
        # The dead worker takes nothing more (a batch queued now would be neither answered nor
        # handed back), and once its sender and receiver have both ended its socket is closed.
        dead = pool._workers[0]
        assert not dead.submit([100], _batch_parts(values[:1])) and not dead._pending
        wait_until(lambda: dead._conn.closed, 30, message="the dead worker's socket closed")
        assert "not restarted: 1 restarts in the last 10 min" in caplog.text
    finally:
        pool.close()


def test_the_gc_policy_freezes_start_up_objects_and_widens_the_first_generation():
    # In a process of its own: the policy is process-wide, and this test process is not ours to tune.
    code = textwrap.dedent("""
        import gc
        from tracejudge.consumer.runtime import gc_policy
        before = gc.get_freeze_count(), gc.get_threshold()
        gc_policy.apply()
        print(before, gc.get_freeze_count() > 0, gc.get_threshold())
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "(0, (700, 10, 10)) True (10000, 10, 10)"


def test_a_batch_crosses_whole_through_short_writes_and_many_parts():
    values = [(f"record {i} ".encode() * (i % 7), "agent_eval" if i % 2 else None) for i in range(2500)]
    parts = _batch_parts(values)
    assert len(parts) > 2 * 1024  # more than one writev's worth of buffers (IOV_MAX is 1024)
    written = bytearray()

    def short_writev(fd, buffers):  # at most 13 bytes a call, as an interrupted write may return
        chunk = b"".join(bytes(b) for b in buffers)[:13]
        written.extend(chunk)
        return len(chunk)

    _write_parts(-1, parts, short_writev)
    # What the worker's recv_bytes returns: the frame without multiprocessing's length prefix.
    assert int.from_bytes(written[:4], "big") == len(written) - 4
    assert _batch(bytes(written[4:])) == [(value, fmt) for value, fmt in values]
