"""Results whose trace reaches MLflow after them: parked, not holding the partition (issue 26 item 3).

The real broker, a real `mlflow server` and the real MLflow sink on the sink runtime (in-process
`SinkRunner`, and the `tracejudge sink mlflow` command for the SIGKILL case). Traces are OpenTelemetry
spans sent to MLflow's OTLP endpoint when the test says so, so a result can be on the results topic
before its trace is in MLflow. What must hold: the verdicts of traces MLflow has are written at once,
including those on the same partition after the waiting one; the waiting one is written once its trace
arrives (parked, offered again on a growing back-off); nothing is committed past a parked record; a
trace that never arrives is given up on after the deadline and counted; a full parked set falls back to
holding the partition; a SIGKILLed sink with parked results, restarted, leaves every verdict exactly once.
Every wait is on a condition (`wait_until`), never a sleep.
"""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.kafka import FAST_GROUP, committed_offsets, ends, produce, scrape, unique, value, wait_until
from support.mlflow_server import MlflowServer, send_otlp, shared_mlflow_server
from support.otel_producers import Producer, genai_trace
from support.sinks import SinkProcess

from tracejudge.consumer.config import Settings, load_settings
from tracejudge.consumer.stages.sink import SinkRunner

JUDGE = {"endpoint": None, "model": None, "version": "9a8b7c6d5e4f"}
NAMES = ("groundedness", "relevance_to_query")


@pytest.fixture(scope="session")
def mlflow_server() -> MlflowServer:
    return shared_mlflow_server()


@pytest.fixture(autouse=True)
def _no_mlflow_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


class Traces:
    """GenAI traces made now and sent to MLflow's OTLP endpoint when `send` says (id: `tr-<hex>`)."""

    def __init__(self, n: int, label: str) -> None:
        producer = Producer(f"{label}-agent")
        recorded = [genai_trace(producer.tracer, f"What is the capital of France? ({label} {i})", "Paris.")
                    for i in range(n)]
        spans = producer.finished()
        self.ids = [f"tr-{r.trace_id}" for r in recorded]
        self._spans = {f"tr-{r.trace_id}": [s for s in spans if f"{s.context.trace_id:032x}" == r.trace_id]
                       for r in recorded}

    def send(self, url: str, experiment: str, *ids: str) -> None:
        send_otlp(url, experiment, [s for tid in (ids or self.ids) for s in self._spans[tid]])


def result_line(trace_id: str) -> bytes:
    """A result line as `tracejudge run` publishes it, two heuristic verdicts."""
    return orjson.dumps({
        "schema_version": 6, "request_id": trace_id[3:], "trace_id": trace_id[3:],
        "mlflow_trace_id": trace_id,
        "session_id": None, "user_id": None, "source_format": "otlp_proto",
        "source": {"format": "otlp_proto", "topic": "otlp_spans", "partition": 0, "offset": 1},
        "metrics": {}, "assessments": [
            {"name": name, "value": 0.75, "score": 0.75, "passed": True, "threshold": 0.5, "rationale": "ok",
             "source": "heuristic", "judge": JUDGE} for name in NAMES]})


def ours(server: MlflowServer, trace_id: str) -> Counter[str]:
    """This sink's verdicts on the trace by name (none when the trace is not on the server yet)."""
    info = server.trace_info(trace_id)
    return Counter(a["assessment_name"] for a in (info or {}).get("assessments") or ()
                   if "tracejudge.key" in (a.get("metadata") or {}))


def on_one_partition(bootstrap: str, topic: str, trace_ids: list[str]) -> list[tuple[int, int]]:
    """Produce the results of `trace_ids` in this order, one key: one partition, in offset order."""
    placed = produce(bootstrap, topic, [result_line(t) for t in trace_ids],
                     keys=[b"one-partition"] * len(trace_ids))
    assert len({p for p, _ in placed}) == 1
    return placed


def sink_settings(bootstrap: str, topic: str, group: str, url: str, experiment: str, **mlflow: Any
                  ) -> Settings:
    values: dict[str, Any] = {"kafka.bootstrap_servers": bootstrap, "sink.results_topic": topic,
                              "sink.group_id": group,
                              "sink.checkpoint_interval_ms": 100, "sink.write_sessions": False,
                              "stream.lag_interval_seconds": 0.5, "http.port": 0,
                              "http.bind_address": "127.0.0.1", "sink.mlflow.tracking_uri": url,
                              "sink.mlflow.experiment_id": experiment, **FAST_GROUP}
    values.update({k if k.startswith("sink.") else f"sink.mlflow.{k}": v for k, v in mlflow.items()})
    return load_settings(environ={}, overrides=values, require_topics=False)


@contextmanager
def running(settings: Settings, group: str) -> Iterator[tuple[SinkRunner, CollectorRegistry]]:
    registry = CollectorRegistry(auto_describe=True)
    assert settings.sink.group_id == group
    runner = SinkRunner(settings, "mlflow", registry=registry)
    runner.start()
    try:
        wait_until(lambda: runner.http_port is not None or runner.error is not None, 30,
                   message="the sink serves /metrics")
        assert runner.error is None, runner.error
        yield runner, registry
    finally:
        runner.stop()
        assert runner.join(60), "the sink did not stop within 60 s"
    assert runner.error is None, runner.error


