"""Sessions without a stream: `tracejudge eval` and the Python API group turns into sessions and judge them.

The session stage (`tracejudge sessions`) closes a session after `sessions.inactivity_s` without a new
turn. A file has no "later": every session in it is closed by the end of the input
(`close_reason="end_of_input"`, status complete), and one evaluation per session is all there is. The
rest is the session stage's: turns ordered by their timestamp (`place_turn`: a turn without a sane
timestamp is placed at the run's wall clock, i.e. after the timestamped ones, in input order), the same
`session_metrics`, the same `SessionJudgeRunner` (the heuristic `user_frustration` when `judges:` has no
endpoint) and the same `SessionResult` line.

Memory: a session holds its `Turn`s (the texts a judge reads and a few numbers), never the full results,
until the end of the input.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tracejudge.schemas.result import Assessment, EvaluationResult
from tracejudge.schemas.session import (
    CLOSE_REASONS,
    SessionResult,
    SessionSource,
    Turn,
    session_metrics,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from tracejudge.consumer.config import Settings
    from tracejudge.metrics.judges.config import JudgesConfig
    from tracejudge.metrics.judges.sessions import SessionJudgeRunner

END_OF_INPUT = "end_of_input"
# Sessions being judged at once (each may call the endpoint); the runner's own budgets still apply.
JUDGE_WINDOW = 32


@dataclass(slots=True)
class GroupedSession:
    """The turns of one session gathered so far, in arrival order until `closed()` sorts them."""

    session_id: str
    user_id: str | None
    app: str | None
    source: SessionSource
    turns: list[Turn] = field(default_factory=list)

    def add(self, turn: Turn, user_id: str | None, app: str | None) -> None:
        self.turns.append(turn)
        # The first turn that states them; a turn without them does not erase them.
        self.user_id = self.user_id or user_id
        self.app = self.app or app

    def ordered_turns(self) -> list[Turn]:
        # Stable: turns with equal times (e.g. all placed at the same arrival) keep their input order.
        return sorted(self.turns, key=lambda t: t.timestamp)


class SessionGrouper:
    """Gathers results into sessions by `session_id` (results without one are counted, not held)."""

    def __init__(self, arrival: float | None = None) -> None:
        # One arrival time for the run: a turn without a sane timestamp goes after the timestamped
        # turns of its session, in input order (offline input has no arrival order of its own).
        self.arrival = time.time() if arrival is None else arrival
        self._sessions: dict[str, GroupedSession] = {}
        self.turns = 0
        self.without_session = 0

    def add(self, result: EvaluationResult) -> bool:
        """Hold the result's turn in its session; False (and counted) for a result without a session."""
        rec = result.record
        if not rec.session_id:
            self.without_session += 1
            return False
        session = self._sessions.get(rec.session_id)
        if session is None:
            src = result.source
            session = self._sessions[rec.session_id] = GroupedSession(
                rec.session_id, rec.user_id, rec.app,
                SessionSource(format=src.format, topic=src.topic, partition=src.partition,
                              first_offset=src.offset, last_offset=src.offset, file=src.file))
        elif result.source.offset is not None:
            session.source.last_offset = result.source.offset
        session.add(Turn.from_result(result, arrival=self.arrival), rec.user_id, rec.app)
        self.turns += 1
        return True

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    def close_all(self) -> Iterator[GroupedSession]:
        """Every session, in the order of their first turn in the input, released as they are taken."""
        while self._sessions:
            key = next(iter(self._sessions))
            yield self._sessions.pop(key)


def session_result(session: GroupedSession, assessments: list[Assessment] | None = None,
                   close_reason: str = END_OF_INPUT, turns: Sequence[Turn] | None = None) -> SessionResult:
    """The session result line of a closed session (its turns in timestamp order)."""
    ordered = list(turns) if turns is not None else session.ordered_turns()
    last = ordered[-1] if ordered else None
    return SessionResult(
        session_id=session.session_id, user_id=session.user_id, app=session.app,
        status=CLOSE_REASONS[close_reason], close_reason=close_reason,
        turns=[t.ref() for t in ordered],
        started_at=ordered[0].timestamp if ordered else None,
        ended_at=None if last is None else last.timestamp + (last.latency_seconds or 0.0),
        metrics=session_metrics(ordered), assessments=list(assessments or []), source=session.source)


class SessionEvaluation:
    """Closed sessions in, session results out in the same order, while up to `window` sessions are
    being judged concurrently by the session judges (None: metrics only)."""

    def __init__(self, judges: SessionJudgeRunner | None, window: int = JUDGE_WINDOW) -> None:
        self.judges = judges
        self.window = max(1, window)

    def results(self, sessions: Iterable[GroupedSession],
                close_reason: str = END_OF_INPUT) -> Iterator[SessionResult]:
        if self.judges is None:
            for session in sessions:
                yield session_result(session, close_reason=close_reason)
            return
        from tracejudge.metrics.judges.sessions import Conversation

        pending: deque[tuple[GroupedSession, list[Turn], Future[list[Assessment]]]] = deque()
        for session in sessions:
            turns = session.ordered_turns()
            future = self.judges.submit(Conversation(session.session_id, session.app, turns))
            pending.append((session, turns, future))
            if len(pending) >= self.window:
                yield self._finish(*pending.popleft(), close_reason)
        while pending:
            yield self._finish(*pending.popleft(), close_reason)

    @staticmethod
    def _finish(session: GroupedSession, turns: list[Turn], future: Future[list[Assessment]],
                close_reason: str) -> SessionResult:
        return session_result(session, future.result(), close_reason, turns)


def build_session_judges(settings: Settings, registry: CollectorRegistry | None = None,
                         config: JudgesConfig | None = None) -> SessionJudgeRunner | None:
    """The session judges of the `judges:` section (None without one): the heuristic
    `user_frustration` without an endpoint, as live. Their metrics go to `registry` (a private one
    by default). A `judges.sessions` error is a `ConfigError` naming the key."""
    judges = config if config is not None else settings.judges
    if judges is None:
        return None
    from prometheus_client import CollectorRegistry

    from tracejudge.metrics.judges.sessions import SessionJudgeRunner

    # A bad section raises `JudgeConfigError`, a `ConfigError` (tracejudge.schemas.errors).
    return SessionJudgeRunner(judges, registry if registry is not None else CollectorRegistry())


def api_session_id(turns: Sequence[Turn]) -> str:
    """A session id for turns that state none (Python API): derived from the turns, so the same turns
    get the same id, and the same sampling decision, in every run."""
    digest = hashlib.sha256()
    for t in turns:
        for part in (t.trace_id, t.request_id, t.request, t.response):
            digest.update((part or "").encode("utf-8", "surrogatepass") + b"\x00")
    return "session-" + digest.hexdigest()[:16]


def common_id(values: Iterable[str | None], what: str) -> str | None:
    """The one id the turns state (None when none does); ValueError when they disagree."""
    found = {v for v in values if v}
    if len(found) > 1:
        raise ValueError(f"the turns name more than one {what}: {sorted(found)[:3]}; "
                         f"pass {what}= to evaluate them as one session")
    return next(iter(found), None)


__all__ = ["END_OF_INPUT", "GroupedSession", "SessionEvaluation", "SessionGrouper", "api_session_id",
           "build_session_judges", "common_id", "session_result"]
