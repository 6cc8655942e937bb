"""The README's examples are tests: every block it shows is run, validated or marked with a reason.

Read from the documents (tests/support/readme_examples.py parses them; its docstring lists the markers),
never copied here, so an example that rots fails:
- ```python: run as written with the venv's Python, in a directory holding the files the section shows;
  a block defining `def test_...` is run by pytest as a test file and must pass.
- ```sh / ```bash / ```console: run as written by bash (`set -e`), from a directory that mirrors the
  repository root plus the section's files, the venv's bin first on PATH; loopback only.
  `check-config` adds `--check-config` to the service commands of a block so they validate and exit.
- ```yaml: a tracejudge configuration, loaded by the real `load_settings`; a `groups:` file is a
  Prometheus rule file, checked by promtool.
- ```text: shown output; a command in one must be a fenced sh block, or marked not run.
A shell block that installs, builds images, needs a cluster or runs the demo is never run unmarked: the
mirror's entries are symlinks to the checkout, and an unmarked `make demo` reinstalled the venv's
entry point from the test's directory once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.readme_examples import (
    DOC_FILES,
    LONG_RUNNING,
    REPO,
    Block,
    blocks_of,
    indented_code_blocks,
    stray_markers,
)

SHELL = {"sh", "bash", "console", "shell"}
RUNNABLE = SHELL | {"python", "yaml"}
KNOWN = RUNNABLE | {"text"}
BLOCK_TIMEOUT_S = 180
BIN = Path(sys.executable).parent
# A command in a text block: a prompt, a tool a reader runs, or tracejudge with flags (a diagram may
# name `tracejudge sink mlflow` without being a command).
_COMMAND_LINE = re.compile(r"^\s*(?:\$ |\.venv/bin/|tracejudge\s.*\s--?\w|"
                           r"(?:make|docker|kubectl|helm|promtool|amtool|python|pip|curl|kafka-topics\.sh)\s)")
_NOT_HERE = re.compile(r"^\s*(?:sudo\s|make\s|docker\s|kubectl\s|helm\s|apt(?:-get)?\s|pip3?\s+install|"
                       r"(?:\S*python3?\s+-m\s+)?pip\s+install|\S*tracejudge\s+demo\b)")
_CHECK_CONFIG = re.compile(r"^(?P<cmd>.*?)(?P<comment>\s+#.*)?$")

BLOCKS: list[Block] = [b for doc in DOC_FILES for b in blocks_of(doc)]


def _declared() -> dict[str, list[Block]]:
    names: dict[str, list[Block]] = {}
    for b in BLOCKS:
        if b.marker and b.marker.file:
            names.setdefault(b.marker.file, []).append(b)
    return names


DECLARED = _declared()


def _runs(block: Block) -> bool:
    return block.lang in RUNNABLE and not (block.marker and block.marker.not_run)


def _resolve(name: str, block: Block) -> Block:
    """The block declaring the file `name` as `block` sees it: its own section's, then the one its
    `uses` names, then the only one in the documents."""
    candidates = DECLARED.get(name, [])
    local = [b for b in candidates if b.doc == block.doc and b.heading == block.heading]
    if local:
        return local[0]
    for used, heading in (block.marker.uses if block.marker else []):
        if used == name:
            chosen = [b for b in candidates if b.heading == heading]
            assert len(chosen) == 1, f"{block.where}: no single file {name!r} under heading {heading!r}"
            return chosen[0]
    assert len(candidates) == 1, (f"{block.where}: file {name!r} is declared {len(candidates)} times "
                                  f"({[b.where for b in candidates]}); "
                                  f"say which with 'uses {name} from HEADING'")
    return candidates[0]


def _merge(base: object, top: object) -> object:
    if isinstance(base, dict) and isinstance(top, dict):
        out = dict(base)
        for key, value in top.items():
            out[key] = _merge(base.get(key), value)
        return out
    return top


class Workspace:
    """A directory holding the files a block's section shows, with stand-ins for what the reader
    supplies (`yours:`) and the environment the commands run with."""

    def __init__(self, root: Path, block: Block, *, mirror_repo: bool) -> None:
        self.root = root
        # As a reader's shell would have it: no tracejudge settings, nothing of the outer pytest run.
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("TRACEJUDGE_", "PYTEST_"))}
        self.env["PATH"] = f"{BIN}{os.pathsep}{self.env.get('PATH', '')}"
        self.env.pop("PYTHONPATH", None)
        if mirror_repo:
            for entry in REPO.iterdir():
                if entry.name not in {".git", ".pytest_cache", ".ruff_cache"}:
                    (root / entry.name).symlink_to(entry)
        self.files: dict[str, Path] = {}
        names = {n for n, bs in DECLARED.items()
                 if len(bs) == 1 or any(b.heading == block.heading for b in bs)}
        names |= {n for n, _ in (block.marker.uses if block.marker else [])}
        for name in sorted(names):
            self.write(name, _resolve(name, block))

    def content(self, declaring: Block, seen: tuple[str, ...] = ()) -> tuple[str, list[tuple[str, Block]]]:
        """The text of the file `declaring` declares (merged over its base) and what the reader supplies,
        each with the block that says so."""
        marker = declaring.marker
        assert marker is not None and marker.file is not None
        yours = [(item, declaring) for item in marker.yours]
        if marker.over is None:
            return declaring.text, yours
        assert marker.over not in seen, f"{declaring.where}: files merged over each other in a cycle"
        base_text, base_yours = self.content(_resolve(marker.over, declaring), (*seen, marker.file))
        merged = _merge(yaml.safe_load(base_text), yaml.safe_load(declaring.text))
        return yaml.safe_dump(merged, sort_keys=False), base_yours + yours

    def write(self, name: str, declaring: Block) -> Path:
        path = self.root / name
        assert not path.exists(), f"{declaring.where}: file {name!r} would replace the repository's {name!r}"
        text, yours = self.content(declaring)
        text = self.stand_ins(text, yours, declaring)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        self.files[name] = path
        return path

    def stand_ins(self, text: str, yours: list[tuple[str, Block]], file_block: Block) -> str:
        for item, declaring in yours:
            if item.startswith("/"):
                assert item in text, f"{file_block.where}: 'yours: {item}' does not occur in the file"
                stand_in = self.root / "yours" / item.lstrip("/")
                stand_in.parent.mkdir(parents=True, exist_ok=True)
                stand_in.write_text("stand-in for the reader's file\n", encoding="utf-8")
                text = text.replace(item, str(stand_in))
            else:
                assert re.fullmatch(r"[A-Z][A-Z0-9_]*", item), (
                    f"{declaring.where}: 'yours: {item}' is no absolute path or environment variable")
                assert any(item in b.text for b in BLOCKS if b.heading == declaring.heading), (
                    f"{declaring.where}: 'yours: {item}' is not mentioned where the file is shown")
                self.env[item] = "stand-in-value"
        return text

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=self.root, env=self.env, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S, check=False)


def _with_check_config(script: str, where: str) -> str:
    out, added = [], 0
    for line in script.splitlines():
        if LONG_RUNNING.match(line):
            m = _CHECK_CONFIG.match(line)
            assert m is not None
            line = f"{m.group('cmd')} --check-config{m.group('comment') or ''}"
            added += 1
        out.append(line)
    assert added, f"{where}: marked check-config, but no service command to check"
    return "\n".join(out) + "\n"


def _needs_marker(block: Block) -> list[str]:
    """Lines of an unmarked shell block that must not run here: they install, change the machine or
    need a service this test does not have; such a block must say `not run (REASON)`."""
    return [line for line in block.text.splitlines() if _NOT_HERE.match(line)]


def _shell_script(block: Block) -> str:
    script = block.text
    if block.lang == "console":
        script = "\n".join(line[2:] for line in script.splitlines() if line.startswith("$ ")) + "\n"
    if block.marker and block.marker.check_config:
        script = _with_check_config(script, block.where)
    return script


def _report(proc: subprocess.CompletedProcess[str], block: Block, what: str) -> str:
    return (f"{block.where} ({block.heading!r}): {what} exited {proc.returncode}\n--- stdout\n"
            f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")


# -- every block is accounted for -----------------------------------------------------------------


def test_the_documents_are_read() -> None:
    assert DOC_FILES[0] == REPO / "README.md"
    assert sum(1 for b in BLOCKS if b.lang == "python") >= 3
    assert sum(1 for b in BLOCKS if b.lang in SHELL) >= 3


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda d: str(d.relative_to(REPO)))
def test_every_example_is_fenced(doc: Path) -> None:
    """An indented block has no language and cannot carry a marker: it would escape this test."""
    found = indented_code_blocks(doc)
    assert found == [], f"{doc.name}: indented code blocks at lines {found}; fence them (```sh, ```text, ...)"


def classification_problems(blocks: list[Block]) -> list[str]:
    """Why blocks cannot be run, or are marked so that they would be skipped without a reason."""
    problems: list[str] = []
    for b in blocks:
        m = b.marker
        if b.lang not in KNOWN:
            problems.append(f"{b.where}: language {b.lang or '(none)'!r}; use one of {sorted(KNOWN)}")
        if m is None:
            if b.lang in SHELL and any(LONG_RUNNING.match(line) for line in b.text.splitlines()):
                problems.append(f"{b.where}: a service command; mark it check-config or not run (REASON)")
            if b.lang in SHELL and _needs_marker(b):
                problems.append(f"{b.where}: {_needs_marker(b)[0]!r} cannot run here; "
                                "mark it not run (REASON)")
            if b.lang == "text" and any(_COMMAND_LINE.match(line) for line in b.text.splitlines()):
                problems.append(f"{b.where}: a command in a text block; make it ```sh or mark it not run")
            continue
        problems += [f"{b.where}: {p}" for p in m.problems]
        if m.not_run is not None and (m.file or m.check_config or m.over):
            problems.append(f"{b.where}: 'not run' with directives that need the block run")
        if (m.file or m.over) and b.lang not in {"yaml", "python"}:
            problems.append(f"{b.where}: file/over on a {b.lang} block")
        if m.check_config and b.lang not in SHELL:
            problems.append(f"{b.where}: check-config on a {b.lang} block")
        if m.not_run is not None and len(m.not_run) < 12:
            problems.append(f"{b.where}: 'not run ({m.not_run})' needs a reason a reader understands")
        if m.file and (Path(m.file).is_absolute() or ".." in Path(m.file).parts):
            problems.append(f"{b.where}: file {m.file!r} must be a relative path inside the directory")
    return problems


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda d: str(d.relative_to(REPO)))
def test_every_marker_is_on_its_block(doc: Path) -> None:
    assert stray_markers(doc) == [], f"{doc.name}: example markers not right before a fence at lines " \
                                     f"{stray_markers(doc)}"


def test_every_block_is_run_or_says_why_not() -> None:
    problems = classification_problems(BLOCKS)
    assert problems == [], "\n".join(problems)


def test_the_rules_catch_what_would_escape(tmp_path: Path) -> None:
    """The classification on a made-up document: each way an example could skip the test is caught."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# T\n\n```sh\nmake demo\n```\n\n"                                   # unmarked, cannot run here
        "```\ntracejudge eval x.jsonl\n```\n\n"                                # no language
        "```text\n.venv/bin/tracejudge eval x.jsonl\n```\n\n"                  # a command shown as text
        "```sh\ntracejudge run --config c.yaml\n```\n\n"                       # a service, unmarked
        "<!-- example: not run () -->\n```sh\ndocker ps\n```\n\n"             # no reason
        "<!-- example: not run (needs a Docker engine; and a registry) -->\n```sh\ndocker ps\n```\n\n"
        "<!-- example: nor run (typo) -->\n```sh\nls\n```\n\n"                # an unknown directive
        "Text:\n\n    docker ps\n\n- a list item\n\n    its indented paragraph\n",
        encoding="utf-8")
    found = classification_problems(blocks_of(doc))
    lines = [int(p.split(":")[1]) for p in found]
    assert lines == [3, 7, 11, 15, 20, 30], found
    assert "make demo" in found[0] and "language" in found[1] and "text block" in found[2]
    assert "service command" in found[3] and "unknown directive 'not run ()'" in found[4]
    assert "unknown directive 'nor run (typo)'" in found[5]
    assert blocks_of(doc)[5].marker.not_run == "needs a Docker engine; and a registry"
    assert stray_markers(doc) == []
    (tmp_path / "moved.md").write_text("<!-- example: not run (a reason long enough) -->\n\nText.\n\n"
                                       "```sh\nls\n```\n", encoding="utf-8")
    assert stray_markers(tmp_path / "moved.md") == [1]
    assert indented_code_blocks(doc) == [36]   # "    docker ps", not the list item's paragraph


