"""MLflow trace JSON in exactly the shape `Trace.to_json()` writes, read with msgspec: the hot path.

Most of a trace's bytes are its spans' `mlflow.spanInputs`/`spanOutputs`, JSON strings that
derivation mostly never reads. orjson would allocate all of them; msgspec decodes the document into
the structs below instead, checking the declared types and decoding the base64 ids in C, keeping
the few attributes derivation may read as the raw bytes of their JSON text (`msgspec.Raw`) and
skipping every other key unread.

* `derive_canonical_json(payload)` gives the `EvalRecord` (what `normalise()` reads whole payloads
  with). When the trace states its own token usage, as MLflow writes it whenever a span recorded
  usage, derivation reads only the root span, the TOOL spans, the top-level RETRIEVER spans and the
  model named by the spans stating usage: one pass over the spans finds those, and they are read
  straight into the record's parts (`_lean_parts`), building no `Span` but the root's; the chains,
  model calls and rerankers around them, half the spans of a RAG agent's trace, are checked like
  the rest and dropped. Nesting (retrievers inside retrievers, model calls inside wrappers) is read
  by `derive()`'s own rules, whatever the order, repeated ids or loops of the span list.
* `parse_canonical_json(payload)` gives the `Trace` with every span.

Both give None for anything else (another shape, another format, bad input): the caller decodes the
payload and calls the general reader (`tracejudge.schemas.formats.mlflow.parse_trace`), which reads every
form and names what is wrong. For the payloads they read, the record equals `derive()` of the
general reader's `Trace`; tests/test_mlflow_fast_path.py checks that on real and mutated traces,
and bench/bench_derive.py on its corpus before it times anything.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Annotated, Any

import msgspec
import orjson

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.derive import (
    HTTP_STATUS_KEYS,
    derive,
    derived_record,
    documents_from_output,
    has_parent_cycle,
    tool_error,
)
from tracejudge.schemas.formats.derive_usage import ModelCall, one_model_calls, usage_walk
from tracejudge.schemas.formats.mlflow import parse_trace
from tracejudge.schemas.formats.mlflow_rules import (
    CHAT_USAGE,
    KINDS,
    LLM_COST,
    LLM_MODEL,
    RAW_KINDS,
    RETRIEVER,
    SPAN_INPUTS,
    SPAN_OUTPUTS,
    SPAN_TYPE,
    STATUS,
    TOOL,
    TRACE_USAGE,
    UNKNOWN,
    UNSET,
    Malformed,
    attr_value,
    build_trace,
    check_events,
    exception_text,
    read_usage,
    tool_name,
)
from tracejudge.schemas.formats.model_cost import span_cost, span_model
from tracejudge.schemas.record import EvalRecord, ToolCall
from tracejudge.schemas.trace import Document, Span, SpanKind, SpanStatus, TokenUsage, Trace

__all__ = ["derive_canonical_json", "parse_canonical_json", "parse_trace_json"]

_span_start = attrgetter("start_time_unix_nano")

# orjson, which the general path reads with, gives a float for an integer beyond 64 bits, and
# msgspec bounds must fit an int64: times past 2**63 - 1 ns (year 2262) take the general path.
_WireInt = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
_NO_EVENTS = msgspec.Raw(b"[]")
_SpanId = Annotated[bytes, msgspec.Meta(min_length=8, max_length=8)]


class _NotCanonical(Exception):
    """The span list is not in the shape `Trace.to_json()` of MLflow >= 3.5 writes."""


# --------------------------------------------------------------------------------------------
# the wire structs: every key derivation reads, exactly typed; anything else is skipped unread


class _WireExperiment(msgspec.Struct, gc=False):
    experiment_id: str | None = None


class _WireLocation(msgspec.Struct, gc=False):
    type: str | None = None
    mlflow_experiment: _WireExperiment | None = None


class _WireInfo(msgspec.Struct, gc=False):
    # The keys `_trace` of the general reader reads, typed as it checks them; a value it would
    # convert or drop (a string of digits, a non-string tag) fails here, and it reads the trace.
    trace_id: str
    client_request_id: str | None = None
    trace_location: _WireLocation | None = None
    request_time: str | _WireInt | None = None
    state: str | None = None
    execution_duration_ms: _WireInt | None = None
    execution_duration: str | None = None
    trace_metadata: dict[str, str] | None = None
    tags: dict[str, str] | None = None
    assessments: msgspec.Raw = None  # rare, and any JSON: decoded by orjson like the general path


class _WireStatus(msgspec.Struct, gc=False):
    code: str
    message: str


# The root span's attributes `derive()` reads besides its payloads (struct field, attribute key).
_HTTP_FIELDS = tuple((f"http_{i}", key) for i, key in enumerate(HTTP_STATUS_KEYS))
# The attributes derivation reads: `mlflow.spanType` as written ('"RETRIEVER"', a JSON string),
# payloads and usage as raw JSON text (decoded only for the spans that need them), and the root
# span's HTTP status.
_WireAttributes = msgspec.defstruct("_WireAttributes", [
    ("span_type", str | None, msgspec.field(name=SPAN_TYPE, default=None)),
    ("inputs", msgspec.Raw, msgspec.field(name=SPAN_INPUTS, default=None)),
    ("outputs", msgspec.Raw, msgspec.field(name=SPAN_OUTPUTS, default=None)),
    ("usage", msgspec.Raw, msgspec.field(name=CHAT_USAGE, default=None)),
    ("model", msgspec.Raw, msgspec.field(name=LLM_MODEL, default=None)),
    ("cost", msgspec.Raw, msgspec.field(name=LLM_COST, default=None)),
    *((name, msgspec.Raw, msgspec.field(name=key, default=None)) for name, key in _HTTP_FIELDS),
], gc=False)


class _WireSpan(msgspec.Struct, gc=False):
    # Every key is required and exactly typed: a span written any other way is read by the general
    # reader. msgspec's base64 is binascii's strict mode: standard alphabet, padded, nothing after
    # the padding, so an 8-byte id is exactly the 12-character form the general reader decodes;
    # the general reader reads an id of another length.
    span_id: _SpanId
    parent_span_id: _SpanId | None
    name: str
    start_time_unix_nano: _WireInt
    end_time_unix_nano: _WireInt
    status: _WireStatus
    attributes: _WireAttributes
    events: msgspec.Raw  # nearly always "[]"; anything else is decoded and checked as JSON


class _WireData(msgspec.Struct, gc=False):
    spans: list[_WireSpan]


class _WireTrace(msgspec.Struct, gc=False):
    info: _WireInfo
    data: _WireData


class _WireDocumentMetadata(msgspec.Struct, gc=False):
    doc_uri: str


class _WireDocument(msgspec.Struct, gc=False):
    # MLflow's `Document.to_dict()`; its other keys (id, chunk_id, score...) are skipped unread.
    page_content: str
    metadata: _WireDocumentMetadata


_WIRE_DECODER = msgspec.json.Decoder(_WireTrace)
_DOCUMENTS_DECODER = msgspec.json.Decoder(list[_WireDocument])
# A Raw's bytes reach orjson only through memoryview(), ~200 ns each: msgspec reads the JSON
# string holding an attribute's JSON at about orjson's speed without that toll.
_STRING_DECODER = msgspec.json.Decoder(str)


class _WireUsage(msgspec.Struct, gc=False):
    # `mlflow.chat.tokenUsage` as MLflow writes it; anything else is read by `read_usage`.
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    cache_read_input_tokens: int | None = None


_USAGE_DECODER = msgspec.json.Decoder(_WireUsage)

# What the wire structs reject, or what the checks after them raise: the general reader decides.
_NOT_READ = (msgspec.DecodeError, UnicodeError, _NotCanonical, Malformed, KeyError, TypeError, ValueError,
             AttributeError, IndexError, OverflowError, RecursionError)


# --------------------------------------------------------------------------------------------
# attribute values


def _raw_attr(raw: msgspec.Raw) -> Any:
    """`attr_value` of an attribute's JSON text: the JSON string, then the JSON inside it."""
    try:
        text = _STRING_DECODER.decode(raw)
    except msgspec.ValidationError:  # not a string: a value set directly on the span, kept as is
        return orjson.loads(memoryview(raw))
    return attr_value(text)


