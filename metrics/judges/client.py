"""An asynchronous client for OpenAI-compatible Chat Completions and Embeddings endpoints.

One `JudgeClient` per configured endpoint. It owns an `httpx.AsyncClient` (connection pool sized to
the endpoint's concurrency), a semaphore bounding requests in flight, retries with exponential backoff
and full jitter on 429 / 5xx / timeouts / connection errors (a Retry-After or retry-after-ms header is
honoured up to `max_retry_after_seconds`), and a circuit breaker: after `breaker_failure_threshold`
consecutive failed requests it refuses calls for `breaker_reset_seconds`, then lets one probe through
(half-open); a failed probe reopens it for twice as long (up to `breaker_max_reset_seconds`).

The breaker keeps its word:
- it is asked once a connection slot is held, right before a request leaves, so a call that waited for a
  slot while the circuit opened is refused instead of sent: once open, no request leaves before the
  reset, then exactly one probe;
- a call refused before it sent anything fails with `circuit_open` and `attempted=False` (the runner
  skips the judgement); a call whose retry is refused fails with the error its last attempt got
  (`http_5xx`, `timeout`, `rate_limited`, ...), which is what happened to it;
- a 429 whose Retry-After is within `max_retry_after_seconds` is back-pressure, not a failure: the call
  waits and retries and the breaker does not count it (a probe answered so closes the circuit: the
  endpoint is up). A 429 without a usable Retry-After, or asking for longer, is a failure.
The breaker, the call error and `CallLedger` (what all the calls of one judgement did, several may run
concurrently) are `tracejudge.metrics.judges.breaker`.

Secrets: the API key is sent in a header and never logged; prompts are never logged; endpoint error
text that reaches a result or a log is truncated and has any secret value masked, and so is every
answer a judge returns (a model asked about its key may echo it). The HTTP libraries' loggers carry
`tracejudge.metrics.judges.secrets.HttpLogFilter` (URLs and credential headers) and this module's
`SecretValueLogFilter`, which masks the secret values of the open clients in every record at every
level (a response header echoing the key, in httpcore's DEBUG trace).

Redaction: this client is the one egress point for production text, so with a `redactor` every chat
message and embeddings input passes the judgement's `Redaction` session (tracejudge.metrics.judges.redaction)
before the request body is built; a text with nothing to replace is sent byte for byte as it was.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import logging
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from tracejudge.metrics.judges.breaker import CircuitBreaker, JudgeCallError, Permit, current_call_ledger
from tracejudge.metrics.judges.endpoints import EndpointConfig
from tracejudge.metrics.judges.redaction import Redaction, RedactionError, Redactor, current_redaction
from tracejudge.metrics.judges.secrets import HTTP_LOGGERS, guard_http_loggers

__all__ = [
    "ChatResult",
    "EmbeddingResult",
    "JudgeClient",
    "SecretValueLogFilter",
    "parse_retry_after",
]

log = logging.getLogger(__name__)

_FORMATS = ("json_schema", "json_object", "none")
# Connections per httpx pool (see `_open`).
POOL_SHARD = 8
_DETAIL_MAX = 200
_MASK = "***"
# An API key or a header value from the environment shorter than this is not masked (nor could it be
# told from ordinary words); a value written in the configuration must be longer still to be taken for a
# credential in a judge's answer (`X-Team: search` must not turn every "search" into "***").
_SECRET_MIN = 4
_CONFIG_SECRET_MIN = 8
# Headers whose configured value is a credential whatever its length.
_CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "api-key", "x-api-key", "cookie"})


@dataclass(slots=True)
class ChatResult:
    content: str
    input_tokens: int | None
    output_tokens: int | None
    requests: int


@dataclass(slots=True)
class EmbeddingResult:
    vectors: list[list[float]]
    input_tokens: int | None
    requests: int


@dataclass(slots=True)
class _Failure:
    """One attempt that produced no usable answer, and what it means for the retry loop."""

    reason: str
    detail: str
    status: int | None = None
    retryable: bool = True
    retry_after: float | None = None
    body: str = ""

    def error(self, requests: int, note: str = "") -> JudgeCallError:
        suffix = f" after {requests} attempts" if requests > 1 else ""
        return JudgeCallError(
            self.reason, self.detail + suffix + note, status=self.status, requests=requests, body=self.body
        )


class SecretValueLogFilter(logging.Filter):
    """Masks the secret values of the open judge clients (API keys, header and query values, URL
    credentials, in every encoding they travel in) in the HTTP libraries' records, at every level.
    `tracejudge.metrics.judges.secrets.HttpLogFilter` masks URLs and credential headers by their shape; this
    catches a secret anywhere else in a record (a response header echoing the key in httpcore's DEBUG
    trace). It never drops a record."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()
        self._values: tuple[str, ...] = ()

    def hold(self, values: Iterable[str]) -> None:
        with self._lock:
            self._held.update(set(values))
            self._refresh()

    def release(self, values: Iterable[str]) -> None:
        with self._lock:
            self._held.subtract(set(values))
            self._held = +self._held
            self._refresh()

    def _refresh(self) -> None:
        self._values = tuple(sorted(self._held, key=len, reverse=True))  # longest first: no partial masks

    def filter(self, record: logging.LogRecord) -> bool:
        values = self._values
        if not values:
            return True
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own error handling
            return True
        masked = _mask(message, values)
        if masked != message:
            record.msg, record.args = masked, None
        return True


