"""Findings written back where the sinks write (issue 26 item 5).

`tracejudge findings` publishes what the failing verdicts have in common as `"kind": "finding"` lines on
the findings topic; the sink runtime reads that topic too (`sink.findings_topic`) for sinks that handle
findings. The real broker, a real `mlflow server` (traces sent to its OTLP endpoint), the real MLflow
and OTLP sinks on the sink runtime (in-process `SinkRunner`), and the loopback OTLP receiver. What must
hold: tags on exactly the example traces, found by MLflow's own trace search; a redelivered finding
changes nothing; an example trace MLflow never gets is parked, then given up on and counted; a malformed
finding line is dead-lettered and counted while the rest flow; the OTLP sink sends one
`tracejudge.finding` event per example trace, on that trace. Every wait is on a condition.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.kafka import FAST_GROUP, committed_offsets, ends, produce, read_topic, unique, value, wait_until
from support.mlflow_server import MlflowServer, send_otlp, shared_mlflow_server
from support.otel_producers import Producer, genai_trace
from support.otlp_receiver import OtlpReceiver

from tracejudge.consumer.config import ConfigError, Settings, load_settings
from tracejudge.consumer.sinks.base import SinkBatch, SinkRecord
from tracejudge.consumer.sinks.mlflow import MlflowSink, MlflowSinkSettings
from tracejudge.consumer.stages.sink import SinkRunner, plan_sink

DOC = "https://docs.example.com/refunds"
G = "tracejudge.finding.groundedness"
WINDOW = "2026-09-21T13:13:20Z/2026-09-21T14:13:20Z"  # 1_790_000_000 - 3600 to 1_790_000_000


@pytest.fixture(scope="session")
def mlflow_server() -> MlflowServer:
    return shared_mlflow_server()


@pytest.fixture(autouse=True)
def _no_mlflow_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def traces(server: MlflowServer, experiment: str, n: int, label: str) -> list[str]:
    """`n` GenAI traces sent to MLflow's OTLP endpoint; their 32-hex trace ids (MLflow's `tr-<hex>`)."""
    producer = Producer(f"{label}-agent")
    recorded = [genai_trace(producer.tracer, f"Can I get a refund? ({label} {i})", "Yes.") for i in range(n)]
    send_otlp(server.url, experiment, producer.finished())
    return [r.trace_id for r in recorded]


def finding(judge: str, dimension: str, val: str, examples: list[str], *, rank: int = 1,
            end: float = 1_790_000_000.0, lift: float = 3.2) -> dict[str, Any]:
    """A finding line as `tracejudge findings` publishes it (`Finding.to_dict`)."""
    return {"kind": "finding", "app": "support-bot", "judge": judge, "dimension": dimension, "value": val,
            "label": None, "failing": 12, "total": 15, "support": 0.4, "lift": lift,
            "lift_interval": [1.8, 5.1], "failure_rate_with": 0.8, "failure_rate_without": 0.25,
            "window_failing": 30, "window_total": 120, "rank": rank, "example_trace_ids": examples,
            "window": {"start": end - 3600, "end": end}, "conditioned_on": [], "sampled": False}


def tags(server: MlflowServer, trace_hex: str) -> dict[str, str]:
    """The trace's `tracejudge.finding.*` tags."""
    info = server.trace_info(f"tr-{trace_hex}") or {}
    return {k: v for k, v in (info.get("tags") or {}).items() if k.startswith("tracejudge.finding.")}


def settings_for(bootstrap: str, results: str, findings: str, group: str, kind: str, **extra: Any
                 ) -> Settings:
    values: dict[str, Any] = {"kafka.bootstrap_servers": bootstrap, "sink.results_topic": results,
                              "sink.findings_topic": findings, "sink.group_id": group,
                              "sink.checkpoint_interval_ms": 100, "sink.write_sessions": False,
                              "stream.lag_interval_seconds": 0.5, "http.port": 0,
                              "http.bind_address": "127.0.0.1", **FAST_GROUP, **extra}
    return load_settings(environ={}, overrides=values, require_topics=False)


@contextmanager
def running(settings: Settings, kind: str) -> Iterator[CollectorRegistry]:
    registry = CollectorRegistry(auto_describe=True)
    runner = SinkRunner(settings, kind, registry=registry)
    runner.start()
    try:
        wait_until(lambda: runner.http_port is not None or runner.error is not None, 30,
                   message="the sink serves /metrics")
        assert runner.error is None, runner.error
        yield registry
    finally:
        runner.stop()
        assert runner.join(60), "the sink did not stop within 60 s"
    assert runner.error is None, runner.error


def count(registry: CollectorRegistry, kind: str, name: str, **labels: str) -> float:
    return value(generate_latest(registry).decode(), name, sink=kind, **labels)


