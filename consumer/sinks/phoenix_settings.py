"""The `sink.phoenix` section of the Phoenix sink (`tracejudge.consumer.sinks.phoenix`), and its API key.

A `SinkSection` (`tracejudge.consumer.sinks.base`): validated by pydantic, every bad key named
(`sink.phoenix.timeout_s: must be > 0, got 0`). `endpoint` defaults to Phoenix's own
`PHOENIX_COLLECTOR_ENDPOINT`; the API key is read once at start-up (`resolve`), so an unreadable
`api_key_file` is reported before anything runs. The section holds the name of the key's variable and
file, never the key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Self
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tracejudge.consumer.sinks.base import OptionalName, SinkSection, key_from_environment
from tracejudge.consumer.sinks.waiting import RetryAttempts, RetryBackoffS, RetryMaxBackoffS, RetryWindowS
from tracejudge.metrics.judges.secrets import redact_url, url_problem
from tracejudge.schemas.errors import ConfigError

__all__ = ["PhoenixSinkSettings"]


class PhoenixSinkSettings(SinkSection):
    """The `sink.phoenix` section. Holds the name of the API key's variable and file, never the key."""

    section_key: ClassVar[str] = "sink.phoenix"

    # Required: the key, else PHOENIX_COLLECTOR_ENDPOINT (Phoenix's own variable, its base URL).
    endpoint: str = Field(default="", validate_default=True)
    # The project checked at start-up (a warning when it has no traces yet). Span and session ids are
    # global in Phoenix, so writes do not need it.
    project_name: str = Field(default="default", min_length=1)
    # The environment variable holding the API key (when api_key_file is not set); empty: none.
    api_key_env: OptionalName = "PHOENIX_API_KEY"
    # A file holding the API key, read at start-up; it comes before the variable.
    api_key_file: OptionalName = None
    # Annotations per request (Phoenix inserts a request's annotations in one transaction).
    max_batch_annotations: int = Field(default=100, ge=1, le=1000)
    # How long one request to Phoenix may take.
    timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # A span (or session) not in Phoenix yet: looked for again after a back-off doubling from
    # `unknown_span_backoff_s` up to `unknown_span_max_backoff_s`; given up on after
    # `unknown_span_attempts` looks once `unknown_span_retry_s` have passed since the first.
    unknown_span_retry_s: RetryWindowS
    # Looks for a span (or session) not in Phoenix yet before it is given up on (once unknown_span_retry_s has
    # passed too).
    unknown_span_attempts: RetryAttempts
    # The first wait before a span (or session) not in Phoenix yet is looked for again; each later wait
    # doubles.
    unknown_span_backoff_s: RetryBackoffS
    # The cap of the doubling wait between looks.
    unknown_span_max_backoff_s: RetryMaxBackoffS

    @model_validator(mode="before")
    @classmethod
    def _endpoint_from_environment(cls, data: Any, info: ValidationInfo) -> Any:
        return key_from_environment(data, info, "endpoint", "PHOENIX_COLLECTOR_ENDPOINT")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if not v:
            raise ValueError("required (or set PHOENIX_COLLECTOR_ENDPOINT)")
        try:
            parts = urlsplit(v)
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"expected an http(s):// URL of a Phoenix server, got {redact_url(v)!r}")
        if problem := url_problem(v, query=False, credentials_go_in="api_key_env / api_key_file"):
            raise ValueError(problem)
        return v.rstrip("/")

    def resolve(self, env: Mapping[str, str]) -> Self:
        """Read the API key once, so a problem with it is reported at start-up."""
        self.api_key(env, where="")
        return self

    def api_key(self, env: Mapping[str, str] | None = None, where: str = "sink.phoenix") -> str | None:
        """The API key: `api_key_file`, else the `api_key_env` variable, else none (a Phoenix without
        authentication). A `ConfigError` names the key under `where` ("" for keys relative to the
        section); the key itself is never in it."""
        env = os.environ if env is None else env
        if self.api_key_file:
            path = Path(self.api_key_file).expanduser()
            key = f"{where}.api_key_file" if where else "api_key_file"
            try:
                value = path.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
            if not value:
                raise ConfigError(key, f"{path} is empty")
            return value
        value = env.get(self.api_key_env) if self.api_key_env else None
        return value.strip() if value and value.strip() else None

    def auth_key(self) -> str:
        """The key to blame when Phoenix refuses the credentials."""
        return "api_key_file" if self.api_key_file else "api_key_env"
