"""`tracejudge dataset`: from collected traces to a regression set.

    tracejudge dataset merge-labels COLLECTION [LABELS ...] --out FILE
        [--labels-from-mlflow URL] [--labels-topic TOPIC (--bootstrap-servers HOSTS | --config FILE)]
        [--conflicts FILE]

`merge-labels` reads a collection (`collections:` rows, `schemas/formats/collected.py`), keeps the first
row of each trace id (a topic read at least once may hold a trace twice), and fills each row's
`expected_response`, `expected_facts` and `expected_retrieved_context` from people's labels
(`schemas/formats/expectations.py`: label files, the MLflow expectations and HUMAN feedback on each
trace, the labels topic). A field two labels give different values for, or that the row already holds
with another value, is a conflict: left as the row had it, never overwritten, listed on stderr and in
`--conflicts FILE` (JSON Lines: trace id, field, the values and where each came from). The output
(temp file then rename) is a valid `tracejudge eval` input as it stands.

Exit status: 0; 1 when there were conflicts (the output is written: the merge ran, its check failed, as
a gate's); 2 for usage, an unreadable collection or labels source (nothing written); 3 when an output
cannot be written. `synthesize` is `dataset_synthesize.py`; room is left for more (`gate`).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tracejudge.consumer.commands.label_sources import (
    MAX_SHOWN,
    Problems,
    from_files,
    from_mlflow,
    from_topic,
)
from tracejudge.consumer.commands.outputs import AtomicOutput, OutputError, refuse_overwriting_inputs
from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.runtime import exit_status
from tracejudge.schemas.errors import InputError
from tracejudge.schemas.formats.collected import EXPECTATION_FIELDS
from tracejudge.schemas.formats.expectations import Expectation
from tracejudge.schemas.formats.input_files import Oversized, open_input, read_lines
from tracejudge.schemas.formats.labels import normalise_id

__all__ = ["Merge", "add_arguments", "main"]

MAX_ROW_BYTES = 64 * 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dataset_command", required=True, metavar="SUBCOMMAND")
    from tracejudge.consumer.commands import dataset_synthesize

    dataset_synthesize.add_arguments(sub.add_parser(
        "synthesize", help="question/answer rows from documents, through the judge endpoint",
        description="Generate questions and reference answers from documents (a folder, JSON Lines chunks "
                    "or result files' retrieved context), keep those the chunk answers, write agent-"
                    "evaluation rows (resumable)."))
    merge = sub.add_parser("merge-labels", help="fill a collection's expectations from people's labels",
                           description="Fill each collected row's expected_response, expected_facts and "
                                       "expected_retrieved_context from labels; conflicts are reported, "
                                       "never overwritten (exit 1).")
    merge.add_argument("collection", metavar="COLLECTION", help="a collection file (JSON Lines, .gz too)")
    merge.add_argument("labels", nargs="*", metavar="LABELS", help="JSON Lines files of expectations")
    merge.add_argument("--out", required=True, metavar="FILE",
                       help="the merged collection; replaced only when the merge succeeds, never an input")
    merge.add_argument("--conflicts", metavar="FILE", help="write each conflict here (JSON Lines)")
    merge.add_argument("--labels-from-mlflow", metavar="URL",
                       help="read the expectations and HUMAN feedback on each collected trace from this "
                            "MLflow tracking server (MLFLOW_TRACKING_TOKEN is sent when set)")
    merge.add_argument("--labels-topic", metavar="TOPIC", help="read the labels topic from its beginning to "
                                                               "its current end")
    merge.add_argument("--bootstrap-servers", metavar="HOST:PORT[,...]",
                       help="the Kafka brokers of --labels-topic (else kafka.bootstrap_servers of --config)")
    merge.add_argument("--config", type=Path, metavar="FILE", help="the YAML file whose kafka: section "
                                                                   "connects to --labels-topic")
    merge.add_argument("--max-label-records", type=int, default=1_000_000, metavar="N",
                       help="read at most N records of --labels-topic (default 1000000; more are counted)")
    merge.add_argument("--labels-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="give up reading --labels-topic after this long (default 60; exit 2)")
    merge.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")


@dataclass
class Merge:
    """The collection's rows by id and what the labels did to them."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    # (row index, field) -> (value, where) of the first label; fields in conflict are left as they were.
    chosen: dict[tuple[int, str], tuple[Any, str]] = field(default_factory=dict)
    conflicts: dict[tuple[int, str], list[tuple[Any, str]]] = field(default_factory=dict)
    agreeing: int = 0
    unmatched: int = 0

    def add_row(self, row: dict[str, Any]) -> None:
        ident = _ident(row)
        if ident is not None and ident in self.index:
            self.duplicates += 1
            return
        if ident is not None:
            self.index[ident] = len(self.rows)
        self.rows.append(row)

    def add(self, exp: Expectation) -> None:
        i = self.index.get(exp.ident)
        if i is None:
            self.unmatched += 1
            return
        key = (i, exp.field)
        held = self.rows[i].get(exp.field)
        if key in self.conflicts:
            self.conflicts[key].append((exp.value, exp.where))
        elif key in self.chosen:
            first = self.chosen[key]
            if first[0] == exp.value:
                self.agreeing += 1
            else:
                self.conflicts[key] = [first, (exp.value, exp.where)]
                del self.chosen[key]
        elif held not in (None, [], "") and held != exp.value:
            self.conflicts[key] = [(held, "the collected row"), (exp.value, exp.where)]
        else:
            self.chosen[key] = (exp.value, exp.where)

    def merged(self) -> list[dict[str, Any]]:
        out = [dict(r) for r in self.rows]
        for (i, name), (value, _where) in self.chosen.items():
            out[i][name] = value
        return out

    def conflict_lines(self) -> list[dict[str, Any]]:
        return [{"trace_id": self.rows[i].get("trace_id"), "request_id": self.rows[i].get("request_id"),
                 "field": name, "values": [{"value": v, "from": w} for v, w in labels]}
                for (i, name), labels in self.conflicts.items()]


