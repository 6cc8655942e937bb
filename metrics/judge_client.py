"""An asynchronous client for OpenAI-compatible Chat Completions and Embeddings endpoints.

One `JudgeClient` per configured endpoint. It owns an `httpx.AsyncClient` (connection pool sized to
the endpoint's concurrency), a semaphore bounding requests in flight, retries with exponential backoff
and full jitter on 429 / 5xx / timeouts / connection errors (a Retry-After or retry-after-ms header is
honoured up to `max_retry_after_seconds`), and a circuit breaker: after `breaker_failure_threshold`
consecutive failed requests it refuses calls for `breaker_reset_seconds`, then lets one probe through
(half-open); a failed probe reopens it for twice as long (up to `breaker_max_reset_seconds`). While it
is open judgements are skipped at once (reason `circuit_open`), so an outage cannot stall the stream
behind timeouts.

Secrets: the API key is sent in a header and never logged; prompts are never logged; endpoint error
text that reaches a result or a log is truncated and has any secret value masked.

Redaction: this client is the one egress point for production text, so with a `redactor` every chat
message and embeddings input passes the judgement's `Redaction` session (tracejudge.metrics.redaction)
before the request body is built; a text with nothing to replace is sent byte for byte as it was.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from tracejudge.metrics.judge_config import EndpointConfig
from tracejudge.metrics.redaction import Redaction, RedactionError, Redactor, current_redaction

__all__ = ["ChatResult", "CircuitBreaker", "EmbeddingResult", "JudgeCallError", "JudgeClient", "Permit"]

log = logging.getLogger(__name__)

_FORMATS = ("json_schema", "json_object", "none")
# Connections per httpx pool (see `_open`).
POOL_SHARD = 8
_DETAIL_MAX = 200


class JudgeCallError(Exception):
    """A call that produced no usable answer. `reason` is a bounded token (a metric label);
    `attempted` is False when no request was sent at all (the breaker refused the first attempt)."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        status: int | None = None,
        attempted: bool = True,
        requests: int = 0,
        body: str = "",
    ):
        self.reason = reason
        self.detail = detail
        self.status = status
        self.attempted = attempted
        self.requests = requests
        self.body = body
        super().__init__(f"{reason}: {detail}")


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
class Permit:
    probe: bool


