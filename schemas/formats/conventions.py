"""Span attribute conventions -> the format-neutral `Span`.

OTLP spans say what they did through attributes, in one of several dialects that coexist in the wild
(often on the same span: an OpenLLMetry span carries `traceloop.*` and `gen_ai.*` keys):

- MLflow's own OTLP export: `mlflow.spanType`, JSON-encoded `mlflow.spanInputs`/`mlflow.spanOutputs`,
  `mlflow.chat.tokenUsage`.
- OpenInference (Arize): `openinference.span.kind`, `input.value`/`output.value`, `llm.token_count.*`,
  flattened `llm.input_messages.N.message.*`, `retrieval.documents.N.document.*`, `tool.name`.
- OpenTelemetry GenAI: `gen_ai.operation.name`, `gen_ai.usage.*_tokens`, `gen_ai.input.messages` /
  `gen_ai.output.messages` (a JSON string or a structured value), `gen_ai.tool.*`, `error.type`.
- Traceloop / OpenLLMetry: `traceloop.span.kind`, `traceloop.entity.input/output`, flattened
  `gen_ai.prompt.N.*`/`gen_ai.completion.N.*`, `gen_ai.usage.prompt_tokens`, `llm.usage.total_tokens`.

A span is read only when one of the marker attributes names its convention (`MARKERS`); any other span
(HTTP, DB, …) keeps its timing and failure and nothing else, because guessing a request out of an
arbitrary attribute would put wrong text in front of the judges.

Chat messages from every dialect are rewritten into the OpenAI chat shapes MLflow records
(`{"messages": [...]}` in, `{"choices": [{"message": ...}]}` out), so `tracejudge.schemas.formats.derive`
extracts request and response from an OTLP chat span by the same rules as from an MLflow span.

Neighbours: how attribute values are written (JSON text, indexed keys) is `attribute_values`; the
session and user a trace states, `session_identity`; the model and cost a span states, `model_cost`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from tracejudge.schemas.formats.attribute_values import (
    indexed_items,
    json_arguments,
    json_items,
    loose_json,
    strict_json,
)
from tracejudge.schemas.trace import Document, Span, SpanKind, SpanStatus, TokenUsage

# Any one of these present means the span follows a convention we read.
MARKERS: Final = ("mlflow.spanType", "openinference.span.kind", "gen_ai.operation.name",
                  "traceloop.span.kind", "llm.request.type", "gen_ai.provider.name", "gen_ai.system")

_MLFLOW_KINDS: Final = {
    **{k.value: k for k in SpanKind},
    # MLflow types the neutral SpanKind does not name: structure-only spans read as CHAIN.
    "WORKFLOW": SpanKind.CHAIN, "TASK": SpanKind.CHAIN,
}
_OPENINFERENCE_KINDS: Final = {
    "LLM": SpanKind.LLM, "EMBEDDING": SpanKind.EMBEDDING, "CHAIN": SpanKind.CHAIN,
    "RETRIEVER": SpanKind.RETRIEVER, "RERANKER": SpanKind.RERANKER, "TOOL": SpanKind.TOOL,
    "AGENT": SpanKind.AGENT, "PROMPT": SpanKind.CHAIN,
}
_GENAI_OPERATIONS: Final = {
    "chat": SpanKind.CHAT_MODEL, "text_completion": SpanKind.LLM, "generate_content": SpanKind.LLM,
    "embeddings": SpanKind.EMBEDDING, "retrieval": SpanKind.RETRIEVER, "execute_tool": SpanKind.TOOL,
    "invoke_agent": SpanKind.AGENT, "create_agent": SpanKind.AGENT, "invoke_workflow": SpanKind.CHAIN,
    # OpenLLMetry >= 0.5x names its LangChain spans' operations so.
    "vector_db_retrieve": SpanKind.RETRIEVER, "execute_task": SpanKind.CHAIN,
}
_TRACELOOP_KINDS: Final = {
    "workflow": SpanKind.CHAIN, "task": SpanKind.CHAIN, "agent": SpanKind.AGENT, "tool": SpanKind.TOOL,
}
_TRACELOOP_REQUEST_TYPES: Final = {
    "chat": SpanKind.CHAT_MODEL, "completion": SpanKind.LLM, "embedding": SpanKind.EMBEDDING,
    "rerank": SpanKind.RERANKER,
}

# Token keys by priority; the first present one wins, so a span carrying two dialects counts once.
_INPUT_TOKENS: Final = ("gen_ai.usage.input_tokens", "llm.token_count.prompt", "gen_ai.usage.prompt_tokens",
                        "llm.usage.prompt_tokens")
_OUTPUT_TOKENS: Final = ("gen_ai.usage.output_tokens", "llm.token_count.completion",
                         "gen_ai.usage.completion_tokens", "llm.usage.completion_tokens")
_TOTAL_TOKENS: Final = ("llm.token_count.total", "gen_ai.usage.total_tokens", "llm.usage.total_tokens")
# Input tokens read from the prompt cache (part of the input tokens): the GenAI conventions' name, its
# name before the rename, OpenInference's.
_CACHED_TOKENS: Final = ("gen_ai.usage.cache_read.input_tokens", "gen_ai.usage.cache_read_input_tokens",
                         "llm.token_count.prompt_details.cache_read")

# Payload attributes moved into Span.inputs/outputs/documents; dropping them from Span.attributes keeps
# an open trace's memory at one copy of its payloads.
_PAYLOAD_KEYS: Final = frozenset({
    "mlflow.spanInputs", "mlflow.spanOutputs", "input.value", "output.value", "gen_ai.input.messages",
    "gen_ai.output.messages", "gen_ai.system_instructions", "traceloop.entity.input",
    "traceloop.entity.output", "gen_ai.tool.call.arguments", "gen_ai.tool.call.result",
    "gen_ai.retrieval.documents", "pydantic_ai.all_messages", "final_result", "tool_arguments",
    "tool_response",
})
_PAYLOAD_PREFIXES: Final = ("llm.input_messages.", "llm.output_messages.", "gen_ai.prompt.",
                            "gen_ai.completion.", "retrieval.documents.")

STATUS_UNSET: Final = 0
STATUS_OK: Final = 1
STATUS_ERROR: Final = 2
_STATUS: Final = {STATUS_UNSET: SpanStatus.UNSET, STATUS_OK: SpanStatus.OK, STATUS_ERROR: SpanStatus.ERROR}


def span_from_otel(
    *,
    span_id: str,
    parent_id: str | None,
    name: str,
    start_ns: int,
    end_ns: int | None,
    status_code: int,
    status_message: str,
    attributes: dict[str, Any],
    events: Sequence[tuple[str, Mapping[str, Any]]] = (),
) -> Span:
    """Build a `Span` from one decoded OTel span (ids already hex, attribute values already Python).

    `attributes` is taken over (payload keys are removed from it); `events` are `(name, attributes)`.
    """
    status = _STATUS.get(status_code, SpanStatus.UNSET)
    error_type = attributes.get("error.type")
    if status is SpanStatus.UNSET and isinstance(error_type, str) and error_type:
        # GenAI: error.type is "conditionally required if the operation ended in an error".
        status = SpanStatus.ERROR
    if status is SpanStatus.ERROR and not status_message and isinstance(error_type, str):
        status_message = error_type
    span = Span(span_id=span_id, parent_id=parent_id, name=name, start_ns=start_ns, end_ns=end_ns,
                status=status, status_message=status_message, exception=_exception(events))
    if any(k in attributes for k in MARKERS):
        flat = {k: v for k, v in attributes.items() if k.startswith(_PAYLOAD_PREFIXES)}
        _read_convention(span, attributes, flat, events)
        span.attributes = {k: v for k, v in attributes.items() if k not in _PAYLOAD_KEYS and k not in flat}
    else:
        span.attributes = attributes
        if events and any(n == "db.query.result" for n, _ in events):
            # OpenLLMetry's vector-DB instrumentations (Chroma, Qdrant, LanceDB, ...) mark a query
            # span with `db.system` only and report its hits as events: it retrieved documents.
            span.kind = SpanKind.RETRIEVER
            span.documents = _documents(attributes, {}, events)
    return span


def _read_convention(span: Span, attrs: dict[str, Any], flat: dict[str, Any],
                     events: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """`flat` holds the flattened-list attributes (`llm.input_messages.N.*`, …), usually none."""
    mlflow = "mlflow.spanType" in attrs
    kind = _kind(attrs)
    span.kind = kind
    if mlflow:
        span.inputs = strict_json(attrs.get("mlflow.spanInputs"))
        span.outputs = strict_json(attrs.get("mlflow.spanOutputs"))
    else:
        span.inputs = _inputs(attrs, flat, kind)
        span.outputs = _outputs(attrs, flat, kind)
        if events and (span.inputs is None or span.outputs is None):
            read_content_events(span, events)
    span.token_usage = _token_usage(attrs)
    if kind is SpanKind.RETRIEVER or kind is SpanKind.RERANKER:
        span.documents = _documents(attrs, flat, events)
    if kind is SpanKind.TOOL:
        tool = attrs.get("gen_ai.tool.name") or attrs.get("tool.name")
        if tool is None and "traceloop.span.kind" in attrs:
            tool = attrs.get("traceloop.entity.name")
        name = str(tool) if tool is not None else span.name
        # OpenInference's DSPy instrumentation names a tool span after the call: `weather.__call__`.
        span.tool_name = name.removesuffix(".__call__") or name
        span.output_chars = _output_chars(attrs)


# A tool's result as text, by preference: what `signal_tool_result_oversized` measures.
_TOOL_RESULT_KEYS: Final = ("mlflow.spanOutputs", "gen_ai.tool.call.result", "tool_response", "output.value",
                            "traceloop.entity.output")


def _output_chars(attrs: Mapping[str, Any]) -> int | None:
    """The length of a tool span's result text (`Span.output_chars`); None when it states none."""
    for key in _TOOL_RESULT_KEYS:
        value = attrs.get(key)
        if type(value) is str and value:
            return len(value)
    return None