def _span_usage(raw: msgspec.Raw) -> TokenUsage | None:
    """`read_usage(_raw_attr(raw))`, typed by msgspec for the shape MLflow writes (integers or null)."""
    try:
        wire = _USAGE_DECODER.decode(_STRING_DECODER.decode(raw))
    except msgspec.DecodeError:
        return read_usage(_raw_attr(raw))
    return _wire_usage(wire)


def _trace_usage(metadata: dict[str, str] | None) -> TokenUsage | None:
    """`_stated_usage(metadata)` (`mlflow.trace.tokenUsage`), typed by msgspec as `_span_usage`."""
    stated = None if metadata is None else metadata.get(TRACE_USAGE)
    if stated is None:
        return None
    try:
        wire = _USAGE_DECODER.decode(stated)
    except msgspec.DecodeError:
        return read_usage(attr_value(stated))
    return _wire_usage(wire)


def _wire_usage(wire: _WireUsage) -> TokenUsage | None:
    inp, out, total = wire.input_tokens, wire.output_tokens, wire.total_tokens
    if inp is None and out is None and total is None:
        return None
    return TokenUsage(inp, out, total, wire.cache_read_input_tokens)


def _raw_documents(raw: msgspec.Raw) -> list[Document]:
    """A retriever's `mlflow.spanOutputs` as `documents_from_output` reads it, straight into
    `Document`s when it is a list of MLflow `Document.to_dict()`s (~60% of the cost)."""
    try:
        chunks = _DOCUMENTS_DECODER.decode(_STRING_DECODER.decode(raw))
    except (msgspec.DecodeError, RecursionError):
        return documents_from_output(_raw_attr(raw))
    documents = [Document(chunk.page_content, chunk.metadata.doc_uri) for chunk in chunks]
    for document in documents:
        if not document.doc_uri:  # `documents_from_output` then looks for a top-level doc_uri
            return documents_from_output(_raw_attr(raw))
    return documents


