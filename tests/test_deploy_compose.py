"""The compose stack, checked without Docker: every file it mounts exists, every name it uses resolves,
and each service's own config passes that service's own checker where one is installed (promtool)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.deploy_files import COMPOSE, DASHBOARDS, ROOT, load_yaml, tool
from support.prometheus_stack import free_port, wait_until

SERVICES = {"kafka", "kafka-init", "otel-collector", "jaeger", "tracejudge", "agent", "prometheus",
            "alertmanager", "alert-relay", "grafana"}


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE / "compose.yaml")


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def bind_mounts(svc: dict[str, Any]) -> list[tuple[Path, str]]:
    mounts = []
    for volume in svc.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts.append(((COMPOSE / source).resolve(), target))
    return mounts


def mounted(svc: str, target: str) -> Path:
    return next(src for src, dst in bind_mounts(service(svc)) if dst == target)


def tracejudge_config() -> dict[str, Any]:
    return load_yaml(mounted("tracejudge", "/etc/tracejudge/config.yaml"))


def test_the_stack_has_every_service() -> None:
    assert set(compose()["services"]) == SERVICES


def test_images_are_pinned_and_builds_point_at_the_dockerfile() -> None:
    for name, svc in compose()["services"].items():
        if "build" in svc:
            context = (COMPOSE / svc["build"]["context"]).resolve()
            assert context == ROOT and (context / svc["build"]["dockerfile"]).is_file(), name
        else:
            image = svc["image"]
            assert re.search(r":v?\d+\.\d+(\.\d+)?(-[\w.-]+)?$", image), f"{name}: pin {image} to a version"


def test_bind_mounted_files_exist() -> None:
    for name, svc in compose()["services"].items():
        for source, _ in bind_mounts(svc):
            assert source.exists(), f"{name} mounts {source}, which does not exist"


def test_dependencies_name_services_and_known_conditions() -> None:
    services = compose()["services"]
    for name, svc in services.items():
        for dependency, spec in svc.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            assert spec["condition"] in ("service_started", "service_healthy",
                                         "service_completed_successfully")
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{dependency} has no healthcheck"


def test_host_ports_do_not_collide() -> None:
    host_ports = [p.split(":")[0] for svc in compose()["services"].values() for p in svc.get("ports", [])]
    assert len(host_ports) == len(set(host_ports))


def test_prometheus_config_passes_promtool_with_the_shipped_rules(tmp_path: Path) -> None:
    config = load_yaml(COMPOSE / "prometheus.yml")
    rules_dir = mounted("prometheus", "/etc/prometheus/rules")
    config["rule_files"] = [str(rules_dir / Path(p).name) for p in config["rule_files"]]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([tool("promtool"), "check", "config", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 13 rules found" in result.stdout  # the rule file was found through the glob


def test_prometheus_keeps_exemplars_and_scrapes_the_stack() -> None:
    assert "--enable-feature=exemplar-storage" in service("prometheus")["command"]
    config = load_yaml(COMPOSE / "prometheus.yml")
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    port = tracejudge_config()["http"]["port"]
    assert f"tracejudge:{port}" in targets and f"{port}:{port}" in service("tracejudge")["ports"]
    for target in targets:
        host = target.split(":")[0]
        assert host == "localhost" or host in compose()["services"], target
    (alertmanagers,) = config["alerting"]["alertmanagers"]
    assert alertmanagers["static_configs"][0]["targets"] == ["alertmanager:9093"]


def test_alertmanager_webhook_reaches_the_relay_service() -> None:
    config = load_yaml(mounted("alertmanager", "/etc/alertmanager/alertmanager.yml"))
    urls = [w["url"] for r in config["receivers"] for w in r.get("webhook_configs", [])]
    assert [httpx.URL(u).host for u in urls] == ["alert-relay"]
    assert all(httpx.URL(u).port == 8080 for u in urls)


def test_alert_relay_prints_each_posted_alert() -> None:
    port = free_port()
    env = {**os.environ, "RELAY_ADDRESS": f"127.0.0.1:{port}"}
    relay = subprocess.Popen([sys.executable, str(COMPOSE / "alert-relay.py")], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        payload = {"version": "4", "status": "firing", "alerts": [{
            "status": "firing", "labels": {"alertname": "GroundednessDropped", "app": "shop"},
            "annotations": {"summary": "Groundedness pass rate 61% for app shop"}}]}
        response = wait_until(lambda: httpx.post(f"http://127.0.0.1:{port}/alertmanager", json=payload),
                              10, "the relay to listen")
        assert response.status_code == 200
    finally:
        relay.terminate()
        out, _ = relay.communicate(timeout=10)
    assert out.strip() == ('[firing] GroundednessDropped {"alertname": "GroundednessDropped", "app": "shop"}'
                           " - Groundedness pass rate 61% for app shop")


def test_tracejudge_config_is_valid_and_drains_within_the_stop_grace_period() -> None:
    from tracejudge.consumer.config import load_settings

    path = mounted("tracejudge", "/etc/tracejudge/config.yaml")
    check = subprocess.run([sys.executable, "-m", "tracejudge.consumer.cli", "run", "--config", str(path),
                            "--check-config"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")})
    assert check.returncode == 0, check.stderr
    settings = load_settings(path, environ={})
    assert settings.judges is not None and settings.judges.endpoints == {}  # the heuristic judges
    grace = int(service("tracejudge")["stop_grace_period"].removesuffix("s"))
    assert grace >= settings.stream.shutdown_grace_seconds + 10
    assert service("tracejudge")["command"] == ["--config", "/etc/tracejudge/config.yaml"]


def test_topics_are_created_with_partitions_for_every_stream() -> None:
    init = service("kafka-init")["environment"]
    created = set(init["TOPICS"].split())
    stream = tracejudge_config()["stream"]
    assert {t["name"] for t in stream["topics"]} | {stream["results_topic"], stream["dead_letter_topic"]} \
        <= created
    assert int(init["PARTITIONS"]) > 1
    script = mounted("kafka-init", "/opt/tracejudge/create-topics.sh")
    assert subprocess.run(["bash", "-n", str(script)], timeout=10).returncode == 0


def test_collector_exports_otlp_proto_keyed_by_trace_id_to_a_topic_tracejudge_reads() -> None:
    collector = load_yaml(mounted("otel-collector", "/etc/otelcol-contrib/config.yaml"))
    kafka = collector["exporters"]["kafka"]
    assert kafka["traces"]["encoding"] == "otlp_proto" and kafka["partition_traces_by_id"] is True
    assert kafka["brokers"] == tracejudge_config()["kafka"]["bootstrap_servers"]
    formats = {t["name"]: t["format"] for t in tracejudge_config()["stream"]["topics"]}
    assert formats[kafka["traces"]["topic"]] == "otlp_proto"
    pipeline = collector["service"]["pipelines"]["traces"]
    assert set(pipeline["receivers"]) <= set(collector["receivers"])
    assert set(pipeline["processors"]) <= set(collector["processors"])
    assert set(pipeline["exporters"]) <= set(collector["exporters"])
    assert collector["exporters"]["otlp/jaeger"]["endpoint"].split(":")[0] in compose()["services"]


def test_collector_exports_content_logs_keyed_by_trace_id_to_a_topic_tracejudge_reads() -> None:
    collector = load_yaml(mounted("otel-collector", "/etc/otelcol-contrib/config.yaml"))
    kafka = collector["exporters"]["kafka"]
    assert kafka["logs"]["encoding"] == "otlp_proto" and kafka["partition_logs_by_trace_id"] is True
    formats = {t["name"]: t["format"] for t in tracejudge_config()["stream"]["topics"]}
    assert formats[kafka["logs"]["topic"]] == "otlp_logs_proto"
    assert "kafka" in collector["service"]["pipelines"]["logs"]["exporters"]


def test_grafana_provisions_the_datasources_and_the_dashboards() -> None:
    provisioning = mounted("grafana", "/etc/grafana/provisioning")
    sources = load_yaml(provisioning / "datasources" / "datasources.yaml")["datasources"]
    by_uid = {s["uid"]: s for s in sources}
    prometheus = by_uid["prometheus"]
    assert httpx.URL(prometheus["url"]).host in compose()["services"] and prometheus["isDefault"] is True
    (destination,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert destination["name"] == "trace_id" and destination["datasourceUid"] in by_uid
    (provider,) = load_yaml(provisioning / "dashboards" / "tracejudge.yaml")["providers"]
    assert mounted("grafana", provider["options"]["path"]) == DASHBOARDS
    home = service("grafana")["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS / Path(home).name).is_file()
    # The dashboards' datasource variable offers Prometheus datasources: the provisioned one qualifies.
    for path in DASHBOARDS.glob("*.json"):
        assert json.loads(path.read_text())["templating"]["list"][0]["query"] == prometheus["type"]


@pytest.mark.parametrize("name", ["kafka", "tracejudge"])
def test_long_running_services_restart(name: str) -> None:
    assert service(name)["restart"] == "unless-stopped"
