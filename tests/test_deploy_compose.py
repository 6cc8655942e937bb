"""The compose stack, checked without Docker: every file it mounts exists, every name it uses resolves,
and each service's own config passes that service's own checker where one is installed (promtool)."""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.deploy_files import COMPOSE, DASHBOARDS, ROOT, load_yaml, rule_groups, tool
from support.mlflow_server import migrated_database
from support.prometheus_stack import free_port, wait_until

SERVICES = {"kafka", "kafka-init", "otel-collector", "jaeger", "mlflow", "tracejudge", "tracejudge-sessions",
            "tracejudge-findings",
            "tracejudge-sink-mlflow", "agent", "prometheus", "alertmanager", "alert-relay", "grafana"}
SINK = "tracejudge-sink-mlflow"
SESSIONS = "tracejudge-sessions"


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
    rules = sum(len(group["rules"]) for group in rule_groups())
    assert f"SUCCESS: {rules} rules found" in result.stdout  # the rule file was found through the glob


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
                              60, "the relay to listen")
        assert response.status_code == 200
    finally:
        relay.terminate()
        out, _ = relay.communicate(timeout=10)
    assert out.strip() == ('[firing] GroundednessDropped {"alertname": "GroundednessDropped", "app": "shop"}'
                           " - Groundedness pass rate 61% for app shop")


def test_alert_relay_prints_the_alert_links() -> None:
    port = free_port()
    env = {**os.environ, "RELAY_ADDRESS": f"127.0.0.1:{port}"}
    relay = subprocess.Popen([sys.executable, str(COMPOSE / "alert-relay.py")], env=env,
                             stdout=subprocess.PIPE, text=True)
    links = {"runbook_url": "https://wiki.example.com/r#groundednessdropped",
             "traces_url": "http://localhost:5000/#/experiments/0/traces?startTimeLabel=CUSTOM"}
    try:
        payload = {"version": "4", "status": "firing", "alerts": [{
            "status": "firing", "labels": {"alertname": "GroundednessDropped"},
            "annotations": {"summary": "s", **links}}]}
        response = wait_until(lambda: httpx.post(f"http://127.0.0.1:{port}/alertmanager", json=payload),
                              60, "the relay to listen")
        assert response.status_code == 200
    finally:
        relay.terminate()
        out, _ = relay.communicate(timeout=10)
    assert out.splitlines()[1:] == [f"    {k}: {v}" for k, v in links.items()]


