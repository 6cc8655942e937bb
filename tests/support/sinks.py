"""A sink for tests, and the real `tracejudge sink` as a process.

`RecordingSink` implements `tracejudge.consumer.sinks.base.Sink` the way a real sink must: its
writes are idempotent. Each verdict (trace, judge, judge version) is a file in `directory`, created
only if absent (`written`), else counted `already_written`; every record a write is offered is
appended to `attempts.log` ("partition offset" per line), so a test can tell at-least-once delivery
(every offset attempted) from exactly-once effects (one file per verdict). In-process tests can also
hold a partition (`refuse`: the sink raises `RetryLater` for it) or slow writes down (`delay_s`).

In a `tracejudge sink` process it is a plugin: `sink.plugins: {recording: "support.sinks:RecordingSink"}`
with `tests/` on PYTHONPATH, and its section `sink.recording: {directory: ..., delay_s: ...}`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from support.kafka import RunnerProcess
from tracejudge.consumer.sinks.base import RetryLater, Sink, SinkBatch, WriteReport

TESTS = Path(__file__).resolve().parent.parent


def verdict_key(result: Mapping[str, Any], assessment: Mapping[str, Any]) -> str:
    """What makes a verdict one: the trace, the judge, the judge's version."""
    judge = assessment.get("judge") or {}
    ident = "\x1f".join([str(result.get("trace_id") or result.get("request_id")), str(assessment["name"]),
                         str(judge.get("version") if isinstance(judge, dict) else "")])
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


class RecordingSink(Sink):
    kind = "recording"

    def __init__(self, settings: Mapping[str, Any] | None = None, registry: Any = None) -> None:
        settings = dict(settings or {})
        directory = settings.get("directory")
        self.directory = Path(directory) if directory else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.delay_s = float(settings.get("delay_s", 0))
        self._closing = threading.Event()
        self.fail_setup = bool(settings.get("fail_setup", False))
        self.lock = threading.Lock()
        # Every batch offered, and the batches written, in order (in-process tests read them).
        self.offered: list[SinkBatch] = []
        self.written: list[SinkBatch] = []
        # partition -> reason: write raises RetryLater(reason) for batches of that partition.
        self.refuse: dict[int, str] = {}
        self.retry_after_s = 0.05
        # Partitions whose batches make write raise a plain error (a bug in a sink).
        self.explode: set[int] = set()
        self.setup_calls = self.close_calls = 0

    def setup(self) -> None:
        self.setup_calls += 1
        if self.fail_setup:
            from tracejudge.consumer.config import ConfigError

            raise ConfigError([("sink.recording.fail_setup", "the backend refused the configuration")])

    def write(self, batch: SinkBatch) -> WriteReport:
        with self.lock:
            self.offered.append(batch)
            reason = self.refuse.get(batch.partition)
            explode = batch.partition in self.explode
        if reason is not None:
            raise RetryLater(reason, after_s=self.retry_after_s)
        if explode:
            raise RuntimeError(f"a bug writing partition {batch.partition}")
        if self.delay_s:
            # A slow backend, so a SIGKILL lands mid-stream; close() ends the wait.
            self._closing.wait(self.delay_s)
        report = WriteReport()
        if self.directory is not None:
            with open(self.directory / "attempts.log", "a") as attempts:
                attempts.write("".join(f"{r.partition} {r.offset}\n" for r in batch.records))
        for record in batch.records:
            for a in record.assessments():
                if a.get("skipped"):
                    report.skip("skipped_judge")
                    continue
                if self.directory is None:
                    report.written += 1
                    continue
                try:
                    fd = os.open(self.directory / verdict_key(record.result, a),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    report.already_written += 1
                    continue
                with os.fdopen(fd, "w") as out:
                    out.write(f"{record.partition} {record.offset} {a.get('value')}\n")
                report.written += 1
        with self.lock:
            self.written.append(batch)
        return report

    def close(self) -> None:
        self.close_calls += 1
        self._closing.set()

    # -- for assertions -------------------------------------------------------------------------

    def offsets(self) -> list[tuple[int, int]]:
        """(partition, offset) of every record written, in write order."""
        with self.lock:
            return [(r.partition, r.offset) for b in self.written for r in b.records]

    def offers(self, partition: int) -> int:
        with self.lock:
            return sum(1 for b in self.offered if b.partition == partition)


def attempted(directory: Path) -> list[tuple[int, int]]:
    path = directory / "attempts.log"
    if not path.exists():
        return []
    return [(int(p), int(o)) for p, o in (line.split() for line in path.read_text().splitlines() if line)]


def verdict_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name != "attempts.log"]


class SinkProcess(RunnerProcess):
    """`tracejudge sink KIND --config FILE` as a process (tests/ on PYTHONPATH for plugins); its log
    goes to a file for the assertions."""

    def __init__(self, bootstrap: str, kind: str, config: Mapping[str, Any], *args: str,
                 env: Mapping[str, str] | None = None) -> None:
        fd, name = tempfile.mkstemp(prefix="tracejudge-sink-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(dict(config), f)
        self.config_path = Path(name)
        pythonpath = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
        super().__init__(bootstrap, *args, env={"PYTHONPATH": pythonpath, **(env or {})},
                         command=("sink", kind, "--config", str(self.config_path)))
