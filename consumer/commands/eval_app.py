"""`tracejudge eval --app-endpoint URL | --app MODULE:FUNCTION`: run the user's app over a dataset, then
evaluate what it answered.

Each line of the dataset is an agent-evaluation row: the `request` (a string, chat messages, or
mlflow.genai's `inputs`) and the expectations (`expected_response`, `expected_facts`,
`expected_retrieved_context`, `guidelines`, ...). A `response`, `outputs`, `retrieved_context` or
`trace` the row carries is an old answer and is dropped. For each row the app is called with the
request, and its answer fills the record the configured judges and metrics then evaluate, as
`tracejudge eval` evaluates any record.

The app, one of:
- an OpenAI-compatible chat completions endpoint (`HttpApp`): POST `{"model": M, "messages": [...]}`
  (the row's chat messages, or its request as one user message); the response is
  `choices[0].message.content`; two optional top-level fields of the answer, an extension, carry
  what the app retrieved (`"retrieved_context": [{"content": ..., "doc_uri": ...}, ...]`, or strings)
  and its MLflow trace (`"trace"`); `usage` gives the token counts. The client is the judges'
  (`tracejudge.metrics.judges.client`): timeouts, retries with backoff on 429/5xx/timeouts, a bound on
  the calls in flight, secrets masked in error text; the API key comes from an environment variable.
- a Python function (`CallableApp`), loaded by the one plug-in loader (`tracejudge.metrics.plugins`),
  called with the row's request as it is in the row (a str, or the dict/list of chat messages), plain
  or `async def`. It returns the response as a str; or a dict with `response` (a str, or a chat
  completion / messages the text is read from) and optionally `retrieved_context` (as above) and
  `trace`; or a trace (an MLflow trace as a dict or JSON text, or an object with `to_json()`, such as
  `mlflow.entities.Trace`), from which the response, retrieved context, tokens and latency are derived.

What the app answers is checked like any input: an answer that cannot be read is an app error
(`invalid_answer`), as are a timeout, a connection failure, an HTTP error after the retries, and an
exception from the function. An app error is never a pass: the row's result is a failed trace
(`failed: true`, `error: "app call failed (REASON): ..."`), which every judge skips as `failed_trace`,
and which the baseline comparison counts as a failure. Errors are counted by reason, the first
`MAX_SHOWN_ERRORS` printed with their file and line, and gated by `--max-app-errors`.

Calls run concurrently (`--app-concurrency`) on an event loop of their own; the results come out in
the dataset's order, at most a window of twice the concurrency ahead (bounded memory).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO, Protocol

from pydantic import ValidationError

from tracejudge.consumer.pipeline import Pipeline
from tracejudge.metrics.judges.breaker import JudgeCallError
from tracejudge.metrics.judges.client import JudgeClient
from tracejudge.metrics.judges.endpoints import EndpointConfig
from tracejudge.metrics.plugins import load_plugin
from tracejudge.schemas import errors
from tracejudge.schemas.errors import ConfigError, RecordError
from tracejudge.schemas.formats.derive_text import request_text, response_text
from tracejudge.schemas.formats.detect import decode, detect
from tracejudge.schemas.formats.input_files import InputError, Oversized, diagnose_unreadable, read_lines
from tracejudge.schemas.record import EvalRecord, TokenUsage
from tracejudge.schemas.result import EvaluationResult, SourceRef

__all__ = ["AppAnswer", "AppCaller", "AppError", "AppEvaluation", "CallableApp", "HttpApp", "add_arguments",
           "answer_from", "app_messages", "build_app", "count_argument"]

# App errors printed on stderr per run; the rest are counted (every one is in its result line).
MAX_SHOWN_ERRORS = 20
DEFAULT_TIMEOUT_SECONDS = 60.0
DEFAULT_CONCURRENCY = {"endpoint": 8, "callable": 1}
# The fields of a row that are an earlier answer, not part of the question. A collected row's
# `trajectory` is the tool calls production made (`reference_trajectory` is the expectation): kept, it
# would be judged as the app's and would override the tool calls of a trace the app returns. The app
# answers each row on its own, without the turns before it, so production's `session_id`/`user_id` would
# group independent answers into a conversation that never happened (and run session judges on it).
ANSWER_FIELDS = ("response", "outputs", "retrieved_context", "trajectory", "trace", "session_id", "user_id")
ANSWER_KEYS = frozenset({"response", "retrieved_context", "trace"})
_DETAIL_MAX = 300


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "running the app over a dataset",
        "call your app for each dataset row and evaluate its answers "
        "(https://tracejudge.github.io/tracejudge/guides/gate-a-release/)")
    target = group.add_mutually_exclusive_group()
    target.add_argument("--app-endpoint", metavar="URL",
                        help="an OpenAI-compatible chat completions endpoint serving your app: the base URL "
                             "(http://host/v1) or the full .../chat/completions URL")
    target.add_argument("--app", metavar="MODULE:FUNCTION",
                        help="a Python function called with each row's request (imported from the current "
                             "directory or the installed packages)")
    group.add_argument("--app-model", default="app", metavar="MODEL",
                       help="the `model` sent to --app-endpoint (default: app)")
    group.add_argument("--app-api-key-env", metavar="VAR",
                       help="environment variable holding --app-endpoint's API key (sent as a bearer "
                            "token, never printed)")
    group.add_argument("--app-concurrency", type=_positive, metavar="N",
                       help="calls in flight at once (default: 8 for an endpoint, 1 for a function)")
    group.add_argument("--app-timeout", type=_seconds, default=DEFAULT_TIMEOUT_SECONDS, metavar="SECONDS",
                       help="how long one call may take (default 60; an endpoint's call is retried)")
    group.add_argument("--app-retries", type=count_argument, default=2, metavar="N",
                       help="retries of an endpoint call on 429, 5xx, timeouts and connection errors "
                            "(default 2)")
    group.add_argument("--max-app-errors", default="0", metavar="N|P%",
                       help="exit 1 when more rows than this (a count, or a share of the rows) got no answer "
                            "from the app (default 0: any app error fails the run)")


def _positive(text: str) -> int:
    n = count_argument(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {text!r}")
    return n


def count_argument(text: str) -> int:
    """An argparse type: a count (an integer >= 0); `tracejudge eval`'s own flags take it too."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a count (an integer >= 0), got {text!r}")
    return n


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


