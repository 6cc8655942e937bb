"""What the demo prints: the evaluator's numbers read from its Prometheus registry (`Samples`) beside
what the agent made (`tracejudge.consumer.demo.producer.ProducerStats`), as a final table (`Summary`)
and as a live block redrawn on a terminal or a line every few seconds elsewhere (`LiveView`).

Everything said about evaluation comes from the registries - the numbers a Prometheus server scraping
`/metrics` would see - so the two sides can be compared ("made 30% ungrounded" / "groundedness pass
rate 71%").
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

from tracejudge.consumer.demo.producer import ProducerStats

TTY_REFRESH_SECONDS = 1.0
PLAIN_REFRESH_SECONDS = 5.0


# -- reading the evaluator's Prometheus registry -------------------------------------------------


class Samples:
    """One read of a Prometheus registry: sample name -> [(labels, value)]."""

    def __init__(self, samples: Mapping[str, list[tuple[dict[str, str], float]]]) -> None:
        self._samples = samples

    @classmethod
    def collect(cls, registry: Any) -> Samples:
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in registry.collect():
            for s in family.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
        return cls(out)

    def total(self, name: str, **match: str) -> float:
        return sum(v for labels, v in self._samples.get(name, ()) if _matches(labels, match))

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, v in self._samples.get(name, ()):
            if label in labels and _matches(labels, match):
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out

    def quantile(self, histogram: str, q: float, **match: str) -> float | None:
        """`histogram_quantile` over the summed buckets: the estimate Grafana shows."""
        buckets: dict[float, float] = {}
        for labels, v in self._samples.get(f"{histogram}_bucket", ()):
            if _matches(labels, match):
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + v
        return histogram_quantile(q, sorted(buckets.items()))


def _matches(labels: Mapping[str, str], match: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate from cumulative (upper bound, count) buckets, linear within a bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in buckets:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound
            if count == lower_count:
                return upper_bound
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper_bound, count
    return None


# -- the summary -------------------------------------------------------------------------------

# The runner's series the summary reads (names are the metrics contract, docs/pages/reference/metrics.md).
TRACES = "tracejudge_traces_total"
RECORDS = "tracejudge_records_total"
DEAD_LETTERS = "tracejudge_dead_letters_total"
VERDICTS = "tracejudge_judge_verdicts_total"
LATENCY = "tracejudge_trace_latency_seconds"
TOKENS = "tracejudge_tokens_total"
LAG = "tracejudge_consumer_lag_records"
GROUNDEDNESS = "groundedness"
# The session stage's series and the session judges'.
SESSIONS = "tracejudge_sessions_total"
SESSION_TURNS = "tracejudge_session_turns"
SESSION_VERDICTS = "tracejudge_session_judge_verdicts_total"
REOPENED = "tracejudge_sessions_reopened_total"
FRUSTRATION = "user_frustration"


@dataclass
class Summary:
    elapsed: float
    producer: ProducerStats
    samples: Samples
    # The session stage's registry (None: no session stage, e.g. on someone else's Kafka).
    sessions: Samples | None = None

    @property
    def evaluated(self) -> int:
        return int(self.samples.total(TRACES))

    @property
    def handled(self) -> int:
        """Records the runner is done with, evaluated or dead-lettered: what the drain waits for."""
        return int(self.samples.total(RECORDS))

    @property
    def sessions_closed(self) -> int:
        """Sessions the stage closed, not counting re-evaluations of reopened ones."""
        if self.sessions is None:
            return 0
        return int(self.sessions.total(SESSIONS) - self.sessions.total(REOPENED))

    def unresolved_rate(self, **match: str) -> tuple[float | None, int]:
        """The share of judged sessions `user_frustration` called unresolved, and how many it judged."""
        if self.sessions is None:
            return None, 0
        verdicts = self.sessions.by(SESSION_VERDICTS, "verdict", judge=FRUSTRATION, **match)
        n = int(sum(verdicts.values()))
        return (verdicts.get("unresolved", 0.0) / n if n else None), n

    def pass_rate(self, judge: str, **match: str) -> tuple[float | None, int]:
        verdicts = self.samples.by(VERDICTS, "verdict", judge=judge, **match)
        n = int(sum(verdicts.values()))
        return (verdicts.get("pass", 0.0) / n if n else None), n

    def planted_lines(self) -> list[str]:
        """One line per planted cause: what it is, from which trace and when, and what it changed."""
        lines = []
        for name, planted in self.producer.planted.items():
            when = (f"from trace {planted.after + 1}, at {planted.started_seconds:.1f}s"
                    if planted.started_seconds is not None else
                    f"from trace {planted.after + 1}, not reached")
            lines.append(f"  planted {name} ({when}): {planted.description}; "
                         f"{planted.changed} traces changed")
        return lines or ["  planted: nothing (healthy defaults: every alert should stay quiet)"]

    def live_line(self) -> str:
        s, p = self.samples, self.producer
        rate = p.produced / self.elapsed if self.elapsed > 0 else 0.0
        parts = [f"[{self.elapsed:5.0f}s] produced {p.produced} ({rate:.1f}/s)",
                 f"evaluated {self.evaluated}",
                 f"failed {int(s.total(TRACES, status='error'))}",
                 f"latency p50 {_secs(s.quantile(LATENCY, 0.5))} p95 {_secs(s.quantile(LATENCY, 0.95))}"]
        rate_g, n = self.pass_rate(GROUNDEDNESS)
        if n:
            parts.append(f"groundedness pass {pct(rate_g)} of {n}")
        if self.sessions is not None:
            parts.append(f"sessions {self.sessions_closed}")
            rate_u, n_u = self.unresolved_rate()
            if n_u:
                parts.append(f"user_frustration unresolved {pct(rate_u)} of {n_u}")
        dead = int(s.total(DEAD_LETTERS))
        if dead:
            parts.append(f"dead letters {dead}")
        parts.append(f"lag {int(s.total(LAG))}")
        started = [name for name, p in self.producer.planted.items() if p.started_seconds is not None]
        if started:
            parts.append(f"planted {', '.join(started)}")
        return " | ".join(parts)

    def table(self, title: str) -> str:
        s, p = self.samples, self.producer
        apps = sorted(set(p.by_app) | set(s.by(TRACES, "app")))
        columns = ["all", *apps]

        def row(label: str, cell: Callable[[dict[str, str]], str]) -> list[str]:
            return [label, *(cell({} if col == "all" else {"app": col}) for col in columns)]

        def produced(attr: str) -> Callable[[dict[str, str]], str]:
            def cell(match: dict[str, str]) -> str:
                counts = [c for app, c in p.by_app.items() if match.get("app", app) == app]
                value = sum(getattr(c, attr) for c in counts)
                if attr in ("produced", "conversations"):
                    return str(value)
                if attr in ("frustrated", "ended_on_failure", "unresolved"):
                    total = sum(c.conversations for c in counts)
                    return f"{value} ({pct(value / total if total else None)})"
                # The ungrounded share is of the answered requests, like the groundedness pass rate.
                total = sum(c.produced - (c.failed if attr == "ungrounded" else 0) for c in counts)
                return f"{value} ({pct(value / total if total else None)})"
            return cell

        def evaluated(match: dict[str, str]) -> str:
            return str(int(s.total(TRACES, **match)))

        def ok_error(match: dict[str, str]) -> str:
            failed = int(s.total(TRACES, status="error", **match))
            return f"{int(s.total(TRACES, **match)) - failed} / {failed}"

        def latency(match: dict[str, str]) -> str:
            return f"{_secs(s.quantile(LATENCY, 0.5, **match))} / {_secs(s.quantile(LATENCY, 0.95, **match))}"

        def tokens(match: dict[str, str]) -> str:
            return (f"{int(s.total(TOKENS, direction='input', **match))} / "
                    f"{int(s.total(TOKENS, direction='output', **match))}")

        def pass_rate(judge: str) -> Callable[[dict[str, str]], str]:
            def cell(match: dict[str, str]) -> str:
                rate, n = self.pass_rate(judge, **match)
                return f"{pct(rate)} (n={n})" if n else "not judged"
            return cell

        def sessions(match: dict[str, str]) -> str:
            assert self.sessions is not None
            return str(int(self.sessions.total(SESSIONS, **match)))

        def session_turns(match: dict[str, str]) -> str:
            assert self.sessions is not None
            q = self.sessions.quantile
            return f"{_num(q(SESSION_TURNS, 0.5, **match))} / {_num(q(SESSION_TURNS, 0.95, **match))}"

        def unresolved(match: dict[str, str]) -> str:
            rate, n = self.unresolved_rate(**match)
            return f"{pct(rate)} (n={n})" if n else "not judged"

        # Groundedness first: it is what the agent's ungrounded share should show up in.
        judges = sorted(set(s.by(VERDICTS, "judge")) | {GROUNDEDNESS}, key=lambda j: (j != GROUNDEDNESS, j))

        rows = [
            ["", *columns],
            row("produced by the agent", produced("produced")),
            row("  made ungrounded (of answered)", produced("ungrounded")),
            row("  made to fail", produced("failed")),
            row("  with a tool call", produced("with_tools")),
            row("evaluated traces", evaluated),
            row("  ok / error", ok_error),
            row("latency p50 / p95", latency),
            row("tokens in / out", tokens),
            *(row(f"{judge} pass rate", pass_rate(judge)) for judge in judges),
            row("conversations by the agent", produced("conversations")),
            row("  made frustrated (repeat, give up)", produced("frustrated")),
            row("  other, last turn failed", produced("ended_on_failure")),
            row("  either: should read unresolved", produced("unresolved")),
        ]
        if self.sessions is not None:
            rows += [
                row("sessions evaluated", sessions),
                row("  turns per session p50 / p95", session_turns),
                row("user_frustration unresolved", unresolved),
            ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(columns) + 1)]
        lines = [title, ""]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        outcomes = s.by(RECORDS, "outcome")
        lines.append("")
        dead = s.by(DEAD_LETTERS, "reason")
        lines.append(f"  records consumed: {_counts(outcomes)}")
        lines.append(f"  dead letters: {_counts(dead)}")
        if p.send_errors:
            lines.append(f"  produce errors: {p.send_errors} (last: {p.last_send_error})")
        lines += self.planted_lines()
        if self.sessions is None:
            lines.append("  sessions: not evaluated (the session stage runs with the demo's own broker)")
        elif reopened := int(self.sessions.total(REOPENED)):
            lines.append(f"  sessions reopened by a late turn (evaluated again): {reopened}")
        return "\n".join(lines)


def _counts(by_key: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {int(v)}" for k, v in sorted(by_key.items())) or "0"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


class LiveView:
    """A refreshed block on a terminal; a line every few seconds anywhere else (CI logs, pipes)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.refresh_seconds = TTY_REFRESH_SECONDS if self.tty else PLAIN_REFRESH_SECONDS
        self._drawn = 0

    def show(self, summary: Summary) -> None:
        if not self.tty:
            print(summary.live_line(), file=self.out, flush=True)
            return
        rate = summary.producer.produced / summary.elapsed if summary.elapsed > 0 else 0.0
        block = summary.table(f"tracejudge demo - live, {summary.elapsed:.0f}s, {rate:.1f} traces/s, "
                              f"consumer lag {int(summary.samples.total(LAG))} (Ctrl-C to stop)")
        # Move up over the previous block and clear it, then draw the new one.
        prefix = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        self.out.write(prefix + block + "\n")
        self.out.flush()
        # Rows on screen, counting lines the terminal wrapped, so the next redraw starts at the top.
        columns = max(1, shutil.get_terminal_size().columns)
        self._drawn = sum(max(1, math.ceil(len(line) / columns)) for line in block.split("\n"))

    def clear(self) -> None:
        if self.tty and self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self.out.flush()
        self._drawn = 0