def _kind(attrs: Mapping[str, Any]) -> SpanKind:
    value = attrs.get("mlflow.spanType")
    if value is not None:
        return _MLFLOW_KINDS.get(str(strict_json(value)).upper(), SpanKind.UNKNOWN)
    value = attrs.get("openinference.span.kind")
    if value is not None:
        return _OPENINFERENCE_KINDS.get(str(value).upper(), SpanKind.UNKNOWN)
    value = attrs.get("gen_ai.operation.name")
    if value is not None:
        kind = _GENAI_OPERATIONS.get(str(value))
        # An operation this table does not name: a Traceloop kind on the same span may tell.
        if kind is not None or "traceloop.span.kind" not in attrs:
            return kind or SpanKind.UNKNOWN
    value = attrs.get("traceloop.span.kind")
    if value is not None:
        return _TRACELOOP_KINDS.get(str(value), SpanKind.UNKNOWN)
    value = attrs.get("llm.request.type")
    if value is not None:
        return _TRACELOOP_REQUEST_TYPES.get(str(value), SpanKind.LLM)
    # GenAI <= v1.26 had no operation name: gen_ai.system was set on inference spans only.
    return SpanKind.LLM


# --- inputs / outputs ------------------------------------------------------------------------------


def _inputs(attrs: dict[str, Any], flat: dict[str, Any], kind: SpanKind) -> Any:
    if kind is SpanKind.TOOL:
        if "gen_ai.tool.call.arguments" in attrs:
            # "SHOULD do the best effort to deserialize it to an object" (GenAI spec). OpenLLMetry's
            # LangChain tools write the callback's wrapper there too: unwrapped.
            return _unwrap_call(strict_json(attrs["gen_ai.tool.call.arguments"]))
        if "tool_arguments" in attrs:  # Pydantic AI's instrumentation before its version 3
            return strict_json(attrs["tool_arguments"])
        if "input.value" in attrs:
            return _unwrap_call(_openinference_value(attrs, "input"))
        if "traceloop.entity.input" in attrs:
            return _unwrap_call(strict_json(attrs["traceloop.entity.input"]))
        # OpenInference's tool.parameters is the call's arguments in some instrumentations and the
        # tool's schema in others; it is read only when nothing states the actual call.
        return loose_json(attrs["tool.parameters"]) if "tool.parameters" in attrs else None
    messages = _chat_request(attrs, flat)
    if messages is not None and (_has_content(messages) or "input.value" not in attrs):
        return {"messages": messages}
    if "input.value" in attrs:
        return _openinference_value(attrs, "input")
    if "traceloop.entity.input" in attrs:
        return _unwrap_call(strict_json(attrs["traceloop.entity.input"]))
    if "pydantic_ai.all_messages" in attrs:
        # Pydantic AI's agent run: the run's whole message history, GenAI-shaped.
        return {"messages": [_genai_message(m) for m in json_items(attrs["pydantic_ai.all_messages"])]}
    if "gen_ai.retrieval.query.text" in attrs:
        return attrs["gen_ai.retrieval.query.text"]
    return None


