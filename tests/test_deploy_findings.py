"""The findings stage in both deployments, checked without Docker or a cluster: compose runs
`tracejudge findings run` as its own service on the shared config, Prometheus scrapes it, its topic is
created, and the MLflow sink reads that topic; the Kubernetes Deployment mirrors the session stage's
(same image, own consumer group, probes, unprivileged pod) with its own ConfigMap file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from support.deploy_files import COMPOSE, K8S, load_yaml, load_yaml_documents

from tracejudge.consumer.config import load_settings
from tracejudge.consumer.runtime.arguments import METRICS_PORTS
from tracejudge.consumer.stages.findings import DEFAULT_GROUP, plan_findings
from tracejudge.consumer.stages.sink import plan_sink

FINDINGS = "tracejudge-findings"
CONFIG = "/etc/tracejudge/config.yaml"
OTHER_GROUPS = {"tracejudge", "tracejudge-sessions", "tracejudge-sink-mlflow", "tracejudge-sink-otlp"}


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("TRACEJUDGE_", "MLFLOW_"))}


def check_config(path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", *command, "--config",
                           str(path), "--check-config"], capture_output=True, text=True, timeout=60,
                          env=clean_env())


# --- docker compose ---------------------------------------------------------------------------------------

def services() -> dict[str, Any]:
    return load_yaml(COMPOSE / "compose.yaml")["services"]


def compose_config_path(service: str) -> Path:
    mounts = [v.split(":")[:2] for v in services()[service]["volumes"]]
    (source,) = [src for src, dst in mounts if dst == CONFIG]
    return (COMPOSE / source).resolve()


def test_compose_runs_the_findings_stage_from_the_evaluators_image_on_the_shared_config() -> None:
    svc, evaluator = services()[FINDINGS], services()["tracejudge"]
    assert svc["image"] == evaluator["image"] and svc["build"] == evaluator["build"]
    assert svc["entrypoint"] == ["tracejudge", "findings", "run"]
    assert svc["command"] == ["--config", CONFIG]
    assert compose_config_path(FINDINGS) == compose_config_path("tracejudge")
    assert svc["depends_on"]["kafka-init"] == {"condition": "service_completed_successfully"}
    assert svc["restart"] == "unless-stopped"
    settings = load_settings(compose_config_path(FINDINGS), environ={})
    assert int(svc["stop_grace_period"].removesuffix("s")) >= settings.stream.shutdown_grace_seconds + 10


def test_compose_findings_stage_joins_its_own_group_and_writes_a_created_topic() -> None:
    settings = load_settings(compose_config_path(FINDINGS), environ={})
    plan = plan_findings(settings)
    assert plan.input_topic == settings.stream.results_topic
    assert plan.group_id == DEFAULT_GROUP == FINDINGS and plan.group_id not in OTHER_GROUPS
    assert settings.findings.group_id is None  # the shared file names no group: each stage its default
    created = services()["kafka-init"]["environment"]["TOPICS"].split()
    assert plan.findings_topic in created
    others = {settings.stream.results_topic, settings.stream.dead_letter_topic,
              settings.sessions.results_topic, settings.sessions.dead_letter_topic}
    assert plan.findings_topic not in others


def test_compose_findings_stage_accepts_the_config() -> None:
    check = check_config(compose_config_path(FINDINGS), "findings", "run")
    assert check.returncode == 0, check.stderr
    assert f'findings.group_id (effective) = "{FINDINGS}"' in check.stdout


def test_compose_mlflow_sink_reads_the_findings_topic() -> None:
    settings = load_settings(compose_config_path("tracejudge-sink-mlflow"), environ={}, require_topics=False)
    assert plan_sink(settings, "mlflow").findings_topic == plan_findings(settings).findings_topic is not None


def test_prometheus_scrapes_the_findings_stage_on_its_default_host_port() -> None:
    jobs = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in load_yaml(COMPOSE / "prometheus.yml")["scrape_configs"]}
    port = load_settings(compose_config_path(FINDINGS), environ={}).http.port
    assert jobs[FINDINGS] == [f"{FINDINGS}:{port}"]
    (published,) = services()[FINDINGS]["ports"]
    assert published == f"{METRICS_PORTS['findings']}:{port}"


def test_compose_reads_the_demo_agents_version_tag() -> None:
    """The agent service produces MLflow traces tagged `app_version` to a topic the evaluator reads:
    with `stream.version_tag` naming it, each result's version is the demo's release."""
    from tracejudge.consumer.demo.agent import VERSION_TAG

    settings = load_settings(compose_config_path("tracejudge"), environ={})
    assert settings.stream.version_tag == VERSION_TAG
    args = services()["agent"]["command"]
    topic = args[args.index("--topic") + 1]
    assert topic in {t.name for t in settings.stream.topics}


# --- Kubernetes ---------------------------------------------------------------------------------------------

def k8s_documents() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in load_yaml_documents(path)]


def deployment(name: str) -> dict[str, Any]:
    (only,) = [d for d in k8s_documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
    return only


def configmap_file(key: str, tmp_path: Path) -> Path:
    (cm,) = [d for d in k8s_documents() if d["kind"] == "ConfigMap"]
    path = tmp_path / key
    path.write_text(cm["data"][key])
    return path


def test_k8s_findings_deployment_mirrors_the_session_stage() -> None:
    pod, sessions = deployment(FINDINGS)["spec"]["template"]["spec"], \
        deployment("tracejudge-sessions")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    (s,) = sessions["containers"]
    assert c["image"] == s["image"]
    assert c["command"] == ["tracejudge", "findings", "run"] and c["args"] == ["--config", CONFIG]
    assert pod["securityContext"] == sessions["securityContext"]
    assert c["securityContext"] == s["securityContext"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == s[probe]["httpGet"], probe
    assert c["ports"] == s["ports"]
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert volume["configMap"]["items"] == [{"key": "findings.yaml", "path": "config.yaml"}]
    assert not any("secret" in v for v in pod["volumes"])  # no judge key: it calls no model by default
    assert deployment(FINDINGS)["spec"]["replicas"] == 1


def test_k8s_findings_config_passes_check_config_with_its_own_group(tmp_path: Path) -> None:
    path = configmap_file("findings.yaml", tmp_path)
    check = check_config(path, "findings", "run")
    assert check.returncode == 0, check.stderr
    settings = load_settings(path, environ={}, require_topics=False)
    (c,) = deployment(FINDINGS)["spec"]["template"]["spec"]["containers"]
    assert settings.http.port == c["ports"][0]["containerPort"]
    plan = plan_findings(settings)
    assert plan.group_id == FINDINGS and plan.group_id not in OTHER_GROUPS
    evaluator = yaml.safe_load(configmap_file("config.yaml", tmp_path).read_text())
    assert plan.input_topic == evaluator["stream"]["results_topic"]
    assert settings.kafka.bootstrap_servers == evaluator["kafka"]["bootstrap_servers"]


def test_k8s_mlflow_sink_reads_the_findings_topic(tmp_path: Path) -> None:
    findings = plan_findings(load_settings(configmap_file("findings.yaml", tmp_path), environ={},
                                           require_topics=False))
    sink = plan_sink(load_settings(configmap_file("sink-mlflow.yaml", tmp_path), environ={},
                                   require_topics=False), "mlflow")
    assert findings.findings_topic is not None and sink.findings_topic == findings.findings_topic


def test_k8s_findings_pods_are_applied_and_scraped() -> None:
    assert "findings-deployment.yaml" in load_yaml(K8S / "kustomization.yaml")["resources"]
    (monitor,) = [d for d in k8s_documents() if d["kind"] == "PodMonitor"]
    spec = deployment(FINDINGS)["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (c,) = spec["template"]["spec"]["containers"]
    assert endpoint["port"] == c["ports"][0]["name"] and endpoint["path"] == "/metrics"
    # KEDA scales the evaluator only: one findings replica is one view of each app and judge.
    (scaled,) = [d for d in k8s_documents() if d["kind"] == "ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] != FINDINGS
