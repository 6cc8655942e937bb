"""The summary of an evaluation run: counts, latency percentiles, token totals, metric means, pass
rates, and each judge's verdicts, errors and skips with their reasons (the evidence the gates of
`tracejudge eval` decide on). Printed by `tracejudge eval` and `tracejudge calibrate`; `JudgeTally` also
counts the verdicts of `tracejudge backfill` (`consumer/stages/backfill.py`)."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

from tracejudge.metrics.findings import FindingsWindow
from tracejudge.metrics.findings.report import summary_lines
from tracejudge.schemas.result import INAPPLICABLE_SKIPS, Assessment, EvaluationResult
from tracejudge.schemas.session import SessionResult

__all__ = ["FRUSTRATION", "NONE", "PLANNED_SKIPS", "JudgeTally", "SessionTally", "Summary", "reasons"]


@dataclass
class Summary:
    records: int = 0
    rejected: int = 0
    failed: int = 0
    latencies: array = field(default_factory=lambda: array("d"))
    tokens: dict[str, int] = field(default_factory=lambda: {"input": 0, "output": 0, "total": 0})
    # Records that reported token usage: without any, the tokens row says so rather than "0".
    token_records: int = 0
    # Records the judges judged (`EvaluationResult.judged`) and records that passed (`.passed`).
    judged_records: int = 0
    passed_records: int = 0
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_counts: dict[str, int] = field(default_factory=dict)
    metric_errors: dict[str, int] = field(default_factory=dict)
    # Records whose stated values were set aside as impossible, by reason (`EvalRecord.warnings`).
    anomalies: dict[str, int] = field(default_factory=dict)
    judges: dict[str, JudgeTally] = field(default_factory=dict)
    sessions: SessionTally = field(default_factory=lambda: SessionTally())
    # What the failing verdicts have in common (`tracejudge.metrics.findings`); None: not analysed.
    findings: FindingsWindow | None = None

    def add(self, result: EvaluationResult) -> None:
        rec = result.record
        self.records += 1
        if self.findings is not None:
            self.findings.add(result)
        if rec.failed:
            self.failed += 1
        if rec.latency_seconds is not None and 0 <= rec.latency_seconds < math.inf:  # never a negative p50
            self.latencies.append(rec.latency_seconds)
        for reason in rec.warnings or ():
            self.anomalies[reason] = self.anomalies.get(reason, 0) + 1
        if rec.tokens is not None:
            reported = False
            for direction in ("input", "output", "total"):
                n = getattr(rec.tokens, direction)
                if n is not None:
                    self.tokens[direction] += n
                    reported = True
            self.token_records += reported
        for name, value in result.metrics.items():
            if value is not None:
                self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value
                self.metric_counts[name] = self.metric_counts.get(name, 0) + 1
        for name in result.metric_errors:
            self.metric_errors[name] = self.metric_errors.get(name, 0) + 1
        for a in result.assessments:
            self.judges.setdefault(a.name, JudgeTally()).add(a)
        if result.assessments:
            self.judged_records += result.judged
            self.passed_records += result.passed

    def _tokens(self) -> str:
        if not self.token_records:
            return f"{NONE} (no record reported usage)"
        counts = " / ".join(str(self.tokens[d]) for d in self.tokens)
        if self.token_records < self.records:
            return f"{counts} (reported by {self.token_records} of {self.records} records)"
        return counts

    def render(self) -> str:
        lat = sorted(self.latencies)
        rows = [
            ("records", str(self.records)),
            ("rejected lines", str(self.rejected)),
            ("failed traces", f"{self.failed} ({_pct(self.failed, self.records)})"),
            ("latency p50", _seconds(_quantile(lat, 0.50))),
            ("latency p95", _seconds(_quantile(lat, 0.95))),
            ("tokens in / out / total", self._tokens()),
        ]
        if self.anomalies:
            set_aside = ", ".join(f"{reason} {n}" for reason, n in sorted(self.anomalies.items()))
            rows.append(("values set aside", set_aside))
        for name in sorted(self.metric_counts):
            errs = self.metric_errors.get(name, 0)
            mean = self.metric_sums[name] / self.metric_counts[name]
            note = f"  (n={self.metric_counts[name]}" + (f", {errs} errors)" if errs else ")")
            rows.append((f"mean {name}", f"{mean:.4g}{note}"))
        for name in sorted(set(self.metric_errors) - set(self.metric_counts)):
            rows.append((f"mean {name}", f"{NONE}  ({self.metric_errors[name]} errors)"))
        if self.judges:
            rows.append(("records passed", f"{self.passed_records} of {self.records} "
                                           f"({self.judged_records} judged by every judge that applies)"))
        for name, t in self.judges.items():
            rows.append((f"judge {name}", t.describe()))
        rows += self.sessions.rows()
        common = summary_lines(self.findings.analyse()) if self.findings is not None else []
        if common:
            rows.append(("failures have in common", "(lift: failure rate with / without the value; "
                         "simultaneous interval)"))
            rows += common
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


@dataclass
class SessionTally:
    """The sessions block of the summary: how many, how long, how many went wrong, and what the
    session judges said (for `user_frustration`, the share judged `unresolved`)."""

    sessions: int = 0
    turns: int = 0
    without_session: int = 0
    with_failure: int = 0
    last_turn_failed: int = 0
    judges: dict[str, JudgeTally] = field(default_factory=dict)
    values: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, session: SessionResult) -> None:
        self.sessions += 1
        self.turns += len(session.turns)
        self.with_failure += bool(session.metrics.get("failed_turns"))
        self.last_turn_failed += session.metrics.get("last_turn_failed") == 1.0
        for a in session.assessments:
            self.judges.setdefault(a.name, JudgeTally()).add(a)
            if a.error is None and a.skipped is None and isinstance(a.value, str):
                counts = self.values.setdefault(a.name, {})
                counts[a.value] = counts.get(a.value, 0) + 1

    def rows(self) -> list[tuple[str, str]]:
        if not self.sessions:
            return []
        rows = [
            ("sessions", f"{self.sessions} ({self.turns} turns; {self.without_session} "
                         f"record{'' if self.without_session == 1 else 's'} without a session id)"),
            ("  turns per session", f"{self.turns / self.sessions:.1f} mean"),
            ("  with a failed turn", f"{self.with_failure} ({_pct(self.with_failure, self.sessions)}), "
                                     f"last turn failed {self.last_turn_failed}"),
        ]
        for name, t in self.judges.items():
            judged = sum(self.values.get(name, {}).values())
            if name == FRUSTRATION:
                unresolved = self.values.get(name, {}).get("unresolved", 0)
                rows.append((f"  session judge {name}",
                             f"unresolved {_pct(unresolved, judged)} (n={judged}; "
                             + ", ".join(f"{v} {c}" for v, c in sorted(self.values.get(name, {}).items()))
                             + f"), {t.outcomes()}"))
                continue
            rows.append((f"  session judge {name}", t.describe()))
        return rows


FRUSTRATION = "user_frustration"


# The skips that lose a verdict the judge was to give (`--max-judge-skips`): not the judge not applying
# (`INAPPLICABLE_SKIPS`), a configured sample (`not_sampled`) or a failed trace (counted as failed).
PLANNED_SKIPS = INAPPLICABLE_SKIPS | {"not_sampled", "failed_trace"}


@dataclass
class JudgeTally:
    """One judge's verdicts, errors and skips over a run (with the reasons: the gate says why)."""

    verdicts: int = 0
    passed: int = 0
    errors: int = 0
    skipped: int = 0
    scores: int = 0
    score_sum: float = 0.0
    error_reasons: dict[str, int] = field(default_factory=dict)
    skip_reasons: dict[str, int] = field(default_factory=dict)

    def add(self, a: Assessment) -> None:
        if a.skipped is not None:
            self.skipped += 1
            self.skip_reasons[a.skipped] = self.skip_reasons.get(a.skipped, 0) + 1
        elif a.error is not None:
            self.errors += 1
            reason = a.error.partition(":")[0]
            self.error_reasons[reason] = self.error_reasons.get(reason, 0) + 1
        if a.score is not None:
            self.scores += 1
            self.score_sum += a.score
        if a.passed is not None:
            self.verdicts += 1
            self.passed += a.passed

    @property
    def mean(self) -> float | None:
        return self.score_sum / self.scores if self.scores else None

    @property
    def lost(self) -> int:
        """Records the judge applied to and was to judge, but skipped (budget, circuit_open, …)."""
        return sum(n for reason, n in self.skip_reasons.items() if reason not in PLANNED_SKIPS)

    @property
    def to_judge(self) -> int:
        """Records the judge was to judge: its verdicts, its errors and its lost skips."""
        return self.verdicts + self.errors + self.lost

    def outcomes(self) -> str:
        """"N errors (reason n, …), M skipped (reason m, …)"."""
        return f"{self.errors} errors{reasons(self.error_reasons)}, {self.skipped} skipped" \
               f"{reasons(self.skip_reasons)}"

    def describe(self) -> str:
        mean = NONE if self.mean is None else f"{self.mean:.3f}"
        share = _pct(self.passed, self.verdicts)
        return (f"mean score {mean}, passed {self.passed}/{self.verdicts} ({share}), "
                f"judged {self.verdicts} of {self.to_judge}, {self.outcomes()}")


def reasons(counts: dict[str, int]) -> str:
    """" (reason n, …)" in sorted order, or nothing without any."""
    return f" ({', '.join(f'{r} {n}' for r, n in sorted(counts.items()))})" if counts else ""


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    # Nearest-rank: the value below which a share q of observations fall; no interpolation to explain.
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[idx]


# What the summary prints for a value nothing reported.
NONE = "–"


def _seconds(v: float | None) -> str:
    return NONE if v is None else f"{v:.3f} s"


def _pct(n: int, d: int) -> str:
    return NONE if d == 0 else f"{100.0 * n / d:.1f}%"
