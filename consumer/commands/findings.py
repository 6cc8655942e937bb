"""`tracejudge findings`: what the failing verdicts have in common, per app and judge.

    tracejudge findings FILE... [--out findings.jsonl]   result files (`tracejudge eval` output): a ranked
                                                         table; with --out, one JSON line per finding
    tracejudge findings run [--config FILE] ...          the stage on the results topic
                                                         (`FindingsRunner`, consumer/stages/findings.py)

The analysis is `tracejudge.metrics.findings`, its options the `findings:` section (flags override
them). A file named `run` is read as `./run`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from typing import BinaryIO

import orjson

from tracejudge.consumer.commands.outputs import AtomicOutput, OutputError, refuse_overwriting_inputs
from tracejudge.consumer.config import ConfigError, Settings, load_settings
from tracejudge.consumer.runtime import exit_status
from tracejudge.consumer.runtime.arguments import TOPIC_METAVAR, add_stage_arguments
from tracejudge.consumer.runtime.process import stage_main
from tracejudge.consumer.stages.findings import (
    DEFAULT_GROUP,
    FindingsRunner,
    cluster_models,
    plan_findings,
    shown_setting,
)
from tracejudge.metrics.findings import Finding, FindingsWindow, RequestClusterer
from tracejudge.metrics.findings.models import ClusterModels, name_findings
from tracejudge.metrics.findings.report import table
from tracejudge.schemas.errors import InputError
from tracejudge.schemas.formats.input_files import Oversized, open_inputs, read_lines
from tracejudge.schemas.result import EvaluationResult
from tracejudge.schemas.results_line import BadResult, decode_line

__all__ = ["add_arguments", "main", "read_results", "settings_from_args"]

RUN = "run"
# The flags that only the stage reads (given with files they are a usage error).
# Results read before their requests are embedded together (findings.clustering.embeddings).
EMBED_CHUNK = 256
_STAGE_FLAGS = ("bootstrap_servers", "metrics_port", "metrics_bind_address", "group_id", "input_topic",
                "findings_topic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `tracejudge findings`; each flag overrides its configuration key."""
    parser.epilog = ("Per app and judge: the retrieved documents, tools, tool errors, versions, models, "
                     "signals and request clusters over-represented among the failing verdicts, each with "
                     "its support (failing/total), lift (failure rate with / without) and interval. From "
                     "result files (a ranked table; --out writes JSON Lines) or, with `run`, from the "
                     "results topic (Kafka) window by window, to /metrics and findings.findings_topic.")
    parser.add_argument("targets", nargs="+", metavar="FILE|run",
                        help="result files (JSON Lines written by `tracejudge eval`, .gz read too, - for "
                             "stdin); or `run` to run the stage on the results topic")
    parser.add_argument("--out", metavar="FILE", help="files: also write one JSON line per finding here")
    parser.add_argument("--top-k", type=int, metavar="N", help="findings per app and judge (findings.top_k)")
    parser.add_argument("--min-failing", type=int, metavar="N",
                        help="failing verdicts a value needs to be tested (findings.min_failing)")
    parser.add_argument("--fail-on-findings", action="store_true",
                        help="files: exit with status 1 when there is a finding (a gate)")
    add_stage_arguments(parser, "findings", config_help="YAML configuration file (its findings: section)")
    parser.add_argument("--group-id", metavar="GROUP",
                        help=f"run: consumer group (findings.group_id, default {DEFAULT_GROUP})")
    parser.add_argument("--input-topic", metavar=TOPIC_METAVAR,
                        help="run: the trace results topic to read (findings.input_topic, default "
                             "stream.results_topic)")
    parser.add_argument("--findings-topic", metavar=TOPIC_METAVAR,
                        help="run: publish each window's findings here (findings.findings_topic)")


def settings_from_args(args: argparse.Namespace, *, offline: bool = False) -> Settings:
    overrides = {"findings.top_k": getattr(args, "top_k", None),
                 "findings.min_failing": getattr(args, "min_failing", None),
                 "findings.group_id": getattr(args, "group_id", None),
                 "findings.input_topic": getattr(args, "input_topic", None),
                 "findings.findings_topic": getattr(args, "findings_topic", None),
                 "kafka.bootstrap_servers": getattr(args, "bootstrap_servers", None),
                 "http.port": getattr(args, "metrics_port", None),
                 "http.bind_address": getattr(args, "metrics_bind_address", None),
                 "logging.level": getattr(args, "log_level", None)}
    if offline:
        return load_settings(getattr(args, "config", None), overrides=overrides, offline=True)
    return load_settings(getattr(args, "config", None), overrides=overrides, require_topics=False)


