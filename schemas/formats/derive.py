"""Derive the canonical `EvalRecord` from a format-neutral `Trace`.

Written once for every input format: MLflow JSON, OTLP spans and inference-log rows all become a
`Trace` first, so a trace means the same thing whichever wire it arrived on. Only `Trace`/`Span`
fields are read here, never a convention's attribute names (parsers map those onto the fields).

The rules follow MLflow's `mlflow.genai.utils.trace_utils` so scores agree with MLflow's judges,
except where MLflow's answer is not what a judge should see (a Python `repr` of the inputs, a JSON
dump of the whole chat history, a blank " " for a missing value). Those differences are listed in
the README ("Where tracejudge deliberately differs from MLflow") and each has its own test.

A field that cannot be derived is None, never guessed.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import Any, TypeVar

import msgspec
import orjson

from tracejudge.schemas.formats.conventions import MLFLOW_TRACE_COST, span_cost, span_model, stated_cost_parts
from tracejudge.schemas.record import (
    END_BEFORE_START,
    NEGATIVE_DURATION,
    NEGATIVE_TOKENS,
    NON_FINITE,
    PARENT_CYCLE,
    Cost,
    EvalRecord,
    ToolCall,
    add_warning,
)
from tracejudge.schemas.trace import Document, Span, SpanKind, SpanStatus, TokenUsage, Trace

__all__ = [
    "HTTP_STATUS_KEYS",
    "derive",
    "derived_record",
    "documents_from_output",
    "has_negative_tokens",
    "has_parent_cycle",
    "json_text",
    "merge",
    "model_calls",
    "model_usage_and_cost",
    "request_text",
    "response_text",
    "stated_latency",
    "sum_token_usage",
    "top_level_retrievers",
    "usage_spans",
    "usage_walk",
]

T = TypeVar("T")
U = TypeVar("U")

# Enum member lookups cost ~140 ns each on Python 3.11; per-span loops use these.
_TOOL, _RETRIEVER, _ERROR = SpanKind.TOOL, SpanKind.RETRIEVER, SpanStatus.ERROR
# Sort key for spans in time order: C-level attribute access, cheaper than a Python function.
_start = attrgetter("start_ns")

# Keys under which an app's input dict carries the user's question, in order of preference.
# `input_args`: OpenInference's DSPy instrumentation wraps a module's named arguments in it.
QUESTION_KEYS = ("query", "question", "input", "prompt", "request", "message", "user_input", "inputs",
                 "input_args")
# Keys under which an output dict carries the answer.
ANSWER_KEYS = ("content", "output", "answer", "response", "text", "result")
# Document text keys, in MLflow's order (`_RETRIEVER_DOCUMENT_CONTENT_KEYS`).
DOCUMENT_TEXT_KEYS = ("page_content", "content", "text")
# Nested payloads are unwrapped at most this deep: inputs are untrusted and may nest arbitrarily.
_MAX_DEPTH = 4
# An HTTP status recorded on the root span (OTel semantic conventions, both generations).
HTTP_STATUS_KEYS = ("http.response.status_code", "http.status_code")


def json_text(value: Any) -> str:
    """Compact UTF-8 JSON text; objects orjson cannot write are written with `str()`."""
    return orjson.dumps(value, default=str).decode()


# --------------------------------------------------------------------------------------------
# request / response text


def _text_of_content(content: Any) -> str | None:
    """The text of a chat message's `content`: a string, or the text parts of a multi-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content
                 if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text")]
        texts = [p for p in parts if isinstance(p, str)]
        if texts:
            return "\n".join(texts)
    return None


# LangChain's message types -> chat roles: `{"type": "human", ...}` (`message.model_dump()`), its
# `{"type": "ai", "data": {...}}` form (`messages_to_dict`) and the serialized
# `{"lc": 1, "type": "constructor", "id": [..., "AIMessage"], "kwargs": {...}}` form.
_LANGCHAIN_ROLES = {
    "human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool",
    "HumanMessage": "user", "HumanMessageChunk": "user", "AIMessage": "assistant",
    "AIMessageChunk": "assistant", "SystemMessage": "system", "ToolMessage": "tool",
    "FunctionMessage": "tool", "ChatMessage": None,
}