def test_findings_become_tags_on_exactly_their_example_traces(broker: Any, mlflow_server: MlflowServer
                                                             ) -> None:
    bs, server = broker.bootstrap_servers, mlflow_server
    experiment = server.create_experiment(unique("findings"))
    ex = traces(server, experiment, 3, "example")
    (bystander,) = traces(server, experiment, 1, "bystander")
    ghost = "6" * 32
    results, topic, dead = unique("results"), unique("findings"), unique("dead")
    group = unique("sink-findings")
    produce(bs, results, [b'{"not": "a result"}'])  # the results topic exists; its bad line is dead too
    top = finding("groundedness", "doc_uri", DOC, [ex[0], f"tr-{ex[1]}"], rank=1)
    second = finding("groundedness", "tool", "search_kb", [ex[0], ex[2]], rank=2, lift=2.0)
    lines = [orjson.dumps(top), b"{not json", orjson.dumps({**second, "rank": "two"}),
             orjson.dumps(second), orjson.dumps(finding("relevance", "version", "v7", [ghost]))]
    placed = produce(bs, topic, lines, keys=[b"support-bot/groundedness"] * len(lines))
    settings = settings_for(bs, results, topic, group, "mlflow", **{
        "sink.dead_letter_topic": dead, "sink.mlflow.tracking_uri": server.url,
        "sink.mlflow.experiment_id": experiment, "sink.mlflow.unknown_trace_retry_s": 2,
        "sink.mlflow.unknown_trace_attempts": 3, "sink.mlflow.unknown_trace_backoff_s": 0.2})
    with running(settings, "mlflow") as registry:
        wait_until(lambda: tags(server, ex[2]).get(G) == "tool=search_kb", 60, message="the findings' tags")
        wait_until(lambda: count(registry, "mlflow", "tracejudge_sink_given_up_total", reason="unknown_trace")
                   == 1, 60, message="the ghost example given up")
        p = placed[0][0]
        wait_until(lambda: committed_offsets(bs, group, topic).get(p) == ends(placed)[p],
                   30, message="the findings topic committed to its end")
        # The top finding (rank 1) holds the judge's tag where both are; every dimension has its own tag.
        assert tags(server, ex[0]) == {
            G: f"doc_uri={DOC}", f"{G}.doc_uri": DOC, f"{G}.tool": "search_kb", f"{G}.lift": "3.2 [1.8, 5.1]",
            f"{G}.rank": "1", f"{G}.window": WINDOW,
            f"{G}.app": "support-bot"}
        assert tags(server, ex[1]) == {G: f"doc_uri={DOC}", f"{G}.doc_uri": DOC,
                                       f"{G}.lift": "3.2 [1.8, 5.1]", f"{G}.rank": "1",
                                       f"{G}.app": "support-bot", f"{G}.window": WINDOW}
        assert tags(server, ex[2])[f"{G}.rank"] == "2" and f"{G}.doc_uri" not in tags(server, ex[2])
        assert tags(server, bystander) == {}
        # The two bad finding lines (and the bad result) are dead-lettered and counted; the rest flowed.
        assert count(registry, "mlflow", "tracejudge_sink_dead_letters_total", reason="invalid_json") == 1
        assert count(registry, "mlflow", "tracejudge_sink_dead_letters_total", reason="not_a_finding") == 1
        assert len(read_topic(bs, dead, at_least=3)) == 3
        assert count(registry, "mlflow", "tracejudge_sink_skipped_total", reason="unknown_trace") == 1
        written = count(registry, "mlflow", "tracejudge_sink_writes_total", outcome="written")
        assert written == 7 + 6 + 6  # five top-finding tags and one tag per dimension
        assert count(registry, "mlflow", "tracejudge_sink_skipped_total", reason="superseded") == 1
        # Redelivered: the same lines again change nothing.
        before = {t: tags(server, t) for t in ex}
        again = produce(bs, topic, [orjson.dumps(top), orjson.dumps(second)],
                        keys=[b"support-bot/groundedness"] * 2)
        wait_until(lambda: committed_offsets(bs, group, topic).get(again[0][0]) == ends(again)[again[0][0]],
                   30, message="the redelivered findings committed")
        assert count(registry, "mlflow", "tracejudge_sink_writes_total", outcome="written") == written
        assert count(registry, "mlflow", "tracejudge_sink_writes_total", outcome="already_written") >= 19
        assert {t: tags(server, t) for t in ex} == before

    # MLflow's own trace search finds exactly the example traces by the tag.
    from mlflow import MlflowClient

    found = MlflowClient(tracking_uri=server.url).search_traces(
        locations=[experiment], filter_string=f"tags.`{G}` = 'doc_uri={DOC}'", include_spans=False)
    assert sorted(t.info.trace_id for t in found) == sorted(f"tr-{t}" for t in ex[:2])


