"""`tracejudge agreement`: join human labels with the judges' verdicts and export how often they agree.

The command's arguments only: each flag overrides its configuration key, and `main` runs the agreement
stage (`AgreementRunner`, consumer/stages/agreement.py) on the consumer runtime until signalled.
"""

from __future__ import annotations

import argparse
import sys

from tracejudge.consumer.config import Settings, load_settings
from tracejudge.consumer.runtime.arguments import GROUP_METAVAR, TOPIC_METAVAR, add_stage_arguments
from tracejudge.consumer.runtime.process import stage_main
from tracejudge.consumer.stages.agreement import DEFAULT_GROUP, AgreementRunner, plan_agreement

__all__ = ["add_arguments", "main", "settings_from_args"]

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tracejudge agreement`; each overrides its configuration key."""
    add_stage_arguments(parser, "agreement", config_help="YAML configuration file (its agreement: section)")
    parser.add_argument("--group-id", metavar=GROUP_METAVAR,
                        help=f"consumer group (agreement.group_id, default {DEFAULT_GROUP})")
    parser.add_argument("--results-topic", metavar=TOPIC_METAVAR,
                        help="the results topic to read (agreement.results_topic, "
                             "default stream.results_topic)")
    parser.add_argument("--labels-topic", metavar=TOPIC_METAVAR,
                        help="the human labels topic (agreement.labels_topic)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {"kafka.bootstrap_servers": getattr(args, "bootstrap_servers", None),
                 "agreement.group_id": getattr(args, "group_id", None),
                 "agreement.results_topic": getattr(args, "results_topic", None),
                 "agreement.labels_topic": getattr(args, "labels_topic", None),
                 "http.port": getattr(args, "metrics_port", None),
                 "http.bind_address": getattr(args, "metrics_bind_address", None),
                 "logging.level": getattr(args, "log_level", None)}
    return load_settings(getattr(args, "config", None), overrides=overrides, require_topics=False)


def main(args: argparse.Namespace) -> int:
    """Entry point of `tracejudge agreement`: 0 after a clean stop, 1 when it cannot start, 2 on bad
    configuration (reported before anything connects)."""
    return stage_main("agreement", args, settings_from_args, AgreementRunner, plan=plan_agreement,
                      show=lambda key: key.startswith(("agreement.", "kafka.", "http.", "logging.",
                                                       "prometheus.")),
                      effective=lambda plan: {"agreement.results_topic": plan.results_topic,
                                              "agreement.group_id": plan.group_id})

if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tracejudge agreement", description=__doc__.splitlines()[0])
    _parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (logging.level)")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
