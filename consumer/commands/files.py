"""The files of the offline commands (`tracejudge eval`, `tracejudge calibrate`): reading inputs as users
have them, and writing outputs without ever destroying one.

Inputs (`open_input`): a name ending in `.gz` is decompressed; a UTF-8 byte-order mark at the start
is skipped (Windows tools write one). What can be told from the first bytes and can never be JSON
Lines is refused up front, naming the likely cause: gzip (or zip, bzip2, xz, zstd, Parquet) under
another name, UTF-16 or UTF-32 with or without a byte-order mark. Lines are read with a cap
(`read_lines`): a line longer than the stream's `stream.max_record_bytes` is never held whole, it
comes out as `Oversized` and is rejected as the stream dead-letters it.

Outputs (`refuse_overwriting_inputs`, `AtomicOutput`): an output that is, or resolves to, an input
(through a symlink, a hard link, `..`, or a shell redirection of stdout) is refused before anything
is opened, since opening it for writing would truncate the input. An output file is written to a
temporary file beside its target and renamed over it only by `commit()`, at the end of a successful
run: a failed or interrupted run leaves the previous file as it was. Write failures become
`OutputError` (exit status 3, `consumer/runtime/exit_status.py`).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shlex
import stat
import sys
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import BinaryIO, Final

__all__ = ["AtomicOutput", "InputError", "OutputError", "Oversized", "StdoutOutput", "diagnose_unreadable",
           "open_input", "open_inputs", "read_lines", "refuse_overwriting_inputs", "silence_stdout"]

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


class InputError(Exception):
    """An input that cannot be read at all, or an invalid option: exit status 2."""


class OutputError(Exception):
    """An output that cannot be written (disk full, permission denied, a closed pipe): exit status 3."""

    def __init__(self, name: str, exc: OSError) -> None:
        self.name = name
        self.broken_pipe = isinstance(exc, BrokenPipeError)
        super().__init__(f"cannot write {name}: {exc.strerror or exc}")


# ------------------------------------------------------------------------------------------- inputs


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


# ------------------------------------------------------------------------------------------ outputs


def silence_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null, so the interpreter's last flush of what is still
    buffered does not print "Exception ignored ... BrokenPipeError" on the way out."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def refuse_overwriting_inputs(outputs: dict[str, str | None], inputs: list[str]) -> None:
    """Raise `InputError` when an output (flag -> path; '-' is stdout) is, or resolves to, one of the
    `inputs` ('-' is stdin) or another output. Only paths are compared and files stat'ed: nothing is
    opened, so a refused run leaves every file as it was."""
    seen: list[tuple[str, tuple[str, tuple[int, int] | None]]] = [
        (f"input {'<stdin>' if name == '-' else name}", _identity(name, fd=0)) for name in inputs]
    for flag, path in outputs.items():
        if path is None:
            continue
        ident = _identity(path, fd=1)
        if path == "-" and ident[1] is None:
            continue  # stdout is a terminal or a pipe: nothing to destroy
        for what, other in seen:
            if _same(ident, other):
                shown = "stdout" if path == "-" else path
                raise InputError(f"{flag} {shown} is {what}: writing it would destroy it; choose another "
                                 "output file")
        seen.append((f"the output of {flag}", ident))


def _identity(path: str, *, fd: int) -> tuple[str, tuple[int, int] | None]:
    """(resolved path, (device, inode)) of a path, or of stdin/stdout ('-') when it is a regular file."""
    if path == "-":
        try:
            st = os.fstat(fd)
        except OSError:
            return ("-", None)
        return ("-", (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None)
    try:
        st = os.stat(path)
    except OSError:
        return (os.path.realpath(path), None)
    return (os.path.realpath(path), (st.st_dev, st.st_ino))


def _same(a: tuple[str, tuple[int, int] | None], b: tuple[str, tuple[int, int] | None]) -> bool:
    if a[1] is not None and a[1] == b[1]:
        return True
    return a[0] != "-" and a[0] == b[0]


class StdoutOutput:
    """Standard output as an output: write failures (a closed pipe, a full disk behind `>`) become
    `OutputError`; there is nothing to commit or to discard."""

    name = "<stdout>"

    def __init__(self) -> None:
        self.file = sys.stdout.buffer

    def write(self, data: bytes) -> None:
        try:
            self.file.write(data)
        except OSError as exc:
            raise OutputError(self.name, exc) from None

    def commit(self) -> None:
        try:
            self.file.flush()
        except OSError as exc:
            raise OutputError(self.name, exc) from None

    def discard(self) -> None:
        return None


class AtomicOutput:
    """An output file written to a temporary file beside its target (same directory, so the rename is
    atomic) and renamed over the target by `commit()`; `discard()` (also on leaving a `with` without
    a commit) removes the temporary file and leaves the target as it was.

    A symlink is written through (its target is replaced, the link kept). A target that exists and is
    not a regular file (`/dev/null`, `/dev/full`, a FIFO) is written directly: it cannot be renamed
    over and holds nothing to protect."""

    def __init__(self, path: str) -> None:
        self.name = path
        self.target = os.path.realpath(path)
        self.tmp: str | None = None
        try:
            st: os.stat_result | None = os.stat(path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise OutputError(path, exc) from None
        try:
            if st is not None and not stat.S_ISREG(st.st_mode):
                # By its own name: /dev/stdout resolves to a pipe's pseudo-path, not a file to open.
                self.file = open(path, "wb")  # noqa: SIM115 - closed by commit/discard
                self.mode: int | None = None
                return
            directory, base = os.path.split(self.target)
            fd, self.tmp = tempfile.mkstemp(dir=directory, prefix=f".{base}.", suffix=".tmp")
        except OSError as exc:
            raise OutputError(path, exc) from None
        self.file = os.fdopen(fd, "wb")
        # The permissions a plain `open(path, "w")` would give: the target's own, else per the umask.
        self.mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_umask()

    def write(self, data: bytes) -> None:
        try:
            self.file.write(data)
        except OSError as exc:
            raise OutputError(self.name, exc) from None

    def commit(self) -> None:
        """Flush, sync and rename into place; on failure the temporary file is removed and the target
        left as it was (`OutputError`)."""
        try:
            self.file.flush()
            if self.tmp is not None:
                os.fsync(self.file.fileno())
            self.file.close()
            if self.tmp is not None:
                os.chmod(self.tmp, self.mode or 0o644)
                os.replace(self.tmp, self.target)
                self.tmp = None
        except OSError as exc:
            self.discard()
            raise OutputError(self.name, exc) from None

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        if self.tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
            self.tmp = None

    def __enter__(self) -> AtomicOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (`os.umask` sets it, which
    another thread creating a file at that instant would see)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
