"""Derive the canonical `EvalRecord` from a format-neutral `Trace`.

Written once for every input format: MLflow JSON, OTLP spans and inference-log rows all become a
`Trace` first, so a trace means the same thing whichever wire it arrived on. Only `Trace`/`Span`
fields are read here, never a convention's attribute names (parsers map those onto the fields).

The rules follow MLflow's `mlflow.genai.utils.trace_utils` so scores agree with MLflow's judges,
except where MLflow's answer is not what a judge should see (a Python `repr` of the inputs, a JSON
dump of the whole chat history, a blank " " for a missing value). Those differences are listed in
docs/pages/inputs/formats.md ("Where tracejudge deliberately differs from MLflow") and each has its own test.

A field that cannot be derived is None, never guessed. The request and response text of a payload
are read by `derive_text`, the token usage and cost of the model calls by `derive_usage`; this module
reads the rest (retrieved documents, tool calls, the app span, failure, latency, expectations) and
makes the record.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter
from typing import Any, TypeVar

import msgspec
import orjson

from tracejudge.schemas.formats.derive_text import (
    answer_in,
    json_text,
    question_in,
    request_text,
    response_text,
)
from tracejudge.schemas.formats.derive_usage import (
    ModelCall,
    has_negative_tokens,
    model_calls,
    model_usage_and_cost,
    one_model_calls,
    stated_cost,
    usage_spans,
    usage_sum,
)
from tracejudge.schemas.formats.model_cost import MLFLOW_TRACE_COST, stated_cost_parts
from tracejudge.schemas.record import (
    END_BEFORE_START,
    NEGATIVE_DURATION,
    NEGATIVE_TOKENS,
    NON_FINITE,
    PARENT_CYCLE,
    TOOL_ERROR_MAX_CHARS,
    EvalRecord,
    ToolCall,
    add_warning,
)
from tracejudge.schemas.trace import Document, Span, SpanKind, SpanStatus, TokenUsage, Trace

__all__ = [
    "DOCUMENT_TEXT_KEYS",
    "HTTP_STATUS_KEYS",
    "apply_expectations",
    "derive",
    "derived_record",
    "documents_from_output",
    "expected_documents",
    "has_parent_cycle",
    "merge",
    "requested_tool_calls",
    "root_span",
    "stated_latency",
    "tool_error",
    "top_level_retrievers",
]

T = TypeVar("T")

# Enum member lookups cost ~140 ns each on Python 3.11; per-span loops use these.
_TOOL, _RETRIEVER, _ERROR = SpanKind.TOOL, SpanKind.RETRIEVER, SpanStatus.ERROR
# Sort key for spans in time order: C-level attribute access, cheaper than a Python function.
_start = attrgetter("start_ns")
_span_id, _parent_id = attrgetter("span_id"), attrgetter("parent_id")

# Document text keys, in MLflow's order (`_RETRIEVER_DOCUMENT_CONTENT_KEYS`).
DOCUMENT_TEXT_KEYS = ("page_content", "content", "text")
# An HTTP status recorded on the root span (OTel semantic conventions, both generations).
HTTP_STATUS_KEYS = ("http.response.status_code", "http.status_code")


# --------------------------------------------------------------------------------------------
# retrieved context and trajectory


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


def tool_error(exception: str | None, in_error: bool, status_message: str, name: str) -> str | None:
    """A tool call's `ToolCall.error` from its span: the exception event's text, else the ERROR
    status's message (else that the status is ERROR); None for a span not in error. Cut to
    `TOOL_ERROR_MAX_CHARS`. The MLflow wire reader calls it with its raw span's parts."""
    if exception:
        return exception[:TOOL_ERROR_MAX_CHARS]
    if in_error:
        return (status_message or f"span {name!r} status is ERROR")[:TOOL_ERROR_MAX_CHARS]
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
        text = question_in(app.inputs, 0)
        if text is not None:
            return text
    # The app span holds no question: the first model call's last user message (a framework's
    # helper marked as a model call, LlamaIndex's `_prepare_chat_with_tools`, may state none).
    for call in below.model_calls:
        text = question_in(call.inputs, 0) if call.inputs is not None else None
        if text is not None and not _is_repr(text):
            return text
    return request_text(app.inputs) if app is not None else None