def _root_attributes(attrs: Any) -> dict[str, Any]:
    out = {}
    for name, key in _HTTP_FIELDS:
        raw = getattr(attrs, name)
        if raw is not None:
            out[key] = _raw_attr(raw)
    return out


def _events_exception(events: msgspec.Raw) -> str | None:
    decoded = orjson.loads(memoryview(events))
    if type(decoded) is not list:
        raise _NotCanonical
    check_events(decoded, "time_unix_nano")
    return exception_text(decoded)


def _kind_of(raw: Any) -> SpanKind:
    """`mlflow.spanType` as the general reader reads it when it is not one of the usual quoted names."""
    if raw is None:
        return UNKNOWN
    value = attr_value(raw)
    return KINDS.get(value, UNKNOWN) if type(value) is str else UNKNOWN


def _tool_inputs(raw: msgspec.Raw) -> Any:
    # `_raw_attr` inlined for the common case: a JSON string holding JSON.
    try:
        return orjson.loads(_STRING_DECODER.decode(raw))
    except (msgspec.ValidationError, orjson.JSONDecodeError):
        return _raw_attr(raw)


# --------------------------------------------------------------------------------------------
# the span walks


def _root_span(raw: _WireSpan, kind: SpanKind, span_id: str) -> Span:
    """The `Span` the general reader builds for a span without a parent (payloads decoded)."""
    attrs = raw.attributes
    status = raw.status
    span = Span(
        span_id, None, raw.name, raw.start_time_unix_nano,
        raw.end_time_unix_nano or None,  # MLflow reads an end time of 0 as "not ended"
        kind, STATUS.get(status.code, UNSET), status.message,
        None if attrs.inputs is None else _raw_attr(attrs.inputs),
        None if attrs.outputs is None else _raw_attr(attrs.outputs),
        None, None if raw.events == _NO_EVENTS else _events_exception(raw.events),
    )
    span.attributes = _root_attributes(attrs)
    if kind is TOOL:
        span.tool_name = tool_name(span.inputs)
        span.output_chars = _output_chars(attrs.outputs)
    return span


