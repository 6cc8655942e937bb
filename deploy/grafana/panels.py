"""The building blocks of the tracejudge dashboards: variables, panels, layout, and the PromQL helpers.

One spelling for each kind of panel and query, shared by the Quality (quality.py) and Operations
(operations.py) dashboards; build_dashboards.py writes them (its docstring names the conventions every
panel follows). The panels, queries and variables are Grafana's own dashboard types, built with
grafana-foundation-sdk (Grafana Labs' dashboards-as-code library; the `test` extra, never a runtime
dependency): a misspelt field or option fails here, at build time, not in a browser. A panel's id
comes from its title (`panel_id`), the same function as `tracejudge.consumer.config.alert_links.panel_id`,
so alert links keep opening their panel.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import heatmap as heatmap_builders
from grafana_foundation_sdk.builders import prometheus as prometheus_builders
from grafana_foundation_sdk.builders import table as table_builders
from grafana_foundation_sdk.builders import timeseries as timeseries_builders
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
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
# The documentation site (docs/mkdocs.yml's site_url): texts that send the reader further link its pages.
DOCS = "https://tracejudge.github.io/tracejudge/"

Board = dashboard_builders.Dashboard
Target = prometheus_builders.Dataquery
Panel = timeseries_builders.Panel | heatmap_builders.Panel | table_builders.Panel
Item = Panel | dashboard_builders.Row
Variable = (dashboard_builders.DatasourceVariable | dashboard_builders.QueryVariable
            | dashboard_builders.TextBoxVariable)
PANEL_HEIGHT = 8

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
NO_SLOS = f"No SLOs configured: see {DOCS}guides/slos/ (tracejudge slo render, then load its rules file)"
NO_FINDINGS = ("No findings: the findings stage is not running (tracejudge findings run), or nothing stands "
               f"out — see {DOCS}guides/findings/")
NO_FLEET_SPEND = "No fleet-wide spend cap (judges.fleet_spend): each replica caps its own spend alone"


# --- building blocks ----------------------------------------------------------------------------------

def datasource_variable() -> dashboard_builders.DatasourceVariable:
    return (dashboard_builders.DatasourceVariable("datasource").label("Data source").type("prometheus")
            .hide(dashboard_models.VariableHide.DONT_HIDE).regex("").include_all(False).multi(False))


def label_variable(name: str, label: str, metric_selector: str) -> dashboard_builders.QueryVariable:
    """A multi-value variable over one label; "All" means `.*`, so panels match it with `=~`."""
    query = {"qryType": 1, "query": f"label_values({metric_selector}, {label})",  # 1: label values
             "refId": "PrometheusVariableQueryEditor-VariableQuery"}
    return (dashboard_builders.QueryVariable(name).label(label).datasource(DATASOURCE).query(query)
            .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC).regex("")
            .hide(dashboard_models.VariableHide.DONT_HIDE).multi(True).include_all(True).all_value(".*")
            .current(dashboard_models.VariableOption(selected=True, text=["All"], value=["$__all"])))


def _textbox(name: str, label: str, default: str, description: str) -> dashboard_builders.TextBoxVariable:
    return (dashboard_builders.TextBoxVariable(name).label(label).default_value(default)
            .current(dashboard_models.VariableOption(selected=False, text=default, value=default))
            .options([dashboard_models.VariableOption(selected=True, text=default, value=default)])
            .hide(dashboard_models.VariableHide.DONT_HIDE).description(description))


def trace_url_variable(default: str = MLFLOW_TRACE_URL) -> dashboard_builders.TextBoxVariable:
    """A textbox: the trace UI's URL up to the trace id. Exemplar links (configured on the datasource
    as `${trace_url:raw}${__value.raw}`) read it, so each dashboard viewer can point them elsewhere
    (Jaeger: `http://jaeger:16686/trace/`) or set it with `?var-trace_url=...`."""
    return _textbox("trace_url", "Trace link (URL before the trace id)", default,
                    "Exemplar dots link to <this URL><trace id>. MLflow: <mlflow>/#/experiments/<id>/"
                    "traces?selectedEvaluationId=tr- ; Jaeger: <jaeger>/trace/ . "
                    f"See From an exemplar to the trace: {DOCS}deploying/#from-an-exemplar-to-the-trace")


def session_url_variable(default: str = MLFLOW_SESSION_URL) -> dashboard_builders.TextBoxVariable:
    """A textbox like `trace_url`, for the `session_id` exemplars of the session judge scores
    (datasource destination `${session_url:raw}${__value.raw}`)."""
    return _textbox("session_url", "Session link (URL before the session id)", default,
                    "Session judge exemplar dots link to <this URL><session id>. MLflow: <mlflow>/#/"
                    "experiments/<id>/chat-sessions/ . See From an exemplar to the trace: "
                    f"{DOCS}deploying/#from-an-exemplar-to-the-trace")


def target(expr: str, legend: str, *, exemplar: bool = False, fmt: str = "time_series",
           instant: bool = False) -> Target:
    """One PromQL query; `instant` asks for the value now only (a table's rows), not a range."""
    query = (prometheus_builders.Dataquery().datasource(DATASOURCE).expr(expr).legend_format(legend)
             .exemplar(exemplar).format(prometheus_models.PromQueryFormat(fmt))
             .editor_mode(prometheus_models.QueryEditorMode.CODE))
    return query.instant() if instant else query.range()


def _with_targets(panel: Panel, targets: Sequence[Target]) -> Panel:
    """The panel's queries, lettered A, B, ... in order (what `byFrameRefID` overrides point at)."""
    return panel.targets([t.ref_id(chr(ord("A") + i)) for i, t in enumerate(targets)])


def timeseries(title: str, description: str, targets: Sequence[Target], *, unit: str = "short",
               ratio: bool = False, stack: bool = False, width: int = 12,
               overrides: Sequence[dashboard_builders.DashboardFieldConfigSourceOverrides] = (),
               empty: str | None = None) -> timeseries_builders.Panel:
    """A time series panel. `empty` is why it can have no data (Grafana's "No value" text, shown
    instead of a bare "No data"): for a panel whose answer, when nothing happened, is 0, the query
    itself says 0 (`or_zero`), and `empty` only names when there is nothing to say 0 about."""
    stacking = common_models.StackingMode.NORMAL if stack else common_models.StackingMode.NONE
    panel = (timeseries_builders.Panel().title(title).description(description).datasource(DATASOURCE)
             .unit("percentunit" if ratio else unit)
             .draw_style(common_models.GraphDrawStyle.LINE).line_width(1).fill_opacity(20 if stack else 0)
             .show_points(common_models.VisibilityMode.NEVER).span_nulls(False)
             .stacking(common_builders.StackingConfig().mode(stacking).group("A"))
             .overrides(list(overrides))
             .legend(common_builders.VizLegendOptions().display_mode(common_models.LegendDisplayMode.TABLE)
                     .placement(common_models.LegendPlacement.BOTTOM).show_legend(True)
                     .calcs(["lastNotNull", "mean"]))
             .tooltip(common_builders.VizTooltipOptions().mode(common_models.TooltipDisplayMode.MULTI)
                      .sort(common_models.SortOrder.DESCENDING))
             .span(width).height(PANEL_HEIGHT))
    if ratio:
        panel.min(0).max(1)
    if empty:
        panel.no_value(empty)
    return _with_targets(panel, targets)


def heatmap(title: str, description: str, expr: str, *, width: int = 12,
            empty: str | None = None) -> heatmap_builders.Panel:
    panel = (heatmap_builders.Panel().title(title).description(description).datasource(DATASOURCE)
             .calculate(False).cell_gap(1)
             # Grafana's own color defaults, written out: the SDK's model would otherwise say 0 steps.
             .color(heatmap_builders.HeatmapColorOptions().mode(heatmap_models.HeatmapColorMode.SCHEME)
                    .scheme("Oranges").fill("dark-orange").scale(heatmap_models.HeatmapColorScale.EXPONENTIAL)
                    .exponent(0.5).steps(64).reverse(False))
             .y_axis(heatmap_builders.YAxisConfig().axis_placement(common_models.AxisPlacement.LEFT)
                     .unit("short"))
             .mode(common_models.TooltipDisplayMode.SINGLE).show_y_histogram()
             .exemplars_color("rgba(255,0,255,0.7)")
             # Grafana's default, written out so the file reads back through the SDK's types unchanged.
             .hide_from(common_builders.HideSeriesConfig().legend(False).tooltip(False).viz(False))
             .span(width).height(PANEL_HEIGHT))
    if empty:
        panel.no_value(empty)
    return _with_targets(panel, [target(expr, "{{le}}", fmt="heatmap")])


def table(title: str, description: str, columns: Sequence[tuple[str, str, str]], labels: Sequence[str], *,
          sort_by: str, width: int = 24, empty: str) -> table_builders.Panel:
    """A table of instant queries that share their labels, one row per label set: `columns` are
    (PromQL, column header, unit), joined on `labels` (Grafana's merge), the label columns first, sorted
    by the column headed `sort_by`, largest first. A table shows no exemplars: a time series of the same
    rows beside it carries them."""
    targets = [target(expr, header, fmt="table", instant=True) for expr, header, _ in columns]
    names = {f"Value #{chr(ord('A') + i)}": header for i, (_, header, _) in enumerate(columns)}
    order = {name: i for i, name in enumerate([*labels, *names.values()])}
    panel = (table_builders.Panel().title(title).description(description).datasource(DATASOURCE)
             .no_value(empty).align(common_models.FieldTextAlignment.AUTO).filterable(True)
             .overrides([dashboard_builders.DashboardFieldConfigSourceOverrides()
                         .matcher(dashboard_models.MatcherConfig(id_val="byName", options=header))
                         .properties([dashboard_models.DynamicConfigValue(id_val="unit", value=unit)])
                         for _, header, unit in columns])
             .show_header(True).cell_height(common_models.TableCellHeight.SM)
             .sort_by([common_builders.TableSortByFieldState().display_name(sort_by).desc(True)])
             .footer(common_builders.TableFooterOptions().show(False).reducer(["sum"]).fields([]))
             .transformations([
                 dashboard_models.DataTransformerConfig(id_val="merge", options={}),
                 dashboard_models.DataTransformerConfig(id_val="organize", options={
                     "excludeByName": {"Time": True}, "indexByName": order, "renameByName": names})])
             .span(width).height(PANEL_HEIGHT))
    return _with_targets(panel, targets)


def right_axis(ref_id: str, unit: str) -> dashboard_builders.DashboardFieldConfigSourceOverrides:
    """An override putting one query's series on a right-hand axis with its own unit (e.g. a count
    beside a ratio)."""
    return (dashboard_builders.DashboardFieldConfigSourceOverrides()
            .matcher(dashboard_models.MatcherConfig(id_val="byFrameRefID", options=ref_id))
            .properties([dashboard_models.DynamicConfigValue(id_val="unit", value=unit),
                         dashboard_models.DynamicConfigValue(id_val="custom.axisPlacement", value="right")]))


def row(title: str) -> dashboard_builders.Row:
    return dashboard_builders.Row(title).collapsed(False)


def panel_id(title: str) -> int:
    """A panel's id from its title, the same as `tracejudge.consumer.config.alert_links.panel_id`, so
    an alert's `dashboard_url` (`viewPanel=<id>`) still opens its panel after panels are added."""
    return zlib.crc32(title.encode()) % 9_000_000 + 1_000_000


def layout(board: dashboard_builders.Dashboard, items: Sequence[Item]) -> None:
    """Add rows and panels to `board` with ids (from their titles, unique in a dashboard) and a grid
    position: rows span the width, panels flow left to right and wrap to a new line when the next does
    not fit (the SDK's own placement would let a wide panel overflow the line)."""
    ids: set[int] = set()
    x = y = line_height = 0
    for item in items:
        is_row = isinstance(item, dashboard_builders.Row)
        built = item.build()
        width, height = (24, 1) if is_row else (built.grid_pos.w, built.grid_pos.h)
        if is_row or x + width > 24:
            x, y, line_height = 0, y + line_height, 0
        ident = panel_id(built.title or "")
        if ident in ids:
            raise ValueError(f"panel {built.title!r}: its id collides with another panel's (same title?)")
        ids.add(ident)
        item.id(ident).grid_pos(dashboard_models.GridPos(h=height, w=width, x=x, y=y))
        if is_row:
            board.with_row(item)
        else:
            board.with_panel(item)
        x, line_height = x + width, max(line_height, height)


def dashboard(uid: str, title: str, description: str, variables: Sequence[Variable],
              panels: Sequence[Item]) -> dashboard_builders.Dashboard:
    board = (dashboard_builders.Dashboard(title).uid(uid).description(description).version(1).editable()
             .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR).tags(["tracejudge"])
             .timezone("browser").refresh("30s").time("now-6h", "now")
             .fiscal_year_start_month(0).live_now(False)
             .link(dashboard_builders.DashboardLink("tracejudge")
                   .type(dashboard_models.DashboardLinkType.DASHBOARDS).tags(["tracejudge"])
                   .as_dropdown(False).include_vars(True).keep_time(True).icon("external link")
                   .target_blank(False))
             .annotation(dashboard_builders.AnnotationQuery().built_in(1).name("Annotations & Alerts")
                         .datasource(dashboard_models.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
                         .enable(True).hide(True).icon_color("rgba(0, 211, 255, 1)").type("dashboard"))
             .variables([datasource_variable(), *variables]))
    layout(board, panels)
    return board


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