def count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return value(generate_latest(registry).decode(), name, sink="mlflow", **labels)


def committed(bootstrap: str, group: str, topic: str, placed: list[tuple[int, int]]) -> int | None:
    return committed_offsets(bootstrap, group, topic).get(placed[0][0])


def test_a_late_trace_is_written_when_it_arrives_while_the_partition_flows(
    broker: Any, mlflow_server: MlflowServer
) -> None:
    bs, server = broker.bootstrap_servers, mlflow_server
    experiment = server.create_experiment(unique("parking"))
    topic, group = unique("results"), unique("sink-parking")
    known, late, later = Traces(4, "known"), Traces(1, "late"), Traces(3, "later")
    known.send(server.url, experiment)
    later.send(server.url, experiment)
    (late_id,) = late.ids
    # One partition: a known trace, the late one, then three more known traces.
    placed = on_one_partition(bs, topic, [known.ids[0], late_id, *known.ids[1:]])
    late_offset = placed[1][1]
    settings = sink_settings(bs, topic, group, server.url, experiment, unknown_trace_retry_s=300)
    with running(settings, group) as (runner, registry):
        # The known traces' verdicts are written, those after the late one included; the late one is
        # parked, and nothing is committed past it.
        wait_until(lambda: all(ours(server, t) == dict.fromkeys(NAMES, 1) for t in known.ids), 60,
                   message="the known traces' verdicts")
        wait_until(lambda: committed(bs, group, topic, placed) == late_offset, 30,
                   message=lambda: f"committed up to the parked one: {committed(bs, group, topic, placed)}")
        assert count(registry, "tracejudge_sink_parked_records") == 1
        assert count(registry, "tracejudge_sink_parked_total") == 1
        assert not ours(server, late_id)
        # The partition is not held: results produced now are written while the late one still waits.
        more = on_one_partition(bs, topic, later.ids)
        wait_until(lambda: all(ours(server, t) == dict.fromkeys(NAMES, 1) for t in later.ids), 60,
                   message="results produced after the parked one")
        assert not ours(server, late_id) and count(registry, "tracejudge_sink_parked_records") == 1
        assert committed(bs, group, topic, placed) == late_offset
        looks_before = count(registry, "tracejudge_sink_parked_retries_total")
        # The trace reaches MLflow: the parked record is written at its next look, then committed.
        late.send(server.url, experiment)
        wait_until(lambda: ours(server, late_id) == dict.fromkeys(NAMES, 1), 60,
                   message="the late verdicts")
        wait_until(lambda: committed(bs, group, topic, placed) == ends(more)[placed[0][0]], 30,
                   message="committed to the end")
        assert count(registry, "tracejudge_sink_parked_records") == 0
        assert count(registry, "tracejudge_sink_parked_retries_total") > looks_before >= 1
        assert count(registry, "tracejudge_sink_park_full_total") == 0
        assert count(registry, "tracejudge_sink_given_up_total", reason="unknown_trace") == 0
        assert count(registry, "tracejudge_sink_writes_total", outcome="written") == 2 * 8
        assert count(registry, "tracejudge_sink_retries_total", reason="unknown_trace") >= 2
        text = scrape(runner.http_port).content
    lint(text)


def lint(text: bytes) -> None:
    from support.deploy_files import tool

    proc = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=30,
                          check=False)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_a_trace_that_never_arrives_is_given_up_after_the_deadline_and_counted(
    broker: Any, mlflow_server: MlflowServer
) -> None:
    bs, server = broker.bootstrap_servers, mlflow_server
    experiment = server.create_experiment(unique("parking-ghost"))
    topic, group = unique("results"), unique("sink-ghost")
    known = Traces(2, "known")
    known.send(server.url, experiment)
    ghost = "tr-" + "7" * 32
    placed = on_one_partition(bs, topic, [ghost, *known.ids])
    settings = sink_settings(bs, topic, group, server.url, experiment, unknown_trace_retry_s=3,
                             unknown_trace_attempts=3, unknown_trace_backoff_s=0.2)
    with running(settings, group) as (_, registry):
        wait_until(lambda: all(ours(server, t) == dict.fromkeys(NAMES, 1) for t in known.ids), 60,
                   message="the known traces' verdicts")
        wait_until(lambda: count(registry, "tracejudge_sink_given_up_total", reason="unknown_trace") == 1,
                   60, message="the ghost given up")
        wait_until(lambda: committed(bs, group, topic, placed) == ends(placed)[placed[0][0]], 30,
                   message="committed past the given-up record")
        assert count(registry, "tracejudge_sink_skipped_total", reason="unknown_trace") == 2  # its 2 verdicts
        assert count(registry, "tracejudge_sink_parked_records") == 0
        # Looked for at least `unknown_trace_attempts` times: parked once, offered again at least twice.
        assert count(registry, "tracejudge_sink_parked_retries_total") >= 2


