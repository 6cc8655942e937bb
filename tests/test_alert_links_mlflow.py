"""The trace search of an alert, end to end with real parts: `mlflow server`, tracejudge's MLflow sink
writing the verdicts, a real Prometheus rendering the alert's `traces_url` at the evaluation that made
it pending, and MLflow's trace search running the filter the link encodes.

The link opens MLflow's traces view with URL filters (`filter=ASSESSMENT::=::no::groundedness`,
`filter=TAG::=::<app>::app`) and a custom time range (`startTime`/`endTime`); `ui_filter` turns them into
the search filter the view sends (the translation of MLflow 3.17's UI: attributes.timestamp_ms between
the two instants, then `tags.<key> = '<value>'` and feedback.`<name>` = '<value>' per URL filter).
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httpx
from prometheus_client import CollectorRegistry, Counter, start_http_server
from support.deploy_files import RULES
from support.kafka import unique
from support.mlflow_server import send_otlp, shared_mlflow_server
from support.otel_producers import Producer
from support.prometheus_stack import PrometheusServer, free_port, wait_until

from tracejudge.consumer.config.alert_rules import render_rules
from tracejudge.consumer.config.alerts import AlertsSettings
from tracejudge.consumer.sinks.base import SinkBatch, SinkRecord
from tracejudge.consumer.sinks.mlflow import MlflowSink, MlflowSinkSettings

MINUTE = 60_000  # ms


def make_traces(url: str, experiment: str, specs: list[tuple[str, int]]) -> list[str]:
    """One single-span trace per (app, start offset in ms from now), sent over OTLP; each gets the tag
    `app` (how `stream.app_tag: app` names its app). Returns the MLflow trace ids, in order."""
    producer = Producer("agent")
    now_ns = time.time_ns()
    ids = []
    for app, offset_ms in specs:
        start = now_ns + offset_ms * 1_000_000
        span = producer.tracer.start_span(f"answer {app}", start_time=start)
        span.end(end_time=start + 800_000_000)
        ids.append(f"tr-{span.get_span_context().trace_id:032x}")
    send_otlp(url, experiment, producer.finished())
    with httpx.Client(base_url=url, timeout=30) as client:
        for trace_id, (app, _) in zip(ids, specs, strict=True):
            r = client.patch(f"/api/3.0/mlflow/traces/{trace_id}/tags", json={"key": "app", "value": app})
            assert r.status_code == 200, r.text
    return ids


def write_verdicts(url: str, verdicts: list[tuple[str, str, bool]]) -> None:
    """(trace id, judge, passed) written as tracejudge's MLflow sink writes them (feedback yes/no)."""
    results = [{"schema_version": 6, "request_id": t.removeprefix("tr-"), "trace_id": t.removeprefix("tr-"),
                "mlflow_trace_id": t, "session_id": None, "user_id": None, "source_format": "otlp_proto",
                "source": {"format": "otlp_proto", "topic": "otlp_spans", "partition": 0, "offset": i},
                "metrics": {}, "assessments": [{"name": judge, "passed": passed, "score": float(passed),
                                                "value": "yes" if passed else "no", "source": "heuristic"}]}
               for i, (t, judge, passed) in enumerate(verdicts)]
    sink = MlflowSink(MlflowSinkSettings.from_mapping({"tracking_uri": url}, env={}), CollectorRegistry(),
                      env={})
    try:
        sink.setup()
        report = sink.write(SinkBatch("tracejudge-results", 0, [
            SinkRecord("tracejudge-results", 0, i, None, r) for i, r in enumerate(results)]))
    finally:
        sink.close()
    assert report.written == len(verdicts), report


def ui_filter(traces_url: str) -> tuple[str, str]:
    """(experiment id, MLflow search filter) of a traces-view link, as MLflow 3.17's UI builds it."""
    fragment = urlsplit(traces_url).fragment
    path, _, query = fragment.partition("?")
    experiment = path.removeprefix("/experiments/").removesuffix("/traces")
    params = parse_qs(query)
    assert params["startTimeLabel"] == ["CUSTOM"]
    ms = {k: int(datetime.fromisoformat(params[k][0]).timestamp() * 1000) for k in ("startTime", "endTime")}
    clauses = [f"attributes.timestamp_ms > {ms['startTime']}", f"attributes.timestamp_ms < {ms['endTime']}"]
    for entry in params.get("filter", []):
        column, operator, value, key = entry.split("::")
        if column == "TAG":
            name = f"tags.`{key}`" if "." in key or " " in key else f"tags.{key}"
            clauses.append(f"{name} {operator} '{value}'")
        elif column == "ASSESSMENT":
            clauses.append(f"feedback.`{key}` {operator} '{value}'")
        else:
            raise AssertionError(f"a filter column the test does not translate: {entry}")
    return experiment, " AND ".join(clauses)


