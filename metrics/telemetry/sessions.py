"""The Prometheus series of the session stage (`tracejudge sessions`, `consumer/stages/sessions.py`).

The runtime's own series (commits, rebalances, lag, in-flight records) come from `ConsumerMetrics`;
these say what the sessions are (`tracejudge_sessions_total{app,status}`, turns and duration
histograms) and what the stage holds and gives up (open-session gauges, early closes by the limit
that caused them, reopened sessions, turns placed by arrival or ignored). The session judges'
series are registered by `SessionJudgeRunner` on the same registry.

Labels come from bounded sets: `status` (complete, incomplete), the closed sets of reasons below,
and `app`, capped by `AppLabelLimiter` as `tracejudge run` caps it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tracejudge.metrics.app_labels import AppLabelLimiter
from tracejudge.metrics.telemetry.consumer import ConsumerMetrics

__all__ = ["DURATION_BUCKETS", "EARLY_CLOSE_REASONS", "FORGET_REASONS", "IGNORE_REASONS", "PLACED_REASONS",
           "TURN_BUCKETS", "SessionMetrics"]

TURN_BUCKETS = (1, 2, 3, 4, 5, 8, 10, 15, 20, 30, 50, 75, 100, 200)
# From a one-question exchange to a working day.
DURATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0)

# Why a session was closed before it went quiet: its own caps, or a memory cap of the stage (evicted).
EARLY_CLOSE_REASONS = ("max_turns", "max_duration", "max_open_sessions", "max_turns_held", "max_bytes_held")
# Why a turn was placed by its arrival time instead of its own timestamp.
PLACED_REASONS = ("missing", "absurd")
# Why a results-topic line was not made a turn (its offset is released at once).
IGNORE_REASONS = ("no_session", "session_result", "duplicate")
# Why a remembered closed session was forgotten (a later turn then starts a new session).
FORGET_REASONS = ("max_closed_sessions", "memory")


class SessionMetrics(ConsumerMetrics):
    """The runtime's series plus the session stage's, on `registry`."""

    def __init__(self, registry: CollectorRegistry, *, max_apps: int = 100) -> None:
        super().__init__(registry)
        r = registry
        self.sessions = Counter("tracejudge_sessions", "Sessions closed and evaluated, by app and status "
                                "(incomplete: closed at max_turns, max_duration or a memory cap).",
                                ["app", "status"], registry=r)
        self.session_turns = Histogram("tracejudge_session_turns", "Turns per evaluated session.", ["app"],
                                       buckets=TURN_BUCKETS, registry=r)
        self.session_duration = Histogram("tracejudge_session_duration_seconds", "Duration of evaluated "
                                          "sessions: first turn's start to the last turn's end.", ["app"],
                                          buckets=DURATION_BUCKETS, registry=r)
        self.open = Gauge("tracejudge_sessions_open", "Sessions open (gathering turns).", registry=r)
        self.turns_held = Gauge("tracejudge_session_turns_held", "Turns held by open sessions.",
                                registry=r)
        self.bytes_held = Gauge("tracejudge_session_bytes_held", "Estimated bytes held by open sessions "
                                "(texts plus a fixed per-turn overhead).", registry=r)
        self.remembered = Gauge("tracejudge_sessions_remembered", "Closed sessions remembered with their "
                                "turns, so a late turn reopens them (sessions.max_closed_sessions).",
                                registry=r)
        self.closed_early = Counter("tracejudge_sessions_closed_early", "Sessions closed before they went "
                                    "quiet, as incomplete, by the limit reached (max_turns, max_duration, "
                                    "or a memory cap: the least recently active session is evicted).",
                                    ["reason"], registry=r)
        self.reopened = Counter("tracejudge_sessions_reopened", "Closed sessions reopened by a later turn "
                                "(evaluated again with every turn).", registry=r)
        self.forgotten = Counter("tracejudge_sessions_forgotten", "Remembered closed sessions forgotten "
                                 "(a later turn starts a new session, evaluation 1), by reason.", ["reason"],
                                 registry=r)
        self.dropped = Counter("tracejudge_sessions_dropped", "Open sessions dropped uncommitted because "
                               "their partition was revoked or the stage stopped (the partition's next "
                               "owner rebuilds them from the uncommitted turns).", registry=r)
        # Not `tracejudge_session_turns_total`: a counter family of that name would collide with the
        # `tracejudge_session_turns` histogram (the same family name in OpenMetrics, both `_created`).
        self.turns = Counter("tracejudge_session_turns_received", "Turns (trace results with a session id) "
                             "taken into sessions.", registry=r)
        self.placed_by_arrival = Counter("tracejudge_session_turns_placed_by_arrival", "Turns whose "
                                         "timestamp was missing or absurd, placed by their arrival time.",
                                         ["reason"], registry=r)
        self.ignored = Counter("tracejudge_session_turns_ignored", "Results-topic lines not made turns, by "
                               "reason (no_session: a result without a session id; session_result: a "
                               "session result line; duplicate: a turn the session already holds).",
                               ["reason"], registry=r)
        self.ids_hashed = Counter("tracejudge_session_ids_hashed", "Session results whose session id was "
                                  "longer than 256 UTF-8 bytes and hashed into the Kafka key.", registry=r)
        self.results_published = Counter("tracejudge_session_results_published", "Session results "
                                         "acknowledged by the broker.", registry=r)
        self.result_publish_failures = Counter("tracejudge_session_result_publish_failures", "Session "
                                               "results the producer failed to deliver (retried; the "
                                               "turns' offsets wait).", registry=r)
        self.dead_letters = Counter("tracejudge_session_dead_letters", "Results-topic records that are not "
                                    "trace results this stage can read, by reason.", ["reason"], registry=r)
        self.dead_letters_unrouted = Counter("tracejudge_session_dead_letters_unrouted", "Of those, the "
                                             "ones only logged (no sessions.dead_letter_topic).", ["reason"],
                                             registry=r)
        self.dead_letter_publish_failures = Counter(
            "tracejudge_session_dead_letter_publish_failures", "Dead letters the producer failed to "
            "deliver (retried; the offset waits).", registry=r)
        self.app_overflow = Counter("tracejudge_app_label_overflow", "Sessions whose app was exported as "
                                    "'other' because the distinct-app cap was reached.", registry=r)
        self.apps = AppLabelLimiter(max_apps, self.app_overflow)
        for reason in EARLY_CLOSE_REASONS:
            self.closed_early.labels(reason)
        for reason in PLACED_REASONS:
            self.placed_by_arrival.labels(reason)
        for reason in IGNORE_REASONS:
            self.ignored.labels(reason)
        for reason in FORGET_REASONS:
            self.forgotten.labels(reason)
        self._series: dict[tuple[str, str], tuple[Counter, Histogram, Histogram]] = {}

    def count_dead_letter(self, topic: str, reason: str, routed: bool) -> None:
        """What `consumer.sinks.DeadLetterSink` counts."""
        self.dead_letters.labels(reason).inc()
        if not routed:
            self.dead_letters_unrouted.labels(reason).inc()

    def session(self, app: str | None, status: str, turns: int, duration: float | None) -> None:
        """One evaluated session."""
        label = self.apps(app)
        series = self._series.get((label, status))
        if series is None:
            series = self._series[(label, status)] = (self.sessions.labels(label, status),
                                                      self.session_turns.labels(label),
                                                      self.session_duration.labels(label))
        series[0].inc()
        series[1].observe(turns)
        if duration is not None:
            series[2].observe(duration)