def _ident(row: dict[str, Any]) -> str | None:
    ident = row.get("trace_id") or row.get("request_id")
    return normalise_id(ident) if isinstance(ident, str) and ident else None


def main(args: argparse.Namespace) -> int:
    """Exit status: 0; 1 with conflicts (output written); 2 usage or unreadable input; 3 output error."""
    if args.dataset_command == "synthesize":
        from tracejudge.consumer.commands import dataset_synthesize

        return dataset_synthesize.main(args)
    err = None if args.quiet else sys.stderr
    problems = Problems()
    merge = Merge()
    with ExitStack() as stack:
        try:
            _check_sources(args)
            inputs = [args.collection, *args.labels, *([str(args.config)] if args.config else [])]
            refuse_overwriting_inputs({"--out": args.out, "--conflicts": args.conflicts}, inputs)
            _read_collection(stack, args.collection, merge)
            for exp in from_files(stack, args.labels, problems):
                merge.add(exp)
            if args.labels_from_mlflow:
                ids = [r["trace_id"] for r in merge.rows if isinstance(r.get("trace_id"), str)]
                for exp in from_mlflow(args.labels_from_mlflow, ids, problems):
                    merge.add(exp)
            if args.labels_topic:
                for exp in from_topic(_kafka_config(args), args.labels_topic, problems,
                                      max_records=args.max_label_records, timeout=args.labels_timeout):
                    merge.add(exp)
        except (InputError, ConfigError) as exc:
            text = exc.report() if isinstance(exc, ConfigError) else str(exc)
            print(f"tracejudge dataset merge-labels: {text}", file=sys.stderr)
            return exit_status.USAGE
        try:
            out = stack.enter_context(AtomicOutput(args.out))
            for row in merge.merged():
                out.write(orjson.dumps(row) + b"\n")
            if args.conflicts:
                conflicts = stack.enter_context(AtomicOutput(args.conflicts))
                for line in merge.conflict_lines():
                    conflicts.write(orjson.dumps(line) + b"\n")
                conflicts.commit()
            out.commit()
        except OutputError as exc:
            print(f"tracejudge dataset merge-labels: {exc}", file=sys.stderr)
            return exit_status.OUTPUT_ERROR
    _summary(merge, problems, args, err)
    return exit_status.GATE_FAILED if merge.conflicts else exit_status.OK


def _check_sources(args: argparse.Namespace) -> None:
    if not (args.labels or args.labels_from_mlflow or args.labels_topic):
        raise InputError("no labels: give LABELS files, --labels-from-mlflow URL or --labels-topic TOPIC")
    if args.labels_topic and not (args.bootstrap_servers or args.config):
        raise InputError("--labels-topic needs --bootstrap-servers or --config (its kafka: section)")
    if args.max_label_records < 1 or args.labels_timeout <= 0:
        raise InputError("--max-label-records must be >= 1 and --labels-timeout > 0")


def _kafka_config(args: argparse.Namespace) -> dict[str, Any]:
    servers = args.bootstrap_servers.split(",") if args.bootstrap_servers else None
    overrides = {"kafka.bootstrap_servers": servers}
    settings = load_settings(args.config, overrides=overrides, offline=True)
    return dict(settings.kafka.client_config())


def _read_collection(stack: ExitStack, name: str, merge: Merge) -> None:
    """Every row of the collection; `InputError` naming the line that is not a row."""
    stream = open_input(stack, name)
    for lineno, line in read_lines(stream, name, MAX_ROW_BYTES):
        if isinstance(line, Oversized):
            raise InputError(f"{name}:{lineno}: {line.size} bytes, more than a collected row may have")
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise InputError(f"{name}:{lineno}: not a collected row: not JSON ({exc})") from None
        if not isinstance(row, dict) or not ("request" in row or "inputs" in row):
            raise InputError(f"{name}:{lineno}: not a collected row: expected an object with \"request\"")
        merge.add_row(row)


def _summary(merge: Merge, problems: Problems, args: argparse.Namespace, err: Any) -> None:
    filled = len(merge.chosen)
    for (i, name), labels in list(merge.conflicts.items())[:MAX_SHOWN]:
        ident = merge.rows[i].get("trace_id") or merge.rows[i].get("request_id")
        shown = "; ".join(f"{_short(v)} from {w}" for v, w in labels)
        print(f"tracejudge dataset merge-labels: conflict: {ident} {name}: {shown}", file=sys.stderr)
    if err is None:
        return
    for line in problems.shown:
        print(f"  skipped {line}", file=err)
    per_field = {f: sum(1 for (_, n) in merge.chosen if n == f) for f in EXPECTATION_FIELDS}
    print("tracejudge dataset merge-labels summary", file=err)
    print(f"  rows                 {len(merge.rows)} ({merge.duplicates} duplicate rows dropped)", file=err)
    fields = ", ".join(f"{n} {f}" for f, n in per_field.items())
    print(f"  fields filled        {filled} ({fields})", file=err)
    print(f"  conflicts            {len(merge.conflicts)}"
          + (f" (all in {args.conflicts})" if args.conflicts else ""), file=err)
    print(f"  agreeing labels      {merge.agreeing}", file=err)
    print(f"  labels for no row    {merge.unmatched}", file=err)
    skipped = ", ".join(f"{n} {k}" for k, n in sorted(problems.counts.items())) or "none"
    print(f"  skipped              {skipped}", file=err)
    print(f"  written              {args.out}", file=err)


def _short(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 80 else text[:77] + "..."
