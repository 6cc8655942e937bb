"""The `sink.mlflow` section of the MLflow sink (`tracejudge.consumer.sinks.mlflow`), and its credentials.

A `SinkSection` (`tracejudge.consumer.sinks.base`): validated by pydantic, every bad key named
(`sink.mlflow.max_concurrency: must be >= 1, got 0`). `tracking_uri` defaults to MLflow's own
`MLFLOW_TRACKING_URI`; the credentials are read once at start-up (`resolve`), so an unreadable
`token_file` or half a basic-auth pair is reported before anything runs. The section holds the names of
the secrets' variables and file, never their values.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Self
from urllib.parse import urlsplit

import httpx
from pydantic import Field, ValidationInfo, field_validator, model_validator

from tracejudge.consumer.sinks.base import OptionalName, SinkSection, key_from_environment
from tracejudge.consumer.sinks.waiting import RetryAttempts, RetryBackoffS, RetryMaxBackoffS, RetryWindowS
from tracejudge.metrics.judges.secrets import redact_url, url_problem
from tracejudge.schemas.errors import ConfigError

__all__ = ["Bearer", "MlflowSinkSettings"]


class MlflowSinkSettings(SinkSection):
    """The `sink.mlflow` section. Holds the names of the secrets' variables and file, never their values."""

    section_key: ClassVar[str] = "sink.mlflow"

    # Required: the key, else MLFLOW_TRACKING_URI.
    tracking_uri: str = Field(default="", validate_default=True)
    # Optional (`OptionalName`: a stated empty value, an environment override `..._TOKEN_ENV=`, means none).
    experiment_id: OptionalName = None
    # The environment variable holding a bearer token (read when neither token_file nor basic auth is set);
    # empty: none.
    token_env: OptionalName = "MLFLOW_TRACKING_TOKEN"
    # A file holding a bearer token, read at start-up; it comes before the variables.
    token_file: OptionalName = None
    # The environment variable holding the basic-auth user (with password_env: both set, or neither).
    username_env: OptionalName = "MLFLOW_TRACKING_USERNAME"
    # The environment variable holding the basic-auth password.
    password_env: OptionalName = "MLFLOW_TRACKING_PASSWORD"
    # Requests to the tracking server in flight at once, at most.
    max_concurrency: int = Field(default=16, ge=1)
    # A trace not on the server yet is looked for again until this long after the first look (and
    # unknown_trace_attempts looks), then given up on (0: after the looks alone).
    unknown_trace_retry_s: RetryWindowS
    # Looks for a trace not on the server yet before it is given up on (once unknown_trace_retry_s has passed
    # too).
    unknown_trace_attempts: RetryAttempts
    # The first wait before a trace not on the server is looked for again; each later wait doubles, up
    # to the cap (the results of that trace wait parked meanwhile; the partition's others are written).
    unknown_trace_backoff_s: RetryBackoffS
    # The cap of the doubling wait between looks for a trace not on the server yet.
    unknown_trace_max_backoff_s: RetryMaxBackoffS
    # Also write each result's computed metrics, as code feedback from `tracejudge.metrics`.
    write_metrics: bool = False
    # How long one request to the tracking server may take.
    timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _uri_from_environment(cls, data: Any, info: ValidationInfo) -> Any:
        return key_from_environment(data, info, "tracking_uri", "MLFLOW_TRACKING_URI")

    @field_validator("tracking_uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if not v:
            raise ValueError("required (or set MLFLOW_TRACKING_URI)")
        if problem := _check_uri(v):
            raise ValueError(problem)
        return v.rstrip("/")

    def resolve(self, env: Mapping[str, str]) -> Self:
        """Read the credentials once, so a problem with them is reported at start-up."""
        self.auth(env, where="")
        return self

    def auth(self, env: Mapping[str, str] | None = None, where: str = "sink.mlflow") -> httpx.Auth | None:
        """The credentials: `token_file`, else basic auth when both of its variables are set, else
        the token variable, else none (MLflow's order, with an explicit file first). A `ConfigError`
        names the key under `where` ("" for keys relative to the section)."""
        env = os.environ if env is None else env

        def key(name: str) -> str:
            return f"{where}.{name}" if where else name

        if self.token_file:
            path = Path(self.token_file).expanduser()
            try:
                token = path.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(key("token_file"), f"cannot read {path}: {exc.strerror}") from None
            if not token:
                raise ConfigError(key("token_file"), f"{path} is empty")
            return Bearer(token)
        user = env.get(self.username_env) if self.username_env else None
        password = env.get(self.password_env) if self.password_env else None
        if user and password:
            return httpx.BasicAuth(user, password)
        if user or password:
            missing = self.password_env if user else self.username_env
            raise ConfigError(key("password_env" if user else "username_env"),
                              f"basic auth needs {missing} set too")
        token = env.get(self.token_env) if self.token_env else None
        if token and token.strip():
            return Bearer(token.strip())
        return None

    def auth_key(self, env: Mapping[str, str] | None = None) -> str:
        """The key to blame when the server refuses the credentials."""
        env = os.environ if env is None else env
        if self.token_file:
            return "token_file"
        if self.username_env and env.get(self.username_env):
            return "username_env"
        return "token_env"


def _check_uri(uri: str) -> str | None:
    """Why `uri` cannot be the tracking URI; the URI is quoted only through `redact_url`."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return f"expected an http(s):// URL of an MLflow tracking server, got {redact_url(uri)!r}"
    if parts.scheme not in ("http", "https") or not parts.netloc:
        hint = " (a Databricks workspace is not supported)" if uri.startswith("databricks") else ""
        return f"expected an http(s):// URL of an MLflow tracking server, got {redact_url(uri)!r}{hint}"
    return url_problem(uri, query=False,
                       credentials_go_in="token_env / token_file, or username_env and password_env")


class Bearer(httpx.Auth):
    """`Authorization: Bearer …`, with a repr that does not show the token."""

    def __init__(self, token: str) -> None:
        self._header = f"Bearer {token}"

    def auth_flow(self, request: httpx.Request):  # type: ignore[no-untyped-def]
        request.headers["Authorization"] = self._header
        yield request

    def __repr__(self) -> str:
        return "Bearer(<redacted>)"