class AppError(Exception):
    """A call that produced no usable answer; `reason` is a bounded token (timeout, connection,
    http_5xx, http_4xx, rate_limited, circuit_open, invalid_response, exception, invalid_answer)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = " ".join(detail.split())[:_DETAIL_MAX]
        super().__init__(f"{reason}: {self.detail}")


@dataclass
class AppAnswer:
    """What the app answered for one row, or why it did not (`error`)."""

    response: str | None = None
    retrieved_context: list[dict[str, Any]] | None = None
    trace: Any = None
    tokens: TokenUsage | None = None
    seconds: float = 0.0
    error: AppError | None = None


class App(Protocol):
    kind: str

    async def call(self, request: Any) -> AppAnswer: ...

    async def aclose(self) -> None: ...


# ---------------------------------------------------------------------------------------------------
# The answers


def app_messages(request: Any) -> list[dict[str, Any]]:
    """The chat messages to send for a row's request: its messages when it has them (a list of
    messages, or a dict with `messages`), else the request's text as one user message."""
    if _is_messages(request):
        return list(request)
    if isinstance(request, Mapping) and _is_messages(request.get("messages")):
        return list(request["messages"])
    return [{"role": "user", "content": request if isinstance(request, str) else request_text(request) or ""}]


def _is_messages(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in value))


def _documents(value: Any, where: str) -> list[dict[str, Any]]:
    """`retrieved_context` as `{content, doc_uri}` dicts; strings are contents."""
    if not isinstance(value, list):
        raise AppError("invalid_answer", f"{where} must be a list of documents, got {type(value).__name__}")
    docs = []
    for i, d in enumerate(value):
        if isinstance(d, str):
            docs.append({"content": d})
        elif isinstance(d, Mapping) and set(d) <= {"content", "doc_uri", "page_content", "id"}:
            docs.append({k: v for k, v in d.items() if v is not None})
        else:
            raise AppError("invalid_answer", f"{where}[{i}] must be a string or an object with content and "
                           f"doc_uri, got {type(d).__name__}")
    return docs


