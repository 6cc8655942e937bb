"""Canaries: labelled records the live judges judge at a fixed rate, to catch a judge drifting.

A judge's verdicts can change while nothing in tracejudge does: the provider swaps the model behind a
name, an endpoint degrades, a prompt edit regresses. Canaries catch it. A canary set is JSON Lines of
agent-evaluation records, each with `expected: {judge: "pass"|"fail"}` (booleans also read): the set
shipped with tracejudge (`canary_set.jsonl`: groundedness and relevance_to_query) plus the user's
`judges.canary.file`. `CanaryRunner.tick(now)` (called by `tracejudge run`'s poll loop) starts, per
judge, one canary every `60 / rate_per_minute` seconds, cycling through that judge's canaries, through
`JudgeRunner.submit_canary`: the live judge with the live endpoint, client, budget, breaker and
timeout, without sampling or filters.

What is counted, and what is not:
- `tracejudge_judge_canary_total{judge, outcome}`: agree / disagree with the known answer, or error
  (the judge ran but gave no verdict). The `JudgeCanaryFailing` alert watches `disagree`.
- `tracejudge_judge_canary_skipped_total{judge, reason}`: not run — `in_flight` (the judge's previous
  canary is still running: at most one per judge), `overloaded` (the runner is at max_in_flight: app
  traffic comes first), `budget`, `circuit_open`, `closed`, `too_large`, `not_applicable`.
- `tracejudge_judge_canary_invalid_total{reason}`: canary lines or labels not used (`invalid_record`,
  `invalid_label`, `unknown_judge`, `missing_inputs`), each also logged with its file and line.
- Never app quality: a canary is not a record of any app, so it is not in the verdict, score, eligible,
  sampled, skipped, error or duration series and never reaches the results topic or the sinks. Its
  tokens and HTTP requests are counted with the judge's (they are real spend on the endpoint).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from tracejudge.metrics.judges.config import CanaryConfig, JudgeConfigError
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats.agent_eval import normalise_agent_eval
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment

if TYPE_CHECKING:
    from tracejudge.metrics.judges.runner import JudgeRunner

__all__ = ["SHIPPED_CANARIES", "Canary", "CanaryRunner", "build_canaries", "load_canaries"]

log = logging.getLogger(__name__)

SHIPPED_CANARIES = "canary_set.jsonl"
_LABELS = {"pass": True, "fail": False, True: True, False: False}


@dataclass(frozen=True)
class Canary:
    """One labelled record for one judge: `expected` True when the right verdict is pass."""

    record: EvalRecord
    expected: bool
    where: str


def _shipped_text() -> str:
    shipped = resources.files("tracejudge.metrics.judges.trust").joinpath(SHIPPED_CANARIES)
    return shipped.read_text(encoding="utf-8")


def load_canaries(
    sources: Iterable[tuple[str, str, bool]],
    runner: JudgeRunner,
    judges: Iterable[str] | None = None,
) -> dict[str, list[Canary]]:
    """Per judge, its canaries from `sources` (name, text, strict): JSON Lines records with an
    `expected` mapping. A bad line or label is counted and logged with its place, never fatal; labels
    for judges that are not configured are counted (`unknown_judge`) only in a strict (the user's) source."""
    live = runner.judge_names()
    checks = {c.name: c.judge for c in runner._judges if c.shadow_of is None}
    # By default model judges only: a heuristic is code, it cannot drift (name it to check it anyway).
    wanted = set(judges) if judges is not None else {c.name for c in runner._judges if not c.local}
    out: dict[str, list[Canary]] = {j: [] for j in live if j in wanted}

    def invalid(reason: str, where: str, detail: str) -> None:
        runner.metrics.canary_invalid.labels(reason).inc()
        log.warning("canary %s not used (%s): %s", where, reason, detail)

    for name, text, strict in sources:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{name}:{number}"
            try:
                obj = orjson.loads(line)
                if not isinstance(obj, dict) or not isinstance(obj.get("expected"), dict):
                    raise RecordError("invalid_record", "expected an object with an `expected` object")
                expected: dict[str, Any] = obj.pop("expected")
                record = normalise_agent_eval(obj)
            except orjson.JSONDecodeError as exc:
                invalid("invalid_record", where, f"not JSON ({exc.msg})")
                continue
            except RecordError as exc:
                invalid("invalid_record", where, str(exc))
                continue
            for judge, label in expected.items():
                verdict = _LABELS.get(label.lower() if isinstance(label, str) else label)
                if verdict is None:
                    invalid("invalid_label", where, f"{judge}: expected pass or fail, got {label!r}")
                elif judge not in checks:
                    if strict:
                        invalid("unknown_judge", where, f"no live judge named {judge!r}")
                elif judge in out:
                    missing = checks[judge].missing_inputs(record)
                    if missing:
                        invalid("missing_inputs", where, f"{judge} needs {', '.join(missing)}")
                    else:
                        out[judge].append(Canary(record, verdict, where))
    for judge in [j for j, c in out.items() if not c]:
        if judges is not None:
            log.warning("judges.canary.judges names %s, but no canary has a label for it", judge)
        del out[judge]
    return out


class CanaryRunner:
    """Starts the canaries at their rate (see the module docstring); `tick` is cheap and never blocks."""

    def __init__(
        self,
        runner: JudgeRunner,
        canaries: dict[str, list[Canary]],
        rate_per_minute: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.runner = runner
        self.metrics = runner.metrics
        self.canaries = canaries
        self.interval = 60.0 / rate_per_minute
        start = clock()
        self._next = dict.fromkeys(canaries, start)
        self._cursor = dict.fromkeys(canaries, 0)
        self._running: dict[str, concurrent.futures.Future[Assessment]] = {}

    def judges(self) -> list[str]:
        return list(self.canaries)

    def tick(self, now: float) -> int:
        """Start the canaries that are due at `now`; returns how many were started."""
        started = 0
        for judge, canaries in self.canaries.items():
            due = self._next[judge]
            if now < due:
                continue
            # Fixed rate; after a stall (a long poll, a paused process) one canary, not a burst.
            self._next[judge] = due + self.interval if now < due + self.interval else now + self.interval
            previous = self._running.get(judge)
            if previous is not None and not previous.done():
                self.metrics.observe_canary_skipped(judge, "in_flight")
                continue
            canary = canaries[self._cursor[judge] % len(canaries)]
            self._cursor[judge] += 1
            future = self.runner.submit_canary(canary.record, judge)
            self._running[judge] = future
            future.add_done_callback(lambda f, j=judge, c=canary: self._judged(j, c, f))
            started += 1
        return started

    def _judged(self, judge: str, canary: Canary, future: concurrent.futures.Future[Assessment]) -> None:
        try:
            a = future.result()
        except Exception as exc:  # a bug must not stop the canaries
            log.warning("canary %s for %s failed: %s", canary.where, judge, type(exc).__name__)
            self.metrics.observe_canary(judge, "error")
            return
        if a.skipped is not None:
            return  # counted as a canary skip by the runner
        if a.error is not None or a.passed is None:
            self.metrics.observe_canary(judge, "error")
            return
        if a.passed == canary.expected:
            self.metrics.observe_canary(judge, "agree")
            return
        self.metrics.observe_canary(judge, "disagree")
        log.warning("canary %s: judge %s said %s, the known answer is %s", canary.where, judge,
                    "pass" if a.passed else "fail", "pass" if canary.expected else "fail")


def build_canaries(runner: JudgeRunner | None, *, clock: Callable[[], float] = time.monotonic
                   ) -> CanaryRunner | None:
    """The canaries `judges.canary` configures for `runner`, or None (no judges, no canary section, or
    no canary for any judge). Raises `JudgeConfigError` when the user's canary file cannot be read."""
    config: CanaryConfig | None = getattr(getattr(runner, "config", None), "canary", None)
    if runner is None or config is None:
        return None
    sources: list[tuple[str, str, bool]] = []
    if config.shipped:
        sources.append((SHIPPED_CANARIES, _shipped_text(), False))
    if config.file:
        path = Path(config.file).expanduser()
        try:
            sources.append((str(path), path.read_text(encoding="utf-8"), True))
        except (OSError, UnicodeDecodeError) as exc:
            raise JudgeConfigError("judges.canary.file", f"cannot read {path}: {exc}") from None
    canaries = load_canaries(sources, runner, config.judges)
    if not canaries:
        log.warning("judges.canary: no canary has a label for any configured judge; no canaries run")
        return None
    log.info("canaries: %s, %g per minute per judge", ", ".join(f"{j} ({len(c)})" for j, c in
                                                               canaries.items()), config.rate_per_minute)
    return CanaryRunner(runner, canaries, config.rate_per_minute, clock=clock)
