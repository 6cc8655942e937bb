"""`tracejudge calibrate`: how often do the configured judges agree with people?

    tracejudge calibrate records.jsonl --labels labels.jsonl --config tracejudge.yaml -o calibration.json

The records are read and normalised as `tracejudge eval` reads them (any supported format; bad lines
reported and counted), and every record that carries a label for a configured judge is judged by the
same `JudgeRunner` the stream uses, with the same prompts, endpoint and model, so the measured
agreement describes the judge that runs. Sampling and filters are set aside here (they are not part of
a judge's fingerprint): every labelled record is judged.

Per judge it prints n, the confusion matrix ("pass" positive), TPR and TNR with Wilson 95% intervals,
balanced accuracy and Cohen's kappa with its interval (`tracejudge.metrics.judges.trust.agreement`), and
writes the
calibration file (`tracejudge.metrics.judges.trust.calibration`) keyed by the judge's version fingerprint. A
judge
with fewer than `MINIMUM_LABELS` labels of either class is reported but marked not calibrated.

Exit status (`consumer/runtime/exit_status.py`): 0; 1 when a judge with labels has a kappa below `--min-kappa`
(or none); 2 for bad input or configuration (unreadable files, a file of which no line is a record or
a label, no labelled record at all, `-o` naming an input); 3 when the calibration file cannot be
written (the previous one is left as it was).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from typing import IO

from tracejudge.consumer.commands.eval import FileEvaluation
from tracejudge.consumer.commands.outputs import AtomicOutput, OutputError, refuse_overwriting_inputs
from tracejudge.consumer.config import ConfigError, Settings, load_settings
from tracejudge.consumer.pipeline import build_pipeline
from tracejudge.consumer.runtime import exit_status
from tracejudge.consumer.runtime.arguments import add_config_argument
from tracejudge.metrics.judges.config import JudgesConfig, JudgeSettings, load_judges_config
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.trust.agreement import MINIMUM_LABELS, Agreement, Confusion
from tracejudge.metrics.judges.trust.calibration import Calibration, CalibrationError, CalibrationFile, load
from tracejudge.metrics.summary import Summary
from tracejudge.schemas.formats.detect import BINARY_FORMATS, INPUT_FORMATS
from tracejudge.schemas.formats.input_files import InputError, open_input, open_inputs
from tracejudge.schemas.formats.labels import LabelsError, LabelSet
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import JudgeIdentity

__all__ = ["JudgeTallies", "add_arguments", "judge_every_record", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="RECORDS",
                        help="JSON Lines files of records to judge ('-' for stdin), any supported format")
    parser.add_argument("--labels", action="append", default=[], metavar="FILE",
                        help='human labels, one per line: {"trace_id"|"request_id", "judge", "label"} '
                             "(repeatable; records' own MLflow HUMAN feedback is always read)")
    parser.add_argument("--labels-from-mlflow", metavar="URI",
                        help="also read HUMAN feedback from this MLflow tracking server (with --experiment)")
    parser.add_argument("--experiment", action="append", default=[], metavar="ID",
                        help="MLflow experiment id whose traces' HUMAN feedback to read (repeatable)")
    add_config_argument(parser, "the YAML file `tracejudge run` reads (its judges: section is calibrated)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write (merge into) this calibration file")
    parser.add_argument("--min-kappa", type=float, metavar="K",
                        help="exit 1 when a labelled judge's Cohen's kappa is below K")
    parser.add_argument("--format", default="auto",
                        choices=[f for f in INPUT_FORMATS if f not in BINARY_FORMATS],
                        help="the format of every record line (default: detected per line)")


def judge_every_record(config: JudgesConfig) -> JudgesConfig:
    """`config` with sampling and filters set aside (rate 1, no filters): calibration judges every
    labelled record. Neither is part of a judge's fingerprint, so the versions are unchanged."""
    def opened(s: JudgeSettings) -> JudgeSettings:
        return s.model_copy(update={"sample_rate": None, "filters": None})

    update: dict[str, object] = {"sample_rate": 1.0, "filters": type(config.filters)(),
                                 "custom": {n: opened(c) for n, c in config.custom.items()}}
    if config.builtin is not None:
        fields = {n: opened(s) for n in type(config.builtin).model_fields
                  if isinstance(s := getattr(config.builtin, n), JudgeSettings)}
        update["builtin"] = config.builtin.model_copy(update=fields)
    return config.model_copy(update=update)


