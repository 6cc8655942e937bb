"""Waiting for the target of a verdict (a trace, a span, a session) that is not at the backend yet.

A sink's verdict may reach it before the thing it is about reaches the backend (traces are exported
in batches, a session row appears with its first span). Such a record is deferred
(`WriteReport.defer`), parked by the sink stage (tracejudge.consumer.stages.sink) and offered again
later; `UnknownTargets` is the sink's side of it, shared by the MLflow and Phoenix sinks: how long to
wait before the next look (a growing back-off) and when to give up (after a number of looks and a
window), per target, in a bounded table. Its four settings are typed here once (`RetryWindowS`,
`RetryAttempts`, `RetryBackoffS`, `RetryMaxBackoffS`: defaults and bounds), each sink naming them after its
target (`sink.mlflow.unknown_trace_*`, `sink.phoenix.unknown_span_*`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated

from pydantic import Field

__all__ = ["MAX_TRACKED_TARGETS", "RetryAttempts", "RetryBackoffS", "RetryMaxBackoffS", "RetryWindowS",
           "UnknownTargets"]

# Targets waited for at once (about 150 bytes each); the oldest is forgotten beyond it.
MAX_TRACKED_TARGETS = 100_000

# The settings of `UnknownTargets`, as a sink section's field types (a bad value is named by its key):
# the window after the first look before giving up (0: give up after the looks alone), the looks, the
# first wait before the next look, and the cap of the doubling wait.
RetryWindowS = Annotated[float, Field(default=300.0, ge=0, allow_inf_nan=False)]
RetryAttempts = Annotated[int, Field(default=5, ge=1)]
RetryBackoffS = Annotated[float, Field(default=0.5, gt=0, allow_inf_nan=False)]
RetryMaxBackoffS = Annotated[float, Field(default=5.0, gt=0, allow_inf_nan=False)]


class UnknownTargets:
    """Per target (a trace id, or a span or session id) not (yet) on the server:
    when it was first looked for and how many times.

    `seen(trace)` records one more look and says whether to give up: after `attempts` looks, once
    `window_s` have passed since the first. `wait_s(trace)` is how long to wait before the next look: a
    back-off from `backoff_s` doubling per look up to `max_backoff_s`, and no later than the deadline
    (so a trace is given up on soon after it, not up to a back-off later). An entry older than twice
    the window starts over (a trace met again long after, in a new result). Bounded: the least recently
    seen goes first."""

    def __init__(self, attempts: int, window_s: float, clock: Callable[[], float],
                 max_tracked: int = MAX_TRACKED_TARGETS, *, backoff_s: float = 0.5,
                 max_backoff_s: float = 5.0) -> None:
        self.attempts = attempts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._max = max_tracked
        self._table: OrderedDict[str, list[float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._table)

    def wait_s(self, trace_id: str) -> float:
        """Seconds until the trace is looked for again."""
        with self._lock:
            entry = self._table.get(trace_id)
            first, looks = (entry[0], int(entry[1])) if entry is not None else (self._clock(), 1)
        wait = min(self.max_backoff_s, self.backoff_s * 2 ** min(max(looks - 1, 0), 30))
        left = first + self.window_s - self._clock()
        return min(wait, left) if left > 0 else wait

    def seen(self, trace_id: str) -> bool:
        now = self._clock()
        with self._lock:
            entry = self._table.get(trace_id)
            # (Without a window, never: an entry would start over at every look and never give up.)
            stale = self.window_s > 0 and entry is not None \
                and now - entry[0] > 2 * self.window_s + self.max_backoff_s
            if entry is None or stale:
                entry = [now, 0.0]
            entry[1] += 1
            self._table[trace_id] = entry
            self._table.move_to_end(trace_id)
            while len(self._table) > self._max:
                self._table.popitem(last=False)
            return entry[1] >= self.attempts and now - entry[0] >= self.window_s

    def found(self, trace_id: str) -> None:
        with self._lock:
            self._table.pop(trace_id, None)
