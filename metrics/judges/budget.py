"""Per-endpoint request and token budgets.

A judgement asks for its whole cost up front (requests it will make, tokens it will send and may
receive). If the budget cannot cover it, the judgement is not queued: it is skipped with reason
`budget`, so a burst of traffic thins the judged sample instead of growing a backlog. When the call
is over, the estimate is replaced by the tokens the endpoint reported, so the token bucket tracks real
spend; a judgement that spent more than estimated leaves the bucket in debt and the next ones wait
their turn by being thinned.

Both buckets refill continuously. The request bucket holds one second of requests (at least one); the
token bucket holds `burst_seconds` (default 10 s) of the per-minute rate, which keeps a burst well
inside what providers enforce over a minute.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Cost", "EndpointBudget", "TokenBucket", "estimate_tokens"]


def estimate_tokens(text: str) -> int:
    """A tokenizer-free estimate: about 4 characters per token for English text and JSON."""
    return len(text) // 4 + 1


@dataclass(frozen=True, slots=True)
class Cost:
    requests: int
    tokens: int


class TokenBucket:
    """A continuously refilling bucket. `take` may drive it negative (debt) once it is full enough."""

    def __init__(self, rate_per_second: float, capacity: float, clock: Callable[[], float] = time.monotonic):
        self.rate = rate_per_second
        self.capacity = capacity
        self._clock = clock
        self._level = capacity
        self._at = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now

    @property
    def level(self) -> float:
        with self._lock:
            self._refill()
            return self._level

    def can_take(self, amount: float) -> bool:
        with self._lock:
            self._refill()
            # An amount larger than the bucket passes when the bucket is full, or it could never pass.
            return self._level >= min(amount, self.capacity)

    def take(self, amount: float) -> None:
        with self._lock:
            self._refill()
            self._level -= amount

    def give_back(self, amount: float) -> None:
        with self._lock:
            self._refill()
            self._level = min(self.capacity, self._level + amount)


class EndpointBudget:
    """Requests per second and tokens per minute for one endpoint; None means unlimited."""

    def __init__(
        self,
        requests_per_second: float | None,
        tokens_per_minute: int | None,
        *,
        burst_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.requests = (
            TokenBucket(requests_per_second, max(1.0, requests_per_second), clock)
            if requests_per_second
            else None
        )
        self.tokens = (
            TokenBucket(
                tokens_per_minute / 60.0, max(1.0, math.ceil(tokens_per_minute / 60.0 * burst_seconds)), clock
            )
            if tokens_per_minute
            else None
        )
        self._lock = threading.Lock()

    @property
    def limited(self) -> bool:
        return self.requests is not None or self.tokens is not None

    def try_acquire(self, cost: Cost) -> bool:
        """Take `cost` from both buckets, or nothing; False means over budget."""
        with self._lock:
            if self.requests is not None and not self.requests.can_take(cost.requests):
                return False
            if self.tokens is not None and not self.tokens.can_take(cost.tokens):
                return False
            if self.requests is not None:
                self.requests.take(cost.requests)
            if self.tokens is not None:
                self.tokens.take(cost.tokens)
            return True

    def settle(self, cost: Cost, *, requests_made: int, tokens_used: int) -> None:
        """Replace the estimate by what was actually spent."""
        if self.requests is not None and requests_made < cost.requests:
            self.requests.give_back(cost.requests - requests_made)
        if self.tokens is not None:
            diff = cost.tokens - tokens_used
            if diff > 0:
                self.tokens.give_back(diff)
            elif diff < 0:
                self.tokens.take(-diff)


# ----------------------------------------------------------------------------------------------
# Hard spend caps in dollars

# The windows a cap can be set over (`endpoints.<name>.usd_per_hour` / `usd_per_day`).
WINDOWS: dict[str, float] = {"hour": 3600.0, "day": 86400.0}


class SpendCap:
    """USD spent on one endpoint over the last hour and/or day, never more than the caps allow.

    A judgement is charged its estimated cost up front (`try_charge`): prompt tokens as estimated,
    the endpoint's `max_output_tokens` per request, times the model's price, so the estimate is what
    the request can cost at most when the prompt estimate holds. It is admitted only when what the
    window has spent (settled judgements and the estimates of those in flight) plus its estimate stays
    within every cap; otherwise it is skipped ("budget"). `settle` replaces the estimate by the cost
    of the usage the endpoint reported. So the reported spend exceeds a cap by no more than the
    in-flight judgements' estimated cost (and only where a reported usage exceeded its estimate).

    The windows slide in one-minute slots (a slot leaves the window whole), which keeps the state at
    most 1,440 numbers whatever the traffic.
    """

    SLOT_SECONDS = 60.0

    def __init__(self, caps: dict[str, float], clock: Callable[[], float] = time.monotonic) -> None:
        unknown = set(caps) - set(WINDOWS)
        if unknown:
            raise ValueError(f"unknown cap windows: {sorted(unknown)}")
        self.caps = dict(caps)
        self._clock = clock
        self._slots: dict[int, float] = {}
        self._lock = threading.Lock()
        self._span_slots = {w: int(WINDOWS[w] // self.SLOT_SECONDS) for w in self.caps}
        self._keep = max(self._span_slots.values(), default=0)

    def _now_slot(self) -> int:
        return int(self._clock() // self.SLOT_SECONDS)

    def _spent(self, window: str, now: int) -> float:
        first = now - self._span_slots[window] + 1
        return sum(v for k, v in self._slots.items() if k >= first)

    def _prune(self, now: int) -> None:
        if len(self._slots) > self._keep:
            first = now - self._keep + 1
            for k in [k for k in self._slots if k < first]:
                del self._slots[k]

    def try_charge(self, usd: float) -> bool:
        """Charge `usd` when every window can take it; False (nothing charged) when one cannot."""
        with self._lock:
            now = self._now_slot()
            self._prune(now)
            for window, cap in self.caps.items():
                if self._spent(window, now) + usd > cap:
                    return False
            self._slots[now] = self._slots.get(now, 0.0) + usd
            return True

    def settle(self, estimate: float, actual: float) -> None:
        """Replace a charged estimate by what the judgement cost."""
        with self._lock:
            now = self._now_slot()
            self._slots[now] = self._slots.get(now, 0.0) + (actual - estimate)

    def remaining(self) -> dict[str, float]:
        """USD each window can still spend (negative when reported usage overran the estimates)."""
        with self._lock:
            now = self._now_slot()
            return {w: cap - self._spent(w, now) for w, cap in self.caps.items()}
