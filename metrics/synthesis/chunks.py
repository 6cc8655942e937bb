"""The chunks a synthetic dataset is generated from, read from three kinds of input:

- a folder of text or Markdown files: each file is cut at its headings, then its paragraphs are packed
  into chunks of at most `max_chars` characters (a longer paragraph is cut at a line or word boundary);
  a chunk's `doc_uri` is the file's path relative to the folder, `#`, and the chunk's index in the file.
  Binary files (a NUL byte, or not UTF-8), empty files and files over `max_file_bytes` are skipped and
  counted (`Skips`), never read as text; hidden files and folders (a leading ".") are not visited;
- a JSON Lines file of chunks, one `{"doc_uri": ..., "content": ...}` object a line;
- result files (`tracejudge eval`/`run` output): the `retrieved_context` documents production retrieved.

`ChunkSet` keeps the first of the chunks with the same `doc_uri` and content (counted as duplicates) in
reading order; `select` picks at most N of them by a seeded hash, so the same seed picks the same
chunks on every run and machine.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tracejudge.metrics.judges.base import split_text
from tracejudge.metrics.judges.sampling import sample_point
from tracejudge.schemas.errors import InputError
from tracejudge.schemas.formats.input_files import Oversized, open_input, read_lines

__all__ = ["Chunk", "ChunkSet", "Skips", "chunk_document", "read_chunk_rows", "read_folder",
           "read_result_contexts", "select"]

MAX_LINE_BYTES = 64 * 1024 * 1024
EXAMPLES = 3
_HEADING = re.compile(r"^(#{1,6}\s|\S.*\n(?:=+|-+)\s*$)", re.M)
_REASONS = {"binary": "binary (a NUL byte or not UTF-8)", "empty": "empty", "too_large": "over the size "
            "limit", "unreadable": "unreadable", "no_content": "documents without content",
            "duplicate": "duplicate chunks (same doc_uri and content)"}


@dataclass(frozen=True, slots=True)
class Chunk:
    doc_uri: str | None
    content: str

    @property
    def key(self) -> str:
        """The chunk's identity: a hash of its doc_uri and content (its progress and request ids)."""
        material = f"{self.doc_uri or ''}\x00{self.content}".encode()
        return hashlib.sha256(material).hexdigest()[:20]

    def document(self) -> dict[str, Any]:
        if self.doc_uri is None:
            return {"content": self.content}
        return {"doc_uri": self.doc_uri, "content": self.content}


