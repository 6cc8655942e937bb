"""`tracejudge eval`: the pipeline over JSON Lines files, one result line per record.

A malformed line never stops the run: it is reported with its file and line number, counted, and
written to `--rejects` when given, so a million-line file with three bad lines still yields
999,997 results and a list of exactly what to fix.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from array import array
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO

import orjson

from tracejudge.consumer.pipeline import Pipeline
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.result import EvaluationResult, SourceRef

PROGRESS_EVERY_SECONDS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="JSON Lines files ('-' for stdin); each line may be any supported format")
    parser.add_argument("-o", "--output", default="-",
                        help="where to write one result per line (default: stdout)")
    parser.add_argument("--rejects", metavar="FILE",
                        help="write malformed lines here, each with its source line number and the reason")
    parser.add_argument("--format", default="auto",
                        choices=["auto", "agent_eval", "mlflow", "inference_log"],
                        help="the format of every line (default: detected per line)")
    parser.add_argument("--config", type=Path, help="the same YAML file `tracejudge run` reads")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress or summary on stderr")


@dataclass
class Summary:
    records: int = 0
    rejected: int = 0
    failed: int = 0
    latencies: array = field(default_factory=lambda: array("d"))
    tokens: dict[str, int] = field(default_factory=lambda: {"input": 0, "output": 0, "total": 0})
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_counts: dict[str, int] = field(default_factory=dict)
    metric_errors: dict[str, int] = field(default_factory=dict)

    def add(self, result: EvaluationResult) -> None:
        rec = result.record
        self.records += 1
        if rec.failed:
            self.failed += 1
        if rec.latency_seconds is not None:
            self.latencies.append(rec.latency_seconds)
        if rec.tokens is not None:
            for direction in ("input", "output", "total"):
                n = getattr(rec.tokens, direction)
                if n is not None:
                    self.tokens[direction] += n
        for name, value in result.metrics.items():
            if value is not None:
                self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value
                self.metric_counts[name] = self.metric_counts.get(name, 0) + 1
        for name in result.metric_errors:
            self.metric_errors[name] = self.metric_errors.get(name, 0) + 1

    def render(self) -> str:
        lat = sorted(self.latencies)
        rows = [
            ("records", str(self.records)),
            ("rejected lines", str(self.rejected)),
            ("failed traces", f"{self.failed} ({_pct(self.failed, self.records)})"),
            ("latency p50", _seconds(_quantile(lat, 0.50))),
            ("latency p95", _seconds(_quantile(lat, 0.95))),
            ("tokens in / out / total", " / ".join(str(self.tokens[d]) for d in self.tokens)),
        ]
        for name in sorted(self.metric_counts):
            errs = self.metric_errors.get(name, 0)
            mean = self.metric_sums[name] / self.metric_counts[name]
            note = f"  (n={self.metric_counts[name]}" + (f", {errs} errors)" if errs else ")")
            rows.append((f"mean {name}", f"{mean:.4g}{note}"))
        for name in sorted(set(self.metric_errors) - set(self.metric_counts)):
            rows.append((f"mean {name}", f"-  ({self.metric_errors[name]} errors)"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    # Nearest-rank: the value below which a share q of observations fall; no interpolation to explain.
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[idx]


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def _pct(n: int, d: int) -> str:
    return "-" if d == 0 else f"{100.0 * n / d:.1f}%"


def _lines(name: str, stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
    for lineno, raw in enumerate(stream, start=1):
        line = raw.strip()
        if line:
            yield lineno, line


def _open_inputs(stack: ExitStack, names: list[str]) -> list[tuple[str, BinaryIO]]:
    """Opens every input up front, so an unreadable one fails the run before any output is written."""
    opened = []
    for name in names:
        if name == "-":
            opened.append(("<stdin>", sys.stdin.buffer))
            continue
        try:
            opened.append((name, stack.enter_context(open(name, "rb"))))  # noqa: SIM115 - ExitStack closes
        except OSError as exc:
            raise InputError(f"cannot read {name}: {exc.strerror or exc}") from exc
    return opened


class InputError(Exception):
    pass


def evaluate_lines(
    pipeline: Pipeline,
    inputs: list[tuple[str, BinaryIO]],
    out: IO[bytes],
    rejects: IO[bytes] | None,
    fmt: str | None,
    summary: Summary,
    err: IO[str] | None,
) -> None:
    last_progress = started = time.monotonic()
    for name, stream in inputs:
        for lineno, line in _lines(name, stream):
            try:
                record = pipeline.normalise(line, fmt)
            except RecordError as exc:
                summary.rejected += 1
                if err is not None:
                    print(f"{name}:{lineno}: rejected ({exc.reason}): {exc.message}", file=err)
                if rejects is not None:
                    rejects.write(orjson.dumps({
                        "file": name, "line": lineno, "reason": exc.reason, "error": exc.message,
                        "record": line.decode("utf-8", "replace"),
                    }) + b"\n")
                continue
            result = pipeline.evaluate(record, SourceRef(format=record.source_format, file=name, line=lineno))
            out.write(result.to_json() + b"\n")
            summary.add(result)
            now = time.monotonic()
            if err is not None and now - last_progress >= PROGRESS_EVERY_SECONDS:
                last_progress = now
                rate = summary.records / (now - started)
                print(f"... {summary.records} records, {summary.rejected} rejected ({rate:.0f}/s)", file=err)


def main(args: argparse.Namespace) -> int:
    err = None if args.quiet else sys.stderr
    fmt = None if args.format == "auto" else args.format
    pipeline = Pipeline()
    summary = Summary()
    with ExitStack() as stack:
        try:
            inputs = _open_inputs(stack, args.inputs)
            out = sys.stdout.buffer if args.output == "-" else stack.enter_context(open(args.output, "wb"))
            rejects = stack.enter_context(open(args.rejects, "wb")) if args.rejects else None
        except InputError as exc:
            print(f"tracejudge eval: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"tracejudge eval: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
            return 2
        evaluate_lines(pipeline, inputs, out, rejects, fmt, summary, err)
    if err is not None:
        print("tracejudge eval summary", file=err)
        print(summary.render(), file=err)
    return 0