def _response(root: Span | None, below: _Below | None, failed: bool | None) -> str | None:
    if below is None:
        return response_text(root.outputs) if root is not None else None
    app = below.app
    if app is not None and app.outputs is not None:
        text = answer_in(app.outputs, 0)
        if text is not None and not _is_repr(text):
            return text
    if not failed and below.model_calls:
        # The app span holds no answer: the assistant text of the model call that ended last.
        last = max(below.model_calls, key=_end)
        text = answer_in(last.outputs, 0) if last.outputs is not None else None
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
    trajectory = [ToolCall(s.tool_name or s.name, s.inputs or None,
                           tool_error(s.exception, s.status == _ERROR, s.status_message, s.name)
                           if s.exception or s.status == _ERROR else None) for s in tools]
    if trace.source_format in _OTLP_FORMATS:
        if not tools:
            trajectory = requested_tool_calls(spans)
        elif any(s.tool_name == "finish" for s in tools):
            trajectory = [c for c, s in zip(trajectory, tools, strict=True) if not _is_dspy_finish(s)]

    # The model calls whose usage counts: only when some span states usage (most MLflow traces'
    # do, with the trace's own total beside them; OTLP traces state no total).
    counted = usage_spans(spans) if any(s.token_usage is not None for s in spans) else []
    tokens = trace.token_usage.with_total() if trace.token_usage is not None else usage_sum(counted)
    calls = model_calls(counted) if counted else None
    if calls and trace.token_usage is not None:
        calls = one_model_calls(calls, tokens)
    root = root_span(spans)
    cycle = root is None and bool(spans) and has_parent_cycle(spans, _span_id, _parent_id)
    return derived_record(trace, root, retrieved, trajectory, tokens, spans, calls, cycle=cycle,
                          tool_chars=max_output_chars(tools))


def max_output_chars(tools: list[Span]) -> int | None:
    """The largest `output_chars` of the tool spans; None when none states its result as text."""
    sizes = [s.output_chars for s in tools if s.output_chars is not None]
    return max(sizes) if sizes else None


def derived_record(trace: Trace, root: Span | None, retrieved: list[Document] | None,
                   trajectory: list[ToolCall], tokens: TokenUsage | None,
                   spans: list[Span] | None = None, calls: list[ModelCall] | None = None, *,
                   cycle: bool = False, tool_chars: int | None = None) -> EvalRecord:
    """The record of `trace` once its spans are read: its root span (the first without a parent),
    the documents of its top-level retrievers in start order (None when it has no retriever), its
    tool calls in start order, its token usage and the model calls whose usage counts (`calls`:
    `model_calls(usage_spans(...))`, for the per-model usage and the cost they state). `derive()`
    reads them from `trace.spans`; the msgspec reader of MLflow JSON
    (`tracejudge.schemas.formats.mlflow_wire`) gathers them while it reads the spans, without building the
    others, and only `trace`'s other fields are read here. `cycle`: the spans' parents loop
    (`has_parent_cycle`), named in the record's warnings. `tool_chars`: the largest tool result's
    length (`max_output_chars`).

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
    )
    # Set apart: a call of more than 15 keywords makes CPython build a dict of them on every record.
    record.complete = trace.complete
    record.root_span_id = root.span_id if root is not None else None
    record.session_id = trace.session_id
    record.user_id = trace.user_id
    record.human_labels = trace.human_labels
    record.version = trace.version
    record.max_tool_result_chars = tool_chars
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
            record.cost = stated_cost(parts)
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