class CircuitBreaker:
    """closed -> (threshold consecutive failures) -> open -> (reset elapsed) -> half_open (one probe)
    -> closed on success / open again, for twice as long, on failure.

    Used from one event loop; not thread-safe (it needs no lock there)."""

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(
        self,
        failure_threshold: int = 5,
        reset_seconds: float = 30.0,
        max_reset_seconds: float = 300.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] | None = None,
    ):
        self.failure_threshold = failure_threshold
        self.reset_seconds = reset_seconds
        self.max_reset_seconds = max(max_reset_seconds, reset_seconds)
        self._clock = clock
        self._on_change = on_change
        self._state = self.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._current_reset = reset_seconds
        self._probe_in_flight = False
        self.opened_count = 0

    def _set(self, state: str) -> None:
        if state != self._state:
            self._state = state
            if self._on_change:
                self._on_change(state)

    def _advance(self) -> None:
        if self._state == self.OPEN and self._clock() - self._opened_at >= self._current_reset:
            self._probe_in_flight = False
            self._set(self.HALF_OPEN)

    @property
    def state(self) -> str:
        self._advance()
        return self._state

    def allows(self) -> bool:
        """Would a call be let through now? (Does not take the half-open probe.)"""
        self._advance()
        return self._state == self.CLOSED or (self._state == self.HALF_OPEN and not self._probe_in_flight)

    def try_acquire(self) -> Permit | None:
        self._advance()
        if self._state == self.CLOSED:
            return Permit(probe=False)
        if self._state == self.HALF_OPEN and not self._probe_in_flight:
            self._probe_in_flight = True
            return Permit(probe=True)
        return None

    def release(self, permit: Permit) -> None:
        """The call ended without a verdict on the endpoint (cancelled): free the probe slot."""
        if permit.probe and self._state == self.HALF_OPEN:
            self._probe_in_flight = False

    def record(self, permit: Permit, ok: bool) -> None:
        if permit.probe:
            self._probe_in_flight = False
            if ok:
                self._failures = 0
                self._current_reset = self.reset_seconds
                self._set(self.CLOSED)
            else:
                self._open(min(self.max_reset_seconds, self._current_reset * 2))
            return
        if self._state != self.CLOSED:
            # A call issued before the breaker opened: its outcome says nothing about now.
            return
        if ok:
            self._failures = 0
            return
        self._failures += 1
        if self._failures >= self.failure_threshold:
            self._open(self.reset_seconds)

    def _open(self, reset: float) -> None:
        self._current_reset = reset
        self._opened_at = self._clock()
        self._failures = 0
        self.opened_count += 1
        self._set(self.OPEN)


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
        clock: Callable[[], float] = time.monotonic,
        redactor: Redactor | None = None,
    ):
        self.name = name
        # Every chat message and embeddings input passes it before a request body is built.
        self._redactor = redactor
        self.config = config
        self._api_key = api_key
        self._extra_headers = dict(extra_headers or {})
        self._secrets = [s for s in [api_key, *self._extra_headers.values()] if s and len(s) >= 4]
        self._on_request = on_request
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
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

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
        """POST with retries and the breaker; returns the decoded JSON object and requests made."""
        self._open()
        assert self._sem is not None
        c = self.config
        payload = orjson.dumps(body)
        made = 0
        attempt = 0
        while True:
            permit = self.breaker.try_acquire()
            if permit is None:
                raise JudgeCallError(
                    "circuit_open",
                    f"endpoint {self.name!r} is failing; its circuit is open",
                    attempted=made > 0,
                    requests=made,
                )
            retry_after: float | None = None
            retryable = True
            status: int | None = None
            body_text = ""
            try:
                async with self._sem:
                    made += 1
                    resp = await self._send(path, payload)
            except httpx.TimeoutException:
                reason, detail = "timeout", f"no answer within {c.timeout_seconds:g}s"
            except httpx.TransportError as exc:
                reason, detail = "connection", type(exc).__name__
            except BaseException:
                self.breaker.release(permit)
                raise
            else:
                status = resp.status_code
                if 200 <= status < 300:
                    try:
                        data = orjson.loads(resp.content)
                    except orjson.JSONDecodeError:
                        data = None
                    if isinstance(data, dict):
                        self.breaker.record(permit, True)
                        self._count("ok")
                        return data, made
                    reason, detail, retryable = (
                        "invalid_response",
                        f"HTTP {status} with a body that is not a JSON object",
                        False,
                    )
                elif status == 429:
                    reason, detail = "rate_limited", "HTTP 429"
                    retry_after = parse_retry_after(resp.headers)
                elif status >= 500:
                    reason, detail = "http_5xx", f"HTTP {status}: {self._error_text(resp)}"
                    retry_after = parse_retry_after(resp.headers)
                else:
                    body_text = self._error_text(resp)
                    reason, detail, retryable = "http_4xx", f"HTTP {status}: {body_text}", False
                    if status not in (401, 403, 404, 407):
                        # The endpoint is up and answered; the request itself was refused.
                        self.breaker.record(permit, True)
                        self._count("http_4xx")
                        raise JudgeCallError(reason, detail, status=status, requests=made, body=body_text)
            self.breaker.record(permit, False)
            self._count("http_429" if status == 429 else reason)
            log.debug("judge endpoint %s: attempt %d failed: %s", self.name, attempt + 1, reason)
            if not retryable or attempt >= c.max_retries:
                suffix = f" after {made} attempts" if made > 1 else ""
                raise JudgeCallError(reason, detail + suffix, status=status, requests=made, body=body_text)
            if retry_after is not None:
                if retry_after > c.max_retry_after_seconds:
                    raise JudgeCallError(
                        "rate_limited",
                        f"Retry-After {retry_after:.0f}s exceeds "
                        f"max_retry_after_seconds ({c.max_retry_after_seconds:g}s)",
                        status=status,
                        requests=made,
                    )
                delay = retry_after + random.uniform(0, min(1.0, retry_after * 0.1 + 0.01))
            else:
                delay = random.uniform(0, min(c.backoff_max_seconds, c.backoff_initial_seconds * 2**attempt))
            attempt += 1
            await asyncio.sleep(delay)

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
        """The judgement's redaction session (tracejudge.metrics.redaction), else one for this call."""
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


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