SECRET_VALUE_LOGS = SecretValueLogFilter()


def _guard_logs() -> None:
    """Both filters on every HTTP library logger (idempotent; a logger's filters do not see the records
    of its children, so each emitting logger carries them)."""
    guard_http_loggers()
    for name in HTTP_LOGGERS:
        logger = logging.getLogger(name)
        if SECRET_VALUE_LOGS not in logger.filters:
            logger.addFilter(SECRET_VALUE_LOGS)


def _mask(text: str, secrets: Sequence[str]) -> str:
    for s in secrets:
        if s in text:
            text = text.replace(s, _MASK)
    return text


def _forms(value: str) -> set[str]:
    """A secret as it may appear in a log line or an echoed answer: as is, percent-encoded, form-encoded
    (httpx's query strings), JSON-escaped and as Python bytes reprs (httpcore's header lists)."""
    forms = {value, quote(value, safe=""), str(httpx.QueryParams({"k": value}))[2:],
             orjson.dumps(value).decode()[1:-1], repr(value.encode())[2:-1]}
    return {f for f in forms if f}


def _mask_strings(value: Any, secrets: Sequence[str]) -> Any:
    if isinstance(value, str):
        return _mask(value, secrets)
    if isinstance(value, list):
        return [_mask_strings(v, secrets) for v in value]
    if isinstance(value, dict):
        return {_mask(k, secrets): _mask_strings(v, secrets) for k, v in value.items()}
    return value


def _secret_values(config: EndpointConfig, api_key: str | None, env_headers: Mapping[str, str]) -> list[str]:
    """The values this client masks in error text and answers, in each form they may take: the API key
    (and the `Bearer`/Basic forms it travels in), the header values from the environment, credential
    headers and long header and query values from the configuration."""
    values = {v for v in (api_key, *env_headers.values()) if v and len(v) >= _SECRET_MIN}
    for name, v in config.headers.items():
        if v and (name.lower() in _CREDENTIAL_HEADERS or len(v) >= _CONFIG_SECRET_MIN):
            values.add(v)
    values |= {v for v in config.query_params.values() if len(v) >= _CONFIG_SECRET_MIN}
    url = httpx.URL(config.base_url)
    if url.password or url.username:  # refused by the configuration; masked should one get through
        values |= {v for v in (url.password or url.username,) if len(v) >= _SECRET_MIN}
        basic = f"{url.username}:{url.password}".encode()
        values.add(base64.b64encode(basic).decode())
    forms = {f for v in values for f in _forms(v) if len(f) >= _SECRET_MIN}
    return sorted(forms, key=len, reverse=True)


