"""The configuration reference, generated from the settings models (`docs/hooks/reference.py` puts it in
docs/pages/reference/configuration.md at build time).

Walks `tracejudge.consumer.config.settings.Settings` and every model it nests, and the built-in sinks'
own sections (`sink.mlflow`, `sink.otlp`, `sink.phoenix`: each sink class's settings class, as
`tracejudge sink` finds it), and writes one table per section: each key's path, type, default (as YAML
shows it, a `default_factory` evaluated), constraints, whether it is a secret (masked in the printed
configuration), its environment variable and its description. A description is, in this order, the
field's `Field(description=...)`, its attribute docstring, or the comment lines directly above it in its
class body (or at the end of its line). Nothing is listed by hand: a field added to a model appears here.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

__all__ = ["Key", "Section", "describe_field", "render", "sections"]


@dataclass
class Key:
    """One key of a section, as the reference shows it."""

    path: str
    type: str
    default: str
    constraints: str
    secret: bool
    env: str | None
    description: str
    anchor: str | None = None  # a key that is a section of its own: that section's anchor


@dataclass
class Section:
    """A model at a key path of the file: `kafka`, `judges.endpoints.<name>`, `collections[]`."""

    path: str
    model: type[BaseModel]
    doc: str
    keys: list[Key] = field(default_factory=list)

    @property
    def anchor(self) -> str:
        return anchor_of(self.path)


def anchor_of(path: str) -> str:
    return "config-" + (re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "top")


# --- where the keys are ---------------------------------------------------------------------------


def sections(root: type[BaseModel] | None = None) -> list[Section]:
    """Every section under `root` (default: `Settings`), in the order of the file, each model documented
    once, at its first path (a key of the same model elsewhere links there)."""
    if root is None:
        from tracejudge.consumer.config.settings import Settings

        root = Settings
    from tracejudge.consumer.config.common import ENV_NESTING, ENV_PREFIX

    out: list[Section] = []
    seen: dict[type[BaseModel], str] = {}

    def env_name(parts: tuple[str, ...] | None) -> str | None:
        return None if parts is None else ENV_PREFIX + ENV_NESTING.join(parts).upper()

    def visit(path: str, model: type[BaseModel], env: tuple[str, ...] | None, secret: bool) -> None:
        section = Section(path, model, _class_doc(model))
        out.append(section)
        nested: list[tuple[str, type[BaseModel], tuple[str, ...] | None, bool]] = []
        for name, info in model.model_fields.items():
            key_path = f"{path}.{name}" if path else name
            key_env = None if env is None else (*env, name)
            is_secret = secret or _declared_secret(info)
            child, how = _nested_model(info.annotation)
            sink_model = _sink_section(model, name)
            if sink_model is not None:
                child, how = sink_model, "model"
            if child is not None:
                child_path = {"model": key_path, "list": f"{key_path}[]", "dict": f"{key_path}.<name>"}[how]
                child_env = {"model": key_env, "list": None,
                             "dict": None if key_env is None else (*key_env, "<NAME>")}[how]
                if child not in seen:  # a model is documented once, at its first path
                    seen[child] = child_path
                    nested.append((child_path, child, child_env, is_secret))
                listed = how == "list" and key_env is not None and _env_settable(model, name, info)
                kind = _type_text(info.annotation, child, how)
                if seen[child] != child_path:
                    kind += f"; its keys as `{seen[child]}`'s"
                section.keys.append(Key(key_path, kind, "", "",
                                        is_secret, env_name(key_env) if listed else None,
                                        describe_field(model, name), anchor_of(seen[child])))
                continue
            section.keys.append(Key(
                key_path, _type_text(info.annotation), _default_text(info), _constraints_text(info),
                is_secret, env_name(key_env) if _env_settable(model, name, info) else None,
                describe_field(model, name)))
        for child_path, child, child_env, is_secret in nested:
            visit(child_path, child, child_env, is_secret)

    seen[root] = ""
    visit("", root, (), False)
    return out


def _sink_section(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The settings class of a built-in sink's own section (`sink.mlflow`, ...), as `tracejudge sink`
    finds it (`sink_settings_type`)."""
    from tracejudge.consumer.config.sink import BUILTIN_SINKS, SinkSettings

    if model is not SinkSettings or name not in BUILTIN_SINKS:
        return None
    from tracejudge.consumer.stages.sink import sink_settings_type
    from tracejudge.metrics.plugins import load_plugin

    cls = load_plugin(BUILTIN_SINKS[name], key=f"sink.{name}", noun="sink class")
    settings = sink_settings_type(cls)
    if not (isinstance(settings, type) and issubclass(settings, BaseModel)):
        raise TypeError(f"the {name} sink has no settings model")
    return settings


