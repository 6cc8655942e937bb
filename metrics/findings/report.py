"""Findings as people read them: the ranked table of `tracejudge findings` and the short block of the
`tracejudge eval` summary."""

from __future__ import annotations

from collections.abc import Sequence

from tracejudge.metrics.findings.window import Finding

__all__ = ["COLUMNS", "summary_lines", "table"]

COLUMNS = ("app", "judge", "rank", "dimension", "value", "failing/total", "support", "lift", "interval",
           "fail rate with/without", "examples")
# A value longer than this is cut in the table (the JSON keeps it whole).
SHOWN_VALUE_CHARS = 60


def _value(f: Finding) -> str:
    value = f.value if len(f.value) <= SHOWN_VALUE_CHARS else f.value[:SHOWN_VALUE_CHARS - 1] + "…"
    return f"{value} ({f.label})" if f.label else value


def _row(f: Finding) -> tuple[str, ...]:
    lo, hi = f.lift_interval
    return (f.app, f.judge, str(f.rank), f.dimension, _value(f), f"{f.failing}/{f.total}",
            f"{f.support:.0%}", f"{f.lift:.2f}", f"[{lo:.2f}, {hi:.2f}]",
            f"{f.failure_rate_with:.0%} / {f.failure_rate_without:.0%}", " ".join(f.example_trace_ids[:2]))


def table(findings: Sequence[Finding]) -> str:
    """The findings as an aligned text table, in their order (by app, judge, rank)."""
    rows = [COLUMNS, *(_row(f) for f in findings)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def summary_lines(findings: Sequence[Finding], per_judge: int = 3) -> list[tuple[str, str]]:
    """(key, text) rows for the eval summary: each judge's first `per_judge` findings."""
    rows = []
    for f in findings:
        if f.rank > per_judge:
            continue
        lo, hi = f.lift_interval
        text = (f"{f.dimension}={_value(f)}: {f.failing} of {f.total} failed ({f.failure_rate_with:.0%} vs "
                f"{f.failure_rate_without:.0%} without), lift {f.lift:.2f} [{lo:.2f}, {hi:.2f}]")
        rows.append((f"  {f.judge} fails with", text + (f", app {f.app}" if f.app != "unknown" else "")))
    return rows