def parse_retry_after(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Seconds to wait from `retry-after-ms` or `Retry-After` (delta-seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _mentions_format(body: str) -> bool:
    text = body.lower()
    return any(
        w in text for w in ("response_format", "json_schema", "json_object", "schema", "format", "guided")
    )


class JudgeClient:
    def __init__(
        self,
        name: str,
        config: EndpointConfig,
        *,
        api_key: str | None = None,
        extra_headers: dict[str, str] | None = None,
        on_request: Callable[[str, str], None] | None = None,
        on_breaker_change: Callable[[str, bool], None] | None = None,
        on_retry: Callable[[str, str], None] | None = None,
        on_refused: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        redactor: Redactor | None = None,
    ):
        """`on_request(endpoint, outcome)`: each request sent; `on_retry(endpoint, reason)`: each retry
        sent, by the reason of the attempt before it; `on_refused(endpoint, attempt)`: each call the open
        circuit refused, `attempt` "first" (nothing sent) or "retry"."""
        self.name = name
        # Every chat message and embeddings input passes it before a request body is built.
        self._redactor = redactor
        self.config = config
        self._api_key = api_key
        self._extra_headers = dict(extra_headers or {})
        # Masked in error text and in every answer (longest first, so no secret is left half-masked).
        self._secrets = _secret_values(config, api_key, self._extra_headers)
        # Masked in the HTTP libraries' log records: every configured header and query value too (but
        # not a value as short as "1", which would mask "HTTP/1.1").
        configured = (*config.headers.values(), *config.query_params.values())
        self._log_secrets = sorted(
            {f for v in configured for f in _forms(v) if len(f) >= _SECRET_MIN} | set(self._secrets),
            key=len, reverse=True)
        self._on_request = on_request
        self._on_retry = on_retry
        self._on_refused = on_refused
        self._format = config.response_format
        self._pools: list[httpx.AsyncClient] = []
        self._load: list[int] = []
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

        def breaker_changed(state: str) -> None:
            if state == CircuitBreaker.OPEN:
                log.warning(
                    "judge endpoint %s: circuit opened, calls refused for %.0fs",
                    name,
                    self.breaker._current_reset,
                )
            else:
                log.info("judge endpoint %s: circuit %s", name, state.replace("_", "-"))
            if on_breaker_change:
                on_breaker_change(name, state == CircuitBreaker.OPEN)

        self.breaker = CircuitBreaker(
            config.breaker_failure_threshold,
            config.breaker_reset_seconds,
            config.breaker_max_reset_seconds,
            clock=clock,
            on_change=breaker_changed,
        )

    def __repr__(self) -> str:  # never the key or headers
        return f"JudgeClient({self.name!r}, model={self.config.model!r})"

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def response_format(self) -> str:
        """The structured-output mode in use (it steps down when the endpoint rejects one)."""
        return self._format

    def _open(self) -> list[httpx.AsyncClient]:
        loop = asyncio.get_running_loop()
        if not self._pools:
            c = self.config
            _guard_logs()
            SECRET_VALUE_LOGS.hold(self._log_secrets)
            headers = {"content-type": "application/json", "accept": "application/json"}
            if self._api_key:
                if c.api_key_header.lower() == "authorization":
                    headers["authorization"] = f"Bearer {self._api_key}"
                else:
                    headers[c.api_key_header] = self._api_key
            headers.update(c.headers)
            # Values from the environment (secrets) last, so they win over a same-named static header.
            headers.update(self._extra_headers)
            # httpcore's pool bookkeeping costs O(connections^2) per request, which at 64 connections
            # spent ~15 ms of CPU per call; pools of POOL_SHARD connections keep it at ~1.5 ms.
            shards = math.ceil(c.max_concurrency / POOL_SHARD)
            per_pool = math.ceil(c.max_concurrency / shards)
            self._pools = [
                httpx.AsyncClient(
                    base_url=c.base_url,
                    headers=headers,
                    params=c.query_params or None,
                    timeout=httpx.Timeout(c.timeout_seconds, connect=c.connect_timeout_seconds),
                    limits=httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool),
                    verify=c.verify_tls,
                )
                for _ in range(shards)
            ]
            self._load = [0] * shards
            self._sem = asyncio.Semaphore(c.max_concurrency)
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(
                f"judge client {self.name!r} is bound to another event loop; use one loop "
                "per JudgeRunner (or its submit()/judge_sync() helpers)"
            )
        return self._pools

    async def _send(self, path: str, payload: bytes) -> httpx.Response:
        """One POST on the least busy pool (the semaphore bounds the total)."""
        pools = self._open()
        i = min(range(len(pools)), key=self._load.__getitem__)
        self._load[i] += 1
        try:
            return await pools[i].post(path, content=payload)
        finally:
            self._load[i] -= 1

    def redact(self, text: str) -> str:
        """`text` with every secret of this client masked."""
        return _mask(text, self._secrets)

    def redact_answer(self, content: str) -> str:
        """A judge's answer with every secret masked before anything reads it: in the text as sent, and,
        when it is JSON, in its decoded strings too (an escape such as `\\u002d` hides a key from a
        plain search). An answer without a secret is returned as it came."""
        if not self._secrets:
            return content
        masked = _mask(content, self._secrets)
        if "\\" not in masked:
            return masked
        try:
            data = orjson.loads(masked)
        except orjson.JSONDecodeError:
            return masked
        if not isinstance(data, dict | list):
            return masked
        clean = _mask_strings(data, self._secrets)
        return orjson.dumps(clean).decode() if clean != data else masked

    def _error_text(self, resp: httpx.Response) -> str:
        try:
            data = orjson.loads(resp.content)
            msg = data.get("error", data) if isinstance(data, dict) else data
            if isinstance(msg, dict):
                msg = msg.get("message", msg)
            text = msg if isinstance(msg, str) else orjson.dumps(msg).decode()
        except orjson.JSONDecodeError:
            text = resp.text
        return self.redact(" ".join(text.split()))[:_DETAIL_MAX]

    def _count(self, outcome: str) -> None:
        if self._on_request:
            self._on_request(self.name, outcome)

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """POST with retries and the breaker; returns the decoded JSON object and requests made.

        Refused by the open circuit before anything was sent: `circuit_open`, not attempted. A retry
        the circuit refuses (or would refuse for longer than the backoff) ends the call with the error
        its last attempt got, which is what happened to it."""
        self._open()
        c = self.config
        payload = orjson.dumps(body)
        made = 0
        failure: _Failure | None = None
        while True:
            outcome = await self._attempt(path, payload, failure)
            if outcome is None:
                if failure is None:
                    raise JudgeCallError(
                        "circuit_open",
                        f"endpoint {self.name!r} is failing; its circuit is open",
                        attempted=False,
                    )
                raise failure.error(made, "; not retried: circuit open")
            made += 1
            if not isinstance(outcome, _Failure):
                return outcome, made
            failure = outcome
            log.debug("judge endpoint %s: attempt %d failed: %s", self.name, made, failure.reason)
            if not failure.retryable or made > c.max_retries:
                raise failure.error(made)
            if failure.retry_after is not None and failure.retry_after > c.max_retry_after_seconds:
                raise JudgeCallError(
                    failure.reason,
                    f"Retry-After {failure.retry_after:.0f}s exceeds "
                    f"max_retry_after_seconds ({c.max_retry_after_seconds:g}s)",
                    status=failure.status,
                    requests=made,
                )
            delay = self._delay(failure, made - 1)
            if self.breaker.refuses_for() > delay:  # the retry would be refused: give up now
                self._refused("retry")
                raise failure.error(made, "; not retried: circuit open")
            await asyncio.sleep(delay)

    def _delay(self, failure: _Failure, attempt: int) -> float:
        c = self.config
        if failure.retry_after is not None:
            return failure.retry_after + random.uniform(0, min(1.0, failure.retry_after * 0.1 + 0.01))
        return random.uniform(0, min(c.backoff_max_seconds, c.backoff_initial_seconds * 2**attempt))

    async def _attempt(
        self, path: str, payload: bytes, previous: _Failure | None
    ) -> dict[str, Any] | _Failure | None:
        """One request: the answer, a failure, or None when the circuit refused it (nothing sent).

        The breaker is asked once a connection slot is held, and its verdict recorded before the slot is
        given back, so a call that waited for a slot sees the circuit as the calls before it left it."""
        assert self._sem is not None
        async with self._sem:
            permit = self.breaker.try_acquire()
            if permit is None:
                self._refused("first" if previous is None else "retry")
                return None
            ledger = current_call_ledger()
            if ledger is not None:
                ledger.sent += 1
            if previous is not None and self._on_retry:
                self._on_retry(self.name, previous.reason)
            try:
                resp = await self._send(path, payload)
            except httpx.TimeoutException:
                outcome: dict[str, Any] | _Failure = _Failure(
                    "timeout", f"no answer within {self.config.timeout_seconds:g}s"
                )
            except httpx.TransportError as exc:
                outcome = _Failure("connection", type(exc).__name__)
            except BaseException:
                self.breaker.release(permit)
                raise
            else:
                outcome = self._classify(resp)
            self._settle(permit, outcome)
        if isinstance(outcome, _Failure) and ledger is not None:
            ledger.failure = (outcome.reason, outcome.detail)
        return outcome

    def _classify(self, resp: httpx.Response) -> dict[str, Any] | _Failure:
        status = resp.status_code
        if 200 <= status < 300:
            try:
                data = orjson.loads(resp.content)
            except orjson.JSONDecodeError:
                data = None
            if isinstance(data, dict):
                return data
            return _Failure(
                "invalid_response", f"HTTP {status} with a body that is not a JSON object", status, False
            )
        if status == 429:
            return _Failure("rate_limited", "HTTP 429", status, retry_after=parse_retry_after(resp.headers))
        if status >= 500:
            return _Failure(
                "http_5xx",
                f"HTTP {status}: {self._error_text(resp)}",
                status,
                retry_after=parse_retry_after(resp.headers),
            )
        body_text = self._error_text(resp)
        return _Failure("http_4xx", f"HTTP {status}: {body_text}", status, False, body=body_text)

    def _settle(self, permit: Permit, outcome: dict[str, Any] | _Failure) -> None:
        """Tell the breaker and the request counter how the attempt went."""
        if not isinstance(outcome, _Failure):
            self.breaker.record(permit, True)
            self._count("ok")
        elif outcome.status == 429 and outcome.retry_after is not None and (
            outcome.retry_after <= self.config.max_retry_after_seconds
        ):
            self.breaker.back_pressure(permit)
            self._count("http_429")
        elif outcome.reason == "http_4xx" and outcome.status not in (401, 403, 404, 407):
            # The endpoint is up and answered; the request itself was refused.
            self.breaker.record(permit, True)
            self._count("http_4xx")
        else:
            self.breaker.record(permit, False)
            self._count("http_429" if outcome.status == 429 else outcome.reason)

    def _refused(self, attempt: str) -> None:
        if self._on_refused:
            self._on_refused(self.name, attempt)

    async def post_json(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """One POST of a body the caller built, with this client's retries, breaker and concurrency
        bound: the decoded JSON object answered and the requests made, or `JudgeCallError`. For a caller
        that is not a judge (`tracejudge eval --app-endpoint` calls the user's app with it); error text
        has the client's secrets masked, the answer is returned as it came."""
        return await self._post(path, body)

    async def chat(
        self,
        messages: Sequence[dict[str, str]],
        *,
        schema: dict[str, Any] | None = None,
        schema_name: str = "judgement",
        structured: bool = True,
    ) -> ChatResult:
        """One chat completion. With `structured`, ask for JSON (schema-constrained where the endpoint
        supports it); the endpoint's first refusal of a format steps this client down to the next."""
        c = self.config
        messages = self._redacted(messages)
        requests = 0
        while True:
            fmt = self._format if structured else "none"
            body: dict[str, Any] = {"model": c.model, "messages": list(messages)}
            if c.temperature is not None:
                body["temperature"] = c.temperature
            body[c.max_tokens_param] = c.max_output_tokens
            if fmt == "json_schema" and schema is not None:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": schema_name, "strict": True, "schema": schema},
                }
            elif fmt in ("json_schema", "json_object"):
                body["response_format"] = {"type": "json_object"}
            try:
                data, made = await self._post(c.chat_path, body)
            except JudgeCallError as exc:
                requests += exc.requests
                if (
                    exc.status in (400, 422)
                    and "response_format" in body
                    and _mentions_format(exc.body)
                    and self._format == fmt
                ):
                    self._format = _FORMATS[_FORMATS.index(fmt) + 1]
                    log.info(
                        "judge endpoint %s refused response_format %s; using %s", self.name, fmt, self._format
                    )
                    continue
                exc.requests = requests
                raise
            requests += made
            try:
                content = data["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                content = None
            if not isinstance(content, str):
                raise JudgeCallError(
                    "invalid_response",
                    "no choices[0].message.content string in the answer",
                    requests=requests,
                )
            # Before any judge reads it: its rationale goes to results, logs and write-back.
            content = self.redact_answer(content)
            usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
            return ChatResult(
                content, _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), requests
            )

    async def embed(self, texts: Sequence[str]) -> EmbeddingResult:
        c = self.config
        if not c.embedding_model:
            raise JudgeCallError(
                "invalid_response", f"endpoint {self.name!r} has no embedding_model", attempted=False
            )
        texts = self._redacted_texts(texts)
        data, made = await self._post(c.embeddings_path, {"model": c.embedding_model, "input": texts})
        items = data.get("data")
        if not isinstance(items, list) or len(items) != len(texts):
            raise JudgeCallError(
                "invalid_response", f"expected {len(texts)} embeddings in data[]", requests=made
            )
        try:
            ordered = sorted(items, key=lambda d: d.get("index", 0))
            vectors = [[float(x) for x in d["embedding"]] for d in ordered]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise JudgeCallError(
                "invalid_response", "data[].embedding is not a list of numbers", requests=made
            ) from None
        if any(len(v) != len(vectors[0]) or not v for v in vectors):
            raise JudgeCallError("invalid_response", "embeddings of different or zero length", requests=made)
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        return EmbeddingResult(vectors, _int(usage.get("prompt_tokens")), made)

    def _session(self) -> Redaction | None:
        """The judgement's redaction session (tracejudge.metrics.judges.redaction), else one for this call."""
        if self._redactor is None:
            return None
        return current_redaction() or self._redactor.session()

    def _redacted(self, messages: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
        session = self._session()
        if session is None:
            return messages
        try:
            return session.messages(messages)
        except RedactionError as exc:  # never send the text unredacted
            raise JudgeCallError("internal", str(exc), attempted=False) from None

    def _redacted_texts(self, texts: Sequence[str]) -> list[str]:
        session = self._session()
        if session is None:
            return list(texts)
        try:
            return session.texts(texts)
        except RedactionError as exc:
            raise JudgeCallError("internal", str(exc), attempted=False) from None

    async def aclose(self) -> None:
        pools, self._pools = self._pools, []
        for pool in pools:
            await pool.aclose()
        if pools:  # after the pools' own closing lines were logged
            SECRET_VALUE_LOGS.release(self._log_secrets)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
