"""The request and response text of an app's payloads: what derivation (`derive`) and the row readers
(`agent_eval`, `inference_log`) take as the question a record asks and the answer it gave.

The rules follow MLflow's `mlflow.genai.utils.trace_utils` (a question under `query`, `question`,
`input`...; the last user message of a chat; an answer's `content`, the last assistant message, an
OpenAI Responses `output`), except where MLflow's answer is not what a judge should see (a Python
`repr` of the inputs, a JSON dump of the whole chat history): see docs/pages/inputs/formats.md, "Where
tracejudge deliberately differs from MLflow". Payloads are untrusted: nesting is unwrapped to a fixed depth.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["ANSWER_KEYS", "QUESTION_KEYS", "answer_in", "json_text", "question_in", "request_text",
           "response_text"]


# Keys under which an app's input dict carries the user's question, in order of preference.
# `input_args`: OpenInference's DSPy instrumentation wraps a module's named arguments in it.
QUESTION_KEYS = ("query", "question", "input", "prompt", "request", "message", "user_input", "inputs",
                 "input_args")


# Keys under which an output dict carries the answer.
ANSWER_KEYS = ("content", "output", "answer", "response", "text", "result")


# Nested payloads are unwrapped at most this deep: inputs are untrusted and may nest arbitrarily.
_MAX_DEPTH = 4


def json_text(value: Any) -> str:
    """Compact UTF-8 JSON text; objects orjson cannot write are written with `str()`."""
    return orjson.dumps(value, default=str).decode()


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


def question_in(value: Any, depth: int) -> str | None:
    """The question in a payload `depth` levels down, or None: no text made up from the whole payload
    (what `request_text` falls back to)."""
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
        text = question_in(inner, depth + 1)
        if text is not None:
            return text
    # A serving request in `dataframe_records` form holds one row per request.
    rows = value.get("dataframe_records")
    if isinstance(rows, list) and len(rows) == 1:
        return question_in(rows[0], depth + 1)
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
    text = question_in(value, 0)
    return text if text is not None else json_text(value)


def answer_in(value: Any, depth: int) -> str | None:
    """The answer in a payload `depth` levels down, or None: no text made up from the whole payload
    (what `response_text` falls back to)."""
    if isinstance(value, str):
        return value
    if depth > _MAX_DEPTH:
        return None
    if isinstance(value, list):
        if _is_message_list(value):
            return _responses_output_text(value) or _last_message_text(value, "assistant")
        # A pyfunc model wraps its one prediction in a list.
        return answer_in(value[0], depth + 1) if len(value) == 1 else None
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
        return answer_in(predictions[0], depth + 1)
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
    text = answer_in(value, 0)
    return text if text is not None else json_text(value)
