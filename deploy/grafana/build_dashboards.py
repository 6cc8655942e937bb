"""Generate the tracejudge Grafana dashboards (classic dashboard JSON) into deploy/grafana/dashboards/.

Plain dictionaries instead of a generator library: the JSON model is small, the output is checked in and
a test regenerates it and fails on drift, so review happens on the JSON diff. Conventions every panel
follows (a test holds them): fixed dashboard uids, the Prometheus datasource is the `${datasource}`
variable (so one file works in every Grafana, provisioned or imported), every panel that is not a row
has at least one PromQL target, histogram panels ask for exemplars, which carry the trace id, a panel
whose answer is 0 says 0 (an error, dead-letter, skip or retry counter that never moved has no series:
`or_zero`), and every panel names why it can still be empty (`empty`, Grafana's "No value" text).

Exemplar links: Grafana takes them from the Prometheus *datasource* (`exemplarTraceIdDestinations`),
never from panel data links (a panel's field config is not applied to exemplar frames). The
dashboards carry a `trace_url` textbox variable, the trace UI's address up to the trace id (default:
MLflow's trace view); a destination whose URL is `${trace_url:raw}${__value.raw}` turns every exemplar
into a link to its trace (deploy/compose/grafana/provisioning/datasources/datasources.yaml, README
"From an exemplar to the trace").

    python deploy/grafana/build_dashboards.py          # rewrite the JSON files
    python deploy/grafana/build_dashboards.py --check  # exit 1 if a checked-in file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
RATE = "$__rate_interval"
# The trace UI's address up to the trace id, which the exemplar link appends (`${__value.raw}`, the
# exemplar's trace_id: 32 hex digits). MLflow 3 stores an OpenTelemetry trace as `tr-<hex>` and opens
# it in the experiment's Traces tab with `selectedEvaluationId`; the trace is fetched by its id, so
# experiment 0 (where the compose collector sends OTLP traces) works as the page behind the drawer.
MLFLOW_TRACE_URL = "http://localhost:5000/#/experiments/0/traces?selectedEvaluationId=tr-"
# The session UI's address up to the session id, which the `session_id` exemplar link appends (the
# exemplar of tracejudge_session_judge_score). MLflow 3 shows a conversation, its turns and their
# assessments at `#/experiments/<id>/chat-sessions/<session id>` (the id of `mlflow.trace.session`).
MLFLOW_SESSION_URL = "http://localhost:5000/#/experiments/0/chat-sessions/"

Json = dict[str, Any]

# Why a panel can be empty when nothing is wrong: Grafana shows these ("No value") instead of "No data".
# Panels whose answer is 0 when nothing happened say 0 instead (`or_zero`); these name what is missing.
NO_VERDICTS = "No judge verdict in range (no judge configured, or no trace sampled)"
NO_ELIGIBLE = "No trace eligible for a judge in range (no judge configured, or no traffic)"
NO_CALIBRATION = "No calibration yet: run tracejudge calibrate, then set judges.calibration_file"
NO_HUMAN_LABELS = "No human labels yet (labels on the traces, or tracejudge agreement)"
NO_CANARIES = "No canaries configured (judges.canary)"
NO_TRACE_COST = "No trace of known cost in range (tracejudge_cost_unknown_total says why)"
NO_SPEND_CAP = "No spend cap configured (endpoints.<name>.usd_per_hour / usd_per_day)"
NO_SESSIONS = "No session stage: run tracejudge sessions"
NO_SESSION_JUDGES = "No session judge ran in range (sessions.judges), or no session stage"
NO_SINK = "No write-back sink: run tracejudge sink <kind>"
NO_OTLP = "No OpenTelemetry input (no topic with an OTLP format)"


# --- building blocks ----------------------------------------------------------------------------------

def datasource_variable() -> Json:
    return {
        "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
        "current": {}, "hide": 0, "refresh": 1, "regex": "", "includeAll": False, "multi": False,
        "options": [], "skipUrlSync": False,
    }


def label_variable(name: str, label: str, metric_selector: str) -> Json:
    """A multi-value variable over one label; "All" means `.*`, so panels match it with `=~`."""
    definition = f"label_values({metric_selector}, {label})"
    return {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "definition": definition,
        "query": {"qryType": 1, "query": definition, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2, "sort": 1, "regex": "", "hide": 0, "multi": True, "includeAll": True,
        "allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [], "skipUrlSync": False,
    }


def trace_url_variable(default: str = MLFLOW_TRACE_URL) -> Json:
    """A textbox: the trace UI's URL up to the trace id. Exemplar links (configured on the datasource
    as `${trace_url:raw}${__value.raw}`) read it, so each dashboard viewer can point them elsewhere
    (Jaeger: `http://jaeger:16686/trace/`) or set it with `?var-trace_url=...`."""
    return {
        "name": "trace_url", "label": "Trace link (URL before the trace id)", "type": "textbox",
        "query": default, "current": {"selected": False, "text": default, "value": default},
        "options": [{"selected": True, "text": default, "value": default}],
        "hide": 0, "skipUrlSync": False,
        "description": "Exemplar dots link to <this URL><trace id>. MLflow: <mlflow>/#/experiments/<id>/"
                       "traces?selectedEvaluationId=tr- ; Jaeger: <jaeger>/trace/ . "
                       "See README, From an exemplar to the trace.",
    }


def session_url_variable(default: str = MLFLOW_SESSION_URL) -> Json:
    """A textbox like `trace_url`, for the `session_id` exemplars of the session judge scores
    (datasource destination `${session_url:raw}${__value.raw}`)."""
    return {
        "name": "session_url", "label": "Session link (URL before the session id)", "type": "textbox",
        "query": default, "current": {"selected": False, "text": default, "value": default},
        "options": [{"selected": True, "text": default, "value": default}],
        "hide": 0, "skipUrlSync": False,
        "description": "Session judge exemplar dots link to <this URL><session id>. MLflow: <mlflow>/#/"
                       "experiments/<id>/chat-sessions/ . See README, From an exemplar to the trace.",
    }


def target(expr: str, legend: str, *, exemplar: bool = False, fmt: str = "time_series") -> Json:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True,
            "instant": False, "exemplar": exemplar, "format": fmt, "editorMode": "code"}


def timeseries(title: str, description: str, targets: Sequence[Json], *, unit: str = "short",
               ratio: bool = False, stack: bool = False, width: int = 12,
               overrides: Sequence[Json] = (), empty: str | None = None) -> Json:
    """A time series panel. `empty` is why it can have no data (Grafana's "No value" text, shown
    instead of a bare "No data"): for a panel whose answer, when nothing happened, is 0, the query
    itself says 0 (`or_zero`), and `empty` only names when there is nothing to say 0 about."""
    defaults: Json = {"unit": "percentunit" if ratio else unit,
                      "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if stack else 0,
                                 "showPoints": "never", "spanNulls": False,
                                 "stacking": {"mode": "normal" if stack else "none", "group": "A"}}}
    if ratio:
        defaults.update(min=0, max=1)
    if empty:
        defaults["noValue"] = empty
    return {"type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
            "targets": list(targets), "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
            "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                                   "calcs": ["lastNotNull", "mean"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "_width": width}


def heatmap(title: str, description: str, expr: str, *, width: int = 12, empty: str | None = None) -> Json:
    return {"type": "heatmap", "title": title, "description": description, "datasource": DATASOURCE,
            "targets": [target(expr, "{{le}}", fmt="heatmap")],
            "fieldConfig": {"defaults": {"noValue": empty} if empty else {}, "overrides": []},
            "options": {"calculate": False, "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges"},
                        "yAxis": {"axisPlacement": "left", "unit": "short"},
                        "tooltip": {"mode": "single", "yHistogram": True},
                        "exemplars": {"color": "rgba(255,0,255,0.7)"}},
            "_width": width}


def right_axis(ref_id: str, unit: str) -> Json:
    """An override putting one query's series on a right-hand axis with its own unit (e.g. a count
    beside a ratio)."""
    return {"matcher": {"id": "byFrameRefID", "options": ref_id},
            "properties": [{"id": "unit", "value": unit},
                           {"id": "custom.axisPlacement", "value": "right"}]}


def row(title: str) -> Json:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(panels: Sequence[Json]) -> list[Json]:
    """Give panels ids and a grid position: rows span the width, panels flow left to right."""
    out, x, y, line_height = [], 0, 0, 0
    for number, spec in enumerate(panels, start=1):
        panel = {k: v for k, v in spec.items() if k != "_width"}
        is_row = panel["type"] == "row"
        width, height = (24, 1) if is_row else (spec["_width"], 8)
        if is_row or x + width > 24:
            x, y, line_height = 0, y + line_height, 0
        panel["id"] = number
        panel["gridPos"] = {"h": height, "w": width, "x": x, "y": y}
        for ref, t in enumerate(panel.get("targets", [])):
            t["refId"] = chr(ord("A") + ref)
        x, line_height = x + width, max(line_height, height)
        out.append(panel)
    return out


def dashboard(uid: str, title: str, description: str, variables: Sequence[Json],
              panels: Sequence[Json]) -> Json:
    return {
        "uid": uid, "title": title, "description": description, "id": None, "version": 1,
        "schemaVersion": SCHEMA_VERSION, "editable": True, "graphTooltip": 1, "tags": ["tracejudge"],
        "timezone": "browser", "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "timepicker": {}, "fiscalYearStartMonth": 0, "liveNow": False,
        "links": [{"type": "dashboards", "tags": ["tracejudge"], "asDropdown": False, "includeVars": True,
                   "keepTime": True, "title": "tracejudge", "icon": "external link", "targetBlank": False}],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
            "type": "dashboard"}]},
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": layout(panels),
    }


# --- PromQL helpers (one spelling for each kind of query) ---------------------------------------------

# Session verdicts that passed: all but user_frustration's "unresolved" and a pass/fail judge's "fail".
PASSED_VERDICTS = 'verdict!~"fail|unresolved"'

def sum_rate(metric: str, by: str, sel: str = "") -> str:
    """Per-second rate of a counter, summed by some labels."""
    grouping = f" by ({by}) " if by else ""
    selector = f"{metric}{{{sel}}}" if sel else metric
    return f"sum{grouping}(rate({selector}[{RATE}]))"


def histogram_mean(histogram: str, by: str, sel: str = "") -> str:
    return f"{sum_rate(histogram + '_sum', by, sel)} / {sum_rate(histogram + '_count', by, sel)}"


def quantile(q: float, histogram: str, by: str, sel: str = "") -> str:
    return f"histogram_quantile({q}, {sum_rate(histogram + '_bucket', by + ', le', sel)})"


def or_zero(expr: str, by: str, activity: str) -> str:
    """`expr`, or 0 for each group (of the `by` labels) where `activity` has a series.

    A counter child that was never incremented has no series: no error, dead letter or skip yet means
    no numerator at all, and `expr` alone would be empty ("No data") where the answer is 0. `activity`
    is a series of the same groups that exists whenever there was something to count (the ratio's
    denominator, the judge's eligible traces, the process's own counters), so the 0 keeps the panel's
    labels and appears only where it is true; never `or vector(0)`, a label-less series that would
    say 0 for a judge, topic or sink that does not exist.
    """
    return f"({expr} or on ({by}) 0 * {activity})"


def ratio_or_zero(numerator: str, denominator: str, by: str) -> str:
    """`numerator / denominator`, 0 (not empty) where the denominator exists and the numerator not."""
    return f"{or_zero(numerator, by, denominator)} / {denominator}"


def total_or_zero(metric: str, by: str, sel: str, activity: str) -> str:
    """Per-second rate of a counter summed over its `reason`s, 0 while `activity` exists and no reason
    has a series yet: the "all reasons" line of a by-reason panel, which says 0 instead of nothing."""
    return or_zero(sum_rate(metric, by, sel), by, activity)


# --- the dashboards -----------------------------------------------------------------------------------

def quality() -> Json:
    sel = 'app=~"$app", judge=~"$judge"'
    judge_only = 'judge=~"$judge"'
    pair = "{{app}} · {{judge}}"
    eligible = sum_rate("tracejudge_judge_eligible_total", "app, judge", sel)
    judge_eligible = sum_rate("tracejudge_judge_eligible_total", "judge", judge_only)
    return dashboard(
        "tracejudge-quality", "tracejudge / Quality",
        "LLM-as-judge verdicts and computed metrics per app: pass rates, scores, coverage, judge health; "
        "conversations: sessions, session judges, frustration.",
        [label_variable("app", "app", "tracejudge_judge_verdicts_total"),
         label_variable("judge", "judge", 'tracejudge_judge_verdicts_total{app=~"$app"}'),
         label_variable("session_judge", "judge", 'tracejudge_session_judge_verdicts_total{app=~"$app"}'),
         session_url_variable(),
         trace_url_variable()],
        [
            row("Pass rate"),
            timeseries("Pass rate per judge and app (5m)",
                       "Share of judge verdicts that passed (app_judge:tracejudge_judge_pass:ratio5m).",
                       [target(f"app_judge:tracejudge_judge_pass:ratio5m{{{sel}}}", pair)], ratio=True,
                       empty=NO_VERDICTS),
            timeseries("Pass rate per judge and app (1h) vs yesterday",
                       "The window GroundednessDropped watches (floor 80%, vs the same hour yesterday).",
                       [target(f"app_judge:tracejudge_judge_pass:ratio1h{{{sel}}}", pair),
                        target(f"app_judge:tracejudge_judge_pass:ratio1h{{{sel}}} offset 1d",
                               pair + " yesterday")],
                       ratio=True, empty=NO_VERDICTS),
            timeseries("Verdicts per second",
                       "Judge verdicts by outcome: a pass rate over few verdicts is noise.",
                       [target(sum_rate("tracejudge_judge_verdicts_total", "app, judge, verdict", sel),
                               pair + " · {{verdict}}")],
                       unit="reqps", stack=True, width=24, empty=NO_VERDICTS),
            row("Scores"),
            heatmap("Judge score distribution",
                    "Judge scores in [0, 1] over time (the buckets of tracejudge_judge_score).",
                    f"sum by (le) (increase(tracejudge_judge_score_bucket{{{sel}}}[{RATE}]))",
                    empty=NO_VERDICTS),
            timeseries("Judge score p10 / p50 (exemplars link to the trace)",
                       "Low tail and median score per judge. Each dot is one judged trace at its score "
                       "(dots near 0 failed): hover it and open the trace, with the verdict and its "
                       "rationale written back on it (the trace_url variable sets where).",
                       [target(quantile(0.1, "tracejudge_judge_score", "judge", sel), "p10 {{judge}}",
                               exemplar=True),
                        target(quantile(0.5, "tracejudge_judge_score", "judge", sel), "p50 {{judge}}",
                               exemplar=True)],
                       unit="none", empty=NO_VERDICTS),
            timeseries("Computed metrics (mean)",
                       "Mean of each computed metric in [0, 1]: document recall, trajectory precision, ...",
                       [target(histogram_mean("tracejudge_metric_value", "app, metric", 'app=~"$app"'),
                               "{{app}} · {{metric}}")],
                       ratio=True, width=24,
                       empty="No computed metric in range (the traces carry no retrieval or trajectory)"),
            row("Coverage and judge health"),
            timeseries("Judge coverage (sampled / eligible)",
                       "Share of eligible traces that were sampled for each judge.",
                       [target(ratio_or_zero(sum_rate("tracejudge_judge_sampled_total", "app, judge", sel),
                                             eligible, "app, judge"), pair)],
                       ratio=True, empty=NO_ELIGIBLE),
            timeseries("Judge skips by reason",
                       "Sampled traces a judge did not evaluate (missing inputs, budget, queue full, "
                       "...); all reasons: their sum, 0 while the judge had eligible traces, none skipped.",
                       [target(sum_rate("tracejudge_judge_skipped_total", "app, judge, reason", sel),
                               pair + " · {{reason}}"),
                        target(total_or_zero("tracejudge_judge_skipped_total", "app, judge", sel, eligible),
                               pair + " · all reasons")],
                       unit="reqps", empty=NO_ELIGIBLE),
            timeseries("Judge errors by reason",
                       "Judge calls that ended without a verdict (timeouts, HTTP errors, unparsable "
                       "replies); all reasons: their sum, 0 while the judge had eligible traces, no error.",
                       [target(sum_rate("tracejudge_judge_errors_total", "judge, reason", judge_only),
                               "{{judge}} · {{reason}}"),
                        target(total_or_zero("tracejudge_judge_errors_total", "judge", judge_only,
                                             judge_eligible), "{{judge}} · all reasons")],
                       unit="reqps", empty=NO_ELIGIBLE),
            timeseries("Judge error ratio (15m)",
                       "JudgeErrorsHigh fires above 10% with at least 20 calls in 15 minutes. 0% while "
                       "a judge that was called had no error (the recording rule has no series then).",
                       [target(or_zero(f"judge:tracejudge_judge_errors:ratio15m{{{judge_only}}}", "judge",
                                       f"(judge:tracejudge_judge_calls:increase15m{{{judge_only}}} > 0)"),
                               "{{judge}}")],
                       ratio=True, empty="No judge call in the last 15 minutes"),
            *judge_trust(),
            *cost(),
            *conversations(),
        ])


def judge_trust() -> list[Json]:
    """The Judge trust row of the quality dashboard: observed vs corrected pass rates, calibration and
    its staleness, agreement with human labels, canaries (README "Trusting the judges")."""
    sel, judge_only = 'app=~"$app", judge=~"$judge"', 'judge=~"$judge"'
    pair = "{{app}} · {{judge}}"
    calibration = "tracejudge_judge_calibration"
    return [
        row("Judge trust"),
        timeseries("Pass rate (1h): observed vs corrected for the judge's error",
                   "Observed: the judge's verdicts. Corrected: Rogan–Gladen with the judge's calibrated TPR "
                   "and TNR (app_judge:tracejudge_judge_pass_corrected:ratio1h); absent without a "
                   "calibration on enough labels, for a stale one, or a judge no better than chance.",
                   [target(f"app_judge:tracejudge_judge_pass:ratio1h{{{sel}}}", pair + " observed"),
                    target(f"app_judge:tracejudge_judge_pass_corrected:ratio1h{{{sel}}}",
                           pair + " corrected")],
                   ratio=True, empty=NO_VERDICTS),
        timeseries("Calibration stale (1 = re-run tracejudge calibrate)",
                   "1 when the judge's configuration (its fingerprint) changed since it was calibrated: "
                   "its corrected pass rate is withheld.",
                   [target(f"max by (judge) (tracejudge_judge_calibration_stale{{{judge_only}}})",
                           "{{judge}} stale")],
                   unit="none", empty=NO_CALIBRATION),
        timeseries("Calibration: TPR, TNR, kappa (labels on the right)",
                   "What tracejudge calibrate measured against human labels (judges.calibration_file).",
                   [target(f'max by (judge, stat) ({calibration}{{{judge_only}, stat=~"tpr|tnr|kappa"}})',
                           "{{judge}} · {{stat}}"),
                    target(f'max by (judge) ({calibration}{{{judge_only}, stat=~"n"}})',
                           "{{judge}} · labels")],
                   ratio=True, overrides=[right_axis("B", "short")], empty=NO_CALIBRATION),
        timeseries("Agreement with human labels (1d)",
                   "Share of human labels agreeing with the judge's verdict on the same trace; "
                   "JudgeDisagreesWithHumans fires under 70% on at least 30 labels.",
                   [target(f"app_judge:tracejudge_judge_agreement:ratio1d{{{sel}}}", pair),
                    target(f"app_judge:tracejudge_judge_agreement:increase1d{{{sel}}}", pair + " labels")],
                   ratio=True, overrides=[right_axis("B", "short")], empty=NO_HUMAN_LABELS),
        timeseries("Human labels by outcome",
                   "Labels taken in: matched with a verdict, unmatched (no verdict in the window), for an "
                   "unknown judge, invalid.",
                   [target(sum_rate("tracejudge_judge_labels_total", "outcome"), "{{outcome}}"),
                    target(sum_rate("tracejudge_judge_agreement_total", "judge, outcome", sel),
                           "{{judge}} · {{outcome}}")],
                   unit="reqps", empty=NO_HUMAN_LABELS),
        timeseries("Canaries: disagreement with known answers (1h)",
                   "JudgeCanaryFailing fires above 20% on at least 10 canaries: the judge itself changed.",
                   [target(f"judge:tracejudge_judge_canary_disagree:ratio1h{{{judge_only}}}", "{{judge}}"),
                    target(sum_rate("tracejudge_judge_canary_total", "judge, outcome", judge_only),
                           "{{judge}} · {{outcome}}")],
                   ratio=True, overrides=[right_axis("B", "reqps")], empty=NO_CANARIES),
    ]


def cost() -> list[Json]:
    """The Cost row of the quality dashboard: what the agent's traces and the judges cost, and how much
    of each judge endpoint's hard spend cap is left (README "What it costs: agent and judges")."""
    app, judge_only = 'app=~"$app"', 'judge=~"$judge"'
    return [
        row("Cost"),
        timeseries("Agent cost per hour by app",
                   "What the evaluated traces cost the agent, in USD per hour: the cost each trace states "
                   "(MLflow) or its per-model tokens x the model's price. Traces of unknown cost are not "
                   "in it (tracejudge_cost_unknown_total counts them by reason).",
                   [target(f"{sum_rate('tracejudge_cost_usd_total', 'app', app)} * 3600", "{{app}}")],
                   unit="currencyUSD", empty=NO_TRACE_COST),
        timeseries("Agent cost per 1,000 traces",
                   "Mean cost of a trace of known cost, times 1,000, per app.",
                   [target(f"1000 * {histogram_mean('tracejudge_trace_cost_usd', 'app', app)}", "{{app}}")],
                   unit="currencyUSD", empty=NO_TRACE_COST),
        timeseries("Judge cost per hour by judge",
                   "What judging costs, in USD per hour: each judgement's reported usage x the judge "
                   "model's price (or the endpoint's configured price).",
                   [target(f"{sum_rate('tracejudge_judge_cost_usd_total', 'judge', judge_only)} * 3600",
                           "{{judge}}")],
                   unit="currencyUSD", empty="No priced judgement in range (no judge called, or no price "
                                             "for its model: endpoints.<name>.price)"),
        timeseries("Judge spend cap: remaining vs cap",
                   "USD each judge endpoint's hard cap (usd_per_hour / usd_per_day, per process) still "
                   "allows; judgements over it are skipped (budget). JudgeSpendNearCap fires at 80% spent.",
                   [target("min by (endpoint, window) (tracejudge_judge_budget_remaining_usd)",
                           "{{endpoint}} · {{window}} remaining"),
                    target("max by (endpoint, window) (tracejudge_judge_budget_cap_usd)",
                           "{{endpoint}} · {{window}} cap")],
                   unit="currencyUSD", empty=NO_SPEND_CAP),
    ]