def _usage_attributes(span: Span, attrs: Any) -> None:
    """A model call's `mlflow.llm.model` and `mlflow.llm.cost`, as the general reader keeps them."""
    model, cost = attrs.model, attrs.cost
    if model is not None or cost is not None:
        if model is not None:
            span.attributes[LLM_MODEL] = _raw_attr(model)
        if cost is not None:
            span.attributes[LLM_COST] = _raw_attr(cost)


# `mlflow.llm.model` as written (a JSON string holding a JSON string) -> the model name: a stream
# names few models, so each is decoded once.
_MODEL_NAMES: dict[bytes, str | None] = {}
_NO_NAME: Any = object()


def _model_call(usage: TokenUsage, attrs: Any) -> ModelCall:
    """A counted model call as `derive_usage.model_calls` reads it from the general reader's span."""
    model_raw, cost_raw = attrs.model, attrs.cost
    model = None
    if model_raw is not None:
        key = bytes(model_raw)
        if key in _MODEL_NAMES:
            model = _MODEL_NAMES[key]
        else:
            model = span_model({LLM_MODEL: _raw_attr(model_raw)})
            if len(_MODEL_NAMES) < 1024:
                _MODEL_NAMES[key] = model
    return model, usage, None if cost_raw is None else span_cost({LLM_COST: _raw_attr(cost_raw)})


def _by_id(spans_raw: list[_WireSpan]) -> dict[bytes, _WireSpan]:
    """Span id -> the last span of that id, as `derive()`'s maps hold them."""
    return {raw.span_id: raw for raw in spans_raw}


def _reachable(raw: _WireSpan, by_id: dict[bytes, _WireSpan]) -> bool:
    """Whether `derive_usage.usage_spans`'s walk from the roots reaches `raw`: whether its chain of
    parents ends at a root (no parent, a parent no span has, itself as parent). False also when
    the chain loops, or runs past one span of a repeated id into a loop where another might not:
    the caller then walks the tree as `usage_spans` does."""
    for _ in range(len(by_id) + 1):
        parent = raw.parent_span_id
        if parent is None or parent == raw.span_id:
            return True
        above = by_id.get(parent)
        if above is None:
            return True
        raw = above
    return False


def _counted_calls(spans_raw: list[_WireSpan]) -> list[ModelCall]:
    """`model_calls(usage_spans(...))` of the spans as the general reader builds them, in the same
    order (`derive_usage.usage_walk`)."""
    walk = usage_walk(spans_raw, _wire_span_id, _wire_parent_id, _wire_span_usage)
    return [_model_call(usage, raw.attributes) for raw, usage in walk]


_wire_span_id, _wire_parent_id = attrgetter("span_id"), attrgetter("parent_span_id")


def _wire_span_usage(raw: _WireSpan) -> TokenUsage | None:
    usage = raw.attributes.usage
    return None if usage is None else _span_usage(usage)