def test_tracejudge_config_is_valid_and_drains_within_the_stop_grace_period() -> None:
    from tracejudge.consumer.config import load_settings

    path = mounted("tracejudge", "/etc/tracejudge/config.yaml")
    check = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "run", "--config",
                            str(path),
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
    link, jaeger, session = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    # The exemplar labels tracejudge writes (metrics/telemetry/evaluation.py, metrics/judges/series.py; the
    # session
    # judges' scores: metrics/judges/sessions.py).
    assert link["name"] == jaeger["name"] == "trace_id"
    assert session["name"] == "session_id" and "url" in session
    assert jaeger["datasourceUid"] in by_uid and by_uid[jaeger["datasourceUid"]]["type"] == "jaeger"
    (provider,) = load_yaml(provisioning / "dashboards" / "tracejudge.yaml")["providers"]
    assert mounted("grafana", provider["options"]["path"]) == DASHBOARDS
    home = service("grafana")["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS / Path(home).name).is_file()
    # The dashboards' datasource variable offers Prometheus datasources: the provisioned one qualifies.
    for path in DASHBOARDS.glob("*.json"):
        assert json.loads(path.read_text())["templating"]["list"][0]["query"] == prometheus["type"]


@pytest.mark.parametrize("name", ["kafka", "tracejudge", SESSIONS, SINK, "mlflow"])
def test_long_running_services_restart(name: str) -> None:
    assert service(name)["restart"] == "unless-stopped"


# --- from the alert to the traces: exemplar links, MLflow, the MLflow sink ------------------------------

def exemplar_link(label: str = "trace_id") -> str:
    """The provisioned exemplar URL for exemplars labelled `label` as Grafana sees it (provisioning
    turns `$$` into `$`)."""
    provisioning = mounted("grafana", "/etc/grafana/provisioning")
    sources = load_yaml(provisioning / "datasources" / "datasources.yaml")["datasources"]
    prometheus = next(s for s in sources if s["type"] == "prometheus")
    (url,) = [d["url"] for d in prometheus["jsonData"]["exemplarTraceIdDestinations"]
              if "url" in d and d["name"] == label]
    assert "$" not in url.replace("$$", ""), "an unescaped $ would be read as an environment variable"
    return url.replace("$$", "$")


def render_link(template: str, variables: dict[str, str]) -> str:
    """Interpolate like Grafana does a data link: `${name:raw}` verbatim, `${name}` URI-encoded."""
    def one(match: re.Match[str]) -> str:
        name, fmt = match.group(1), match.group(2)
        value = variables[name]
        return value if fmt == "raw" else urllib.parse.quote(value, safe="")
    return re.sub(r"\$\{([\w.]+)(?::(\w+))?\}", one, template)


def trace_url_default(dashboard: str = "tracejudge-quality.json") -> str:
    variables = json.loads((DASHBOARDS / dashboard).read_text())["templating"]["list"]
    return next(v["query"] for v in variables if v["name"] == "trace_url")


def mlflow_flags() -> dict[str, str]:
    command = service("mlflow")["command"]
    assert command[:2] == ["mlflow", "server"]
    return dict(arg.removeprefix("--").split("=", 1) for arg in command[2:])


def test_exemplars_link_through_the_dashboards_trace_url_variable() -> None:
    template = exemplar_link()
    # `:raw`: Grafana URI-encodes variables in link URLs by default, which would mangle the URL.
    assert template == "${trace_url:raw}${__value.raw}"
    for path in DASHBOARDS.glob("*.json"):
        assert trace_url_default(path.name) == trace_url_default()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    url = httpx.URL(render_link(template, {"trace_url": trace_url_default(), "__value.raw": trace_id}))
    # The MLflow UI of the compose stack, on the host; MLflow names the OTLP trace `tr-<hex>`.
    assert (url.host, url.port) == ("localhost", int(service("mlflow")["ports"][0].split(":")[0]))
    assert url.fragment == f"/experiments/0/traces?selectedEvaluationId=tr-{trace_id}"
    # Jaeger instead: the same template with the variable set to Jaeger's trace page.
    jaeger = render_link(template, {"trace_url": "http://localhost:16686/trace/", "__value.raw": trace_id})
    assert jaeger == f"http://localhost:16686/trace/{trace_id}"


def test_mlflow_server_matches_the_projects_mlflow_and_keeps_its_store_on_a_volume() -> None:
    image = service("mlflow")["image"]
    assert image == f"ghcr.io/mlflow/mlflow:v{importlib.metadata.version('mlflow-skinny')}"
    flags = mlflow_flags()
    assert flags["backend-store-uri"].startswith("sqlite:////mlflow/")  # assessments need a SQL store
    assert flags["host"] == "0.0.0.0"
    assert "mlflow-data:/mlflow" in service("mlflow")["volumes"] and "mlflow-data" in compose()["volumes"]
    assert service("mlflow")["ports"] == [f"{flags['port']}:{flags['port']}"]


def test_the_sink_runs_the_tracejudge_image_as_its_own_consumer_group() -> None:
    sink, evaluator = service(SINK), service("tracejudge")
    assert sink["image"] == evaluator["image"] and sink["build"] == evaluator["build"]
    assert sink["entrypoint"] == ["tracejudge", "sink", "mlflow"]
    args = sink["command"]
    assert args[args.index("--config") + 1] == "/etc/tracejudge/config.yaml"
    config = "/etc/tracejudge/config.yaml"
    assert mounted(SINK, config) == mounted("tracejudge", config)
    # The shared file names no sink group: each kind joins its own default group, never the
    # evaluator's (two kinds in one group would split the partitions between them).
    assert "group_id" not in tracejudge_config()["sink"]
    from tracejudge.consumer.config import load_settings
    from tracejudge.consumer.stages.sink import plan_sink

    settings = load_settings(None, environ={}, overrides={"sink.results_topic": "r"},
                             require_topics=False)
    groups = {kind: plan_sink(settings, kind).group_id for kind in ("mlflow", "otlp")}
    assert groups == {"mlflow": "tracejudge-sink-mlflow", "otlp": "tracejudge-sink-otlp"}
    assert tracejudge_config()["kafka"]["group_id"] not in groups.values()
    assert sink["depends_on"]["mlflow"] == {"condition": "service_healthy"}
    assert int(sink["stop_grace_period"].removesuffix("s")) >= \
        tracejudge_config()["stream"]["shutdown_grace_seconds"] + 10


def test_the_sink_writes_to_the_mlflow_service_and_reads_the_results_topic() -> None:
    config = tracejudge_config()
    sink = config["sink"]
    uri = httpx.URL(sink["mlflow"]["tracking_uri"])
    assert uri.host == "mlflow" and uri.port == int(mlflow_flags()["port"])
    allowed = mlflow_flags()["allowed-hosts"].split(",")
    assert f"{uri.host}:{uri.port}" in allowed  # MLflow rejects other Host headers
    assert sink["results_topic"] == config["stream"]["results_topic"]
    assert sink["dead_letter_topic"] in service("kafka-init")["environment"]["TOPICS"].split()
    assert not {"token", "password"} & set(sink["mlflow"]), "a literal secret in the config file"


def test_prometheus_scrapes_the_sink() -> None:
    config = load_yaml(COMPOSE / "prometheus.yml")
    jobs = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in config["scrape_configs"]}
    port = tracejudge_config()["http"]["port"]
    assert jobs[SINK] == [f"{SINK}:{port}"]
    (published,) = service(SINK)["ports"]
    assert published.endswith(f":{port}") and published != f"{port}:{port}"


