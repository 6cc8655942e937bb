"""MkDocs hook: the references generated at build time, and the snippets' base path.

- `on_config` sets pymdownx.snippets' `base_path` to the repository root, as an absolute path, so the
  site builds from any working directory.
- `on_page_markdown` replaces a marker line `<!-- generated: NAME -->` with the generated text of NAME:
  `configuration` (`reference_config`: from the settings models) or `metrics` (`reference_metrics`: from
  the registered Prometheus series). An unknown marker, or a generator that fails, fails the build.

The generators import tracejudge (installed in the environment that builds the site); they are not part
of the package.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

HOOKS = Path(__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]
if str(HOOKS) not in sys.path:  # the generators beside this file, also when a test imports it
    sys.path.insert(0, str(HOOKS))

import reference_config  # noqa: E402
import reference_metrics  # noqa: E402
from markers import generated_markers  # noqa: E402

GENERATORS: dict[str, Callable[[], str]] = {
    "configuration": reference_config.render,
    "metrics": reference_metrics.render,
}
# Markers another hook of docs/mkdocs.yml fills, by their first word: left for it (`on_page_content`
# fails the build if one is still there).
OTHER_HOOKS = {"usage": "hooks/commands.py"}


class GenerationError(PluginError):
    """A marker no hook fills (unknown, or left unfilled), or a generator that failed."""


def on_config(config: Any, **kwargs: Any) -> Any:
    """pymdownx.snippets reads from the repository root, whatever the working directory."""
    options = config["mdx_configs"].setdefault("pymdownx.snippets", {})
    options["base_path"] = [str(ROOT)]
    return config


def on_page_markdown(markdown: str, page: Any = None, **kwargs: Any) -> str:
    """Each marker line (outside fenced code) replaced by its generated text."""
    where = _where(page)
    lines = markdown.split("\n")
    for n, name in generated_markers(lines):
        lines[n] = _fill(name, lines[n], where)
    return "\n".join(lines)


def _fill(name: str, line: str, where: str) -> str:
    if name.split(" ", 1)[0] in OTHER_HOOKS:
        return line
    generate = GENERATORS.get(name)
    if generate is None:
        known = ", ".join([*sorted(GENERATORS), *(f"{k} ... ({v})" for k, v in OTHER_HOOKS.items())])
        raise GenerationError(f"{where}: unknown marker <!-- generated: {name} --> (known: {known})")
    try:
        text = generate()
    except Exception as exc:
        raise GenerationError(f"{where}: generating {name!r} failed: {type(exc).__name__}: {exc}") from exc
    if not text.strip():
        raise GenerationError(f"{where}: generating {name!r} gave nothing")
    return text.rstrip("\n")


def on_page_content(html: str, page: Any = None, **kwargs: Any) -> str:
    """No marker is left in a page (a hook that should have filled it did not run)."""
    if "<!-- generated:" in html:
        raise GenerationError(f"{_where(page)}: a <!-- generated: ... --> marker was left unfilled")
    return html


def _where(page: Any) -> str:
    return getattr(getattr(page, "file", None), "src_path", None) or "a page"
