"""The links an alert carries: `runbook_url`, `dashboard_url` and `traces_url` annotations, absolute, built
from the `alerts:` section as Prometheus templates that Prometheus fills in when the alert fires
(`tracejudge.consumer.config`).

One function for every caller, whatever writes the rule: `link_annotations(alerts, AlertShape(name,
labels, window_s))` returns the annotations of one alert (`tracejudge alerts render` calls it for each
alert of a rules file, `shape_of` reads the shape from the rule itself; a command that generates rules
calls it with the shape it knows).

The runbook is a page per alert, `<alerts.runbook_base_url>/<AlertName>/` (the alert's name as written,
case kept: the documentation site's docs/pages/runbooks/<AlertName>.md); what the other two templates hold:
- the alert's labels, URL-encoded (`{{ $labels.app | urlquery }}`): the links of an alert for app
  `shop` open shop's traces;
- its window, from `time()` at the evaluation that fired it (`{{ with query "time() - 4500" }}`): the
  trace search and the dashboard cover [now - window, now], where the window is the longest range the
  alert's expression reads (recording rules included, `offset` excluded) plus its `for:`, the time
  over which the failing verdicts that fired it were counted.

The trace search exists where it means something, an alert with an `app` label: with a `judge` label
too, the app's traces that judge failed in the window; with an app alone, the app's traces in the
window. Alerts about topics, sinks or endpoints get the runbook and the dashboard only.

Label values go into URLs through `urlquery`; they are not escaped for the filter languages: an app or
judge name holding a quote (`'` for MLflow, `"` for TraceQL and Jaeger's tags) makes a filter that
finds nothing.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from tracejudge.consumer.config.alerts import AlertsSettings

__all__ = ["DASHBOARDS", "LINK_ANNOTATIONS", "PANELS", "AlertShape", "duration_seconds", "link_annotations",
           "panel_id", "shape_of"]

# The annotations this module owns (an older `runbook` too): rendering replaces them, nothing else.
LINK_ANNOTATIONS = ("runbook_url", "dashboard_url", "traces_url")
REPLACED_ANNOTATIONS = (*LINK_ANNOTATIONS, "runbook")

# deploy/grafana/build_dashboards.py: each dashboard's uid -> its label variables (`var-<name>`).
DASHBOARDS: dict[str, tuple[str, ...]] = {
    "tracejudge-quality": ("app", "judge", "session_judge"),
    "tracejudge-operations": ("app", "topic", "judge", "sink"),
}
# The panel an alert's `dashboard_url` opens (`viewPanel`): (dashboard uid, panel title). An alert not
# listed opens its dashboard (quality when it has an app or judge label, else operations) whole.
PANELS: dict[str, tuple[str, str]] = {
    "GroundednessDropped": ("tracejudge-quality", "Pass rate per judge and app (1h) vs yesterday"),
    "JudgeErrorsHigh": ("tracejudge-quality", "Judge error ratio (15m)"),
    "EvaluationsMissing": ("tracejudge-quality", "Judge coverage (sampled / eligible)"),
    "ConsumerLagHigh": ("tracejudge-operations", "Consumer lag (records)"),
    "DeadLettersRising": ("tracejudge-operations", "Dead-letter ratio (15m)"),
    "WriteBackLagging": ("tracejudge-operations", "Sink lag (results not yet written back)"),
    "UserFrustrationRising": ("tracejudge-quality",
                              "Sessions ending unresolved (user_frustration, 1h) vs yesterday"),
    "JudgeDisagreesWithHumans": ("tracejudge-quality", "Agreement with human labels (1d)"),
    "JudgeCanaryFailing": ("tracejudge-quality", "Canaries: disagreement with known answers (1h)"),
    "ReleaseRegressed": ("tracejudge-quality", "Pass rate: current vs previous release (1d)"),
    "JudgeSpendNearCap": ("tracejudge-quality", "Judge spend cap: remaining vs cap"),
    "SLOBurnFast": ("tracejudge-quality", "SLO burn rate per window (1 = budget spent exactly)"),
    "SLOBurnSlow": ("tracejudge-quality", "SLO burn rate per window (1 = budget spent exactly)"),
}
# The dashboard shows at least this much history before the alert's window, for context.
DASHBOARD_CONTEXT_S = 6 * 3600
# The MLflow sink writes a failed pass/fail verdict as feedback value "no"; the OTLP sink as the
# `gen_ai.evaluation.score.label` "fail".
MLFLOW_FAILED = "no"
OTLP_FAILED = "fail"

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_DURATION = re.compile(r"(\d+)(ms|[smhdwy])")
_RANGE = re.compile(r"\[\s*([0-9smhdwy]+)\s*(?::[^\]]*)?\]")
_GROUPING = re.compile(r"\b(?:by|on|group_left|group_right)\s*\(([^)]*)\)")
_LABEL_REF = re.compile(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)")
_RULE_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def panel_id(title: str) -> int:
    """A dashboard panel's id from its title, so a link to a panel survives panels added before it
    (deploy/grafana/build_dashboards.py gives every panel this id)."""
    return zlib.crc32(title.encode()) % 9_000_000 + 1_000_000


def duration_seconds(text: str) -> float:
    """A Prometheus duration ("1h30m", "15m", "500ms") in seconds."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


