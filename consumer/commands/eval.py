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
(`api/sessions.py`): after the last trace result, one session result line per session
(`"kind": "session"`, closed by the end of the input) with the session metrics and, when `judges:`
is configured, the session judges' verdicts. The summary on stderr, and the evidence of the gates, is
`metrics/summary.py` (`Summary`, `JudgeTally`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO

import orjson

from tracejudge.consumer.commands.collect_files import CollectionFiles, collection_outputs, topic_only
from tracejudge.consumer.commands.eval_app import AppEvaluation, build_app, count_argument
from tracejudge.consumer.commands.eval_app import add_arguments as add_app_arguments
from tracejudge.consumer.commands.eval_baseline import BaselineGate
from tracejudge.consumer.commands.eval_baseline import add_arguments as add_baseline_arguments
from tracejudge.consumer.commands.outputs import (
    AtomicOutput,
    OutputError,
    StdoutOutput,
    refuse_overwriting_inputs,
    silence_stdout,
)
from tracejudge.consumer.config import ConfigError, Settings, load_settings
from tracejudge.consumer.pipeline import Pipeline, build_judges, build_pipeline, with_judgements
from tracejudge.consumer.runtime import exit_status
from tracejudge.consumer.stages.assembly import OtlpLineAssembler
from tracejudge.metrics.findings import FindingsWindow, RequestClusterer
from tracejudge.metrics.summary import PLANNED_SKIPS, JudgeTally, Summary, reasons
from tracejudge.schemas import errors
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats import otlp
from tracejudge.schemas.formats.detect import BINARY_FORMATS, INPUT_FORMATS, OTLP_JSON_FORMATS
from tracejudge.schemas.formats.input_files import (
    InputError,
    Oversized,
    diagnose_unreadable,
    open_inputs,
    read_lines,
)
from tracejudge.schemas.result import EvaluationResult, SourceRef
from tracejudge.sessions import SessionEvaluation, SessionGrouper, build_session_judges

PROGRESS_EVERY_SECONDS = 5.0
# Rejected lines printed on stderr per run; the rest are counted (and all are in --rejects).
MAX_SHOWN_REJECTS = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="JSON Lines files ('-' for stdin; FILE.gz is decompressed); each line may be "
                             "any supported format")
    parser.add_argument("-o", "--output", default="-", metavar="FILE",
                        help="where to write one result per line (default: stdout); replaced only when "
                             "the run succeeds, never one of the inputs")
    parser.add_argument("--rejects", metavar="FILE",
                        help="write malformed lines here, each with its source line number and the reason")
    parser.add_argument("--format", default="auto", choices=INPUT_FORMATS,
                        help="the format of every line (default: detected per line; OTLP/JSON lines are "
                             "assembled into traces)")
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="the YAML file `tracejudge run` reads (metrics, judges, app tag, OTLP assembly)")
    parser.add_argument("--fail-under", action="append", default=[], metavar="JUDGE=THRESHOLD",
                        help="exit 1 when JUDGE's mean score is below THRESHOLD (repeatable), or when "
                             "errors or skips leave too little evidence (the three flags below)")
    parser.add_argument("--max-judge-errors", default="0", metavar="N|P%",
                        help="a gated judge may error on at most N of its records, or P%% of the records "
                             "it was to judge (default 0: any judge error fails the gate)")
    parser.add_argument("--max-judge-skips", default="0", metavar="N|P%",
                        help="likewise for records a gated judge should have judged but skipped (budget, "
                             "circuit_open, overloaded, too_large, closed; default 0)")
    parser.add_argument("--min-judged", default=1, type=count_argument, metavar="N",
                        help="a gated judge needs at least N verdicts (default 1)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress or summary on stderr")
    add_app_arguments(parser)
    add_baseline_arguments(parser)


