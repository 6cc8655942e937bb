"""A real HTTP/1.1 server on loopback that speaks enough of the OpenAI API for the judge tests.

It runs an asyncio server on its own thread, so the real httpx client in the code under test opens
real sockets to it (keep-alive, timeouts, disconnects and all). Answers are scripted:

    with OpenAIStub() as stub:                       # default: every chat answer is a "yes" verdict
        stub.enqueue(Reply.error(429, retry_after=1), Reply.verdict("no"))   # the next two answers
        stub.responder = lambda req: Reply.chat("...")                       # then this, per request

`Reply.delay` holds the answer back (a delay longer than the client's timeout is a timeout);
`Reply.hold` holds it until a `threading.Event` is set (a test keeps a request in flight as long as it
needs, with no timing guess); `Reply.raw` sends any bytes (malformed JSON). Every request is recorded
(`stub.requests`) with its arrival time, headers and decoded JSON body. Embedding requests get
deterministic bag-of-words vectors by default, so texts sharing words have a high cosine similarity.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["OpenAIStub", "Reply", "StubRequest", "bag_of_words_vector", "wait_until"]


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0, interval: float = 0.01) -> None:
    """Poll `predicate` until it holds; fail after `timeout` seconds (no bare sleeps in tests). The
    default is generous: a condition that holds returns at once, however loaded the machine is."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        threading.Event().wait(interval)


@dataclass
class StubRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float

    @property
    def prompt(self) -> str:
        """All message contents, joined (what a scripted responder decides on)."""
        msgs = self.body.get("messages", []) if isinstance(self.body, dict) else []
        return "\n".join(str(m.get("content", "")) for m in msgs)

    @property
    def response_format(self) -> str:
        rf = self.body.get("response_format") if isinstance(self.body, dict) else None
        return rf.get("type", "?") if isinstance(rf, dict) else "none"


@dataclass
class Reply:
    status: int = 200
    body: bytes = b"{}"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    content_type: str = "application/json"
    # Answer only once this is set (the request is recorded at once).
    hold: threading.Event | None = None

    @classmethod
    def chat(
        cls,
        content: str | dict[str, Any],
        *,
        prompt_tokens: int | None = 40,
        completion_tokens: int | None = 10,
        delay: float = 0.0,
        model: str = "stub",
    ) -> Reply:
        text = content if isinstance(content, str) else orjson.dumps(content).decode()
        obj: dict[str, Any] = {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
            ],
        }
        if prompt_tokens is not None:
            obj["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens or 0,
                "total_tokens": prompt_tokens + (completion_tokens or 0),
            }
        return cls(body=orjson.dumps(obj), delay=delay)

    @classmethod
    def tool_calls(
        cls,
        *calls: tuple[str, dict[str, Any]],
        prompt_tokens: int = 40,
        completion_tokens: int = 10,
        model: str = "stub",
    ) -> Reply:
        """A chat completion that asks for tool calls: `(name, arguments)` pairs, ids `call_0`, …"""
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": name, "arguments": orjson.dumps(args).decode()}}
                for i, (name, args) in enumerate(calls)
            ],
        }
        obj = {
            "id": "chatcmpl-stub-tools",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }
        return cls(body=orjson.dumps(obj))

    @classmethod
    def verdict(cls, result: str = "yes", rationale: str = "stub verdict", **kw: Any) -> Reply:
        return cls.chat({"rationale": rationale, "result": result}, **kw)

    @classmethod
    def verdicts(cls, results: dict[int, str], rationale: str = "stub verdicts", **kw: Any) -> Reply:
        return cls.chat(
            {"rationale": rationale, "verdicts": [{"index": i, "result": r} for i, r in results.items()]},
            **kw,
        )

    @classmethod
    def error(
        cls,
        status: int,
        message: str = "stub error",
        *,
        retry_after: str | float | None = None,
        delay: float = 0.0,
    ) -> Reply:
        headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
        body = orjson.dumps({"error": {"message": message, "type": "stub_error"}})
        return cls(status=status, body=body, headers=headers, delay=delay)

    @classmethod
    def raw(cls, body: bytes, *, status: int = 200, content_type: str = "application/json") -> Reply:
        return cls(status=status, body=body, content_type=content_type)

    @classmethod
    def embeddings(cls, vectors: list[list[float]], *, prompt_tokens: int = 12) -> Reply:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return cls(
            body=orjson.dumps(
                {
                    "object": "list",
                    "data": data,
                    "model": "stub-embed",
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
                }
            )
        )


