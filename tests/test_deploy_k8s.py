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

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.deploy_files import K8S, load_yaml, load_yaml_documents

KUBERNETES_VERSIONS = ["1.29", kubernetes_validate.latest_version()]
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def resources() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for path in MANIFESTS for doc in load_yaml_documents(path)}


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
    namespaces = {doc["metadata"].get("namespace") for kind, doc in resources().items()
                  if kind != "Namespace"}
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
    check = subprocess.run([sys.executable, "-m", "tracejudge.consumer.cli", "run", "--config", str(path),
                            "--check-config"], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")})
    assert check.returncode == 0, check.stderr
    settings = load_settings(path, environ={})
    assert settings.http.port == container()["ports"][0]["containerPort"]
    assert settings.judges is not None and settings.judges.endpoints["default"].api_key_file


def test_podmonitor_scrapes_the_deployment_pods() -> None:
    monitor, deployment = resources()["PodMonitor"], resources()["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == container()["ports"][0]["name"] and endpoint["path"] == "/metrics"


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
