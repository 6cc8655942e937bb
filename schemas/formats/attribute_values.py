"""How span attributes are written across conventions, read back: JSON text that may or may not be
JSON, and lists flattened into indexed keys (`llm.input_messages.0.message.role`).

Shared by the span conventions (`conventions`) and the model and cost attributes (`model_cost`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["indexed_items", "json_arguments", "json_items", "loose_json", "strict_json"]


def loose_json(value: Any) -> Any:
    """A JSON object/array string decoded; plain text and structured values as they are."""
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def strict_json(value: Any) -> Any:
    """A value its writer always JSON-encodes, decoded: MLflow's own attributes (`"\\"AGENT\\""`,
    `"20"`), Traceloop's `json.dumps`-ed entity input/output. Text that is not JSON stays text."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def json_items(value: Any) -> list[Any]:
    """A list, or a JSON array string, as a list; a single value as a list of it; absent: []."""
    value = loose_json(value)
    if isinstance(value, list):
        return value
    return [] if value is None else [value]


def json_arguments(value: Any) -> Any:
    """Tool-call arguments as OpenAI states them: a JSON string."""
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def indexed_items(flat: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """`{prefix}N.rest` keys -> a list (by N) of `{rest: value}` dicts; non-numeric N is skipped
    (`gen_ai.prompt.name` is not a prompt message)."""
    items: dict[int, dict[str, Any]] = {}
    cut = len(prefix)
    for key, value in flat.items():
        if not key.startswith(prefix):
            continue
        index, _, rest = key[cut:].partition(".")
        if not rest or not index.isdigit():
            continue
        items.setdefault(int(index), {})[rest] = value
    return [items[i] for i in sorted(items)]
