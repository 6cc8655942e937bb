"""The command-line flags the `tracejudge` commands share, defined once so they cannot drift apart.

Every command that reads a configuration file takes `--config FILE`; every command that talks to
Kafka takes `--bootstrap-servers HOST:PORT[,...]`; every long-running stage takes `--metrics-port PORT`,
`--metrics-bind-address ADDR` and `--check-config`, with the same metavar and wording everywhere
(tests/test_cli_consistency.py holds them to it). `add_stage_arguments` adds the whole common set.

Each stage has its own default metrics port (`METRICS_PORTS`), so `run`, `sink`, `sessions`,
`agreement` and `backfill` can run side by side on one host without a flag. An explicit `http.port`
(configuration file, `TRACEJUDGE_HTTP__PORT`, `--metrics-port`) still wins: `with_command_port` fills
the command's default in only where none was given.

Kafka-free and cheap to import: `tracejudge eval` and `calibrate` use it too.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from tracejudge.consumer.config import Settings

__all__ = ["METRICS_PORTS", "add_bootstrap_servers_argument", "add_check_config_argument",
           "add_config_argument", "add_metrics_arguments", "add_stage_arguments", "metrics_port_default",
           "with_command_port"]

# The default port of /metrics, /healthz and /readyz per command. `run` keeps 9464 (the image's
# EXPOSE and HEALTHCHECK, the documented contract); the others follow it in the order they are
# usually added. deploy/ and the docs' commands page (docs/pages/commands/index.md) quote these.
METRICS_PORTS: Final = {"run": 9464, "sink": 9465, "sessions": 9466, "agreement": 9467, "backfill": 9468,
                         "findings": 9469}

CONFIG_METAVAR: Final = "FILE"
BOOTSTRAP_METAVAR: Final = "HOST:PORT[,...]"
PORT_METAVAR: Final = "PORT"
ADDRESS_METAVAR: Final = "ADDR"
TOPIC_METAVAR: Final = "TOPIC"
GROUP_METAVAR: Final = "GROUP"


def metrics_port_default(command: str) -> int:
    """The command's default metrics port; a `KeyError` for a command that serves none (a typo in a
    caller should fail its tests, not fall back to another stage's port)."""
    return METRICS_PORTS[command]


def add_config_argument(parser: argparse.ArgumentParser, help_text: str, *, required: bool = False) -> None:
    """`--config FILE`: the YAML configuration file (read as given; errors name the file)."""
    parser.add_argument("--config", metavar=CONFIG_METAVAR, required=required, help=help_text)


def add_bootstrap_servers_argument(parser: argparse.ArgumentParser) -> None:
    """`--bootstrap-servers HOST:PORT[,...]` over `kafka.bootstrap_servers`."""
    parser.add_argument("--bootstrap-servers", metavar=BOOTSTRAP_METAVAR,
                        help="Kafka brokers, comma-separated (kafka.bootstrap_servers)")


def add_metrics_arguments(parser: argparse.ArgumentParser, command: str, *, key: bool = True) -> None:
    """`--metrics-port PORT` and `--metrics-bind-address ADDR`, the help quoting the command's own
    default port. `key=False` for a command whose port is not `http.port` (backfill reads the run's
    file, whose `http.port` is the running stream's)."""
    port = metrics_port_default(command)
    where = "http.port, " if key else ""
    # Through http.port its range is checked with the configuration, naming the flag as the origin.
    parser.add_argument("--metrics-port", type=int if key else _port, metavar=PORT_METAVAR,
                        help=f"port of /metrics, /healthz, /readyz ({where}default {port} for `{command}`; "
                             "0 picks a free port)")
    parser.add_argument("--metrics-bind-address", metavar=ADDRESS_METAVAR,
                        help="address to serve them on (http.bind_address, default 0.0.0.0)")


def add_check_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check-config", action="store_true",
                        help="validate the configuration, print it (secrets redacted) and exit")


def add_stage_arguments(parser: argparse.ArgumentParser, command: str, *, config_help: str) -> None:
    """The flags of every long-running stage: `--config`, `--bootstrap-servers`, `--metrics-port`,
    `--metrics-bind-address`, `--check-config`."""
    add_config_argument(parser, config_help)
    add_bootstrap_servers_argument(parser)
    add_metrics_arguments(parser, command)
    add_check_config_argument(parser)


def with_command_port(settings: Settings, command: str) -> Settings:
    """`settings` with `http.port` set to the command's default unless one was given (file, environment
    or flag: pydantic remembers which fields were set)."""
    if "port" in settings.http.model_fields_set:
        return settings
    http = settings.http.model_copy(update={"port": metrics_port_default(command)})
    return settings.model_copy(update={"http": http})


def _port(text: str) -> int:
    """A TCP port, 0-65535, or an argparse error naming the flag's value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535; 0 picks a free port)")
    return value
