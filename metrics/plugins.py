"""The one loader of `package.module:attr` plug-in specs: the user's code a configuration key names.

Four keys name code to import: `kafka.sasl_oauth_token_provider` (a token provider), `sink.plugins.<kind>`
(a sink class), `metrics.custom[].function` (a custom metric) and `judges.redaction.callable` (a span
finder). Each is loaded here, at start-up, so a spec that does not load is a `ConfigError` naming the key
path and the spec, worded the same whichever key it is:

    metrics.custom[x].function: cannot import 'no_such_module' (from 'no_such_module:f'): No module ...
    judges.redaction.callable: 'mymod' has no function 'find' (from 'mymod:find'): no attribute of that name

It lives below the configuration (`tracejudge.consumer.config`) and beside the computed metrics and the
judges (`tracejudge.metrics.computed`, `tracejudge.metrics.judges.redaction`), which load with it too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from tracejudge.schemas.errors import ConfigError

__all__ = ["load_plugin"]


def load_plugin(spec: str, *, key: str, noun: str = "attribute", accept: Callable[[Any], bool] | None = None,
                dotted: bool = False) -> Any:
    """The object `spec` ("package.module:attr", `attr` may be dotted: "module:Class.method") names.

    `key` is the configuration key path that holds the spec (the `ConfigError`'s key); `noun` what the
    attribute must be ("function", "class"), for the messages; `accept` a check of the loaded object
    (a callable, a subclass); `dotted` also takes "package.module.attr", without the colon. Any failure
    to import (not only ImportError: a plug-in module may raise anything at import) is a `ConfigError`.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep and dotted:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(key, f"expected 'package.module:{noun}', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any failure is a configuration error
        raise ConfigError(key, f"cannot import {module_name!r} (from {spec!r}): {exc}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(key, f"{module_name!r} has no {noun} {attr!r} (from {spec!r}): no attribute "
                                   "of that name")
    if accept is not None and not accept(obj):
        raise ConfigError(key, f"{module_name!r} has no {noun} {attr!r} (from {spec!r}): it is "
                               f"{type(obj).__name__!r}")
    return obj
