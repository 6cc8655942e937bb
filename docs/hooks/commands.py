"""MkDocs hook: each command page's usage, generated from the `tracejudge` parser at build time.

A page line that is only

    <!-- generated: usage tracejudge eval -->

(or `tracejudge sink mlflow`, `tracejudge findings run`, `tracejudge dataset synthesize`, plain
`tracejudge`) becomes a ```text block holding what that command's `--help` prints, built in-process
from the parser `tracejudge` itself parses with (`consumer/commands/cli.py`, `build_parser`), so the
pages cannot drift from the flags. The width is fixed (`COLUMNS`), so the build is the same on every
terminal. A marker naming a command the parser does not have fails the build; a marker inside a fenced
block is left as written (a page may show one).

Words after the subcommands are accepted only where the command's help depends on them: a built-in sink
kind (`tracejudge sink KIND --help` describes that sink and its `sink.KIND:` keys) and `findings run`
(the same parser as `findings FILE...`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

from tracejudge.consumer.commands import cli
from tracejudge.consumer.config import BUILTIN_SINKS

HOOKS = Path(__file__).resolve().parent
if str(HOOKS) not in sys.path:  # markers.py beside this file, also when a test imports it
    sys.path.insert(0, str(HOOKS))

from markers import generated_markers  # noqa: E402

__all__ = ["COLUMNS", "USAGE", "UnknownCommand", "fixed_width", "markers_of", "on_page_markdown", "render",
           "usage"]

COLUMNS = 80
# A marker of docs/hooks/markers.py whose text is `usage tracejudge ...`.
USAGE = re.compile(r"^usage\b\s*(.*)$")
# Words after a command's subcommands that select its help: (command path) -> the words allowed.
_ARGUMENT_WORDS: dict[tuple[str, ...], Callable[[], set[str]]] = {
    ("sink",): lambda: set(BUILTIN_SINKS),
    ("findings",): lambda: {importlib.import_module("tracejudge.consumer.commands.findings").RUN},
}


class UnknownCommand(PluginError):
    """A usage marker names a command (or a word) that `tracejudge` does not have."""


@contextlib.contextmanager
def fixed_width(columns: int = COLUMNS) -> Iterator[None]:
    """argparse wraps at the terminal's width (`COLUMNS`, read by `shutil.get_terminal_size`): fixed
    while the help is formatted, restored after."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(columns)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _checked(words: Sequence[str]) -> argparse.ArgumentParser:
    """The parser `tracejudge` builds for `words` (checked against it); UnknownCommand otherwise."""
    where = "tracejudge " + " ".join(words)
    if not words:
        return cli.build_parser(None)
    if words[0] not in cli.SUBCOMMANDS:
        raise UnknownCommand(f"usage marker {where!r}: tracejudge has no command {words[0]!r} "
                             f"(it has {', '.join(cli.SUBCOMMANDS)})")
    with warnings.catch_warnings():  # the libraries' import-time deprecations are not the page's
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = cli.build_parser(words[0])
    current = _subcommands(parser)[words[0]]
    path: list[str] = [words[0]]
    while len(path) < len(words) and words[len(path)] in (nested := _subcommands(current)):
        current = nested[words[len(path)]]
        path.append(words[len(path)])
    rest = list(words[len(path):])
    allowed = _ARGUMENT_WORDS.get(tuple(path), set)()
    # At most one argument word, and one the command's help depends on.
    at = len(path) if rest and rest[0] not in allowed else len(path) + 1 if len(rest) > 1 else None
    if at is not None:
        known = sorted(_subcommands(current)) or (sorted(allowed) if at == len(path) else [])
        raise UnknownCommand(f"usage marker {where!r}: `tracejudge {' '.join(words[:at])}` has no "
                             f"{words[at]!r}" + (f" (it has {', '.join(known)})" if known else ""))
    return parser


def usage(words: Sequence[str], columns: int = COLUMNS) -> str:
    """What `tracejudge WORDS... --help` prints, as argparse prints it, `columns` wide."""
    parser = _checked(list(words))
    out = io.StringIO()
    with fixed_width(columns), contextlib.redirect_stdout(out):
        try:
            parser.parse_args([*words, "--help"])
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise UnknownCommand(f"`tracejudge {' '.join(words)} --help` exited {exc.code}") from exc
        else:
            raise UnknownCommand(f"`tracejudge {' '.join(words)} --help` printed no help")
    return out.getvalue()


def markers_of(markdown: str) -> list[tuple[int, list[str]]]:
    """(line index, the words after `tracejudge`) of every usage marker outside fenced blocks."""
    lines = markdown.splitlines()
    found: list[tuple[int, list[str]]] = []
    for n, text in generated_markers(lines):
        if (m := USAGE.match(text)) is None:
            continue
        words = m.group(1).split()
        if not words or words[0] != "tracejudge":
            raise UnknownCommand(f"line {n + 1}: usage marker {lines[n].strip()!r} names no `tracejudge` "
                                 "command")
        found.append((n, words[1:]))
    return found


def render(markdown: str, where: str = "page") -> str:
    """`markdown` with every usage marker replaced by its command's help in a ```text block."""
    lines = markdown.splitlines()
    try:
        found = markers_of(markdown)
    except UnknownCommand as exc:
        raise UnknownCommand(f"{where}: {exc}") from exc
    for n, words in reversed(found):
        try:
            text = usage(words).rstrip("\n")
        except UnknownCommand as exc:
            raise UnknownCommand(f"{where}:{n + 1}: {exc}") from exc
        longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
        fence = "`" * max(3, longest + 1)
        lines[n:n + 1] = [f"{fence}text", *text.splitlines(), fence]
    return "\n".join(lines) + ("\n" if markdown.endswith("\n") else "")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    return render(markdown, page.file.src_uri)