def test_a_full_parked_set_holds_the_partition_instead(broker: Any, mlflow_server: MlflowServer) -> None:
    bs, server = broker.bootstrap_servers, mlflow_server
    experiment = server.create_experiment(unique("parking-full"))
    topic, group = unique("results"), unique("sink-full")
    known, late = Traces(1, "known"), Traces(2, "late")
    known.send(server.url, experiment)
    placed = on_one_partition(bs, topic, [*late.ids, *known.ids])
    settings = sink_settings(bs, topic, group, server.url, experiment, **{"sink.max_parked_records": 1})
    with running(settings, group) as (_, registry):
        wait_until(lambda: ours(server, known.ids[0]) == dict.fromkeys(NAMES, 1), 60,
                   message="known verdicts")
        wait_until(lambda: count(registry, "tracejudge_sink_park_full_total") >= 1, 30, message="park full")
        assert count(registry, "tracejudge_sink_parked_records") == 1  # the limit, never more
        assert committed(bs, group, topic, placed) in (None, placed[0][1])
        late.send(server.url, experiment)
        wait_until(lambda: all(ours(server, t) == dict.fromkeys(NAMES, 1) for t in late.ids), 60,
                   message="both late traces' verdicts")
        wait_until(lambda: committed(bs, group, topic, placed) == ends(placed)[placed[0][0]], 30,
                   message="committed to the end")
        assert count(registry, "tracejudge_sink_parked_records") == 0


def test_sigkill_with_parked_results_then_restart_writes_every_verdict_exactly_once(
    broker: Any, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    bs, server = broker.bootstrap_servers, mlflow_server
    experiment = server.create_experiment(unique("parking-kill"))
    topic, group = unique("results"), unique("sink-kill")
    known, late = Traces(12, "known"), Traces(3, "late")
    known.send(server.url, experiment)
    order = [known.ids[0], late.ids[0], *known.ids[1:5], late.ids[1], *known.ids[5:9], late.ids[2],
             *known.ids[9:]]
    placed = on_one_partition(bs, topic, order)
    first_parked = placed[1][1]
    config = {"stream": {"lag_interval_seconds": 0.5},
              "sink": {"results_topic": topic, "max_batch_records": 4, "checkpoint_interval_ms": 100,
                       "write_sessions": False,
                       "mlflow": {"tracking_uri": server.url, "experiment_id": experiment}}}

    first = SinkProcess(bs, "mlflow", config, "--group-id", group).wait_ready()
    try:
        wait_until(lambda: first.metric("tracejudge_sink_parked_records", sink="mlflow") == 3
                   and all(ours(server, t) == dict.fromkeys(NAMES, 1) for t in known.ids), 60,
                   message=lambda: f"three parked, the rest written; log:\n{first.log[-2000:]}")
        wait_until(lambda: committed(bs, group, topic, placed) == first_parked, 30,
                   message="committed up to the first parked record, no further")
    finally:
        first.kill()  # SIGKILL: the parked records are lost with the process, their offsets uncommitted
    assert committed(bs, group, topic, placed) == first_parked

    late.send(server.url, experiment)
    second = SinkProcess(bs, "mlflow", config, "--group-id", group).wait_ready()
    try:
        wait_until(lambda: committed(bs, group, topic, placed) == ends(placed)[placed[0][0]], 90,
                   message=lambda: f"committed to the end; log:\n{second.log[-2000:]}")
        again = second.metric("tracejudge_sink_writes_total", sink="mlflow", outcome="already_written")
        written = second.metric("tracejudge_sink_writes_total", sink="mlflow", outcome="written")
        second.signal(signal.SIGTERM)
        assert second.finish() == 0
    finally:
        second.kill()
    # Redelivered from the first parked record on: the known traces' verdicts found, the late ones written.
    assert (written, again) == (2 * 3, 2 * 11)
    for t in [*known.ids, *late.ids]:
        assert ours(server, t) == dict.fromkeys(NAMES, 1), t


def test_the_back_off_and_parking_keys_are_validated_and_named() -> None:
    from tracejudge.consumer.config import ConfigError
    from tracejudge.consumer.sinks.mlflow import MlflowSinkSettings

    defaults = MlflowSinkSettings.from_mapping({"tracking_uri": "http://127.0.0.1:5000"}, env={})
    assert (defaults.unknown_trace_backoff_s, defaults.unknown_trace_max_backoff_s) == (0.5, 5.0)
    with pytest.raises(ConfigError) as bad:
        MlflowSinkSettings.from_mapping({"tracking_uri": "http://127.0.0.1:5000",
                                         "unknown_trace_backoff_s": 0, "unknown_trace_max_backoff_s": "soon"},
                                        "sink.mlflow", env={})
    assert {key for key, _ in bad.value.problems} == {"sink.mlflow.unknown_trace_backoff_s",
                                                      "sink.mlflow.unknown_trace_max_backoff_s"}
    assert load_settings(environ={}, overrides={}, require_topics=False).sink.max_parked_records == 10_000
    with pytest.raises(ConfigError) as negative:
        load_settings(environ={}, overrides={"sink.max_parked_records": -1}, require_topics=False)
    assert "sink.max_parked_records" in str(negative.value)