def _as_stream(reply: Reply) -> Reply:
    """A chat completion reply as the server-sent events of a streamed one: a role chunk, one chunk
    of content or tool calls, a finish chunk, a usage chunk (sent whatever `stream_options` asked, so
    a streaming client sees the same usage as a plain one), then `[DONE]`."""
    try:
        obj = orjson.loads(reply.body)
        choice = obj["choices"][0]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return reply
    message = choice.get("message") or {}
    base = {"id": obj.get("id", "chatcmpl-stub"), "object": "chat.completion.chunk",
            "created": 0, "model": obj.get("model", "stub")}
    delta: dict[str, Any] = {}
    if message.get("content") is not None:
        delta["content"] = message["content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    chunks = [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason")}]},
    ]
    if obj.get("usage"):
        chunks.append({**base, "choices": [], "usage": obj["usage"]})
    body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    return Reply(body=body, headers=reply.headers, delay=reply.delay, content_type="text/event-stream")


def bag_of_words_vector(text: str, dims: int = 64) -> list[float]:
    v = [0.0] * dims
    for w in re.findall(r"[a-z0-9]+", text.lower()):
        v[int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "big") % dims] += 1.0
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def default_responder(req: StubRequest) -> Reply:
    if req.path.endswith("/embeddings"):
        inputs = req.body.get("input", []) if isinstance(req.body, dict) else []
        inputs = [inputs] if isinstance(inputs, str) else inputs
        return Reply.embeddings([bag_of_words_vector(str(t)) for t in inputs])
    return Reply.verdict("yes")


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class OpenAIStub:
    def __init__(
        self,
        responder: Callable[[StubRequest], Reply] | None = None,
        *,
        delay: float = 0.0,
        record: int = 100_000,
    ):
        self.responder = responder or default_responder
        # Added to every reply's own delay (the benchmark's fixed latency).
        self.delay = delay
        self.requests: deque[StubRequest] = deque(maxlen=record)
        # (request, reply) pairs in answer order: what a test app's expected token counts come from.
        self.answered: deque[tuple[StubRequest, Reply]] = deque(maxlen=record)
        self.total = 0
        self._queue: deque[Reply] = deque()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    # ------------------------------------------------------------------ control
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def enqueue(self, *replies: Reply) -> None:
        with self._lock:
            self._queue.extend(replies)

    def count(self, path_suffix: str = "") -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.path.endswith(path_suffix))

    def chat_requests(self) -> list[StubRequest]:
        with self._lock:
            return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def start(self) -> OpenAIStub:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="openai-stub", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=512), self._loop
        ).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> OpenAIStub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ server
    def _next_reply(self, req: StubRequest) -> Reply:
        with self._lock:
            self.requests.append(req)
            self.total += 1
            scripted = self._queue.popleft() if self._queue else None
        reply = scripted if scripted is not None else self.responder(req)
        with self._lock:
            self.answered.append((req, reply))
        return reply

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                try:
                    body = orjson.loads(raw) if raw else None
                except orjson.JSONDecodeError:
                    body = None
                req = StubRequest(method, target.split("?", 1)[0], headers, body, time.monotonic())
                req.headers["x-query"] = target.split("?", 1)[1] if "?" in target else ""
                reply = self._next_reply(req)
                if isinstance(body, dict) and body.get("stream") and reply.status == 200:
                    reply = _as_stream(reply)
                while reply.hold is not None and not reply.hold.is_set():
                    await asyncio.sleep(0.002)
                if reply.delay + self.delay > 0:
                    await asyncio.sleep(reply.delay + self.delay)
                extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
                head = (
                    f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Status')}\r\n"
                    f"content-type: {reply.content_type}\r\n"
                    f"content-length: {len(reply.body)}\r\n{extra}\r\n"
                )
                writer.write(head.encode("latin-1") + reply.body)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            writer.close()


def main() -> None:
    """Serve on loopback in its own process (the benchmark's endpoint): prints the port, then serves
    until stdin closes."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before every answer")
    args = parser.parse_args()
    with OpenAIStub(delay=args.delay, record=1000) as stub:
        print(stub.port, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