def _args(annotation: Any) -> tuple[Any, ...]:
    return typing.get_args(annotation)


def _strip(annotation: Any) -> Any:
    """`Annotated[X, ...]` -> X."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = _args(annotation)[0]
    return annotation


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The model a field holds: itself (`model`), as list items (`list`) or mapping values (`dict`)."""
    annotation = _strip(annotation)
    options = [_strip(a) for a in _args(annotation)] if _is_union(annotation) else [annotation]
    for option in options:
        if _is_model(option):
            return option, "model"
        origin = typing.get_origin(option)
        args = [_strip(a) for a in _args(option)]
        if origin in (list, tuple, set, frozenset) and args and _is_model(args[0]):
            return args[0], "list"
        if origin in (dict, Mapping) and len(args) == 2 and _is_model(args[1]):
            return args[1], "dict"
    return None, ""


def _declared_secret(info: FieldInfo) -> bool:
    """A `SecretStr` or `SECRET` field. (An `OPAQUE` section, a sink's own, is a model documented here:
    its keys' secrecy is what its settings model declares.)"""
    from tracejudge.metrics.judges.secrets import SECRET

    return SECRET in info.metadata or any(a is SecretStr for a in _walk_types(info.annotation))


def _walk_types(annotation: Any) -> Iterator[Any]:
    yield annotation
    for arg in _args(annotation):
        yield from _walk_types(arg)


def _env_settable(model: type[BaseModel], name: str, info: FieldInfo) -> bool:
    """Whether an environment variable (a string) can give the key: a scalar, or a list or mapping whose
    model reads a string for it (a `mode="before"` validator: `TRACEJUDGE_STREAM__TOPICS=a,b`)."""
    annotation = _strip(info.annotation)
    options = [_strip(a) for a in _args(annotation)] if _is_union(annotation) else [annotation]
    containers = [o for o in options if typing.get_origin(o) in (list, dict, tuple, set, Mapping)
                  or o in (list, dict)]
    if not containers:
        return True
    for validator in model.__pydantic_decorators__.field_validators.values():
        fields = validator.info.fields
        if validator.info.mode == "before" and (name in fields or "*" in fields):
            return True
    return False


# --- how the keys are shown -----------------------------------------------------------------------


_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path",
            SecretStr: "string", type(None): "null", Any: "any", object: "any"}


def _type_text(annotation: Any, child: type[BaseModel] | None = None, how: str = "") -> str:
    if child is not None:
        name = {"model": "section", "list": "list of entries", "dict": "mapping of names to entries"}[how]
        return name + (", or null" if _admits_none(annotation) else "")
    return _plain_type(annotation)


def _admits_none(annotation: Any) -> bool:
    annotation = _strip(annotation)
    return _is_union(annotation) and any(_strip(a) is type(None) for a in _args(annotation))


def _plain_type(annotation: Any) -> str:
    annotation = _strip(annotation)
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if _is_union(annotation):
        parts = [_plain_type(a) for a in _args(annotation) if _strip(a) is not type(None)]
        text = " or ".join(dict.fromkeys(parts))
        return text + (", or null" if _admits_none(annotation) else "")
    origin = typing.get_origin(annotation)
    args = _args(annotation)
    if origin is Literal:
        kinds = {_SCALARS.get(type(a), "value") for a in args}
        return " or ".join(sorted(kinds))
    if origin in (list, tuple, set, frozenset):
        return f"list of {_plain_type(args[0])}" if args else "list"
    if origin in (dict, Mapping) or annotation in (dict, Mapping):
        return f"mapping of {_plain_type(args[0])} to {_plain_type(args[1])}" if len(args) == 2 else "mapping"
    if _is_model(annotation):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return "required"
    return yaml_value(value)


