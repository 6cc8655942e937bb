"""The sections of `tracejudge run`: `stream:` (what to consume and where results go), `producer:`, `http:`,
`prometheus:`, `logging:` and `otlp:` (span assembly) (`tracejudge.consumer.config`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tracejudge.consumer.config.common import (
    ENV_NESTING,
    ENV_PREFIX,
    TOPIC_NAME,
    Section,
    optional_topic,
    split_list,
)
from tracejudge.consumer.config.external_evaluations import ExternalEvaluationsSettings
from tracejudge.metrics.sections import BuiltSection
from tracejudge.schemas.errors import ConfigError

__all__ = ["AssemblySection", "AssemblySettings", "HttpSettings", "LoggingSettings", "OtlpSettings",
           "ProducerSettings", "PrometheusSettings", "StreamSettings", "TopicSpec"]


class TopicSpec(Section):
    """A topic to consume and the format of its records (`auto` detects per record)."""

    # The Kafka topic.
    name: str
    # The format of its records; `auto` detects it per record.
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
        if not TOPIC_NAME.match(v) or v in (".", ".."):
            raise ValueError(f"{v!r} is not a valid Kafka topic name (letters, digits, '.', '_', '-'; "
                             "at most 249 characters)")
        return v

    def __str__(self) -> str:
        return f"{self.name}:{self.format}"


class StreamSettings(Section):
    """What to consume, where results and dead letters go, and the limits of the runner."""

    # The topics to consume, each `name` or `name:format` (`format` as in `stream.topics[].format`); required
    # by `tracejudge run`. A comma-separated list in the environment.
    topics: list[TopicSpec] = Field(default_factory=list)
    # The topic each record's result (its metrics and verdicts, one JSON line) is published to; unset: results
    # are only exported to Prometheus.
    results_topic: str | None = None
    # The topic records that cannot be evaluated go to, with the reason; unset: they are logged and counted,
    # and skipped.
    dead_letter_topic: str | None = None
    # The trace tag whose value names the app (the `app` label); else the source's own notion.
    app_tag: str | None = None
    # The trace tag (MLflow tag or metadata key, span attribute, row field) whose value is the
    # record's session id, over the conventions (`mlflow.trace.session`, `session.id`, ...).
    session_tag: str | None = None
    # The trace tag (as session_tag) whose value is the record's version, the app's release, over the
    # conventions (`mlflow.modelId`, `gen_ai.agent.version`, `service.version`, a `version` column).
    version_tag: str | None = None
    # Records fetched and not yet exported; past it fetching pauses (memory stays bounded).
    max_in_flight: int = Field(default=2_000, gt=0)
    # Processes that decode and score MLflow / agent-evaluation / inference-log records beside the
    # consumer (consumer/stages/decoding.py); 0 decodes on the poll thread. "auto": one when the
    # process may use two CPUs or more (affinity and cgroup quota) and a topic can use it, else 0.
    decode_workers: int | Literal["auto"] = "auto"
    # Larger records are dead-lettered (reason too_large) without being parsed.
    max_record_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # How often the offsets of records whose results are exported are committed (0: after every poll).
    commit_interval_ms: int = Field(default=1_000, ge=0)
    # On SIGTERM or revocation: how long in-flight records may take to finish before we give up on
    # them (they are re-delivered).
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    # How long one poll waits for records when there are none.
    poll_timeout_ms: int = Field(default=250, gt=0)
    # How often the consumer lag of the assigned partitions is measured and exported.
    lag_interval_seconds: float = Field(default=2.0, gt=0)
    # `gen_ai.evaluation.result` events of other evaluators on the logs topics
    # (docs/pages/inputs/opentelemetry.md, "Verdicts from other evaluators").
    external_evaluations: ExternalEvaluationsSettings = Field(default_factory=ExternalEvaluationsSettings)

    _split = field_validator("topics", mode="before")(split_list)

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

    _sink_topic = field_validator("results_topic", "dead_letter_topic")(optional_topic)

    @model_validator(mode="after")
    def _coherent(self, info: ValidationInfo) -> StreamSettings:
        # `tracejudge eval` reads the same file for its metrics/judges sections and consumes nothing.
        if not self.topics and not (info.context or {}).get("offline"):
            raise ConfigError("topics", "at least one topic is required (--topic NAME[:FORMAT], "
                              f"{ENV_PREFIX}STREAM{ENV_NESTING}TOPICS or stream.topics in the file)")
        names = [t.name for t in self.topics]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(f"topics[{i}]", f"topic {name!r} is listed twice")
        for key in ("results_topic", "dead_letter_topic"):
            if (sink := getattr(self, key)) in names:
                raise ConfigError(key, f"{sink!r} is also a consumed topic; tracejudge would read its "
                                  "own output")
        return self


class ProducerSettings(Section):
    """The producer that writes results and dead letters (acks=all, idempotent)."""

    # One result per record (~3 KB) at thousands a second: kafka-python builds batches in Python,
    # so its cost is mostly per batch. 10 ms / 256 KB (100 results a batch) against 5 ms / 64 KB
    # measured 254 -> 219 µs of CPU per record with a results topic, and +19% records/s; 256 KB
    # stays far below a broker's default message.max.bytes (1 MB).
    linger_ms: int = Field(default=10, ge=0)
    # Bytes of records the producer batches per partition before it sends them.
    batch_size: int = Field(default=262_144, gt=0)
    # How produced batches are compressed; unset: not compressed.
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    # Bytes one produce request may hold, at most (the broker's message.max.bytes bounds it too).
    max_request_size: int = Field(default=1_048_576, gt=0)
    # How long the producer tries to deliver a record before it reports it failed (it is then sent again after
    # retry_backoff_seconds).
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

    # Serve /metrics, /healthz and /readyz.
    enabled: bool = True
    # The address the endpoint listens on (`127.0.0.1`: this host only).
    bind_address: str = "0.0.0.0"
    # 0 picks a free port (tests); the bound port is logged.
    port: int = Field(default=9464, ge=0, le=65535)


class PrometheusSettings(Section):
    # Distinct `app` label values before new ones are exported as "other".
    max_apps: int = Field(default=100, gt=0)
    # Distinct `version` label values per app on the judge verdict series: the most recently first seen
    # are kept, records of older (retired) versions are exported as "other".
    max_versions: int = Field(default=5, gt=0)


class LoggingSettings(Section):
    # The lowest level logged.
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # "text" for people, "json" for log pipelines.
    format: Literal["text", "json"] = "text"

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class AssemblySettings(BuiltSection, Section):
    """`otlp.assembly`: how OTLP spans are held until their trace is whole
    (`tracejudge.consumer.stages.assembly.TraceAssembler`). Built directly (`AssemblySettings(
    max_wait_s=1)`), a bad value is a `ConfigError` naming its key."""

    # Emit a trace this long after its last span arrived, once its root span is in.
    quiet_period_s: float = Field(default=5.0, gt=0)
    # Emit a trace (incomplete) this long after its first span arrived, root or not.
    max_wait_s: float = Field(default=60.0, gt=0)
    # Traces assembled at once, at most; beyond it the oldest is emitted incomplete (evicted).
    max_open_traces: int = Field(default=20_000, gt=0)
    # Spans held in memory, at most; beyond it the oldest trace is emitted incomplete (evicted).
    max_spans_held: int = Field(default=200_000, gt=0)
    # Emitted trace ids remembered, so that a late span of one is dropped (counted) rather than starting a new
    # trace.
    remember_emitted: int = Field(default=100_000, gt=0)

    @model_validator(mode="after")
    def _coherent(self) -> AssemblySettings:
        if self.max_wait_s < self.quiet_period_s:
            raise ConfigError("max_wait_s", f"must be at least quiet_period_s ({self.quiet_period_s})")
        return self

    def to_settings(self) -> AssemblySettings:
        """The assembly's settings: this section itself (kept for callers of the former twin)."""
        return self


class OtlpSettings(Section):
    """The `otlp:` section: how OTLP spans are assembled into traces."""

    # How the spans of OTLP topics are held until their trace is whole.
    assembly: AssemblySettings = Field(default_factory=AssemblySettings)


# The sinks shipped with tracejudge; `tracejudge sink <kind>` imports the class only when it is chosen.


# The name the section had beside its former dataclass twin.
AssemblySection = AssemblySettings