class FileEvaluation:
    """Lines in, results out, in input order (an assembled OTLP trace comes out when it is whole).

    A line longer than `stream.max_record_bytes` is rejected (`too_large`) unread, as the stream
    dead-letters it. The first `MAX_SHOWN_REJECTS` rejected lines are printed, the rest counted. A file
    none of whose lines could be read as a record ends the run: `unreadable` then says which file and
    the likely cause, and the caller exits 2 (a CSV file, pretty-printed JSON... is not an input with
    no records, it is the wrong input)."""

    def __init__(self, pipeline: Pipeline, settings: Settings, fmt: str | None, summary: Summary,
                 rejects: AtomicOutput | IO[bytes] | None, err: IO[str] | None) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.fmt = fmt
        self.summary = summary
        self.rejects = rejects
        self.err = err
        self.max_bytes = settings.stream.max_record_bytes
        self.shown = 0
        self.unreadable: str | None = None

    def results(self, inputs: list[tuple[str, BinaryIO]]) -> Iterator[EvaluationResult]:
        for name, stream in inputs:
            yield from self._file(name, stream)
            if self.unreadable is not None:
                break
        hidden = self.summary.rejected - self.shown
        if hidden > 0 and self.err is not None:
            where = (f"all are in {getattr(self.rejects, 'name', 'the rejects file')}" if self.rejects
                     is not None else "--rejects FILE writes them all")
            print(f"... and {hidden} more rejected line{'' if hidden == 1 else 's'} not shown ({where})",
                  file=self.err)

    def _file(self, name: str, stream: BinaryIO) -> Iterator[EvaluationResult]:
        # One assembler per file: a trace spread over two files is two partial traces, as it
        # would be over two topics.
        assembler: OtlpLineAssembler | None = None
        read = rejected = 0
        first: tuple[bytes, RecordError] | None = None
        try:
            for lineno, line in read_lines(stream, name, self.max_bytes):
                try:
                    if isinstance(line, Oversized):
                        raise RecordError(errors.TOO_LARGE, f"{line.size} bytes, more than "
                                          f"stream.max_record_bytes ({self.max_bytes}); not parsed")
                    if self.fmt in OTLP_JSON_FORMATS or (self.fmt is None
                                                         and otlp.looks_like_otlp_json(line)):
                        if assembler is None:
                            assembler = OtlpLineAssembler(self.settings.otlp.assembly.to_settings(),
                                                          app_tag=self.pipeline.app_tag,
                                                          session_tag=self.pipeline.session_tag,
                                                          version_tag=self.pipeline.version_tag)
                        traces = assembler.feed(line, lineno)
                        read += 1
                        for t in traces:
                            yield self._evaluate(t.record(), name, t.line)
                        continue
                    record = self.pipeline.normalise(line, self.fmt)
                except RecordError as exc:
                    rejected += 1
                    if first is None:
                        first = (line.head if isinstance(line, Oversized) else line, exc)
                    self._reject(name, lineno, line, exc)
                    continue
                read += 1
                yield self._evaluate(record, name, lineno)
        except InputError as exc:
            self.unreadable = str(exc)
            return
        if assembler is not None:
            for t in assembler.finish():
                yield self._evaluate(t.record(), name, t.line)
        if first is not None and read == 0:
            line, exc = first
            self.unreadable = (f"{name}: no line could be read as a record ({rejected} rejected): "
                               f"{diagnose_unreadable(name, line, exc.reason, exc.message)}")
        elif rejected == 0 and read == 0 and self.err is not None:
            print(f"{name}: empty (no lines), no records", file=self.err)

    def _evaluate(self, record: Any, name: str, line: int) -> EvaluationResult:
        return self.pipeline.evaluate(record, SourceRef(format=record.source_format, file=name, line=line))

    def _reject(self, name: str, lineno: int, line: bytes | Oversized, exc: RecordError) -> None:
        self.summary.rejected += 1
        if self.err is not None and self.shown < MAX_SHOWN_REJECTS:
            self.shown += 1
            print(f"{name}:{lineno}: rejected ({exc.reason}): {exc.message}", file=self.err)
        if self.rejects is not None:
            entry: dict[str, Any] = {"file": name, "line": lineno, "reason": exc.reason, "error": exc.message}
            if isinstance(line, Oversized):
                # The line is in the input; its head says which one it is without copying megabytes.
                entry.update(record=line.head.decode("utf-8", "replace"), truncated=True, bytes=line.size)
            else:
                entry["record"] = line.decode("utf-8", "replace")
            self.rejects.write(orjson.dumps(entry) + b"\n")


@dataclass(frozen=True)
class Allowance:
    """How much of a gated judge's work may go missing: a count, or a share (`percent`) of the records
    it was to judge."""

    count: int | None = 0
    percent: float | None = None

    @classmethod
    def parse(cls, flag: str, text: str) -> Allowance:
        value = text.strip()
        try:
            if value.endswith("%"):
                percent = float(value[:-1])
                if 0.0 <= percent <= 100.0:
                    return cls(None, percent)
            elif int(value) >= 0:
                return cls(int(value), None)
        except ValueError:
            pass
        raise InputError(f"{flag} {text!r}: expected a count (N >= 0) or a percentage (P% from 0 to 100)")

    def allows(self, n: int, of: int) -> bool:
        if self.percent is not None:
            return n <= of * self.percent / 100.0
        return n <= (self.count or 0)

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else str(self.count)


@dataclass(frozen=True)
class Gates:
    """The `--fail-under` gates and how much missing evidence they tolerate."""

    thresholds: dict[str, float] = field(default_factory=dict)
    max_errors: Allowance = field(default_factory=Allowance)
    max_skips: Allowance = field(default_factory=Allowance)
    min_judged: int = 1