@dataclass(frozen=True)
class AlertShape:
    """What the links of one alert need: its name, the labels its alerts carry (those that select:
    `app`, `judge`, `topic`, `sink`, `version`, ...) and its window in seconds (how far back the
    verdicts that fired it were counted: the longest range read plus `for:`)."""

    name: str
    labels: frozenset[str]
    window_s: int

    @classmethod
    def of(cls, name: str, labels: Iterable[str], window_s: float) -> AlertShape:
        return cls(name, frozenset(labels), max(0, round(window_s)))


def shape_of(rule: Mapping[str, Any], recording: Mapping[str, str]) -> AlertShape:
    """The shape of an alerting rule of a rules file; `recording` maps each recording rule of the file
    to its expression. Labels: those its expression groups or matches by (`by (...)`, `on (...)`,
    `group_left (...)`, through the recording rules it reads, recursively) and those its summary and
    description name (`$labels.app`)."""
    labels, ranges = _reads(str(rule["expr"]), recording, set())
    notes = rule.get("annotations") or {}
    text = " ".join(str(v) for k, v in notes.items() if k not in REPLACED_ANNOTATIONS)
    labels |= set(_LABEL_REF.findall(text))
    pending = duration_seconds(str(rule["for"])) if rule.get("for") else 0
    return AlertShape.of(str(rule["alert"]), labels, max(ranges, default=0) + pending)


def _reads(expr: str, recording: Mapping[str, str], seen: set[str]) -> tuple[set[str], list[float]]:
    """(labels grouped or matched by, range durations in seconds) of `expr` and the recording rules it
    reads."""
    labels = {name.strip() for group in _GROUPING.findall(expr) for name in group.split(",") if name.strip()}
    ranges = [duration_seconds(r) for r in _RANGE.findall(expr)]
    for name in set(_RULE_NAME.findall(expr)) & set(recording) - seen:
        seen.add(name)
        more, more_ranges = _reads(recording[name], recording, seen)
        labels |= more
        ranges += more_ranges
    return labels, ranges


def link_annotations(alerts: AlertsSettings, shape: AlertShape, *, app_tag: str | None = None
                     ) -> dict[str, str]:
    """The alert's link annotations, each a Prometheus template of an absolute URL: `runbook_url` and
    `dashboard_url` always, `traces_url` where the alert has an app (and `trace_search.kind` is not
    `none`). `app_tag` is `stream.app_tag`, used when `trace_search.mlflow.app_tag` is unset."""
    out = {"runbook_url": runbook_url(alerts, shape.name), "dashboard_url": dashboard_url(alerts, shape)}
    traces = traces_url(alerts, shape, app_tag=app_tag)
    if traces is not None:
        out["traces_url"] = traces
    return out