def main(args: argparse.Namespace) -> int:
    """0: done (no finding gate failed); 1: `--fail-on-findings` and a finding; 2: usage, configuration
    or an unreadable file or line (named); 3: `--out` cannot be written (a previous file left as it
    was); `run`: as every stage (`stage_main`)."""
    if args.targets[0] == RUN:
        if len(args.targets) > 1:
            print("tracejudge findings: `run` takes no files (a file named run: ./run)", file=sys.stderr)
            return exit_status.USAGE
        return stage_main("findings", args, settings_from_args, FindingsRunner, plan=plan_findings,
                          show=shown_setting,
                          effective=lambda plan: {"findings.input_topic": plan.input_topic,
                                                  "findings.group_id": plan.group_id})
    given = [f"--{flag.replace('_', '-')}" for flag in _STAGE_FLAGS if getattr(args, flag, None) is not None]
    if given or args.check_config:
        print(f"tracejudge findings: {(given or ['--check-config'])[0]} applies to `tracejudge findings run` "
              "only", file=sys.stderr)
        return exit_status.USAGE
    try:
        settings = settings_from_args(args, offline=True)
        models = cluster_models(settings)
    except ConfigError as exc:
        print(f"tracejudge findings: invalid configuration\n{exc.report()}", file=sys.stderr)
        return exit_status.USAGE
    try:
        return _files(args, settings, models)
    finally:
        if models is not None:
            models.close()


def _files(args: argparse.Namespace, settings: Settings, models: ClusterModels | None) -> int:
    f = settings.findings
    embed = models.vector if models is not None and models.embedder is not None else None
    clusterer = RequestClusterer(f.clustering.options(), embed)
    window = FindingsWindow(f.options(), clusterer)
    with ExitStack() as stack:
        try:
            refuse_overwriting_inputs({"--out": args.out},
                                      [*args.targets, *([str(args.config)] if args.config else [])])
            inputs = open_inputs(stack, args.targets)
            chunk: list[EvaluationResult] = []
            for name, stream in inputs:
                for result in read_results(stream, name, settings.stream.max_record_bytes):
                    chunk.append(result)
                    if len(chunk) >= EMBED_CHUNK:
                        _add(window, chunk, models)
            _add(window, chunk, models)
        except InputError as exc:
            print(f"tracejudge findings: {exc}", file=sys.stderr)
            return exit_status.USAGE
        findings = window.analyse()
        if models is not None:
            name_findings(findings, clusterer, models)
        try:
            if args.out:
                out = stack.enter_context(AtomicOutput(args.out))
                for finding in findings:
                    out.write(orjson.dumps(finding.to_dict()) + b"\n")
                out.commit()
        except OutputError as exc:
            print(f"tracejudge findings: {exc}", file=sys.stderr)
            return exit_status.OUTPUT_ERROR
    _print(findings, window)
    if models is not None and models.fallback is not None:
        print(f"requests clustered by words from the {models.fallback} fallback on (the embeddings endpoint "
              "could not be used)", file=sys.stderr)
    return exit_status.GATE_FAILED if findings and args.fail_on_findings else exit_status.OK


def _add(window: FindingsWindow, chunk: list[EvaluationResult], models: ClusterModels | None) -> None:
    """Count a chunk of results into the window, their requests embedded together first; empties it."""
    if models is not None:
        models.prefetch([r.record.request for r in chunk])
    for result in chunk:
        window.add(result)
    chunk.clear()


def _print(findings: list[Finding], window: FindingsWindow) -> None:
    if findings:
        print(table(findings))
    else:
        print("no finding: no value is over-represented among the failing verdicts with the support and "
              "confidence asked for")
    failing = sum(g.failing for g in window.groups.values())
    dropped = sum(window.dropped_values.values())
    note = f"; {dropped} rare values set aside (findings.max_values)" if dropped else ""
    if window.sample_dropped:
        note += (f"; conditioned tests on a sample, {window.sample_dropped} verdicts left out "
                 "(findings.sample)")
    print(f"{window.verdicts} verdicts ({failing} failing) of {len(window.groups)} app/judge pairs{note}",
          file=sys.stderr)


def read_results(stream: BinaryIO, name: str, max_bytes: int) -> Iterator[EvaluationResult]:
    """The trace results of one result file, one at a time (session lines skipped); `InputError` naming
    the first line that is not a result."""
    for lineno, line in read_lines(stream, name, max_bytes):
        if isinstance(line, Oversized):
            raise InputError(f"{name}:{lineno}: a line of {line.size} bytes, over stream.max_record_bytes "
                             f"({max_bytes})")
        try:
            decoded, session = decode_line(line)
        except BadResult as exc:
            raise InputError(f"{name}:{lineno}: {exc.message}") from None
        if session is None:
            yield EvaluationResult.from_dict(decoded)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tracejudge findings", description=__doc__.splitlines()[0])
    _parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (logging.level)")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