def parse_gates(args: argparse.Namespace, judge_names: list[str]) -> Gates:
    """The gates of `--fail-under` with the evidence they need; InputError naming the bad flag. The
    evidence flags without a `--fail-under` gate are an error (they would change nothing)."""
    thresholds = parse_fail_under(args.fail_under, judge_names)
    max_errors = Allowance.parse("--max-judge-errors", str(getattr(args, "max_judge_errors", "0")))
    max_skips = Allowance.parse("--max-judge-skips", str(getattr(args, "max_judge_skips", "0")))
    min_judged = getattr(args, "min_judged", 1)
    relaxed = [flag for flag, given in (("--max-judge-errors", max_errors != Allowance()),
                                        ("--max-judge-skips", max_skips != Allowance()),
                                        ("--min-judged", min_judged != 1)) if given]
    if relaxed and not thresholds:
        raise InputError(f"{', '.join(relaxed)} applies to --fail-under gates; "
                         "add --fail-under JUDGE=THRESHOLD")
    return Gates(thresholds, max_errors, max_skips, min_judged)


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
    """Exit status (`consumer/runtime/exit_status.py`): 0; 1 when a `--fail-under` gate fails; 2 for usage,
    configuration or unreadable input (nothing written); 3 when an output cannot be written (the
    previous output file left as it was)."""
    err = None if args.quiet else sys.stderr
    fmt = None if args.format == "auto" else args.format
    if args.format in BINARY_FORMATS:
        print(f"tracejudge eval: --format {args.format}: protobuf is binary, one message per Kafka record, "
              "and has no JSON Lines form; write OTLP/JSON (the Collector's file exporter does) and use "
              "--format otlp_json", file=sys.stderr)
        return exit_status.USAGE
    try:
        settings = load_settings(args.config, offline=True)
        pipeline = build_pipeline(settings)
        judges = build_judges(settings)
        session_judges = build_session_judges(settings)
    except ConfigError as exc:
        print(f"tracejudge eval: invalid configuration\n{exc.report()}", file=sys.stderr)
        return exit_status.USAGE
    summary = Summary(findings=FindingsWindow(settings.findings.options(),
                                              RequestClusterer(settings.findings.clustering.options())))
    with ExitStack() as stack:
        if judges is not None:
            stack.callback(judges.close)
        if session_judges is not None:
            stack.callback(session_judges.close)
        try:
            names = [*(judges.judge_names() if judges else []),
                     *(session_judges.judge_names() if session_judges else [])]
            gates = parse_gates(args, names)
            app = build_app(args)
            app_errors = Allowance.parse("--max-app-errors", str(getattr(args, "max_app_errors", "0")))
            baseline = BaselineGate.from_args(args, settings.stream.max_record_bytes)
            # Before anything is opened: opening an input for writing would truncate it.
            refuse_overwriting_inputs({"-o/--output": args.output, "--rejects": args.rejects,
                                       **collection_outputs(settings)},
                                      [*args.inputs, *([str(args.config)] if args.config else []),
                                       *([baseline.path] if baseline is not None else [])])
            inputs = open_inputs(stack, args.inputs)
            out = StdoutOutput() if args.output == "-" else stack.enter_context(AtomicOutput(args.output))
            rejects = stack.enter_context(AtomicOutput(args.rejects)) if args.rejects else None
            collected = CollectionFiles.open(stack, settings)
        except InputError as exc:
            print(f"tracejudge eval: {exc}", file=sys.stderr)
            return exit_status.USAGE
        except OutputError as exc:
            print(f"tracejudge eval: {exc}", file=sys.stderr)
            return exit_status.OUTPUT_ERROR
        files = FileEvaluation(pipeline, settings, fmt, summary, rejects, err)
        evaluation: FileEvaluation | AppEvaluation = files
        if app is not None:  # the dataset's rows through the app, rejected lines as the files' are
            evaluation = AppEvaluation.start(stack, app, args, pipeline, settings.stream.max_record_bytes,
                                             files._reject, err)
        try:
            _write_results(evaluation, inputs, judges, session_judges, out, summary, err, collected,
                           observe=baseline.add if baseline is not None else None)
            if evaluation.unreadable is not None:
                # Leaving the `with` discards the outputs: a previous output file is left as it was.
                print(f"tracejudge eval: {evaluation.unreadable}", file=sys.stderr)
                return exit_status.USAGE
            if rejects is not None:
                rejects.commit()
            if collected is not None:
                collected.finish(summary.findings)  # the `finding:` rules, once the findings are known
                collected.commit()
            out.commit()
        except OutputError as exc:
            return _output_failed(exc)
    if err is not None:
        print("tracejudge eval summary", file=err)
        print(summary.render(), file=err)
        if collected is not None:
            print(collected.render(), file=err)
        for name in topic_only(settings):
            print(f"  collection {name}: a topic only; its rows are published by tracejudge run", file=err)
        if isinstance(evaluation, AppEvaluation):
            print(f"  {evaluation.render()}", file=err)
    status = _gate(gates, summary)
    if isinstance(evaluation, AppEvaluation):
        status = max(status, evaluation.gate(app_errors))
    return max(status, baseline.decide()) if baseline is not None else status