def write(sink: MlflowSink, *lines: dict[str, Any]) -> Any:
    records = [SinkRecord("findings", 0, i, None, line) for i, line in enumerate(lines)]
    return sink.write(SinkBatch("findings", 0, records))


def test_a_newer_window_replaces_the_top_finding_an_older_one_does_not(mlflow_server: MlflowServer) -> None:
    server = mlflow_server
    experiment = server.create_experiment(unique("findings-window"))
    (t,) = traces(server, experiment, 1, "window")
    sink = MlflowSink(MlflowSinkSettings.from_mapping({"tracking_uri": server.url}, env={}),
                      CollectorRegistry(), env={})
    try:
        write(sink, finding("groundedness", "doc_uri", DOC, [t], end=1_790_000_000.0))
        newer = write(sink, finding("groundedness", "model", "gpt-x", [t], end=1_790_003_600.0, rank=3))
        # The judge's tag, rank, window and the model tag change; lift and app hold the same values.
        assert (newer.written, newer.already_written, dict(newer.skipped)) == (4, 2, {})
        older = write(sink, finding("groundedness", "tool", "calc", [t], end=1_789_990_000.0))
        assert (older.written, dict(older.skipped)) == (0, {"superseded": 1})
        long_value = write(sink, finding("safety", "request_cluster", "refund " * 400, [t]))
        assert long_value.written == 6
    finally:
        sink.close()
    held = tags(server, t)
    assert held[G] == "model=gpt-x" and held[f"{G}.rank"] == "3" and f"{G}.tool" not in held
    assert held[f"{G}.doc_uri"] == DOC  # the older window's dimension tag stays beside it
    cut = held["tracejudge.finding.safety.request_cluster"]
    assert len(cut) == 1000 and cut.endswith("…")


def test_otlp_sink_sends_a_finding_event_per_example_trace(broker: Any) -> None:
    bs = broker.bootstrap_servers
    results, topic, group = unique("results"), unique("findings"), unique("sink-otlp-findings")
    produce(bs, results, [b'{"not": "a result"}'])
    a, b = "ab" * 16, "cd" * 16
    line = finding("groundedness", "doc_uri", DOC, [a, f"tr-{b}", "mlflow-2-request-id"])
    with OtlpReceiver() as rx:
        produce(bs, topic, [orjson.dumps(line), b"[]"])
        settings = settings_for(bs, results, topic, group, "otlp", **{"sink.otlp.endpoint": rx.endpoint,
                                                                       "sink.otlp.emit_spans": True})
        with running(settings, "otlp") as registry:
            rx.wait_for(lambda r: len(r.events("tracejudge.finding")) >= 2, 60)
            wait_until(lambda: count(registry, "otlp", "tracejudge_sink_skipped_total", reason="no_trace_id")
                       == 1, 30, message="the MLflow 2 id skipped")
            assert count(registry, "otlp", "tracejudge_sink_dead_letters_total", reason="not_a_finding") == 1
        events = rx.events("tracejudge.finding")
        assert sorted(e.trace_id for e in events) == sorted([a, b])
        for e in events:
            assert e.span_id == ""
            assert e.attributes["tracejudge.finding.judge"] == "groundedness"
            assert e.attributes["tracejudge.finding.dimension"] == "doc_uri"
            assert e.attributes["tracejudge.finding.value"] == DOC
            assert e.attributes["tracejudge.finding.lift"] == 3.2
            assert e.attributes["tracejudge.finding.rank"] == 1
        assert len({e.attributes["tracejudge.finding.id"] for e in events}) == 2
        assert rx.spans() == []  # no span for a finding, even with emit_spans


def test_the_findings_topic_defaults_to_the_findings_stage_and_is_checked() -> None:
    base = {"stream.results_topic": "results", "findings.findings_topic": "findings"}
    plan = plan_sink(load_settings(environ={}, overrides=base, require_topics=False), "mlflow")
    assert plan.findings_topic == "findings"
    off = load_settings(environ={}, overrides={**base, "sink.write_findings": False}, require_topics=False)
    assert plan_sink(off, "mlflow").findings_topic is None
    own = load_settings(environ={}, overrides={**base, "sink.findings_topic": "mine"}, require_topics=False)
    assert plan_sink(own, "mlflow").findings_topic == "mine"
    with pytest.raises(ConfigError) as exc:
        plan_sink(load_settings(environ={}, overrides={**base, "findings.findings_topic": "results"},
                                require_topics=False), "mlflow")
    assert [k for k, _ in exc.value.problems] == ["sink.findings_topic"]
    with pytest.raises(ConfigError) as exc:
        load_settings(environ={}, overrides={**base, "sink.findings_topic": "results",
                                             "sink.results_topic": "results"}, require_topics=False)
    assert "sink.findings_topic" in str(exc.value)
