"""Helpers for tests against the real (Tansu) broker and the real `tracejudge run`.

- `shared_broker()`: one `LocalBroker` per test process, stopped at exit; the `broker` fixture below
  is session-scoped and every module that imports it gets the same broker.
- `wait_until(predicate, timeout)`: the only way tests wait (no sleeps as synchronisation).
- producing, reading topics from the beginning, committed offsets, scraping `/metrics`.
- `RunnerProcess`: the real `tracejudge run` (the CLI module) as a subprocess (SIGTERM / SIGKILL tests).
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from tracejudge.consumer.config import Settings, load_settings
from tracejudge.consumer.demo.broker import LocalBroker, free_port
from tracejudge.consumer.stages.run import StreamRunner

T = TypeVar("T")

# Group timings that join in ~3 s on Tansu (kafka-python's defaults take ~25 s).
FAST_GROUP = {"kafka.session_timeout_ms": 6000, "kafka.heartbeat_interval_ms": 1000}
_names = itertools.count()
_broker: LocalBroker | None = None
_broker_lock = threading.Lock()


def shared_broker() -> LocalBroker:
    global _broker
    with _broker_lock:
        if _broker is None:
            _broker = LocalBroker().start()
            atexit.register(_broker.stop)
        return _broker


def unique(prefix: str) -> str:
    """A topic or group name no other test uses (the broker is shared)."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


class Timeout(AssertionError):
    pass


def wait_until(predicate: Callable[[], T], timeout: float, *, interval: float = 0.05,
               message: str | Callable[[], str] = "condition") -> T:
    """Call `predicate` until it returns something truthy (returned) or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise Timeout(f"not met within {timeout:g}s: {text}")
        pause.wait(interval)


# -- Kafka ----------------------------------------------------------------------------------------


def produce(bootstrap: str, topic: str, values: Iterable[bytes], *, keys: Iterable[bytes | None] | None = None
            ) -> list[tuple[int, int]]:
    """Produce and wait for every ack; returns (partition, offset) per value, in order."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_request_size=8 * 1024 * 1024)
    try:
        values = list(values)
        key_list = list(keys) if keys is not None else [None] * len(values)
        futures = [producer.send(topic, value=v, key=k) for v, k in zip(values, key_list, strict=True)]
        producer.flush(timeout=30)
        return [(md.partition, md.offset) for md in (f.get(timeout=30) for f in futures)]
    finally:
        producer.close(timeout=5)


def read_topic(bootstrap: str, topic: str, *, at_least: int, timeout: float = 30.0) -> list[Any]:
    """Every record of `topic` from the beginning (no group): waits for at least `at_least` of them,
    then reads on to the high watermarks, so extra (duplicate) records are seen too."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                             auto_offset_reset="earliest", group_id=None)
    records: list[Any] = []
    try:
        if at_least == 0 and not consumer.partitions_for_topic(topic):
            return []
        partitions = wait_until(lambda: consumer.partitions_for_topic(topic), timeout,
                                message=f"topic {topic} exists")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)

        def complete() -> bool:
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(batch)
            if len(records) < at_least:
                return False
            # Tansu answers ListOffsets(latest) with the last batch's base offset + 1, not the high
            # watermark, so `end_offsets()` is wrong there; fetch responses carry the real one.
            highs = [consumer.highwater(tp) for tp in tps]
            return all(h is not None and consumer.position(tp) >= h for tp, h in zip(tps, highs, strict=True))

        wait_until(complete, timeout, interval=0.0,
                   message=lambda: f"{at_least} records on {topic}, have {len(records)}")
        return records
    finally:
        consumer.close()


def ends(placed: Iterable[tuple[int, int]]) -> dict[int, int]:
    """The next offset to read per partition, from the (partition, offset) pairs `produce` returned."""
    out: dict[int, int] = {}
    for partition, offset in placed:
        out[partition] = max(out.get(partition, 0), offset + 1)
    return out


def partition_count(bootstrap: str, topic: str) -> int:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    try:
        return len(wait_until(lambda: consumer.partitions_for_topic(topic), 30, message=f"{topic} exists"))
    finally:
        consumer.close()


def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int | None]:
    """The group's committed offset per partition of `topic` (None: never committed)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        return {p: consumer.committed(TopicPartition(topic, p), timeout_ms=10_000)
                for p in sorted(partitions)}
    finally:
        consumer.close(autocommit=False)


