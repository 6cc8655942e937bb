"""The building blocks of the tracejudge dashboards: variables, panels, layout, and the PromQL helpers.

One spelling for each kind of panel and query, shared by the Quality (quality.py) and Operations
(operations.py) dashboards; build_dashboards.py writes them (its docstring names the conventions every
panel follows). A panel's id comes from its title (`panel_id`), the same function as
`tracejudge.consumer.config.alert_links.panel_id`, so alert links keep opening their panel.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

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
NO_RELEASES = "No two releases to compare in the last day (no version stated, or one version so far)"
NO_SLOS = "No SLOs configured: see README#quality-slos (tracejudge slo render, then load its rules file)"
NO_FINDINGS = ("No findings: the findings stage is not running (tracejudge findings run), or nothing stands "
               "out — see README#what-the-failures-have-in-common")
NO_FLEET_SPEND = "No fleet-wide spend cap (judges.fleet_spend): each replica caps its own spend alone"


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


def target(expr: str, legend: str, *, exemplar: bool = False, fmt: str = "time_series",
           instant: bool = False) -> Json:
    """One PromQL query; `instant` asks for the value now only (a table's rows), not a range."""
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": not instant,
            "instant": instant, "exemplar": exemplar, "format": fmt, "editorMode": "code"}


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


def table(title: str, description: str, columns: Sequence[tuple[str, str, str]], labels: Sequence[str], *,
          sort_by: str, width: int = 24, empty: str) -> Json:
    """A table of instant queries that share their labels, one row per label set: `columns` are
    (PromQL, column header, unit), joined on `labels` (Grafana's merge), the label columns first, sorted
    by the column headed `sort_by`, largest first. A table shows no exemplars: a time series of the same
    rows beside it carries them."""
    targets = [target(expr, header, fmt="table", instant=True) for expr, header, _ in columns]
    names = {f"Value #{chr(ord('A') + i)}": header for i, (_, header, _) in enumerate(columns)}
    order = {name: i for i, name in enumerate([*labels, *names.values()])}
    overrides = [{"matcher": {"id": "byName", "options": header},
                  "properties": [{"id": "unit", "value": unit}]} for _, header, unit in columns]
    return {"type": "table", "title": title, "description": description, "datasource": DATASOURCE,
            "targets": targets,
            "fieldConfig": {"defaults": {"noValue": empty, "custom": {"align": "auto", "filterable": True}},
                            "overrides": overrides},
            "options": {"showHeader": True, "cellHeight": "sm", "sortBy": [{"displayName": sort_by,
                                                                             "desc": True}],
                        "footer": {"show": False, "reducer": ["sum"], "fields": ""}},
            "transformations": [{"id": "merge", "options": {}},
                                {"id": "organize", "options": {"excludeByName": {"Time": True},
                                                               "indexByName": order,
                                                               "renameByName": names}}],
            "_width": width}


def right_axis(ref_id: str, unit: str) -> Json:
    """An override putting one query's series on a right-hand axis with its own unit (e.g. a count
    beside a ratio)."""
    return {"matcher": {"id": "byFrameRefID", "options": ref_id},
            "properties": [{"id": "unit", "value": unit},
                           {"id": "custom.axisPlacement", "value": "right"}]}


def row(title: str) -> Json:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def panel_id(title: str) -> int:
    """A panel's id from its title, the same as `tracejudge.consumer.config.alert_links.panel_id`, so
    an alert's `dashboard_url` (`viewPanel=<id>`) still opens its panel after panels are added."""
    return zlib.crc32(title.encode()) % 9_000_000 + 1_000_000


def layout(panels: Sequence[Json]) -> list[Json]:
    """Give panels ids (from their titles, unique in a dashboard) and a grid position: rows span the
    width, panels flow left to right."""
    out, x, y, line_height = [], 0, 0, 0
    for spec in panels:
        panel = {k: v for k, v in spec.items() if k != "_width"}
        is_row = panel["type"] == "row"
        width, height = (24, 1) if is_row else (spec["_width"], 8)
        if is_row or x + width > 24:
            x, y, line_height = 0, y + line_height, 0
        panel["id"] = panel_id(panel["title"])
        if any(p["id"] == panel["id"] for p in out):
            raise ValueError(f"panel {panel['title']!r}: its id collides with another panel's (same title?)")
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