def test_files_are_declared_once_per_section() -> None:
    seen: dict[tuple[Path, str, str], str] = {}
    for name, declaring in DECLARED.items():
        for b in declaring:
            key = (b.doc, b.heading, name)
            assert key not in seen, f"{b.where}: {name!r} already declared in this section at {seen[key]}"
            seen[key] = b.where


# -- running them ----------------------------------------------------------------------------------


RUN = [b for b in BLOCKS if _runs(b)]


@pytest.mark.parametrize("block", RUN, ids=lambda b: f"{b.where}:{b.lang}")
def test_example(block: Block, tmp_path: Path) -> None:
    # Never run a block the classification test rejects: an unmarked `make demo` would reinstall the venv.
    assert not (block.marker and block.marker.problems), f"{block.where}: {block.marker.problems}"
    assert block.lang not in SHELL or block.marker or not _needs_marker(block), (
        f"{block.where}: {_needs_marker(block)} cannot run here; mark the block not run (REASON)")
    if block.lang == "python":
        _run_python(block, tmp_path)
    elif block.lang in SHELL:
        _run_shell(block, tmp_path)
    else:
        _check_yaml(block, tmp_path)


def _run_python(block: Block, tmp_path: Path) -> None:
    ws = Workspace(tmp_path, block, mirror_repo=False)
    script = tmp_path / (f"test_readme_line{block.line}.py" if re.search(r"^def test_", block.text, re.M)
                         else f"readme_line{block.line}.py")
    script.write_text(block.text, encoding="utf-8")
    if script.name.startswith("test_"):
        proc = ws.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                       str(tmp_path), str(script)])
        assert proc.returncode == 0, _report(proc, block, "pytest")
        ran = re.search(r"(\d+) passed", proc.stdout)
        tests = len(re.findall(r"^def test_", block.text, re.M))
        assert ran and int(ran.group(1)) == tests, _report(proc, block, f"pytest (expected {tests} passed)")
    else:
        proc = ws.run([sys.executable, str(script)])
        assert proc.returncode == 0, _report(proc, block, "python")


