"""The Prometheus rules of the `slos:` section: recording rules of each SLO's error ratio per window and
its error budget, and the multi-window, multi-burn-rate alerts `SLOBurnFast` (page) and `SLOBurnSlow`
(ticket) (`tracejudge slo render`) (`tracejudge.consumer.config`).

Pure: `render_slo_rules(slos)` is text from settings, so a test can read exactly what ships. The windows
are the Google SRE workbook's (chapter "Alerting on SLOs", a 30-day SLO): a burn rate is the error ratio
over a window divided by the error budget (1 - objective); 1 spends the budget exactly over the SLO
window. A pair fires when both its long and its short window burn faster than its factor:

    severity  long  short  factor (30d)  budget spent in the long window
    page      1h    5m     14.4          2%
    page      6h    30m    6             5%
    ticket    1d    2h     3             10%
    ticket    3d    6h     1             10%

scaled to the configured window (factor = budget share x window / long window: 13.44, 5.6, 2.8 and
0.933 for 28 days, as Sloth does). One more page pair is tracejudge's own, `SHARP`: the last 5 minutes
alone at the 6h pair's factor. Quality SLOs have loose objectives (95%, not 99.9%): at 95% the largest
possible burn is 20, and a 50-point drop (a burn of 10) never reaches the 1h pair's 13.44 and needs
over 3 hours to reach the 6h pair's; the sharp pair pages it in minutes. Five minutes hold few verdicts,
so the sharp pair needs `sharp_minimum` of them: at least min_judged, and enough that a 5-minute window
of traces failing exactly at the budget's rate crosses its threshold with a probability under 1e-6.

Every pair also needs `min_judged` judged traces in its long window (the `>= N` guard of the rules'
conventions): an SLO over too few judged traces does not page. The alert's description states the burn
rate and how many judged traces each long window rests on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tracejudge.consumer.config.alert_links import duration_seconds
from tracejudge.consumer.config.slos import SloSpec

__all__ = ["PAIRS", "SHARP", "WindowPair", "factor", "render_slo_rules", "sharp_minimum", "slo_rule_names"]

VERDICTS = "tracejudge_judge_verdicts_total"
JUDGED = "app_judge_slo:tracejudge_slo_judged:increase"
ERRORS = "app_judge_slo:tracejudge_slo_error:ratio"
OBSERVED = "app_judge_slo:tracejudge_slo_error_observed:ratio"
OBJECTIVE = "app_judge_slo:tracejudge_slo_objective:ratio"
BUDGET_REMAINING = "app_judge_slo:tracejudge_slo_error_budget_remaining:ratio"
SLO_WINDOW_S = 30 * 86400
# The chance a 5-minute window of traces failing at exactly the budget's rate crosses the sharp pair's
# threshold: once in about two years of 1-minute evaluations.
SHARP_FALSE_PAGE = 1e-6
SHARP_MAX_MINIMUM = 1_000_000


@dataclass(frozen=True)
class WindowPair:
    """A long and a short window (None: the long one alone), the share of the SLO window's budget the
    long window spends at the threshold, and the alert it belongs to."""

    long: str
    short: str | None
    budget_share: float
    severity: str

    @property
    def alert(self) -> str:
        return "SLOBurnFast" if self.severity == "page" else "SLOBurnSlow"


PAIRS = (WindowPair("1h", "5m", 0.02, "page"), WindowPair("6h", "30m", 0.05, "page"),
         WindowPair("1d", "2h", 0.10, "ticket"), WindowPair("3d", "6h", 0.10, "ticket"))
SHARP = WindowPair("5m", None, 0.05, "page")  # the 6h pair's factor (5% of the budget in 6h), 5 minutes


def factor(pair: WindowPair, window_s: int) -> float:
    """The burn-rate threshold of a pair for an SLO window: the budget share spent in the long window."""
    long_s = 6 * 3600 if pair is SHARP else duration_seconds(pair.long)  # SHARP: the 6h pair's factor
    return round(pair.budget_share * window_s / long_s, 4)


def sharp_minimum(slo: SloSpec) -> int:
    """The judged traces the sharp pair needs in 5 minutes: the smallest n >= min_judged for which
    P(Binomial(n, budget) / n > threshold) < SHARP_FALSE_PAGE (at most SHARP_MAX_MINIMUM)."""
    threshold = factor(SHARP, slo.window_s) * slo.budget
    n = slo.min_judged
    while n < SHARP_MAX_MINIMUM and _upper_tail(n, slo.budget, threshold) >= SHARP_FALSE_PAGE:
        n = max(n + 1, math.ceil(n * 1.05))
    return min(n, SHARP_MAX_MINIMUM)


def _upper_tail(n: int, p: float, ratio: float) -> float:
    """P(X > ratio * n) for X ~ Binomial(n, p), summed in log space from the first count above."""
    first = math.floor(ratio * n) + 1
    if first > n:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total = 0.0
    for k in range(first, n + 1):
        term = math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p
                        + (n - k) * log_q)
        total += term
        if term < total * 1e-12:
            break
    return total


def slo_rule_names(slo_windows: Sequence[str] = ()) -> set[str]:
    """Every recording rule name a rendered file may hold, for SLOs over `slo_windows` (the error ratio
    over the SLO window is named after it: `...:ratio28d`)."""
    windows = {w for p in (*PAIRS, SHARP) for w in (p.long, p.short) if w} | set(slo_windows)
    return ({f"{JUDGED}{w}" for w in windows} | {f"{ERRORS}{w}" for w in windows}
            | {f"{OBSERVED}{w}" for w in windows} | {OBJECTIVE, BUDGET_REMAINING})


# --- rendering ----------------------------------------------------------------------------------------

HEADER = """\
# tracejudge quality SLOs: recording rules and multi-window, multi-burn-rate alerts.
#
# GENERATED by `tracejudge slo render` from the `slos:` section of
#   {config}
# Edit the configuration and render again, never this file (Quality SLOs:
# https://tracejudge.github.io/tracejudge/guides/slos/). One group per SLO; every
# alert of a group reads the recording rules of the same evaluation. Conventions as in
# tracejudge.rules.yml: literal ranges, `>= N` only as a minimum-volume guard (min_judged), ratios of
# sums that divide by `(count > 0)`, every aggregation `sum by (app, judge)` (the verdict series carry
# more labels, `version` among them).
"""


def render_slo_rules(slos: Sequence[SloSpec], *, config: str = "CONFIG") -> str:
    """The rules file of `slos` (an empty `groups: []` file without SLOs, so rendering after removing
    the section removes the rules). Link annotations are added by `alert_rules.render_rules`."""
    config = "".join("?" if ch in "\r\n" else ch for ch in config)  # a comment line stays one line
    if not slos:
        return HEADER.format(config=config) + "# No slos: section in the configuration: no rules.\n" \
            "groups: []\n"
    return HEADER.format(config=config) + "groups:\n" + "".join(_group(slo) for slo in slos)


def _windows(slo: SloSpec) -> list[str]:
    seen: list[str] = []
    for w in [w for p in (SHARP, *PAIRS) for w in (p.short, p.long) if w] + [slo.window]:
        if w not in seen:
            seen.append(w)
    return sorted(seen, key=duration_seconds)


def _group(slo: SloSpec) -> str:
    out = [f"  - name: tracejudge-slo-{slo.slo}\n", "    rules:\n",
           f"      # {slo.objective:.6g} of app {slo.app}'s traces judged by {slo.judge} pass, over "
           f"{slo.window} (budget {slo.budget:.6g}).\n      # Pass rate: {_mode(slo)}.\n"]
    out += _record(OBJECTIVE, f"vector({slo.objective:.12g})", slo, own_labels=True)
    ratio_name = ERRORS if slo.corrected is False else OBSERVED
    for w in _windows(slo):
        out += _record(f"{JUDGED}{w}", f"sum by (app, judge) (increase({_verdicts(slo)}[{w}]))", slo)
        out += _record(f"{ratio_name}{w}", _observed(slo, w), slo)
        if slo.corrected is not False:
            out += _record(f"{ERRORS}{w}", _corrected(slo, w), slo)
    out += _record(BUDGET_REMAINING, f"1 - {ERRORS}{slo.window}{_sel(slo)} / {_num(slo.budget)}", slo)
    out += _alert(slo, "page", [SHARP, *[p for p in PAIRS if p.severity == "page"]])
    out += _alert(slo, "ticket", [p for p in PAIRS if p.severity == "ticket"])
    return "".join(out)


def _mode(slo: SloSpec) -> str:
    return {True: "the pass rate corrected for the judge's calibration (absent without one)",
            False: "the observed pass rate",
            "auto": "the corrected pass rate where the judge has a fresh calibration, else the observed one",
            }[slo.corrected]


def _num(x: float) -> str:
    return f"{x:.12g}"


def _sel(slo: SloSpec) -> str:
    return f'{{slo="{slo.slo}"}}'


def _verdicts(slo: SloSpec, extra: str = "") -> str:
    return f'{VERDICTS}{{app="{slo.app}",judge="{slo.judge}"{extra}}}'


def _record(name: str, expr: str, slo: SloSpec, *, own_labels: bool = False) -> list[str]:
    labels = f'{{app: "{slo.app}", judge: "{slo.judge}", slo: "{slo.slo}"}}' if own_labels \
        else f'{{slo: "{slo.slo}"}}'
    body = (["        expr: |\n", *[f"          {line}\n" for line in expr.splitlines()]] if "\n" in expr
            else [f"        expr: {expr}\n"])
    return [f"      - record: {name}\n", *body, f"        labels: {labels}\n"]


def _observed(slo: SloSpec, w: str) -> str:
    """1 - the pass ratio: verdicts that are not a pass over all, 0 (not empty) when none failed."""
    judged = f"{JUDGED}{w}{_sel(slo)}"
    failed = _verdicts(slo, ',verdict!="pass"')
    return (f"(\n  sum by (app, judge) (increase({failed}[{w}]))\n"
            f"  or on (app, judge) 0 * {judged}\n)\n/ on (app, judge) ({judged} > 0)")


def _corrected(slo: SloSpec, w: str) -> str:
    """1 - the Rogan–Gladen corrected pass rate, as app_judge:tracejudge_judge_pass_corrected:ratio1h
    in tracejudge.rules.yml; with `auto`, the observed error ratio where there is no correction."""
    cal = f'tracejudge_judge_calibration{{judge="{slo.judge}",stat="%s"}}'
    tpr, tnr = f"max by (judge) ({cal % 'tpr'})", f"max by (judge) ({cal % 'tnr'})"
    stale = f'max by (judge) (tracejudge_judge_calibration_stale{{judge="{slo.judge}"}})'
    corrected = (f"(\n  1 - clamp(\n    (1 - {OBSERVED}{w}{_sel(slo)} + on (judge) group_left {tnr} - 1)\n"
                 f"    / on (judge) group_left () (({tpr} + on (judge) {tnr} - 1) > 0),\n    0, 1\n  )\n"
                 f"  unless on (judge) ({stale} > 0)\n)")
    if slo.corrected == "auto":
        return f"{corrected}\nor on (app, judge, slo) {OBSERVED}{w}{_sel(slo)}"
    return corrected


def _alert(slo: SloSpec, severity: str, pairs: list[WindowPair]) -> list[str]:
    """One alert over its window pairs, each `burn(long) > f and burn(short) > f and judged(long) >= N`;
    its value is the burn rate of the first pair that fires."""
    alternatives = []
    for pair in pairs:
        f = _num(factor(pair, slo.window_s))
        minimum = sharp_minimum(slo) if pair is SHARP else slo.min_judged
        lines = [f"{ERRORS}{pair.long}{_sel(slo)} / {_num(slo.budget)} > {f}"]
        if pair.short:
            short = f"{ERRORS}{pair.short}{_sel(slo)}"
            lines.append(f"and on (app, judge, slo) {short} / {_num(slo.budget)} > {f}")
        lines.append(f"and on (app, judge, slo) {JUDGED}{pair.long}{_sel(slo)} >= {minimum}")
        alternatives.append("(\n" + "".join(f"  {line}\n" for line in lines) + ")")
    expr = "\nor on (app, judge, slo)\n".join(alternatives)
    name = pairs[0].alert
    longs = [p.long for p in pairs]
    counts = ", ".join(f"{_count(w)} in the last {w}" for w in longs)
    pair_text = "; ".join(f"{p.long}{'/' + p.short if p.short else ''} over "
                          f"{_num(factor(p, slo.window_s))}x" for p in pairs)
    what = "pages" if severity == "page" else "opens a ticket"
    sharp = f", the 5m one {sharp_minimum(slo)}" if SHARP in pairs else ""
    description = (f"App {{{{ $labels.app }}}} spends the error budget of SLO {{{{ $labels.slo }}}} "
                   f"({_percent(slo.objective)}% of traces judged by {{{{ $labels.judge }}}} pass over "
                   f"{slo.window}) {{{{ $value | printf \"%.2f\" }}}} times as fast as the objective allows "
                   f"(a burn rate of 1 spends it exactly in {slo.window}); judged traces: {counts} (a pair "
                   f"needs at least {slo.min_judged} in its long window{sharp}). "
                   f"It {what} when a window pair burns too fast: {pair_text}. Pass rate: "
                   f"{_mode(slo)}.")
    summary = (f"SLO {{{{ $labels.slo }}}} of app {{{{ $labels.app }}}}: error budget burning at "
               f"{{{{ $value | printf \"%.2f\" }}}}x ({severity})")
    return [f"      - alert: {name}\n", "        expr: |\n",
            *[f"          {line}\n" for line in expr.splitlines()],
            f"        labels:\n          severity: {severity}\n          slo: {slo.slo}\n",
            "        annotations:\n", f"          summary: {_quoted(summary)}\n",
            f"          description: {_quoted(description)}\n"]


def _count(window: str) -> str:
    """A template printing the judged traces of the alert's SLO in `window` (0 when none)."""
    return (f'{{{{ with printf `{JUDGED}{window}{{slo="%s"}}` $labels.slo | query }}}}'
            f'{{{{ . | first | value | printf "%.0f" }}}}{{{{ else }}}}0{{{{ end }}}}')


def _percent(objective: float) -> str:
    return f"{round(objective * 100, 6):g}"


def _quoted(value: str) -> str:
    """A YAML single-quoted scalar: the templates' double quotes stay readable."""
    return "'" + value.replace("'", "''") + "'"