class JudgeTallies:
    """Per judge: the confusion matrix of labelled verdicts, its identity, and what could not count."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.confusion: dict[str, Confusion] = {n: Confusion() for n in names}
        self.identity: dict[str, JudgeIdentity] = {}
        self.unjudged: dict[str, Counter[str]] = {n: Counter() for n in names}
        self.labelled: Counter[str] = Counter()

    def add(self, record: EvalRecord, assessments: list, labels: LabelSet) -> None:
        for a in assessments:
            human = labels.of(record, a.name)
            if human is None or a.name not in self.confusion:
                continue
            self.labelled[a.name] += 1
            if a.judge is not None:
                self.identity.setdefault(a.name, a.judge)
            if a.passed is None:
                self.unjudged[a.name][a.skipped or ("error" if a.error else "no verdict")] += 1
                continue
            self.confusion[a.name].add(human, bool(a.passed))

    def render(self, name: str) -> str:
        c, ident = self.confusion[name], self.identity.get(name)
        lines = [f"{name}  (version {ident.version if ident else '-'}"
                 + (f", {ident.endpoint}/{ident.model}" if ident and ident.model else "") + ")"]
        missed = self.unjudged[name]
        note = (", not judged: " + ", ".join(f"{k} {v}" for k, v in sorted(missed.items()))) if missed else ""
        lines.append(f"  n {c.n}  (labelled {self.labelled[name]}{note})")
        if c.n == 0:
            return "\n".join(lines)
        ag = c.agreement()
        lines += [
            "                judge pass  judge fail",
            f"  human pass  {c.tp:>10}  {c.fn:>10}",
            f"  human fail  {c.fp:>10}  {c.tn:>10}",
            f"  TPR {_rate(ag.tpr)} {ag.tpr_interval or ''}   TNR {_rate(ag.tnr)} {ag.tnr_interval or ''}",
            f"  balanced accuracy {_rate(ag.balanced_accuracy)}   "
            f"kappa {_rate(ag.kappa)} {ag.kappa_interval or ''}",
        ]
        if ag.enough_labels:
            lines.append("  calibrated")
        else:
            lines.append(f"  NOT calibrated: {c.tp + c.fn} human passes and {c.tn + c.fp} human fails; "
                         f"at least {MINIMUM_LABELS} of each are needed")
        return "\n".join(lines)


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _labelled(results: Iterator, labels: LabelSet, judges: list[str],
              summary: Summary) -> Iterator[EvalRecord]:
    """The records with a label for a configured judge (reading each record's own HUMAN feedback)."""
    for result in results:
        summary.records += 1
        record = result.record
        labels.read_records([record])
        if any(labels.of(record, j) is not None for j in judges):
            yield record


def _build(settings: Settings) -> JudgeRunner:
    # A bad section raises `JudgeConfigError`, a `ConfigError` naming the key.
    config = judge_every_record(load_judges_config(settings.judges or {}).for_offline())
    return JudgeRunner(config)


def main(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    out = out or sys.stdout
    err = sys.stderr
    if bool(args.experiment) != bool(args.labels_from_mlflow):
        print("tracejudge calibrate: --labels-from-mlflow and --experiment go together", file=err)
        return 2
    try:
        settings = load_settings(args.config, offline=True)
        pipeline = build_pipeline(settings)
        runner = _build(settings)
    except ConfigError as exc:
        print(f"tracejudge calibrate: invalid configuration\n{exc.report()}", file=err)
        return 2
    names = runner.judge_names()
    labels = LabelSet(judges=frozenset(names))
    tallies = JudgeTallies(names)
    summary = Summary()
    with ExitStack() as stack:
        stack.callback(runner.close)
        try:
            # Before anything is opened: the calibration file must not be one of the inputs.
            read = [*args.inputs, *args.labels, *([str(args.config)] if args.config else [])]
            refuse_overwriting_inputs({"-o/--output": args.output}, read)
            _check_mergeable(args.output)
            for path in args.labels:
                labels.read_jsonl(open_input(stack, path), path, settings.stream.max_record_bytes)
            if args.labels_from_mlflow:
                labels.read_mlflow(args.labels_from_mlflow, args.experiment)
            inputs = open_inputs(stack, args.inputs)
        except (InputError, LabelsError, CalibrationError) as exc:
            print(f"tracejudge calibrate: {exc}", file=err)
            return exit_status.USAGE
        fmt = None if args.format == "auto" else args.format
        evaluation = FileEvaluation(pipeline, settings, fmt, summary, None, err)
        results = evaluation.results(inputs)
        records: list[EvalRecord] = []

        def kept() -> Iterator[EvalRecord]:
            for record in _labelled(results, labels, names, summary):
                records.append(record)
                yield record

        for i, assessments in enumerate(runner.judge_many(kept())):
            tallies.add(records[i], assessments, labels)
            records[i] = None  # type: ignore[call-overload]  # judged: let it go
        if evaluation.unreadable is not None:
            print(f"tracejudge calibrate: {evaluation.unreadable}", file=err)
            return exit_status.USAGE
    for line in labels.reported:
        print(f"labels: {line}", file=err)
    if labels.problems:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(labels.problems.items()))
        print(f"labels skipped: {skipped}", file=err)
    print(f"tracejudge calibrate: {summary.records} records read ({summary.rejected} rejected), "
          f"{len(records)} labelled, {len(labels)} labels", file=out)
    judged = [n for n in names if tallies.labelled[n]]
    if not judged:
        print("tracejudge calibrate: no record carries a label for a configured judge "
              f"({', '.join(names)})", file=err)
        return 2
    for name in judged:
        print(tallies.render(name), file=out)
    if args.output:
        calibrations = CalibrationFile()
        for name in judged:
            ident = tallies.identity.get(name)
            if ident is not None and tallies.confusion[name].n:
                calibrations.put(Calibration.measured(name, ident, Agreement.of(tallies.confusion[name])))
        try:
            _write_calibration(args.output, calibrations)
        except CalibrationError as exc:
            print(f"tracejudge calibrate: cannot merge into {args.output}: {exc}", file=err)
            return exit_status.USAGE
        except OutputError as exc:
            print(f"tracejudge calibrate: {exc}", file=err)
            return exit_status.OUTPUT_ERROR
        print(f"calibration written to {args.output}", file=out)
    return _gate(args.min_kappa, tallies, judged)


def _check_mergeable(path: str | None) -> None:
    """The calibration file `-o` merges into, read before any judge runs: a malformed one is found
    before the judging it would waste (`CalibrationError`, status 2)."""
    if path is not None and os.path.isfile(path):
        load(path)


def _write_calibration(path: str, calibrations: CalibrationFile) -> None:
    """`calibrations` merged into what `path` holds (other judges and versions kept, the same version
    replaced), written beside it and renamed into place (`outputs.AtomicOutput`): a failed write leaves
    the previous file as it was. Raises `CalibrationError` (the file became unreadable) or
    `OutputError`."""
    merged = load(path) if os.path.isfile(path) else CalibrationFile()
    for versions in calibrations.judges.values():
        for c in versions.values():
            merged.put(c)
    with AtomicOutput(path) as output:
        output.write(json.dumps(merged.to_json(), indent=1).encode() + b"\n")
        output.commit()


def _gate(min_kappa: float | None, tallies: JudgeTallies, judged: list[str]) -> int:
    if min_kappa is None:
        return 0
    failed = False
    for name in judged:
        kappa = Agreement.of(tallies.confusion[name]).kappa
        if kappa is None or kappa < min_kappa:
            failed = True
            got = "no kappa" if kappa is None else f"kappa {kappa:.3f}"
            print(f"tracejudge calibrate: {name}: {got} is below --min-kappa {min_kappa}", file=sys.stderr)
    return 1 if failed else 0
