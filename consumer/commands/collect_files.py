"""`tracejudge eval --config` with `collections:`: each rule with a `file` gets the rows of the traces it
collects (`consumer/collecting.py`, the same rules, sample, dedupe and cap as `tracejudge run`).

A collection file is an output of the run, like `-o`: written whole to a temporary file beside it and
renamed over it when the run succeeds (`AtomicOutput`); a failed run leaves the previous file as it
was, and a file that is one of the inputs is refused before anything is opened. So re-running eval on
the same inputs gives the same file, never a growing one; to grow a regression set across runs, keep
one file per run (or `tracejudge run`'s appended file) and merge them with `tracejudge dataset
merge-labels`. Rules with only a `topic` publish from `tracejudge run`; eval says so and skips them.

A rule with a `finding:` condition needs the run's findings, known only at the end of the input: the
results its other conditions (and the finding's verdict) match are spooled to a temporary file (memory
stays bounded), and `finish` computes the findings (`FindingsWindow.analyse`, the summary's "what the
failures have in common") and offers the spooled results to those rules. Their rows come after the
other rules' rows in a shared file.
"""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from typing import IO

import orjson
from prometheus_client import CollectorRegistry

from tracejudge.consumer.collecting import ASSUMED, Collected, Collector, FindingIndex, matches, uses_findings
from tracejudge.consumer.commands.outputs import AtomicOutput
from tracejudge.consumer.config import Settings
from tracejudge.metrics.findings import FindingsWindow
from tracejudge.schemas.result import EvaluationResult

__all__ = ["CollectionFiles", "collection_outputs", "topic_only"]


def collection_outputs(settings: Settings) -> dict[str, str | None]:
    """The collection files as outputs (flag-like name -> path), for `refuse_overwriting_inputs`; one
    entry per distinct file (two rules may share one)."""
    out: dict[str, str | None] = {}
    for i, rule in enumerate(settings.collections):
        if rule.file and rule.file not in out.values():
            out[f"collections[{i}].file"] = rule.file
    return out


class CollectionFiles:
    """The collection files of one `tracejudge eval` run and the collector that fills them."""

    def __init__(self, collector: Collector, files: dict[str, AtomicOutput],
                 registry: CollectorRegistry) -> None:
        self.collector = collector
        self.files = files
        self.registry = registry
        # The rules with a `finding:` condition, applied by `finish`, and the results spooled for them.
        self.later = [r for r in collector.rules if uses_findings(r)]
        self.now = [r for r in collector.rules if not uses_findings(r)]
        self.spool: IO[bytes] | None = None
        self.spooled = 0
        self.findings: int | None = None

    @classmethod
    def open(cls, stack: ExitStack, settings: Settings) -> CollectionFiles | None:
        """None without a rule that has a file. Raises `OutputError` when a file cannot be created."""
        rules = [r for r in settings.collections if r.file]
        if not rules:
            return None
        registry = CollectorRegistry(auto_describe=True)
        collector = Collector.build(rules, registry)
        assert collector is not None
        files: dict[str, AtomicOutput] = {}
        for rule in rules:
            assert rule.file is not None
            if rule.file not in files:
                files[rule.file] = stack.enter_context(AtomicOutput(rule.file))
        out = cls(collector, files, registry)
        if out.later:
            out.spool = stack.enter_context(tempfile.TemporaryFile(prefix="tracejudge-collect-"))  # noqa: SIM115
        return out

    def add(self, result: EvaluationResult) -> None:
        """Write the rows of `result` its rules collect (`OutputError` when a file cannot be written);
        spool it when a `finding:` rule may collect it once the findings are known."""
        self._write(self.collector.offer(result, self.now))
        if self.spool is not None and any(matches(r, result, ASSUMED) for r in self.later):
            self.spool.write(result.to_json() + b"\n")
            self.spooled += 1

    def finish(self, window: FindingsWindow | None) -> None:
        """Apply the `finding:` rules to the spooled results, against the findings of `window` (the
        run's; None: none, and each spooled trace is counted as dropped, `no_findings`)."""
        if self.spool is None:
            return
        if window is not None:
            found = window.analyse()
            self.collector.findings = FindingIndex.of(found)
            self.findings = len(found)
        self.spool.seek(0)
        for line in self.spool:
            self._write(self.collector.offer(EvaluationResult.from_dict(orjson.loads(line)), self.later))
        self.spool.close()
        self.spool = None

    def _write(self, items: list[Collected]) -> None:
        for item in items:
            assert item.rule.file is not None
            self.files[item.rule.file].write(item.line + b"\n")
            self.collector.written(item)

    def commit(self) -> None:
        for f in self.files.values():
            f.commit()

    def count(self, name: str, reason: str | None = None) -> int:
        """Rows collected by rule `name` (or its traces dropped for `reason`) in this run."""
        if reason is None:
            value = self.registry.get_sample_value("tracejudge_collected_total", {"collection": name})
        else:
            value = self.registry.get_sample_value("tracejudge_collection_dropped_total",
                                                   {"collection": name, "reason": reason})
        return int(value or 0)

    def render(self) -> str:
        """One line per rule: rows collected, and the traces it matched but left out, by reason."""
        lines = []
        for rule in self.collector.rules:
            dropped = {reason: self.count(rule.name, reason)
                       for reason in ("sampled_out", "duplicate", "cap", "no_request", "no_findings")}
            left = ", ".join(f"{n} {reason}" for reason, n in dropped.items() if n) or "none left out"
            if rule in self.later and self.findings is not None:
                left += f"; against {self.findings} findings"
            lines.append(f"  collection {rule.name}: {self.count(rule.name)} rows -> {rule.file} ({left})")
        return "\n".join(lines)


def topic_only(settings: Settings) -> list[str]:
    """The rules `tracejudge eval` cannot serve (a topic and no file)."""
    return [r.name for r in settings.collections if r.topic and not r.file]