def _trace(value: Any) -> Any:
    """A trace as the agent-eval `trace` field takes it: a dict, JSON text, or `obj.to_json()`."""
    if isinstance(value, Mapping | str):
        return value
    to_json = getattr(value, "to_json", None)
    if callable(to_json):
        return to_json()
    raise AppError("invalid_answer",
                   f"trace must be a dict, JSON text or have to_json(), got {type(value).__name__}")


def _looks_like_trace(value: Mapping[str, Any]) -> bool:
    return "info" in value and "data" in value


def answer_from(value: Any) -> AppAnswer:
    """A function's return value as an answer (see the module docstring); `AppError` naming what is
    wrong with it."""
    if isinstance(value, str):
        return AppAnswer(response=value)
    if isinstance(value, Mapping):
        if _looks_like_trace(value):
            return AppAnswer(trace=value)
        unknown = sorted(str(k) for k in value if k not in ANSWER_KEYS)
        if unknown:
            raise AppError("invalid_answer", f"returned a dict with {', '.join(unknown)}; expected the keys "
                           "response, retrieved_context, trace")
        answer = AppAnswer()
        if value.get("response") is not None:
            answer.response = response_text(value["response"])
        if value.get("retrieved_context") is not None:
            answer.retrieved_context = _documents(value["retrieved_context"], "retrieved_context")
        if value.get("trace") is not None:
            answer.trace = _trace(value["trace"])
        if answer.response is None and answer.trace is None:
            raise AppError("invalid_answer", "returned a dict with neither response nor trace")
        return answer
    if callable(getattr(value, "to_json", None)):
        return AppAnswer(trace=_trace(value))
    raise AppError("invalid_answer", f"returned {type(value).__name__}; expected a str, a dict with response "
                   "(and retrieved_context, trace) or a trace")


def chat_answer(data: Mapping[str, Any]) -> AppAnswer:
    """A chat completion as an answer: the message content, `usage`, and the extension fields
    `retrieved_context` and `trace`."""
    try:
        content = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        content = None
    if not isinstance(content, str):
        raise AppError("invalid_answer", "no choices[0].message.content string in the answer")
    answer = AppAnswer(response=content)
    if data.get("retrieved_context") is not None:
        answer.retrieved_context = _documents(data["retrieved_context"], "retrieved_context")
    if data.get("trace") is not None:
        answer.trace = _trace(data["trace"])
    usage = data.get("usage")
    if isinstance(usage, Mapping):
        counts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")]
        if all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            answer.tokens = TokenUsage(input=counts[0], output=counts[1], total=counts[2])
    return answer


# ---------------------------------------------------------------------------------------------------
# The apps


class HttpApp:
    """An OpenAI-compatible chat completions endpoint, called through the judges' HTTP client."""

    kind = "endpoint"

    def __init__(self, url: str, *, model: str, api_key: str | None, concurrency: int, timeout: float,
                 retries: int) -> None:
        base, path = split_url(url)
        try:
            config = EndpointConfig(
                base_url=base, model=model, chat_path=path, timeout_seconds=timeout,
                connect_timeout_seconds=min(timeout, 10.0), max_concurrency=concurrency, max_retries=retries,
                response_format="none", temperature=None,
                # A row refused by an open circuit is an app error: only a long run of failures opens it.
                breaker_failure_threshold=max(20, 2 * concurrency), breaker_reset_seconds=10.0)
        except ValidationError as exc:
            problems = "; ".join(f"{e['msg']}" for e in exc.errors())
            raise InputError(f"--app-endpoint: {problems}") from None
        self.client = JudgeClient("app", config, api_key=api_key)
        self.path = config.chat_path
        self.model = model

    async def call(self, request: Any) -> AppAnswer:
        try:
            data, _ = await self.client.post_json(self.path, {"model": self.model,
                                                              "messages": app_messages(request)})
        except JudgeCallError as exc:
            raise AppError(exc.reason, exc.detail) from None
        return chat_answer(data)

    async def aclose(self) -> None:
        await self.client.aclose()


def split_url(url: str) -> tuple[str, str]:
    """(base URL, chat path) of `--app-endpoint`: a URL ending in /chat/completions is split there."""
    stripped = url.rstrip("/")
    suffix = "/chat/completions"
    if stripped.endswith(suffix) and len(stripped) > len(suffix):
        return stripped[: -len(suffix)], suffix
    return stripped, suffix


