"""The test Prometheus/Alertmanager stack works end to end before the tracejudge e2e test relies on it.

A prometheus_client registry served on loopback is scraped by a real Prometheus (exemplar storage on),
a trivial rule fires, Alertmanager routes it, and the webhook receiver in this process gets it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from support.deploy_files import ALERTMANAGER, load_yaml
from support.prometheus_stack import (
    AlertmanagerServer,
    PrometheusServer,
    WebhookReceiver,
    alertmanager_config,
    free_port,
    wait_until,
)


@pytest.fixture
def exporter():
    """A registry with a counter and a histogram with exemplars, served on 127.0.0.1."""
    registry = CollectorRegistry()
    events = Counter("demo_events", "Events seen.", ["app"], registry=registry)
    latency = Histogram("demo_latency_seconds", "Latency.", ["app"], buckets=(0.1, 1.0), registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}", events, latency
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_rule_fires_through_prometheus_and_alertmanager_to_the_webhook(tmp_path: Path, exporter) -> None:
    address, events, latency = exporter
    events.labels("shop").inc(3)
    latency.labels("shop").observe(0.3, exemplar={"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"})
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "demo", "rules": [{
        "alert": "DemoEventsSeen", "expr": "sum by (app) (demo_events_total) > 2", "for": "0s",
        "labels": {"severity": "warning"},
        "annotations": {"summary": "{{ $value }} events for {{ $labels.app }}"}}]}]}))
    config = {"route": {"receiver": "hook", "group_by": ["alertname"], "group_wait": "1s",
                        "group_interval": "1s", "repeat_interval": "1m"},
              "receivers": [{"name": "hook", "webhook_configs": [{"url": "placeholder"}]}]}

    with WebhookReceiver() as hook:
        config["receivers"][0]["webhook_configs"][0]["url"] = hook.url
        with AlertmanagerServer(config, tmp_path / "am") as am, \
             PrometheusServer(tmp_path / "prom", targets=[address], rule_files=[rules],
                              alertmanager=am.address) as prom:
            wait_until(prom.targets_up, 30, "the exporter to be scraped")
            (sample,) = wait_until(lambda: prom.query('demo_events_total{app="shop"}'), 30, "the counter")
            assert float(sample["value"][1]) == 3

            (alert,) = wait_until(lambda: hook.alerts(alertname="DemoEventsSeen"), 60, "the webhook alert")
            assert alert["labels"] == {"alertname": "DemoEventsSeen", "app": "shop", "severity": "warning"}
            assert alert["annotations"] == {"summary": "3 events for shop"}
            assert prom.firing("DemoEventsSeen")
            assert any(a["labels"]["alertname"] == "DemoEventsSeen" for a in am.alerts())

            # Exemplar storage is on: the trace id attached to the observation is queryable.
            exemplars = wait_until(lambda: prom.query_exemplars("demo_latency_seconds_bucket"), 30,
                                   "the exemplar")
            trace_ids = {e["labels"]["trace_id"] for series in exemplars for e in series["exemplars"]}
            assert trace_ids == {"4bf92f3577b34da6a3ce929d0e0e4736"}


def test_shipped_alertmanager_config_is_derived_with_the_webhook_and_short_timers() -> None:
    derived = alertmanager_config("http://127.0.0.1:1/hook")
    shipped = load_yaml(ALERTMANAGER)
    assert derived["route"]["group_wait"] == "1s" and derived["route"]["routes"] == shipped["route"]["routes"]
    urls = [w["url"] for r in derived["receivers"] for w in r.get("webhook_configs", [])]
    assert urls == ["http://127.0.0.1:1/hook"]


def test_wait_until_reports_what_it_waited_for_and_the_last_error() -> None:
    def failing() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(AssertionError, match=r"waiting for the answer \(last error: ConnectionError"):
        wait_until(failing, 0.3, "the answer", interval=0.05)
    assert wait_until(lambda: [1], 1, "a value") == [1]


def test_a_server_that_cannot_start_fails_with_its_log(tmp_path: Path) -> None:
    rules = tmp_path / "broken.yml"
    rules.write_text("groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: sum(\n")
    broken = PrometheusServer(tmp_path / "prom", targets=["127.0.0.1:1"], rule_files=[rules])
    try:
        with pytest.raises(AssertionError, match=r"(?s)prometheus exited with \d+.*broken.yml"):
            broken.start()
    finally:
        broken.stop()