def _outputs(attrs: dict[str, Any], flat: dict[str, Any], kind: SpanKind) -> Any:
    if kind is SpanKind.TOOL and "gen_ai.tool.call.result" in attrs:
        return strict_json(attrs["gen_ai.tool.call.result"])
    if kind is SpanKind.TOOL and "tool_response" in attrs:
        return loose_json(attrs["tool_response"])
    if "final_result" in attrs:  # Pydantic AI's agent run: the run's output
        return loose_json(attrs["final_result"])
    choices = _chat_response(attrs, flat)
    if choices is not None and (_has_content([c["message"] for c in choices]) or "output.value" not in attrs):
        return {"choices": choices}
    if "output.value" in attrs:
        return _openinference_value(attrs, "output")
    if "traceloop.entity.output" in attrs:
        return _unwrap_call(strict_json(attrs["traceloop.entity.output"]))
    return None


def _has_content(messages: list[dict[str, Any]]) -> bool:
    """Some message states text or tool calls: OpenInference's LangChain instrumentation flattens
    `llm.input_messages.N.message.role` onto chain spans without the content, which is then only
    in `input.value`."""
    return any(m.get("content") is not None or m.get("tool_calls") for m in messages)


# Span events that carry a model call's messages, for frameworks that write content there (Strands
# Agents, the GenAI conventions' deprecated per-message events, their `gen_ai.content.*` events
# before those, and the latest experimental `gen_ai.client.inference.operation.details`).
_MESSAGE_EVENT_ROLES: Final = {
    "gen_ai.system.message": "system", "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool",
}
_CHOICE_EVENT: Final = "gen_ai.choice"
_DETAILS_EVENT: Final = "gen_ai.client.inference.operation.details"
_PROMPT_EVENT: Final = "gen_ai.content.prompt"
_COMPLETION_EVENT: Final = "gen_ai.content.completion"
CONTENT_EVENTS: Final = frozenset({*_MESSAGE_EVENT_ROLES, _CHOICE_EVENT, _DETAILS_EVENT, _PROMPT_EVENT,
                                   _COMPLETION_EVENT})


