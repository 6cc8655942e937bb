"""`tracejudge alerts render`: the Prometheus rules with every alert's links (`runbook_url`,
`dashboard_url`, `traces_url`) set from the configuration's `alerts:` section, for GitOps.

    tracejudge alerts render --config tracejudge.yaml --out rules/            # the shipped rules
    tracejudge alerts render --config tracejudge.yaml --rules mine.yml --out rendered.yml

Without `--rules` it renders the rules shipped in the package (the same file as
deploy/prometheus/rules/tracejudge.rules.yml), so a pip-installed tracejudge or the image renders them
too. `--rules` may be given several times (tracejudge's rules and an SLO rules file): `--out` is then a
directory, and each file keeps its name there. Each output is written through a temporary file renamed
into place only when complete; an output that is one of the inputs is refused. `--out -` (the default)
writes to standard output.

Exit status (`consumer/runtime/exit_status.py`): 0; 2 for a configuration error (the key named),
a rules file that cannot be read or edited, or an output that is an input; 3 when an output cannot be
written.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from pathlib import Path
from typing import IO

from tracejudge.consumer.commands.outputs import OutputError, refuse_overwriting_inputs, write_text
from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.config.alert_rules import render_rules
from tracejudge.consumer.runtime import exit_status
from tracejudge.schemas.errors import InputError

__all__ = ["PACKAGED_RULES", "add_arguments", "main", "packaged_rules"]

PACKAGED_RULES = "tracejudge.rules.yml"


def packaged_rules() -> str:
    """The text of the rules file shipped in the package (tracejudge.consumer.config)."""
    return resources.files("tracejudge.consumer.config").joinpath(PACKAGED_RULES).read_text(encoding="utf-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    render = actions.add_parser(
        "render", help="write the rules with every alert's links set from the alerts: section",
        description="Write Prometheus rules with absolute runbook_url, dashboard_url and traces_url "
                    "annotations on every alert, built from the configuration's alerts: section.")
    render.add_argument("--config", metavar="FILE", help="the configuration file (its alerts: section; "
                        "stream.app_tag too); without it, the defaults and TRACEJUDGE_ALERTS__* variables")
    render.add_argument("--rules", metavar="FILE", action="append", default=[],
                        help="a Prometheus rules file to render (repeatable; default: the rules shipped "
                             "with tracejudge)")
    render.add_argument("--out", metavar="FILE|DIR", default="-",
                        help="where to write: a file, a directory (each input keeps its name) or - for "
                             "standard output (default)")


def main(args: argparse.Namespace, err: IO[str] | None = None) -> int:
    err = err or sys.stderr
    try:
        settings = load_settings(args.config, require_topics=False)
    except ConfigError as exc:
        print(f"tracejudge alerts render: invalid configuration\n{exc.report()}", file=err)
        return exit_status.USAGE
    try:
        targets = _targets(args.rules, args.out)
        refuse_overwriting_inputs({f"--out ({i + 1})": out for i, (_, out) in enumerate(targets)},
                                  [*args.rules, *([args.config] if args.config else [])])
        rendered = [(out, render_rules(_read(source), settings.alerts, app_tag=settings.stream.app_tag,
                                       name=source or f"the packaged {PACKAGED_RULES}"))
                    for source, out in targets]
    except InputError as exc:
        print(f"tracejudge alerts render: {exc}", file=err)
        return exit_status.USAGE
    try:
        for out, text in rendered:
            write_text(out, text)
    except OutputError as exc:
        if exc.broken_pipe:
            raise BrokenPipeError from None  # the command line's handler ends silently, status 3
        print(f"tracejudge alerts render: {exc}", file=err)
        return exit_status.OUTPUT_ERROR
    for out, _ in rendered:
        if out != "-":
            print(f"tracejudge alerts render: wrote {out}", file=err)
    return exit_status.OK


def _targets(rules: list[str], out: str) -> list[tuple[str | None, str]]:
    """(input path, None for the packaged rules; output path or '-') per input. Several inputs need a
    directory; a directory output takes each input's name."""
    sources: list[str | None] = list(rules) or [None]
    is_dir = out != "-" and (os.path.isdir(out) or out.endswith(os.sep))
    if len(sources) > 1 and not is_dir:
        raise InputError(f"--out {out}: with {len(sources)} --rules files, --out must be an existing "
                         "directory")
    names = [Path(s).name if s else PACKAGED_RULES for s in sources]
    if is_dir and len(set(names)) != len(names):
        raise InputError("--rules: two files have the same name; render them to separate directories")
    return [(s, os.path.join(out, n) if is_dir else out) for s, n in zip(sources, names, strict=True)]


def _read(source: str | None) -> str:
    if source is None:
        return packaged_rules()
    try:
        return Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise InputError(f"cannot read --rules {source}: {reason}") from None
