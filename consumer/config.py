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
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tracejudge.metrics.computed import MetricsConfig
from tracejudge.metrics.judges.config import JudgesConfig
from tracejudge.metrics.judges.secrets import MASK, OPAQUE, SECRET, redact_url, redact_urls, shown

__all__ = [
    "ENV_PREFIX",
    "FORMATS",
    "ConfigError",
    "HttpSettings",
    "KafkaSettings",
    "LoggingSettings",
    "ProducerSettings",
    "PrometheusSettings",
    "SessionsSettings",
    "Settings",
    "SinkSettings",
    "StreamSettings",
    "TopicSpec",
    "load_settings",
]

ENV_PREFIX = "TRACEJUDGE_"
ENV_NESTING = "__"
# otlp_logs_*: the Collector's logs topic, whose GenAI content events join their spans in assembly.
FORMATS = ("auto", "agent_eval", "mlflow", "inference_log", "otlp_proto", "otlp_json", "otlp_logs_proto",
           "otlp_logs_json")
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


class ConfigError(Exception):
    """An invalid configuration: `problems` is a list of (key, message), all reported together."""

    def __init__(self, problems: Sequence[tuple[str, str]]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{k}: {m}" if k else m for k, m in self.problems))

    def report(self) -> str:
        lines = [f"  {key}: {msg}" if key else f"  {msg}" for key, msg in self.problems]
        return "invalid configuration:\n" + "\n".join(lines)


class _KeyedError(ValueError):
    """A cross-field error that names the key to blame (relative to the model that raised it)."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


def _split_list(v: Any) -> Any:
    if isinstance(v, str):
        return [item.strip() for item in v.split(",") if item.strip()]
    return v


def _optional_topic(v: str | None) -> str | None:
    """An optional topic key (results, dead letters, sessions, labels): a valid Kafka topic name;
    "" means unset."""
    if v is not None and (not _TOPIC_NAME.match(v) or v in (".", "..")):
        raise ValueError(f"{v!r} is not a valid Kafka topic name")
    return v or None


def _group_id(v: str | None) -> str | None:
    if v is not None and not v.strip():
        raise ValueError("must not be empty")
    return v


class TopicSpec(Section):
    """A topic to consume and the format of its records (`auto` detects per record)."""

    name: str
    format: Literal["auto", "agent_eval", "mlflow", "inference_log", "otlp_proto", "otlp_json",
                    "otlp_logs_proto", "otlp_logs_json"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, v: Any) -> Any:
        # "traces" or "traces:mlflow", as on the command line.
        if isinstance(v, str):
            name, sep, fmt = v.partition(":")
            return {"name": name.strip(), "format": fmt.strip()} if sep else {"name": name.strip()}
        return v

    @field_validator("name")
    @classmethod
    def _topic_name(cls, v: str) -> str:
        if not _TOPIC_NAME.match(v) or v in (".", ".."):
            raise ValueError(f"{v!r} is not a valid Kafka topic name (letters, digits, '.', '_', '-'; "
                             "at most 249 characters)")
        return v

    def __str__(self) -> str:
        return f"{self.name}:{self.format}"


class KafkaSettings(Section):
    """Connection, consumer-group and security settings, passed to kafka-python's clients."""

    bootstrap_servers: list[str] = Field(default_factory=lambda: ["localhost:9092"], min_length=1)
    client_id: str = "tracejudge"
    group_id: str = Field(default="tracejudge", min_length=1)
    # Static membership: only useful with stable pod identities (a StatefulSet).
    group_instance_id: str | None = None
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    session_timeout_ms: int = Field(default=10_000, gt=0)
    heartbeat_interval_ms: int = Field(default=2_000, gt=0)
    max_poll_interval_ms: int = Field(default=300_000, gt=0)
    max_poll_records: int = Field(default=500, gt=0)
    fetch_max_bytes: int = Field(default=52_428_800, gt=0)
    max_partition_fetch_bytes: int = Field(default=1_048_576, gt=0)
    request_timeout_ms: int = Field(default=30_000, gt=0)
    # How long the first connection may take before start-up fails.
    bootstrap_timeout_ms: int = Field(default=30_000, gt=0)
    commit_timeout_ms: int = Field(default=10_000, gt=0)

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI",
                            "AWS_MSK_IAM"] | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: SecretStr | None = None
    sasl_kerberos_service_name: str = "kafka"
    sasl_kerberos_domain_name: str | None = None
    # OAUTHBEARER: "package.module:factory" returning a kafka.net.sasl.oauth.AbstractTokenProvider ...
    sasl_oauth_token_provider: str | None = None
    # ... or a file holding the token, re-read on every authentication (a mounted, rotated secret).
    sasl_oauth_token_file: Path | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_password: SecretStr | None = None
    ssl_crlfile: Path | None = None
    ssl_check_hostname: bool = True
    ssl_ciphers: str | None = None

    _split = field_validator("bootstrap_servers", mode="before")(_split_list)

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_port(cls, v: list[str]) -> list[str]:
        for server in v:
            if "@" in server or "://" in server:
                raise ValueError("a bootstrap server is host:port, without a scheme or credentials "
                                 "(user:password@); SASL credentials go in kafka.sasl_plain_username "
                                 "and kafka.sasl_plain_password")
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{server!r} is not host:port")
        return v

    @field_validator("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_crlfile", "sasl_oauth_token_file")
    @classmethod
    def _file_exists(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_file():
            raise ValueError(f"file {str(v)!r} does not exist")
        return v

    @model_validator(mode="after")
    def _coherent(self) -> KafkaSettings:
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise _KeyedError("heartbeat_interval_ms", f"must be lower than session_timeout_ms "
                              f"({self.session_timeout_ms}); a third of it is usual")
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and self.sasl_mechanism is None:
            raise _KeyedError("sasl_mechanism", f"is required with security_protocol "
                              f"{self.security_protocol}")
        if not sasl and self.sasl_mechanism is not None:
            raise _KeyedError("security_protocol", f"must be SASL_SSL or SASL_PLAINTEXT to use "
                              f"sasl_mechanism {self.sasl_mechanism}")
        if self.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            # kafka-python builds, but does not raise, this error for SCRAM: it would surface later
            # as a confusing authentication failure.
            if not self.sasl_plain_username:
                raise _KeyedError("sasl_plain_username", f"is required with sasl_mechanism "
                                  f"{self.sasl_mechanism}")
            if self.sasl_plain_password is None:
                raise _KeyedError("sasl_plain_password", f"is required with sasl_mechanism "
                                  f"{self.sasl_mechanism}")
        if self.sasl_mechanism == "OAUTHBEARER":
            if (self.sasl_oauth_token_provider is None) == (self.sasl_oauth_token_file is None):
                raise _KeyedError("sasl_oauth_token_provider", "OAUTHBEARER needs exactly one of "
                                  "sasl_oauth_token_provider or sasl_oauth_token_file")
            if self.sasl_oauth_token_provider is not None:
                try:
                    _load_token_provider(self.sasl_oauth_token_provider)
                except (ImportError, AttributeError, TypeError, ValueError) as exc:
                    raise _KeyedError("sasl_oauth_token_provider", str(exc)) from None
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise _KeyedError("ssl_certfile", "is required with ssl_keyfile")
        return self

    def client_config(self) -> dict[str, Any]:
        """Options shared by the consumer and the producer (connection and security)."""
        cfg: dict[str, Any] = {
            "bootstrap_servers": list(self.bootstrap_servers),
            "client_id": self.client_id,
            "request_timeout_ms": self.request_timeout_ms,
            "bootstrap_timeout_ms": self.bootstrap_timeout_ms,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism is not None:
            cfg["sasl_mechanism"] = self.sasl_mechanism
            if self.sasl_plain_username is not None:
                cfg["sasl_plain_username"] = self.sasl_plain_username
            if self.sasl_plain_password is not None:
                cfg["sasl_plain_password"] = self.sasl_plain_password.get_secret_value()
            if self.sasl_mechanism == "GSSAPI":
                cfg["sasl_kerberos_service_name"] = self.sasl_kerberos_service_name
                if self.sasl_kerberos_domain_name:
                    cfg["sasl_kerberos_domain_name"] = self.sasl_kerberos_domain_name
            if self.sasl_mechanism == "OAUTHBEARER":
                cfg["sasl_oauth_token_provider"] = (
                    _load_token_provider(self.sasl_oauth_token_provider) if self.sasl_oauth_token_provider
                    else _file_token_provider(self.sasl_oauth_token_file))
        for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_crlfile"):
            if (path := getattr(self, key)) is not None:
                cfg[key] = str(path)
        if self.ssl_password is not None:
            cfg["ssl_password"] = self.ssl_password.get_secret_value()
        if self.security_protocol in ("SSL", "SASL_SSL"):
            cfg["ssl_check_hostname"] = self.ssl_check_hostname
            if self.ssl_ciphers:
                cfg["ssl_ciphers"] = self.ssl_ciphers
        return cfg

    def consumer_config(self) -> dict[str, Any]:
        cfg = self.client_config()
        cfg.update(
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset=self.auto_offset_reset,
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            max_poll_interval_ms=self.max_poll_interval_ms,
            max_poll_records=self.max_poll_records,
            fetch_max_bytes=self.fetch_max_bytes,
            max_partition_fetch_bytes=self.max_partition_fetch_bytes,
        )
        if self.group_instance_id:
            cfg["group_instance_id"] = self.group_instance_id
        return cfg


def _load_token_provider(spec: str) -> Any:
    """Import "package.module:attr"; a class (or factory) is called without arguments."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not 'package.module:attribute'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise ImportError(f"cannot import {module_name!r}: {exc}") from None
    except AttributeError:
        raise AttributeError(f"module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "token")):
        obj = obj()
    provider = obj
    if not callable(getattr(provider, "token", None)):
        raise TypeError(f"{spec!r} must give a token provider with a token() method")
    return provider


def _file_token_provider(path: Path | None) -> Any:
    from kafka.net.sasl.oauth import AbstractTokenProvider

    assert path is not None

    class FileTokenProvider(AbstractTokenProvider):
        # Re-read at every authentication so a rotated token (a mounted secret) is picked up.
        def token(self) -> str:
            return path.read_text().strip()

    return FileTokenProvider()


class StreamSettings(Section):
    """What to consume, where results and dead letters go, and the limits of the runner."""

    topics: list[TopicSpec] = Field(default_factory=list)
    results_topic: str | None = None
    dead_letter_topic: str | None = None
    # The trace tag whose value names the app (the `app` label); else the source's own notion.
    app_tag: str | None = None
    # The trace tag (MLflow tag or metadata key, span attribute, row field) whose value is the
    # record's session id, over the conventions (`mlflow.trace.session`, `session.id`, ...).
    session_tag: str | None = None
    # Records fetched and not yet exported; past it fetching pauses (memory stays bounded).
    max_in_flight: int = Field(default=2_000, gt=0)
    # Processes that decode and score MLflow / agent-evaluation / inference-log records beside the
    # consumer (consumer/stages/decoding.py); 0 decodes on the poll thread. "auto": one when the
    # process may use two CPUs or more (affinity and cgroup quota) and a topic can use it, else 0.
    decode_workers: int | Literal["auto"] = "auto"
    # Larger records are dead-lettered (reason too_large) without being parsed.
    max_record_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    commit_interval_ms: int = Field(default=1_000, ge=0)
    # On SIGTERM or revocation: how long in-flight records may take to finish before we give up on
    # them (they are re-delivered).
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    poll_timeout_ms: int = Field(default=250, gt=0)
    lag_interval_seconds: float = Field(default=2.0, gt=0)

    _split = field_validator("topics", mode="before")(_split_list)

    @field_validator("decode_workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> int | str:
        # One message rather than pydantic's two (one per branch of the union).
        number = v
        if isinstance(v, str):
            text = v.strip()
            if text.lower() == "auto":
                return "auto"
            if text.isascii() and text.isdigit():
                number = int(text)
        if type(number) is not int or not 0 <= number <= 32:
            raise ValueError(f'expected "auto" or a number of worker processes from 0 to 32, got {v!r}')
        return number

    _sink_topic = field_validator("results_topic", "dead_letter_topic")(_optional_topic)

    @model_validator(mode="after")
    def _coherent(self, info: ValidationInfo) -> StreamSettings:
        # `tracejudge eval` reads the same file for its metrics/judges sections and consumes nothing.
        if not self.topics and not (info.context or {}).get("offline"):
            raise _KeyedError("topics", "at least one topic is required (--topic NAME[:FORMAT], "
                              f"{ENV_PREFIX}STREAM{ENV_NESTING}TOPICS or stream.topics in the file)")
        names = [t.name for t in self.topics]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise _KeyedError(f"topics[{i}]", f"topic {name!r} is listed twice")
        for key in ("results_topic", "dead_letter_topic"):
            if (sink := getattr(self, key)) in names:
                raise _KeyedError(key, f"{sink!r} is also a consumed topic; tracejudge would read its "
                                  "own output")
        return self


class ProducerSettings(Section):
    """The producer that writes results and dead letters (acks=all, idempotent)."""

    # One result per record (~3 KB) at thousands a second: kafka-python builds batches in Python,
    # so its cost is mostly per batch. 10 ms / 256 KB (100 results a batch) against 5 ms / 64 KB
    # measured 254 -> 219 µs of CPU per record with a results topic, and +19% records/s; 256 KB
    # stays far below a broker's default message.max.bytes (1 MB).
    linger_ms: int = Field(default=10, ge=0)
    batch_size: int = Field(default=262_144, gt=0)
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    max_request_size: int = Field(default=1_048_576, gt=0)
    delivery_timeout_ms: int = Field(default=120_000, gt=0)
    # Between attempts to re-send a result or dead letter the producer gave up on.
    retry_backoff_seconds: float = Field(default=1.0, gt=0)

    def producer_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "acks": "all",
            "linger_ms": self.linger_ms,
            "batch_size": self.batch_size,
            "max_request_size": self.max_request_size,
            "delivery_timeout_ms": self.delivery_timeout_ms,
        }
        if self.compression_type:
            cfg["compression_type"] = self.compression_type
        return cfg


class HttpSettings(Section):
    """The /metrics, /healthz and /readyz endpoint."""

    enabled: bool = True
    bind_address: str = "0.0.0.0"
    # 0 picks a free port (tests); the bound port is logged.
    port: int = Field(default=9464, ge=0, le=65535)


class PrometheusSettings(Section):
    # Distinct `app` label values before new ones are exported as "other".
    max_apps: int = Field(default=100, gt=0)


class LoggingSettings(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # "text" for people, "json" for log pipelines.
    format: Literal["text", "json"] = "text"

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class AssemblySection(Section):
    """`otlp.assembly`: how OTLP spans are held until their trace is whole
    (`tracejudge.consumer.stages.assembly.AssemblySettings`)."""

    # Emit a trace this long after its last span arrived, once its root span is in.
    quiet_period_s: float = Field(default=5.0, gt=0)
    # Emit a trace (incomplete) this long after its first span arrived, root or not.
    max_wait_s: float = Field(default=60.0, gt=0)
    max_open_traces: int = Field(default=20_000, gt=0)
    max_spans_held: int = Field(default=200_000, gt=0)
    remember_emitted: int = Field(default=100_000, gt=0)

    @model_validator(mode="after")
    def _coherent(self) -> AssemblySection:
        if self.max_wait_s < self.quiet_period_s:
            raise _KeyedError("max_wait_s", f"must be at least quiet_period_s ({self.quiet_period_s})")
        return self

    def to_settings(self) -> Any:
        from tracejudge.consumer.stages.assembly import AssemblySettings

        return AssemblySettings(**self.model_dump())


class OtlpSettings(Section):
    assembly: AssemblySection = Field(default_factory=AssemblySection)


# The sinks shipped with tracejudge; `tracejudge sink <kind>` imports the class only when it is chosen.
BUILTIN_SINKS = {"mlflow": "tracejudge.consumer.sinks.mlflow:MlflowSink",
                 "otlp": "tracejudge.consumer.sinks.otlp:OtlpSink"}
_SINK_KIND = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_CLASS_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


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
    # More sinks: kind -> "package.module:Class", a `tracejudge.consumer.sinks.base.Sink`.
    plugins: dict[str, str] = Field(default_factory=dict)
    # The built-in sinks' sections, validated by their sinks (`from_mapping`): opaque here.
    mlflow: Annotated[dict[str, Any] | None, OPAQUE] = None
    otlp: Annotated[dict[str, Any] | None, OPAQUE] = None

    _topic = field_validator("results_topic", "session_results_topic", "dead_letter_topic")(_optional_topic)

    _group = field_validator("group_id")(_group_id)

    @model_validator(mode="after")
    def _coherent(self) -> SinkSettings:
        own = set(type(self).model_fields)
        for kind, spec in self.plugins.items():
            if not _SINK_KIND.match(kind) or kind in own - set(BUILTIN_SINKS):
                raise _KeyedError(f"plugins.{kind}", "a sink kind is lowercase letters, digits, '_' and "
                                  "'-', and not a key of the sink section")
            if not isinstance(spec, str) or not _CLASS_SPEC.match(spec):
                raise _KeyedError(f"plugins.{kind}", f"expected 'package.module:Class', got {spec!r}")
        for key, value in (self.model_extra or {}).items():
            if key not in self.plugins:
                close = difflib.get_close_matches(key, [*own, *self.plugins], n=1)
                raise _KeyedError(key, "unknown key" + (f"; did you mean {close[0]!r}?" if close else
                                                        "; a plugin's section needs sink.plugins." + key))
            if value is not None and not isinstance(value, dict):  # never quoted: it may be a secret
                raise _KeyedError(key, f"must be a mapping, got {type(value).__name__}")
        if self.dead_letter_topic is not None and self.dead_letter_topic == self.results_topic:
            raise _KeyedError("dead_letter_topic", "is the results topic; the sink would read its own "
                              "dead letters")
        if self.dead_letter_topic is not None and self.dead_letter_topic == self.session_results_topic:
            raise _KeyedError("dead_letter_topic", "is the session results topic; the sink would read its "
                              "own dead letters")
        return self

    def kinds(self) -> dict[str, str]:
        """Every sink kind this configuration can run: kind -> "package.module:Class"."""
        return {**BUILTIN_SINKS, **self.plugins}

    def section(self, kind: str) -> dict[str, Any]:
        """The sink's own section, `sink.<kind>` ({} when absent)."""
        value = getattr(self, kind) if kind in ("mlflow", "otlp") else (self.model_extra or {}).get(kind)
        return dict(value or {})


class SessionsSettings(Section):
    """`tracejudge sessions`: the session stage (`consumer/stages/sessions.py`). It reads the trace results
    (`input_topic`, default `stream.results_topic`), gathers the turns of each session, and writes one
    session result per closed session to `results_topic` (required for the stage)."""

    # Default: stream.results_topic.
    input_topic: str | None = None
    results_topic: str | None = None
    # Where records that are not trace results (or of a newer schema version) go; else logged.
    dead_letter_topic: str | None = None
    # Default: tracejudge-sessions.
    group_id: str | None = None
    # A session closes this long after its last turn (stream time of its partition, or wall clock).
    inactivity_s: float = Field(default=300.0, gt=0)
    # A session reaching either is closed early, as incomplete.
    max_turns: int = Field(default=100, gt=0)
    max_duration_s: float = Field(default=3600.0, gt=0)
    # Memory caps: past one, the least recently active sessions are closed early (evicted).
    max_open_sessions: int = Field(default=100_000, gt=0)
    max_turns_held: int = Field(default=1_000_000, gt=0)
    max_bytes_held: int = Field(default=536_870_912, gt=0)
    # Closed sessions remembered (with their turns) so a late turn reopens them; 0 never reopens.
    max_closed_sessions: int = Field(default=10_000, ge=0)

    _topic = field_validator("input_topic", "results_topic", "dead_letter_topic")(_optional_topic)

    _group = field_validator("group_id")(_group_id)


class AgreementSettings(Section):
    """`tracejudge agreement`: the online-agreement stage (`consumer/stages/agreement.py`). It reads the trace
    results (`results_topic`, default `stream.results_topic`) and the human labels (`labels_topic`,
    required for the stage) and joins them by trace id / request id within `window_s`."""

    results_topic: str | None = None
    labels_topic: str | None = None
    # Default: tracejudge-agreement.
    group_id: str | None = None
    # How long a verdict waits for its label and a label for its verdict (wall clock); a label still
    # unmatched then is counted as unmatched.
    window_s: float = Field(default=3600.0, gt=0)
    # Verdicts and labels held waiting, each; past it the oldest is dropped (counted).
    max_pending: int = Field(default=100_000, gt=0)

    _topic = field_validator("results_topic", "labels_topic")(_optional_topic)

    _group = field_validator("group_id")(_group_id)


class Settings(Section):
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    stream: StreamSettings = Field(default_factory=StreamSettings)
    producer: ProducerSettings = Field(default_factory=ProducerSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    prometheus: PrometheusSettings = Field(default_factory=PrometheusSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
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


# -- loading ------------------------------------------------------------------------------------


def load_settings(config_file: str | os.PathLike[str] | None = None, *,
                  environ: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None, offline: bool = False,
                  require_topics: bool = True) -> Settings:
    """Build `Settings` from the layers; raises `ConfigError` naming every bad key and its origin.

    `overrides` are dotted keys from the command line (`{"stream.topics": [...], "http.port": 9100}`);
    None values are ignored (flag not given). `offline` (for `tracejudge eval`) and
    `require_topics=False` (for `tracejudge sink`, which reads `sink.results_topic`) do not require
    `stream.topics`.
    """
    data: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    problems: list[tuple[str, str]] = []

    if config_file is not None:
        path = Path(config_file)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError([("--config", f"cannot read {str(path)!r}: {exc.strerror or exc}")]) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError([("--config", f"{str(path)!r} is not valid YAML{where}: {problem}")]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError([("--config", f"{str(path)!r} must hold a mapping of sections "
                                            f"(kafka:, stream:, ...), not {type(loaded).__name__}")])
        for section, body in loaded.items():
            if isinstance(body, dict) and body:
                for key, value in body.items():
                    _put(data, origins, (str(section), str(key)), value, f"{path}")
            else:
                _put(data, origins, (str(section),), body, f"{path}")

    env = os.environ if environ is None else environ
    for name, value in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or ENV_NESTING not in name:
            continue
        parts = name[len(ENV_PREFIX):].lower().split(ENV_NESTING)
        if len(parts) < 2 or not all(parts):
            problems.append((name, f"expected {ENV_PREFIX}<SECTION>{ENV_NESTING}<KEY>"))
            continue
        _put(data, origins, tuple(parts), value, name)

    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        key = tuple(dotted.split("."))
        _put(data, origins, key, value, _FLAG_NAMES.get(dotted, "command line"))

    if problems:
        raise ConfigError(problems)
    # Validate absent sections inside `Settings` too, so their errors carry the section's name.
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            data.setdefault(name, {})
    try:
        settings = Settings.model_validate(data, context={"offline": offline or not require_topics})
    except ValidationError as exc:
        raise ConfigError(_explain(exc, origins)) from None
    # Offline evaluation judges every eligible record unless a sample rate is configured.
    if offline and settings.judges is not None:
        settings = settings.model_copy(update={"judges": settings.judges.for_offline()})
    return settings


# The flags of `tracejudge run` and `tracejudge sink`, for error messages ("from --group-id").
_FLAG_NAMES = {
    "kafka.bootstrap_servers": "--bootstrap-servers",
    "kafka.group_id": "--group-id",
    "stream.topics": "--topic",
    "stream.results_topic": "--results-topic",
    "stream.dead_letter_topic": "--dead-letter-topic",
    "http.port": "--metrics-port",
    "http.bind_address": "--metrics-bind-address",
    "logging.level": "--log-level",
    # `tracejudge sink`
    "sink.group_id": "--group-id",
    "sink.results_topic": "--results-topic",
    "sink.dead_letter_topic": "--dead-letter-topic",
    # `tracejudge sessions`
    "sessions.group_id": "--group-id",
    "sessions.input_topic": "--input-topic",
    "sessions.results_topic": "--results-topic",
    "sessions.dead_letter_topic": "--dead-letter-topic",
    # `tracejudge agreement`
    "agreement.group_id": "--group-id",
    "agreement.results_topic": "--results-topic",
    "agreement.labels_topic": "--labels-topic",
}


def _put(data: dict[str, Any], origins: dict[tuple[str, ...], str], key: tuple[str, ...], value: Any,
         origin: str) -> None:
    node = data
    for part in key[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[key[-1]] = value
    origins[key] = origin


def _explain(exc: ValidationError, origins: Mapping[tuple[str, ...], str]) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, _KeyedError):
            loc = loc + tuple(_parse_key(cause.key))
            message = cause.message
        else:
            message = _message(err, loc)
        key = _render(loc)
        origin = _origin(loc, origins)
        problems.append((f"{key} (from {origin})" if origin else key, message))
    return problems


def _parse_key(key: str) -> Iterable[str | int]:
    for part in key.split("."):
        name, _, rest = part.partition("[")
        yield name
        if rest:
            yield int(rest.rstrip("]"))


def _render(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "literal[")) or part == "str":
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _origin(loc: Sequence[Any], origins: Mapping[tuple[str, ...], str]) -> str | None:
    names = tuple(str(p) for p in loc if not isinstance(p, int))
    for n in range(len(names), 0, -1):
        if names[:n] in origins:
            return origins[names[:n]]
    return None


def _message(err: Mapping[str, Any], loc: Sequence[Any]) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    given = "" if _declared_secret(loc) else f", got {redact_urls(repr(err.get('input')))}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']}{given}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']}{given}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']}{given}"
    if kind == "less_than":
        return f"must be < {ctx['lt']}{given}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"must be an integer{given}"
    if kind in ("float_parsing", "float_type"):
        return f"must be a number{given}"
    if kind in ("bool_parsing", "bool_type"):
        return f"must be true or false{given}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{given}"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        name = str(loc[-1]) if loc else ""
        known = _fields_at(loc[:-1])
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else (f"; known keys: {', '.join(known)}"
                                                              if known else "")
        return f"unknown key{hint}"
    if kind in ("too_short", "string_too_short"):
        return "must not be empty"
    if kind in ("string_type", "list_type", "dict_type", "model_type", "model_attributes_type"):
        expected = {"string_type": "a string", "list_type": "a list", "dict_type": "a mapping"}.get(
            kind, "a mapping")
        return f"must be {expected}{given}"
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    return str(err.get("msg", kind))


def _declared_secret(loc: Sequence[Any]) -> bool:
    """Whether the value at `loc` is, or is inside, a field declared secret (`SecretStr`, `SECRET`)
    or opaque (`OPAQUE`, or a section a model does not validate): its input is never quoted."""
    cls: Any = Settings
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = cls.model_fields.get(str(part))
        if field is None:
            # A key of a mapping field (walked past already) or an extra key: a sink plugin's section.
            if cls.model_config.get("extra") == "allow":
                return True
            continue
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
        if SECRET in field.metadata or OPAQUE in field.metadata or SecretStr in candidates:
            return True
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return False


def _fields_at(loc: Sequence[Any]) -> list[str]:
    """The keys the model at `loc` accepts, for "did you mean" hints."""
    cls: Any = Settings
    for part in loc:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(str(part))
        if field is None:
            return []
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if cls is None:
            return []
    return list(cls.model_fields)
