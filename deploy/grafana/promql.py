"""Every PromQL expression in the tracejudge dashboards, ready to send to a Prometheus.

    python deploy/grafana/promql.py                      # one expression per line, variables filled in
    python deploy/grafana/promql.py --raw                # as written, with $variables
    python deploy/grafana/promql.py --json d1.json ...   # JSON lines: dashboard, panel, refId, expr

Dashboard variables become values any Prometheus accepts: `$__rate_interval` and friends a duration
(`--rate-interval`, default 1m), and every template variable `.*` (the dashboards only use them in `=~`
matchers, with `.*` as their "All" value). `metric_names()` lists the metrics an expression reads.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parent / "dashboards"

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*(=~|=)\s*"((?:[^"\\]|\\.)*)"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_IDENT = re.compile(r"(?<![\w.$:])[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = frozenset({"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring",
                       "group_left", "group_right", "inf", "nan", "start", "end", "atan2"})


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str  # the dashboard uid
    panel: str      # the panel title
    ref_id: str
    expr: str       # as written in the dashboard

    def resolved(self, rate_interval: str = "1m") -> str:
        return fill_variables(self.expr, rate_interval=rate_interval)


def panel_queries(dashboard: Mapping[str, Any]) -> list[PanelQuery]:
    """Every Prometheus target of every panel (rows' nested panels included)."""

    def walk(panels: Iterable[Mapping[str, Any]]) -> Iterator[PanelQuery]:
        for panel in panels:
            yield from walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                if target.get("expr"):
                    yield PanelQuery(dashboard["uid"], panel.get("title", ""), target.get("refId", ""),
                                     target["expr"])

    return list(walk(dashboard.get("panels", [])))


def fill_variables(expr: str, *, rate_interval: str = "1m",
                   values: Mapping[str, str] | None = None) -> str:
    """Replace Grafana variables: interval ones by `rate_interval`, template ones by `values` or `.*`."""
    values = dict(values or {})

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in values:
            return values[name]
        if name in ("__rate_interval", "__interval", "__range"):
            return rate_interval
        return ".*"

    return _VARIABLE.sub(replace, expr)


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects (metric names and recording rules).

    A small lexer, not a parser: it drops strings, label matchers, grouping clauses and ranges, then
    keeps the identifiers that are not functions or keywords. `{__name__=~"a|b"}` selectors count too.
    """
    names: set[str] = set()
    for op, value in _NAME_MATCHER.findall(expr):
        names.update(value.split("|") if op == "=~" else [value])
    expr = _VARIABLE.sub("", expr)
    expr = _STRING.sub('""', expr)
    expr = _MATCHERS.sub("", expr)
    expr = _CLAUSE.sub("", expr)
    expr = _BRACKETS.sub("", expr)
    for match in _IDENT.finditer(expr):
        is_call = expr[match.end():].lstrip().startswith("(")
        if not is_call and match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names


def dashboard_files(paths: Sequence[str | Path] = ()) -> list[Path]:
    return [Path(p) for p in paths] or sorted(DASHBOARDS.glob("*.json"))


def all_queries(paths: Sequence[str | Path] = ()) -> list[PanelQuery]:
    """The queries of the given dashboard files (default: every shipped dashboard)."""
    out: list[PanelQuery] = []
    for path in dashboard_files(paths):
        out.extend(panel_queries(json.loads(Path(path).read_text())))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dashboards", nargs="*", help="dashboard JSON files (default: the shipped ones)")
    parser.add_argument("--raw", action="store_true", help="print the expressions as written")
    parser.add_argument("--json", action="store_true", help="JSON lines with dashboard, panel and refId")
    parser.add_argument("--rate-interval", default="1m", help="value of $__rate_interval (default 1m)")
    args = parser.parse_args(argv)
    for query in all_queries(args.dashboards):
        expr = query.expr if args.raw else query.resolved(args.rate_interval)
        if args.json:
            print(json.dumps({"dashboard": query.dashboard, "panel": query.panel, "ref_id": query.ref_id,
                              "expr": expr}))
        else:
            print(" ".join(expr.split()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