class CallableApp:
    """A Python function of the request. A plain function runs on a thread of its own per call (a call
    that outlives `--app-timeout` is abandoned: the row is a timeout); `async def` runs on the loop."""

    kind = "callable"

    def __init__(self, fn: Callable[[Any], Any], timeout: float) -> None:
        self.fn = fn
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(fn)

    @classmethod
    def load(cls, spec: str, timeout: float) -> CallableApp:
        """`module:function`, imported as from the current directory (as `python -m` would); an
        `InputError` naming --app when it cannot be had."""
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        try:
            fn = load_plugin(spec, key="--app", noun="function", accept=callable)
        except ConfigError as exc:
            raise InputError(str(exc)) from None
        return cls(fn, timeout)

    async def call(self, request: Any) -> AppAnswer:
        try:
            if self.is_async:
                value = await asyncio.wait_for(self.fn(request), self.timeout)
            else:
                value = await asyncio.wait_for(self._in_thread(request), self.timeout)
        except TimeoutError:
            raise AppError("timeout", f"no answer within {self.timeout:g}s") from None
        except AppError:
            raise
        except Exception as exc:  # the user's code: any failure is this row's error
            raise AppError("exception", f"{type(exc).__name__}: {exc}") from None
        return answer_from(value)

    def _in_thread(self, request: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:
            if done.done():  # abandoned after a timeout
                return
            if exc is None:
                done.set_result(value)
            else:
                done.set_exception(exc)

        def work() -> None:
            try:
                value = self.fn(request)
            except BaseException as exc:  # handed to the awaiting call as its error
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, value, None)

        threading.Thread(target=work, name="tracejudge-app-call", daemon=True).start()
        return done

    async def aclose(self) -> None:
        return None


def build_app(args: argparse.Namespace) -> App | None:
    """The app the flags name, or None without --app/--app-endpoint; `InputError` naming the flag."""
    endpoint, spec = getattr(args, "app_endpoint", None), getattr(args, "app", None)
    if endpoint is None and spec is None:
        given = [flag for flag, default in (("--app-model", "app"), ("--app-api-key-env", None),
                                            ("--app-concurrency", None), ("--app-retries", 2),
                                            ("--app-timeout", DEFAULT_TIMEOUT_SECONDS),
                                            ("--max-app-errors", "0"))
                 if getattr(args, flag[2:].replace("-", "_"), default) != default]
        if given:
            raise InputError(f"{', '.join(given)} applies to the app: add --app-endpoint URL or --app "
                             "MODULE:FUNCTION")
        return None
    if args.format not in ("auto", "agent_eval"):
        raise InputError(f"--format {args.format}: the app runs on dataset rows (agent-evaluation records "
                         "with a request); use --format agent_eval or leave it out")
    timeout = args.app_timeout
    if spec is not None:
        http_only = [f for f, v in (("--app-model", args.app_model != "app"),
                                    ("--app-api-key-env", args.app_api_key_env)) if v]
        if http_only:
            raise InputError(f"{', '.join(http_only)} applies to --app-endpoint, not to --app")
        return CallableApp.load(spec, timeout)
    api_key = None
    if args.app_api_key_env:
        api_key = os.environ.get(args.app_api_key_env, "").strip()
        if not api_key:
            raise InputError(f"--app-api-key-env {args.app_api_key_env}: the environment variable is not set "
                             "or empty")
    concurrency = args.app_concurrency or DEFAULT_CONCURRENCY["endpoint"]
    return HttpApp(endpoint, model=args.app_model, api_key=api_key, concurrency=concurrency, timeout=timeout,
                   retries=args.app_retries)


# ---------------------------------------------------------------------------------------------------
# Calling it


