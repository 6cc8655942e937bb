"""Input files as users have them, opened for the offline commands (`tracejudge eval`,
`tracejudge calibrate`) and the human-labels reader (`tracejudge.schemas.formats.labels`).

`open_input`: a name ending in `.gz` is decompressed; a UTF-8 byte-order mark at the start is skipped
(Windows tools write one). What can be told from the first bytes and can never be JSON Lines is
refused up front, naming the likely cause: gzip (or zip, bzip2, xz, zstd, Parquet) under another
name, UTF-16 or UTF-32 with or without a byte-order mark. Lines are read with a cap (`read_lines`): a
line longer than the stream's `stream.max_record_bytes` is never held whole, it comes out as
`Oversized` and is rejected as the stream dead-letters it. `diagnose_unreadable` names the likely
cause of a file none of whose lines is a record (pretty-printed JSON, CSV, UTF-16...). Failures are
`InputError` (`schemas/errors.py`). Writing outputs is `tracejudge.consumer.commands.outputs`.
"""

from __future__ import annotations

import gzip
import shlex
import sys
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import BinaryIO, Final

from tracejudge.schemas.errors import InputError

__all__ = ["GZIP_MAGIC", "OVERSIZED_HEAD_BYTES", "UTF8_BOM", "InputError", "Oversized", "diagnose_unreadable",
           "open_input", "open_inputs", "read_lines"]

UTF8_BOM: Final = b"\xef\xbb\xbf"
GZIP_MAGIC: Final = b"\x1f\x8b"
# Containers that are never JSON Lines, by their first bytes: what the user has, and what to do.
_MAGIC: Final = (
    (b"\x1f\x8b", "gzip-compressed"),
    (b"PK\x03\x04", "a zip archive"),
    (b"BZh", "bzip2-compressed"),
    (b"\xfd7zXZ\x00", "xz-compressed"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
    (b"PAR1", "a Parquet file"),
)
_BOMS: Final = (
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian byte-order mark FF FE 00 00)", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian byte-order mark 00 00 FE FF)", "UTF-32"),
    (b"\xff\xfe", "UTF-16 (little-endian byte-order mark FF FE)", "UTF-16"),
    (b"\xfe\xff", "UTF-16 (big-endian byte-order mark FE FF)", "UTF-16"),
)
# The head of a rejected line kept for the rejects file when the line is too large to keep whole.
OVERSIZED_HEAD_BYTES: Final = 1024
_CHUNK: Final = 1 << 20


def open_inputs(stack: ExitStack, names: list[str]) -> list[tuple[str, BinaryIO]]:
    """(name as shown, stream) of every input, all opened and checked up front, so an unreadable one
    fails the run before any output is written."""
    return [("<stdin>" if name == "-" else name, open_input(stack, name)) for name in names]


def open_input(stack: ExitStack, name: str) -> BinaryIO:
    """`name` opened for reading ('-': stdin), decompressed when it ends in `.gz`, past a UTF-8
    byte-order mark; raises `InputError` naming the cause when it cannot be JSON Lines."""
    if name == "-":
        stream: BinaryIO = sys.stdin.buffer
        shown = "<stdin>"
    else:
        try:
            stream = stack.enter_context(open(name, "rb"))  # noqa: SIM115 - the ExitStack closes it
        except OSError as exc:
            raise InputError(f"cannot read {name}: {exc.strerror or exc}") from exc
        shown = name
    if name.lower().endswith(".gz"):
        head = _head(stream, shown)
        if head and not head.startswith(GZIP_MAGIC):
            raise InputError(f"{shown}: its name ends in .gz but it is not gzip-compressed "
                             f"(it starts with {head[:4].hex(' ').upper()}); rename it without .gz")
        if head:
            stream = stack.enter_context(gzip.GzipFile(fileobj=stream, mode="rb"))  # type: ignore[arg-type]
    _check_head(stream, shown, compressed=name.lower().endswith(".gz"))
    return stream


def _head(stream: BinaryIO, name: str) -> bytes:
    try:
        return stream.peek(8)[:8]  # type: ignore[attr-defined]
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(f"cannot read {name}: {_reason(exc)}") from exc