def _lean_calls(with_usage: list[_WireSpan], root_id: bytes | None,
                spans_raw: list[_WireSpan]) -> list[ModelCall] | str | None:
    """The counted model calls (`derive_usage.usage_spans`) of a trace whose spans `with_usage` state
    usage. When every one of them names the same `mlflow.llm.model` and none states a cost, the
    trace's own usage is that model's (`derive_usage.one_model_calls`): returns the model's name (None
    when they name none) without decoding every call's usage, which is most of this reader's work
    on a trace with many model calls; that needs one counted call, the first span stating usage
    when the walk from the roots reaches it, as it does in every tree."""
    first = with_usage[0]
    attrs = first.attributes
    model_raw = attrs.model
    one_model = attrs.cost is None
    if one_model:
        for raw in with_usage:
            other = raw.attributes
            if other.model != model_raw or other.cost is not None:
                one_model = False
                break
    # Reached when its parent is the root (the first span without a parent), as in most traces.
    if (one_model and _span_usage(attrs.usage) is not None
            and (first.parent_span_id == root_id or _reachable(first, _by_id(spans_raw)))):
        if model_raw is None:
            return None
        name = _MODEL_NAMES.get(bytes(model_raw), _NO_NAME)
        return _model_call(TokenUsage(), attrs)[0] if name is _NO_NAME else name
    return _counted_calls(spans_raw)


def _nested_retriever(raw: _WireSpan, by_id: dict[bytes, _WireSpan]) -> bool:
    """Whether `top_level_retrievers` leaves this RETRIEVER span out: a RETRIEVER above it."""
    kinds, retriever = _LEAN_KINDS, RETRIEVER
    parent, hops, limit = raw.parent_span_id, 0, len(by_id)
    while parent is not None and hops <= limit:  # a malformed trace may loop: bounded as there
        above = by_id.get(parent)
        if above is None:
            return False
        kind_raw = above.attributes.span_type
        kind = kinds.get(kind_raw)
        if (kind if kind is not None else _kind_of(kind_raw)) is retriever:
            return True
        parent, hops = above.parent_span_id, hops + 1
    return False


# `mlflow.spanType` as written -> its kind; None (no type) is UNKNOWN, as the general reader reads it.
_LEAN_KINDS: dict[str | None, SpanKind] = {None: UNKNOWN, **RAW_KINDS}


