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
from tracejudge.consumer.log_setup import configure_library_logs

SUBCOMMANDS = {
    "eval": ("tracejudge.consumer.offline", "evaluate JSON Lines files offline (same scores as the stream)"),
    "calibrate": ("tracejudge.consumer.calibrate", "measure the judges' agreement with human labels "
                                                   "and write a calibration file"),
    "run": ("tracejudge.consumer.stream", "consume traces from Kafka and export quality to Prometheus"),
    "sessions": ("tracejudge.consumer.sessions", "gather the trace results into conversations and evaluate "
                                                 "each session when it goes quiet"),
    "sink": ("tracejudge.consumer.sink_stage", "write the judges' verdicts from the results topic back to "
                                               "MLflow or an OpenTelemetry collector"),
    "agreement": ("tracejudge.consumer.agreement", "join human labels from a labels topic with the judges' "
                                                   "verdicts and export their agreement"),
    "backfill": ("tracejudge.consumer.backfill", "re-judge a time range of the input topics and publish "
                                                 "the results marked as backfill (resumable)"),
    "demo": ("tracejudge.consumer.demo.command", "run a local broker, a synthetic agent and the evaluator"),
}


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tracejudge", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tracejudge {__version__}")
    # No default here: `tracejudge run`/`sink` fall back to `logging.level` from their configuration.
    parser.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    args = build_parser(chosen).parse_args(argv)
    logging.basicConfig(level=args.log_level or "INFO", stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Per-request library lines (httpx's "HTTP Request: POST …") only with --log-level DEBUG.
    configure_library_logs(args.log_level or "INFO")
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.main(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