def search(url: str, experiment: str, filter_string: str) -> set[str]:
    body: dict[str, Any] = {"locations": [{"type": "MLFLOW_EXPERIMENT",
                                           "mlflow_experiment": {"experiment_id": experiment}}],
                            "filter": filter_string, "max_results": 500}
    r = httpx.post(f"{url}/api/3.0/mlflow/traces/search", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return {t["trace_id"] for t in r.json().get("traces", [])}


def test_traces_url_finds_exactly_the_failing_traces_of_the_app_in_the_window(tmp_path: Path) -> None:
    server = shared_mlflow_server()
    experiment = server.create_experiment(unique("alert-links"))
    shop, other = "shop", "billing"
    # The window of GroundednessDropped: 1h of verdicts + `for: 15m` = 75 minutes up to the evaluation.
    failing_in = make_traces(server.url, experiment, [(shop, -10 * MINUTE), (shop, -35 * MINUTE),
                                                      (shop, -70 * MINUTE)])
    passing_in = make_traces(server.url, experiment, [(shop, -15 * MINUTE), (shop, -50 * MINUTE)])
    other_app = make_traces(server.url, experiment, [(other, -12 * MINUTE), (other, -40 * MINUTE)])
    before = make_traces(server.url, experiment, [(shop, -120 * MINUTE)])
    after = make_traces(server.url, experiment, [(shop, 30 * MINUTE)])
    other_judge = make_traces(server.url, experiment, [(shop, -20 * MINUTE)])
    failing = failing_in + other_app + before + after
    write_verdicts(server.url, [*[(t, "groundedness", False) for t in failing],
                                *[(t, "groundedness", True) for t in passing_in + other_judge],
                                *[(t, "relevance", False) for t in other_judge]])

    alerts = AlertsSettings(trace_search={"kind": "mlflow", "mlflow": {
        "tracking_url": server.url, "experiment_id": experiment, "app_tag": "app"}})
    rules = tmp_path / "rules.yml"
    rules.write_text(render_rules(RULES.read_text(), alerts))

    # The evaluator's verdicts counter: shop's groundedness verdicts all fail from now on.
    registry = CollectorRegistry()
    verdicts = Counter("tracejudge_judge_verdicts", "Judge verdicts", ["app", "judge", "verdict"],
                       registry=registry)
    failed = verdicts.labels(app=shop, judge="groundedness", verdict="fail")
    port = free_port()
    httpd, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        with PrometheusServer(tmp_path / "prom", targets=[f"127.0.0.1:{port}"], rule_files=[rules]) as prom:
            wait_until(lambda: prom.query("tracejudge_judge_verdicts_total"), 60, "the first scrape")
            failed.inc(40)

            def pending() -> list[dict[str, Any]]:
                return [a for a in prom.api("alerts")["alerts"]
                        if a["labels"].get("alertname") == "GroundednessDropped"
                        and a["labels"]["app"] == shop]

            (alert,) = wait_until(pending, 60, "GroundednessDropped pending for shop")
    finally:
        httpd.shutdown()
        thread.join(10)

    traces_url = alert["annotations"]["traces_url"]
    assert traces_url.startswith(f"{server.url}/#/experiments/{experiment}/traces?")
    linked_experiment, filter_string = ui_filter(traces_url)
    assert linked_experiment == experiment
    assert "tags.app = 'shop'" in filter_string and "feedback.`groundedness` = 'no'" in filter_string
    # MLflow 3.17's traces view reads the app from `tag=<key>=<value>` (each side URL-encoded inside).
    (tag,) = parse_qs(urlsplit(traces_url).fragment.partition("?")[2])["tag"]
    assert [unquote(part) for part in tag.split("=", 1)] == ["app", shop]
    assert search(server.url, experiment, filter_string) == set(failing_in)
    # The filter is what separates them: the window alone holds the passing, the other app's and the
    # other judge's traces too, and the app's failing verdicts outside the window exist.
    window_only = " AND ".join(filter_string.split(" AND ")[:2])
    in_window = set(failing_in + passing_in + other_app + other_judge)
    assert search(server.url, experiment, window_only) == in_window
    assert set(before + after) <= search(server.url, experiment, "feedback.`groundedness` = 'no'")