def read_content_events(span: Span, events: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """Fill a span's missing inputs/outputs from the content events on it, in the chat shapes:
    span events, and log records placed on the span by trace assembly (`schemas/formats/otlp_logs.py`)."""
    if span.kind is SpanKind.TOOL:
        # Strands Agents' tool span: the call's arguments as a tool message, its result as a choice.
        for name, attrs in events:
            if name == "gen_ai.tool.message" and span.inputs is None:
                span.inputs = loose_json(attrs.get("content"))
            elif name == _CHOICE_EVENT and span.outputs is None:
                span.outputs = _content_text(attrs.get("message"))
        return
    messages: list[dict[str, Any]] = []
    choices: list[dict[str, Any]] = []
    for name, attrs in events:
        role = _MESSAGE_EVENT_ROLES.get(name)
        if role is not None:
            messages.append(_event_message(attrs, role))
        elif name == _CHOICE_EVENT:
            message = loose_json(attrs.get("message"))
            out = (_event_message(message, "assistant") if isinstance(message, Mapping)
                   else {"role": "assistant", "content": _content_text(message)})
            choice: dict[str, Any] = {"index": _int(attrs.get("index")) or len(choices), "message": out}
            if attrs.get("finish_reason") is not None:
                choice["finish_reason"] = attrs["finish_reason"]
            choices.append(choice)
        elif name == _DETAILS_EVENT:
            found = _chat_request(dict(attrs), {})
            if found:
                messages.extend(found)
            found = _chat_response(dict(attrs), {})
            if found:
                choices.extend(found)
        elif name == _PROMPT_EVENT and "gen_ai.prompt" in attrs:
            prompt = loose_json(attrs["gen_ai.prompt"])
            for m in prompt if isinstance(prompt, list) else [prompt]:
                messages.append(_event_message(m, "user"))
        elif name == _COMPLETION_EVENT and "gen_ai.completion" in attrs:
            completion = loose_json(attrs["gen_ai.completion"])
            for m in completion if isinstance(completion, list) else [completion]:
                choices.append({"index": len(choices), "message": _event_message(m, "assistant")})
    if span.inputs is None and messages:
        span.inputs = {"messages": messages}
    if span.outputs is None and choices:
        span.outputs = {"choices": choices}


def _event_message(attrs: Any, role: str) -> dict[str, Any]:
    """One message from an event's attributes (or a message object): `content` as text or content
    blocks (`[{"text": ...}]`, GenAI parts), `role` when stated, tool calls when stated."""
    if not isinstance(attrs, Mapping):
        return {"role": role, "content": _content_text(attrs)}
    out: dict[str, Any] = {"role": attrs.get("role") or role, "content": _content_text(attrs.get("content"))}
    if out["content"] is None and "parts" in attrs:
        parts = loose_json(attrs["parts"])
        out["content"] = _parts_text(parts if isinstance(parts, list) else [parts])
    calls = loose_json(attrs.get("tool_calls"))
    if isinstance(calls, list) and calls:
        out["tool_calls"] = calls
    if attrs.get("id") is not None and role == "tool":
        out["tool_call_id"] = attrs["id"]
    return out


def _content_text(value: Any) -> str | None:
    """Text of a content value: a string (JSON-decoded when it is a JSON array or object), or a
    list of content blocks, `{"text": ...}` (Strands, Bedrock) or `{"type": "text", ...}` parts."""
    value = loose_json(value)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, list):
        texts = []
        for block in value:
            if isinstance(block, str):
                texts.append(block)
            elif isinstance(block, Mapping):
                text = block.get("text", block.get("content") if block.get("type") == "text" else None)
                if isinstance(text, str):
                    texts.append(text)
        return "\n".join(texts) if texts else None
    return str(value)


