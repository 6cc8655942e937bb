"""The metrics reference, generated from the registered Prometheus series (`docs/hooks/reference.py` puts
it in docs/pages/reference/metrics.md at build time).

Each process that serves /metrics builds its series with a few constructors (the metric owners:
`PrometheusExporter`, `JudgeMetrics`, `SinkMetrics`, ...). `OWNERS` calls the same constructors on a
fresh `CollectorRegistry` per process, each with the condition under which the process makes it, and the
reference lists every family found on those registries: its name as exposed (counters with `_total`), type,
help text, label names, the label values exported from the start (closed sets the code declares), and the
commands that export it. Names, help and labels come from the registries, never from a list here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

__all__ = ["COMMANDS", "Family", "collect", "families", "render"]

# A label value passed for a name the configuration gives (a collection's, a judge's): not a value set.
PLACEHOLDER = "<name>"
# Labels whose value is the name of the command's own variant (`tracejudge sink <kind>`): not a value set.
NAMED_LABELS = frozenset({"sink"})


@dataclass
class Family:
    """One metric family as a process exposes it."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...]
    values: dict[str, set[str]] = field(default_factory=dict)  # label -> values exported from the start
    commands: dict[str, str] = field(default_factory=dict)  # command -> condition ("" when always)


# --- the processes' constructors ------------------------------------------------------------------


def _run(r: CollectorRegistry) -> Iterator[tuple[str, Any]]:
    from tracejudge.metrics.cost import JudgeCostMetrics
    from tracejudge.metrics.judges.fleet_spend import FleetSpendMetrics
    from tracejudge.metrics.judges.redaction import RedactionMetrics
    from tracejudge.metrics.judges.series import JudgeMetrics
    from tracejudge.metrics.signals import AppNorms, SignalsConfig
    from tracejudge.metrics.telemetry.assembly import AssemblyMetrics
    from tracejudge.metrics.telemetry.collections import CollectionMetrics
    from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
    from tracejudge.metrics.telemetry.external import ExternalEvaluations
    from tracejudge.metrics.telemetry.trust import TrustMetrics

    exporter = PrometheusExporter(r)
    yield "", exporter
    exporter.signals.watch(AppNorms(SignalsConfig()))
    yield "`metrics.signals` on (the default)", exporter.signals
    judges = JudgeMetrics(r, exporter.apps)
    yield "with judges, or with other evaluators' verdicts", judges
    yield "with judges", JudgeCostMetrics(r)
    yield "with judges and `judges.redaction` on (the default)", RedactionMetrics(r)
    yield "with `judges.fleet_spend`", FleetSpendMetrics(r)
    yield "with judges", TrustMetrics(r, exporter.apps)
    yield "with an OTLP topic (`otlp_*` formats)", AssemblyMetrics(r)
    yield "with a logs topic and `stream.external_evaluations.enabled`", ExternalEvaluations(
        r, judges, thresholds={}, max_evaluators=10, max_names=10)
    yield "with `collections:` rules", CollectionMetrics(r, [PLACEHOLDER])


def _sink(kind: str) -> Callable[[CollectorRegistry], Iterator[tuple[str, Any]]]:
    def build(r: CollectorRegistry) -> Iterator[tuple[str, Any]]:
        from tracejudge.consumer.config.sink import BUILTIN_SINKS
        from tracejudge.consumer.stages.sink import sink_settings_type
        from tracejudge.metrics.plugins import load_plugin
        from tracejudge.metrics.telemetry.sinks import SinkMetrics

        cls = load_plugin(BUILTIN_SINKS[kind], key=f"sink.{kind}", noun="sink class")
        section = {"mlflow": {"tracking_uri": "http://127.0.0.1:9"},
                   "phoenix": {"endpoint": "http://127.0.0.1:9"}}.get(kind, {})
        settings = sink_settings_type(cls).from_mapping(section, f"sink.{kind}", env={})
        sink = cls(settings, r)  # no connection: `setup` is not called
        try:
            yield "", sink
        finally:
            sink.close()
        yield "", SinkMetrics(r, kind)
    return build


def _sessions(r: CollectorRegistry) -> Iterator[tuple[str, Any]]:
    from tracejudge.metrics.cost import JudgeCostMetrics
    from tracejudge.metrics.judges.fleet_spend import FleetSpendMetrics
    from tracejudge.metrics.judges.redaction import RedactionMetrics
    from tracejudge.metrics.judges.sessions import SessionJudgeMetrics
    from tracejudge.metrics.telemetry.sessions import SessionMetrics

    metrics = SessionMetrics(r)
    yield "", metrics
    yield "", SessionJudgeMetrics(r, metrics.apps)
    yield "with judges", JudgeCostMetrics(r)
    yield "with judges and `judges.redaction` on (the default)", RedactionMetrics(r)
    yield "with `judges.fleet_spend`", FleetSpendMetrics(r)


def _embedded_sessions(r: CollectorRegistry) -> Iterator[tuple[str, Any]]:
    from tracejudge.metrics.judges.sessions import SessionJudgeMetrics

    # `SessionJudgeRunner` without the stage's app limiter: the session judges' own app cap.
    yield "", SessionJudgeMetrics(r)


