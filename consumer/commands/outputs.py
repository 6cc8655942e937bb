"""The outputs of the offline commands (`tracejudge eval`, `tracejudge calibrate`): written without ever
destroying one. (Their inputs are opened by `tracejudge.schemas.formats.input_files`.)

`refuse_overwriting_inputs`: an output that is, or resolves to, an input (through a symlink, a hard
link, `..`, or a shell redirection of stdout) is refused before anything is opened, since opening it
for writing would truncate the input. `AtomicOutput`: an output file is written to a temporary file
beside its target and renamed over it only by `commit()`, at the end of a successful run: a failed or
interrupted run leaves the previous file as it was. `StdoutOutput` is standard output as such an
output. Write failures become `OutputError` (exit status 3, `consumer/runtime/exit_status.py`);
`silence_stdout` keeps a closed pipe from printing a traceback on the way out.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile

from tracejudge.schemas.errors import InputError, OutputError

__all__ = ["AtomicOutput", "OutputError", "StdoutOutput", "refuse_overwriting_inputs", "silence_stdout",
           "write_text"]


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


def write_text(out: str, text: str) -> None:
    """Write one whole text (UTF-8) to `out`, "-" for standard output. A file is replaced only once all
    of it is written (`AtomicOutput`), so a failure (`OutputError`) leaves the previous one as it was."""
    target = StdoutOutput() if out == "-" else AtomicOutput(out)
    try:
        target.write(text.encode("utf-8"))
        target.commit()
    finally:
        target.discard()


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
