"""Cheap signals: what a trace says about itself without a judge, as computed metrics of 1.0 (present)
or 0.0 (absent), left out (None) when the record cannot say.

Per record, pure (`record_signals`, in `ComputedMetrics.compute`, so decode workers compute them too):

- `signal_tool_retry_loop`: a tool called again with the same arguments in one trace (name and
  canonical-JSON input equal, as the trajectory metrics compare calls). None without a trajectory.
- `signal_empty_retrieval`: the trace has a retrieval step and it returned no document
  (`retrieved_context == []`); 0.0 when it returned some; None when the trace has no retrieval step
  (`retrieved_context is None`: nothing was asked of a retriever, which is not "retrieved nothing").
- `prompt_cache_hit_ratio`: cached (cache-read) input tokens / input tokens, only when the trace states
  its cached tokens (`TokenUsage.cached_input`) and some input tokens; None otherwise.

Relative to the app's norm, stateful (`AppNorms`, applied in record order by the pipeline: offline in
the order of the input, in the stream in the order results reach the consumer thread):

- `signal_answer_overlong`: the answer is longer (characters) than `answer_factor` x the app's running
  `quantile` of answer lengths.
- `signal_tool_result_oversized`: the trace's largest tool result (characters as stated,
  `EvalRecord.max_tool_result_chars`) is larger than `tool_result_factor` x the app's running quantile
  of them.
- `signal_repeated_answer`: the same answer (case and white space folded) was given recently in the
  same app to a different request (likewise folded): a canned or stuck answer.

A norm is a P² estimate of the app's quantile (Jain & Chlamtac 1985: five markers, O(1) memory and
time, deterministic), compared with the value before the value is added; it says nothing (None) until
the app has `warmup` values. State is bounded: at most `max_apps` apps (the others get None, counted in
`dropped["app_over_cap"]`), and at most `answers_per_app` remembered answers per app, least recently
seen evicted first (counted in `dropped["answer_evicted"]`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import orjson
from pydantic import Field

from tracejudge.metrics.sections import Section
from tracejudge.schemas.record import EvalRecord, ToolCall

__all__ = [
    "ANSWER_EVICTED",
    "ANSWER_OVERLONG",
    "APP_OVER_CAP",
    "CACHE_HIT_RATIO",
    "EMPTY_RETRIEVAL",
    "REPEATED_ANSWER",
    "SIGNALS",
    "TOOL_RESULT_OVERSIZED",
    "TOOL_RETRY_LOOP",
    "AppNorms",
    "P2Quantile",
    "SignalsConfig",
    "call_key",
    "fold_text",
    "record_signals",
    "tool_retry_loop",
]

TOOL_RETRY_LOOP = "signal_tool_retry_loop"
TOOL_RESULT_OVERSIZED = "signal_tool_result_oversized"
ANSWER_OVERLONG = "signal_answer_overlong"
EMPTY_RETRIEVAL = "signal_empty_retrieval"
REPEATED_ANSWER = "signal_repeated_answer"
CACHE_HIT_RATIO = "prompt_cache_hit_ratio"
# The 0/1 signals, in the order results list them (the `signal` label of `tracejudge_signals_total`).
SIGNALS = (TOOL_RETRY_LOOP, TOOL_RESULT_OVERSIZED, ANSWER_OVERLONG, EMPTY_RETRIEVAL, REPEATED_ANSWER)

# Why state was not kept (`AppNorms.dropped`, the `reason` label of `tracejudge_signal_state_dropped_total`).
APP_OVER_CAP = "app_over_cap"
ANSWER_EVICTED = "answer_evicted"


class SignalsConfig(Section):
    """`metrics.signals` in the configuration file."""

    # Off: no signal and no cache-hit ratio is computed or exported.
    enabled: bool = True
    # `signal_tool_retry_loop`: a tool called again with the same arguments in one trace.
    tool_retry_loop: bool = True
    # `signal_tool_result_oversized`: the trace's largest tool result is over tool_result_factor x the app's
    # norm.
    tool_result_oversized: bool = True
    # `signal_answer_overlong`: the answer is longer than answer_factor x the app's norm.
    answer_overlong: bool = True
    # `signal_empty_retrieval`: the trace has a retrieval step that returned no document.
    empty_retrieval: bool = True
    # `signal_repeated_answer`: the same answer was given recently in the same app to a different request.
    repeated_answer: bool = True
    # `prompt_cache_hit_ratio`: cached input tokens / input tokens, in traces that state them.
    prompt_cache_hit_ratio: bool = True
    # An app's values seen before its norm says anything (P² needs five).
    warmup: int = Field(default=50, ge=5)
    # The app's running quantile the norm-relative signals compare with.
    quantile: float = Field(default=0.95, gt=0, lt=1)
    # An answer longer than this times the app's running quantile of answer lengths is overlong.
    answer_factor: float = Field(default=1.5, gt=0)
    # A tool result larger than this times the app's running quantile of them is oversized.
    tool_result_factor: float = Field(default=1.5, gt=0)
    # Apps with state of their own (as `prometheus.max_apps` bounds the app label); later apps get None.
    max_apps: int = Field(default=100, ge=1)
    # Recent answers remembered per app for `signal_repeated_answer`.
    answers_per_app: int = Field(default=1000, ge=1)


def tool_retry_loop(trajectory: Sequence[ToolCall]) -> float:
    """1.0 when some tool is called again with the same arguments (inputs compared as canonical JSON)."""
    if len(trajectory) < 2:
        return 0.0
    # Per record on the hot path: only calls of the same tool are compared, as Python values first
    # (key order ignored, as canonical JSON ignores it), canonical JSON confirming a match.
    by_name: dict[str, list[Any]] = {}
    for call in trajectory:
        name, given = call.tool_name, call.tool_input
        earlier = by_name.get(name)
        if earlier is None:
            by_name[name] = [given]
            continue
        try:
            maybe = given in earlier
        except Exception:  # a value from a custom handler may compare oddly: canonical JSON decides
            maybe = True
        if maybe:
            key = call_key(call)
            if any(call_key(ToolCall(name, other)) == key for other in earlier):
                return 1.0
        earlier.append(given)
    return 0.0


def call_key(call: ToolCall) -> tuple[str, bytes]:
    """A tool call as the trajectory metrics and the retry-loop signal compare it: its name and its
    input as canonical JSON, so {"a":1,"b":2} equals {"b":2,"a":1}."""
    try:
        canon = orjson.dumps(call.tool_input, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except TypeError:
        canon = repr(call.tool_input).encode()
    return call.tool_name, canon


def record_signals(record: EvalRecord, config: SignalsConfig, values: dict[str, float | None]) -> None:
    """Add the per-record signals and the cache-hit ratio to `values` (left out when unknown)."""
    if config.tool_retry_loop and record.trajectory is not None:
        values[TOOL_RETRY_LOOP] = tool_retry_loop(record.trajectory)
    if config.empty_retrieval and record.retrieved_context is not None:
        values[EMPTY_RETRIEVAL] = 0.0 if record.retrieved_context else 1.0
    tokens = record.tokens
    if config.prompt_cache_hit_ratio and tokens is not None and tokens.cached_input is not None:
        cached, total_in = tokens.cached_input, tokens.input
        # Cached tokens are part of the input tokens (OTel, OpenAI, MLflow): more is not a ratio.
        if total_in and total_in > 0 and 0 <= cached <= total_in:
            values[CACHE_HIT_RATIO] = cached / total_in


def fold_text(text: str) -> str:
    """`text` compared loosely: case folded, runs of white space as one space, trimmed."""
    # Per record: most answers are one line of ASCII with single spaces, where that is strip().
    if text.isascii() and text.isprintable() and "  " not in text:
        return text.strip().lower()
    return " ".join(text.casefold().split())


class P2Quantile:
    """A running estimate of one quantile in O(1) memory: the P² algorithm (Jain & Chlamtac, 1985).

    The first five values are kept sorted; from then on five markers track the minimum, p/2, p,
    (1+p)/2 and the maximum, adjusted by piecewise-parabolic interpolation. The same values in the
    same order always give the same estimate.
    """

    __slots__ = ("count", "dn", "heights", "p", "positions", "wanted")

    def __init__(self, p: float) -> None:
        self.p = p
        self.count = 0
        self.heights: list[float] = []
        self.positions = [1.0, 2.0, 3.0, 4.0, 5.0]
        self.wanted = [1.0, 1.0 + 2 * p, 1.0 + 4 * p, 3.0 + 2 * p, 5.0]
        self.dn = (0.0, p / 2, p, (1 + p) / 2, 1.0)

    def value(self) -> float | None:
        """The estimate; None before five values (the exact quantile of those few is no better)."""
        if self.count < 5:
            return None
        return self.heights[2]

    def add(self, x: float) -> None:
        self.count += 1
        q = self.heights
        if self.count <= 5:
            q.append(x)
            q.sort()
            return
        n = self.positions
        # The cell x falls in; the markers above it move up one place.
        if x < q[1]:
            if x < q[0]:
                q[0] = x
            n[1] += 1
            n[2] += 1
            n[3] += 1
        elif x < q[2]:
            n[2] += 1
            n[3] += 1
        elif x < q[3]:
            n[3] += 1
        elif x > q[4]:
            q[4] = x
        n[4] += 1
        wanted, dn = self.wanted, self.dn
        wanted[1] += dn[1]
        wanted[2] += dn[2]
        wanted[3] += dn[3]
        wanted[4] += 1.0  # wanted[0] stays 1
        for i in (1, 2, 3):
            ni = n[i]
            d = wanted[i] - ni
            # A marker more than a place from where it should be moves one place, if there is room.
            if d >= 1.0:
                if n[i + 1] - ni <= 1:
                    continue
                s = 1.0
            elif d <= -1.0:
                if n[i - 1] - ni >= -1:
                    continue
                s = -1.0
            else:
                continue
            h = _parabolic(q, n, i, s)
            if not q[i - 1] < h < q[i + 1]:
                j = i + int(s)
                h = q[i] + s * (q[j] - q[i]) / (n[j] - ni)
            q[i] = h
            n[i] = ni + s


def _parabolic(q: list[float], n: list[float], i: int, s: float) -> float:
    return q[i] + s / (n[i + 1] - n[i - 1]) * (
        (n[i] - n[i - 1] + s) * (q[i + 1] - q[i]) / (n[i + 1] - n[i])
        + (n[i + 1] - n[i] - s) * (q[i] - q[i - 1]) / (n[i] - n[i - 1]))


class _AppState:
    __slots__ = ("answer_len", "answers", "tool_result")

    def __init__(self, p: float) -> None:
        self.answer_len = P2Quantile(p)
        self.tool_result = P2Quantile(p)
        # folded answer's hash -> folded request's hash, least recently seen first.
        self.answers: OrderedDict[int, int] = OrderedDict()


class AppNorms:
    """The norm-relative signals, per app, in the order records are given (`apply`). Thread-safe:
    the stream's decode-pool receivers apply results from several threads."""

    def __init__(self, config: SignalsConfig) -> None:
        self.config = config
        # The settings `apply` reads per record, as plain attributes (a pydantic model's are slower).
        self._overlong = config.answer_overlong
        self._oversized = config.tool_result_oversized
        self._repeats = config.repeated_answer
        self._warmup, self._max_apps = config.warmup, config.max_apps
        self._max_answers = config.answers_per_app
        self._answer_factor, self._tool_factor = config.answer_factor, config.tool_result_factor
        self._apps: dict[str | None, _AppState] = {}
        self._lock = threading.Lock()
        # Why state was not kept, by reason (`APP_OVER_CAP`, `ANSWER_EVICTED`): read by the telemetry.
        self.dropped = {APP_OVER_CAP: 0, ANSWER_EVICTED: 0}

    @property
    def apps(self) -> int:
        return len(self._apps)

    @property
    def answers(self) -> int:
        """Answers remembered, over every app (at most `max_apps` x `answers_per_app`)."""
        with self._lock:
            return sum(len(s.answers) for s in self._apps.values())

    def apply(self, record: EvalRecord, values: dict[str, Any]) -> None:
        """Add `signal_answer_overlong`, `signal_tool_result_oversized` and `signal_repeated_answer`
        to `values` where they can be said, and learn the record's values for the next."""
        response = record.response
        tool_chars = record.max_tool_result_chars if self._oversized else None
        overlong = response is not None and self._overlong
        # The answer and request as compared, hashed: folded outside the lock.
        answer = asked = None
        if response is not None and self._repeats and record.request is not None:
            folded = fold_text(response)
            if folded:
                answer, asked = hash(folded), hash(fold_text(record.request))
        if not overlong and tool_chars is None and answer is None:
            return
        with self._lock:
            state = self._apps.get(record.app)
            if state is None:
                if len(self._apps) >= self._max_apps:
                    self.dropped[APP_OVER_CAP] += 1
                    return
                state = self._apps[record.app] = _AppState(self.config.quantile)
            if overlong:
                said = _beyond(state.answer_len, len(response or ""), self._answer_factor, self._warmup)
                if said is not None:
                    values[ANSWER_OVERLONG] = said
            if tool_chars is not None:
                said = _beyond(state.tool_result, tool_chars, self._tool_factor, self._warmup)
                if said is not None:
                    values[TOOL_RESULT_OVERSIZED] = said
            if answer is not None:
                values[REPEATED_ANSWER] = self._repeated(state, answer, asked)

    def _repeated(self, state: _AppState, answer: int, asked: int | None) -> float:
        answers = state.answers
        before = answers.get(answer)
        answers[answer] = asked  # type: ignore[assignment]
        answers.move_to_end(answer)
        if len(answers) > self._max_answers:
            answers.popitem(last=False)
            self.dropped[ANSWER_EVICTED] += 1
        return 0.0 if before is None or before == asked else 1.0


def _beyond(norm: P2Quantile, value: float, factor: float, warmup: int) -> float | None:
    # Compared with the norm of the values before it, then learnt.
    estimate = norm.value() if norm.count >= warmup else None
    norm.add(value)
    if estimate is None:
        return None
    return 1.0 if value > factor * estimate else 0.0