def runbook_url(alerts: AlertsSettings, name: str) -> str:
    """The alert's runbook page: `alerts.runbook_base_url` with exactly one trailing '/', then the alert's
    name and '/' (the documentation site builds docs/pages/runbooks/<AlertName>.md at
    `runbooks/<AlertName>/`); a base holding `{alert}` has it replaced by the lower-cased name."""
    base = alerts.runbook_base_url
    if "{alert}" in base:
        return base.replace("{alert}", name.lower())
    return f"{base.rstrip('/')}/{name}/"


def dashboard_url(alerts: AlertsSettings, shape: AlertShape) -> str:
    """The Grafana dashboard, its variables set from the alert's labels, on the panel of the alert
    (`PANELS`), over the alert's window or the last `DASHBOARD_CONTEXT_S`, whichever is longer."""
    uid, title = PANELS.get(shape.name, (None, None))
    if uid is None:
        quality = "app" in shape.labels or "judge" in shape.labels
        uid = "tracejudge-quality" if quality else "tracejudge-operations"
    params: list[tuple[str, str]] = [("orgId", str(alerts.grafana_org_id))]
    if title is not None:
        params.append(("viewPanel", str(panel_id(title))))
    params += [(f"var-{v}", _label(v)) for v in DASHBOARDS[uid] if v in shape.labels]
    params += [("from", _epoch(max(shape.window_s, DASHBOARD_CONTEXT_S), 1000)), ("to", _epoch(0, 1000))]
    return f"{alerts.dashboard_url}/d/{uid}/?{_query(params)}"


def traces_url(alerts: AlertsSettings, shape: AlertShape, *, app_tag: str | None = None) -> str | None:
    """The trace search of the alert's app (and failing verdicts of its judge) in its window; None
    without an app label or with `trace_search.kind: none`."""
    kind = alerts.trace_search.kind
    if "app" not in shape.labels or kind == "none":
        return None
    judge = "judge" in shape.labels
    if kind == "mlflow":
        return _mlflow(alerts, shape.window_s, judge, alerts.trace_search.mlflow.app_tag or app_tag)
    if kind == "tempo":
        return _tempo(alerts, shape.window_s, judge)
    return _jaeger(alerts, shape.window_s, judge)


# --- the trace UIs ------------------------------------------------------------------------------------

def _mlflow(alerts: AlertsSettings, window_s: int, judge: bool, app_tag: str | None) -> str:
    """MLflow's experiment traces view (`#/experiments/<id>/traces`) with a custom time range
    (`startTime`/`endTime`, ISO 8601), the app's tag (`tag=<app_tag>=<app>`) and the traces page's
    URL filters (`filter=COLUMN::OPERATOR::VALUE::KEY`, from which the page builds `feedback.<judge> =
    'no'` and `tags.<app_tag> = '<app>'`). MLflow 3.17.2's view applies the time range and the tag; it
    does not read `filter=` yet, so there the judge's filter is one click (Filter, the judge, "no").
    An app `experiment:<id>` opens that experiment, unfiltered by app."""
    cfg = alerts.trace_search.mlflow
    params: list[tuple[str, str]] = [("startTimeLabel", "CUSTOM"), ("startTime", _iso(window_s)),
                                     ("endTime", _iso(0))]
    if judge:
        params.append(("filter", f"ASSESSMENT::=::{MLFLOW_FAILED}::{_label('judge')}"))

    in_experiment = 'match "^experiment:" $labels.app'
    from_label = '{{ reReplaceAll "^experiment:" "" $labels.app | urlquery }}'
    experiment = f"{{{{ if {in_experiment} }}}}{from_label}{{{{ else }}}}{cfg.experiment_id}{{{{ end }}}}"
    by_tag = ""
    if app_tag:
        # Two spellings of the app filter: the traces page's URL filter DSL and the `tag=<key>=<value>`
        # parameter MLflow 3.17's traces view reads (its value URL-encoded inside, spaces as %20).
        tag_filter = _query([("filter", f"TAG::=::{_label('app')}::{app_tag}")])
        inner = _piece("{{ $labels.app | urlquery | reReplaceAll `\\+` \"%20\" | urlquery }}")
        tag_param = _query([("tag", f"{quote(app_tag, safe='')}={inner}")])
        by_tag = f"{{{{ if not ({in_experiment}) }}}}&{tag_filter}&{tag_param}{{{{ end }}}}"
    return f"{cfg.tracking_url}/#/experiments/{experiment}/traces?{_query(params)}{by_tag}"