def _chat_message(value: Any) -> dict[str, Any] | None:
    """`value` as an OpenAI-style `{role, content, ...}` message, or None when it is none.

    OpenAI's shape is taken as it is; LangChain's three dict forms are unwrapped."""
    if type(value) is not dict:
        return None
    if "role" in value:
        return value
    kind = value.get("type")
    if kind == "constructor" and value.get("lc") == 1:
        ids, kwargs = value.get("id"), value.get("kwargs")
        if isinstance(ids, list) and ids and isinstance(kwargs, dict):
            role = _LANGCHAIN_ROLES.get(ids[-1]) or kwargs.get("role")
            return {**kwargs, "role": role} if role else None
        return None
    if isinstance(kind, str) and kind in _LANGCHAIN_ROLES:
        data = value.get("data")
        body = data if isinstance(data, dict) and "content" in data else value
        if "content" in body:
            role = _LANGCHAIN_ROLES[kind] or body.get("role")
            return {**body, "role": role} if role else None
    return None


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and _chat_message(value[-1]) is not None


def _last_message_text(messages: list[Any], role: str) -> str | None:
    for item in reversed(messages):
        message = _chat_message(item)
        if message is not None and message.get("role") == role:
            text = _text_of_content(message.get("content"))
            if text is not None:
                return text
    return None


def _question(value: Any, depth: int) -> str | None:
    if isinstance(value, str):
        return value
    if depth > _MAX_DEPTH:
        return None
    if _is_message_list(value):
        return _last_message_text(value, "user")
    if not isinstance(value, dict):
        return None
    messages = value.get("messages")
    if _is_message_list(messages):
        text = _last_message_text(messages, "user")
        if text is not None:
            return text
    for key in QUESTION_KEYS:
        inner = value.get(key)
        if inner is None:
            continue
        if isinstance(inner, str):
            return inner
        text = _question(inner, depth + 1)
        if text is not None:
            return text
    # A serving request in `dataframe_records` form holds one row per request.
    rows = value.get("dataframe_records")
    if isinstance(rows, list) and len(rows) == 1:
        return _question(rows[0], depth + 1)
    # A traced function with one string parameter: whatever it is called, that string is the question.
    if len(value) == 1:
        (only,) = value.values()
        if isinstance(only, str):
            return only
    return None


def request_text(value: Any) -> str | None:
    """The user's question in a request payload.

    A plain string; the last user message of a chat (`messages`, or a Responses-API `input` list);
    the `query`/`question`/`input`/`prompt`/… string field of a dict (unwrapping a nested request);
    the only string field of a one-field dict; else the JSON text of the payload. None for None.
    """
    if value is None:
        return None
    text = _question(value, 0)
    return text if text is not None else json_text(value)


def _answer(value: Any, depth: int) -> str | None:
    if isinstance(value, str):
        return value
    if depth > _MAX_DEPTH:
        return None
    if isinstance(value, list):
        if _is_message_list(value):
            return _responses_output_text(value) or _last_message_text(value, "assistant")
        # A pyfunc model wraps its one prediction in a list.
        return _answer(value[0], depth + 1) if len(value) == 1 else None
    if not isinstance(value, dict):
        return None
    choices = value.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        first = choices[0]
        message = first.get("message")
        if isinstance(message, dict):
            text = _text_of_content(message.get("content"))
            if text is not None:
                return text
        if isinstance(first.get("text"), str):  # legacy completions
            return first["text"]
    messages = value.get("messages")
    if _is_message_list(messages):
        text = _last_message_text(messages, "assistant")
        if text is None:
            last = _chat_message(messages[-1])
            if last is not None and isinstance(last.get("content"), str):
                text = last["content"]
        if text is not None:
            return text
    message = _chat_message(value)
    if message is not None:
        # One message: a LangChain AIMessage, or `{"role": "assistant", "content": ...}`.
        text = _text_of_content(message.get("content"))
        if text is not None:
            return text
    output = value.get("output")
    if isinstance(output, list):
        text = _responses_output_text(output)
        if text is not None:
            return text
    for key in ANSWER_KEYS:
        inner = value.get(key)
        if isinstance(inner, str):
            return inner
    predictions = value.get("predictions")
    if isinstance(predictions, list) and len(predictions) == 1:
        return _answer(predictions[0], depth + 1)
    return None


def _responses_output_text(output: list[Any]) -> str | None:
    """The assistant text of an OpenAI Responses-API `output` list (`type == "message"` items)."""
    for item in reversed(output):
        if isinstance(item, dict) and item.get("type") == "message" and item.get("role") == "assistant":
            text = _text_of_content(item.get("content"))
            if text is not None:
                return text
    return None