def _check_head(stream: BinaryIO, name: str, *, compressed: bool) -> None:
    head = _head(stream, name)
    if head.startswith(UTF8_BOM):
        stream.read(len(UTF8_BOM))
        return
    for bom, what, encoding in _BOMS:
        if head.startswith(bom):
            raise InputError(f"{name} is {what}; tracejudge reads UTF-8 JSON Lines: convert it with "
                             f"iconv -f {encoding} -t UTF-8")
    for magic, what in _MAGIC:
        if head.startswith(magic):
            if magic == GZIP_MAGIC and name == "<stdin>":
                raise InputError("<stdin> is gzip-compressed: pipe it through gunzip -c first, or pass the "
                                 "file itself, named .gz")
            if magic == GZIP_MAGIC and not compressed:
                raise InputError(f"{name} is gzip-compressed but its name does not end in .gz: name it "
                                 f"{name}.gz, or decompress it (gunzip -c {name} | tracejudge eval -)")
            raise InputError(f"{name} is {what}, not JSON Lines: extract the JSON Lines file from it")
    if b"\x00" in head[:4]:
        # JSON never holds a raw NUL byte; ASCII text in UTF-16 without a byte-order mark has one in
        # every other byte.
        raise InputError(f"{name} has NUL bytes at its start: it looks like UTF-16 or UTF-32 text without a "
                         "byte-order mark; tracejudge reads UTF-8 JSON Lines: convert it with "
                         "iconv -f UTF-16LE -t UTF-8 (or UTF-16BE)")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return "the gzip stream is truncated (it ends before its end marker)"
    if isinstance(exc, gzip.BadGzipFile | zlib.error):
        return f"corrupt gzip data ({exc})"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


@dataclass(frozen=True, slots=True)
class Oversized:
    """A line longer than the record size limit: its size and its first bytes, never the whole of it."""

    size: int
    head: bytes


def read_lines(stream: BinaryIO, name: str, max_bytes: int) -> Iterator[tuple[int, bytes | Oversized]]:
    """(line number, line without surrounding whitespace) of every non-blank line, or `Oversized` for
    a line of more than `max_bytes` (not counting its line end), read in chunks and dropped.
    A read failure (a truncated gzip file, an I/O error) raises `InputError` naming the line."""
    lineno = 0
    try:
        while True:
            raw = stream.readline(max_bytes + 2)
            if not raw:
                return
            lineno += 1
            body = raw.rstrip(b"\r\n")
            if len(body) > max_bytes:
                yield lineno, _skip_rest(stream, raw)
                continue
            line = body.strip()
            if line:
                yield lineno, line
    except (OSError, EOFError, zlib.error) as exc:
        raise InputError(f"cannot read {name} after line {lineno}: {_reason(exc)}") from exc


def _skip_rest(stream: BinaryIO, raw: bytes) -> Oversized:
    size = len(raw.rstrip(b"\r\n"))
    tail = raw
    while not tail.endswith(b"\n"):
        tail = stream.readline(_CHUNK)
        if not tail:
            break
        size += len(tail.rstrip(b"\r\n"))
    return Oversized(size, raw[:OVERSIZED_HEAD_BYTES])


def diagnose_unreadable(name: str, first_line: bytes, first_reason: str, first_message: str) -> str:
    """The likely cause of a file none of whose lines is a record, from its first line and why that
    line was rejected, with the command that converts it."""
    head = first_line.lstrip()
    name = "FILE" if name == "<stdin>" else shlex.quote(name)
    if first_line in (b"{", b"[", b"[{") or (head[:1] in (b"{", b"[") and "ends before" in first_message):
        return ("it looks like pretty-printed JSON (one value spread over many lines); tracejudge reads "
                f"JSON Lines, one record per line: convert it with jq -c . {name} (a top-level array: "
                f"jq -c '.[]' {name})")
    if head[:1] == b"[" and "got an array" in first_message:
        return ("it is a JSON array on one line; tracejudge reads JSON Lines, one record per line: "
                f"convert it with jq -c '.[]' {name}")
    if "byte-order mark" in first_message:
        return "its lines start with a UTF-8 byte-order mark (files concatenated with their marks?)"
    if b"\x00" in first_line:
        return "its lines hold NUL bytes: it looks like UTF-16 text; convert it with iconv -t UTF-8"
    if first_reason == "invalid_json" and head[:1] not in (b"{", b"[") and (b"," in head or b"\t" in head):
        return ("it looks like CSV or TSV (comma- or tab-separated text, not JSON); tracejudge reads JSON "
                "Lines, one JSON object per line")
    return f"the first line was rejected as {first_reason}: {first_message}"
