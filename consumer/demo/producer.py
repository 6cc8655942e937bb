"""The demo's producer: a thread that runs the synthetic agent (`tracejudge.consumer.demo.agent`) at a
rate and produces each trace to Kafka, and what it counts of what it made (`ProducerStats`, by app),
which the summary (`tracejudge.consumer.demo.summary`) puts beside what the evaluator measured.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

# The most conversations the agent keeps open at once; fewer at low rates (see `conversations_for`).
MAX_CONCURRENT_CONVERSATIONS = 16


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
class Planted:
    """A cause planted in the agent (`AgentSettings.describe`), from the trace after `after`: when
    the first such trace was sent (seconds after the agent started; None: not yet) and how many
    traces it changed (for a stale document: those that retrieved it)."""

    description: str
    after: int
    started_seconds: float | None = None
    changed: int = 0


@dataclass
class ProducerStats:
    by_app: dict[str, AppCounts] = field(default_factory=dict)
    send_errors: int = 0
    last_send_error: str | None = None
    # By plant name (`tracejudge.consumer.demo.agent.PLANTS`), in the order planted.
    planted: dict[str, Planted] = field(default_factory=dict)

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
        self.stats = ProducerStats(planted={plant: Planted(settings.describe(plant), after)
                                            for plant, after in settings.planted_after().items()})
        self._sent = 0
        self._began = time.monotonic()
        self.error: BaseException | None = None
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

    def stop(self) -> None:
        self._stop_event.set()

    def snapshot(self) -> ProducerStats:
        with self._lock:
            return ProducerStats({app: AppCounts(**vars(c)) for app, c in self.stats.by_app.items()},
                                 self.stats.send_errors, self.stats.last_send_error,
                                 {name: Planted(**vars(p)) for name, p in self.stats.planted.items()})

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
                self._began = time.monotonic()
                self._loop(agent, producer)
        except Exception as exc:  # reported by `command.main`, which stops the demo
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
            self._sent += 1
            for name, planted in self.stats.planted.items():
                if self._sent == planted.after + 1:
                    planted.started_seconds = time.monotonic() - self._began
                planted.changed += name in item.planted

    def _send_failed(self, exc: BaseException) -> None:
        with self._lock:
            self.stats.send_errors += 1
            self.stats.last_send_error = f"{type(exc).__name__}: {exc}"