def test_collector_sends_every_trace_to_mlflow_too() -> None:
    collector = load_yaml(mounted("otel-collector", "/etc/otelcol-contrib/config.yaml"))
    exporter = collector["exporters"]["otlphttp/mlflow"]
    endpoint = httpx.URL(exporter["traces_endpoint"])
    assert (endpoint.host, endpoint.port) == ("mlflow", int(mlflow_flags()["port"]))
    assert endpoint.path == "/v1/traces"
    assert "otlphttp/mlflow" in collector["service"]["pipelines"]["traces"]["exporters"]
    # The experiment the traces land in is the one the dashboards' trace link opens.
    experiment = exporter["headers"]["x-mlflow-experiment-id"]
    assert f"/#/experiments/{experiment}/traces?" in trace_url_default()


def test_the_compose_mlflow_command_ingests_otlp_and_takes_assessments(tmp_path: Path) -> None:
    """Run the compose service's `mlflow server` flags (paths and port moved here) with this
    environment's MLflow: the collector's OTLP export and the sink's write go through with their
    Host header, a trace lands as `tr-<hex>`, and a Host not allowed is refused."""
    flags = mlflow_flags()
    port = free_port()
    flags.update({"backend-store-uri": f"sqlite:///{tmp_path}/mlflow.db",
                  "artifacts-destination": str(tmp_path / "artifacts"), "host": "127.0.0.1",
                  "port": str(port)})
    # An empty database already at this MLflow's schema (the migrations run once per test run).
    migrated_database(tmp_path / "mlflow.db")
    server = subprocess.Popen([tool("mlflow"), "server", *(f"--{k}={v}" for k, v in flags.items())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/health", timeout=2).status_code == 200, 120, "mlflow to serve")
        collector = load_yaml(mounted("otel-collector", "/etc/otelcol-contrib/config.yaml"))
        exporter = collector["exporters"]["otlphttp/mlflow"]
        host = httpx.URL(exporter["traces_endpoint"]).netloc.decode()
        trace_id, span_id = os.urandom(16), os.urandom(8)
        request = otlp_request(trace_id, span_id)
        response = httpx.post(f"{base}/v1/traces", content=gzip.compress(request),
                              headers={**exporter["headers"], "Host": host, "Content-Encoding": "gzip",
                                       "Content-Type": "application/x-protobuf"}, timeout=30)
        assert response.status_code == 200, response.text
        mlflow_id = "tr-" + trace_id.hex()
        sink_host = httpx.URL(tracejudge_config()["sink"]["mlflow"]["tracking_uri"]).netloc.decode()
        got = httpx.get(f"{base}/api/3.0/mlflow/traces/{mlflow_id}", headers={"Host": sink_host}, timeout=30)
        assert got.status_code == 200, got.text
        location = got.json()["trace"]["trace_info"]["trace_location"]["mlflow_experiment"]
        assert location["experiment_id"] == exporter["headers"]["x-mlflow-experiment-id"]
        assessment = {"assessment": {"assessment_name": "groundedness", "trace_id": mlflow_id,
                                     "span_id": span_id.hex(), "rationale": "no document states it",
                                     "source": {"source_type": "LLM_JUDGE", "source_id": "tracejudge"},
                                     "feedback": {"value": "no"}}}
        written = httpx.post(f"{base}/api/3.0/mlflow/traces/{mlflow_id}/assessments", json=assessment,
                             headers={"Host": sink_host}, timeout=30)
        assert written.status_code == 200, written.text
        refused = httpx.get(f"{base}/api/3.0/mlflow/traces/{mlflow_id}", headers={"Host": "elsewhere:5000"},
                            timeout=30)
        assert refused.status_code == 403
    finally:
        server.terminate()
        server.wait(timeout=30)


def otlp_request(trace_id: bytes, span_id: bytes) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    end = time.time_ns()
    operation = KeyValue(key="gen_ai.operation.name", value=AnyValue(string_value="invoke_agent"))
    span = Span(trace_id=trace_id, span_id=span_id, name="invoke_agent", start_time_unix_nano=end - 10**9,
                end_time_unix_nano=end, attributes=[operation])
    resource = Resource(attributes=[KeyValue(key="service.name", value=AnyValue(string_value="shop"))])
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=resource, scope_spans=[ScopeSpans(spans=[span])])]).SerializeToString()