def conversations() -> list[Json]:
    """The Conversations row of the quality dashboard: `tracejudge sessions` and its session judges."""
    app, sel, judge_only = 'app=~"$app"', 'app=~"$app", judge=~"$session_judge"', 'judge=~"$session_judge"'
    verdicts = "tracejudge_session_judge_verdicts_total"
    pair = "{{app}} · {{judge}}"
    # 0% for a judge none of whose verdicts passed (it has no passing series at all).
    passed = ratio_or_zero(sum_rate(verdicts, "app, judge", sel + ", " + PASSED_VERDICTS),
                           sum_rate(verdicts, "app, judge", sel), "app, judge")
    session_eligible = sum_rate("tracejudge_session_judge_eligible_total", "judge", judge_only)
    sampled = sum_rate("tracejudge_session_judge_sampled_total", "judge", judge_only)
    unresolved = f"app:tracejudge_user_frustration_unresolved:ratio1h{{{app}}}"
    return [
        row("Conversations (tracejudge sessions)"),
        timeseries("Sessions closed per minute by status",
                   "Sessions the session stage closed: complete (inactivity, end of input) or incomplete "
                   "(max_turns, max_duration_s, or closed early at a memory cap).",
                   [target("60 * " + sum_rate("tracejudge_sessions_total", "app, status", app),
                           "{{app}} · {{status}}")],
                   stack=True, empty=NO_SESSIONS),
        timeseries("Turns per session p50 / p90",
                   "Turns of the sessions closed in the window (tracejudge_session_turns).",
                   [target(quantile(q, "tracejudge_session_turns", "app", app),
                           f"p{round(q * 100)} {{{{app}}}}") for q in (0.5, 0.9)],
                   empty=NO_SESSIONS),
        timeseries("Session duration p50 / p90",
                   "First turn to last turn of the sessions closed in the window.",
                   [target(quantile(q, "tracejudge_session_duration_seconds", "app", app),
                           f"p{round(q * 100)} {{{{app}}}}") for q in (0.5, 0.9)],
                   unit="s", empty=NO_SESSIONS),
        timeseries("Sessions ending unresolved (user_frustration, 1h) vs yesterday",
                   "Share of the judged sessions the user_frustration judge found ending with the user "
                   "frustrated and unresolved, with the number judged (right axis). UserFrustrationRising: "
                   "over 20% on at least 20 sessions and over 1.5 times the same hour yesterday.",
                   [target(unresolved, "{{app}} unresolved"),
                    target(unresolved + " offset 1d", "{{app}} unresolved yesterday"),
                    target(f"app:tracejudge_user_frustration_verdicts:increase1h{{{app}}}",
                           "{{app}} sessions judged")],
                   unit="percentunit", overrides=[right_axis("C", "short")],
                   empty="No session judged by user_frustration in the last hour (sessions.judges)"),
        timeseries("Session judge pass rate",
                   "Share of session verdicts that passed (user_frustration: not unresolved).",
                   [target(passed, pair)], ratio=True, empty=NO_SESSION_JUDGES),
        timeseries("Session verdicts per minute",
                   "Session judge verdicts by value: a pass rate over few sessions is noise.",
                   [target("60 * " + sum_rate(verdicts, "app, judge, verdict", sel),
                           pair + " · {{verdict}}")],
                   stack=True, empty=NO_SESSION_JUDGES),
        timeseries("Session judge score p10 / p50 (exemplars link to the session)",
                   "Each dot is one judged session at its score: hover it and open the conversation, its "
                   "turns and the verdicts written back (the session_url variable sets where).",
                   [target(quantile(q, "tracejudge_session_judge_score", "judge", sel), f"p{round(q * 100)} "
                           "{{judge}}", exemplar=True) for q in (0.1, 0.5)],
                   unit="none", empty=NO_SESSION_JUDGES),
        timeseries("Session judge coverage (sampled / eligible)",
                   "Share of the closed sessions each session judge could judge that were sampled.",
                   [target(ratio_or_zero(sampled, session_eligible, "judge"), "{{judge}}")],
                   ratio=True, empty=NO_SESSION_JUDGES),
        timeseries("Session judge skips and errors by reason",
                   "Sampled sessions not judged (budget, overloaded, ...) and judgements without a verdict; "
                   "all reasons: their sums, 0 while the judge had eligible sessions and none.",
                   [target(sum_rate("tracejudge_session_judge_skipped_total", "judge, reason", judge_only),
                           "skipped {{judge}} · {{reason}}"),
                    target(sum_rate("tracejudge_session_judge_errors_total", "judge, reason", judge_only),
                           "error {{judge}} · {{reason}}"),
                    target(total_or_zero("tracejudge_session_judge_skipped_total", "judge", judge_only,
                                         session_eligible), "skipped {{judge}} · all reasons"),
                    target(total_or_zero("tracejudge_session_judge_errors_total", "judge", judge_only,
                                         session_eligible), "error {{judge}} · all reasons")],
                   unit="reqps", empty=NO_SESSION_JUDGES),
        timeseries("Sessions closed early and reopened per minute",
                   "Closed early: at max_turns, max_duration or evicted at a memory cap (then incomplete). "
                   "Reopened: a late turn for a remembered closed session, evaluated again. Forgotten: no "
                   "longer remembered, so a later turn starts a new session (evaluation 1).",
                   [target("60 * " + sum_rate("tracejudge_sessions_closed_early_total", "reason"),
                           "closed early · {{reason}}"),
                    target("60 * " + sum_rate("tracejudge_sessions_reopened_total", ""), "reopened"),
                    target("60 * " + sum_rate("tracejudge_sessions_forgotten_total", "reason"),
                           "forgotten · {{reason}}")],
                   empty=NO_SESSIONS),
        timeseries("Open sessions and turns held",
                   "Sessions waiting for more turns and the turns they hold, over all session-stage "
                   "replicas (caps: sessions.max_open_sessions, sessions.max_turns_held), and the closed "
                   "sessions remembered so a late turn reopens them (sessions.max_closed_sessions).",
                   [target("sum(tracejudge_sessions_open)", "open sessions"),
                    target("sum(tracejudge_session_turns_held)", "turns held"),
                    target("sum(tracejudge_sessions_remembered)", "closed sessions remembered")],
                   empty=NO_SESSIONS),
        timeseries("Bytes held by open sessions",
                   "Memory of the held turns, over all replicas (cap per replica: sessions.max_bytes_held).",
                   [target("sum(tracejudge_session_bytes_held)", "bytes held")],
                   unit="bytes", empty=NO_SESSIONS),
    ]


