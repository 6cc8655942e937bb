"""`tracejudge slo render`: the Prometheus rules of the configuration's `slos:` section (recording rules
of each SLO's error ratio and error budget, the `SLOBurnFast` page and `SLOBurnSlow` ticket alerts with
their links from the `alerts:` section), for GitOps.

    tracejudge slo render --config tracejudge.yaml                         # to standard output
    tracejudge slo render --config tracejudge.yaml --out rules/tracejudge.slo.rules.yml

Load the file beside deploy/prometheus/rules/tracejudge.rules.yml: it reads only tracejudge's metrics,
and the shipped rules need none of it. A configuration without `slos:` renders a valid rules file with
no groups (status 0, and a note on standard error), so rendering after deleting the section removes the
alerts instead of leaving the old file in place. `--out` is written through a temporary file renamed into
place when complete; the configuration itself is never an output.

Exit status (`consumer/runtime/exit_status.py`): 0; 2 for a configuration error (the key named) or an
output that is the configuration; 3 when the output cannot be written.
"""

from __future__ import annotations

import argparse
import sys
from typing import IO

from tracejudge.consumer.commands.outputs import OutputError, refuse_overwriting_inputs, write_text
from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.config.alert_rules import render_rules
from tracejudge.consumer.config.slo_rules import render_slo_rules
from tracejudge.consumer.runtime import exit_status
from tracejudge.schemas.errors import InputError

__all__ = ["add_arguments", "main", "render"]

PROG = "tracejudge slo render"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    render_parser = actions.add_parser(
        "render", help="write the SLOs' recording rules and burn-rate alerts",
        description="Write the Prometheus rules of the configuration's slos: section: each SLO's error "
                    "ratio per window, its error budget remaining, and the SLOBurnFast (page) and "
                    "SLOBurnSlow (ticket) multi-window, multi-burn-rate alerts.")
    render_parser.add_argument("--config", metavar="FILE", required=True,
                               help="the configuration file (its slos:, judges: and alerts: sections)")
    render_parser.add_argument("--out", metavar="FILE", default="-",
                               help="the rules file to write, or - for standard output (default)")


def render(settings_path: str) -> tuple[str, int]:
    """The rendered rules of a configuration file (its `slos:`, with the `alerts:` links) and the number
    of SLOs in it. Raises `ConfigError` or `InputError`."""
    settings = load_settings(settings_path, require_topics=False)
    text = render_slo_rules(settings.slos, config=settings_path)
    if settings.slos:
        text = render_rules(text, settings.alerts, app_tag=settings.stream.app_tag, name="the SLO rules")
    return text, len(settings.slos)


def main(args: argparse.Namespace, err: IO[str] | None = None) -> int:
    err = err or sys.stderr
    try:
        text, count = render(args.config)
        refuse_overwriting_inputs({"--out": args.out}, [args.config])
    except ConfigError as exc:
        print(f"{PROG}: invalid configuration\n{exc.report()}", file=err)
        return exit_status.USAGE
    except InputError as exc:
        print(f"{PROG}: {exc}", file=err)
        return exit_status.USAGE
    try:
        write_text(args.out, text)
    except OutputError as exc:
        if exc.broken_pipe:
            raise BrokenPipeError from None  # the command line's handler ends silently, status 3
        print(f"{PROG}: {exc}", file=err)
        return exit_status.OUTPUT_ERROR
    if count == 0:
        print(f"{PROG}: {args.config} has no slos: section: the rules file has no groups", file=err)
    elif args.out != "-":
        print(f"{PROG}: wrote {count} SLO(s) to {args.out}", file=err)
    return exit_status.OK