def _lean_parts(spans_raw: list[_WireSpan]) -> tuple[Span | None, list[Document] | None, list[ToolCall],
                                                     list[ModelCall] | str | None, int | None]:
    """`derived_record`'s parts of a trace that states its usage: the root `Span`, the documents of
    the top-level retrievers and the tool calls, in start order, and the model calls whose usage
    counts (`derive_usage.usage_spans`), read as `derive()` reads them from the general reader's spans,
    whatever the span list's order, repeated ids or loops; every span is checked as the general
    reader checks it. Raises `_NotCanonical` for what the general reader must read."""
    # The stream's hottest loop: one pass finds the few spans derivation reads (the root, tools,
    # retrievers, spans stating usage); what each needs is read after it.
    kinds, tool, retriever, no_events = _LEAN_KINDS, TOOL, RETRIEVER, _NO_EVENTS
    root_raw: _WireSpan | None = None
    tools: list[_WireSpan] = []
    retrievers: list[_WireSpan] = []
    with_usage: list[_WireSpan] = []
    try:
        for raw in spans_raw:
            attrs = raw.attributes
            kind = kinds.get(attrs.span_type)
            if kind is None:
                kind = _kind_of(attrs.span_type)
            if kind is tool:
                tools.append(raw)
            elif kind is retriever:
                retrievers.append(raw)
            if attrs.usage is not None:
                with_usage.append(raw)
            if raw.parent_span_id is None and root_raw is None:  # the root: the first without a parent
                root_raw = raw
            elif raw.events != no_events:
                _events_exception(raw.events)  # checked as the general reader checks it
        root = None
        if root_raw is not None:
            kind_raw = root_raw.attributes.span_type
            kind = kinds.get(kind_raw)
            root = _root_span(root_raw, kind if kind is not None else _kind_of(kind_raw),
                              root_raw.span_id.hex())
        counted = (_lean_calls(with_usage, None if root_raw is None else root_raw.span_id, spans_raw)
                   if with_usage else [])
        if len(retrievers) > 1:
            by_id = _by_id(spans_raw)
            retrievers = [raw for raw in retrievers if not _nested_retriever(raw, by_id)]
            retrievers.sort(key=_span_start)  # stable, as `derive()`'s: a tie keeps the spans' order
        retrieved = None
        if retrievers:
            retrieved = []
            for raw in retrievers:
                if raw is root_raw:
                    retrieved.extend(documents_from_output(root.outputs))
                elif raw.attributes.outputs is not None:
                    retrieved.extend(_raw_documents(raw.attributes.outputs))
        trajectory = []
        tool_chars = None
        if tools:
            if len(tools) > 1:
                tools.sort(key=_span_start)
            error_codes = _ERROR_CODES
            # `max_output_chars`: the longest result on the wire is decoded, the others only when
            # one might measure more (n bytes hold at most n - 2 characters: `_max_output_chars`).
            longest = second = 0
            largest = None
            for raw in tools:
                attrs = raw.attributes
                outputs = attrs.outputs
                if outputs is not None:
                    size = len(outputs)
                    if size > longest:
                        second, longest, largest = longest, size, outputs
                    elif size > second:
                        second = size
                if raw is root_raw:
                    failed = tool_error(root.exception, root.status is SpanStatus.ERROR, root.status_message,
                                        root.name)
                    trajectory.append(ToolCall(root.tool_name or root.name, root.inputs or None, failed))
                    continue
                inputs = attrs.inputs
                if inputs is not None:
                    inputs = _tool_inputs(inputs)
                name = tool_name(inputs) if type(inputs) is dict and "call" in inputs else None
                # Nearly every call succeeded: no exception event, a status other than ERROR.
                failed = (None if raw.events == no_events and raw.status.code not in error_codes
                          else _wire_tool_error(raw))
                trajectory.append(ToolCall(name or raw.name, inputs or None, failed))
            if largest is not None:
                tool_chars = _output_chars(largest)
                if second - 2 > (tool_chars or 0):  # another might measure more
                    tool_chars = _max_output_chars(tools, largest, tool_chars)
    except (Malformed, KeyError, TypeError, ValueError, RecursionError):
        raise _NotCanonical from None
    return root, retrieved, trajectory, counted, tool_chars


# The status codes the general reader reads as ERROR (`STATUS`): a tuple, as a decoded code is a new
# string that a set would hash first.
_ERROR_CODES = tuple(code for code, status in STATUS.items() if status is SpanStatus.ERROR)


def _wire_tool_error(raw: _WireSpan) -> str | None:
    """`derive.tool_error` of a raw tool span: its exception event, else its ERROR status."""
    failed = raw.status.code in _ERROR_CODES
    if raw.events == _NO_EVENTS and not failed:
        return None
    exception = None if raw.events == _NO_EVENTS else _events_exception(raw.events)
    return tool_error(exception, failed, raw.status.message, raw.name)


def _max_output_chars(tools: list[_WireSpan], measured: msgspec.Raw | None = None,
                      most: int | None = None) -> int | None:
    """`derive.max_output_chars` of the tool spans: the largest `_output_chars` of their raw
    `mlflow.spanOutputs`, or `most` (that of `measured`, one of them) when larger. A JSON string of
    n bytes holds at most n - 2 characters (its quotes, then at least a byte per character): a result
    of n bytes is not decoded when n - 2 is no more than the largest measured yet."""
    for raw in tools:
        outputs = raw.attributes.outputs
        if outputs is not None and outputs is not measured and len(outputs) - 2 > (most or 0):
            size = _output_chars(outputs)
            if size is not None and (most is None or size > most):
                most = size
    return most


def _output_chars(outputs: msgspec.Raw | None) -> int | None:
    """The length in characters of a tool span's `mlflow.spanOutputs` JSON text, the attribute's
    string value (`Span.output_chars`); None for an empty or non-string value (one set on the span
    directly). (Decoding costs less than counting the characters in the bytes.)"""
    if outputs is None:
        return None
    try:
        return len(_STRING_DECODER.decode(outputs)) or None
    except msgspec.DecodeError:  # not a string
        return None


