"""The stages the demo runs in its own process: `tracejudge run`'s `StreamRunner` (`EmbeddedRunner`)
and, with the demo's own broker, `tracejudge sessions`' `SessionRunner` (`EmbeddedSessions`), each in a
thread, started until it serves /metrics and stopped with its drain; and `DemoUnavailable`, why the
demo cannot run (a stage that did not start, a missing extra, an unreachable Kafka).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tracejudge.consumer.demo.agent import APP_TAG, VERSION_TAG
from tracejudge.consumer.demo.summary import REOPENED, SESSIONS, Samples

DEFAULT_GROUP = "tracejudge-demo"
SESSIONS_GROUP = "tracejudge-demo-sessions"


def evaluation_overrides() -> dict[str, Any]:
    """How the demo's runner reads and judges the agent's traces, as `load_settings` overrides: the
    app from the agent's tag, the version from its version tag, and an empty judges section: with no
    model endpoint, the model-free heuristic groundedness and relevance_to_query judges run on every
    answered trace. The tests evaluate the agent's traces offline with the same (`Evaluator(load_settings(...,
    overrides=evaluation_overrides(), offline=True))`)."""
    return {"stream.app_tag": APP_TAG, "stream.version_tag": VERSION_TAG, "judges": {}}


class DemoUnavailable(RuntimeError):
    """The demo cannot run; the message says why (and what to do), without a traceback."""


class EmbeddedStage:
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
        except BaseException as exc:  # reported by the command (`command.main`)
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


class EmbeddedRunner(EmbeddedStage):
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
            "http.bind_address": "127.0.0.1",
            "http.port": metrics_port,
            # The agent names its app in a trace tag (without it the app would be "experiment:1"),
            # its version in another; the heuristic judges.
            **evaluation_overrides(),
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


class EmbeddedSessions(EmbeddedStage):
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

