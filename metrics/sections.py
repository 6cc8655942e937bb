"""The one base of every configuration section, and how a section's validation errors are worded.

Every section of the configuration file is a `Section`, a pydantic model that refuses unknown keys: the
runtime's (`tracejudge.consumer.config`), the computed metrics' (`metrics:`, `tracejudge.metrics.computed`),
the judges' (`judges:`, `tracejudge.metrics.judges.config`) and the write-back sinks' (`sink.mlflow`,
`sink.otlp`, `tracejudge.consumer.sinks`). A family may add a flag of its own to `model_config` (pydantic
merges it with this one): the judges' models are frozen, the runtime's validate their defaults.

One error type: a check across keys raises `ConfigError(key, message)` (`tracejudge.schemas.errors`, a
`ValueError`, so pydantic carries it) with the key relative to the model; `problems` turns a pydantic
`ValidationError` into (key path, message) pairs, prefixing that key with the model's own path, and words
pydantic's errors the one way (`must be > 0, got -1`; `unknown key; did you mean 'port'?`), never quoting
a value declared secret (`SecretStr`, `SECRET`, `OPAQUE`: `tracejudge.metrics.judges.secrets`). A section
built directly (a `BuiltSection`: `AssemblySettings(max_wait_s=0)`) raises that `ConfigError` itself; a
file's sections are validated by their loader, which adds where each value came from.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError

from tracejudge.metrics.judges.secrets import OPAQUE, SECRET, redact_urls
from tracejudge.schemas.errors import ConfigError

__all__ = ["BuiltSection", "Section", "describe", "parse_key", "problems", "render_key"]


class Section(BaseModel):
    """A configuration section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class BuiltSection(Section):
    """A section that code also builds directly (`AssemblySettings(max_wait_s=1)`): a bad value is a
    `ConfigError` naming its key, as from a file. Its validators get no validation context (pydantic calls
    a custom `__init__` for nested values too), so a section whose checks read the context is a `Section`."""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError([(render_key(loc), message) for loc, message in problems(exc, type(self))]) \
                from None


def problems(exc: ValidationError, model: type[BaseModel]) -> list[tuple[tuple[Any, ...], str]]:
    """(location, message) of each error of `exc`, raised validating `model`: a `ConfigError` raised by a
    validator extends the location by its own (relative) key."""
    out: list[tuple[tuple[Any, ...], str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ConfigError):  # a validator's check, or a nested section built directly
            out.extend((loc + tuple(parse_key(key)), message) for key, message in cause.problems)
        else:
            out.append((loc, describe(err, loc, model)))
    return out


def parse_key(key: str) -> Iterable[str | int]:
    """"topics[2].name" -> "topics", 2, "name" (a part that is not `name[n]` is kept as it is)."""
    for part in key.split("."):
        name, _, rest = part.partition("[")
        if rest.endswith("]") and rest[:-1].isdigit():
            yield name
            yield int(rest[:-1])
        else:
            yield part


def render_key(loc: Sequence[Any]) -> str:
    """A pydantic location as the dotted key a user writes (`stream.topics[1].name`)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part).startswith(("function-", "literal[")) or part == "str":
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def describe(err: Mapping[str, Any], loc: Sequence[Any], model: type[BaseModel]) -> str:
    """What is wrong, in the configuration's words; the value is quoted unless it may be a secret."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    given = "" if _declared_secret(model, loc) else f", got {redact_urls(repr(err.get('input')))}"
    bounds = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
              "less_than_equal": ("le", "<="), "less_than": ("lt", "<")}
    if kind in bounds:
        name, sign = bounds[kind]
        bound = ctx[name]
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)  # `gt=0` of a float field: "must be > 0", as the file says it
        return f"must be {sign} {bound}{given}"
    named = {"int_parsing": "an integer", "int_type": "an integer", "int_from_float": "an integer",
             "float_parsing": "a number", "float_type": "a number", "bool_parsing": "true or false",
             "bool_type": "true or false", "string_type": "a string", "list_type": "a list",
             "dict_type": "a mapping", "model_type": "a mapping", "model_attributes_type": "a mapping"}
    if kind in named:
        return f"must be {named[kind]}{given}"
    if kind == "finite_number":
        return f"must be a finite number{given}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{given}"
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return _unknown_key(model, loc)
    if kind in ("too_short", "string_too_short"):
        return "must not be empty"
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    return str(err.get("msg", kind))


def _unknown_key(model: type[BaseModel], loc: Sequence[Any]) -> str:
    name = str(loc[-1]) if loc else ""
    known = _fields_at(model, loc[:-1])
    close = difflib.get_close_matches(name, known, n=1)
    hint = (f"; did you mean {close[0]!r}?" if close
            else f"; known keys: {', '.join(known)}" if known else "")
    return f"unknown key{hint}"


def _candidates(annotation: Any) -> list[Any]:
    return [annotation, *getattr(annotation, "__args__", ())]


def _declared_secret(model: type[BaseModel], loc: Sequence[Any]) -> bool:
    """Whether the value at `loc` is, or is inside, a field declared secret (`SecretStr`, `SECRET`)
    or opaque (`OPAQUE`, or a section a model does not validate): its input is never quoted."""
    cls: Any = model
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = cls.model_fields.get(str(part))
        if field is None:
            # A key of a mapping field (walked past already) or an extra key: a sink plugin's section.
            if cls.model_config.get("extra") == "allow":
                return True
            continue
        candidates = _candidates(field.annotation)
        if SECRET in field.metadata or OPAQUE in field.metadata or SecretStr in candidates:
            return True
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return False


def _fields_at(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """The keys the model at `loc` accepts, for "did you mean" hints."""
    cls: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(str(part))
        if field is None:
            return []
        cls = next((c for c in _candidates(field.annotation)
                    if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if cls is None:
            return []
    return list(cls.model_fields)