def _spans(spans_raw: list[_WireSpan]) -> list[Span]:
    """Every span, as the general reader with `everything=False` builds it but for what
    `parse_canonical_json` documents."""
    # The struct types already hold the checks the general reader makes with `type()`; what they
    # cannot state is checked here.
    raw_kinds, status_of, unset, unknown, tool, retriever = (
        RAW_KINDS, STATUS, UNSET, UNKNOWN, TOOL, RETRIEVER)
    span_of, no_events = Span, _NO_EVENTS
    ids: dict[bytes, str] = {}  # every parent id is some span's id
    spans: list[Span] = []
    append = spans.append
    try:
        for raw in spans_raw:
            sid = raw.span_id
            span_id = ids[sid] = sid.hex()
            attrs = raw.attributes
            kind_raw = attrs.span_type
            kind = unknown if kind_raw is None else raw_kinds.get(kind_raw)
            if kind is None:
                kind = _kind_of(kind_raw)
            parent = raw.parent_span_id
            if parent is None:
                span = _root_span(raw, kind, span_id)
                append(span)
            else:
                parent_id = ids.get(parent)
                if parent_id is None:  # a child listed before its parent
                    parent_id = ids[parent] = parent.hex()
                events = raw.events
                status = raw.status
                span = span_of(
                    span_id, parent_id, raw.name, raw.start_time_unix_nano,
                    raw.end_time_unix_nano or None,  # MLflow reads an end time of 0 as "not ended"
                    kind, status_of.get(status.code, unset), status.message, None, None, None,
                    None if events == no_events else _events_exception(events),
                )
                append(span)
                # As the general reader: tools' inputs and retrievers' outputs (the root's are
                # decoded whole by `_root_span`).
                if kind is tool:
                    span.output_chars = _output_chars(attrs.outputs)
                    if attrs.inputs is not None:
                        inputs = span.inputs = _tool_inputs(attrs.inputs)
                        if type(inputs) is dict and "call" in inputs:
                            span.tool_name = tool_name(inputs)
                elif kind is retriever and attrs.outputs is not None:
                    span.documents = _raw_documents(attrs.outputs)
            if attrs.usage is not None:
                span.token_usage = _span_usage(attrs.usage)
                if span.token_usage is not None:
                    _usage_attributes(span, attrs)
    except (Malformed, KeyError, TypeError, ValueError, RecursionError):
        raise _NotCanonical from None
    return spans


# --------------------------------------------------------------------------------------------
# the trace


def _trace(info: _WireInfo, spans: list[Span], app_tag: str | None, usage: Any,
           session_tag: str | None = None, version_tag: str | None = None) -> Trace:
    assessments = None
    if info.assessments is not None:
        assessments = orjson.loads(memoryview(info.assessments))
        if assessments is not None and type(assessments) is not list:
            raise Malformed
    location = info.trace_location
    experiment = None
    if location is not None and location.mlflow_experiment is not None:
        experiment = location.mlflow_experiment.experiment_id
    return build_trace(
        info.trace_id, spans, "mlflow_v3", app_tag, usage,
        metadata={} if info.trace_metadata is None else info.trace_metadata,
        tags={} if info.tags is None else info.tags,
        experiment=experiment, client_request_id=info.client_request_id, state=info.state,
        assessments=assessments, request_time=info.request_time,
        duration_value=info.execution_duration_ms, duration_wire=info.execution_duration,
        session_tag=session_tag, version_tag=version_tag,
    )


def _decode(payload: bytes | str) -> _WireTrace | None:
    try:
        if not payload.isascii():
            # msgspec does not check the UTF-8 of the values it skips; the general path rejects it.
            if type(payload) is not bytes:
                return None
            payload.decode()
        return _WIRE_DECODER.decode(payload)
    except _NOT_READ:
        return None


