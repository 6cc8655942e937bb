"""The Kubernetes manifests: schema-valid, and consistent with each other and with tracejudge's config.

Core kinds are validated offline against the Kubernetes OpenAPI schemas bundled in
`kubernetes-validate` (strict: unknown fields fail). The CRDs (PodMonitor, PrometheusRule,
ScaledObject) have no bundled schema, so the fields these manifests use are described below in JSON
Schema, closed with `additionalProperties: false` so a misspelt field fails here, not in the cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.deploy_files import K8S, load_yaml, load_yaml_documents

KUBERNETES_VERSIONS = ["1.29", kubernetes_validate.latest_version()]
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


EVALUATOR, SINK, SESSIONS = "tracejudge", "tracejudge-sink-mlflow", "tracejudge-sessions"


def documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in load_yaml_documents(path)]


def resources() -> dict[str, dict[str, Any]]:
    """One resource per kind; for Deployments, the evaluator's (the sink's: `sink_deployment()`)."""
    return {doc["kind"]: doc for doc in documents()
            if doc["kind"] != "Deployment" or doc["metadata"]["name"] == EVALUATOR}


def deployments() -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in documents() if doc["kind"] == "Deployment"}


def sink_deployment() -> dict[str, Any]:
    return deployments()[SINK]


def closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


STRING = {"type": "string"}
INT = {"type": "integer"}
LABELS = {"type": "object", "additionalProperties": STRING}
METADATA = closed({"name": STRING, "namespace": STRING, "labels": LABELS, "annotations": LABELS},
                  ("name", "namespace"))
SELECTOR = closed({"matchLabels": LABELS, "matchExpressions": {"type": "array"}})
DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                         r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
RULE = closed({"record": STRING, "alert": STRING, "expr": STRING, "for": DURATION,
               "keep_firing_for": DURATION, "labels": LABELS, "annotations": LABELS}, ("expr",))

CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    # monitoring.coreos.com/v1 PodMonitor (prometheus-operator podmonitor_types.go)
    "PodMonitor": closed({
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
        "metadata": METADATA,
        "spec": closed({
            "selector": SELECTOR,
            "namespaceSelector": closed({"any": {"type": "boolean"}, "matchNames": {"type": "array"}}),
            "jobLabel": STRING, "podTargetLabels": {"type": "array", "items": STRING},
            "sampleLimit": INT, "targetLimit": INT, "labelLimit": INT,
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": closed({
                "port": STRING, "portNumber": INT, "path": STRING, "scheme": {"enum": ["http", "https"]},
                "interval": DURATION, "scrapeTimeout": DURATION, "honorLabels": {"type": "boolean"},
                "honorTimestamps": {"type": "boolean"}, "relabelings": {"type": "array"},
                "metricRelabelings": {"type": "array"}, "params": {"type": "object"}})},
        }, ("selector", "podMetricsEndpoints")),
    }, ("apiVersion", "kind", "metadata", "spec")),
    # monitoring.coreos.com/v1 PrometheusRule
    "PrometheusRule": closed({
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": METADATA,
        "spec": closed({"groups": {"type": "array", "minItems": 1, "items": closed({
            "name": STRING, "interval": DURATION, "limit": INT, "query_offset": DURATION,
            "rules": {"type": "array", "items": RULE}}, ("name", "rules"))}}, ("groups",)),
    }, ("apiVersion", "kind", "metadata", "spec")),
    # keda.sh/v1alpha1 ScaledObject (keda scaledobject_types.go); trigger metadata is map[string]string.
    "ScaledObject": closed({
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": METADATA,
        "spec": closed({
            "scaleTargetRef": closed({"apiVersion": STRING, "kind": STRING, "name": STRING,
                                      "envSourceContainerName": STRING}, ("name",)),
            "pollingInterval": INT, "cooldownPeriod": INT, "initialCooldownPeriod": INT,
            "idleReplicaCount": INT, "minReplicaCount": INT, "maxReplicaCount": INT,
            "fallback": {"type": "object"},
            "advanced": closed({
                "restoreToOriginalReplicaCount": {"type": "boolean"},
                "scalingModifiers": {"type": "object"},
                "horizontalPodAutoscalerConfig": closed({"name": STRING, "behavior": closed({
                    direction: closed({
                        "stabilizationWindowSeconds": INT, "selectPolicy": STRING,
                        "policies": {"type": "array", "items": closed({
                            "type": {"enum": ["Pods", "Percent"]}, "value": INT, "periodSeconds": INT},
                            ("type", "value", "periodSeconds"))}})
                    for direction in ("scaleUp", "scaleDown")})})}),
            "triggers": {"type": "array", "minItems": 1, "items": closed({
                "type": STRING, "name": STRING, "useCachedMetrics": {"type": "boolean"},
                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                "metadata": {"type": "object", "additionalProperties": STRING},
                "authenticationRef": closed({"name": STRING, "kind": STRING}, ("name",))},
                ("type", "metadata"))},
        }, ("scaleTargetRef", "triggers")),
    }, ("apiVersion", "kind", "metadata", "spec")),
}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_schema_valid(path: Path, version: str) -> None:
    for doc in load_yaml_documents(path):
        if doc["kind"] in CRD_SCHEMAS:
            jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def test_crd_schemas_reject_a_misspelt_field() -> None:
    scaled = resources()["ScaledObject"]
    broken = {**scaled, "spec": {**scaled["spec"], "maxReplicas": 6}}
    with pytest.raises(jsonschema.ValidationError, match="maxReplicas"):
        jsonschema.validate(broken, CRD_SCHEMAS["ScaledObject"])


def test_strict_core_validation_rejects_a_misspelt_field() -> None:
    deployment = yaml.safe_load(yaml.safe_dump(resources()["Deployment"]))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)


def test_everything_lives_in_one_namespace() -> None:
    namespaces = {doc["metadata"].get("namespace") for doc in documents() if doc["kind"] != "Namespace"}
    assert namespaces == {resources()["Namespace"]["metadata"]["name"]}


def config() -> dict[str, Any]:
    return yaml.safe_load(resources()["ConfigMap"]["data"]["config.yaml"])


def pod_spec() -> dict[str, Any]:
    return resources()["Deployment"]["spec"]["template"]["spec"]


def container() -> dict[str, Any]:
    (only,) = pod_spec()["containers"]
    return only


def test_graceful_drain_fits_in_the_termination_grace_period() -> None:
    drain = config()["stream"]["shutdown_grace_seconds"]
    assert drain >= 30
    # The drain, then the final commit and producer flush, must finish before the kubelet's SIGKILL.
    assert pod_spec()["terminationGracePeriodSeconds"] >= drain + 10


def test_probes_and_metrics_port() -> None:
    c = container()
    (port,) = c["ports"]
    assert port == {"name": "metrics", "containerPort": config()["http"]["port"], "protocol": "TCP"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert c["args"] == ["--config", "/etc/tracejudge/config.yaml"]


def test_pod_runs_unprivileged_with_resources() -> None:
    pod, c = pod_spec(), container()
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    # A read-only root still needs a writable /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_judge_key_comes_from_a_secret_never_from_the_configmap() -> None:
    endpoint = config()["judges"]["endpoints"]["default"]
    key_file = Path(endpoint["api_key_file"])
    mount = next(m for m in container()["volumeMounts"] if m["name"] == "judge-api-key")
    assert key_file.parent == Path(mount["mountPath"]) and mount["readOnly"] is True
    volume = next(v for v in pod_spec()["volumes"] if v["name"] == "judge-api-key")
    assert volume["secret"]["secretName"] == "tracejudge-judge-api-key"
    assert not {"api_key", "key", "token"} & set(endpoint), "a literal key in the ConfigMap"


def test_configmap_config_passes_tracejudge_check_config(tmp_path: Path) -> None:
    from tracejudge.consumer.config import load_settings

    path = tmp_path / "config.yaml"
    path.write_text(resources()["ConfigMap"]["data"]["config.yaml"])
    check = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "run", "--config",
                            str(path),
                            "--check-config"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")})
    assert check.returncode == 0, check.stderr
    settings = load_settings(path, environ={})
    assert settings.http.port == container()["ports"][0]["containerPort"]
    assert settings.judges is not None and settings.judges.endpoints["default"].api_key_file


@pytest.mark.parametrize("name", [EVALUATOR, SINK, SESSIONS])
def test_podmonitor_scrapes_the_deployment_pods(name: str) -> None:
    monitor, deployment = resources()["PodMonitor"], deployments()[name]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    assert endpoint["port"] == only["ports"][0]["name"] and endpoint["path"] == "/metrics"


def test_deployment_selectors_do_not_overlap() -> None:
    # Two Deployments selecting each other's pods would fight over them.
    for name, deployment in deployments().items():
        selector = deployment["spec"]["selector"]["matchLabels"].items()
        for other_name, other in deployments().items():
            if other_name != name:
                assert not selector <= other["spec"]["template"]["metadata"]["labels"].items(), \
                    f"{name} selects the pods of {other_name}"


def test_keda_scales_the_deployment_on_the_consumer_groups_lag() -> None:
    scaled, deployment, cfg = resources()["ScaledObject"], resources()["Deployment"], config()
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert spec["minReplicaCount"] >= 1
    assert spec["minReplicaCount"] <= deployment["spec"]["replicas"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "kafka"
    assert meta["consumerGroup"] == cfg["kafka"]["group_id"]
    assert meta["topic"] in {t["name"] for t in cfg["stream"]["topics"]}
    assert meta["offsetResetPolicy"] == cfg["kafka"]["auto_offset_reset"]
    assert meta["bootstrapServers"] == ",".join(cfg["kafka"]["bootstrap_servers"])
    # Capped at the partition count: more replicas than partitions would sit idle.
    assert meta["allowIdleConsumers"] == "false"
    assert int(meta["lagThreshold"]) > 0
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert behavior["stabilizationWindowSeconds"] >= 300, "every scale step is a rebalance: damp scale-down"


# --- the MLflow sink ------------------------------------------------------------------------------------

def sink_config() -> dict[str, Any]:
    return yaml.safe_load(resources()["ConfigMap"]["data"]["sink-mlflow.yaml"])


def sink_container() -> dict[str, Any]:
    (only,) = sink_deployment()["spec"]["template"]["spec"]["containers"]
    return only


def test_sink_runs_the_evaluators_image_as_tracejudge_sink_mlflow() -> None:
    c = sink_container()
    assert c["image"] == container()["image"]
    assert c["command"] == ["tracejudge", "sink", "mlflow"]
    assert c["args"] == ["--config", "/etc/tracejudge/config.yaml"]
    volumes = sink_deployment()["spec"]["template"]["spec"]["volumes"]
    volume = next(v for v in volumes if v["name"] == "config")
    assert volume["configMap"] == {"name": resources()["ConfigMap"]["metadata"]["name"],
                                   "items": [{"key": "sink-mlflow.yaml", "path": "config.yaml"}]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    assert mount == {"name": "config", "mountPath": "/etc/tracejudge", "readOnly": True}


def test_sink_probes_metrics_port_and_drain() -> None:
    c = sink_container()
    (port,) = c["ports"]
    assert port == {"name": "metrics", "containerPort": sink_config()["http"]["port"], "protocol": "TCP"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert sink_deployment()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 40


def test_sink_pod_runs_as_unprivileged_as_the_evaluator() -> None:
    pod = sink_deployment()["spec"]["template"]["spec"]
    assert pod["securityContext"] == pod_spec()["securityContext"]
    assert pod["automountServiceAccountToken"] is False
    c = sink_container()
    assert c["securityContext"] == container()["securityContext"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_sink_reads_the_evaluators_results_as_its_own_group() -> None:
    sink, evaluator = sink_config(), config()
    assert sink["kafka"]["bootstrap_servers"] == evaluator["kafka"]["bootstrap_servers"]
    assert sink["sink"]["group_id"] == SINK != evaluator["kafka"]["group_id"]
    assert sink["sink"]["results_topic"] == evaluator["stream"]["results_topic"]
    assert sink["sink"]["dead_letter_topic"] not in {evaluator["stream"]["results_topic"],
                                                     evaluator["stream"]["dead_letter_topic"]}
    assert "judges" not in sink, "the sink pod has no judge key and needs no judge configuration"


def test_mlflow_credentials_come_from_a_secret_through_the_environment() -> None:
    env = {e["name"]: e for e in sink_container()["env"]}
    for name in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "tracejudge-mlflow-auth" and ref["optional"] is True, name
        assert "value" not in env[name]
    mlflow = sink_config()["sink"]["mlflow"]
    assert httpx.URL(mlflow["tracking_uri"]).scheme in ("http", "https")
    assert not {"token", "username", "password"} & set(mlflow), "a literal credential in the ConfigMap"
    text = resources()["ConfigMap"]["data"]["sink-mlflow.yaml"]
    assert "MLFLOW_TRACKING_TOKEN" in text  # says where the token comes from


def test_keda_scales_only_the_evaluator() -> None:
    assert resources()["ScaledObject"]["spec"]["scaleTargetRef"]["name"] == EVALUATOR


def test_sink_config_passes_tracejudge_sink_check_config(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(resources()["ConfigMap"]["data"]["sink-mlflow.yaml"])
    check = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "sink", "mlflow",
                            "--config",
                            str(path), "--check-config"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items()
                                if not k.startswith(("TRACEJUDGE_", "MLFLOW_"))})
    assert check.returncode == 0, check.stderr



# --- the session stage ----------------------------------------------------------------------------------

def sessions_config() -> dict[str, Any]:
    return yaml.safe_load(resources()["ConfigMap"]["data"]["sessions.yaml"])


def sessions_pod() -> dict[str, Any]:
    return deployments()[SESSIONS]["spec"]["template"]["spec"]


def sessions_container() -> dict[str, Any]:
    (only,) = sessions_pod()["containers"]
    return only


def mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_sessions_runs_the_evaluators_image_as_tracejudge_sessions() -> None:
    c = sessions_container()
    assert c["image"] == container()["image"]
    assert c["command"] == ["tracejudge", "sessions"]
    assert c["args"] == ["--config", "/etc/tracejudge/config.yaml"]
    volume = next(v for v in sessions_pod()["volumes"] if v["name"] == "config")
    assert volume["configMap"] == {"name": resources()["ConfigMap"]["metadata"]["name"],
                                   "items": [{"key": "sessions.yaml", "path": "config.yaml"}]}
    (port,) = c["ports"]
    assert port == {"name": "metrics", "containerPort": sessions_config()["http"]["port"], "protocol": "TCP"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert sessions_pod()["terminationGracePeriodSeconds"] >= 40
    assert sessions_pod()["securityContext"] == pod_spec()["securityContext"]
    assert c["securityContext"] == container()["securityContext"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]


def test_sessions_reads_the_evaluators_results_and_the_sink_writes_its_results_back() -> None:
    sessions, evaluator, sink = sessions_config(), config(), sink_config()
    assert sessions["kafka"]["bootstrap_servers"] == evaluator["kafka"]["bootstrap_servers"]
    s = sessions["sessions"]
    assert s["input_topic"] == evaluator["stream"]["results_topic"]
    assert s["results_topic"] not in {evaluator["stream"]["results_topic"], s["dead_letter_topic"]}
    assert sink["sink"]["session_results_topic"] == s["results_topic"]


def test_sessions_memory_caps_fit_the_pod() -> None:
    s = sessions_config()["sessions"]
    limit = mebibytes(sessions_container()["resources"]["limits"]["memory"])
    # The held turns are estimated, and the runtime and judges need room besides: at most half the limit.
    assert s["max_bytes_held"] / 2**20 <= limit / 2
    assert s["max_open_sessions"] <= s["max_turns_held"]


def test_sessions_judge_key_comes_from_the_same_secret() -> None:
    endpoint = sessions_config()["judges"]["endpoints"]["default"]
    key_file = Path(endpoint["api_key_file"])
    mount = next(m for m in sessions_container()["volumeMounts"] if m["name"] == "judge-api-key")
    assert key_file.parent == Path(mount["mountPath"]) and mount["readOnly"] is True
    volume = next(v for v in sessions_pod()["volumes"] if v["name"] == "judge-api-key")
    assert volume["secret"]["secretName"] == "tracejudge-judge-api-key"
    assert {"user_frustration"} <= set(sessions_config()["judges"]["sessions"])


def test_sessions_config_passes_tracejudge_sessions_check_config(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(resources()["ConfigMap"]["data"]["sessions.yaml"])
    check = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "sessions", "--config",
                            str(path), "--check-config"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")})
    assert check.returncode == 0, check.stderr
    assert 'sessions.group_id (effective) = "tracejudge-sessions"' in check.stdout
