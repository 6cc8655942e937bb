"""The judge endpoints of the `judges:` section (`judges.endpoints.<name>`), and their secrets.

`EndpointConfig` is one OpenAI-compatible endpoint: where it is, which model, how hard to call it
(concurrency, retries, rate and token budgets, the circuit breaker), its price and spend caps. Its API
key and secret headers never live in the configuration: `resolve_api_key` and `resolve_headers` read
them from the environment or a file when the runner (`tracejudge.metrics.judges.runner`) builds a
client (`tracejudge.metrics.judges.client`). The rest of the section is
`tracejudge.metrics.judges.config`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from tracejudge.metrics.judges.secrets import SECRET, redact_url, url_problem
from tracejudge.metrics.sections import Section
from tracejudge.schemas.errors import JudgeConfigError

__all__ = ["EndpointConfig", "EndpointPrice", "StrictSection", "resolve_api_key", "resolve_headers"]

# Keys a user may write to give the API key inline: refused with a pointer to where it belongs.
_INLINE_KEYS = ("api_key", "apikey", "api-key", "key", "token", "api_token", "bearer_token")


class StrictSection(Section):
    # The judges' sections (`tracejudge.metrics.sections`: unknown keys are errors) are frozen: a
    # runner shares them between threads.
    model_config = ConfigDict(frozen=True)


class EndpointPrice(StrictSection):
    """A judge model's price in USD per million input and output tokens."""

    # USD per million input tokens.
    input_per_mtok: float = Field(ge=0)
    # USD per million output tokens.
    output_per_mtok: float = Field(ge=0)