def response_text(value: Any) -> str | None:
    """The answer in a response payload.

    A plain string; `choices[0].message.content` of a chat completion; the last assistant message of
    `messages`; the assistant text of a Responses-API `output`; the `content`/`output`/`answer`/…
    string field of a dict; the one element of a one-element list; else the JSON text. None for None.
    """
    if value is None:
        return None
    text = _answer(value, 0)
    return text if text is not None else json_text(value)


# --------------------------------------------------------------------------------------------
# retrieved context, trajectory, tokens


def _document(chunk: Any) -> Document | None:
    if type(chunk) is not dict:
        if isinstance(chunk, str):
            return Document(chunk)
        if not isinstance(chunk, dict):
            return None
    content: Any = None
    for key in DOCUMENT_TEXT_KEYS:
        if key in chunk:
            content = chunk[key]
            break
    if content is not None and type(content) is not str:
        content = json_text(content)
    metadata = chunk.get("metadata")
    doc_uri = metadata.get("doc_uri") if type(metadata) is dict else None
    if not doc_uri:
        doc_uri = chunk.get("doc_uri")
    if doc_uri is not None and type(doc_uri) is not str:
        doc_uri = json_text(doc_uri)
    return Document(content, doc_uri or None)


def documents_from_output(output: Any) -> list[Document]:
    """The documents a retriever returned: a list of `Document`-like dicts (or strings)."""
    if isinstance(output, str):
        try:
            output = orjson.loads(output)
        except orjson.JSONDecodeError:
            return []
    if not isinstance(output, list):
        return []
    docs = []
    for chunk in output:
        # MLflow's `Document.to_dict()` (string page_content, a metadata dict with a string doc_uri)
        # is read inline: a call per chunk is a third of the cost. Anything else goes to `_document`.
        if type(chunk) is dict and "page_content" in chunk:
            content = chunk["page_content"]
            metadata = chunk.get("metadata")
            if type(content) is str and type(metadata) is dict:
                doc_uri = metadata.get("doc_uri")
                if doc_uri and type(doc_uri) is str:
                    docs.append(Document(content, doc_uri))
                    continue
        doc = _document(chunk)
        if doc is not None:
            docs.append(doc)
    return docs


def top_level_retrievers(spans: list[Span]) -> list[Span]:
    """RETRIEVER spans with no RETRIEVER ancestor (a retriever calling a retriever counts once)."""
    retrievers = [s for s in spans if s.kind == _RETRIEVER]
    if len(retrievers) < 2:  # a retriever can only be nested under another: no id map to build
        return retrievers
    by_id = {s.span_id: s for s in spans}
    limit = len(spans)
    result = []
    for span in retrievers:
        parent_id, hops, nested = span.parent_id, 0, False
        # `hops` bounds the walk: a malformed trace may have a cycle of parent ids.
        while parent_id and hops <= limit:
            parent = by_id.get(parent_id)
            if parent is None:
                break
            if parent.kind == _RETRIEVER:
                nested = True
                break
            parent_id, hops = parent.parent_id, hops + 1
        if not nested:
            result.append(span)
    return result


