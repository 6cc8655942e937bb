"""The metric names the dashboards and alert rules query are the ones tracejudge really exports."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from support.deploy_files import (
    FINDINGS_METRICS,
    FLEET_SPEND_METRICS,
    RUN_METRICS,
    SESSION_JUDGE_METRICS,
    SESSION_STAGE_METRICS,
    SINK_METRICS,
)

from tracejudge.metrics.cost import JudgeCostMetrics
from tracejudge.metrics.judges.series import JudgeMetrics
from tracejudge.metrics.telemetry.assembly import AssemblyMetrics
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.metrics.telemetry.trust import TrustMetrics


def families(*owners: object) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name (counters with `_total`) -> (type, label names) of every family the owners registered."""
    out = {}
    for owner in owners:
        for metric in vars(owner).values():
            if isinstance(metric, MetricWrapperBase):
                name = metric._name + ("_total" if metric._type == "counter" else "")
                out[name] = (metric._type, tuple(metric._labelnames))
    return out


def exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    registry = CollectorRegistry()
    return families(PrometheusExporter(registry), JudgeMetrics(registry), AssemblyMetrics(registry),
                    TrustMetrics(registry), JudgeCostMetrics(registry))


def test_every_contract_metric_is_exported_with_its_labels() -> None:
    real = exported()
    for name, family in RUN_METRICS.items():
        assert name in real, f"{name} is queried by the dashboards/rules but not exported"
        assert real[name] == (family.type, family.labels), f"{name}: exported as {real[name]}"


def sink_families() -> dict[str, dict[str, tuple[str, tuple[str, ...]]]]:
    """Per sink kind, the families its class registers (no connection is made: `setup` is not called)."""
    from tracejudge.consumer.sinks.mlflow import MlflowSink, MlflowSinkSettings
    from tracejudge.consumer.sinks.otlp import OtlpSink, OtlpSinkSettings

    out = {}
    for kind, sink in (
        ("mlflow", MlflowSink(MlflowSinkSettings.from_mapping({"tracking_uri": "http://127.0.0.1:9"}, env={}),
                              CollectorRegistry())),
        ("otlp", OtlpSink(OtlpSinkSettings.from_mapping({}, env={}), CollectorRegistry())),
    ):
        try:
            out[kind] = families(sink)
        finally:
            sink.close()
    return out


def test_each_sink_exports_its_contract_metrics_with_their_labels() -> None:
    # The runtime side (lag, batches, dead letters) is exported by the sink runtime, not the sink.
    own = {"tracejudge_sink_writes_total", "tracejudge_sink_skipped_total", "tracejudge_sink_retries_total"}
    for kind, real in sink_families().items():
        for name in own:
            family = SINK_METRICS[name]
            assert name in real, f"sink {kind} does not export {name}"
            assert real[name] == (family.type, family.labels), f"{kind}: {name} exported as {real[name]}"


def test_the_sink_runtime_exports_lag_batches_and_dead_letters_with_their_labels() -> None:
    from tracejudge.metrics.telemetry.sinks import SinkMetrics

    real = families(SinkMetrics(CollectorRegistry(), "mlflow"))
    for name in ("tracejudge_sink_lag_records", "tracejudge_sink_batches_total",
                 "tracejudge_sink_dead_letters_total", "tracejudge_sink_parked_records",
                 "tracejudge_sink_parked_total", "tracejudge_sink_parked_retries_total",
                 "tracejudge_sink_park_full_total", "tracejudge_sink_given_up_total"):
        family = SINK_METRICS[name]
        assert name in real, f"the sink runtime does not export {name}"
        assert real[name] == (family.type, family.labels), f"{name}: exported as {real[name]}"


def test_every_sink_contract_metric_has_an_exporter() -> None:
    from tracejudge.metrics.telemetry.sinks import SinkMetrics

    runtime = families(SinkMetrics(CollectorRegistry(), "otlp"))
    for kind, real in sink_families().items():
        assert set(SINK_METRICS) <= set(real) | set(runtime), kind


def test_the_session_stage_exports_its_contract_metrics_with_their_labels() -> None:
    from tracejudge.metrics.telemetry.sessions import SessionMetrics

    real = families(SessionMetrics(CollectorRegistry()))
    for name, family in SESSION_STAGE_METRICS.items():
        assert name in real, f"{name} is queried by the dashboards/rules but not exported"
        assert real[name] == (family.type, family.labels), f"{name}: exported as {real[name]}"


def test_the_session_judges_export_their_contract_metrics_with_their_labels() -> None:
    from tracejudge.metrics.judges.sessions import SessionJudgeMetrics

    real = families(SessionJudgeMetrics(CollectorRegistry()))
    for name, family in SESSION_JUDGE_METRICS.items():
        assert name in real, f"{name} is queried by the dashboards/rules but not exported"
        assert real[name] == (family.type, family.labels), f"{name}: exported as {real[name]}"


def test_user_frustration_verdicts_carry_the_values_the_alert_counts() -> None:
    """UserFrustrationRising counts verdict="unresolved" of judge="user_frustration"; the dashboards
    count "fail" and "unresolved" as not passed."""
    from tracejudge.metrics.judges.sessions import SessionJudgeMetrics
    from tracejudge.schemas.result import Assessment

    registry = CollectorRegistry()
    metrics = SessionJudgeMetrics(registry)
    for value, score in (("none", 1.0), ("resolved", 0.5), ("unresolved", 0.0)):
        assessment = Assessment(name="user_frustration", value=value, score=score,
                                passed=value != "unresolved")
        metrics.observe_session_verdict("shop", "user_frustration", assessment, "conv-1")
    metrics.observe_session_verdict("shop", "conversation_completeness",
                                    Assessment(name="conversation_completeness", value="no", passed=False),
                                    "conv-1")
    sample = registry.get_sample_value
    for value in ("none", "resolved", "unresolved"):
        assert sample("tracejudge_session_judge_verdicts_total",
                      {"app": "shop", "judge": "user_frustration", "verdict": value}) == 1
    assert sample("tracejudge_session_judge_verdicts_total",
                  {"app": "shop", "judge": "conversation_completeness", "verdict": "fail"}) == 1
    # The exemplar label the Grafana datasource links to the session view (`session_id`).
    exemplars = [s.exemplar for m in registry.collect() if m.name == "tracejudge_session_judge_score"
                 for s in m.samples if s.exemplar is not None]
    assert exemplars and {e.labels["session_id"] for e in exemplars} == {"conv-1"}


def test_the_findings_stage_and_fleet_spend_export_their_contract_metrics_with_their_labels() -> None:
    """The quality dashboard's findings table and fleet-spend panel read these."""
    from tracejudge.metrics.judges.fleet_spend import FleetSpendMetrics
    from tracejudge.metrics.telemetry.findings import FindingsMetrics

    for owner, contract in ((FindingsMetrics(CollectorRegistry()), FINDINGS_METRICS),
                            (FleetSpendMetrics(CollectorRegistry()), FLEET_SPEND_METRICS)):
        real = families(owner)
        for name, family in contract.items():
            assert name in real, f"{name} is queried by the dashboards but not exported"
            assert real[name] == (family.type, family.labels), f"{name}: exported as {real[name]}"
