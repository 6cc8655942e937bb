"""A stage's process: its entry point (`stage_main`), the signals that stop it
(`run_until_signalled`) and the command-line flags every stage shares (`add_runtime_arguments`,
`runtime_overrides`).

The runtime itself is `loop.py`'s `ConsumerRuntime`; the commands (`consumer/commands/`) and the
stages' `main` functions call these.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from tracejudge.consumer.config import ConfigError, Settings
from tracejudge.consumer.runtime.arguments import (
    GROUP_METAVAR,
    TOPIC_METAVAR,
    add_stage_arguments,
    with_command_port,
)
from tracejudge.consumer.runtime.exit_status import INTERRUPTED, SERVICE_FAILED
from tracejudge.consumer.runtime.logs import configure_logging
from tracejudge.consumer.runtime.loop import ConsumerRuntime
from tracejudge.schemas.errors import StartupError

__all__ = ["add_runtime_arguments", "run_until_signalled", "runtime_overrides", "stage_main"]



def run_until_signalled(runtime: ConsumerRuntime) -> int:
    """Run in this thread until SIGTERM/SIGINT (the first one drains and commits, a second exits at
    once without committing). 0 after a clean stop, 4 (`SERVICE_FAILED`) when it cannot start (logged in
    one line).
    Other exceptions propagate."""
    log = runtime.log
    signals = {"n": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        signals["n"] += 1
        if signals["n"] > 1:
            log.error("second %s: exiting now without committing", signal.Signals(signum).name)
            os._exit(INTERRUPTED)  # interrupted: nothing past the last commit is committed
        log.info("%s received: stopping", signal.Signals(signum).name)
        runtime.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        runtime.run()
    except StartupError as exc:
        log.error("%s; exiting with status %d", exc, SERVICE_FAILED)
        return SERVICE_FAILED
    return 0


def stage_main(name: str, args: Any, settings_from_args: Callable[[Any], Settings],
               make_runner: Callable[[Settings], ConsumerRuntime], *,
               plan: Callable[[Settings], Any] | None = None, show: Callable[[str], bool] | None = None,
               effective: Callable[[Any], Mapping[str, Any]] | None = None) -> int:
    """The entry point of a stage's command (`tracejudge run`, `sessions`, `agreement`): load the
    settings and the stage's `plan` (a `ConfigError` is reported before anything connects: status 2);
    with `--check-config` print the settings `show` picks (secrets redacted) and the `effective`
    values the plan resolved, status 0; else run until signalled (0 after a clean stop, 1 when it
    cannot start)."""
    try:
        # The stage's own default metrics port unless http.port was given (`cli_args.METRICS_PORTS`).
        settings = with_command_port(settings_from_args(args), name)
        planned = plan(settings) if plan is not None else None
    except ConfigError as exc:
        print(f"tracejudge {name}: {exc.report()}", file=sys.stderr)
        return 2
    configure_logging(settings.logging)
    if getattr(args, "check_config", False):
        for key, value in settings.redacted().items():
            if show is None or show(key):
                print(f"{key} = {json.dumps(value)}")
        for key, value in (effective(planned) if effective is not None else {}).items():
            print(f"{key} (effective) = {json.dumps(value)}")
        return 0
    try:
        runner = make_runner(settings)
    except ConfigError as exc:
        print(f"tracejudge {name}: {exc.report()}", file=sys.stderr)
        return 2
    return run_until_signalled(runner)


# -- command-line flags every stage shares ----------------------------------------------------------


def add_runtime_arguments(parser: Any, *, command: str, config_help: str, group: tuple[str, str],
                          results: tuple[str, str], dead_letters: tuple[str, str]) -> None:
    """The flags of every command on the runtime: the common stage flags (`cli_args`), then `group`,
    `results` and `dead_letters`, each the configuration key the flag overrides and its help text
    (`runtime_overrides` reads them back)."""
    add_stage_arguments(parser, command, config_help=config_help)
    parser.add_argument("--group-id", metavar=GROUP_METAVAR, help=group[1])
    parser.add_argument("--results-topic", metavar=TOPIC_METAVAR, help=results[1])
    parser.add_argument("--dead-letter-topic", metavar=TOPIC_METAVAR, help=dead_letters[1])
    parser.set_defaults(runtime_keys={"group_id": group[0], "results_topic": results[0],
                                      "dead_letter_topic": dead_letters[0]})


def runtime_overrides(args: Any) -> dict[str, Any]:
    """The configuration keys the shared flags set (None where a flag was not given)."""
    keys = getattr(args, "runtime_keys", {})
    overrides = {keys[flag]: getattr(args, flag, None) for flag in keys}
    overrides.update({
        "kafka.bootstrap_servers": getattr(args, "bootstrap_servers", None),
        "http.port": getattr(args, "metrics_port", None),
        "http.bind_address": getattr(args, "metrics_bind_address", None),
        "logging.level": getattr(args, "log_level", None),
    })
    return overrides