def _add(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else a + b


def usage_spans(spans: list[Span]) -> list[Span]:
    """The spans whose usage counts, each model call once: a depth-first walk from the roots that
    does not descend below a span with its own usage, so a wrapper span that rolls up its inner
    model call's usage is counted and the inner call is not (MLflow's `aggregate_usage_from_spans`
    does the same)."""
    return [span for span, _ in usage_walk(spans, _span_id, _parent_id, _token_usage)]


_span_id, _parent_id, _token_usage = attrgetter("span_id"), attrgetter("parent_id"), attrgetter("token_usage")


def usage_walk(spans: Sequence[T], span_id: Callable[[T], Any], parent_id: Callable[[T], Any],
               usage: Callable[[T], U | None]) -> list[tuple[T, U]]:
    """`usage_spans`' walk over spans of any shape (the MLflow wire reader's too): each counted span
    with its usage, in the walk's order. A span is a root when it has no parent, a parent no span
    has, or itself as parent."""
    ids = {span_id(s) for s in spans}
    children: dict[Any, list[T]] = {}
    stack: list[T] = []
    for span in spans:
        parent = parent_id(span)
        if parent and parent in ids and parent != span_id(span):
            children.setdefault(parent, []).append(span)
        else:
            stack.append(span)
    counted: list[tuple[T, U]] = []
    seen: set[int] = set()
    while stack:
        span = stack.pop()
        if id(span) in seen:  # duplicate span ids can make a node reachable twice
            continue
        seen.add(id(span))
        stated = usage(span)
        if stated is not None:
            counted.append((span, stated))
            continue
        stack.extend(children.get(span_id(span), ()))
    return counted


def _usage_sum(counted: list[Span]) -> TokenUsage | None:
    total: TokenUsage | None = None
    for span in counted:
        usage = span.token_usage
        if usage is None:
            continue
        if total is None:
            total = TokenUsage(usage.input, usage.output, usage.total)
        else:
            total = TokenUsage(_add(total.input, usage.input), _add(total.output, usage.output),
                               _add(total.total, usage.total))
    return total.with_total() if total is not None else None


def sum_token_usage(spans: list[Span]) -> TokenUsage | None:
    """Usage summed over the spans that state it, each model call counted once (`usage_spans`)."""
    return _usage_sum(usage_spans(spans))


# One counted model call as cost reads it: (model, usage, stated cost (input, output, total)).
CostParts = tuple[float | None, float | None, float | None]
ModelCall = tuple[str | None, TokenUsage | None, CostParts | None]


def model_calls(counted: list[Span]) -> list[ModelCall]:
    """The model, usage and stated cost of each counted model call (`usage_spans`)."""
    return [(span_model(attrs), span.token_usage, span_cost(attrs)) if (attrs := span.attributes)
            else (None, span.token_usage, None) for span in counted]


def one_model_calls(calls: list[ModelCall], tokens: TokenUsage | None) -> list[ModelCall]:
    """For a trace that states its usage (`tokens`): when every counted call names the same model and
    none states a cost, that model's usage is the trace's (MLflow's trace-level roll-up sums the same
    calls), one call; else the calls as they are. Both MLflow readers apply it, so they agree."""
    model = calls[0][0]
    for m, _, stated in calls:
        if m != model or stated is not None:
            return calls
    return [(model, tokens, None)]


def model_usage_and_cost(calls: list[ModelCall]) -> tuple[dict[str, TokenUsage] | None, Cost | None]:
    """Per-model usage of the counted model calls (`model_calls`) that name their model, and the
    cost they state (summed, source "stated") when every one of them states one: MLflow's
    trace-level roll-up can be a partial sum under asynchronous logging, its spans' costs are not.
    Values are as stated; `tracejudge.metrics.cost` checks them."""
    if len(calls) == 1:  # the usual trace: one model call
        model, usage, stated = calls[0]
        return ({model: usage.with_total()} if model is not None and usage is not None else None,
                None if stated is None else _stated(stated))
    sums: dict[str, list[int | None]] | None = None
    costs: list[CostParts] = []
    every_cost = True
    for model, usage, stated in calls:
        if model is not None and usage is not None:
            i, o, t = usage.input, usage.output, usage.total
            if t is None and i is not None and o is not None:
                t = i + o
            if sums is None:
                sums = {}
            had = sums.get(model)
            if had is None:
                sums[model] = [i, o, t]
            else:
                had[0], had[1], had[2] = _add(had[0], i), _add(had[1], o), _add(had[2], t)
        if stated is None:
            every_cost = False
        elif every_cost:
            costs.append(stated)
    by_model = None if sums is None else {m: TokenUsage(*u) for m, u in sums.items()}
    if not costs or not every_cost:
        return by_model, None
    if len(costs) == 1:
        return by_model, _stated(costs[0])
    # fsum: the same total whatever order a reader met the spans in.
    return by_model, _stated((_fsum([c[0] for c in costs]), _fsum([c[1] for c in costs]),
                              _fsum([c[2] for c in costs])))


def _fsum(values: list[float | None]) -> float | None:
    return None if None in values else math.fsum(values)  # type: ignore[arg-type]


def _stated(parts: tuple[float | None, float | None, float | None]) -> Cost:
    inp, out, total = parts
    if total is None and inp is not None and out is not None:
        total = inp + out
    return Cost(inp, out, total, source="stated")


# --------------------------------------------------------------------------------------------
# expectations


def _str_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):  # named guidelines: {"tone": ["…"], "scope": ["…"]}
        value = [g for group in value.values() for g in (group if isinstance(group, list) else [group])]
    if isinstance(value, list):
        return [v if isinstance(v, str) else json_text(v) for v in value]
    return [json_text(value)]


def expected_documents(value: Any) -> list[Document] | None:
    if value is None:
        return None
    return documents_from_output(value if isinstance(value, list) else [value])