def _run_shell(block: Block, tmp_path: Path) -> None:
    ws = Workspace(tmp_path, block, mirror_repo=True)
    script = tmp_path / f".readme_line{block.line}.sh"
    script.write_text("set -eo pipefail\n" + _shell_script(block), encoding="utf-8")
    proc = ws.run(["bash", "-x", str(script)])
    assert proc.returncode == 0, _report(proc, block, "bash")


def _check_yaml(block: Block, tmp_path: Path) -> None:
    ws = Workspace(tmp_path, block, mirror_repo=False)
    marker = block.marker
    if marker and marker.file:
        path = ws.files[marker.file]
    elif marker and marker.over:
        base = _resolve(marker.over, block)
        merged = _merge(yaml.safe_load(ws.files[marker.over].read_text(encoding="utf-8")),
                        yaml.safe_load(block.text))
        path = tmp_path / f"readme_line{block.line}.yaml"
        path.write_text(yaml.safe_dump(merged, sort_keys=False), encoding="utf-8")
        assert base.marker and base.marker.file == marker.over
    else:
        path = tmp_path / f"readme_line{block.line}.yaml"
        path.write_text(block.text, encoding="utf-8")
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict), f"{block.where}: a YAML block must hold a mapping"
    if "groups" in loaded:
        promtool = shutil.which("promtool")
        assert promtool, "promtool is needed to check a rule file (tests/support/ensure_system_packages.sh)"
        proc = ws.run([promtool, "check", "rules", str(path)])
        assert proc.returncode == 0, _report(proc, block, "promtool check rules")
        return
    ws.env["PYTHONPATH"] = str(tmp_path)   # the section's files are importable, as it says they must be
    check = ("import sys\nfrom tracejudge.consumer.config import ConfigError, load_settings\n"
             "try:\n    load_settings(sys.argv[1], require_topics=False)\n"
             "except ConfigError as exc:\n    sys.exit(exc.report())\n")
    proc = ws.run([sys.executable, "-c", check, str(path)])
    assert proc.returncode == 0, _report(proc, block, "load_settings")
