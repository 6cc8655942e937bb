"""The `kafka:` section: connection, consumer group and security, passed to kafka-python's clients
(`tracejudge.consumer.config`). A SASL/OAUTHBEARER token provider is user code, loaded by the one plug-in
loader (`tracejudge.metrics.plugins`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from tracejudge.consumer.config.common import Section, split_list
from tracejudge.metrics.plugins import load_plugin
from tracejudge.schemas.errors import ConfigError

__all__ = ["KafkaSettings", "load_token_provider"]


class KafkaSettings(Section):
    """Connection, consumer-group and security settings, passed to kafka-python's clients."""

    # The brokers to connect to first, as host:port (a comma-separated list in the environment).
    bootstrap_servers: list[str] = Field(default_factory=lambda: ["localhost:9092"], min_length=1)
    # The client id the consumer and producer send to the brokers (in their logs and quotas).
    client_id: str = "tracejudge"
    # The consumer group of `tracejudge run`; replicas in one group share the partitions.
    group_id: str = Field(default="tracejudge", min_length=1)
    # Static membership: only useful with stable pod identities (a StatefulSet).
    group_instance_id: str | None = None
    # Where a group with no committed offset starts reading a partition.
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    # How long the group coordinator waits for a heartbeat before it drops this consumer and rebalances.
    session_timeout_ms: int = Field(default=10_000, gt=0)
    # How often the consumer sends heartbeats; lower than session_timeout_ms (a third of it is usual).
    heartbeat_interval_ms: int = Field(default=2_000, gt=0)
    # The longest time between two polls before the consumer is considered failed and leaves the group.
    max_poll_interval_ms: int = Field(default=300_000, gt=0)
    # Records returned by one poll, at most.
    max_poll_records: int = Field(default=500, gt=0)
    # Bytes a fetch request returns, at most.
    fetch_max_bytes: int = Field(default=52_428_800, gt=0)
    # Bytes a fetch returns per partition, at most.
    max_partition_fetch_bytes: int = Field(default=1_048_576, gt=0)
    # How long a request to a broker may take before it is retried or fails.
    request_timeout_ms: int = Field(default=30_000, gt=0)
    # How long the first connection may take before start-up fails.
    bootstrap_timeout_ms: int = Field(default=30_000, gt=0)
    # How long an offset commit may take before it counts as failed.
    commit_timeout_ms: int = Field(default=10_000, gt=0)

    # How the clients talk to the brokers: plain or TLS, with or without SASL.
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    # The SASL mechanism; required with a SASL_* security_protocol, refused without one.
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI",
                            "AWS_MSK_IAM"] | None = None
    # The user of PLAIN and SCRAM authentication.
    sasl_plain_username: str | None = None
    # The password of PLAIN and SCRAM authentication (best from the environment).
    sasl_plain_password: SecretStr | None = None
    # GSSAPI: the brokers' Kerberos service name.
    sasl_kerberos_service_name: str = "kafka"
    # GSSAPI: the Kerberos domain, when not the brokers' host names.
    sasl_kerberos_domain_name: str | None = None
    # OAUTHBEARER: "package.module:factory" returning a kafka.net.sasl.oauth.AbstractTokenProvider ...
    sasl_oauth_token_provider: str | None = None
    # ... or a file holding the token, re-read on every authentication (a mounted, rotated secret).
    sasl_oauth_token_file: Path | None = None
    # A CA certificate file (PEM) to verify the brokers with; must exist.
    ssl_cafile: Path | None = None
    # The client certificate file (PEM) for mutual TLS; must exist.
    ssl_certfile: Path | None = None
    # The client's private key file (PEM); needs ssl_certfile.
    ssl_keyfile: Path | None = None
    # The password of ssl_keyfile, when it is encrypted.
    ssl_password: SecretStr | None = None
    # A certificate revocation list file (PEM) to check the brokers' certificates against.
    ssl_crlfile: Path | None = None
    # Check that a broker's certificate names its host.
    ssl_check_hostname: bool = True
    # The TLS ciphers allowed, in OpenSSL's cipher list format; unset: Python's defaults.
    ssl_ciphers: str | None = None

    _split = field_validator("bootstrap_servers", mode="before")(split_list)

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
            raise ConfigError("heartbeat_interval_ms", f"must be lower than session_timeout_ms "
                              f"({self.session_timeout_ms}); a third of it is usual")
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and self.sasl_mechanism is None:
            raise ConfigError("sasl_mechanism", f"is required with security_protocol "
                              f"{self.security_protocol}")
        if not sasl and self.sasl_mechanism is not None:
            raise ConfigError("security_protocol", f"must be SASL_SSL or SASL_PLAINTEXT to use "
                              f"sasl_mechanism {self.sasl_mechanism}")
        if self.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            # kafka-python builds, but does not raise, this error for SCRAM: it would surface later
            # as a confusing authentication failure.
            if not self.sasl_plain_username:
                raise ConfigError("sasl_plain_username", f"is required with sasl_mechanism "
                                  f"{self.sasl_mechanism}")
            if self.sasl_plain_password is None:
                raise ConfigError("sasl_plain_password", f"is required with sasl_mechanism "
                                  f"{self.sasl_mechanism}")
        if self.sasl_mechanism == "OAUTHBEARER":
            if (self.sasl_oauth_token_provider is None) == (self.sasl_oauth_token_file is None):
                raise ConfigError("sasl_oauth_token_provider", "OAUTHBEARER needs exactly one of "
                                  "sasl_oauth_token_provider or sasl_oauth_token_file")
            if self.sasl_oauth_token_provider is not None:
                load_token_provider(self.sasl_oauth_token_provider, "sasl_oauth_token_provider")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ConfigError("ssl_certfile", "is required with ssl_keyfile")
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
                    load_token_provider(self.sasl_oauth_token_provider) if self.sasl_oauth_token_provider
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


def load_token_provider(spec: str, key: str = "kafka.sasl_oauth_token_provider") -> Any:
    """Import "package.module:attr" (`tracejudge.metrics.plugins`); a class (or factory) is called
    without arguments. A `ConfigError` naming `key` when it gives no token provider."""
    obj = load_plugin(spec, key=key, noun="token provider")
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "token")):
        try:
            obj = obj()
        except (TypeError, ValueError) as exc:
            raise ConfigError(key, f"{spec!r} cannot be called without arguments: {exc}") from None
    if not callable(getattr(obj, "token", None)):
        raise ConfigError(key, f"{spec!r} must give a token provider with a token() method")
    return obj


def _file_token_provider(path: Path | None) -> Any:
    from kafka.net.sasl.oauth import AbstractTokenProvider

    assert path is not None

    class FileTokenProvider(AbstractTokenProvider):
        # Re-read at every authentication so a rotated token (a mounted secret) is picked up.
        def token(self) -> str:
            return path.read_text().strip()

    return FileTokenProvider()