def _tool_calls(value: Any) -> list[ToolCall] | None:
    if not isinstance(value, list):
        return None
    calls = []
    for step in value:
        if isinstance(step, dict) and isinstance(step.get("tool_name"), str):
            calls.append(ToolCall(step["tool_name"], step.get("tool_input") or None))
        elif isinstance(step, str):
            calls.append(ToolCall(step))
    return calls


def _expected_tool_calls(value: Any) -> list[ToolCall] | None:
    """MLflow's `expected_tool_calls` [{name, arguments?}] as ToolCalls (arguments None when not
    given). All or nothing: one malformed entry drops the expectation, so a tool-call judge reports
    it missing rather than judging against part of it."""
    if not isinstance(value, list):
        return None
    calls = []
    for call in value:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments")
        if arguments is not None and not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(call["name"], arguments))
    return calls


def apply_expectations(record: EvalRecord, expectations: Mapping[str, Any]) -> None:
    """Fill the expected_* fields of `record` from an expectations mapping (MLflow's names)."""
    if not expectations:
        return
    if "expected_response" in expectations:
        value = expectations["expected_response"]
        record.expected_response = value if isinstance(value, str) or value is None else response_text(value)
    if "expected_facts" in expectations:
        record.expected_facts = _str_list(expectations["expected_facts"])
    if "guidelines" in expectations:
        record.guidelines = _str_list(expectations["guidelines"])
    if "expected_retrieved_context" in expectations:
        record.expected_retrieved_context = expected_documents(expectations["expected_retrieved_context"])
    if "reference_trajectory" in expectations:
        record.reference_trajectory = _tool_calls(expectations["reference_trajectory"])
    if "expected_tool_calls" in expectations:
        record.reference_trajectory = _expected_tool_calls(expectations["expected_tool_calls"])


# --------------------------------------------------------------------------------------------
# the trace -> record derivation


def root_span(spans: Iterable[Span]) -> Span | None:
    """The first span without a parent (MLflow's `_get_root_span`)."""
    for span in spans:
        if span.parent_id is None:
            return span
    return None


def _span_error(span: Span) -> str | None:
    if span.exception:
        return span.exception
    if span.status == _ERROR:
        return span.status_message or f"span {span.name!r} status is ERROR"
    return None


def _failure(trace: Trace, root: Span | None, below: _Below | None) -> tuple[bool | None, str | None]:
    """Failed when the root span is in error or answered HTTP >= 500, or the trace's state says so;
    for spans from OpenTelemetry instrumentation (`below`), also when the app span or a top-level
    AGENT span is in error. A span in error below those (a tool the agent recovered from, a model
    call that was retried) is not a failure of the request."""
    error: str | None = None
    if root is not None:
        error = _span_error(root)
        if error is None:
            for key in HTTP_STATUS_KEYS:
                code = root.attributes.get(key)
                if isinstance(code, int) and not isinstance(code, bool) and code >= 500:
                    error = f"HTTP {code}"
                    break
    if error is None and below is not None:
        if below.app is not None and below.app is not root:
            error = _span_error(below.app)
        if error is None:
            for span in below.top_agents:
                error = _span_error(span)
                if error is not None:
                    break
    if error is None and trace.state == "ERROR":
        error = "trace state is ERROR"
    if error is not None:
        return True, error
    if trace.state is None and root is None:
        return None, None
    return False, None


# --------------------------------------------------------------------------------------------
# the app span: where an OpenTelemetry trace states the request it served

# Formats whose spans come from OpenTelemetry instrumentation: their root is often not the app's
# (an HTTP server span, a framework's content-less workflow span), so the request and response
# come from the app span and the model calls below it. An MLflow trace's root is the app by
# MLflow's definition, and its request and response are read there only, as MLflow reads them.
_OTLP_FORMATS = frozenset({"otlp_proto", "otlp_json"})


class _Below:
    """What an OpenTelemetry trace's spans below the root say about the request."""

    __slots__ = ("app", "model_calls", "top_agents")

    def __init__(self, spans: list[Span], root: Span | None) -> None:
        children: dict[str, list[Span]] = {}
        ids = {s.span_id for s in spans}
        for span in spans:
            if span.parent_id and span.parent_id in ids and span.parent_id != span.span_id:
                children.setdefault(span.parent_id, []).append(span)
        self.app = _app_span(root, children, len(spans))
        # Model calls in start order (a model call's own nested call is one more model call: the
        # first one's input and the last-ending one's output are what the fallbacks read).
        self.model_calls = sorted((s for s in spans if s.kind.is_model_call), key=_start)
        self.top_agents = _top_agents(root, children, len(spans))


