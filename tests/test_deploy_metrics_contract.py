"""The metric names the dashboards and alert rules query are the ones tracejudge really exports."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from support.deploy_files import METRICS

from tracejudge.metrics.assembly_metrics import AssemblyMetrics
from tracejudge.metrics.judge_metrics import JudgeMetrics
from tracejudge.metrics.prometheus import PrometheusExporter


def exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name (counters with `_total`) -> (type, label names) of every family the exporters register."""
    registry = CollectorRegistry()
    families = {}
    for owner in (PrometheusExporter(registry), JudgeMetrics(registry), AssemblyMetrics(registry)):
        for metric in vars(owner).values():
            if isinstance(metric, MetricWrapperBase):
                name = metric._name + ("_total" if metric._type == "counter" else "")
                families[name] = (metric._type, tuple(metric._labelnames))
    return families


def test_every_contract_metric_is_exported_with_its_labels() -> None:
    real = exported()
    for name, family in METRICS.items():
        assert name in real, f"{name} is queried by the dashboards/rules but not exported"
        assert real[name] == (family.type, family.labels), f"{name}: exported as {real[name]}"
