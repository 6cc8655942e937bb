"""The documentation's command pages (docs/pages/commands/): one page per `tracejudge` command, each
with its usage generated at build time from the parser `tracejudge` parses with (docs/hooks/commands.py),
so a flag added to a command is on its page without anyone copying it there.

Every command and nested subcommand the parser has is on a page with a usage marker; what a marker
becomes is what `tracejudge ... --help` prints, whatever the terminal's width; a marker naming a command
that does not exist fails the build; the site builds with --strict and the eval page shows its gate."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tracejudge.consumer.commands import cli
from tracejudge.consumer.config import BUILTIN_SINKS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = DOCS / "pages" / "commands"
HOOK_PATH = DOCS / "hooks" / "commands.py"
MKDOCS = Path(sys.executable).parent / "mkdocs"
BUILD_TIMEOUT_S = 300


def _load_hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tracejudge_docs_hook_commands", HOOK_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _load_hook()


def _nested(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command path the parser has down to the ones that run: ("eval",), ("dataset", "synthesize")."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        nested = _nested(parser)
        if not nested:
            found[path] = parser
        for name, sub in nested.items():
            walk((*path, name), sub)

    for name in cli.SUBCOMMANDS:
        walk((name,), _nested(cli.build_parser(name))[name])
    return found


COMMANDS = command_parsers()


def page_markers() -> dict[str, list[tuple[str, ...]]]:
    """The usage markers of each command page (page name -> the words after `tracejudge`)."""
    return {page.stem: [tuple(words) for _, words in hook.markers_of(page.read_text(encoding="utf-8"))]
            for page in sorted(PAGES.glob("*.md"))}


def test_the_walk_finds_the_nested_subcommands() -> None:
    # The walk is what the next test trusts: it must reach below the top-level commands.
    assert {("eval",), ("dataset", "merge-labels"), ("dataset", "synthesize"), ("alerts", "render"),
            ("slo", "render")} <= set(COMMANDS)
    assert {path[0] for path in COMMANDS} == set(cli.SUBCOMMANDS)


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_every_command_has_a_page_with_its_usage(path: tuple[str, ...]) -> None:
    page = PAGES / f"{path[0]}.md"
    assert page.is_file(), f"no page {page.relative_to(ROOT)} for `tracejudge {' '.join(path)}`"
    markers = page_markers()[path[0]]
    assert any(words[:len(path)] == path for words in markers), (
        f"{page.relative_to(ROOT)} has no `<!-- generated: usage tracejudge {' '.join(path)} -->`")
    nav = yaml.safe_load((DOCS / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    assert f"commands/{path[0]}.md" in str(nav), f"commands/{path[0]}.md is not in mkdocs.yml's nav"


def test_the_sink_page_shows_every_built_in_kind() -> None:
    kinds = {words[1] for words in page_markers()["sink"] if len(words) == 2}
    assert kinds == set(BUILTIN_SINKS)


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_the_generated_usage_is_the_parsers_own_help(path: tuple[str, ...],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(hook.COLUMNS))
    expected = COMMANDS[path].format_help()
    assert expected.startswith(f"usage: tracejudge {' '.join(path)} ")
    assert hook.usage(path) == expected


def test_every_marker_on_the_pages_is_what_the_command_prints(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    seen = 0
    for page, markers in page_markers().items():
        for words in markers:
            monkeypatch.setenv("COLUMNS", str(hook.COLUMNS))
            with pytest.raises(SystemExit) as exit_info:
                cli.main([*words, "--help"])
            assert exit_info.value.code == 0
            printed = capsys.readouterr().out
            assert hook.usage(words) == printed, f"{page}.md: tracejudge {' '.join(words)}"
            seen += 1
    assert seen >= len(COMMANDS) + len(BUILTIN_SINKS) - 1


def test_a_sink_kind_gets_that_sinks_help() -> None:
    for kind in BUILTIN_SINKS:
        text = " ".join(hook.usage(("sink", kind)).split())
        assert f"sink.{kind}:" in text and f"tracejudge-sink-{kind}" in text, kind


def test_the_usage_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    wide_terminal = hook.usage(("eval",))
    assert os.environ["COLUMNS"] == "200"  # put back as it was
    monkeypatch.delenv("COLUMNS")
    assert hook.usage(("eval",)) == wide_terminal
    assert "COLUMNS" not in os.environ
    # ... and the width was the hook's, not the terminal's: at 200 columns argparse wraps otherwise.
    assert hook.usage(("eval",), columns=200) != wide_terminal
    assert wide_terminal.splitlines()[0] == "usage: tracejudge eval [-h] [-o FILE] [--rejects FILE]"


def test_a_marker_becomes_a_text_block_and_one_in_a_fence_is_left_alone() -> None:
    page = ("# eval\n\n<!-- generated: usage tracejudge eval -->\n\n"
            "```markdown\n<!-- generated: usage tracejudge nope -->\n```\n")
    out = hook.render(page)
    block = re.search(r"^(`{3,})text\n(.*?)^\1$", out, re.MULTILINE | re.DOTALL)
    assert block, out
    assert block.group(2) == hook.usage(("eval",))
    assert "<!-- generated: usage tracejudge eval -->" not in out
    assert "<!-- generated: usage tracejudge nope -->" in out


@pytest.mark.parametrize(("marker", "says"), [
    ("tracejudge nope", "no command 'nope'"),
    ("tracejudge dataset nope", "has no 'nope'"),
    ("tracejudge dataset", None),             # a group: its help lists its subcommands, a valid marker
    ("tracejudge sink nope", "has no 'nope'"),
    ("tracejudge findings results.jsonl", "has no 'results.jsonl'"),
    ("tracejudge eval run", "has no 'run'"),
    ("tracejudge sink mlflow otlp", "has no 'otlp'"),
    ("eval", "names no `tracejudge` command"),
    ("", "names no `tracejudge` command"),
])
def test_an_unknown_command_in_a_marker_is_an_error(marker: str, says: str | None) -> None:
    page = f"# page\n\n<!-- generated: usage {marker} -->\n"
    if says is None:
        assert "usage: tracejudge dataset [-h] SUBCOMMAND" in hook.render(page, "x.md")
        return
    with pytest.raises(hook.UnknownCommand, match=re.escape(says)) as raised:
        hook.render(page, "x.md")
    assert str(raised.value).startswith("x.md")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S, check=False)


def test_an_unknown_command_fails_the_build(tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "index.md").write_text("# Commands\n\n<!-- generated: usage tracejudge slo render -->\n",
                                    encoding="utf-8")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"site_name: t\ndocs_dir: pages\nhooks:\n  - {HOOK_PATH}\n", encoding="utf-8")
    good = _build(config, tmp_path / "site")
    assert good.returncode == 0, good.stderr
    assert "usage: tracejudge slo render [-h] --config FILE" in (tmp_path / "site" / "index.html").read_text()
    (pages / "index.md").write_text("# Commands\n\n<!-- generated: usage tracejudge slo burn -->\n",
                                    encoding="utf-8")
    bad = _build(config, tmp_path / "site2")
    assert bad.returncode != 0
    assert "index.md:3: usage marker 'tracejudge slo burn': `tracejudge slo` has no 'burn'" in bad.stderr


def test_the_site_builds_strict_with_the_generated_usage(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = _build(DOCS / "mkdocs.yml", site)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    eval_page = (site / "commands" / "eval" / "index.html").read_text(encoding="utf-8")
    assert "usage: tracejudge eval [-h]" in eval_page
    assert "--fail-under" in eval_page
    assert "generated: usage" not in eval_page
    for path in COMMANDS:
        assert (site / "commands" / path[0] / "index.html").is_file(), path
