"""`tracejudge sink <kind>`: write the judges' verdicts from the results topic back where people look.

The command's arguments only: KIND and the flags (each overrides its configuration key), the chosen
sink's own `--help` (read off its module and settings class), `--check-config`, and `main`, which runs
the write-back stage (`SinkRunner`, consumer/stages/sink.py) until signalled.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from typing import Any

from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import BUILTIN_SINKS, ConfigError, Settings, load_settings
from tracejudge.consumer.runtime.arguments import with_command_port
from tracejudge.consumer.runtime.exit_status import SERVICE_FAILED
from tracejudge.consumer.runtime.logs import configure_logging
from tracejudge.consumer.runtime.process import add_runtime_arguments, run_until_signalled, runtime_overrides
from tracejudge.consumer.stages.sink import (
    SinkRunner,
    build_sink,
    load_sink_class,
    plan_sink,
    shown_for,
    sink_settings_type,
)

__all__ = ["add_arguments", "main", "settings_from_args", "sink_help"]

log = logging.getLogger("tracejudge.sink")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `tracejudge sink`; each flag overrides its configuration key."""
    parser.add_argument("kind", metavar="KIND", action=_SinkKind,
                        help="mlflow (MLflow assessments on the traces), otlp (OpenTelemetry "
                             "gen_ai.evaluation.result events to a collector), phoenix (Arize Phoenix "
                             "span annotations), or a kind named in "
                             "sink.plugins; `tracejudge sink KIND --help` describes that sink and its "
                             "sink.KIND: settings")
    add_runtime_arguments(
        parser, command="sink", config_help="YAML configuration file (its sink: section)",
        group=("sink.group_id", "consumer group (sink.group_id, default tracejudge-sink-KIND)"),
        results=("sink.results_topic",
                 "the results topic to read (sink.results_topic, default stream.results_topic)"),
        dead_letters=("sink.dead_letter_topic",
                      "route records that are not results here (sink.dead_letter_topic)"))


class _SinkKind(argparse.Action):
    """Stores KIND and makes the help the chosen sink's: argparse takes the positional before a later
    `--help`, so `tracejudge sink mlflow --help` describes the MLflow sink and its `sink.mlflow:` keys."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        description = sink_help(values)
        if description is not None:
            parser.description, parser.epilog = description


def sink_help(kind: str) -> tuple[str, str] | None:
    """(what the built-in sink `kind` does, its settings section and keys) for `--help`, read off the
    sink's module docstring and settings class so the help cannot drift from them; None for a kind
    that is not built in (a plugin's class is named in the configuration, unread at `--help`)."""
    spec = BUILTIN_SINKS.get(kind)
    if spec is None:
        return None
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        return f"the {kind} sink (not available here: {exc})", ""
    doc = sys.modules[cls.__module__].__doc__ or ""
    summary = " ".join(doc.strip().split("\n\n", 1)[0].split())
    settings_type = sink_settings_type(cls)
    # A `SinkSection` lists its keys (tracejudge.consumer.sinks.base).
    keys = settings_type.keys_help() if hasattr(settings_type, "keys_help") else []
    settings = (f"Settings: the sink.{kind}: section of --config: {', '.join(keys)}. "
                if keys else f"Settings: the sink.{kind}: section of --config. ")
    epilog = (settings + "It reads sink.results_topic (default stream.results_topic) as its own consumer "
              f"group (sink.group_id, default tracejudge-sink-{kind}); see "
              "https://tracejudge.github.io/tracejudge/writeback/")
    return summary or f"the {kind} sink", epilog


def settings_from_args(args: argparse.Namespace) -> Settings:
    return load_settings(getattr(args, "config", None), overrides=runtime_overrides(args),
                         require_topics=False)


def main(args: argparse.Namespace) -> int:
    """Entry point of `tracejudge sink KIND`: 0 after a clean stop, 1 when it cannot start or a write
    fails, 2 on bad configuration (reported before anything connects)."""
    kind = args.kind
    try:
        # The sink's own default metrics port unless http.port was given (`cli_args.METRICS_PORTS`).
        settings = with_command_port(settings_from_args(args), "sink")
        plan = plan_sink(settings, kind)
        cls = load_sink_class(plan, settings)
        own: Any = None  # the sink's validated section, shown by its own `redacted()` (secrets masked)
        if getattr(args, "check_config", False):
            settings_type = sink_settings_type(cls)
            if settings_type is not None:
                own = settings_type.from_mapping(plan.section, f"sink.{kind}")
    except ConfigError as exc:
        print(f"tracejudge sink: {exc.report()}", file=sys.stderr)
        return 2
    configure_logging(settings.logging)
    if getattr(args, "check_config", False):
        show = shown_for(settings, kind)
        for key, value in settings.redacted().items():
            if show(key):
                print(f"{key} = {json.dumps(value)}")
        print(f"sink.group_id (effective) = {json.dumps(plan.group_id)}")
        print(f"sink.results_topic (effective) = {json.dumps(plan.results_topic)}")
        reads_sessions = plan.session_results_topic if getattr(cls, "accepts_sessions", False) else None
        print(f"sink.session_results_topic (effective) = {json.dumps(reads_sessions)}")
        if callable(getattr(own, "redacted", None)):
            print(f"sink.{kind} (effective) = {json.dumps(own.redacted())}")
        return 0
    try:
        registry = CollectorRegistry(auto_describe=True)
        runner = SinkRunner(settings, kind, build_sink(plan, cls, registry), registry=registry)
    except ConfigError as exc:
        print(f"tracejudge sink: {exc.report()}", file=sys.stderr)
        return 2
    try:
        return run_until_signalled(runner)
    except ConfigError as exc:  # the sink's own check at start-up (`Sink.setup`)
        print(f"tracejudge sink: {exc.report()}", file=sys.stderr)
        log.error("the %s sink's configuration cannot work (above); exiting with status 2", kind)
        return 2
    except Exception:  # a failed write, logged where it failed
        log.error("the %s sink stopped on an error; exiting with status %d", kind, SERVICE_FAILED)
        return SERVICE_FAILED

if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tracejudge sink", description=__doc__.splitlines()[0])
    _parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (logging.level)")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