def _carries_dialect(span: Span) -> bool:
    """The span states what it did under a convention tracejudge reads (not an HTTP or DB span)."""
    return span.kind is not SpanKind.UNKNOWN or span.inputs is not None or span.outputs is not None


def _app_span(root: Span | None, children: dict[str, list[Span]], limit: int) -> Span | None:
    """The outermost span that carries a dialect: the root when it does, else the first such span
    breadth-first below it (the earliest-starting one of its level)."""
    if root is None or _carries_dialect(root):
        return root
    level, seen = [root], {id(root)}
    while level and len(seen) <= limit:
        below = sorted((c for s in level for c in children.get(s.span_id, ()) if id(c) not in seen),
                       key=_start)
        for span in below:
            if _carries_dialect(span):
                return span
        seen.update(id(c) for c in below)
        level = below
    return root


def _top_agents(root: Span | None, children: dict[str, list[Span]], limit: int) -> list[Span]:
    """AGENT spans with no AGENT span above them, below the root."""
    if root is None:
        return []
    found: list[Span] = []
    stack, seen = list(children.get(root.span_id, ())), {id(root)}
    while stack and len(seen) <= limit:
        span = stack.pop()
        if id(span) in seen:
            continue
        seen.add(id(span))
        if span.kind is SpanKind.AGENT:
            found.append(span)
        else:
            stack.extend(children.get(span.span_id, ()))
    return found


def _request(root: Span | None, below: _Below | None) -> str | None:
    if below is None:
        return request_text(root.inputs) if root is not None else None
    app = below.app
    if app is not None and app.inputs is not None:
        text = _question(app.inputs, 0)
        if text is not None:
            return text
    # The app span holds no question: the first model call's last user message (a framework's
    # helper marked as a model call, LlamaIndex's `_prepare_chat_with_tools`, may state none).
    for call in below.model_calls:
        text = _question(call.inputs, 0) if call.inputs is not None else None
        if text is not None and not _is_repr(text):
            return text
    return request_text(app.inputs) if app is not None else None


def _response(root: Span | None, below: _Below | None, failed: bool | None) -> str | None:
    if below is None:
        return response_text(root.outputs) if root is not None else None
    app = below.app
    if app is not None and app.outputs is not None:
        text = _answer(app.outputs, 0)
        if text is not None and not _is_repr(text):
            return text
    if not failed and below.model_calls:
        # The app span holds no answer: the assistant text of the model call that ended last.
        last = max(below.model_calls, key=_end)
        text = _answer(last.outputs, 0) if last.outputs is not None else None
        if text is not None:
            return text
    return response_text(app.outputs) if app is not None else None


# A Python object's repr, which instrumentors write when a framework returns an object they cannot
# serialize (LlamaIndex's `StopEvent(result=AgentOutput(...))`): no judge should read it as text.
_REPR = re.compile(r"[A-Z][A-Za-z0-9_]*\((?:[a-z_][a-z0-9_]*=|\))")


def _is_repr(text: str) -> bool:
    return _REPR.match(text) is not None


def _is_dspy_finish(span: Span) -> bool:
    """DSPy ReAct's built-in `finish` step, which its instrumentation traces as a tool call: the
    agent deciding it is done, not a tool it ran."""
    return (span.tool_name == "finish" and span.outputs in ("Completed.", '"Completed."')
            and span.inputs in (None, {}, {"kwargs": {}}))


def requested_tool_calls(spans: list[Span]) -> list[ToolCall]:
    """The tool calls the model calls asked for, in order: an app that runs its tools without
    spans (a hand-written loop on a model SDK's instrumentation) states them only there. Only
    outermost model calls are read, so a framework's model span and the SDK span inside it count
    once."""
    calls = [s for s in spans if s.kind.is_model_call and s.outputs is not None]
    if not calls:
        return []
    by_id = {s.span_id: s for s in spans}
    out: list[ToolCall] = []
    for span in sorted(calls, key=_start):
        parent, hops = by_id.get(span.parent_id) if span.parent_id else None, 0
        while parent is not None and hops <= len(spans) and not parent.kind.is_model_call:
            parent, hops = by_id.get(parent.parent_id) if parent.parent_id else None, hops + 1
        if parent is not None and parent.kind.is_model_call:
            continue
        choices = span.outputs.get("choices") if isinstance(span.outputs, dict) else None
        message = choices[0].get("message") if isinstance(choices, list) and choices and \
            isinstance(choices[0], dict) else None
        for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    with contextlib.suppress(orjson.JSONDecodeError):
                        arguments = orjson.loads(arguments)
                out.append(ToolCall(function["name"], arguments or None))
    return out


