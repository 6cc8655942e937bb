"""Prometheus families of tracejudge, the export of results, and the /metrics /healthz /readyz server."""

from __future__ import annotations

import gzip
import shutil
import subprocess

import httpx
import pytest
from prometheus_client import CollectorRegistry
from support.kafka import agent_traces, samples, value

from tracejudge.consumer.pipeline import Pipeline
from tracejudge.consumer.runtime.http import OperationsServer
from tracejudge.metrics.app_labels import OTHER_APP, UNKNOWN_APP
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.record import Document, EvalRecord, ToolCall
from tracejudge.schemas.result import EvaluationResult, SourceRef

OPENMETRICS = "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4"


@pytest.fixture(scope="module")
def traces():
    return agent_traces(40, seed=5, failure_share=0.2)


def evaluate_all(exporter: PrometheusExporter, payloads) -> list[EvaluationResult]:
    pipeline = Pipeline(app_tag="app")
    out = []
    for i, payload in enumerate(payloads):
        result = pipeline.evaluate(pipeline.normalise(payload), SourceRef("mlflow", topic="t", offset=i))
        exporter.export(result)
        out.append(result)
    return out


def test_export_counts_traces_latency_tokens_and_documents_per_app(traces):
    exporter = PrometheusExporter()
    results = evaluate_all(exporter, [t.payload for t in traces])
    text = exporter_text(exporter)
    for app in {t.app for t in traces}:
        mine = [r.record for r in results if r.record.app == app]
        failed = sum(bool(r.failed) for r in mine)
        assert value(text, "tracejudge_traces_total", app=app, status="error") == failed
        assert value(text, "tracejudge_traces_total", app=app, status="ok") == len(mine) - failed
        latencies = [r.latency_seconds for r in mine if r.latency_seconds is not None]
        assert value(text, "tracejudge_trace_latency_seconds_count", app=app) == len(latencies)
        assert value(text, "tracejudge_trace_latency_seconds_sum", app=app) == pytest.approx(sum(latencies))
        tokens_in = sum(r.tokens.input or 0 for r in mine if r.tokens)
        assert tokens_in > 0
        assert value(text, "tracejudge_tokens_total", app=app, direction="input") == tokens_in
        docs = [len(r.retrieved_context) for r in mine if r.retrieved_context is not None]
        assert value(text, "tracejudge_retrieved_documents_sum", app=app) == sum(docs)
    assert sum(t.failed for t in traces) == value(text, "tracejudge_traces_total", status="error") > 0


def test_ratio_metrics_are_histogrammed_and_other_metrics_are_not():
    exporter = PrometheusExporter()
    record = EvalRecord(trace_id="tr-1", app="shop", latency_seconds=0.8,
                        retrieved_context=[Document("a"), Document("b")],
                        trajectory=[ToolCall("search")])
    result = EvaluationResult(record, SourceRef("agent_eval"),
                              metrics={"document_recall": 0.5, "trajectory_precision": 1.0,
                                       "latency_seconds": 0.8, "trajectory_recall": None,
                                       "custom_ratio": 0.25},
                              metric_errors={"custom_ratio_broken": "ZeroDivisionError"})
    exporter.export(result)
    custom = PrometheusExporter(CollectorRegistry(), ratio_metrics={"custom_ratio"})
    custom.export(result)
    text = exporter_text(exporter)
    assert value(text, "tracejudge_metric_value_count", app="shop", metric="document_recall") == 1
    assert value(text, "tracejudge_metric_value_bucket", app="shop", metric="document_recall", le="0.5") == 1
    assert value(text, "tracejudge_metric_value_bucket", app="shop", metric="document_recall", le="0.4") == 0
    assert value(text, "tracejudge_metric_value_bucket", app="shop", metric="trajectory_precision",
                 le="1.0") == 1
    assert value(text, "tracejudge_metric_value_count", metric="latency_seconds") == 0
    assert value(text, "tracejudge_metric_value_count", metric="trajectory_recall") == 0
    assert value(text, "tracejudge_metric_errors_total", metric="custom_ratio_broken") == 1
    assert value(exporter_text(custom), "tracejudge_metric_value_count", metric="custom_ratio") == 1


def test_the_app_label_is_capped_and_overflow_is_counted():
    exporter = PrometheusExporter(max_apps=2)
    for app in ["a", "b", "c", "d", "a", None, "x" * 500]:
        exporter.export(EvaluationResult(EvalRecord(trace_id="t", app=app), SourceRef("agent_eval")))
    text = exporter_text(exporter)
    apps = {dict(labels)["app"] for (name, labels) in samples(text) if name == "tracejudge_traces_total"}
    assert apps == {"a", "b", OTHER_APP, UNKNOWN_APP}
    assert value(text, "tracejudge_traces_total", app=OTHER_APP) == 3
    assert value(text, "tracejudge_app_label_overflow_total") == 3
    assert exporter.apps.admitted == {"a", "b"}


