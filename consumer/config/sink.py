"""The `sink:` section of `tracejudge sink <kind>`: the results it reads, how it batches them, the plug-in
sinks (`plugins`) and each sink's own section, validated by the sink's settings class
(`tracejudge.consumer.sinks`) (`tracejudge.consumer.config`)."""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from tracejudge.consumer.config.common import Section, group_id_value, optional_topic
from tracejudge.metrics.judges.secrets import OPAQUE
from tracejudge.schemas.errors import ConfigError

__all__ = ["BUILTIN_SINKS", "CLASS_SPEC", "SINK_KIND", "SinkSettings"]

BUILTIN_SINKS = {"mlflow": "tracejudge.consumer.sinks.mlflow:MlflowSink",
                 "otlp": "tracejudge.consumer.sinks.otlp:OtlpSink",
                 "phoenix": "tracejudge.consumer.sinks.phoenix:PhoenixSink"}
SINK_KIND = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
CLASS_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class SinkSettings(Section):
    """`tracejudge sink <kind>`: the results it reads, how it batches them, and each sink's own
    section (`sink.mlflow`, `sink.otlp`, `sink.<plugin kind>`), handed as a mapping to the sink's
    settings class (`from_mapping`), which validates it."""

    # A plugin's section is `sink.<kind>`: extra keys are allowed, and checked against `plugins`.
    model_config = ConfigDict(extra="allow", validate_default=True)

    # Default: stream.results_topic.
    results_topic: str | None = None
    # The session results to write back too (sinks that handle sessions). Default: sessions.results_topic.
    session_results_topic: str | None = None
    # False: write trace verdicts only, even when a session results topic is configured.
    write_sessions: bool = True
    # The findings to write back too (sinks that handle findings). Default: findings.findings_topic.
    findings_topic: str | None = None
    # False: do not read findings, even when a findings topic is configured.
    write_findings: bool = True
    # Where records that are not tracejudge results (or of a newer schema version) go; else logged.
    dead_letter_topic: str | None = None
    # Default: tracejudge-sink-<kind>, so every kind reads every result.
    group_id: str | None = None
    # Records written per partition per checkpoint, at most.
    max_batch_records: int = Field(default=500, gt=0)
    # How long a partition's records may wait for their checkpoint.
    checkpoint_interval_ms: int = Field(default=1_000, ge=0)
    # Cap of the exponential back-off between offers of a batch the sink asked to retry (`RetryLater`).
    max_retry_backoff_s: float = Field(default=60.0, gt=0)
    # Results a sink deferred (their trace not at the backend yet) waiting to be offered again, over
    # every partition; beyond it a partition is held instead (`tracejudge_sink_park_full_total`).
    max_parked_records: int = Field(default=10_000, ge=0)
    # More sinks: kind -> "package.module:Class", a `tracejudge.consumer.sinks.base.Sink`.
    plugins: dict[str, str] = Field(default_factory=dict)
    # The built-in sinks' sections, validated by their sinks (`from_mapping`): opaque here.
    mlflow: Annotated[dict[str, Any] | None, OPAQUE] = None
    # The OTLP sink's own section (`tracejudge sink otlp`), validated when it starts.
    otlp: Annotated[dict[str, Any] | None, OPAQUE] = None
    # The Phoenix sink's own section (`tracejudge sink phoenix`), validated when it starts.
    phoenix: Annotated[dict[str, Any] | None, OPAQUE] = None

    _topic = field_validator("results_topic", "session_results_topic", "findings_topic",
                             "dead_letter_topic")(optional_topic)

    _group = field_validator("group_id")(group_id_value)

    @model_validator(mode="after")
    def _coherent(self) -> SinkSettings:
        own = set(type(self).model_fields)
        for kind, spec in self.plugins.items():
            if not SINK_KIND.match(kind) or kind in own - set(BUILTIN_SINKS):
                raise ConfigError(f"plugins.{kind}", "a sink kind is lowercase letters, digits, '_' and "
                                  "'-', and not a key of the sink section")
            if not isinstance(spec, str) or not CLASS_SPEC.match(spec):
                raise ConfigError(f"plugins.{kind}", f"expected 'package.module:Class', got {spec!r}")
        for key, value in (self.model_extra or {}).items():
            if key not in self.plugins:
                close = difflib.get_close_matches(key, [*own, *self.plugins], n=1)
                raise ConfigError(key, "unknown key" + (f"; did you mean {close[0]!r}?" if close else
                                                        "; a plugin's section needs sink.plugins." + key))
            if value is not None and not isinstance(value, dict):  # never quoted: it may be a secret
                raise ConfigError(key, f"must be a mapping, got {type(value).__name__}")
        if self.dead_letter_topic is not None and self.dead_letter_topic == self.results_topic:
            raise ConfigError("dead_letter_topic", "is the results topic; the sink would read its own "
                              "dead letters")
        if self.dead_letter_topic is not None and self.dead_letter_topic == self.session_results_topic:
            raise ConfigError("dead_letter_topic", "is the session results topic; the sink would read its "
                              "own dead letters")
        if self.findings_topic is not None and self.findings_topic in (self.dead_letter_topic,
                                                                       self.results_topic,
                                                                       self.session_results_topic):
            raise ConfigError("findings_topic", "is also the results, session results or dead-letter "
                              "topic; findings need a topic of their own")
        return self

    def kinds(self) -> dict[str, str]:
        """Every sink kind this configuration can run: kind -> "package.module:Class"."""
        return {**BUILTIN_SINKS, **self.plugins}

    def section(self, kind: str) -> dict[str, Any]:
        """The sink's own section, `sink.<kind>` ({} when absent)."""
        builtin = kind in ("mlflow", "otlp", "phoenix")
        value = getattr(self, kind) if builtin else (self.model_extra or {}).get(kind)
        return dict(value or {})