def _openinference_value(attrs: Mapping[str, Any], which: str) -> Any:
    """`input.value`/`output.value`: JSON when `*.mime_type` says so; text when it says text/plain;
    without a mime type, decoded only when it is a JSON object or array."""
    value = attrs[f"{which}.value"]
    mime = attrs.get(f"{which}.mime_type")
    if mime == "application/json":
        return strict_json(value)
    if mime == "text/plain":
        return value
    return loose_json(value)


def _chat_request(attrs: dict[str, Any], flat: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Input chat messages from whichever dialect states them, as OpenAI-style messages."""
    if "gen_ai.input.messages" in attrs:
        messages = [_genai_message(m) for m in json_items(attrs["gen_ai.input.messages"])]
        system = attrs.get("gen_ai.system_instructions")
        if system is not None:
            parts = loose_json(system)
            content = _parts_text(parts if isinstance(parts, list) else [parts])
            messages.insert(0, {"role": "system", "content": content})
        return messages
    items = indexed_items(flat, "llm.input_messages.")
    if items:
        return [_openinference_message(m) for m in items]
    items = indexed_items(flat, "gen_ai.prompt.")
    if items:
        return [_traceloop_message(m) for m in items]
    return None


def _chat_response(attrs: dict[str, Any], flat: dict[str, Any]) -> list[dict[str, Any]] | None:
    if "gen_ai.output.messages" in attrs:
        out = []
        for i, m in enumerate(json_items(attrs["gen_ai.output.messages"])):
            choice: dict[str, Any] = {"index": i, "message": _genai_message(m)}
            if isinstance(m, Mapping) and m.get("finish_reason") is not None:
                choice["finish_reason"] = m["finish_reason"]
            out.append(choice)
        return out
    items = indexed_items(flat, "llm.output_messages.")
    if items:
        return [{"index": i, "message": _openinference_message(m)} for i, m in enumerate(items)]
    items = indexed_items(flat, "gen_ai.completion.")
    if items:
        out = []
        for i, m in enumerate(items):
            choice = {"index": i, "message": _traceloop_message(m)}
            if m.get("finish_reason") is not None:
                choice["finish_reason"] = m["finish_reason"]
            out.append(choice)
        return out
    return None


def _genai_message(message: Any) -> dict[str, Any]:
    """GenAI `{role, parts[]}` -> `{role, content, tool_calls?}`; `tool_call_response` -> a tool message."""
    if not isinstance(message, Mapping):
        return {"role": None, "content": None if message is None else str(message)}
    parts = message.get("parts")
    parts = parts if isinstance(parts, list) else []
    out: dict[str, Any] = {"role": message.get("role"), "content": _parts_text(parts)}
    calls = [{"id": p.get("id"), "type": "function",
              "function": {"name": p.get("name"), "arguments": json_arguments(p.get("arguments"))}}
             for p in parts if isinstance(p, Mapping) and p.get("type") == "tool_call"]
    if calls:
        out["tool_calls"] = calls
    responses = [p for p in parts if isinstance(p, Mapping) and p.get("type") == "tool_call_response"]
    if responses and len(responses) == len(parts):
        # Tool results sent back as a "user" message (Pydantic AI before its data version 6) are
        # not the user's words.
        out["role"] = "tool"
    for p in responses:
        out["tool_call_id"] = p.get("id")
        if out["content"] is None:
            # The schema names it `response`; the registry's own example says `result`.
            out["content"] = json_arguments(p.get("response", p.get("result")))
    if message.get("name") is not None:
        out["name"] = message["name"]
    return out


def _parts_text(parts: Iterable[Any]) -> str | None:
    texts = []
    for p in parts:
        if isinstance(p, str):
            texts.append(p)
        elif isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("content"), str):
            texts.append(p["content"])
    return "\n".join(texts) if texts else None


def _openinference_message(flat: dict[str, Any]) -> dict[str, Any]:
    content = flat.get("message.content")
    if content is None:
        parts = indexed_items(flat, "message.contents.")
        texts = [p["message_content.text"] for p in parts if isinstance(p.get("message_content.text"), str)]
        content = "\n".join(texts) if texts else None
    out: dict[str, Any] = {"role": flat.get("message.role"), "content": content}
    calls = indexed_items(flat, "message.tool_calls.")
    if calls:
        out["tool_calls"] = [{"id": c.get("tool_call.id"), "type": "function",
                              "function": {"name": c.get("tool_call.function.name"),
                                           "arguments": c.get("tool_call.function.arguments")}}
                             for c in calls]
    if flat.get("message.tool_call_id") is not None:
        out["tool_call_id"] = flat["message.tool_call_id"]
    if flat.get("message.name") is not None:
        out["name"] = flat["message.name"]
    return out


def _traceloop_message(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": flat.get("role"), "content": flat.get("content")}
    calls = indexed_items(flat, "tool_calls.")
    if calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c.get("name"), "arguments": c.get("arguments")}}
                             for c in calls]
    if flat.get("tool_call_id") is not None:
        out["tool_call_id"] = flat["tool_call_id"]
    return out


# Traceloop's LangChain instrumentation wraps a run's inputs and outputs with the callback's extras.
_TRACELOOP_INPUT_EXTRAS: Final = frozenset({"tags", "metadata", "kwargs", "input_str"})


def _unwrap_call(value: Any) -> Any:
    """Traceloop records a call as `{"args": [...], "kwargs": {...}}`; MLflow records the named
    arguments. Unwrap the unambiguous cases so both compare equal in trajectories. Its LangChain
    instrumentation writes `{"inputs": ..., "tags": ..., "metadata": ..., "kwargs": ...}` and
    `{"outputs": ..., "kwargs": ...}`: the run's own inputs and outputs are unwrapped."""
    if isinstance(value, dict) and len(value) > 1:
        for key in ("inputs", "outputs"):
            if key in value and set(value) - {key} <= _TRACELOOP_INPUT_EXTRAS:
                return value[key]
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get("kwargs"), dict):
        # OpenInference's LlamaIndex and DSPy tools: the call's keyword arguments.
        return value["kwargs"]
    if isinstance(value, dict) and set(value) == {"args", "kwargs"}:
        args, kwargs = value["args"], value["kwargs"]
        if not args and isinstance(kwargs, dict):
            return kwargs
        if not kwargs and isinstance(args, list) and len(args) == 1:
            return args[0]
    return value


