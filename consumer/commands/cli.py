"""The `tracejudge` command: `eval` (files), `run` (Kafka), `sessions` (conversations), `sink` (write-back),
`backfill` (re-judge a time range), `demo` (everything embedded).

Each subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`;
this file only wires them together, importing a subcommand's module when it is chosen so that
`tracejudge eval` does not pay for Kafka's imports.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from tracejudge import __version__
from tracejudge.consumer.commands.outputs import silence_stdout
from tracejudge.consumer.runtime import exit_status
from tracejudge.consumer.runtime.logs import configure_library_logs

SUBCOMMANDS = {
    "eval": ("tracejudge.consumer.commands.eval",
             "evaluate JSON Lines files offline (same scores as the stream)"),
    "calibrate": ("tracejudge.consumer.commands.calibrate", "measure the judges' agreement with human labels "
                                                   "and write a calibration file"),
    "run": ("tracejudge.consumer.commands.run", "consume traces from Kafka and export quality to Prometheus"),
    "sessions": ("tracejudge.consumer.commands.sessions",
                 "gather the trace results into conversations and evaluate "
                                                 "each session when it goes quiet"),
    "sink": ("tracejudge.consumer.commands.sink", "write the judges' verdicts from the results topic back to "
                                               "MLflow or an OpenTelemetry collector"),
    "agreement": ("tracejudge.consumer.commands.agreement",
                  "join human labels from a labels topic with the judges' "
                                                   "verdicts and export their agreement"),
    "backfill": ("tracejudge.consumer.commands.backfill",
                 "re-judge a time range of the input topics and publish "
                                                 "the results marked as backfill (resumable)"),
    "findings": ("tracejudge.consumer.commands.findings",
                 "find what the failing verdicts have in common (documents, tools, versions, models, "
                 "request clusters), from result files or the results topic"),
    "dataset": ("tracejudge.consumer.commands.dataset",
                "turn collected traces into a regression set (merge-labels: people's labels become the "
                "rows' expectations; synthesize: question/answer rows from documents)"),
    "alerts": ("tracejudge.consumer.commands.alerts",
               "render the Prometheus rules with every alert's links (runbook, dashboard, trace search)"),
    "slo": ("tracejudge.consumer.commands.slo",
            "render the quality SLOs of the slos: section as Prometheus rules: error budget and burn-rate "
            "alerts"),
    "demo": ("tracejudge.consumer.demo.command", "run a local broker, a synthetic agent and the evaluator"),
}

# The top-level help: whole sentences (not the docstring's first line, which breaks mid-list).
DESCRIPTION = ("Evaluate LLM agent traces (MLflow, OpenTelemetry, agent-evaluation records, inference logs) "
               "with computed metrics and judges: offline from files, or from Kafka as a service that "
               "exports quality to Prometheus and publishes one result per trace.")
EPILOG = ("Start with `tracejudge demo` (everything embedded) or `tracejudge eval FILE`. "
          "`tracejudge COMMAND --help` describes a command and its flags.")


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracejudge", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"tracejudge {__version__}")
    # No default here: `tracejudge run`/`sink` fall back to `logging.level` from their configuration.
    parser.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="the log's level, given before COMMAND (default: logging.level of the "
                             "configuration, else INFO); DEBUG adds the libraries' own lines")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The exit status means one thing per value, for every command (`consumer/runtime/exit_status.py`).
    Here: 130 on Ctrl-C, and 3 when stdout is a pipe its reader closed (`tracejudge ... | head -1`),
    silently, as `cat` ends; argparse's usage errors are 2."""
    try:
        status = _run(argv)
        sys.stdout.flush()  # here, not at interpreter exit, where a closed pipe cannot be handled
        return status
    except KeyboardInterrupt:
        return exit_status.INTERRUPTED
    except BrokenPipeError:
        silence_stdout()
        return exit_status.OUTPUT_ERROR


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(chosen).parse_args(argv)
    logging.basicConfig(level=args.log_level or "INFO", stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Per-request library lines (httpx's "HTTP Request: POST …") only with --log-level DEBUG.
    configure_library_logs(args.log_level or "INFO")
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(args))


if __name__ == "__main__":
    sys.exit(main())
