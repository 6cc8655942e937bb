"""`tracejudge run`: consume traces from Kafka, evaluate them, export to Prometheus and a results topic.

The command's arguments only: each flag overrides its configuration key, and `main` runs the evaluation
stage (`StreamRunner`, consumer/stages/run.py) on the consumer runtime until signalled.
"""

from __future__ import annotations

import argparse
import sys

from tracejudge.consumer.config import Settings, load_settings
from tracejudge.consumer.runtime.process import add_runtime_arguments, runtime_overrides, stage_main
from tracejudge.consumer.stages.run import StreamRunner

__all__ = ["add_arguments", "main", "settings_from_args"]

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `tracejudge run`; each overrides its configuration key."""
    add_runtime_arguments(
        parser, command="run", config_help="YAML configuration file",
        group=("kafka.group_id", "consumer group (kafka.group_id)"),
        results=("stream.results_topic", "publish one JSON result per record here (stream.results_topic)"),
        dead_letters=("stream.dead_letter_topic",
                      "route undecodable records here (stream.dead_letter_topic)"))
    parser.add_argument("--topic", action="append", dest="topics", metavar="NAME[:FORMAT]",
                        help="topic to consume, repeatable; FORMAT is auto (default), agent_eval, mlflow, "
                             "inference_log, otlp_proto, otlp_json, otlp_logs_proto or otlp_logs_json "
                             "(stream.topics)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {**runtime_overrides(args), "stream.topics": getattr(args, "topics", None)}
    return load_settings(getattr(args, "config", None), overrides=overrides)


def main(args: argparse.Namespace) -> int:
    """Entry point of `tracejudge run`: 0 after a clean stop, 1 when it cannot start, 2 on bad config."""
    return stage_main("run", args, settings_from_args, lambda settings: StreamRunner(settings, tune_gc=True))

if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tracejudge run", description=__doc__.splitlines()[0])
    # `tracejudge --log-level X run` has it on the top-level parser.
    _parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (logging.level)")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