class AppCaller:
    """Calls the app for a sequence of requests, `concurrency` at once on a loop of its own, and gives
    the answers back in order, at most `2 * concurrency` requests ahead of the consumer."""

    def __init__(self, app: App, concurrency: int) -> None:
        self.app = app
        self.concurrency = concurrency
        self.window = 2 * concurrency
        self._loop = asyncio.new_event_loop()
        self._sem: asyncio.Semaphore | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="tracejudge-app", daemon=True)
        self._thread.start()

    def answers(self, items: Iterable[tuple[Any, Any]]) -> Iterator[tuple[Any, AppAnswer]]:
        """(item, answer) for each (item, request), in order."""
        window: deque[tuple[Any, Future[AppAnswer]]] = deque()
        for item, request in items:
            window.append((item, asyncio.run_coroutine_threadsafe(self._call(request), self._loop)))
            while len(window) >= self.window or (window and window[0][1].done()):
                head, future = window.popleft()
                yield head, future.result()
        while window:
            head, future = window.popleft()
            yield head, future.result()

    async def _shutdown(self) -> None:
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.app.aclose()

    async def _call(self, request: Any) -> AppAnswer:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.concurrency)
        async with self._sem:
            started = time.monotonic()
            try:
                answer = await self.app.call(request)
            except AppError as exc:
                answer = AppAnswer(error=exc)
            except Exception as exc:  # a bug here must cost one row, not the run
                answer = AppAnswer(error=AppError("exception", f"{type(exc).__name__}: {exc}"))
            answer.seconds = time.monotonic() - started
            return answer

    def close(self) -> None:
        """Cancel the calls still in flight (a run that stopped early), close the app, stop the loop."""
        if not self._loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)
                self._loop.close()


# ---------------------------------------------------------------------------------------------------
# The dataset through the app


@dataclass
class _Row:
    line: int
    row: dict[str, Any]
    record: EvalRecord


@dataclass
class AppTally:
    """Rows the app was called for, answered, and failed by reason."""

    rows: int = 0
    answered: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def render(self, kind: str) -> str:
        failed = sum(self.errors.values())
        reasons = ", ".join(f"{r} {n}" for r, n in self.errors.most_common())
        return (f"app ({kind}): {self.rows} rows called, {self.answered} answered, {failed} app errors"
                + (f" ({reasons})" if reasons else ""))


Reject = Callable[[str, int, bytes | Oversized, RecordError], None]