def test_latency_exemplar_carries_the_trace_id_in_openmetrics_only(traces):
    exporter = PrometheusExporter()
    results = evaluate_all(exporter, [traces[0].payload])
    trace_id = results[0].record.trace_id
    # MLflow's "tr-<hex>" is the OTel trace id; tracejudge keeps the hex (what OTLP sources carry too).
    assert trace_id == traces[0].trace_id.removeprefix("tr-")
    with OperationsServer(exporter.registry, host="127.0.0.1", port=0).start() as server:
        om = httpx.get(f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": OPENMETRICS})
        plain = httpx.get(f"http://127.0.0.1:{server.port}/metrics")
    assert om.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert om.text.rstrip().endswith("# EOF")
    latency_lines = [line for line in om.text.splitlines()
                     if line.startswith("tracejudge_trace_latency_seconds_bucket") and "# {" in line]
    assert len(latency_lines) == 1 and f'trace_id="{trace_id}"' in latency_lines[0]
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# {" not in plain.text and value(plain.text, "tracejudge_traces_total") == 1


def test_each_latency_bucket_keeps_a_fresh_exemplar_without_one_per_observation():
    exporter = PrometheusExporter()
    for trace_id, latency in (("fast-1", 0.07), ("fast-2", 0.08), ("slow-1", 25.0)):
        exporter.export(EvaluationResult(EvalRecord(trace_id=trace_id, app="a", latency_seconds=latency),
                                         SourceRef("agent_eval")))
    with OperationsServer(exporter.registry, host="127.0.0.1", port=0) as server:
        text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": OPENMETRICS}).text
    exemplars = {line.split('le="')[1].split('"')[0]: line.split('trace_id="')[1].split('"')[0]
                 for line in text.splitlines()
                 if line.startswith("tracejudge_trace_latency_seconds_bucket") and "# {" in line}
    # The second fast trace came within the refresh interval: the bucket keeps the first one's; the
    # slow trace, in another bucket, gets its own at once.
    assert exemplars == {"0.1": "fast-1", "30.0": "slow-1"}
    assert value(text.replace("# EOF", ""), "tracejudge_trace_latency_seconds_count") == 3


def test_exemplar_ids_longer_than_the_limit_are_truncated_not_rejected():
    exporter = PrometheusExporter()
    exporter.export(EvaluationResult(EvalRecord(trace_id="x" * 300, latency_seconds=1.0), SourceRef("a")))
    assert value(exporter_text(exporter), "tracejudge_trace_latency_seconds_count") == 1


def test_a_lone_surrogate_from_custom_code_does_not_break_the_exposition():
    # The built-in formats replace them; a custom format handler's record may still hold one.
    exporter = PrometheusExporter()
    exporter.export(EvaluationResult(EvalRecord(trace_id="t\ud800", app="caf\udce9", latency_seconds=1.0),
                                     SourceRef("custom")))
    with OperationsServer(exporter.registry, host="127.0.0.1", port=0) as server:
        om = httpx.get(f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": OPENMETRICS})
        plain = httpx.get(f"http://127.0.0.1:{server.port}/metrics")
    assert om.status_code == plain.status_code == 200
    assert value(plain.text, "tracejudge_traces_total", app="caf?", status="ok") == 1
    assert 'trace_id="t?"' in om.text


def test_promtool_finds_nothing_to_complain_about(traces):
    exporter = PrometheusExporter()
    evaluate_all(exporter, [t.payload for t in traces])
    exporter.count_ok("traces")
    exporter.count_dead_letter("traces", "invalid_json", routed=False)
    exporter.set_lag("traces", 0, 12)
    exporter.rebalances.labels("assigned").inc()
    exporter.processing.observe(0.001)
    text = exporter_text(exporter)
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "" and proc.stderr.strip() == "", (
        proc.stdout + proc.stderr)


def test_health_endpoints_answer_with_status_and_reason():
    state = {"ready": (False, "no partitions assigned")}

    def broken() -> tuple[bool, str]:
        raise RuntimeError("boom")

    server = OperationsServer(CollectorRegistry(), host="127.0.0.1", port=0,
                              readiness=lambda: state["ready"], liveness=broken).start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        ready = httpx.get(f"{base}/readyz")
        assert (ready.status_code, ready.text) == (503, "no partitions assigned\n")
        state["ready"] = (True, "ok: 4 partitions assigned")
        assert httpx.get(f"{base}/readyz").status_code == 200
        alive = httpx.get(f"{base}/healthz")
        assert alive.status_code == 503 and "health check failed: RuntimeError: boom" in alive.text
        assert httpx.get(f"{base}/nope").status_code == 404
        with httpx.stream("GET", f"{base}/metrics", headers={"Accept-Encoding": "gzip"}) as zipped:
            assert zipped.headers["content-encoding"] == "gzip"
            assert gzip.decompress(b"".join(zipped.iter_raw())) == b""  # an empty registry
    finally:
        server.stop()


def exporter_text(exporter: PrometheusExporter) -> str:
    from prometheus_client import generate_latest

    return generate_latest(exporter.registry).decode()