def _stripped(text: str | None) -> str | None:
    """Instrumentors pad text their framework printed (Strands' `str(result)` ends in a newline):
    the white space around a request or answer means nothing to a judge."""
    return text.strip() if text is not None else None


def _end(span: Span) -> int:
    return span.end_ns if span.end_ns is not None else span.start_ns


_INF = math.inf


def stated_latency(duration_ms: float | None) -> tuple[float | None, str | None]:
    """A stated duration in milliseconds as latency in seconds, or None and the reason it was set
    aside (`NEGATIVE_DURATION`, `NON_FINITE`): time only moves forward, so no percentile or
    histogram may see it. (None, None) when nothing was stated."""
    if duration_ms is None:
        return None, None
    if 0 <= duration_ms < _INF:
        return duration_ms / 1000.0, None
    return None, NEGATIVE_DURATION if -_INF < duration_ms < 0 else NON_FINITE


def _latency(trace: Trace, root: Span | None) -> tuple[float | None, str | None]:
    """The duration the source states (MLflow's `execution_duration`, what its UI shows) wins over
    the root span's own timing, which is the fallback (OTLP states none). A root span that ends
    before it starts gives no latency, and says so."""
    if trace.duration_ms is not None:
        return stated_latency(trace.duration_ms)
    if root is None or root.end_ns is None:
        return None, None
    if root.end_ns >= root.start_ns:
        return (root.end_ns - root.start_ns) / 1e9, None
    return None, END_BEFORE_START


def has_parent_cycle(spans: Iterable[T], span_id: Callable[[T], Any], parent_id: Callable[[T], Any]) -> bool:
    """Whether some span's chain of parents comes back on itself (a -> b -> a, or a span that is its
    own parent). Such a trace has no root, so its request, response and latency cannot be read: the
    record names the cycle rather than leaving those null without a reason. Spans of any shape (the
    MLflow wire reader's too); a parent no span has ends a chain. Each span is visited once."""
    parents = {span_id(s): parent_id(s) for s in spans}
    done: set[Any] = set()
    for start in parents:
        path: set[Any] = set()
        node = start
        while node is not None and node not in done:
            if node in path:
                return True
            path.add(node)
            node = parents.get(node)
        done |= path
    return False


def has_negative_tokens(tokens: TokenUsage) -> bool:
    """A token count below zero: the usage is set aside (`NEGATIVE_TOKENS`) rather than summed."""
    inp, out, total = tokens.input, tokens.output, tokens.total
    return (inp is not None and inp < 0) or (out is not None and out < 0) or (total is not None and total < 0)


def derive(trace: Trace) -> EvalRecord:
    """Everything the trace lets us derive about the request it recorded."""
    spans = trace.spans
    retrievers = top_level_retrievers(spans)
    retrieved: list[Document] | None = None
    if retrievers:
        retrieved = []
        if len(retrievers) > 1:
            retrievers.sort(key=_start)
        for span in retrievers:
            docs = span.documents if span.documents is not None else documents_from_output(span.outputs)
            retrieved.extend(docs)

    tools = [s for s in spans if s.kind == _TOOL]
    if len(tools) > 1:
        tools.sort(key=_start)
    trajectory = [ToolCall(s.tool_name or s.name, s.inputs or None) for s in tools]
    if trace.source_format in _OTLP_FORMATS:
        if not tools:
            trajectory = requested_tool_calls(spans)
        elif any(s.tool_name == "finish" for s in tools):
            trajectory = [c for c, s in zip(trajectory, tools, strict=True) if not _is_dspy_finish(s)]

    # The model calls whose usage counts: only when some span states usage (most MLflow traces'
    # do, with the trace's own total beside them; OTLP traces state no total).
    counted = usage_spans(spans) if any(s.token_usage is not None for s in spans) else []
    tokens = trace.token_usage.with_total() if trace.token_usage is not None else _usage_sum(counted)
    calls = model_calls(counted) if counted else None
    if calls and trace.token_usage is not None:
        calls = one_model_calls(calls, tokens)
    root = root_span(spans)
    cycle = root is None and bool(spans) and has_parent_cycle(spans, _span_id, _parent_id)
    return derived_record(trace, root, retrieved, trajectory, tokens, spans, calls, cycle=cycle)


