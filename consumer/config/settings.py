"""`Settings`, the whole configuration (one field per section), and its listing with every secret masked
(`Settings.redacted`, what `--check-config` and the start-up summary print) (`tracejudge.consumer.config`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr, model_validator

from tracejudge.consumer.config.alerts import AlertsSettings
from tracejudge.consumer.config.collections import CollectionRule, check_collections
from tracejudge.consumer.config.common import Section
from tracejudge.consumer.config.findings import FindingsSettings
from tracejudge.consumer.config.kafka import KafkaSettings
from tracejudge.consumer.config.sessions import AgreementSettings, SessionsSettings
from tracejudge.consumer.config.sink import SinkSettings
from tracejudge.consumer.config.slos import SloSpec, check_slos
from tracejudge.consumer.config.stream import (
    HttpSettings,
    LoggingSettings,
    OtlpSettings,
    ProducerSettings,
    PrometheusSettings,
    StreamSettings,
    TopicSpec,
)
from tracejudge.metrics.computed import MetricsConfig
from tracejudge.metrics.judges.config import JudgesConfig
from tracejudge.metrics.judges.secrets import MASK, OPAQUE, SECRET, redact_url, shown

__all__ = ["Settings"]


class Settings(Section):
    """The whole configuration: one field per section of the file."""

    # The connection to Kafka, the consumer group and security, for every command that reads or writes topics.
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    # What `tracejudge run` consumes, where its results and dead letters go, and the runner's limits.
    stream: StreamSettings = Field(default_factory=StreamSettings)
    # The producer that publishes results, dead letters and findings.
    producer: ProducerSettings = Field(default_factory=ProducerSettings)
    # The /metrics, /healthz and /readyz endpoint of each long-running command.
    http: HttpSettings = Field(default_factory=HttpSettings)
    # The bounds on the Prometheus labels.
    prometheus: PrometheusSettings = Field(default_factory=PrometheusSettings)
    # What is logged, and how.
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    # How OTLP spans are assembled into traces.
    otlp: OtlpSettings = Field(default_factory=OtlpSettings)
    # `tracejudge sink <kind>` (write-back of verdicts from the results topic).
    sink: SinkSettings = Field(default_factory=SinkSettings)
    # `tracejudge sessions` (session-level evaluation of the trace results).
    sessions: SessionsSettings = Field(default_factory=SessionsSettings)
    # Computed-metric options and custom metric functions (tracejudge.metrics.computed).
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    # LLM / heuristic judges (tracejudge.metrics.judges.config); no section: no judges run.
    judges: JudgesConfig | None = None
    # `tracejudge agreement` (human labels joined with the judges' verdicts).
    agreement: AgreementSettings = Field(default_factory=AgreementSettings)
    # The links in the alerts (`tracejudge alerts render`).
    alerts: AlertsSettings = Field(default_factory=AlertsSettings)
    # `tracejudge findings` (what the failing verdicts have in common, per app and judge).
    findings: FindingsSettings = Field(default_factory=FindingsSettings)
    # Rules routing matching traces into collections (tracejudge.consumer.config.collections).
    # A default, not a factory: the loader fills absent factory sections with {}, and this is a list.
    collections: list[CollectionRule] = Field(default=[], description=(
        "Rules that collect matching traces (by a judge's verdict, a metric, the app, the version or a "
        "finding) into a file or topic, "
        "for a regression set."))
    # Quality SLOs per app and judge (`tracejudge slo render`: recording rules and burn-rate alerts).
    slos: list[SloSpec] = Field(default=[])

    @model_validator(mode="after")
    def _collections_known(self) -> Settings:
        # Rules name judges and metrics of other sections: checked once all are read.
        check_collections(self.collections, self.judges, self.metrics)
        check_slos(self.slos, self.judges)
        return self

    def redacted(self) -> dict[str, Any]:
        """Effective settings as flat `section.key -> value`, by each field's declared secrecy
        (`tracejudge.metrics.judges.secrets`): a `SecretStr` or `SECRET` field (each value of a `SECRET`
        mapping) is '**********', an `OPAQUE` section (a sink's own, validated by the sink) shows its
        strings as '**********', and every URL is shown without its credentials or query values.
        Nothing is hidden or shown because of what a key is called."""
        out: dict[str, Any] = {}
        _walk_shown(out, "", self, secret=False, opaque=False)
        return out


def _markers(model: type[BaseModel], name: str) -> tuple[bool, bool]:
    """(secret, opaque) as the field `name` of `model` declares it."""
    field = model.model_fields[name]
    return SECRET in field.metadata, OPAQUE in field.metadata


def _walk_shown(out: dict[str, Any], prefix: str, obj: Any, *, secret: bool, opaque: bool) -> None:
    if isinstance(obj, BaseModel):
        cls = type(obj)
        for name in cls.model_fields:
            is_secret, is_opaque = _markers(cls, name)
            _walk_shown(out, f"{prefix}.{name}" if prefix else name, getattr(obj, name),
                        secret=secret or is_secret, opaque=opaque or is_opaque)
        # A model's extra keys are sections it does not validate (a sink plugin's): opaque.
        for name, value in (obj.model_extra or {}).items():
            _walk_shown(out, f"{prefix}.{name}" if prefix else name, value, secret=secret, opaque=True)
    elif isinstance(obj, Mapping) and obj:
        for key, value in obj.items():
            _walk_shown(out, f"{prefix}.{key}", value, secret=secret, opaque=opaque)
    elif obj is None or isinstance(obj, Mapping):
        out[prefix] = None if obj is None else {}
    elif secret or isinstance(obj, SecretStr):
        out[prefix] = MASK
    elif opaque:
        out[prefix] = _opaque_value(obj)
    elif isinstance(obj, list):
        out[prefix] = [str(x) if isinstance(x, TopicSpec) else
                       _shown_json(x.model_dump(mode="json")) if isinstance(x, BaseModel) else shown(x)
                       for x in obj]
    elif isinstance(obj, Path):
        out[prefix] = str(obj)
    else:
        out[prefix] = shown(obj)


def _opaque_value(value: Any) -> Any:
    """A value of a section this process does not validate: numbers, booleans and URLs (redacted)
    are shown; any other string, which may be a secret, is masked."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return redact_url(value) if "://" in value else MASK
    if isinstance(value, Mapping):
        return {str(k): _opaque_value(v) for k, v in value.items()} if value else {}
    if isinstance(value, (list, tuple)):
        return [_opaque_value(v) for v in value]
    return MASK


def _shown_json(value: Any) -> Any:
    """A plain JSON value (a list item that is a model) with every URL in it redacted."""
    if isinstance(value, Mapping):
        return {k: _shown_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shown_json(v) for v in value]
    return shown(value)