@dataclass
class Skips:
    """What was not read as a chunk, by reason, with a few examples of each."""

    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, example: str) -> None:
        self.counts[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES:
            shown.append(example)

    def line(self) -> str:
        """One line naming every count and its examples ("none" when nothing was skipped)."""
        if not self.counts:
            return "none"
        parts = []
        for reason, n in sorted(self.counts.items()):
            more = ", ..." if n > len(self.examples[reason]) else ""
            parts.append(f"{n} {_REASONS.get(reason, reason)} ({', '.join(self.examples[reason])}{more})")
        return "; ".join(parts)


def chunk_document(text: str, max_chars: int) -> list[str]:
    """The text cut at its Markdown headings (ATX `#` and underlined), each section's paragraphs packed
    into chunks of at most `max_chars` characters; a heading always starts a new chunk."""
    starts = sorted({0, *(m.start() for m in _HEADING.finditer(text))})
    sections = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    out: list[str] = []
    for section in sections:
        current = ""
        for para in re.split(r"\n\s*\n", section):
            para = para.strip()
            if not para:
                continue
            for piece in split_text(para, max_chars) if len(para) > max_chars else [para]:
                if current and len(current) + 2 + len(piece) > max_chars:
                    out.append(current)
                    current = ""
                current = f"{current}\n\n{piece}" if current else piece
        if current:
            out.append(current)
    return out


def read_folder(root: str, max_chars: int, max_file_bytes: int, skips: Skips) -> Iterator[Chunk]:
    """Every chunk of every readable file under `root`, files in sorted path order."""
    base = Path(root)
    if not base.is_dir():
        raise InputError(f"--docs {root}: not a folder")
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        paths.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
    for path in sorted(paths, key=lambda p: p.relative_to(base).as_posix()):
        rel = path.relative_to(base).as_posix()
        text = _read_text(path, rel, max_file_bytes, skips)
        if text is None:
            continue
        for i, content in enumerate(chunk_document(text, max_chars)):
            yield Chunk(f"{rel}#{i}", content)


def _read_text(path: Path, rel: str, max_file_bytes: int, skips: Skips) -> str | None:
    try:
        size = path.stat().st_size
        if size > max_file_bytes:
            skips.add("too_large", f"{rel}: {size} bytes")
            return None
        data = path.read_bytes()
    except OSError as exc:
        skips.add("unreadable", f"{rel}: {exc.strerror or type(exc).__name__}")
        return None
    if len(data) > max_file_bytes:  # grew since it was stat'ed
        skips.add("too_large", f"{rel}: {len(data)} bytes")
        return None
    if b"\x00" in data:
        skips.add("binary", rel)
        return None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        skips.add("binary", rel)
        return None
    if not text.strip():
        skips.add("empty", rel)
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _lines(stack: ExitStack, name: str) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON) of each non-blank line; `InputError` naming a line that is not JSON."""
    stream = open_input(stack, name)
    for lineno, line in read_lines(stream, name, MAX_LINE_BYTES):
        if isinstance(line, Oversized):
            raise InputError(f"{name}:{lineno}: {line.size} bytes, more than a line may have")
        if not line.strip():
            continue
        try:
            yield lineno, orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise InputError(f"{name}:{lineno}: not JSON ({exc})") from None


def read_chunk_rows(name: str, skips: Skips) -> Iterator[Chunk]:
    """The chunks of a JSON Lines file of `{"doc_uri", "content"}` objects."""
    with ExitStack() as stack:
        for lineno, obj in _lines(stack, name):
            if not isinstance(obj, dict) or not isinstance(obj.get("content"), str):
                raise InputError(f'{name}:{lineno}: not a chunk: expected an object with a "content" string '
                                 'and a "doc_uri"')
            uri = obj.get("doc_uri")
            if uri is not None and not isinstance(uri, str):
                raise InputError(f"{name}:{lineno}: doc_uri must be a string")
            if not obj["content"].strip():
                skips.add("no_content", f"{name}:{lineno}")
                continue
            yield Chunk(uri or None, obj["content"].strip())


def read_result_contexts(name: str, skips: Skips) -> Iterator[Chunk]:
    """The retrieved documents of every result line (a line without `retrieved_context` gives none)."""
    with ExitStack() as stack:
        for lineno, obj in _lines(stack, name):
            if not isinstance(obj, dict):
                raise InputError(f"{name}:{lineno}: not a result line: expected a JSON object")
            docs = obj.get("retrieved_context") or []
            if not isinstance(docs, list):
                raise InputError(f"{name}:{lineno}: retrieved_context must be a list")
            for k, doc in enumerate(docs):
                content = doc.get("content") if isinstance(doc, dict) else None
                if not isinstance(content, str) or not content.strip():
                    skips.add("no_content", f"{name}:{lineno} retrieved_context[{k}]")
                    continue
                uri = doc.get("doc_uri")
                yield Chunk(uri if isinstance(uri, str) and uri else None, content.strip())


class ChunkSet:
    """Chunks in reading order, the first of each (doc_uri, content) kept."""

    def __init__(self, skips: Skips) -> None:
        self.chunks: list[Chunk] = []
        self._seen: set[str] = set()
        self._skips = skips

    def extend(self, chunks: Iterator[Chunk]) -> None:
        for chunk in chunks:
            if chunk.key in self._seen:
                self._skips.add("duplicate", chunk.doc_uri or chunk.content[:40])
                continue
            self._seen.add(chunk.key)
            self.chunks.append(chunk)


def select(chunks: list[Chunk], max_chunks: int | None, seed: str) -> list[Chunk]:
    """At most `max_chunks` chunks: those with the smallest seeded hash of their key, in reading order."""
    if max_chunks is None or len(chunks) <= max_chunks:
        return list(chunks)
    ranked = sorted(range(len(chunks)), key=lambda i: (sample_point(chunks[i].key, seed), i))
    keep = set(ranked[:max_chunks])
    return [c for i, c in enumerate(chunks) if i in keep]