# --- documents, tokens, exceptions -------------------------------------------------------------------


def _documents(attrs: dict[str, Any], flat: dict[str, Any],
               events: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Document] | None:
    items = indexed_items(flat, "retrieval.documents.")
    if items:
        return [_document(d.get("document.content"), d.get("document.metadata")) for d in items]
    if "gen_ai.retrieval.documents" in attrs:
        docs = []
        for d in json_items(attrs["gen_ai.retrieval.documents"]):
            if isinstance(d, Mapping):
                content = next((d[k] for k in ("content", "text", "page_content") if k in d), None)
                docs.append(_document(content, d.get("metadata")))
        return docs
    # Traceloop's LangChain retriever: `{"documents": [<LangChain Document>, ...]}` as its output.
    if "traceloop.entity.output" in attrs:
        output = _unwrap_call(strict_json(attrs["traceloop.entity.output"]))
        if isinstance(output, Mapping):
            output = output.get("documents")
        if isinstance(output, list) and all(isinstance(d, Mapping) for d in output):
            return [_document(d.get("page_content", d.get("content")), d.get("metadata")) for d in output]
    # Traceloop's vector-DB instrumentations: one `db.query.result` event per hit.
    hits = [e for n, e in events if n == "db.query.result"]
    if hits:
        return [_document(e.get("db.query.result.document"), e.get("db.query.result.metadata"))
                for e in hits]
    # None (not []): MLflow-style retrievers state their documents in the outputs, read by derive.
    return None