def _write_results(evaluation: FileEvaluation | AppEvaluation, inputs: list[tuple[str, BinaryIO]],
                   judges: Any, session_judges: Any, out: AtomicOutput | StdoutOutput, summary: Summary,
                   err: IO[str] | None, collected: CollectionFiles | None = None,
                   observe: Callable[[EvaluationResult], None] | None = None) -> None:
    """Every trace result, then (the end of the input closing every session) every session result;
    the rows of the traces the `collections:` rules collect to their files."""
    results = evaluation.results(inputs)
    if judges is not None:
        results = with_judgements(results, judges)
    last_progress = started = time.monotonic()
    grouper = SessionGrouper()
    for result in results:
        out.write(result.to_json() + b"\n")
        if collected is not None:
            collected.add(result)
        summary.add(result)
        grouper.add(result)
        if observe is not None:
            observe(result)
        now = time.monotonic()
        if err is not None and now - last_progress >= PROGRESS_EVERY_SECONDS:
            last_progress = now
            rate = summary.records / (now - started)
            print(f"... {summary.records} records, {summary.rejected} rejected ({rate:.0f}/s)", file=err)
    if evaluation.unreadable is not None:
        return
    summary.sessions.without_session = grouper.without_session
    if err is not None and grouper.open_sessions and session_judges is not None:
        print(f"... {grouper.open_sessions} sessions, {grouper.turns} turns: evaluating the sessions",
              file=err)
    for session in SessionEvaluation(session_judges).results(grouper.close_all()):
        out.write(session.to_json() + b"\n")
        summary.sessions.add(session)


def _output_failed(exc: OutputError) -> int:
    """Status 3, one line on stderr; nothing for a closed pipe (`| head`), which ends the command as
    quietly as it ends `cat`."""
    if exc.broken_pipe:
        silence_stdout()
    else:
        print(f"tracejudge eval: {exc}", file=sys.stderr)
    return exit_status.OUTPUT_ERROR


def _gate(gates: Gates | dict[str, float], summary: Summary) -> int:
    """Exit status 1 when a gate fails, with every reason on stderr; 0 with a confirmation per gate.
    A gate fails on a mean score below its threshold, and on too little evidence: fewer verdicts than
    `--min-judged`, more judge errors than `--max-judge-errors`, more lost skips than
    `--max-judge-skips` (defaults: any error or lost skip fails)."""
    if not isinstance(gates, Gates):
        gates = Gates(dict(gates))
    failed = False
    for name, threshold in gates.thresholds.items():
        # A session judge's gate reads its verdicts on sessions (the names do not overlap).
        tally = summary.judges.get(name) or summary.sessions.judges.get(name) or JudgeTally()
        reasons = _gate_failures(name, threshold, tally, gates)
        for reason in reasons:
            print(f"tracejudge eval: {name}: {reason}", file=sys.stderr)
        if reasons:
            failed = True
        else:
            print(f"tracejudge eval: {name}: gate passed: mean score {tally.mean:.3f} >= --fail-under "
                  f"{threshold} on {tally.scores} judged; {tally.outcomes()}", file=sys.stderr)
    return 1 if failed else 0


def _gate_failures(name: str, threshold: float, tally: JudgeTally, gates: Gates) -> list[str]:
    out = []
    of = tally.to_judge
    mean = tally.mean
    if mean is None:
        out.append(f"no scores is below --fail-under {threshold}: no verdict ({tally.outcomes()})")
    elif tally.scores < gates.min_judged:
        out.append(f"{tally.scores} judged, under --min-judged {gates.min_judged}: too little evidence "
                   f"({tally.outcomes()})")
    if tally.errors and not gates.max_errors.allows(tally.errors, of):
        out.append(f"{tally.errors} judge errors of {of} records to judge{reasons(tally.error_reasons)}, "
                   f"over --max-judge-errors {gates.max_errors}: too little evidence "
                   f"(only {tally.verdicts} judged)")
    lost = {r: n for r, n in tally.skip_reasons.items() if r not in PLANNED_SKIPS}
    if tally.lost and not gates.max_skips.allows(tally.lost, of):
        out.append(f"{tally.lost} records skipped of {of} to judge{reasons(lost)}, over --max-judge-skips "
                   f"{gates.max_skips}: too little evidence (only {tally.verdicts} judged)")
    if mean is not None and mean < threshold:
        out.append(f"mean score {mean:.3f} is below --fail-under {threshold}")
    return out