def derive_canonical_json(payload: bytes | str, *, app_tag: str | None = None, session_tag: str | None = None,
                          version_tag: str | None = None) -> EvalRecord | None:
    """`derive()` of the `Trace` of an MLflow 3 trace's JSON in exactly the shape `Trace.to_json()`
    writes, or None for anything else: then decode the payload and call the general reader,
    which reads every form and names what is wrong. An exception raised past reading (a bug in
    derivation) is raised, as `derive()` raises it."""
    wire = _decode(payload)
    if wire is None:
        return None
    try:
        info = wire.info
        # Trace-level usage, when stated, is what derivation reports: span usage goes unread.
        usage = _trace_usage(info.trace_metadata)
        parts = None if usage is None else _lean_parts(wire.data.spans)
        spans = [] if parts is not None else _spans(wire.data.spans)
        trace = _trace(info, spans, app_tag, usage, session_tag, version_tag)
    except _NOT_READ:
        return None
    if parts is None:
        return derive(trace)
    root, retrieved, trajectory, counted, tool_chars = parts
    tokens = usage.with_total()
    if not isinstance(counted, list):  # one model for every call: the trace's usage is its usage
        counted = [(counted, tokens, None)]
    elif counted:  # the spans stating usage differ, the calls counted may not
        counted = one_model_calls(counted, tokens)
    # No root (rare): the spans' parents may loop, which the record names as `derive()` does.
    cycle = root is None and has_parent_cycle(wire.data.spans, _wire_span_id, _wire_parent_id)
    return derived_record(trace, root, retrieved, trajectory, tokens, calls=counted or None, cycle=cycle,
                          tool_chars=tool_chars)


def parse_canonical_json(payload: bytes | str, *, app_tag: str | None = None,
                         session_tag: str | None = None, version_tag: str | None = None) -> Trace | None:
    """The `Trace` of an MLflow 3 trace's JSON in exactly the shape `Trace.to_json()` writes, or
    None for anything else (another shape, another format, bad input) — then decode the payload
    and call `parse_trace`, which reads every form and names what is wrong.

    It equals `parse_trace(orjson.loads(payload), everything=False)` but in what derivation does
    not read: a non-root retriever's documents are in `Span.documents` and its `Span.outputs` is
    left None, and the root's `attributes` hold only its HTTP status (and the `mlflow.llm.model` and
    `mlflow.llm.cost` of a root that is a model call, as every span's).
    """
    wire = _decode(payload)
    if wire is None:
        return None
    try:
        usage = _trace_usage(wire.info.trace_metadata)
        return _trace(wire.info, _spans(wire.data.spans), app_tag, usage, session_tag, version_tag)
    except _NOT_READ:
        return None


def parse_trace_json(text: str, *, app_tag: str | None = None, field: str = "",
                     session_tag: str | None = None, version_tag: str | None = None) -> Trace:
    """An MLflow trace embedded as JSON text in another record (an agent-evaluation row's `trace`,
    a serving response's `databricks_output.trace`), read for derivation: by `parse_canonical_json`
    when it is in `Trace.to_json()`'s exact shape, else decoded by orjson and read by `parse_trace`
    with `everything=False`. Raises `RecordError`: invalid_json at `field`, or the field that is wrong.

    One difference from decoding with orjson first: a number beyond the float range under a key
    derivation never reads is skipped by msgspec unread, so such a trace is read (as it is when it
    is the whole payload) rather than rejected as invalid JSON.
    """
    trace = parse_canonical_json(text, app_tag=app_tag, session_tag=session_tag, version_tag=version_tag)
    if trace is not None:
        return trace
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise RecordError(errors.INVALID_JSON, errors.not_json(exc), field or None) from None
    return parse_trace(obj, app_tag=app_tag, field=field, everything=False, session_tag=session_tag,
                       version_tag=version_tag)