# Where a document's metadata states where it came from, by preference: MLflow's own key, the usual
# URI keys, LangChain loaders' `source`, LlamaIndex's `file_path` for documents read from files.
DOC_URI_KEYS: Final = ("doc_uri", "uri", "url", "source", "file_path")


def _document(content: Any, metadata: Any) -> Document:
    """A retrieved document; its `doc_uri` comes from its metadata only. A document's id names the
    chunk in its store (a UUID, a row number), not where the text came from, so it is never
    taken as a URI."""
    meta = loose_json(metadata)
    uri = None
    if isinstance(meta, Mapping):
        uri = next((meta[k] for k in DOC_URI_KEYS if meta.get(k) not in (None, "")), None)
    return Document(content=None if content is None else str(content),
                    doc_uri=None if uri is None else str(uri))


def _token_usage(attrs: Mapping[str, Any]) -> TokenUsage | None:
    mlflow = attrs.get("mlflow.chat.tokenUsage")
    if mlflow is not None:
        usage = strict_json(mlflow)
        if isinstance(usage, Mapping):
            return TokenUsage(_int(usage.get("input_tokens")), _int(usage.get("output_tokens")),
                              _int(usage.get("total_tokens")),
                              _int(usage.get("cache_read_input_tokens"))).with_total()
    found = [_first_int(attrs, _INPUT_TOKENS), _first_int(attrs, _OUTPUT_TOKENS),
             _first_int(attrs, _TOTAL_TOKENS)]
    if found == [None, None, None]:
        return None
    return TokenUsage(*found, _first_int(attrs, _CACHED_TOKENS)).with_total()


def _first_int(attrs: Mapping[str, Any], keys: Iterable[str]) -> int | None:
    for key in keys:
        value = attrs.get(key)
        if value is not None:
            value = _int(value)
            if value is not None:
                return value
    return None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _exception(events: Sequence[tuple[str, Mapping[str, Any]]]) -> str | None:
    for name, attrs in events:
        if name == "exception":
            etype, message = attrs.get("exception.type"), attrs.get("exception.message")
            if etype and message:
                return f"{etype}: {message}"
            if etype or message:
                return str(etype or message)
    return None