def operations() -> Json:
    app, topic, judge, sink = 'app=~"$app"', 'topic=~"$topic"', 'judge=~"$judge"', 'sink=~"$sink"'
    traces = "tracejudge_traces_total"
    failed = sum_rate(traces, "app", app + ', status="error"')
    no_traces = "No trace evaluated in range (is tracejudge run scraped?)"
    no_records = "No record read in range (is tracejudge run scraped?)"
    no_judge_calls = "No judge call in range (no judge configured, or no trace sampled)"
    batches = sum_rate("tracejudge_sink_batches_total", "sink", sink)
    return dashboard(
        "tracejudge-operations", "tracejudge / Operations",
        "Traffic, latency, tokens and failures of the evaluated agents; judge cost; Kafka consumption; "
        "writing verdicts back onto traces (tracejudge sink); the session stage (tracejudge sessions).",
        [label_variable("app", "app", traces),
         label_variable("topic", "topic", "tracejudge_records_total"),
         label_variable("judge", "judge", "tracejudge_judge_duration_seconds_count"),
         label_variable("sink", "sink", "tracejudge_sink_lag_records"),
         trace_url_variable()],
        [
            row("Agent traffic"),
            timeseries("Traces per second", "Evaluated traces by app and status.",
                       [target(sum_rate(traces, "app, status", app), "{{app}} · {{status}}")],
                       unit="reqps", stack=True, empty=no_traces),
            timeseries("Trace failure rate",
                       "Share of traces whose status is error: 0% while none failed.",
                       [target(ratio_or_zero(failed, sum_rate(traces, "app", app), "app"), "{{app}}")],
                       ratio=True, empty=no_traces),
            timeseries("Trace latency p50 / p95 / p99 (exemplars link to the trace)",
                       "End-to-end latency of the agent's traces; exemplar dots carry the trace_id.",
                       [target(quantile(q, "tracejudge_trace_latency_seconds", "app", app),
                               f"p{round(q * 100)} {{{{app}}}}", exemplar=True) for q in (0.5, 0.95, 0.99)],
                       unit="s", empty="No trace with a latency in range"),
            timeseries("Tokens per second", "Tokens the agents used, by direction.",
                       [target(sum_rate("tracejudge_tokens_total", "app, direction", app),
                               "{{app}} · {{direction}}")],
                       unit="short", stack=True, empty="No trace with token counts in range"),
            timeseries("Retrieved documents per trace (mean)",
                       "Documents retrieved per trace (the tracejudge_retrieved_documents histogram).",
                       [target(histogram_mean("tracejudge_retrieved_documents", "app", app), "{{app}}")],
                       unit="short", width=24, empty="No trace with retrieval in range"),
            row("Judges"),
            timeseries("Judge latency p50 / p95", "Duration of one judge call.",
                       [target(quantile(q, "tracejudge_judge_duration_seconds", "judge", judge),
                               f"p{round(q * 100)} {{{{judge}}}}") for q in (0.5, 0.95)],
                       unit="s", empty=no_judge_calls),
            timeseries("Judge tokens per second",
                       "Tokens the judges spent, by direction: the cost of evaluation.",
                       [target(sum_rate("tracejudge_judge_tokens_total", "judge, direction", judge),
                               "{{judge}} · {{direction}}")],
                       unit="short", stack=True, empty=no_judge_calls),
            row("Kafka"),
            timeseries("Records per second by outcome",
                       "Records read per topic: evaluated (ok) or dead-lettered.",
                       [target(sum_rate("tracejudge_records_total", "topic, outcome", topic),
                               "{{topic}} · {{outcome}}")],
                       unit="reqps", stack=True, empty=no_records),
            timeseries("Consumer lag (records)",
                       "Records between the consumer's position and the partition's end (alert: > 10000).",
                       [target(f"sum by (topic, partition) (tracejudge_consumer_lag_records{{{topic}}})",
                               "{{topic}} [{{partition}}]")],
                       unit="short", empty="No partition assigned (is tracejudge run scraped?)"),
            timeseries("Dead letters by reason",
                       "Records written to the dead-letter topic, by reason, and over all reasons: 0 while "
                       "records are read and none is dead-lettered.",
                       [target(sum_rate("tracejudge_dead_letters_total", "reason"), "{{reason}}"),
                        target(total_or_zero("tracejudge_dead_letters_total", "", "",
                                             sum_rate("tracejudge_records_total", "")), "all reasons")],
                       unit="reqps", empty=no_records),
            timeseries("Dead-letter ratio (15m)",
                       "DeadLettersRising fires above 1% with at least 20 records in 15 minutes. 0% while "
                       "records are read and none is dead-lettered (the recording rule has no series then).",
                       [target(or_zero(f"topic:tracejudge_records_dead_lettered:ratio15m{{{topic}}}",
                                       "topic", f"(topic:tracejudge_records:increase15m{{{topic}}} > 0)"),
                               "{{topic}}")],
                       ratio=True, empty="No record read in the last 15 minutes"),
            timeseries("Offset commits per second",
                       "Offsets are committed only after a record's results are exported: flat means stuck.",
                       [target(sum_rate("tracejudge_commits_total", ""), "commits")],
                       unit="reqps", width=24, empty="No tracejudge run scraped in range"),
            row("OpenTelemetry trace assembly"),
            timeseries("Traces being assembled",
                       "Open traces and held spans, waiting for a trace's root span or its idle timeout.",
                       [target("sum(tracejudge_assembly_open_traces)", "open traces"),
                        target("sum(tracejudge_assembly_spans_held)", "spans held")],
                       unit="short", empty=NO_OTLP),
            timeseries("Assembled traces emitted by reason",
                       "Why a trace was taken as complete (root seen, idle timeout, evicted at a limit).",
                       [target(sum_rate("tracejudge_assembly_traces_emitted_total", "reason"), "{{reason}}")],
                       unit="reqps", empty=NO_OTLP),
            row("Write-back (tracejudge sink)"),
            timeseries("Sink lag (results not yet written back)",
                       "Records between each sink's position on the results topic and its end, summed "
                       "over partitions and replicas (WriteBackLagging: > 10000 for 15 minutes).",
                       [target(f"sum by (sink) (tracejudge_sink_lag_records{{{sink}}})", "{{sink}}")],
                       unit="short", empty=NO_SINK),
            timeseries("Verdicts written back per second by outcome",
                       "written: a new assessment/event; already_written: found on the trace already "
                       "(a redelivery after a restart or rebalance), so not written twice.",
                       [target(sum_rate("tracejudge_sink_writes_total", "sink, outcome", sink),
                               "{{sink}} · {{outcome}}")],
                       unit="reqps", stack=True, empty=NO_SINK),
            timeseries("Verdicts skipped by reason",
                       "Deliberately not written. unknown_trace: the trace never reached the trace "
                       "backend within the retry window (traces not logged there). All reasons: 0 while the "
                       "sink runs and skipped none.",
                       [target(sum_rate("tracejudge_sink_skipped_total", "sink, reason", sink),
                               "{{sink}} · {{reason}}"),
                        target(total_or_zero("tracejudge_sink_skipped_total", "sink", sink, batches),
                               "{{sink}} · all reasons")],
                       unit="reqps", empty=NO_SINK),
            timeseries("Write retries by reason",
                       "Batches offered again after network errors, 429, 5xx or a trace not there yet: "
                       "lag grows meanwhile, nothing is lost. All reasons: 0 while the sink runs and "
                       "retried none.",
                       [target(sum_rate("tracejudge_sink_retries_total", "sink, reason", sink),
                               "{{sink}} · {{reason}}"),
                        target(total_or_zero("tracejudge_sink_retries_total", "sink", sink, batches),
                               "{{sink}} · all reasons")],
                       unit="reqps", empty=NO_SINK),
            timeseries("Sink dead letters by reason",
                       "Results-topic records that are not tracejudge results (or of an unknown schema "
                       "version), sent to sink.dead_letter_topic. All reasons: 0 while the sink runs and "
                       "dead-lettered none.",
                       [target(sum_rate("tracejudge_sink_dead_letters_total", "sink, reason", sink),
                               "{{sink}} · {{reason}}"),
                        target(total_or_zero("tracejudge_sink_dead_letters_total", "sink", sink, batches),
                               "{{sink}} · all reasons")],
                       unit="reqps", empty=NO_SINK),
            timeseries("Batches written per second",
                       "One batch per partition per checkpoint, committed after it is written: flat "
                       "while the lag grows means the sink is stuck.",
                       [target(batches, "{{sink}}")],
                       unit="reqps", empty=NO_SINK),
            row("Session stage (tracejudge sessions)"),
            timeseries("Turns in, session results out",
                       "Trace results taken into sessions, and session results the broker acknowledged "
                       "(only then are the turns' offsets committed): turns flowing while no result "
                       "comes out means sessions never close.",
                       [target(sum_rate("tracejudge_session_turns_received_total", ""), "turns"),
                        target(sum_rate("tracejudge_session_results_published_total", ""),
                               "session results published")],
                       unit="reqps", empty=NO_SESSIONS),
            timeseries("Results not taken into a session, by reason",
                       "no_session: the trace has no session id (released at once: single-turn traffic); "
                       "session_result: a session result line; duplicate: a turn the session already holds "
                       "(a redelivery).",
                       [target(sum_rate("tracejudge_session_turns_ignored_total", "reason"), "{{reason}}")],
                       unit="reqps", empty=NO_SESSIONS),
            timeseries("Session dead letters by reason",
                       "Results-topic records the session stage cannot read (not a result, a newer schema "
                       "version), sent to sessions.dead_letter_topic. All reasons: 0 while the stage "
                       "runs and dead-lettered none.",
                       [target(sum_rate("tracejudge_session_dead_letters_total", "reason"), "{{reason}}"),
                        target(total_or_zero("tracejudge_session_dead_letters_total", "", "",
                                             sum_rate("tracejudge_session_turns_received_total", "")),
                               "all reasons")],
                       unit="reqps", empty=NO_SESSIONS),
            timeseries("Turns placed by arrival, session ids hashed",
                       "Turns whose timestamp was missing or absurd (far future, before 2000), placed by "
                       "their arrival time instead; session ids over 256 bytes, hashed into the key.",
                       [target(sum_rate("tracejudge_session_turns_placed_by_arrival_total", "reason"),
                               "placed by arrival · {{reason}}"),
                        target(sum_rate("tracejudge_session_ids_hashed_total", ""), "session ids hashed")],
                       unit="reqps", empty=NO_SESSIONS),
        ])


DASHBOARDS = {"tracejudge-quality.json": quality, "tracejudge-operations.json": operations}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = OUT / name, render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in stale:
        print(f"{path} is stale: run python deploy/grafana/build_dashboards.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
