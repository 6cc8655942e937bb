"""The judge HTTP client against a real OpenAI-compatible server on loopback (no patched httpx)."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from typing import Any

import httpx
import pytest
from support.clock import FakeClock
from support.openai_stub import OpenAIStub, Reply, StubRequest

from tracejudge.metrics.judges.breaker import CircuitBreaker, JudgeCallError
from tracejudge.metrics.judges.client import JudgeClient, parse_retry_after
from tracejudge.metrics.judges.endpoints import EndpointConfig

MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"result": {"type": "string"}}, "required": ["result"]}


def endpoint(stub: OpenAIStub, **kw: Any) -> EndpointConfig:
    base: dict[str, Any] = {
        "base_url": stub.base_url,
        "model": "judge-model",
        "embedding_model": "embed-model",
        "timeout_seconds": 2.0,
        "backoff_initial_seconds": 0.01,
        "backoff_max_seconds": 0.05,
    }
    return EndpointConfig(**{**base, **kw})


def run(coro_fn: Any) -> Any:
    return asyncio.run(coro_fn())


def test_chat_sends_model_schema_key_headers_and_query(stub: OpenAIStub) -> None:
    cfg = endpoint(
        stub,
        headers={"X-Team": "search"},
        query_params={"api-version": "2024-10-21"},
        max_output_tokens=64,
        max_tokens_param="max_completion_tokens",
    )
    client = JudgeClient("default", cfg, api_key="sk-test-123456")

    async def go() -> Any:
        try:
            return await client.chat(MESSAGES, schema=SCHEMA, schema_name="verdict")
        finally:
            await client.aclose()

    result = run(go)
    assert result.content == '{"rationale":"stub verdict","result":"yes"}'
    assert (result.input_tokens, result.output_tokens, result.requests) == (40, 10, 1)
    [req] = stub.requests
    assert req.path == "/v1/chat/completions"
    assert req.headers["authorization"] == "Bearer sk-test-123456"
    assert req.headers["x-team"] == "search"
    assert req.headers["x-query"] == "api-version=2024-10-21"
    assert req.body["model"] == "judge-model"
    assert req.body["messages"] == MESSAGES
    assert req.body["temperature"] == 0.0
    assert req.body["max_completion_tokens"] == 64 and "max_tokens" not in req.body
    assert req.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "strict": True, "schema": SCHEMA},
    }


def test_azure_style_key_header_and_no_auth_without_key(stub: OpenAIStub) -> None:
    async def go() -> None:
        azure = JudgeClient("azure", endpoint(stub, api_key_header="api-key"), api_key="azure-key-1")
        local = JudgeClient("local", endpoint(stub))
        await azure.chat(MESSAGES)
        await local.chat(MESSAGES)
        await azure.aclose()
        await local.aclose()

    run(go)
    first, second = stub.requests
    assert first.headers["api-key"] == "azure-key-1" and "authorization" not in first.headers
    assert "authorization" not in second.headers and "api-key" not in second.headers


def test_429_retry_after_is_honoured(stub: OpenAIStub) -> None:
    stub.enqueue(Reply.error(429, "slow down", retry_after="0.3"), Reply.verdict("no"))
    client = JudgeClient("default", endpoint(stub))

    async def go() -> Any:
        result = await client.chat(MESSAGES)
        await client.aclose()
        return result

    result = run(go)
    assert '"no"' in result.content and result.requests == 2
    first, second = stub.requests
    assert second.at - first.at >= 0.3  # waited at least what the server asked for


def test_retry_after_ms_header_wins(stub: OpenAIStub) -> None:
    reply = Reply.error(429, retry_after="30")
    reply.headers["retry-after-ms"] = "50"
    stub.enqueue(reply)
    client = JudgeClient("default", endpoint(stub, max_retry_after_seconds=1.0))

    async def go() -> Any:
        result = await client.chat(MESSAGES)
        await client.aclose()
        return result

    assert run(go).requests == 2


def test_retry_after_longer_than_allowed_fails_at_once(stub: OpenAIStub) -> None:
    stub.enqueue(Reply.error(429, retry_after="120"))
    client = JudgeClient("default", endpoint(stub, max_retry_after_seconds=1.0))

    async def go() -> None:
        try:
            await client.chat(MESSAGES)
        finally:
            await client.aclose()

    with pytest.raises(JudgeCallError) as err:
        run(go)
    assert err.value.reason == "rate_limited" and "Retry-After 120s" in err.value.detail
    assert stub.total == 1


def test_5xx_is_retried_then_given_up(stub: OpenAIStub) -> None:
    stub.enqueue(Reply.error(502), Reply.error(503), Reply.verdict("yes"))
    client = JudgeClient("default", endpoint(stub, max_retries=2))

    async def go() -> Any:
        ok = await client.chat(MESSAGES)
        stub.enqueue(*[Reply.error(500, "boom")] * 3)
        try:
            await client.chat(MESSAGES)
        except JudgeCallError as exc:
            return ok, exc
        finally:
            await client.aclose()

    ok, exc = run(go)
    assert ok.requests == 3
    assert exc.reason == "http_5xx" and exc.requests == 3 and "HTTP 500: boom" in exc.detail
    assert stub.total == 6


def test_timeout_when_the_server_answers_too_late(stub: OpenAIStub) -> None:
    stub.enqueue(Reply.verdict(delay=3.0), Reply.verdict(delay=3.0))
    client = JudgeClient("default", endpoint(stub, timeout_seconds=0.2, max_retries=1))

    async def go() -> None:
        try:
            await client.chat(MESSAGES)
        finally:
            await client.aclose()

    with pytest.raises(JudgeCallError) as err:
        run(go)
    assert err.value.reason == "timeout" and err.value.requests == 2


def test_malformed_body_is_an_invalid_response_not_retried(stub: OpenAIStub) -> None:
    stub.enqueue(Reply.raw(b'{"choices": [ {"message": '))
    stub.enqueue(Reply.chat("x"))
    client = JudgeClient("default", endpoint(stub))

    async def go() -> None:
        try:
            await client.chat(MESSAGES)
        finally:
            await client.aclose()

    with pytest.raises(JudgeCallError) as err:
        run(go)
    assert err.value.reason == "invalid_response" and stub.total == 1


def test_missing_message_content_is_an_invalid_response(stub: OpenAIStub) -> None:
    stub.enqueue(Reply.raw(b'{"choices": []}'))
    client = JudgeClient("default", endpoint(stub))

    async def go() -> None:
        try:
            await client.chat(MESSAGES)
        finally:
            await client.aclose()

    with pytest.raises(JudgeCallError) as err:
        run(go)
    assert err.value.reason == "invalid_response"


def test_a_refused_request_is_not_retried_and_does_not_trip_the_breaker(stub: OpenAIStub) -> None:
    stub.responder = lambda req: Reply.error(400, "This model's maximum context length is 8192 tokens")
    client = JudgeClient("default", endpoint(stub, breaker_failure_threshold=2))

    async def go() -> list[JudgeCallError]:
        errors = []
        for _ in range(3):
            try:
                await client.chat(MESSAGES)
            except JudgeCallError as exc:
                errors.append(exc)
        await client.aclose()
        return errors

    errors = run(go)
    assert [e.reason for e in errors] == ["http_4xx"] * 3
    assert stub.total == 3 and client.breaker.state == "closed"


def test_response_format_steps_down_when_refused(stub: OpenAIStub) -> None:
    def picky(req: StubRequest) -> Reply:
        if req.response_format == "json_schema":
            return Reply.error(400, "response_format json_schema is not supported by this model")
        if req.response_format == "json_object":
            return Reply.error(422, "Unknown field: response_format")
        return Reply.verdict("yes")

    stub.responder = picky
    client = JudgeClient("default", endpoint(stub))

    async def go() -> None:
        await client.chat(MESSAGES, schema=SCHEMA)
        await client.chat(MESSAGES, schema=SCHEMA)
        await client.aclose()

    run(go)
    assert [r.response_format for r in stub.requests] == ["json_schema", "json_object", "none", "none"]
    assert client.response_format == "none"


def test_breaker_opens_refuses_without_calling_then_half_opens(stub: OpenAIStub) -> None:
    clock = FakeClock()
    stub.responder = lambda req: Reply.error(500)
    client = JudgeClient(
        "default",
        endpoint(
            stub,
            max_retries=0,
            breaker_failure_threshold=3,
            breaker_reset_seconds=10,
            breaker_max_reset_seconds=40,
        ),
        clock=clock,
    )

    async def attempt() -> str:
        try:
            await client.chat(MESSAGES)
            return "ok"
        except JudgeCallError as exc:
            return exc.reason + ("" if exc.attempted else "/not-sent")

    async def go() -> None:
        assert [await attempt() for _ in range(3)] == ["http_5xx"] * 3
        assert client.breaker.state == "open"
        assert await attempt() == "circuit_open/not-sent"
        assert stub.total == 3  # refused without touching the endpoint

        clock.now += 10  # reset elapsed: one probe may go; it fails, so the wait doubles
        assert client.breaker.state == "half_open"
        assert await attempt() == "http_5xx"
        assert client.breaker.state == "open"
        clock.now += 10
        assert client.breaker.state == "open"
        clock.now += 10
        assert client.breaker.state == "half_open"

        # A probe in flight holds the half-open slot: a concurrent call is refused.
        stub.responder = lambda req: Reply.verdict("yes", delay=0.3)
        probe = asyncio.create_task(attempt())
        while stub.total < 5:
            await asyncio.sleep(0.005)
        assert await attempt() == "circuit_open/not-sent"
        assert await probe == "ok"
        assert client.breaker.state == "closed"
        assert await attempt() == "ok"
        await client.aclose()

    run(go)
    assert stub.total == 6


def test_breaker_ignores_outcomes_of_calls_issued_before_it_opened() -> None:
    clock = FakeClock()
    states: list[str] = []
    breaker = CircuitBreaker(2, 5.0, clock=clock, on_change=states.append)
    early = breaker.try_acquire()
    a, b = breaker.try_acquire(), breaker.try_acquire()
    assert early and a and b
    breaker.record(a, False)
    breaker.record(b, False)
    assert breaker.state == "open"
    breaker.record(early, True)  # a success from before the outage says nothing about now
    assert breaker.state == "open" and not breaker.allows()
    clock.now += 5
    probe = breaker.try_acquire()
    assert probe is not None and probe.probe and breaker.try_acquire() is None
    breaker.release(probe)  # cancelled: the slot is free again
    assert breaker.allows()
    assert states == ["open", "half_open"]


def test_embeddings_in_index_order(stub: OpenAIStub) -> None:
    stub.enqueue(
        Reply(body=b'{"data": [{"index": 1, "embedding": [0, 1]}, {"index": 0, "embedding": [1, 0]}]}')
    )
    stub.enqueue(Reply.embeddings([[1.0, 0.0]]))  # one vector for two inputs
    client = JudgeClient("default", endpoint(stub))

    async def go() -> Any:
        result = await client.embed(["first", "second"])
        try:
            await client.embed(["first", "second"])
        except JudgeCallError as exc:
            return result, exc
        finally:
            await client.aclose()

    result, exc = run(go)
    assert result.vectors == [[1.0, 0.0], [0.0, 1.0]]
    assert exc.reason == "invalid_response"
    assert stub.requests[0].path == "/v1/embeddings"
    assert stub.requests[0].body == {"model": "embed-model", "input": ["first", "second"]}


def test_connection_refused_is_a_connection_error() -> None:
    with OpenAIStub() as gone:
        url = gone.base_url
    client = JudgeClient(
        "default",
        EndpointConfig(
            base_url=url, model="m", max_retries=1, backoff_initial_seconds=0.01, connect_timeout_seconds=1
        ),
    )

    async def go() -> None:
        try:
            await client.chat(MESSAGES)
        finally:
            await client.aclose()

    with pytest.raises(JudgeCallError) as err:
        run(go)
    assert err.value.reason == "connection" and err.value.requests == 2


def test_parse_retry_after_forms() -> None:
    assert parse_retry_after(httpx.Headers({"retry-after": "7"})) == 7.0
    assert parse_retry_after(httpx.Headers({"retry-after-ms": "250", "retry-after": "7"})) == 0.25
    now = time.time()
    date = email.utils.formatdate(now + 30, usegmt=True)
    assert 28 <= parse_retry_after(httpx.Headers({"retry-after": date}), now=now) <= 31
    assert parse_retry_after(httpx.Headers({"retry-after": "soon"})) is None
    assert parse_retry_after(httpx.Headers({})) is None


def test_repr_and_errors_never_show_the_key(stub: OpenAIStub) -> None:
    secret = "sk-live-DO-NOT-LEAK-42"
    stub.enqueue(Reply.error(401, f"Incorrect API key provided: {secret}"))
    client = JudgeClient("default", endpoint(stub), api_key=secret)

    async def go() -> None:
        try:
            await client.chat(MESSAGES)
        finally:
            await client.aclose()

    with pytest.raises(JudgeCallError) as err:
        run(go)
    assert err.value.reason == "http_4xx" and "HTTP 401" in str(err.value)
    assert secret not in str(err.value) and secret not in repr(client)


# ------------------------------------------------------------------------------------------------
# Secrets in what a judge returns and in what the HTTP libraries log (issue 24, item 6)

KEY = "sk-proj-ECHO-0123456789abcdef"
TOKEN = "tok-GATEWAY-987654321"
QUERY_SECRET = "sig/SECRET+query value=42"  # a value that travels percent- and form-encoded


def _escaped(text: str) -> str:
    """`text` as JSON may carry it with every '-' escaped: a plain search would not find the key."""
    return text.replace("-", "\\u002d")


def test_a_key_echoed_by_the_judge_never_reaches_results_logs_or_metrics(
    stub: OpenAIStub, caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from tracejudge.metrics.judges.runner import JudgeRunner
    from tracejudge.schemas.record import EvalRecord
    from tracejudge.schemas.result import EvaluationResult, SourceRef

    echo = f"your key is Bearer {KEY}, the gateway token {TOKEN}, the signature {QUERY_SECRET}"
    plain = Reply.verdict("yes", rationale=echo)
    plain.headers["x-echo-key"] = KEY  # a response header: httpcore logs response headers at DEBUG
    escaped_key = _escaped(f"Bearer {KEY}")
    escaped = Reply.chat(f'{{"rationale": "{escaped_key}", "result": "no"}}')
    free_text = Reply.chat(f"I cannot answer in JSON. Your key is {KEY}.")
    bad_value = Reply.chat({"rationale": "see result", "result": f"key {KEY}"})
    stub.enqueue(plain, escaped, free_text, bad_value, Reply.error(500, f"upstream rejected {KEY}"))
    for name in ("", "httpx", "httpcore", "tracejudge"):
        caplog.set_level(logging.DEBUG, logger=name or None)
    config = {
        "endpoints": {"default": {
            "base_url": stub.base_url, "model": "judge-model", "api_key_env": "JUDGE_KEY",
            "headers_from_env": {"X-Gateway-Token": "GATEWAY_TOKEN"}, "query_params": {"code": QUERY_SECRET},
            "max_retries": 0, "breaker_failure_threshold": 100,
        }},
        "sample_rate": 1.0,
        "builtin": {"relevance_to_query": {}},
    }
    r = JudgeRunner(config, registry=CollectorRegistry(), env={"JUDGE_KEY": KEY, "GATEWAY_TOKEN": TOKEN})
    results = []
    for i in range(5):
        rec = EvalRecord(trace_id=f"{i:032x}", app="shop", request=f"Question {i}?", response="An answer.")
        results.append(EvaluationResult(rec, SourceRef("mlflow"), assessments=r.judge_sync(rec)))
    r.close()

    # The secrets were really sent, and really echoed.
    assert stub.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert stub.requests[0].headers["x-gateway-token"] == TOKEN
    assert httpx.QueryParams(stub.requests[0].headers["x-query"])["code"] == QUERY_SECRET
    [a0], [a1], [a2], [a3], [a4] = (res.assessments for res in results)
    assert a0.value == "yes"
    assert a0.rationale == "your key is Bearer ***, the gateway token ***, the signature ***"
    assert a1.value == "no" and a1.rationale == "Bearer ***"
    assert a2.error and a2.error.startswith("unparseable")
    assert a3.error and a3.error.startswith("invalid_answer") and "key ***" in a3.error
    assert a4.error and a4.error.startswith("http_5xx") and "upstream rejected ***" in a4.error

    records = [rec for rec in caplog.records if rec.name.startswith(("httpx", "httpcore"))]
    assert any(rec.name == "httpx" and "HTTP Request: POST" in rec.getMessage() for rec in records)
    assert any("x-echo-key" in rec.getMessage() for rec in records)  # httpcore's DEBUG header trace
    written = "".join(res.to_json().decode() for res in results)
    logged = caplog.text + "".join(rec.getMessage() + repr(rec.args) for rec in caplog.records)
    shown = written + logged + generate_latest(r.metrics.registry).decode()
    query_forms = {QUERY_SECRET, str(httpx.QueryParams({"c": QUERY_SECRET}))[2:]}
    for secret in (KEY, _escaped(KEY), TOKEN, *query_forms):
        assert secret not in shown, secret


def test_answers_without_a_secret_are_passed_on_as_they_came(stub: OpenAIStub) -> None:
    answer = '{"rationale": "The key point is\\u002d supported.",  "result": "yes"}'
    stub.enqueue(Reply.chat(answer))
    stub.enqueue(Reply.chat(f"Bearer {KEY}"))
    client = JudgeClient("default", endpoint(stub, headers={"X-Team": "search"}), api_key=KEY)

    async def go() -> tuple[str, str]:
        try:
            return (await client.chat(MESSAGES)).content, (await client.chat(MESSAGES)).content
        finally:
            await client.aclose()

    untouched, masked = run(go)
    assert untouched == answer  # byte for byte: nothing to mask, so nothing re-encoded
    assert masked == "Bearer ***"


def test_httpx_and_httpcore_at_debug_never_show_the_key_headers_or_query_secrets(
    stub: OpenAIStub, caplog: pytest.LogCaptureFixture
) -> None:
    """Every record of the HTTP libraries at DEBUG, through a request, a retried 503 and a timeout."""
    reply = Reply.verdict("yes")
    reply.headers["x-request-token"] = TOKEN  # an endpoint echoing a header value
    stub.enqueue(Reply.error(503, retry_after="0"), reply, Reply.verdict(delay=1.0), Reply.verdict(delay=1.0))
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=name)
    cfg = endpoint(stub, query_params={"api-key": QUERY_SECRET, "api-version": "2024-10-21"},
                   timeout_seconds=0.3, max_retries=1)
    client = JudgeClient("default", cfg, api_key=KEY, extra_headers={"X-Gateway-Token": TOKEN})

    async def go() -> JudgeCallError:
        try:
            await client.chat(MESSAGES)
            await client.chat(MESSAGES)
        except JudgeCallError as exc:
            return exc
        finally:
            await client.aclose()
        raise AssertionError("the second call should time out")

    assert run(go).reason == "timeout"
    assert stub.requests[0].headers["authorization"] == f"Bearer {KEY}"
    records = [rec for rec in caplog.records if rec.name.startswith(("httpx", "httpcore"))]
    assert {"httpx", "httpcore.connection", "httpcore.http11"} <= {rec.name for rec in records}
    assert any("receive_response_headers.complete" in rec.getMessage() for rec in records)
    text = caplog.text + "".join(rec.getMessage() + repr(rec.args) for rec in records)
    for secret in (KEY, TOKEN, QUERY_SECRET, str(httpx.QueryParams({"c": QUERY_SECRET}))[2:]):
        assert secret not in text, secret
    assert "127.0.0.1" in text  # the records are there, only their secrets masked
