"""`tracejudge sessions`: gather the trace results into conversations and evaluate each when it goes quiet.

The command's arguments only: each flag overrides its configuration key, and `main` runs the session
stage (`SessionRunner`, consumer/stages/sessions.py) on the consumer runtime until signalled.
"""

from __future__ import annotations

import argparse
import sys

from tracejudge.consumer.config import Settings, load_settings
from tracejudge.consumer.runtime.arguments import TOPIC_METAVAR
from tracejudge.consumer.runtime.process import add_runtime_arguments, runtime_overrides, stage_main
from tracejudge.consumer.stages.sessions import DEFAULT_GROUP, SessionRunner, plan_sessions, shown_setting

__all__ = ["add_arguments", "main", "settings_from_args"]

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tracejudge sessions`; each overrides its configuration key."""
    add_runtime_arguments(
        parser, command="sessions",
        config_help="YAML configuration file (its sessions: and judges: sections)",
        group=("sessions.group_id", f"consumer group (sessions.group_id, default {DEFAULT_GROUP})"),
        results=("sessions.results_topic", "publish one session result per closed session here "
                                           "(sessions.results_topic, required)"),
        dead_letters=("sessions.dead_letter_topic",
                      "route records that are not trace results here (sessions.dead_letter_topic)"))
    parser.add_argument("--input-topic", metavar=TOPIC_METAVAR,
                        help="the trace results topic to read (sessions.input_topic, default "
                             "stream.results_topic)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {**runtime_overrides(args), "sessions.input_topic": getattr(args, "input_topic", None)}
    return load_settings(getattr(args, "config", None), overrides=overrides, require_topics=False)


def main(args: argparse.Namespace) -> int:
    """Entry point of `tracejudge sessions`: 0 after a clean stop, 1 when it cannot start, 2 on bad
    configuration (reported before anything connects)."""
    return stage_main("sessions", args, settings_from_args, lambda s: SessionRunner(s, tune_gc=True),
                      plan=plan_sessions, show=shown_setting,
                      effective=lambda plan: {"sessions.input_topic": plan.input_topic,
                                              "sessions.group_id": plan.group_id})

if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tracejudge sessions", description=__doc__.splitlines()[0])
    _parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (logging.level)")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