def test_the_sink_accepts_the_compose_config() -> None:
    path = mounted(SINK, "/etc/tracejudge/config.yaml")
    check = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "sink", "mlflow",
                            "--config",
                            str(path), "--check-config"],
                           capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items()
                                if not k.startswith(("TRACEJUDGE_", "MLFLOW_"))})
    assert check.returncode == 0, check.stderr


# --- conversations: the session stage, its results written back, the demo agent in MLflow ---------------

def test_the_session_stage_runs_the_tracejudge_image_on_the_shared_config() -> None:
    sessions, evaluator = service(SESSIONS), service("tracejudge")
    assert sessions["image"] == evaluator["image"] and sessions["build"] == evaluator["build"]
    assert sessions["entrypoint"] == ["tracejudge", "sessions"]
    assert sessions["command"] == ["--config", "/etc/tracejudge/config.yaml"]
    config = "/etc/tracejudge/config.yaml"
    assert mounted(SESSIONS, config) == mounted("tracejudge", config)
    assert sessions["depends_on"]["kafka-init"] == {"condition": "service_completed_successfully"}
    assert int(sessions["stop_grace_period"].removesuffix("s")) >= \
        tracejudge_config()["stream"]["shutdown_grace_seconds"] + 10


def test_the_session_stage_reads_the_results_and_writes_session_results_to_created_topics() -> None:
    from tracejudge.consumer.config import load_settings

    config = tracejudge_config()
    sessions = config["sessions"]
    assert sessions.get("input_topic", config["stream"]["results_topic"]) == config["stream"]["results_topic"]
    assert sessions["results_topic"] == "tracejudge-session-results"
    created = set(service("kafka-init")["environment"]["TOPICS"].split())
    assert {sessions["results_topic"], sessions["dead_letter_topic"]} <= created
    assert len({sessions["results_topic"], sessions["dead_letter_topic"], config["stream"]["results_topic"],
                config["stream"]["dead_letter_topic"], config["sink"]["dead_letter_topic"]}) == 5
    # The shared file names no sessions group: the stage joins its own default group, never the
    # evaluator's (kafka.group_id) nor a sink's.
    assert "group_id" not in sessions
    from tracejudge.consumer.stages.sessions import plan_sessions

    plan = plan_sessions(load_settings(mounted(SESSIONS, "/etc/tracejudge/config.yaml"), environ={}))
    assert plan.input_topic == config["stream"]["results_topic"]
    assert plan.results_topic == sessions["results_topic"]
    assert plan.group_id == "tracejudge-sessions"
    assert plan.group_id not in {config["kafka"]["group_id"], "tracejudge-sink-mlflow",
                                 "tracejudge-sink-otlp"}


