"""`load_settings`: the configuration from its layers, defaults < file < environment < flags, each bad key
reported with where its value came from (`tracejudge.consumer.config`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tracejudge.consumer.config.common import ENV_NESTING, ENV_PREFIX
from tracejudge.consumer.config.settings import Settings
from tracejudge.metrics.sections import problems, render_key
from tracejudge.schemas.errors import ConfigError

__all__ = ["load_settings"]


def load_settings(config_file: str | os.PathLike[str] | None = None, *,
                  environ: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None, offline: bool = False,
                  require_topics: bool = True) -> Settings:
    """Build `Settings` from the layers; raises `ConfigError` naming every bad key and its origin.

    `overrides` are dotted keys from the command line (`{"stream.topics": [...], "http.port": 9100}`);
    None values are ignored (flag not given). `offline` (for `tracejudge eval`) and
    `require_topics=False` (for `tracejudge sink`, which reads `sink.results_topic`) do not require
    `stream.topics`.
    """
    data: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    problems: list[tuple[str, str]] = []

    if config_file is not None:
        path = Path(config_file)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError([("--config", f"cannot read {str(path)!r}: {exc.strerror or exc}")]) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError([("--config", f"{str(path)!r} is not valid YAML{where}: {problem}")]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError([("--config", f"{str(path)!r} must hold a mapping of sections "
                                            f"(kafka:, stream:, ...), not {type(loaded).__name__}")])
        for section, body in loaded.items():
            if isinstance(body, dict) and body:
                for key, value in body.items():
                    _put(data, origins, (str(section), str(key)), value, f"{path}")
            else:
                _put(data, origins, (str(section),), body, f"{path}")

    env = os.environ if environ is None else environ
    for name, value in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or ENV_NESTING not in name:
            continue
        parts = name[len(ENV_PREFIX):].lower().split(ENV_NESTING)
        if len(parts) < 2 or not all(parts):
            problems.append((name, f"expected {ENV_PREFIX}<SECTION>{ENV_NESTING}<KEY>"))
            continue
        _put(data, origins, tuple(parts), value, name)

    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        key = tuple(dotted.split("."))
        _put(data, origins, key, value, _FLAG_NAMES.get(dotted, "command line"))

    if problems:
        raise ConfigError(problems)
    # Validate absent sections inside `Settings` too, so their errors carry the section's name.
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            data.setdefault(name, {})
    try:
        settings = Settings.model_validate(data, context={"offline": offline or not require_topics})
    except ValidationError as exc:
        raise ConfigError(_explain(exc, origins)) from None
    # Offline evaluation judges every eligible record unless a sample rate is configured.
    if offline and settings.judges is not None:
        settings = settings.model_copy(update={"judges": settings.judges.for_offline()})
    return settings


# The flags of `tracejudge run` and `tracejudge sink`, for error messages ("from --group-id").
_FLAG_NAMES = {
    "kafka.bootstrap_servers": "--bootstrap-servers",
    "kafka.group_id": "--group-id",
    "stream.topics": "--topic",
    "stream.results_topic": "--results-topic",
    "stream.dead_letter_topic": "--dead-letter-topic",
    "http.port": "--metrics-port",
    "http.bind_address": "--metrics-bind-address",
    "logging.level": "--log-level",
    # `tracejudge sink`
    "sink.group_id": "--group-id",
    "sink.results_topic": "--results-topic",
    "sink.dead_letter_topic": "--dead-letter-topic",
    # `tracejudge sessions`
    "sessions.group_id": "--group-id",
    "sessions.input_topic": "--input-topic",
    "sessions.results_topic": "--results-topic",
    "sessions.dead_letter_topic": "--dead-letter-topic",
    # `tracejudge agreement`
    "agreement.group_id": "--group-id",
    "agreement.results_topic": "--results-topic",
    "agreement.labels_topic": "--labels-topic",
}


def _put(data: dict[str, Any], origins: dict[tuple[str, ...], str], key: tuple[str, ...], value: Any,
         origin: str) -> None:
    node = data
    for part in key[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[key[-1]] = value
    origins[key] = origin


def _explain(exc: ValidationError, origins: Mapping[tuple[str, ...], str]) -> list[tuple[str, str]]:
    """Each problem's key path, with where its value came from (`tracejudge.metrics.sections` words it)."""
    out: list[tuple[str, str]] = []
    for loc, message in problems(exc, Settings):
        key = render_key(loc)
        origin = _origin(loc, origins)
        out.append((f"{key} (from {origin})" if origin else key, message))
    return out


def _origin(loc: Sequence[Any], origins: Mapping[tuple[str, ...], str]) -> str | None:
    names = tuple(str(p) for p in loc if not isinstance(p, int))
    for n in range(len(names), 0, -1):
        if names[:n] in origins:
            return origins[names[:n]]
    return None