def _agreement(r: CollectorRegistry) -> Iterator[tuple[str, Any]]:
    from tracejudge.metrics.telemetry.agreement import AgreementMetrics

    yield "", AgreementMetrics(r, max_apps=100, judges=None)


def _backfill(r: CollectorRegistry) -> Iterator[tuple[str, Any]]:
    from tracejudge.metrics.telemetry.backfill import BackfillProgress, ProgressSnapshot

    progress = BackfillProgress(ProgressSnapshot)
    r.register(progress)
    yield "`http.enabled` (the default)", progress


def _findings(r: CollectorRegistry) -> Iterator[tuple[str, Any]]:
    from tracejudge.metrics.cost import JudgeCostMetrics
    from tracejudge.metrics.judges.redaction import RedactionMetrics
    from tracejudge.metrics.telemetry.findings import FindingsMetrics

    yield "", FindingsMetrics(r)
    yield "with `findings.clustering.embeddings` or `name_with`", JudgeCostMetrics(r)
    yield "with `findings.clustering.embeddings` or `name_with`", RedactionMetrics(r)


# Each process serving /metrics, and how it builds its series.
COMMANDS: dict[str, Callable[[CollectorRegistry], Iterator[tuple[str, Any]]]] = {
    "tracejudge run": _run,
    "tracejudge sink mlflow": _sink("mlflow"),
    "tracejudge sink otlp": _sink("otlp"),
    "tracejudge sink phoenix": _sink("phoenix"),
    "tracejudge sessions": _sessions,
    "tracejudge agreement": _agreement,
    "tracejudge backfill": _backfill,
    "tracejudge findings run": _findings,
    # Not a command: the session judges embedded (`tracejudge.api.sessions`), on the caller's registry.
    "the session judges embedded (tracejudge.api)": _embedded_sessions,
}


# --- what a registry holds ------------------------------------------------------------------------


def _collectors(registry: CollectorRegistry) -> list[Any]:
    # prometheus_client keeps no public list of a registry's collectors.
    return list(registry._collector_to_names)


def collect(registry: CollectorRegistry) -> dict[str, Family]:
    """Every family registered on `registry`, by its exposed name."""
    out: dict[str, Family] = {}
    for collector in _collectors(registry):
        for metric in collector.collect():
            if isinstance(collector, MetricWrapperBase):
                labels = tuple(collector._labelnames)
            else:
                labels = tuple(getattr(metric, "_labelnames", ()) or
                               dict.fromkeys(k for s in metric.samples for k in s.labels))
            name = metric.name + ("_total" if metric.type == "counter" else "")
            family = Family(name, metric.type, metric.documentation, labels)
            for sample in metric.samples:
                for label, value in sample.labels.items():
                    if label in labels and value != PLACEHOLDER and label not in NAMED_LABELS:
                        family.values.setdefault(label, set()).add(value)
            out[name] = family
    return out


def families() -> dict[str, Family]:
    """Every family of every process, with the commands that export it and on what condition (that of
    the constructor that made it)."""
    out: dict[str, Family] = {}
    for command, build in COMMANDS.items():
        registry = CollectorRegistry()
        conditions: dict[str, str] = {}
        for condition, _owner in build(registry):
            for name in collect(registry):
                conditions.setdefault(name, condition)
        for name, family in collect(registry).items():
            found = out.setdefault(name, family)
            for label, values in family.values.items():
                found.values.setdefault(label, set()).update(values)
            found.commands[command] = conditions.get(name, "")
    return dict(sorted(out.items()))


# --- the page -------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def _command(command: str) -> str:
    return f"`{command}`" if command.startswith("tracejudge ") else command


def _exposed(family: Family) -> str:
    if family.type == "histogram":
        return " (`_bucket`, `_sum`, `_count`)"
    if family.type == "summary":
        return " (`_sum`, `_count`)"
    return ""


def render() -> str:
    """The reference as Markdown: one table of every family, then one line per command."""
    found = families()
    out = ["| Metric | Type | Labels | Exported by | Help |", "|---|---|---|---|---|"]
    for family in found.values():
        labels = []
        for label in family.labels:
            values = family.values.get(label)
            shown = ", ".join(f"`{v}`" for v in sorted(values or ()))
            labels.append(f"`{label}`" + (f" (from the start: {shown})" if values else ""))
        commands = []
        for command, condition in family.commands.items():
            commands.append(_command(command) + (f" ({condition})" if condition else ""))
        out.append(f"| `{family.name}` | {family.type}{_exposed(family)} | {', '.join(labels) or '—'} | "
                   f"{_cell('; '.join(commands))} | {_cell(family.help)} |")
    out.append("")
    out.append("Families by command:\n")
    for command in COMMANDS:
        names = [f"`{n}`" for n, f in found.items() if command in f.commands]
        out.append(f"- {_command(command)} ({len(names)}): {', '.join(names)}")
    out.append("")
    return "\n".join(out)
