"""The README's code blocks, read as examples the test suite runs (tests/test_readme_examples.py).

Every fenced block states its language. What the test does with a block follows from the language and
from an optional marker, an HTML comment on the last non-blank line before the fence:

    <!-- example: not run (REASON) -->        any block: not run; the reason is required
    <!-- example: file PATH -->               a yaml or python block is also the file PATH of its section
    <!-- example: file PATH over BASE -->     ... that file is BASE's YAML with this block's keys merged in
    <!-- example: over BASE -->               a yaml block validated merged into BASE (a section of a file)
    <!-- example: check-config -->            sh: `tracejudge run|sink|sessions|...` lines get --check-config
    <!-- example: uses NAME from HEADING -->  the file NAME declared under HEADING (another section)
    <!-- example: yours: ITEM, ITEM -->       what the reader supplies to a file: an absolute path (the
                                              test puts a stand-in file there and its path in the text)
                                              or an environment variable (set to a stand-in value)

Directives combine with ";". A block sees the files declared in its own section (its nearest heading),
every file name declared only once in the documents, and what `uses` names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DOC_FILES", "LONG_RUNNING", "REPO", "Block", "Marker", "blocks_of", "doc_files",
           "indented_code_blocks", "stray_markers"]

REPO = Path(__file__).resolve().parents[2]


def doc_files(repo: Path = REPO) -> list[Path]:
    """README.md, then every Markdown file under docs/ (when there is one), in a stable order."""
    docs = repo / "docs"
    return [repo / "README.md", *(sorted(docs.rglob("*.md")) if docs.is_dir() else [])]


DOC_FILES = doc_files()

# Commands that serve until stopped: a block running them must be marked check-config or not run.
LONG_RUNNING = re.compile(r"^\s*(?:\w+=\S*\s+)*(?:\.venv/bin/)?tracejudge\s+"
                          r"(?:run|sink\s+\S+|sessions|agreement|backfill|demo)\b")
_FENCE = re.compile(r"^(```+|~~~+)\s*([^\s`]*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_MARKER = re.compile(r"^<!--\s*example:\s*(.*?)\s*-->$")
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")


@dataclass
class Marker:
    """The directives of one `<!-- example: ... -->` comment."""

    text: str
    not_run: str | None = None
    file: str | None = None
    over: str | None = None
    check_config: bool = False
    uses: list[tuple[str, str]] = field(default_factory=list)
    yours: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class Block:
    """One fenced code block: where it is, its language and text, its heading and marker."""

    doc: Path
    line: int
    lang: str
    text: str
    heading: str
    marker: Marker | None

    @property
    def where(self) -> str:
        doc = self.doc.relative_to(REPO) if self.doc.is_relative_to(REPO) else self.doc
        return f"{doc}:{self.line}"


def _directives(text: str) -> list[str]:
    """`text` split at the semicolons outside parentheses (a reason may hold a semicolon)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def parse_marker(text: str) -> Marker:
    """Directives of a marker; anything not understood is listed in `problems`."""
    marker = Marker(text=text)
    for part in (p.strip() for p in _directives(text)):
        if m := re.fullmatch(r"not run \((.+)\)", part):
            marker.not_run = m.group(1).strip()
        elif m := re.fullmatch(r"file (\S+)(?: over (\S+))?", part):
            marker.file, marker.over = m.group(1), m.group(2)
        elif m := re.fullmatch(r"over (\S+)", part):
            marker.over = m.group(1)
        elif part == "check-config":
            marker.check_config = True
        elif m := re.fullmatch(r"uses (\S+) from (.+)", part):
            marker.uses.append((m.group(1), m.group(2).strip().strip('"')))
        elif m := re.fullmatch(r"yours: (.+)", part):
            marker.yours.extend(item.strip() for item in m.group(1).split(","))
        else:
            marker.problems.append(f"unknown directive {part!r}")
    return marker


def blocks_of(doc: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    heading = doc.name
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence is None:
            if h := _HEADING.match(line):
                heading = h.group(2)
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence.group(1)):
            end += 1
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        m = _MARKER.match(before)
        blocks.append(Block(doc=doc, line=i + 1, lang=fence.group(2).lower(),
                            text="\n".join(lines[i + 1:end]) + "\n", heading=heading,
                            marker=parse_marker(m.group(1)) if m else None))
        i = end + 1
    return blocks


def stray_markers(doc: Path) -> list[int]:
    """Line numbers of `<!-- example: ... -->` comments that are not a block's marker (the last non-blank
    line before a fence): a marker moved away from its block, or a second one, would be ignored."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    stray: list[int] = []
    for n, line in enumerate(lines, 1):
        if _MARKER.match(line.strip()):
            after = next((later for later in lines[n:] if later.strip()), "")
            if not _FENCE.match(after):
                stray.append(n)
    return stray


def indented_code_blocks(doc: Path) -> list[int]:
    """Line numbers of indented (unfenced) code blocks: they have no language and no marker, so every
    example must be fenced instead. A list item's indented continuation is not a code block."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    found: list[int] = []
    in_fence: str | None = None
    last_text = ""
    for n, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if in_fence:
            if line.startswith(in_fence):
                in_fence = None
            continue
        if fence:
            in_fence = fence.group(1)
            last_text = line
            continue
        if (line.startswith("    ") and line.strip() and n > 1 and not lines[n - 2].strip()
                and not _LIST_ITEM.match(last_text) and not last_text.startswith("  ")):
            found.append(n)
        if line.strip():
            last_text = line
    return found
