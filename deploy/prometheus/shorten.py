"""Derive a fast-clock copy of a Prometheus rule file: shorter windows, `for:`, and minimum counts.

The shipped rules watch hours and days; a test that drives real traffic through real Prometheus has
seconds. This rewrites, in every rule's `expr`:

* each range `[5m]` and each `offset 1d` through a mapping of duration literals (an unmapped literal is an
  error naming it, so a new window in the rule file can never slip through un-shortened);
* each `>= N` (the rule file reserves `>=` for minimum-volume guards) to `>= min_count`;

and sets every alert's `for:` (and optionally each group's `interval:`). Everything else (names,
labels, annotations, thresholds on ratios) is left alone, so the derived file fires the same alerts.

    python deploy/prometheus/shorten.py rules.yml fast.yml --for 0s --min-count 3 --duration 1h=30s ...
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

# A set that fits a test with a 1 s scrape and evaluation interval; pass your own for other clocks.
FAST_CLOCK: Mapping[str, str] = {"5m": "10s", "15m": "20s", "30m": "30s", "1h": "30s", "1d": "2m"}

_DURATION = r"(?:\d+(?:ms|[smhdwy]))+"
_RANGE = re.compile(rf"\[\s*({_DURATION})\s*\]")
_OFFSET = re.compile(rf"\boffset\s+({_DURATION})\b")
_GUARD = re.compile(r">=\s*(\d+(?:\.\d+)?)")


class ShortenError(ValueError):
    """The rule file uses something the rewrite cannot map (names the rule and the literal)."""


def shorten_expr(expr: str, durations: Mapping[str, str], min_count: float | None = None,
                 where: str = "expr") -> str:
    """Rewrite one PromQL expression (see the module docstring)."""

    def mapped(literal: str) -> str:
        try:
            return durations[literal]
        except KeyError:
            raise ShortenError(
                f"{where}: duration {literal!r} has no mapping (known: {', '.join(sorted(durations))})"
            ) from None

    expr = _RANGE.sub(lambda m: f"[{mapped(m.group(1))}]", expr)
    expr = _OFFSET.sub(lambda m: f"offset {mapped(m.group(1))}", expr)
    if min_count is not None:
        expr = _GUARD.sub(lambda m: f">= {_number(min_count)}", expr)
    return expr


def shorten_rules(doc: Mapping[str, Any], durations: Mapping[str, str] = FAST_CLOCK, *,
                  for_: str | None = "0s", min_count: float | None = None,
                  interval: str | None = None) -> dict[str, Any]:
    """A rewritten deep copy of a parsed rule file (`{"groups": [...]}`)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("groups"), list):
        raise ShortenError("not a Prometheus rule file: expected a mapping with a 'groups' list")
    groups = []
    for group in doc["groups"]:
        group = dict(group)
        if interval is not None:
            group["interval"] = interval
        rules = []
        for rule in group.get("rules", []):
            rule = dict(rule)
            name = rule.get("alert") or rule.get("record") or "?"
            rule["expr"] = shorten_expr(str(rule["expr"]), durations, min_count,
                                        where=f"group {group.get('name')!r} rule {name!r}")
            if "alert" in rule and for_ is not None:
                rule["for"] = for_
            rules.append(rule)
        group["rules"] = rules
        groups.append(group)
    return {**doc, "groups": groups}


def shorten_file(src: str | Path, dst: str | Path, durations: Mapping[str, str] = FAST_CLOCK, *,
                 for_: str | None = "0s", min_count: float | None = None,
                 interval: str | None = None) -> Path:
    """Read `src`, write the rewritten rules to `dst`, return `dst`."""
    doc = yaml.safe_load(Path(src).read_text())
    out = shorten_rules(doc, durations, for_=for_, min_count=min_count, interval=interval)
    dst = Path(dst)
    dst.write_text(yaml.dump(out, Dumper=_BlockDumper, sort_keys=False, width=1000))
    return dst


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings as `|` blocks so the derived file reads like the original."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_representer)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--duration", action="append", default=[], metavar="FROM=TO",
                        help="map a duration literal (repeatable); default: the FAST_CLOCK set")
    parser.add_argument("--for", dest="for_", default="0s", help="every alert's `for:` (default 0s)")
    parser.add_argument("--min-count", type=float, default=None, help="every `>= N` guard becomes this")
    parser.add_argument("--interval", default=None, help="every group's evaluation interval")
    args = parser.parse_args(argv)
    durations = dict(FAST_CLOCK)
    for item in args.duration:
        old, sep, new = item.partition("=")
        if not sep:
            parser.error(f"--duration {item!r}: expected FROM=TO, e.g. 1h=30s")
        durations[old] = new
    try:
        shorten_file(args.src, args.dst, durations, for_=args.for_, min_count=args.min_count,
                     interval=args.interval)
    except ShortenError as exc:
        print(f"shorten: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
