"""`tracejudge sink` on the consumer runtime, against the real broker, with a test sink.

The sink here (`support.sinks.RecordingSink`) implements `consumer/sinks/base.py`'s `Sink` with
idempotent writes; the MLflow and OpenTelemetry sinks have their own tests. Results are real result
lines (`EvaluationResult.to_json()`); the `tracejudge sink` process is the real command, the test sink
registered as a plugin (`sink.plugins`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry
from support.kafka import (
    FAST_GROUP,
    committed_offsets,
    ends,
    metric,
    produce,
    read_topic,
    scrape,
    unique,
    wait_until,
)
from support.sinks import TESTS, RecordingSink, SinkProcess, attempted, verdict_files

from tracejudge.consumer.config import Settings, load_settings
from tracejudge.consumer.demo.broker import free_port
from tracejudge.consumer.runtime import producing as topics
from tracejudge.consumer.stages.sink import SinkRunner, sink_settings_type
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef
from tracejudge.schemas.results_line import (
    INVALID_JSON,
    KNOWN_SCHEMA_VERSION,
    NOT_A_RESULT,
    UNKNOWN_SCHEMA_VERSION,
    BadResult,
    decode_result,
)

JUDGES = ("groundedness", "relevance_to_query")


def result_lines(n: int, *, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """(key, value) of `n` result lines as `tracejudge run` publishes them, two verdicts each."""
    out = []
    for i in range(n):
        trace_id = hashlib.md5(f"{seed}-{i}".encode()).hexdigest()
        result = EvaluationResult(
            record=EvalRecord(request_id=f"req-{seed}-{i}", trace_id=trace_id, app="support-bot",
                              source_format="otlp_proto", request=f"question {i}", response="answer"),
            source=SourceRef(format="otlp_proto", topic="traces", partition=0, offset=i),
            assessments=[Assessment(name=j, value="yes" if i % 3 else "no", score=1.0 if i % 3 else 0.0,
                                    passed=bool(i % 3), rationale="because", source="heuristic")
                         for j in JUDGES])
        out.append((trace_id.encode(), result.to_json()))
    return out


def sink_settings(bootstrap: str, results_topic: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"kafka.bootstrap_servers": bootstrap, "sink.results_topic": results_topic,
                              "sink.checkpoint_interval_ms": 100, "http.port": 0,
                              "http.bind_address": "127.0.0.1", **FAST_GROUP}
    values.update(overrides)
    return load_settings(environ={}, overrides=values, require_topics=False)


@contextmanager
def running_sink(settings: Settings, kind: str, sink: RecordingSink, registry: CollectorRegistry | None = None
                 ) -> Iterator[SinkRunner]:
    """A `SinkRunner` in a thread; stopped (and joined) on exit, failing the test if it crashed."""
    registry = registry or CollectorRegistry(auto_describe=True)
    runner = SinkRunner(settings, kind, sink, registry=registry)
    runner.start()
    try:
        wait_until(lambda: runner.http_port is not None or runner.error is not None, 30,
                   message="the sink serves /metrics")
        if runner.error is not None:
            raise AssertionError(f"the sink failed to start: {runner.error!r}")
        yield runner
    finally:
        runner.stop()
        assert runner.join(60), "the sink did not stop within 60 s"
    if runner.error is not None:
        raise AssertionError(f"the sink crashed: {runner.error!r}") from runner.error


def committed_to_the_end(bootstrap: str, group: str, topic: str, placed: list[tuple[int, int]]) -> bool:
    committed = committed_offsets(bootstrap, group, topic)
    return all(committed.get(p) == end for p, end in ends(placed).items())


def by_partition(placed: list[tuple[int, int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for p, o in placed:
        out.setdefault(p, []).append(o)
    return out


def promtool_lint(text: bytes) -> None:
    from support.deploy_files import tool

    proc = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=30,
                          check=False)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


# -- in-process ----------------------------------------------------------------------------------------


def test_every_result_is_written_once_in_offset_order_and_committed(broker):
    bs = broker.bootstrap_servers
    topic, kind = unique("results"), unique("rec")
    lines = result_lines(60)
    placed = produce(bs, topic, [v for _, v in lines], keys=[k for k, _ in lines])
    assert len(by_partition(placed)) > 1
    sink = RecordingSink()
    s = sink_settings(bs, topic, **{"sink.max_batch_records": 7, "stream.lag_interval_seconds": 0.2})
    with running_sink(s, kind, sink) as runner:
        assert runner.group_id == f"tracejudge-sink-{kind}"
        port = runner.http_port
        wait_until(lambda: len(sink.offsets()) == len(placed), 60, message="every result written")
        wait_until(lambda: committed_to_the_end(bs, runner.group_id, topic, placed), 30,
                   message="committed to the end")
        wait_until(lambda: metric(port, "tracejudge_sink_lag_records", sink=kind) == 0
                   and metric(port, "tracejudge_assigned_partitions") == len(by_partition(placed)), 30)
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        text = scrape(port).content
        assert metric(port, "tracejudge_sink_writes_total", sink=kind, outcome="written") == 2 * len(placed)
        assert metric(port, "tracejudge_sink_batches_total", sink=kind) == len(sink.written)
        assert metric(port, "tracejudge_commits_total") >= 1
        assert metric(port, "tracejudge_sink_dead_letters_total") == 0
    assert sorted(sink.offsets()) == sorted(placed)  # every result, none twice
    for batch in sink.written:  # one partition per batch, at most max_batch_records, in offset order
        offsets = [r.offset for r in batch.records]
        assert {r.partition for r in batch.records} == {batch.partition}
        assert len(offsets) <= 7 and offsets == sorted(offsets)
    for partition, offsets in by_partition(placed).items():
        assert [o for p, o in sink.offsets() if p == partition] == offsets
    first = sink.written[0].records[0]
    assert first.result["assessments"][0]["name"] in JUDGES and first.trace_id == first.key.decode()
    assert (sink.setup_calls, sink.close_calls) == (1, 1)
    promtool_lint(text)


def test_a_record_that_is_not_a_result_is_dead_lettered_and_the_rest_flow(broker):
    bs = broker.bootstrap_servers
    topic, dlq, kind = unique("results"), unique("sink-dlq"), unique("rec")
    good = [v for _, v in result_lines(3, seed=1)]
    newer = orjson.loads(good[0])
    newer["schema_version"] = KNOWN_SCHEMA_VERSION + 1
    values = [good[0], b"not json {", b"[1, 2]", b'{"trace_id": "abc"}', orjson.dumps(newer), good[1],
              b'{"trace_id": 5, "request_id": null, "assessments": []}', None, good[2]]
    reasons = [None, INVALID_JSON, NOT_A_RESULT, NOT_A_RESULT, UNKNOWN_SCHEMA_VERSION, None, NOT_A_RESULT,
               NOT_A_RESULT, None]
    placed = produce(bs, topic, values, keys=[b"one-partition"] * len(values))
    sink = RecordingSink()
    s = sink_settings(bs, topic, **{"sink.dead_letter_topic": dlq})
    with running_sink(s, kind, sink) as runner:
        port = runner.http_port
        letters = read_topic(bs, dlq, at_least=6)
        wait_until(lambda: len(sink.offsets()) == 3, 30, message="the results around them written")
        wait_until(lambda: committed_to_the_end(bs, runner.group_id, topic, placed), 30)
        assert metric(port, "tracejudge_sink_dead_letters_total", sink=kind, reason=NOT_A_RESULT) == 4
        assert metric(port, "tracejudge_sink_dead_letters_total", sink=kind, reason=INVALID_JSON) == 1
        assert metric(port, "tracejudge_sink_dead_letters_total", sink=kind,
                      reason=UNKNOWN_SCHEMA_VERSION) == 1
    assert sink.offsets() == [placed[i] for i, r in enumerate(reasons) if r is None]
    assert len(letters) == 6
    got = {int(dict(r.headers)[topics.HEADER_OFFSET]): r for r in letters}
    for i, reason in enumerate(reasons):
        if reason is None:
            continue
        headers = dict(got[placed[i][1]].headers)
        assert headers[topics.HEADER_REASON] == reason.encode()
        assert headers[topics.HEADER_TOPIC] == topic.encode()
        assert got[placed[i][1]].value == values[i] or (values[i] is None and got[placed[i][1]].value == b"")
    assert b"newer than this tracejudge reads" in dict(got[placed[4][1]].headers)[topics.HEADER_ERROR]


def test_retry_later_holds_the_partition_uncommitted_then_writes_it(broker):
    bs = broker.bootstrap_servers
    topic, kind = unique("results"), unique("rec")
    lines = result_lines(90, seed=2)
    placed = produce(bs, topic, [v for _, v in lines], keys=[k for k, _ in lines])
    parts = by_partition(placed)
    held = max(parts, key=lambda p: len(parts[p]))
    held_key = next(k for (k, _), (p, _) in zip(lines, placed, strict=True) if p == held)
    others = [(p, o) for p, o in placed if p != held]
    sink = RecordingSink()
    sink.refuse[held] = "backend_down"
    # Small polls: the held partition is paused with records of a fetched batch still buffered, the
    # case kafka-python 3.0.12 can starve after resume() (the runtime works around it).
    s = sink_settings(bs, topic, **{"sink.max_batch_records": 5, "kafka.max_poll_records": 3,
                                    "sink.max_retry_backoff_s": 0.2, "stream.lag_interval_seconds": 0.2})
    with running_sink(s, kind, sink) as runner:
        port, group = runner.http_port, runner.group_id
        wait_until(lambda: sorted(sink.offsets()) == sorted(others), 60, message="the others written")
        wait_until(lambda: committed_to_the_end(bs, group, topic, others), 30)
        wait_until(lambda: sink.offers(held) >= 4, 30, message="the held batch offered again")
        assert committed_offsets(bs, group, topic)[held] is None  # nothing moved: nothing committed
        assert not [o for p, o in sink.offsets() if p == held]
        assert metric(port, "tracejudge_sink_retries_total", sink=kind, reason="backend_down") >= 3
        # Its lag counts every result of the partition not written, fetched or not, and keeps growing
        # while it is held (measured against the broker's end offset: a paused partition is not fetched).
        wait_until(lambda: metric(port, "tracejudge_sink_lag_records", sink=kind) == len(parts[held]), 30)
        more = produce(bs, topic, [result_lines(1, seed=3)[0][1]], keys=[held_key])
        assert more[0][0] == held
        wait_until(lambda: metric(port, "tracejudge_sink_lag_records", sink=kind) == len(parts[held]) + 1, 30)
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
        del sink.refuse[held]
        wait_until(lambda: sorted(sink.offsets()) == sorted(placed + more), 60, message="the held partition")
        wait_until(lambda: committed_to_the_end(bs, group, topic, placed + more), 30)
        wait_until(lambda: metric(port, "tracejudge_sink_lag_records", sink=kind) == 0, 30)
    # Written once each, in offset order, after the retries.
    assert [o for p, o in sink.offsets() if p == held] == parts[held] + [more[0][1]]


def test_a_write_that_fails_stops_the_sink_without_committing_past_it(broker):
    bs = broker.bootstrap_servers
    topic, kind = unique("results"), unique("rec")
    lines = result_lines(20, seed=4)
    placed = produce(bs, topic, [v for _, v in lines], keys=[b"one-partition"] * len(lines))
    partition = placed[0][0]
    sink = RecordingSink()
    sink.explode.add(partition)
    s = sink_settings(bs, topic)
    runner = SinkRunner(s, kind, sink, registry=CollectorRegistry())
    runner.start()
    assert runner.join(60), "the sink did not stop on its own"
    assert isinstance(runner.error, RuntimeError) and "a bug writing partition" in str(runner.error)
    assert committed_offsets(bs, runner.group_id, topic)[partition] is None
    assert sink.close_calls == 1 and sink.offsets() == []


def test_two_sinks_side_by_side_on_one_results_topic_each_see_everything(broker):
    bs = broker.bootstrap_servers
    topic, left_kind, right_kind = unique("results"), unique("left"), unique("right")
    lines = result_lines(40, seed=5)
    placed = produce(bs, topic, [v for _, v in lines], keys=[k for k, _ in lines])
    left, right = RecordingSink(), RecordingSink()
    s = sink_settings(bs, topic)
    with running_sink(s, left_kind, left) as a, running_sink(s, right_kind, right) as b:
        assert a.group_id != b.group_id
        wait_until(lambda: len(left.offsets()) == len(right.offsets()) == len(placed), 60)
        more = produce(bs, topic, [v for _, v in result_lines(5, seed=6)])
        wait_until(lambda: len(left.offsets()) == len(right.offsets()) == len(placed) + 5, 60)
        for runner in (a, b):
            wait_until(lambda r=runner: committed_to_the_end(bs, r.group_id, topic, placed + more), 30)
    assert sorted(left.offsets()) == sorted(right.offsets()) == sorted(placed + more)


# -- the `tracejudge sink` process ---------------------------------------------------------------------


def plugin_config(topic: str, directory: Path, **sink: Any) -> dict[str, Any]:
    return {"sink": {"results_topic": topic, "plugins": {"recording": "support.sinks:RecordingSink"},
                     "recording": {"directory": str(directory), **sink.pop("recording", {})}, **sink}}


def test_a_sigkilled_sink_restarts_and_every_verdict_is_written_exactly_once(broker, tmp_path):
    bs = broker.bootstrap_servers
    topic, group = unique("results"), unique("sink-group")
    lines = result_lines(200, seed=7)
    placed = produce(bs, topic, [v for _, v in lines], keys=[k for k, _ in lines])
    directory = tmp_path / "verdicts"
    # A slow backend and small batches: the kill lands between writes and commits.
    config = plugin_config(topic, directory, max_batch_records=5, checkpoint_interval_ms=20,
                           recording={"delay_s": 0.03})
    first = SinkProcess(bs, "recording", config, "--group-id", group)
    try:
        first.wait_ready()
        wait_until(lambda: len(attempted(directory)) >= 40, 60, message="writes under way")
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(timeout=30)
    finally:
        first.kill()
    before = attempted(directory)
    assert len(set(before)) < len(placed), "the sink finished before it was killed"
    restarted = SinkProcess(bs, "recording", config, "--group-id", group)
    try:
        restarted.wait_ready()
        wait_until(lambda: len(verdict_files(directory)) == 2 * len(placed), 90,
                   message=lambda: f"every verdict written; log:\n{restarted.log[-3000:]}")
        wait_until(lambda: committed_to_the_end(bs, group, topic, placed), 30)
        again = restarted.metric("tracejudge_sink_writes_total", sink="recording", outcome="already_written")
        restarted.signal(signal.SIGTERM)
        assert restarted.finish(timeout=60) == 0, restarted.log[-3000:]
    finally:
        restarted.kill()
    every = attempted(directory)
    assert set(every) == set(placed)  # at least once
    assert len(verdict_files(directory)) == 2 * len(placed)  # idempotent writes: exactly once
    redelivered = len(every) - len(set(every))
    assert again <= 2 * redelivered
    assert "tracejudge.sink: stopped" in restarted.log


def test_sigterm_offers_the_pending_batches_once_more_commits_and_leaves(broker, tmp_path):
    bs = broker.bootstrap_servers
    topic, group = unique("results"), unique("sink-group")
    lines = result_lines(30, seed=8)
    placed = produce(bs, topic, [v for _, v in lines], keys=[k for k, _ in lines])
    directory = tmp_path / "verdicts"
    # Checkpoints never come due: what is written is written by the shutdown.
    config = plugin_config(topic, directory, max_batch_records=1000, checkpoint_interval_ms=3_600_000)
    proc = SinkProcess(bs, "recording", config, "--group-id", group)
    try:
        proc.wait_ready()
        wait_until(lambda: proc.metric("tracejudge_in_flight_records") == len(placed), 60,
                   message="every result fetched")
        assert attempted(directory) == [] and proc.metric("tracejudge_commits_total") == 0
        proc.signal(signal.SIGTERM)
        assert proc.finish(timeout=60) == 0, proc.log[-3000:]
    finally:
        proc.kill()
    assert sorted(attempted(directory)) == sorted(placed)
    assert len(verdict_files(directory)) == 2 * len(placed)
    assert committed_to_the_end(bs, group, topic, placed)
    log = proc.log
    assert "SIGTERM received: stopping" in log and "partitions revoked" in log
    assert log.rstrip().endswith("tracejudge.sink: stopped")
    assert "starting tracejudge sink recording with" in log and "stream.topics" not in log


# -- configuration ----------------------------------------------------------------------------------------


def _sink_cli(*args: str, config: dict[str, Any] | None = None, env: dict[str, str] | None = None,
              tmp_path: Path) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}
    environ.update({"PYTHONPATH": str(TESTS), "TRACEJUDGE_KAFKA__BOOTSTRAP_TIMEOUT_MS": "2000",
                    **(env or {})})
    cmd = [sys.executable, "-m", "tracejudge.consumer.commands.cli", "sink", *args,
           "--bootstrap-servers", f"127.0.0.1:{free_port()}", "--metrics-port", "0"]
    if config is not None:
        import yaml

        path = tmp_path / "sink.yaml"
        path.write_text(yaml.safe_dump(config))
        cmd += ["--config", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False, env=environ)


@pytest.mark.parametrize(("args", "config", "env", "expected"), [
    (("nosuch", "--results-topic", "r"), None, None, "KIND: unknown sink 'nosuch'; known: mlflow, otlp"),
    (("mlflow",), None, None, "sink.results_topic: is required"),
    (("x",), {"sink": {"results_topic": "r", "plugins": {"x": "no_such_module_xyz:Sink"}}}, None,
     "sink.plugins.x: the x sink is not available: cannot import 'no_such_module_xyz'"),
    (("x",), {"sink": {"results_topic": "r", "plugins": {"x": "support.sinks:verdict_key"}}}, None,
     "sink.plugins.x: 'support.sinks:verdict_key' is not a tracejudge sink class"),
    (("recording",), {"sink": {"results_topic": "r", "recordng": {}}}, None,
     "unknown key; a plugin's section needs sink.plugins.recordng"),
    (("mlflow", "--results-topic", "r"), {"sink": {"mlflow": {"tracking_uri": "http://127.0.0.1:1",
                                                              "max_concurrency": 0}}}, None,
     "sink.mlflow.max_concurrency"),
    (("otlp", "--results-topic", "r"), {"sink": {"otlp": {"timeout_s": -1}}}, None, "sink.otlp.timeout_s"),
    (("otlp", "--results-topic", "r"), None, {"TRACEJUDGE_SINK__MAX_BATCH_RECORDS": "0"},
     "sink.max_batch_records (from TRACEJUDGE_SINK__MAX_BATCH_RECORDS): must be > 0"),
    (("otlp", "--results-topic", "r", "--dead-letter-topic", "r"), None, None,
     "sink.dead_letter_topic (from --dead-letter-topic): is the results topic"),
    # The sink's own start-up check (`Sink.setup`) runs before Kafka is reached.
    (("recording",), {"sink": {"results_topic": "r", "plugins": {"recording": "support.sinks:RecordingSink"},
                               "recording": {"fail_setup": True}}}, None,
     "sink.recording.fail_setup: the backend refused the configuration"),
], ids=["unknown-kind", "no-results-topic", "plugin-not-importable", "plugin-not-a-sink", "unknown-key",
        "mlflow-section", "otlp-section", "env", "dead-letters-to-itself", "setup"])
def test_configuration_errors_exit_2_naming_the_key_before_anything_runs(args, config, env, expected,
                                                                          tmp_path):
    proc = _sink_cli(*args, config=config, env=env, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr and "cannot reach Kafka" not in proc.stderr


def test_check_config_prints_the_sinks_settings_with_header_values_redacted(tmp_path):
    secret = "Bearer s3cr3t-value"
    proc = _sink_cli("otlp", "--results-topic", "results", "--check-config", tmp_path=tmp_path,
                     config={"stream": {"topics": ["traces"]}, "sink": {"mlflow": {"tracking_uri": "http://x"}}},
                     env={"TRACEJUDGE_SINK__OTLP__HEADERS__AUTHORIZATION": secret})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert 'sink.otlp.headers.authorization = "**********"' in out and "s3cr3t" not in out + proc.stderr
    assert 'sink.group_id (effective) = "tracejudge-sink-otlp"' in out
    assert 'sink.results_topic (effective) = "results"' in out
    # What the otlp sink does not read is not shown: the stream's topics, the mlflow sink's section.
    assert "stream.topics" not in out and "sink.mlflow" not in out and "kafka.group_id" not in out


def test_a_broker_that_cannot_be_reached_is_one_line_then_exit_4(tmp_path):
    proc = _sink_cli("recording", tmp_path=tmp_path, config=plugin_config("results", tmp_path / "v"))
    assert proc.returncode == 4, proc.stderr  # SERVICE_FAILED
    assert "ERROR tracejudge.sink: cannot reach Kafka at 127.0.0.1:" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- units ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "reason"), [
    (None, NOT_A_RESULT),
    (b"", INVALID_JSON),
    (b"\xff\xfe", INVALID_JSON),
    (b'"a string"', NOT_A_RESULT),
    (b'{"trace_id": null, "request_id": null}', NOT_A_RESULT),
    (b'{"trace_id": null, "request_id": "r", "assessments": {}}', NOT_A_RESULT),
    (b'{"trace_id": null, "request_id": "r", "assessments": [{"value": 1}]}', NOT_A_RESULT),
    (b'{"trace_id": null, "request_id": "r", "assessments": [], "schema_version": "2"}', NOT_A_RESULT),
    (b'{"trace_id": null, "request_id": "r", "assessments": [], "schema_version": 999}',
     UNKNOWN_SCHEMA_VERSION),
    (b'{"trace_id": null, "request_id": "r", "assessments": [], "latency_seconds": "slow"}', NOT_A_RESULT),
])
def test_what_is_not_a_result(value, reason):
    with pytest.raises(BadResult) as exc:
        decode_result(value)
    assert exc.value.reason == reason


def test_a_result_line_of_either_version_is_a_result():
    line = result_lines(1)[0][1]
    assert decode_result(line)["assessments"][0]["name"] == JUDGES[0]
    v1 = orjson.loads(line)
    v1.pop("schema_version", None)
    assert decode_result(orjson.dumps(v1))["trace_id"] == v1["trace_id"]


def test_the_builtin_sinks_settings_classes_are_found_from_their_constructors():
    from tracejudge.consumer.sinks.mlflow import MlflowSink, MlflowSinkSettings
    from tracejudge.consumer.sinks.otlp import OtlpSink, OtlpSinkSettings

    assert sink_settings_type(MlflowSink) is MlflowSinkSettings
    assert sink_settings_type(OtlpSink) is OtlpSinkSettings
    assert sink_settings_type(RecordingSink) is None  # it takes its mapping as it is
