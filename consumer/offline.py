"""`tracejudge eval`: the pipeline over JSON Lines files, one result line per record, then one session
result line per session.

A malformed line never stops the run: it is reported with its file and line number, counted, and
written to `--rejects` when given, so a million-line file with three bad lines still yields
999,997 results and a list of exactly what to fix.

It reads the same configuration file as `tracejudge run` (custom metrics, judges, app tag, OTLP
assembly limits), so the scores it writes are the scores the stream exports. OTLP/JSON lines
(`{"resourceSpans": ...}`) go through the same trace assembly as an OTLP topic: the spans of one trace
may be spread over many lines, and each trace is evaluated once it is whole (at the latest at the end
of the input).

Records that belong to a conversation (`session_id`) are also gathered into sessions
(`consumer/session_eval.py`): after the last trace result, one session result line per session
(`"kind": "session"`, closed by the end of the input) with the session metrics and, when `judges:`
is configured, the session judges' verdicts.
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
from typing import IO, Any, BinaryIO

import orjson

from tracejudge.consumer.assembly import OtlpLineAssembler
from tracejudge.consumer.config import ConfigError, Settings, load_settings
from tracejudge.consumer.pipeline import Pipeline, build_judges, build_pipeline, with_judgements
from tracejudge.consumer.session_eval import SessionEvaluation, SessionGrouper, build_session_judges
from tracejudge.schemas import otlp
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef
from tracejudge.schemas.session import SessionResult

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
    parser.add_argument("--config", type=Path,
                        help="the YAML file `tracejudge run` reads (metrics, judges, app tag, OTLP assembly)")
    parser.add_argument("--fail-under", action="append", default=[], metavar="JUDGE=THRESHOLD",
                        help="exit 1 when JUDGE's mean score is below THRESHOLD (repeatable)")
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
    judges: dict[str, JudgeTally] = field(default_factory=dict)
    sessions: SessionTally = field(default_factory=lambda: SessionTally())

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
        for a in result.assessments:
            self.judges.setdefault(a.name, JudgeTally()).add(a)

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
        for name, t in self.judges.items():
            mean = "-" if t.mean is None else f"{t.mean:.3f}"
            rows.append((f"judge {name}", f"mean score {mean}, passed {t.passed}/{t.verdicts} "
                                          f"({_pct(t.passed, t.verdicts)}), {t.errors} errors, "
                                          f"{t.skipped} skipped"))
        rows += self.sessions.rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


@dataclass
class SessionTally:
    """The sessions block of the summary: how many, how long, how many went wrong, and what the
    session judges said (for `user_frustration`, the share judged `unresolved`)."""

    sessions: int = 0
    turns: int = 0
    without_session: int = 0
    with_failure: int = 0
    last_turn_failed: int = 0
    judges: dict[str, JudgeTally] = field(default_factory=dict)
    values: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, session: SessionResult) -> None:
        self.sessions += 1
        self.turns += len(session.turns)
        self.with_failure += bool(session.metrics.get("failed_turns"))
        self.last_turn_failed += session.metrics.get("last_turn_failed") == 1.0
        for a in session.assessments:
            self.judges.setdefault(a.name, JudgeTally()).add(a)
            if a.error is None and a.skipped is None and isinstance(a.value, str):
                counts = self.values.setdefault(a.name, {})
                counts[a.value] = counts.get(a.value, 0) + 1

    def rows(self) -> list[tuple[str, str]]:
        if not self.sessions:
            return []
        rows = [
            ("sessions", f"{self.sessions} ({self.turns} turns; {self.without_session} "
                         f"record{'' if self.without_session == 1 else 's'} without a session id)"),
            ("  turns per session", f"{self.turns / self.sessions:.1f} mean"),
            ("  with a failed turn", f"{self.with_failure} ({_pct(self.with_failure, self.sessions)}), "
                                     f"last turn failed {self.last_turn_failed}"),
        ]
        for name, t in self.judges.items():
            judged = sum(self.values.get(name, {}).values())
            if name == FRUSTRATION:
                unresolved = self.values.get(name, {}).get("unresolved", 0)
                rows.append((f"  session judge {name}",
                             f"unresolved {_pct(unresolved, judged)} (n={judged}; "
                             + ", ".join(f"{v} {c}" for v, c in sorted(self.values.get(name, {}).items()))
                             + f"), {t.errors} errors, {t.skipped} skipped"))
                continue
            mean = "-" if t.mean is None else f"{t.mean:.3f}"
            rows.append((f"  session judge {name}", f"mean score {mean}, passed {t.passed}/{t.verdicts} "
                                                    f"({_pct(t.passed, t.verdicts)}), {t.errors} errors, "
                                                    f"{t.skipped} skipped"))
        return rows


FRUSTRATION = "user_frustration"


@dataclass
class JudgeTally:
    verdicts: int = 0
    passed: int = 0
    errors: int = 0
    skipped: int = 0
    scores: int = 0
    score_sum: float = 0.0

    def add(self, a: Assessment) -> None:
        if a.skipped is not None:
            self.skipped += 1
        elif a.error is not None:
            self.errors += 1
        if a.score is not None:
            self.scores += 1
            self.score_sum += a.score
        if a.passed is not None:
            self.verdicts += 1
            self.passed += a.passed

    @property
    def mean(self) -> float | None:
        return self.score_sum / self.scores if self.scores else None


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


def _lines(stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
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


class FileEvaluation:
    """Lines in, results out, in input order (an assembled OTLP trace comes out when it is whole)."""

    def __init__(self, pipeline: Pipeline, settings: Settings, fmt: str | None, summary: Summary,
                 rejects: IO[bytes] | None, err: IO[str] | None) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.fmt = fmt
        self.summary = summary
        self.rejects = rejects
        self.err = err

    def results(self, inputs: list[tuple[str, BinaryIO]]) -> Iterator[EvaluationResult]:
        for name, stream in inputs:
            # One assembler per file: a trace spread over two files is two partial traces, as it
            # would be over two topics.
            assembler: OtlpLineAssembler | None = None
            for lineno, line in _lines(stream):
                try:
                    if self.fmt is None and otlp.looks_like_otlp_json(line):
                        if assembler is None:
                            assembler = OtlpLineAssembler(self.settings.otlp.assembly.to_settings(),
                                                          app_tag=self.pipeline.app_tag,
                                                          session_tag=self.pipeline.session_tag)
                        for t in assembler.feed(line, lineno):
                            yield self._evaluate(t.record(), name, t.line)
                        continue
                    record = self.pipeline.normalise(line, self.fmt)
                except RecordError as exc:
                    self._reject(name, lineno, line, exc)
                    continue
                yield self._evaluate(record, name, lineno)
            if assembler is not None:
                for t in assembler.finish():
                    yield self._evaluate(t.record(), name, t.line)

    def _evaluate(self, record: Any, name: str, line: int) -> EvaluationResult:
        return self.pipeline.evaluate(record, SourceRef(format=record.source_format, file=name, line=line))

    def _reject(self, name: str, lineno: int, line: bytes, exc: RecordError) -> None:
        self.summary.rejected += 1
        if self.err is not None:
            print(f"{name}:{lineno}: rejected ({exc.reason}): {exc.message}", file=self.err)
        if self.rejects is not None:
            self.rejects.write(orjson.dumps({
                "file": name, "line": lineno, "reason": exc.reason, "error": exc.message,
                "record": line.decode("utf-8", "replace"),
            }) + b"\n")


def parse_fail_under(values: list[str], judge_names: list[str]) -> dict[str, float]:
    gates: dict[str, float] = {}
    for value in values:
        name, sep, threshold = value.partition("=")
        try:
            gates[name] = float(threshold)
        except ValueError:
            sep = ""
        if not sep or not 0.0 <= gates.get(name, -1.0) <= 1.0:
            raise InputError(f"--fail-under {value!r}: expected JUDGE=THRESHOLD with a threshold in [0, 1]")
        if name not in judge_names:
            configured = ", ".join(judge_names) or "none: add a judges: section to --config"
            raise InputError(f"--fail-under {value!r}: {name!r} is not a configured judge ({configured})")
    return gates


def main(args: argparse.Namespace) -> int:
    err = None if args.quiet else sys.stderr
    fmt = None if args.format == "auto" else args.format
    try:
        settings = load_settings(args.config, offline=True)
        pipeline = build_pipeline(settings)
        judges = build_judges(settings)
        session_judges = build_session_judges(settings)
    except ConfigError as exc:
        print(f"tracejudge eval: invalid configuration\n{exc.report()}", file=sys.stderr)
        return 2
    summary = Summary()
    with ExitStack() as stack:
        if judges is not None:
            stack.callback(judges.close)
        if session_judges is not None:
            stack.callback(session_judges.close)
        try:
            names = [*(judges.judge_names() if judges else []),
                     *(session_judges.judge_names() if session_judges else [])]
            gates = parse_fail_under(args.fail_under, names)
            inputs = _open_inputs(stack, args.inputs)
            out = sys.stdout.buffer if args.output == "-" else stack.enter_context(open(args.output, "wb"))
            rejects = stack.enter_context(open(args.rejects, "wb")) if args.rejects else None
        except InputError as exc:
            print(f"tracejudge eval: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"tracejudge eval: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
            return 2
        results = FileEvaluation(pipeline, settings, fmt, summary, rejects, err).results(inputs)
        if judges is not None:
            results = with_judgements(results, judges)
        last_progress = started = time.monotonic()
        grouper = SessionGrouper()
        for result in results:
            out.write(result.to_json() + b"\n")
            summary.add(result)
            grouper.add(result)
            now = time.monotonic()
            if err is not None and now - last_progress >= PROGRESS_EVERY_SECONDS:
                last_progress = now
                rate = summary.records / (now - started)
                print(f"... {summary.records} records, {summary.rejected} rejected ({rate:.0f}/s)", file=err)
        # The end of the input closes every session: their lines follow the trace results.
        summary.sessions.without_session = grouper.without_session
        if err is not None and grouper.open_sessions and session_judges is not None:
            print(f"... {grouper.open_sessions} sessions, {grouper.turns} turns: evaluating the sessions",
                  file=err)
        for session in SessionEvaluation(session_judges).results(grouper.close_all()):
            out.write(session.to_json() + b"\n")
            summary.sessions.add(session)
    if err is not None:
        print("tracejudge eval summary", file=err)
        print(summary.render(), file=err)
    return _gate(gates, summary)


def _gate(gates: dict[str, float], summary: Summary) -> int:
    failed = False
    for name, threshold in gates.items():
        # A session judge's gate reads its verdicts on sessions (the names do not overlap).
        tally = summary.judges.get(name) or summary.sessions.judges.get(name) or JudgeTally()
        mean = tally.mean
        if mean is None or mean < threshold:
            failed = True
            got = "no scores" if mean is None else f"mean score {mean:.3f}"
            print(f"tracejudge eval: {name}: {got} is below --fail-under {threshold}", file=sys.stderr)
    return 1 if failed else 0
