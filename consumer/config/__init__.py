"""Settings of `tracejudge run` and `tracejudge sink`: a YAML file, overridden by environment variables,
overridden by flags.

    defaults  <  --config FILE (YAML)  <  TRACEJUDGE_<SECTION>__<KEY>  <  command-line flags

One pydantic model per YAML section (`kafka`, `stream`, `producer`, `http`, `prometheus`, `logging`,
`sink`); new sections (`judges:`, `metrics:`) are new fields of `Settings`. `tracejudge run` and
`tracejudge sink <kind>` can share one file: each reads the sections it needs. Every environment
variable maps to one key: `TRACEJUDGE_KAFKA__SESSION_TIMEOUT_MS=6000` sets
`kafka.session_timeout_ms` (double underscore between section and key, as in pydantic-settings).
Lists (`stream.topics`, `kafka.bootstrap_servers`) take comma-separated values from the environment.

Errors name the key and where its value came from, e.g.
`kafka.session_timeout_ms (from TRACEJUDGE_KAFKA__SESSION_TIMEOUT_MS): must be > 0`, and are all
reported together before anything connects. Secrets are `SecretStr`: never printed, never in errors.

The package holds one module per group of sections, so each reads alone: `common` (the environment's
naming, the runtime's `Section` base on `tracejudge.metrics.sections.Section`), `kafka`, `stream` (`stream`,
`producer`, `http`, `prometheus`, `logging`, `otlp`), `sink`, `sessions` (`sessions`, `agreement`),
`settings` (`Settings` and its redacted listing) and `loading` (`load_settings`). The one error is
`ConfigError` (`tracejudge.schemas.errors`), re-exported here; the `metrics:` and `judges:` sections are
`tracejudge.metrics.computed.MetricsConfig` and `tracejudge.metrics.judges.config.JudgesConfig`.
"""


from tracejudge.consumer.config.common import ENV_NESTING, ENV_PREFIX, FORMATS, Section
from tracejudge.consumer.config.kafka import KafkaSettings, load_token_provider
from tracejudge.consumer.config.loading import load_settings
from tracejudge.consumer.config.sessions import AgreementSettings, SessionsSettings
from tracejudge.consumer.config.settings import Settings
from tracejudge.consumer.config.sink import BUILTIN_SINKS, SinkSettings
from tracejudge.consumer.config.stream import (
    AssemblySection,
    AssemblySettings,
    HttpSettings,
    LoggingSettings,
    OtlpSettings,
    ProducerSettings,
    PrometheusSettings,
    StreamSettings,
    TopicSpec,
)
from tracejudge.schemas.errors import ConfigError

__all__ = [
    "BUILTIN_SINKS",
    "ENV_NESTING",
    "ENV_PREFIX",
    "FORMATS",
    "AgreementSettings",
    "AssemblySection",
    "AssemblySettings",
    "ConfigError",
    "HttpSettings",
    "KafkaSettings",
    "LoggingSettings",
    "OtlpSettings",
    "ProducerSettings",
    "PrometheusSettings",
    "Section",
    "SessionsSettings",
    "Settings",
    "SinkSettings",
    "StreamSettings",
    "TopicSpec",
    "load_settings",
    "load_token_provider",
]