def test_the_session_stage_accepts_the_compose_config() -> None:
    path = mounted(SESSIONS, "/etc/tracejudge/config.yaml")
    check = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "sessions", "--config",
                            str(path), "--check-config"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")})
    assert check.returncode == 0, check.stderr
    assert 'sessions.group_id (effective) = "tracejudge-sessions"' in check.stdout


def test_the_sink_writes_session_verdicts_back_too() -> None:
    from tracejudge.consumer.config import load_settings
    from tracejudge.consumer.stages.sink import plan_sink

    settings = load_settings(mounted(SINK, "/etc/tracejudge/config.yaml"), environ={})
    plan = plan_sink(settings, "mlflow")
    assert plan.session_results_topic == tracejudge_config()["sessions"]["results_topic"]
    assert plan.results_topic == tracejudge_config()["stream"]["results_topic"]


def test_prometheus_scrapes_the_session_stage() -> None:
    config = load_yaml(COMPOSE / "prometheus.yml")
    jobs = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in config["scrape_configs"]}
    port = tracejudge_config()["http"]["port"]
    assert jobs[SESSIONS] == [f"{SESSIONS}:{port}"]
    (published,) = service(SESSIONS)["ports"]
    assert published.endswith(f":{port}") and published not in service("tracejudge")["ports"]


def test_the_demo_agent_logs_its_traces_to_the_mlflow_service() -> None:
    """Without the tracking URI the agent's traces reach Kafka only, and the sink skips their verdicts
    as unknown_trace; with it MLflow has every trace (experiment 0, where the links open)."""
    agent = service("agent")
    args = agent["command"]
    uri = httpx.URL(args[args.index("--mlflow-tracking-uri") + 1])
    assert (uri.host, uri.port) == ("mlflow", int(mlflow_flags()["port"]))
    assert f"{uri.host}:{uri.port}" in mlflow_flags()["allowed-hosts"].split(",")
    assert agent["depends_on"]["mlflow"] == {"condition": "service_healthy"}
    from tracejudge.consumer.demo.command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(args)
    assert parsed.mlflow_tracking_uri == str(uri).rstrip("/")


def test_session_exemplars_link_to_the_mlflow_conversation_view() -> None:
    template = exemplar_link("session_id")
    assert template == "${session_url:raw}${__value.raw}"
    variables = json.loads((DASHBOARDS / "tracejudge-quality.json").read_text())["templating"]["list"]
    default = next(v["query"] for v in variables if v["name"] == "session_url")
    url = httpx.URL(render_link(template, {"session_url": default, "__value.raw": "conv-42"}))
    assert (url.host, url.port) == ("localhost", int(service("mlflow")["ports"][0].split(":")[0]))
    # The experiment the demo agent and the collector log to.
    collector = load_yaml(mounted("otel-collector", "/etc/otelcol-contrib/config.yaml"))
    experiment = collector["exporters"]["otlphttp/mlflow"]["headers"]["x-mlflow-experiment-id"]
    assert url.fragment == f"/experiments/{experiment}/chat-sessions/conv-42"
