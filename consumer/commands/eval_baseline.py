"""`tracejudge eval --fail-if-worse-than BASELINE.jsonl [--worse-margin M]`: the release gate.

The baseline is the results file of an earlier `tracejudge eval` over the same dataset (the previous
release's run, kept as a CI artifact or committed). Each result of this run is paired with the
baseline's result for the same request (`tracejudge.metrics.compare`), and for every judge and
pass/fail metric the command prints the pass rate then and now over the paired rows, the difference
with its 95% interval (Newcombe's interval for paired proportions), and a verdict. It fails (exit 1)
when a difference is significantly negative: the interval's upper bound is below 0, or below
`-M` with `--worse-margin M` (a drop the team accepts). A few flipped rows on a small dataset are
within the interval and do not fail it.

The baseline is read before anything runs: a line that is not a result line is an error naming the
file and line (exit 2), as is a baseline with no result; one whose requests none of this run's rows
share (no overlap, so nothing to compare) is exit 2 after the run.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from typing import IO

import msgspec
import orjson

from tracejudge.consumer.runtime import exit_status
from tracejudge.metrics.compare import Difference, PairedRuns, RowKeys, evidence, outcomes
from tracejudge.schemas.formats.input_files import InputError, Oversized, open_input, read_lines
from tracejudge.schemas.result import EvaluationResult

__all__ = ["BaselineGate", "add_arguments", "read_baseline"]

# A results line holds its record: allow lines well over the input limit.
BASELINE_LINE_FACTOR = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "comparing with a baseline run",
        "per judge and pass/fail metric: pass rate then and now over the same requests, the difference "
        "with its 95% interval (https://tracejudge.github.io/tracejudge/guides/gate-a-release/)")
    group.add_argument("--fail-if-worse-than", metavar="BASELINE",
                       help="a results file of an earlier run over the same dataset: exit 1 when a judge's "
                            "or metric's pass rate is significantly lower now")
    group.add_argument("--worse-margin", type=_margin, default=0.0, metavar="M",
                       help="fail only when the drop is significantly more than M (a proportion, e.g. 0.05 "
                            "for 5 points; default 0)")


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a proportion from 0 to 1 (0.05 for 5 points), "
                                         f"got {text!r}")
    return value


def read_baseline(path: str, max_bytes: int) -> dict[tuple[str, int], dict[str, bool | None]]:
    """Each baseline result's outcomes by its pairing key; `InputError` naming the file and line of a
    line that is not a result line, or the file when it holds no result."""
    rows: dict[tuple[str, int], dict[str, bool | None]] = {}
    keys = RowKeys()
    results = 0
    limit = max_bytes * BASELINE_LINE_FACTOR
    with ExitStack() as stack:
        stream = open_input(stack, path)
        for lineno, line in read_lines(stream, path, limit):
            where = f"--fail-if-worse-than {path}:{lineno}"
            if isinstance(line, Oversized):
                raise InputError(f"{where}: {line.size} bytes, over {limit}; not a result line")
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise InputError(f"{where}: not JSON ({exc}); expected a tracejudge eval result "
                                 "line") from None
            if not isinstance(obj, dict):
                raise InputError(f"{where}: a JSON {type(obj).__name__}, not a result line")
            if obj.get("kind") == "session":
                continue
            try:
                result = EvaluationResult.from_dict(obj)
            except (ValueError, msgspec.ValidationError) as exc:
                raise InputError(f"{where}: not a tracejudge eval result line: {exc}") from None
            results += 1
            key = keys.next(result.record.request)
            if key is not None:
                rows[key] = outcomes(result)
    if results == 0:
        raise InputError(f"--fail-if-worse-than {path}: no result lines (expected the output of "
                         "tracejudge eval)")
    return rows


class BaselineGate:
    """The new run's outcomes, gathered result by result (`add`), then compared (`decide`)."""

    def __init__(self, path: str, baseline: dict[tuple[str, int], dict[str, bool | None]],
                 margin: float = 0.0) -> None:
        self.path = path
        self.runs = PairedRuns(baseline=baseline, new={})
        self.margin = margin
        self._keys = RowKeys()
        self.without_request = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace, max_bytes: int) -> BaselineGate | None:
        path = getattr(args, "fail_if_worse_than", None)
        margin = getattr(args, "worse_margin", 0.0)
        if path is None:
            if margin:
                raise InputError("--worse-margin applies to --fail-if-worse-than BASELINE; add it")
            return None
        return cls(path, read_baseline(path, max_bytes), margin)

    def add(self, result: EvaluationResult) -> None:
        key = self._keys.next(result.record.request)
        if key is None:
            self.without_request += 1
        else:
            self.runs.new[key] = outcomes(result)

    def decide(self, out: IO[str] | None = None) -> int:
        """Print the comparison on `out` (stderr); 1 when a name is significantly worse, 2 when the runs
        share no request or no verdict, else 0."""
        out = out or sys.stderr
        common = self.runs.common
        new, base = self.runs.new, self.runs.baseline
        if not common:
            print(f"tracejudge eval: --fail-if-worse-than {self.path}: no overlap: none of its {len(base)} "
                  f"results has a request of this run's {len(new)} (is it a run over the same dataset?)",
                  file=out)
            return exit_status.USAGE
        diffs = self.runs.differences(self.margin)
        compared = [d for d in diffs.values() if d is not None]
        margin = f", margin {self.margin:g}" if self.margin else ""
        print(f"tracejudge eval: against the baseline {self.path}: {len(common)} rows paired by request "
              f"({len(new) - len(common)} only in this run, {len(base) - len(common)} only in the baseline); "
              f"difference = this run - baseline, 95% interval (Newcombe, paired){margin}", file=out)
        print(_table(diffs, self.runs), file=out)
        if not compared:
            print("tracejudge eval: nothing to compare: no judge or pass/fail metric has a verdict on "
                  "the same rows in both runs", file=out)
            return exit_status.USAGE
        worse = [d for d in compared if d.worse]
        for d in worse:
            print(f"tracejudge eval: {d.name}: worse than the baseline: {_pct(d.difference)} "
                  f"[{_pct(d.low)}, {_pct(d.high)}] on {d.n} paired rows", file=out)
        if not worse:
            print(f"tracejudge eval: baseline gate passed: no judge or metric significantly worse "
                  f"({len(compared)} compared)", file=out)
        return exit_status.GATE_FAILED if worse else exit_status.OK


def _table(diffs: dict[str, Difference | None], runs: PairedRuns) -> str:
    head = ("judge / metric", "baseline (n)", "this run (n)", "difference [95% interval]", "verdict")
    rows = [head]
    for name, d in diffs.items():
        if d is None:
            note = (f"{evidence(runs.baseline, name)} in the baseline, {evidence(runs.new, name)} in "
                    "this run, none on the same rows")
            rows.append((name, "-", "-", note, "not compared"))
            continue
        rows.append((name, f"{d.baseline_passed / d.n:.1%} ({d.baseline_passed}/{d.n})",
                     f"{d.new_passed / d.n:.1%} ({d.new_passed}/{d.n})",
                     f"{_pct(d.difference)} [{_pct(d.low)}, {_pct(d.high)}]", d.verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
                     for r in rows)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"
