"""Every flag the README and the documentation's pages give a `tracejudge` command is a flag of that
command: in a line that runs or quotes `tracejudge COMMAND ...`, each `--flag` up to the end of that
command (a closing backquote, a pipe, `;`, `&&`) is checked against the command's own parser, so a
renamed or removed flag cannot stay in a page."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tracejudge.consumer.commands import cli

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"tracejudge\s+([a-z][a-z-]*)((?:[^`|;&\n]|&(?!&))*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    found = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _flags(sub)
    return found


def _command_flags() -> dict[str, set[str]]:
    top = _flags(cli.build_parser(None))
    out = {}
    for name in cli.SUBCOMMANDS:
        sub = next(a for a in cli.build_parser(name)._actions if isinstance(a, argparse._SubParsersAction))
        out[name] = _flags(sub.choices[name]) | top
    return out


def _uses() -> list[tuple[str, str, str]]:
    """(page, command, flag) for every flag given to a tracejudge command in the pages."""
    uses = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs" / "pages").rglob("*.md"))]:
        for match in COMMAND.finditer(doc.read_text(encoding="utf-8")):
            for flag in FLAG.findall(match.group(2)):
                uses.append((doc.relative_to(ROOT).as_posix(), match.group(1), flag))
    return uses


def test_every_flag_given_to_a_command_in_the_documentation_is_one_of_its_flags() -> None:
    flags = _command_flags()
    uses = _uses()
    assert len(uses) > 100, "the pages give the commands many flags"
    wrong = sorted({(page, command, flag) for page, command, flag in uses
                    if command in flags and flag not in flags[command]})
    assert not wrong, f"flags the documentation gives a command that does not take them: {wrong}"


def test_the_check_sees_a_flag_of_another_command() -> None:
    flags = _command_flags()
    assert "--fail-under" in flags["eval"] and "--fail-under" not in flags["run"]
    assert "--check-config" in flags["sink"]  # a nested command's flags count for its command
    assert COMMAND.findall("`tracejudge eval a.jsonl --fail-under g=0.9` and --strict") == [
        ("eval", " a.jsonl --fail-under g=0.9")]
