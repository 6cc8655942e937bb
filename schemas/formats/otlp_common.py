"""What both OTLP readers share: the encodings of OTLP's common messages (ids, `AnyValue`,
`KeyValue` attribute lists, a resource's service) in protobuf and in OTLP/JSON.

Trace requests (`tracejudge.schemas.formats.otlp`) and content log records
(`tracejudge.schemas.formats.otlp_logs`) are the same OTLP underneath: the same id rules (an all-zero
id is invalid), the same attribute values, the same leniency towards protobuf-JSON writers (base64
ids, snake_case names). The OTLP/JSON readers raise `RecordError` naming the path (`where`) of what is
wrong, so a record is dead-lettered with the field to look at.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from typing import Any, Final

import orjson

from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError

__all__ = ["ZERO_SPAN", "ZERO_TRACE", "json_attributes", "json_document", "json_double", "json_field",
           "json_id", "json_int", "json_list", "json_object", "json_string", "json_value", "proto_attributes",
           "proto_value", "service_name"]

# All-zero ids are invalid in OTLP (and a zero parent means "no parent").
ZERO_TRACE: Final = b"\x00" * 16
ZERO_SPAN: Final = b"\x00" * 8
_HEX: Final = frozenset("0123456789abcdefABCDEF")


# --- protobuf ---------------------------------------------------------------------------------------


def proto_attributes(kvs: Any) -> dict[str, Any]:
    """Protobuf `KeyValue`s -> {key: value}."""
    return {kv.key: proto_value(kv.value) for kv in kvs}


def proto_value(value: Any) -> Any:
    """A protobuf `AnyValue` as the Python value OTLP/JSON would give (bytes as base64)."""
    which = value.WhichOneof("value")
    if which == "string_value":
        return value.string_value
    if which in ("int_value", "double_value", "bool_value"):
        return getattr(value, which)
    if which == "array_value":
        return [proto_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: proto_value(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        # As OTLP/JSON writes bytes: base64, so both encodings give the same attribute value.
        return base64.b64encode(value.bytes_value).decode()
    return None


# --- OTLP/JSON --------------------------------------------------------------------------------------


def json_field(obj: Mapping[str, Any], camel: str, snake: str) -> Any:
    """A field under its OTLP/JSON (camelCase) name, else its protobuf (snake_case) one."""
    value = obj.get(camel)
    return obj.get(snake) if value is None else value


def json_object(value: Any, where: str) -> None:
    """Raises `RecordError` at `where` unless `value` is a JSON object."""
    if not isinstance(value, Mapping):
        raise RecordError(errors.INVALID_RECORD, f"expected an object, got {type(value).__name__}", where)


def json_list(value: Any, where: str) -> list[Any]:
    """A JSON array (absent: empty), else `RecordError` at `where`."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RecordError(errors.INVALID_RECORD, f"expected an array, got {type(value).__name__}", where)
    return value


def json_string(value: Any, where: str) -> str:
    """A JSON string (absent: ""), else `RecordError` at `where`."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError(errors.INVALID_RECORD, f"expected a string, got {type(value).__name__}", where)
    return value


def json_id(value: Any, size: int, where: str, *, zero_ok: bool = False) -> str | None:
    """A hex id (OTLP/JSON), or a base64 one (protobuf JSON), as lowercase hex; "" -> None."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise RecordError(errors.INVALID_RECORD, f"expected a hex string, got {type(value).__name__}", where)
    if len(value) == 2 * size and _HEX.issuperset(value):
        hex_id = value.lower()
    else:
        # Protobuf JSON writes base64 (16 bytes -> 24 chars, 8 -> 12): never the hex lengths.
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != size:
            raise RecordError(errors.INVALID_RECORD, f"expected {2 * size} hex characters, got "
                              f"{errors.describe_value(value)}", where)
        hex_id = raw.hex()
    if hex_id.count("0") == 2 * size:
        if zero_ok:
            return None
        raise RecordError(errors.INVALID_RECORD, "id is all zeros (invalid)", where)
    return hex_id


def json_int(value: Any, where: str) -> int:
    """A 64-bit integer as OTLP/JSON writes it (a decimal string) or a number; absent: 0."""
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise RecordError(errors.INVALID_RECORD, f"expected an integer (decimal string), got "
                      f"{errors.describe_value(value)}", where)


def json_attributes(kvs: Any, where: str) -> dict[str, Any]:
    """OTLP/JSON `[{"key", "value": AnyValue}]` -> {key: value}, naming the path of a bad one."""
    out: dict[str, Any] = {}
    for i, kv in enumerate(json_list(kvs, where)):
        if not isinstance(kv, Mapping) or not isinstance(kv.get("key"), str):
            raise RecordError(errors.INVALID_RECORD, "expected {\"key\": <string>, \"value\": {...}}",
                              f"{where}[{i}]")
        out[kv["key"]] = json_value(kv.get("value"), f"{where}[{i}].value")
    return out


def json_value(value: Any, where: str) -> Any:
    """An OTLP/JSON `AnyValue` -> its Python value (None when it holds none)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RecordError(errors.INVALID_RECORD, f"expected an AnyValue object, got {type(value).__name__}",
                          where)
    for key, item in value.items():
        if key in ("stringValue", "string_value"):
            return json_string(item, where)
        if key in ("intValue", "int_value"):
            return json_int(item, where)
        if key in ("boolValue", "bool_value"):
            if not isinstance(item, bool):
                raise RecordError(errors.INVALID_RECORD,
                                  f"expected true/false, got {errors.describe_value(item)}", where)
            return item
        if key in ("doubleValue", "double_value"):
            return json_double(item, where)
        if key in ("arrayValue", "array_value"):
            values = json_list((item or {}).get("values"), f"{where}.arrayValue.values")
            return [json_value(v, f"{where}.arrayValue.values[{i}]") for i, v in enumerate(values)]
        if key in ("kvlistValue", "kvlist_value"):
            return json_attributes((item or {}).get("values"), f"{where}.kvlistValue.values")
        if key in ("bytesValue", "bytes_value"):
            return json_string(item, where)
    return None


def json_double(value: Any, where: str) -> float:
    """A double as JSON writes it, "NaN"/"Infinity" included."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # also "NaN", "Infinity", "-Infinity": how JSON spells them
        except ValueError:
            pass
    raise RecordError(errors.INVALID_RECORD, f"expected a number, got {errors.describe_value(value)}", where)


# --- both -------------------------------------------------------------------------------------------


def service_name(resource: Mapping[str, Any]) -> str | None:
    """The resource's `service.name`, None when unset or the SDK's `unknown_service` placeholder."""
    name = resource.get("service.name")
    # The SDK's placeholder when the app set no name; it identifies nothing.
    if not isinstance(name, str) or not name or name.startswith("unknown_service"):
        return None
    return name


def json_document(payload: bytes | str | Mapping[str, Any], accepts: Callable[[Any], bool], what: str,
                  key: str) -> Any:
    """The OTLP/JSON document of one record (`payload` parsed unless it already is), refused as
    `invalid_json` when it is not JSON and as `invalid_record` when `accepts` does not take it (an object
    with `key`: `resourceSpans` for traces, `resourceLogs` for logs)."""
    if isinstance(payload, Mapping):
        doc: Any = payload
    else:
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise RecordError(errors.INVALID_JSON, errors.not_json(exc)) from exc
    if not accepts(doc):
        raise RecordError(errors.INVALID_RECORD, f"an OTLP/JSON {what} record must be an object with '{key}'",
                          key)
    return doc
