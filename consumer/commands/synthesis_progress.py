"""The progress file of `tracejudge dataset synthesize`: what makes a run resumable.

`OUT.progress` (beside the output) is JSON Lines: a header naming the settings that shape the rows (a
fingerprint of the seed, the number of questions, the check, the filters' thresholds, the chunk size and
each step's judge version: prompts, schema, model, temperature), then one line per finished chunk: its
key, its rows, what was dropped and what its calls used. A line is appended, flushed and synced when a
chunk is finished, so an interrupted run (Ctrl-C, a kill) loses at most the chunk in progress; a torn
last line is cut off when the file is opened again. A run with other settings refuses the file (exit 2)
unless `--restart` discards it: rows made under other settings must not be mixed in. The file is removed
once the output is complete.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import IO, Any

import orjson

from tracejudge.metrics.judges.base import fingerprint
from tracejudge.schemas.errors import InputError, OutputError

__all__ = ["PROGRESS_VERSION", "Progress", "settings_fingerprint"]

PROGRESS_VERSION = 1


def settings_fingerprint(settings: dict[str, Any]) -> str:
    return fingerprint({"progress": PROGRESS_VERSION, **settings})


@dataclass
class Progress:
    """The finished chunks by key, and the open file new ones are appended to."""

    path: str
    fingerprint: str
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    _file: IO[bytes] | None = None

    @classmethod
    def open(cls, path: str, fp: str, *, restart: bool) -> Progress:
        """The progress so far (none with `restart`, or when there is no file); `InputError` when the
        file was written with other settings or is not a progress file."""
        progress = cls(path, fp)
        if restart:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            raise InputError(f"{path}: cannot read the progress file ({exc.strerror})") from None
        keep = progress._load(data)
        try:
            if keep != len(data):
                with open(path, "r+b") as f:  # a torn last line (killed while writing it)
                    f.truncate(keep)
            progress._file = open(path, "ab")  # noqa: SIM115 - closed by close()
            if keep == 0:
                progress._append({"synthesize_progress": PROGRESS_VERSION, "fingerprint": fp})
        except OSError as exc:
            raise OutputError(path, exc) from None
        return progress

    def _load(self, data: bytes) -> int:
        """Read the finished chunks; the number of bytes of whole, valid lines."""
        if not data:
            return 0
        lines = data.split(b"\n")
        try:
            head = orjson.loads(lines[0])
        except orjson.JSONDecodeError:
            head = None
        if not isinstance(head, dict) or head.get("synthesize_progress") != PROGRESS_VERSION:
            if len(lines) == 1:  # the header itself was torn: nothing was done
                return 0
            raise InputError(f"{self.path}: not a progress file of this version; remove it or give --restart")
        if head.get("fingerprint") != self.fingerprint:
            raise InputError(f"{self.path} was written with other settings (seed, questions, check, "
                             "thresholds, chunk size, model or prompts): give the same settings to resume, "
                             "or --restart to discard it")
        keep = len(lines[0]) + 1
        for line in lines[1:]:
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                break
            if not isinstance(entry, dict) or not isinstance(entry.get("chunk"), str):
                break
            self.done[entry["chunk"]] = entry
            keep += len(line) + 1
        return min(keep, len(data))

    def _append(self, obj: dict[str, Any]) -> None:
        assert self._file is not None
        try:
            self._file.write(orjson.dumps(obj) + b"\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise OutputError(self.path, exc) from None

    def add(self, key: str, rows: list[dict[str, Any]], dropped: dict[str, int],
            used: dict[str, Any]) -> None:
        entry = {"chunk": key, "rows": rows, "dropped": dropped, "used": used}
        self._append(entry)
        self.done[key] = entry

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def remove(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