class EndpointConfig(StrictSection):
    """An OpenAI-compatible endpoint (OpenAI, Azure OpenAI, vLLM, Ollama, LiteLLM, Databricks serving).

    `base_url` is the prefix before `/chat/completions` (e.g. `https://api.openai.com/v1`,
    `http://localhost:11434/v1`, `https://<workspace>/serving-endpoints`, or an Azure deployment URL
    `https://<res>.openai.azure.com/openai/deployments/<deployment>` with `query_params:
    {api-version: ...}` and `api_key_header: api-key`).
    """

    # The URL before `/chat/completions` (see above).
    base_url: str
    # The model the judges ask.
    model: str = Field(min_length=1)
    # The model of the embeddings calls (answer_relevancy, findings clustering); unset: none.
    embedding_model: str | None = None
    # Where the key comes from; never the key itself, so a config file can be committed.
    api_key_env: str | None = None
    # A file holding the API key (a mounted secret); not with api_key_env.
    api_key_file: str | None = None
    # "authorization" sends `Authorization: Bearer <key>`; any other name sends the bare key in that
    # header (Azure OpenAI: `api-key`).
    api_key_header: str = "authorization"
    # Header values are secrets (SECRET): never printed or logged. Prefer `headers_from_env`.
    headers: Annotated[dict[str, str], SECRET] = Field(default_factory=dict, repr=False)
    # Header name -> environment variable holding its value (tokens other than the API key).
    headers_from_env: dict[str, str] = Field(default_factory=dict)
    # Values are secrets (SECRET: a signature or key, `?code=`, `?sig=`): never printed or logged.
    query_params: Annotated[dict[str, str], SECRET] = Field(default_factory=dict, repr=False)
    # The path of chat completions, after base_url.
    chat_path: str = "/chat/completions"
    # The path of embeddings, after base_url.
    embeddings_path: str = "/embeddings"
    # Verify the endpoint's TLS certificate: true, false, or the path of a CA bundle.
    verify_tls: bool | str = True
    # How long one request may take.
    timeout_seconds: float = Field(default=30.0, gt=0)
    # How long connecting may take.
    connect_timeout_seconds: float = Field(default=5.0, gt=0)
    # Requests to the endpoint in flight at once, at most.
    max_concurrency: int = Field(default=16, ge=1, le=1024)
    # Times a failed request (network error, 429, 5xx) is sent again.
    max_retries: int = Field(default=3, ge=0, le=10)
    # The first wait before a retry; it doubles per retry (with jitter), up to backoff_max_seconds.
    backoff_initial_seconds: float = Field(default=0.5, ge=0)
    # The cap of the wait between retries.
    backoff_max_seconds: float = Field(default=20.0, ge=0)
    # A Retry-After longer than this is not waited for: the judgement fails as rate_limited instead of
    # holding an in-flight slot for minutes.
    max_retry_after_seconds: float = Field(default=30.0, ge=0)
    # Structured output: json_schema (OpenAI, vLLM, Ollama>=0.5, LiteLLM), json_object, or none.
    # The client steps down this list by itself when the endpoint rejects a format.
    response_format: Literal["json_schema", "json_object", "none"] = "json_schema"
    # None: do not send (o-series models reject anything but their default).
    temperature: float | None = 0.0
    # The answer's length limit sent with each request.
    max_output_tokens: int = Field(default=512, ge=16)
    # The request field that carries max_output_tokens (newer OpenAI models want max_completion_tokens).
    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    # The judge's input budget in tokens (estimated at 4 characters per token); longer contexts are
    # judged in chunks.
    max_input_tokens: int = Field(default=8000, ge=256)
    # Requests per second sent, at most (a token bucket); unset: no limit.
    requests_per_second: float | None = Field(default=None, gt=0)
    # Tokens per minute sent (estimated), at most; unset: no limit.
    tokens_per_minute: int | None = Field(default=None, gt=0)
    # Consecutive failed requests that open the circuit breaker (calls are refused while it is open).
    breaker_failure_threshold: int = Field(default=5, ge=1)
    # How long the breaker stays open before it lets one probe through; a failed probe reopens it for twice as
    # long.
    breaker_reset_seconds: float = Field(default=30.0, gt=0)
    # The cap of the breaker's doubling open time.
    breaker_max_reset_seconds: float = Field(default=300.0, gt=0)
    # What the endpoint's model costs, USD per million tokens (a self-hosted or unlisted model); None:
    # the price table's price for `model` (tracejudge.metrics.cost).
    price: EndpointPrice | None = None
    # Hard spend caps in USD over the last hour / day (tracejudge.metrics.judges.budget.SpendCap). A cap
    # needs a price: a configured one, or the table's for `model` (checked at start-up).
    usd_per_hour: float | None = Field(default=None, gt=0)
    # Hard spend cap in USD over the last day (as usd_per_hour).
    usd_per_day: float | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _no_inline_key(cls, data: Any) -> Any:
        # The key itself never goes in a file that may be committed or printed; say where it belongs
        # (the value is not repeated in the message).
        if isinstance(data, Mapping):
            inline = next((k for k in _INLINE_KEYS if k in data), None)
            if inline is not None:
                raise ValueError(
                    f"{inline}: the API key is not written in the configuration; set api_key_env "
                    "to the name of the environment variable that holds it, or api_key_file to a "
                    "file that holds it"
                )
        return data

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        # Credentials or a query in the URL would be printed by --check-config and logged by HTTP
        # libraries; they have settings of their own, read from the environment or a file.
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"must be an http(s) URL, got {redact_url(v)!r}")
        problem = url_problem(v, query=False, query_goes_in="query_params",
                              credentials_go_in="api_key_env or api_key_file (the key), or headers_from_env")
        if problem:
            raise ValueError(problem)
        return v.rstrip("/")

    @field_validator("chat_path", "embeddings_path")
    @classmethod
    def _path(cls, v: str) -> str:
        return v if v.startswith("/") else "/" + v

    @model_validator(mode="after")
    def _one_key_source(self) -> EndpointConfig:
        if self.api_key_env and self.api_key_file:
            raise ValueError("set api_key_env or api_key_file, not both")
        return self


def resolve_api_key(
    name: str, endpoint: EndpointConfig, env: Mapping[str, str] | None = None, *, prefix: str = "judges"
) -> str | None:
    """Read an endpoint's key from its environment variable or file; None when it names neither."""
    env = os.environ if env is None else env
    key = f"{prefix}.endpoints.{name}"
    if endpoint.api_key_env:
        value = env.get(endpoint.api_key_env)
        if not value:
            raise JudgeConfigError(
                f"{key}.api_key_env", f"environment variable {endpoint.api_key_env} is not set or empty"
            )
        return value.strip()
    if endpoint.api_key_file:
        path = Path(endpoint.api_key_file).expanduser()
        try:
            value = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise JudgeConfigError(f"{key}.api_key_file", f"cannot read {path}: {exc.strerror}") from None
        if not value:
            raise JudgeConfigError(f"{key}.api_key_file", f"{path} is empty")
        return value
    return None


def resolve_headers(
    name: str, endpoint: EndpointConfig, env: Mapping[str, str] | None = None, *, prefix: str = "judges"
) -> dict[str, str]:
    """The headers whose values come from the environment (`headers_from_env`); treated as secrets."""
    env = os.environ if env is None else env
    headers: dict[str, str] = {}
    for header, var in endpoint.headers_from_env.items():
        value = env.get(var)
        if not value:
            raise JudgeConfigError(
                f"{prefix}.endpoints.{name}.headers_from_env.{header}",
                f"environment variable {var} is not set or empty",
            )
        headers[header] = value
    return headers