def settings(bootstrap: str, topics: Sequence[str], **overrides: Any) -> Settings:
    """Runner settings for a test: fast group timings, a free metrics port, no environment."""
    values: dict[str, Any] = {"kafka.bootstrap_servers": bootstrap, "stream.topics": list(topics),
                              "http.port": 0, "http.bind_address": "127.0.0.1", **FAST_GROUP}
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_settings(environ={}, overrides=values)


@contextmanager
def running(settings: Settings, **kwargs: Any) -> Iterator[StreamRunner]:
    """A `StreamRunner` in a thread; stopped (and joined) on exit, failing the test if it crashed."""
    runner = StreamRunner(settings, **kwargs)
    runner.start()
    try:
        wait_until(lambda: runner.http_port is not None or runner.error is not None, 30,
                   message="the runner serves /metrics")
        if runner.error is not None:
            raise AssertionError(f"the runner failed to start: {runner.error!r}")
        yield runner
    finally:
        runner.stop()
        assert runner.join(60), "the runner did not stop within 60 s"
    if runner.error is not None:
        raise AssertionError(f"the runner crashed: {runner.error!r}") from runner.error


def assigned(*runners: StreamRunner, partitions: int) -> bool:
    """The runners hold disjoint assignments covering `partitions` partitions (a settled group)."""
    sets = [r.assignment for r in runners]
    union = frozenset().union(*sets)
    return len(union) == partitions == sum(len(s) for s in sets) and all(sets)


# -- Prometheus -----------------------------------------------------------------------------------


def scrape(port: int, accept: str | None = None) -> httpx.Response:
    headers = {"Accept": accept} if accept else {}
    return httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers, timeout=5)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text_or_samples: str | Mapping[Any, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
    table = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    want = set(labels.items())
    return sum(v for (n, ls), v in table.items() if n == name and want <= ls)


def metric(port: int, name: str, **labels: str) -> float:
    return value(scrape(port).text, name, **labels)


def series(port: int, name: str, **labels: str) -> list[float]:
    """The values of every exposed sample of `name` whose labels include `labels` (absent: [])."""
    want = set(labels.items())
    return [v for (n, ls), v in samples(scrape(port).text).items() if n == name and want <= ls]


# -- the real `tracejudge run` as a process ---------------------------------------------------------


class RunnerProcess:
    """`tracejudge run` with flags, as a process; its log goes to a file for the assertions.
    `command` is the subcommand and its leading arguments (`("sink", "mlflow", "--config", F)`)."""

    def __init__(self, bootstrap: str, *args: str, env: Mapping[str, str] | None = None,
                 command: Sequence[str] = ("run",)) -> None:
        self.port = free_port()
        self.command = command[0]
        self.log_path = Path(tempfile.mkstemp(prefix=f"tracejudge-{self.command}-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in finish()
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}
        environ.update({"TRACEJUDGE_KAFKA__SESSION_TIMEOUT_MS": "6000",
                        "TRACEJUDGE_KAFKA__HEARTBEAT_INTERVAL_MS": "1000",
                        "TRACEJUDGE_HTTP__BIND_ADDRESS": "127.0.0.1", **(env or {})})
        cmd = [sys.executable, "-m", "tracejudge.consumer.commands.cli", *command, "--bootstrap-servers",
               bootstrap,
               "--metrics-port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=environ)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"tracejudge {self.command} exited with {self.proc.returncode}:\n"
                                 f"{self.log[-4000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 60.0) -> RunnerProcess:
        wait_until(self.ready, timeout, interval=0.1,
                   message=lambda: f"{self.command} ready; log:\n{self.log[-3000:]}")
        return self

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.port, name, **labels)

    def series(self, name: str, **labels: str) -> list[float]:
        return series(self.port, name, **labels)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()


# -- real traces ------------------------------------------------------------------------------------


def agent_traces(count: int, seed: int = 11, **settings: Any) -> list[Any]:
    """`AgentTrace`s (trace_id, payload = `Trace.to_json()` bytes) from the demo's agent traced with the
    real MLflow tracing; deterministic for a seed."""
    from tracejudge.consumer.demo.agent import AgentSettings, SyntheticRagAgent

    with SyntheticRagAgent(AgentSettings(seed=seed, **settings)) as agent:
        return list(agent.traces(count))
