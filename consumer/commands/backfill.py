"""`tracejudge backfill`: re-judge a time range of the input topics and publish the results, marked.

The command's arguments only: `--from`/`--to` and the flags, the progress series on `--metrics-port`
(`metrics/telemetry/backfill.py`), Ctrl-C, the summary and the command that resumes an interrupted run.
The run itself is `BackfillRun` (consumer/stages/backfill.py).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from typing import IO, Any

from kafka.errors import KafkaError
from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import ConfigError, Settings, load_settings
from tracejudge.consumer.runtime.arguments import (
    GROUP_METAVAR,
    TOPIC_METAVAR,
    add_bootstrap_servers_argument,
    add_config_argument,
    add_metrics_arguments,
    metrics_port_default,
)
from tracejudge.consumer.runtime.exit_status import SERVICE_FAILED
from tracejudge.consumer.runtime.http import OperationsServer
from tracejudge.consumer.stages.backfill import BackfillError, BackfillRun, parse_time
from tracejudge.metrics.telemetry.backfill import BackfillProgress

__all__ = ["add_arguments", "main"]

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="start", required=True, metavar="TIME",
                        help="re-judge records from this time: ISO 8601, epoch seconds, or a duration ago "
                             "(6h, 7d)")
    parser.add_argument("--to", dest="end", metavar="TIME",
                        help="up to (not including) this time (default: the topics' end when the run starts)")
    add_config_argument(parser, "the YAML file `tracejudge run` reads (topics, judges, results topic)",
                        required=True)
    add_bootstrap_servers_argument(parser)
    parser.add_argument("--judges", metavar="A,B", help="the judges to run (default: every configured judge)")
    parser.add_argument("--group-id", metavar=GROUP_METAVAR,
                        help="consumer group (default: tracejudge-backfill-<run id>, so the same command "
                             "resumes)")
    parser.add_argument("--results-topic", metavar=TOPIC_METAVAR,
                        help="publish the results here (default: stream.results_topic)")
    # Not http.port: the file is the running stream's, whose port is taken by `tracejudge run`.
    add_metrics_arguments(parser, "backfill", key=False)


def _serve_progress(run: BackfillRun, args: argparse.Namespace, settings: Settings,
                    err: IO[str]) -> tuple[OperationsServer | None, bool]:
    """Serve the run's progress (`BackfillProgress`) on `--metrics-port` (default 9468) unless
    `http.enabled` is false: (the server, True), or (None, False) when the port the user asked for
    cannot be bound. The default port taken (another backfill on this host) only warns: the metrics
    are an extra, the terminal has the progress."""
    if not settings.http.enabled:
        return None, True
    port = args.metrics_port if getattr(args, "metrics_port", None) is not None \
        else metrics_port_default("backfill")
    host = getattr(args, "metrics_bind_address", None) or settings.http.bind_address
    registry = CollectorRegistry(auto_describe=True)
    registry.register(BackfillProgress(run.tally.snapshot))
    try:
        server = OperationsServer(registry, host=host, port=port).start()
    except OSError as exc:
        asked = getattr(args, "metrics_port", None) is not None
        print(f"tracejudge backfill: cannot serve metrics on {host}:{port} (--metrics-port): "
              f"{exc.strerror or exc}; {'' if asked else 'going on without them; '}"
              "--metrics-port 0 picks a free port", file=err)
        return None, not asked
    print(f"tracejudge backfill: progress metrics on http://{host}:{server.port}/metrics", file=err)
    return server, True


def main(args: argparse.Namespace, *, stop_event: threading.Event | None = None) -> int:
    """0 when the range is done, 130 when interrupted (Ctrl-C), 1 when it cannot run, 2 on bad input."""
    err = sys.stderr
    try:
        now = time.time()
        start = parse_time(args.start, now)
        end = parse_time(args.end, now) if args.end else None
        overrides = {"kafka.bootstrap_servers": args.bootstrap_servers}
        settings = load_settings(args.config, overrides=overrides)
        judges = [j.strip() for j in args.judges.split(",") if j.strip()] if args.judges else None
        stop = stop_event or threading.Event()
        run = BackfillRun(settings, start=start, end=end, judges=judges, group_id=args.group_id,
                          results_topic=args.results_topic, stop_event=stop, out=err)
    except ConfigError as exc:
        print(f"tracejudge backfill: invalid configuration\n{exc.report()}", file=err)
        return 2
    except BackfillError as exc:
        print(f"tracejudge backfill: {exc}", file=err)
        return 2
    judged = ", ".join(run.judges.judge_names())
    print(f"tracejudge backfill {run.run_id}: {', '.join(run.topics)} from {_iso(start)} to "
          f"{_iso(end) if end is not None else 'the end at start'}; judges {judged}; group {run.group_id}; "
          f"results to {run.results_topic}", file=err)
    server, served = _serve_progress(run, args, settings, err)
    if not served:
        run.judges.close()
        return SERVICE_FAILED
    previous = _on_sigint(stop) if threading.current_thread() is threading.main_thread() else None
    try:
        tally = run.run()
    except BackfillError as exc:
        print(f"tracejudge backfill: {exc}", file=err)
        return SERVICE_FAILED
    except KafkaError as exc:
        print(f"tracejudge backfill: cannot read from Kafka ({', '.join(settings.kafka.bootstrap_servers)}): "
              f"{type(exc).__name__}: {exc}", file=err)
        return SERVICE_FAILED
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if server is not None:
            server.stop()
    if run.tally.resumed:
        print(f"resumed {run.tally.resumed} partitions from the group's committed offsets", file=err)
    print(f"tracejudge backfill {run.run_id} {'summary' if run.completed else 'stopped'}", file=err)
    print(tally.render(), file=err)
    if not run.completed:
        command = _resume_command(args, start, end)
        print(f"interrupted: what was published is committed; resume with the same command:\n  {command}",
              file=err)
        return 130
    return 0


def _on_sigint(stop: threading.Event) -> Any:
    """Ctrl-C sets `stop`: the loop finishes what it handed on, commits, and the run reports."""
    return signal.signal(signal.SIGINT, lambda _sig, _frame: stop.set())


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _resume_command(args: argparse.Namespace, start: float, end: float | None) -> str:
    """The command that resumes this run: the same arguments, with a relative `--from 6h` written as
    the absolute time it meant (a new "6h ago" would be another range, another run)."""
    words = ["tracejudge", "backfill", "--from", _iso(start)]
    if end is not None:
        words += ["--to", _iso(end)]
    words += ["--config", str(args.config)]
    for flag in ("judges", "group_id", "results_topic", "bootstrap_servers", "metrics_port",
                 "metrics_bind_address"):
        if (value := getattr(args, flag, None)) is not None:
            words += [f"--{flag.replace('_', '-')}", str(value)]
    return shlex.join(words)
