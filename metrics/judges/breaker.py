"""The circuit breaker of a judge endpoint, and what the calls of one judgement did.

`CircuitBreaker`: closed -> (threshold consecutive failures) -> open -> (reset elapsed) -> half_open
(one probe) -> closed on success / open again, for twice as long, on failure. The endpoint client
(`tracejudge.metrics.judges.client.JudgeClient`) asks it right before each request leaves and tells it
each outcome; the runner (`tracejudge.metrics.judges.runner`) asks it before preparing a judgement.

`JudgeCallError` is a call that produced no usable answer. `CallLedger` is shared by the calls of one
judgement (a judge may gather several): requests sent and the last error an endpoint gave, so the
runner reports that error rather than a sibling's `circuit_open` refusal, and skips only a judgement
that sent nothing.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "CallLedger",
    "CircuitBreaker",
    "JudgeCallError",
    "Permit",
    "current_call_ledger",
    "reset_call_ledger",
    "use_call_ledger",
]


class JudgeCallError(Exception):
    """A call that produced no usable answer. `reason` is a bounded token (a metric label);
    `attempted` is False when no request was sent at all (the breaker refused the first attempt)."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        status: int | None = None,
        attempted: bool = True,
        requests: int = 0,
        body: str = "",
    ):
        self.reason = reason
        self.detail = detail
        self.status = status
        self.attempted = attempted
        self.requests = requests
        self.body = body
        super().__init__(f"{reason}: {detail}")


@dataclass(slots=True)
class Permit:
    probe: bool


class CircuitBreaker:
    """closed -> (threshold consecutive failures) -> open -> (reset elapsed) -> half_open (one probe)
    -> closed on success / open again, for twice as long, on failure. Back-pressure (a 429 with a
    Retry-After the client waits for) is neither: it leaves the count of failures as it is.

    Used from one event loop; not thread-safe (it needs no lock there)."""

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(
        self,
        failure_threshold: int = 5,
        reset_seconds: float = 30.0,
        max_reset_seconds: float = 300.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] | None = None,
    ):
        self.failure_threshold = failure_threshold
        self.reset_seconds = reset_seconds
        self.max_reset_seconds = max(max_reset_seconds, reset_seconds)
        self._clock = clock
        self._on_change = on_change
        self._state = self.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._current_reset = reset_seconds
        self._probe_in_flight = False
        self.opened_count = 0

    def _set(self, state: str) -> None:
        if state != self._state:
            self._state = state
            if self._on_change:
                self._on_change(state)

    def _advance(self) -> None:
        if self._state == self.OPEN and self._clock() - self._opened_at >= self._current_reset:
            self._probe_in_flight = False
            self._set(self.HALF_OPEN)

    @property
    def state(self) -> str:
        self._advance()
        return self._state

    def allows(self) -> bool:
        """Would a call be let through now? (Does not take the half-open probe.)"""
        self._advance()
        return self._state == self.CLOSED or (self._state == self.HALF_OPEN and not self._probe_in_flight)

    def try_acquire(self) -> Permit | None:
        self._advance()
        if self._state == self.CLOSED:
            return Permit(probe=False)
        if self._state == self.HALF_OPEN and not self._probe_in_flight:
            self._probe_in_flight = True
            return Permit(probe=True)
        return None

    def refuses_for(self) -> float:
        """Seconds until the open circuit lets a probe through; 0 when it is not open."""
        if self.state != self.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self._current_reset - self._clock())

    def back_pressure(self, permit: Permit) -> None:
        """The endpoint answered and asked to wait (429 with a Retry-After the client honours): not a
        failure. A probe answered so closes the circuit, since the endpoint is up; other calls change
        nothing (the failures counted so far stay counted)."""
        if permit.probe:
            self.record(permit, True)

    def release(self, permit: Permit) -> None:
        """The call ended without a verdict on the endpoint (cancelled): free the probe slot."""
        if permit.probe and self._state == self.HALF_OPEN:
            self._probe_in_flight = False

    def record(self, permit: Permit, ok: bool) -> None:
        if permit.probe:
            self._probe_in_flight = False
            if ok:
                self._failures = 0
                self._current_reset = self.reset_seconds
                self._set(self.CLOSED)
            else:
                self._open(min(self.max_reset_seconds, self._current_reset * 2))
            return
        if self._state != self.CLOSED:
            # A call issued before the breaker opened: its outcome says nothing about now.
            return
        if ok:
            self._failures = 0
            return
        self._failures += 1
        if self._failures >= self.failure_threshold:
            self._open(self.reset_seconds)

    def _open(self, reset: float) -> None:
        self._current_reset = reset
        self._opened_at = self._clock()
        self._failures = 0
        self.opened_count += 1
        self._set(self.OPEN)


class CallLedger:
    """What the calls of one judgement did, shared by the calls it runs concurrently (a judge may gather
    several): requests sent and the last error an endpoint gave. A call refused by the open circuit
    knows only about itself; the ledger lets the runner report the error a sibling call got instead of
    `circuit_open`, and skip only a judgement that sent nothing (`use_call_ledger`)."""

    __slots__ = ("failure", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.failure: tuple[str, str] | None = None

    def explain(self, exc: JudgeCallError) -> tuple[str, str]:
        """(reason, detail) to report for a judgement that ended in `exc`."""
        if exc.reason == "circuit_open" and self.failure is not None:
            reason, detail = self.failure
            return reason, f"{detail}; not retried: circuit open"
        return exc.reason, exc.detail


_LEDGER: contextvars.ContextVar[CallLedger | None] = contextvars.ContextVar("judge_calls", default=None)


def use_call_ledger(ledger: CallLedger | None) -> contextvars.Token[CallLedger | None]:
    """Make `ledger` the current judgement's (the tasks it starts share it); undo with `reset_call_ledger`."""
    return _LEDGER.set(ledger)


def reset_call_ledger(token: contextvars.Token[CallLedger | None]) -> None:
    _LEDGER.reset(token)


def current_call_ledger() -> CallLedger | None:
    """The ledger of the judgement this call belongs to (None outside a judgement)."""
    return _LEDGER.get()