class AppEvaluation:
    """Dataset lines in, the app's answers evaluated, results out in the dataset's order.

    The interface of `tracejudge eval`'s `FileEvaluation` (`results(inputs)`, `unreadable`): a line
    that is not a dataset row is rejected through `reject` (the same report and --rejects file); a
    file none of whose lines is a row ends the run (`unreadable`)."""

    def __init__(self, pipeline: Pipeline, caller: AppCaller, kind: str, max_bytes: int, reject: Reject,
                 err: IO[str] | None) -> None:
        self.pipeline = pipeline
        self.caller = caller
        self.kind = kind
        self.max_bytes = max_bytes
        self.reject = reject
        self.err = err
        self.tally = AppTally()
        self.shown = 0
        self.unreadable: str | None = None

    @classmethod
    def start(cls, stack: ExitStack, app: App, args: argparse.Namespace, pipeline: Pipeline, max_bytes: int,
              reject: Reject, err: IO[str] | None) -> AppEvaluation:
        """The evaluation of `app`'s answers, its caller's loop closed by `stack`."""
        caller = AppCaller(app, getattr(args, "app_concurrency", None) or DEFAULT_CONCURRENCY[app.kind])
        stack.callback(caller.close)
        return cls(pipeline, caller, app.kind, max_bytes, reject, err)

    def results(self, inputs: list[tuple[str, BinaryIO]]) -> Iterator[EvaluationResult]:
        for name, stream in inputs:
            yield from self._file(name, stream)
            if self.unreadable is not None:
                break
        hidden = sum(self.tally.errors.values()) - self.shown
        if hidden > 0 and self.err is not None:
            print(f"... and {hidden} more app error{'' if hidden == 1 else 's'} not shown (each is in its "
                  "result line)", file=self.err)

    def _file(self, name: str, stream: BinaryIO) -> Iterator[EvaluationResult]:
        counts = {"read": 0, "rejected": 0}
        first: list[tuple[bytes, RecordError]] = []
        rows = self._rows(name, stream, counts, first)
        for row, answer in self.caller.answers((r, _request_of(r.row)) for r in rows):
            record = self._answered(row, answer, name)
            source = SourceRef(format=record.source_format, file=name, line=row.line)
            yield self.pipeline.evaluate(record, source)
        if first and counts["read"] == 0:
            line, exc = first[0]
            self.unreadable = (f"{name}: no line could be read as a dataset row ({counts['rejected']} "
                               f"rejected): {diagnose_unreadable(name, line, exc.reason, exc.message)}")
        elif counts["read"] == 0 and counts["rejected"] == 0 and self.err is not None:
            print(f"{name}: empty (no lines), no rows", file=self.err)

    def _rows(self, name: str, stream: BinaryIO, counts: dict[str, int],
              first: list[tuple[bytes, RecordError]]) -> Iterator[_Row]:
        """The dataset rows of a file, each checked before the app is called for it."""
        try:
            for lineno, line in read_lines(stream, name, self.max_bytes):
                try:
                    row = self._row(line)
                except RecordError as exc:
                    counts["rejected"] += 1
                    if not first:
                        first.append((line.head if isinstance(line, Oversized) else line, exc))
                    self.reject(name, lineno, line, exc)
                    continue
                counts["read"] += 1
                yield _Row(lineno, *row)
        except InputError as exc:
            self.unreadable = str(exc)

    def _row(self, line: bytes | Oversized) -> tuple[dict[str, Any], EvalRecord]:
        if isinstance(line, Oversized):
            raise RecordError(errors.TOO_LARGE, f"{line.size} bytes, more than stream.max_record_bytes "
                              f"({self.max_bytes}); not parsed")
        obj = decode(line)
        kind = detect(obj)
        if kind != "agent_eval":
            raise RecordError(errors.UNKNOWN_FORMAT, f"a {kind} record, not a dataset row: the app is called "
                              "with an agent-evaluation row's request (and its expectations)")
        if obj.get("request") is None and obj.get("inputs") is None:
            raise RecordError(errors.INVALID_RECORD, "a dataset row must state its request (or inputs)",
                              "request")
        row = {k: v for k, v in obj.items() if k not in ANSWER_FIELDS}
        return row, self.pipeline.normalise(row, "agent_eval")

    def _answered(self, row: _Row, answer: AppAnswer, name: str) -> EvalRecord:
        """The row's record filled with the app's answer, or marked failed with the app's error."""
        self.tally.rows += 1
        if answer.error is None:
            try:
                record = self.pipeline.normalise(_filled(row.row, answer), "agent_eval")
            except RecordError as exc:
                answer.error = AppError("invalid_answer", exc.message)
            else:
                self.tally.answered += 1
                if record.latency_seconds is None:
                    record.latency_seconds = answer.seconds
                if record.tokens is None:
                    record.tokens = answer.tokens
                return record
        assert answer.error is not None
        error = answer.error
        self.tally.errors[error.reason] += 1
        if self.err is not None and self.shown < MAX_SHOWN_ERRORS:
            self.shown += 1
            print(f"{name}:{row.line}: app error ({error.reason}): {error.detail}", file=self.err)
        record = row.record
        record.failed = True
        record.error = f"app call failed ({error.reason}): {error.detail}"
        record.latency_seconds = answer.seconds
        return record

    def render(self) -> str:
        """The app's line of the summary: rows called, answered, errors by reason."""
        return self.tally.render(self.kind)

    def gate(self, allowance: Any) -> int:
        """1 when more rows got an app error than `allowance` (`.allows(n, of)`) lets through, with
        the count on stderr; else 0."""
        failed = sum(self.tally.errors.values())
        if failed and not allowance.allows(failed, self.tally.rows):
            reasons = ", ".join(f"{r} {n}" for r, n in self.tally.errors.most_common())
            print(f"tracejudge eval: app: {failed} of {self.tally.rows} rows got no answer ({reasons}), over "
                  f"--max-app-errors {allowance}", file=sys.stderr)
            return 1
        return 0


def _request_of(row: Mapping[str, Any]) -> Any:
    """What the app is called with: the row's `request` as stated, else mlflow.genai's `inputs`."""
    request = row.get("request")
    return request if request is not None else row.get("inputs")


def _filled(row: Mapping[str, Any], answer: AppAnswer) -> dict[str, Any]:
    filled = dict(row)
    if answer.response is not None:
        filled["response"] = answer.response
    if answer.retrieved_context is not None:
        filled["retrieved_context"] = answer.retrieved_context
    if answer.trace is not None:
        filled["trace"] = answer.trace if not isinstance(answer.trace, bytes) else answer.trace.decode()
    return filled