def derived_record(trace: Trace, root: Span | None, retrieved: list[Document] | None,
                   trajectory: list[ToolCall], tokens: TokenUsage | None,
                   spans: list[Span] | None = None, calls: list[ModelCall] | None = None, *,
                   cycle: bool = False) -> EvalRecord:
    """The record of `trace` once its spans are read: its root span (the first without a parent),
    the documents of its top-level retrievers in start order (None when it has no retriever), its
    tool calls in start order, its token usage and the model calls whose usage counts (`calls`:
    `model_calls(usage_spans(...))`, for the per-model usage and the cost they state). `derive()`
    reads them from `trace.spans`; the msgspec reader of MLflow JSON
    (`tracejudge.schemas.formats.mlflow_wire`) gathers them while it reads the spans, without building the
    others, and only `trace`'s other fields are read here. `cycle`: the spans' parents loop
    (`has_parent_cycle`), named in the record's warnings.

    What time or counts cannot be (a negative or non-finite duration, a root ending before it
    starts, a negative token count) is None and named in `EvalRecord.warnings`."""
    latency, anomaly = _latency(trace, root)
    if tokens is not None and has_negative_tokens(tokens):
        tokens = None
        anomaly_tokens = True
    else:
        anomaly_tokens = False

    timestamp: float | None = None
    if trace.request_time_ms is not None:
        timestamp = trace.request_time_ms / 1000.0
    elif root is not None and root.start_ns:
        timestamp = root.start_ns / 1e9

    # OpenTelemetry traces: the app span below a non-GenAI root, model-call fallbacks, failure
    # below the root. `spans` is None from the MLflow reader, which reads the root only.
    # A trace whose root never arrived has no app span: nothing below is read as the request's.
    below = (_Below(spans, root) if root is not None and spans is not None
             and trace.source_format in _OTLP_FORMATS else None)
    failed, error = _failure(trace, root, below)
    record = EvalRecord(
        request_id=trace.client_request_id or trace.trace_id,
        trace_id=trace.trace_id,
        app=trace.app,
        source_format=trace.source_format,
        request=_request(root, below) if below is None else _stripped(_request(root, below)),
        response=(_response(root, below, failed) if below is None
                  else _stripped(_response(root, below, failed))),
        retrieved_context=retrieved,
        trajectory=trajectory,
        latency_seconds=latency,
        failed=failed,
        error=error,
        tokens=tokens,
        timestamp=timestamp,
        tags=dict(trace.tags),
        complete=trace.complete,
        root_span_id=root.span_id if root is not None else None,
        session_id=trace.session_id,
        user_id=trace.user_id,
        human_labels=trace.human_labels,
    )
    if anomaly is not None:
        add_warning(record, anomaly)
    if anomaly_tokens:
        add_warning(record, NEGATIVE_TOKENS)
    if cycle:
        add_warning(record, PARENT_CYCLE)
    if calls:
        record.model_usage, record.cost = model_usage_and_cost(calls)
    if record.cost is None and MLFLOW_TRACE_COST in trace.metadata:
        parts = stated_cost_parts(trace.metadata[MLFLOW_TRACE_COST])
        if parts is not None:
            record.cost = _stated(parts)
    apply_expectations(record, trace.expectations)
    return record


def merge(stated: EvalRecord, derived: EvalRecord) -> EvalRecord:
    """`stated` with its gaps filled from `derived`: a field the record states wins over one
    derived from its trace. Tags are merged, the stated ones winning; `complete` is the AND."""
    updates: dict[str, Any] = {}
    for name in EvalRecord.__struct_fields__:
        if name == "tags":
            updates["tags"] = {**derived.tags, **stated.tags}
        elif name == "complete":
            updates["complete"] = stated.complete and derived.complete
        elif name == "source_format":
            updates[name] = (stated.source_format if stated.source_format != "unknown"
                             else derived.source_format)
        elif name == "warnings":
            if derived.warnings:  # both sides' reasons, each once
                updates[name] = [*(stated.warnings or ()),
                                 *(w for w in derived.warnings if w not in (stated.warnings or ()))]
        elif getattr(stated, name) is None:
            updates[name] = getattr(derived, name)
    return msgspec.structs.replace(stated, **updates)