def _tempo(alerts: AlertsSettings, window_s: int, judge: bool) -> str:
    """Grafana Explore, one pane on the Tempo datasource with a TraceQL query: the evaluation spans of
    the app's failed verdicts of the judge (`tracejudge.app`, `gen_ai.evaluation.name`,
    `gen_ai.evaluation.score.label`), or, for an app alone, its traces (`resource.service.name`)."""
    cfg = alerts.trace_search.tempo
    if judge:
        query = (f'{{ span.tracejudge.app = "{_label("app")}" && span.gen_ai.evaluation.name = '
                 f'"{_label("judge")}" && span.gen_ai.evaluation.score.label = "{OTLP_FAILED}" }}')
    else:
        query = f'{{ resource.service.name = "{_label("app")}" }}'
    datasource = {"type": "tempo", "uid": cfg.datasource_uid}
    panes = {"alert": {"datasource": cfg.datasource_uid, "queries": [
        {"refId": "A", "datasource": datasource, "queryType": "traceql", "limit": 100, "query": query}],
        "range": {"from": _epoch(window_s, 1000), "to": _epoch(0, 1000)}}}
    params = [("schemaVersion", "1"), ("orgId", str(alerts.grafana_org_id)),
              ("panes", json.dumps(panes, separators=(",", ":")))]
    return f"{cfg.grafana_url or alerts.dashboard_url}/explore?{_query(params)}"


def _jaeger(alerts: AlertsSettings, window_s: int, judge: bool) -> str:
    """Jaeger UI's search: the evaluation spans (service `jaeger.service`) of the app's failed
    verdicts of the judge, by their tags, or, for an app alone, the app's own service."""
    cfg = alerts.trace_search.jaeger
    if judge:
        tags = {"tracejudge.app": _label("app"), "gen_ai.evaluation.name": _label("judge"),
                "gen_ai.evaluation.score.label": OTLP_FAILED}
        params = [("service", cfg.service), ("tags", json.dumps(tags, separators=(",", ":")))]
    else:
        params = [("service", _label("app"))]
    params += [("start", _epoch(window_s, 1_000_000)), ("end", _epoch(0, 1_000_000)), ("limit", "100"),
               ("lookback", "custom")]
    return f"{cfg.url}/search?{_query(params)}"


# --- template pieces ----------------------------------------------------------------------------------
# A URL is encoded in Python with a placeholder for each template piece (letters only, so encoding leaves
# it as it is), then each placeholder is replaced by its template: the template's own characters (quotes,
# braces) are never percent-encoded, and what it prints is encoded by `urlquery` or is digits.

_PIECES: dict[str, str] = {}


def _piece(template: str) -> str:
    """The placeholder of a template piece (bounded: one per label name and window in the rules)."""
    key = f"TJPIECE{zlib.crc32(template.encode()):08x}X"
    _PIECES[key] = template
    return key


def _label(name: str) -> str:
    return _piece(f"{{{{ $labels.{name} | urlquery }}}}")


def _epoch(offset_s: int, scale: int) -> str:
    """Digits: the evaluation time minus `offset_s` seconds, in 1/`scale` seconds."""
    expr = f"time() * {scale}" if offset_s == 0 else f"(time() - {offset_s}) * {scale}"
    return _piece(f'{{{{ with query "{expr}" }}}}{{{{ . | first | value | printf "%.0f" }}}}{{{{ end }}}}')


def _iso(offset_s: int) -> str:
    """The evaluation time minus `offset_s` seconds, ISO 8601 in UTC with milliseconds."""
    expr = "time()" if offset_s == 0 else f"time() - {offset_s}"
    return _piece(f'{{{{ with query "{expr}" }}}}{{{{ (. | first | value | toTime).Format '
                  f'"2006-01-02T15:04:05.000Z" }}}}{{{{ end }}}}')


def _query(params: list[tuple[str, str]]) -> str:
    encoded = urlencode(params, quote_via=quote, safe="")
    for key, template in _PIECES.items():
        encoded = encoded.replace(key, template)
    return encoded