def yaml_value(value: Any) -> str:
    """A value as a YAML file writes it, on one line."""
    plain = to_jsonable_python(value)
    text = yaml.safe_dump(plain, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def _constraints_text(info: FieldInfo) -> str:
    out: list[str] = []
    signs = {annotated_types.Gt: ("gt", ">"), annotated_types.Ge: ("ge", "≥"),
             annotated_types.Lt: ("lt", "<"), annotated_types.Le: ("le", "≤")}
    for meta in _all_metadata(info):
        for kind, (attr, sign) in signs.items():
            if isinstance(meta, kind):
                out.append(f"{sign} {_number(getattr(meta, attr))}")
        if isinstance(meta, annotated_types.MinLen) and meta.min_length:
            out.append("not empty" if meta.min_length == 1 else f"at least {meta.min_length} long")
        if isinstance(meta, annotated_types.MaxLen):
            out.append(f"at most {meta.max_length} long")
        pattern = getattr(meta, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"matches `{pattern}`")
    choices = [a for a in _walk_types(_strip(info.annotation)) if typing.get_origin(a) is Literal]
    values = [v for lit in choices for v in _args(lit)]
    if values:
        out.append("one of " + ", ".join(f"`{v if isinstance(v, str) and v else yaml_value(v)}`"
                                         for v in values))
    return "; ".join(dict.fromkeys(out))


def _all_metadata(info: FieldInfo) -> Iterator[Any]:
    yield from info.metadata
    annotation = info.annotation
    for option in (_args(annotation) if _is_union(annotation) else (annotation,)):
        if typing.get_origin(option) is typing.Annotated:
            yield from _args(option)[1:]


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# --- descriptions ---------------------------------------------------------------------------------


def describe_field(model: type[BaseModel], name: str) -> str:
    """`Field(description=...)`, else the attribute docstring, else the comments above the field (or at
    the end of its line) in the class that declares it; "" when there is none."""
    info = model.model_fields[name]
    if info.description:
        return _one_line(info.description)
    for cls in model.__mro__:
        if name in inspect.get_annotations(cls):
            return _source_description(cls, name)
    return ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _class_doc(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")
    return _one_line(inspect.cleandoc(doc)) if doc else ""


@cache
def _class_source(cls: type) -> tuple[list[str], ast.ClassDef] | None:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    node = tree.body[0]
    return (source.splitlines(), node) if isinstance(node, ast.ClassDef) else None


def _source_description(cls: type, name: str) -> str:
    found = _class_source(cls)
    if found is None:
        return ""
    lines, node = found
    body = node.body
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and stmt.target.id == name):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            return _one_line(inspect.cleandoc(after.value.value))
        comments: list[str] = []
        row = stmt.lineno - 2
        while row >= 0 and lines[row].strip().startswith("#"):
            comments.insert(0, lines[row].strip().lstrip("#").strip())
            row -= 1
        if comments:
            return _one_line(" ".join(comments))
        end = lines[(stmt.end_lineno or stmt.lineno) - 1]
        trailing = _trailing_comment(end)
        return _one_line(trailing) if trailing else ""
    return ""


def _trailing_comment(line: str) -> str:
    """The comment at the end of a line of code ("" when none), strings' `#` aside."""
    try:
        import io
        import tokenize

        for tok in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
            if tok.type == tokenize.COMMENT:
                return tok.string.lstrip("#").strip()
    except (tokenize.TokenError, SyntaxError):
        return ""
    return ""


# --- the page -------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(root: type[BaseModel] | None = None) -> str:
    """The reference as Markdown: one heading and table per section."""
    out: list[str] = []
    for section in sections(root):
        title = f"`{section.path}`" if section.path else "Top level"
        out.append(f"### {title} {{ #{section.anchor} }}\n")
        if section.doc:
            out.append(_cell(section.doc) + "\n")
        out.append("| Key | Type | Default | Constraints | Environment variable | Description |")
        out.append("|---|---|---|---|---|---|")
        for key in section.keys:
            kind = key.type + (" (secret: masked)" if key.secret else "")
            if key.anchor is not None:
                kind = f"[{kind}](#{key.anchor})"
            default = f"`{_cell(key.default)}`" if key.default and key.default != "required" else key.default
            env = f"`{key.env}`" if key.env else "—"
            out.append(f"| `{key.path}` | {_cell(kind)} | {default} | {_cell(key.constraints)} | {env} | "
                       f"{_cell(key.description)} |")
        out.append("")
    return "\n".join(out)
