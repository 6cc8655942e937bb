"""The `alerts:` section: where the links in the alerts point (`tracejudge alerts render`,
`tracejudge.consumer.config.alert_links`) (`tracejudge.consumer.config`).

A page is read on a phone, far from the repository: every link an alert carries is absolute. Three:
the runbook (`runbook_base_url`: the documentation site's runbooks, one page per alert at
`<runbook_base_url>/<AlertName>/`), the Grafana panel (`dashboard_url`,
the dashboards of deploy/grafana) and a trace search listing the app's failing traces of the judge in
the alert's window (`trace_search`: MLflow's traces view, Grafana Explore on Tempo, or Jaeger's
search). The defaults are the addresses of deploy/compose on localhost.

Each URL is checked here, before anything renders: http(s), a host, no credentials (an annotation is
copied into every notification, chat message and ticket: a password in it would be everywhere), and
no query or fragment where the link appends its own.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from tracejudge.consumer.config.common import Section
from tracejudge.metrics.judges.secrets import redact_url, url_problem

__all__ = ["DEFAULT_RUNBOOK_BASE_URL", "AlertsSettings", "JaegerSearch", "MlflowSearch", "TempoSearch",
           "TraceSearchSettings", "runbook_base"]

# The documentation site's runbooks (docs/mkdocs.yml's site_url + `runbooks/`): one page per alert,
# docs/pages/runbooks/<AlertName>.md, built at `runbooks/<AlertName>/`. Point it at where you host the
# built site (`make docs` builds docs/site/), or at your wiki if it keeps a page per alert the same way.
DEFAULT_RUNBOOK_BASE_URL = "https://tracejudge.github.io/tracejudge/runbooks/"
# An MLflow experiment id, a Grafana datasource uid, a Jaeger service name: plain tokens in a URL.
_TOKEN = re.compile(r"^[A-Za-z0-9._:-]{1,200}$")
# An MLflow tag key as the traces view filters it (`tags.<key>` or tags.`<key>`).
_TAG_KEY = re.compile(r"^[A-Za-z0-9._ /-]{1,250}$")


def base_url(value: str) -> str:
    """A base URL the links extend: http(s) with a host, no credentials, no query or fragment (the
    link adds its own). A trailing '/' is dropped, so `base + "/d/uid"` has one slash."""
    problem = url_problem(value, credentials_go_in="nowhere: a link is copied into every notification",
                          query=False)
    if problem:
        raise ValueError(problem)
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http(s) URL with a host, got {redact_url(value)!r}")
    if "{" in value:
        raise ValueError(f"must not contain '{{', got {redact_url(value)!r}")
    return value.rstrip("/")


def runbook_base(value: str) -> str:
    """`alerts.runbook_base_url`: the folder of the runbook pages, one per alert at `<base><AlertName>/`
    (returned with exactly one trailing '/'), or a URL template holding `{alert}`, which the alert's
    lower-cased name replaces (a wiki's own page per alert; returned as it is). Absolute http(s), no
    query or '#' fragment (runbooks are pages, not anchors of a README) and no other '{'."""
    scheme = "each alert's runbook is the page <runbook_base_url>/<AlertName>/, or {alert} in it replaced"
    if "#" in value or "?" in value:
        raise ValueError(f"must not have a query or '#' fragment ({scheme}: the documentation site's "
                         f"runbooks/ folder, not a README anchor), got {redact_url(value)!r}")
    if "{" in value.replace("{alert}", ""):
        raise ValueError(f"may hold '{{alert}}' and no other '{{' ({scheme}), got {redact_url(value)!r}")
    if "{alert}" in value:
        base_url(value.replace("{alert}", "alert"))  # the same checks, on the template filled in
        return value
    return base_url(value) + "/"


def token(value: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"must be letters, digits and . _ : - (at most 200), got {value!r}")
    return value


class MlflowSearch(Section):
    """`alerts.trace_search.mlflow`: MLflow's traces view of an experiment, filtered on the judge's
    feedback ('no': a failed verdict, as the MLflow sink writes it), the app and the window."""

    # The tracking server's UI, as people open it (deploy/compose: http://localhost:5000).
    tracking_url: str = "http://localhost:5000"
    # The experiment whose traces view opens, unless the alert's app label is `experiment:<id>` (an
    # MLflow trace's app when no `stream.app_tag` is set): then that experiment.
    experiment_id: str = "0"
    # The trace tag naming the app (the `stream.app_tag` tracejudge reads); unset: `stream.app_tag`.
    # Without either, an app that is not `experiment:<id>` is not filtered (the experiment is the app).
    app_tag: str | None = None

    _url = field_validator("tracking_url")(base_url)
    _experiment = field_validator("experiment_id")(token)

    @field_validator("app_tag")
    @classmethod
    def _tag(cls, v: str | None) -> str | None:
        if v is not None and not _TAG_KEY.match(v):
            raise ValueError(f"must be a tag key (letters, digits, space and . _ / -), got {v!r}")
        return v


class TempoSearch(Section):
    """`alerts.trace_search.tempo`: Grafana Explore on a Tempo datasource, a TraceQL query on the
    evaluation spans `tracejudge sink otlp` sends with `emit_spans: true`."""

    # Grafana's address; unset: `alerts.dashboard_url`.
    grafana_url: str | None = None
    # The uid of the Tempo datasource in Grafana.
    datasource_uid: str = "tempo"

    _url = field_validator("grafana_url")(lambda v: None if v is None else base_url(v))
    _uid = field_validator("datasource_uid")(token)


class JaegerSearch(Section):
    """`alerts.trace_search.jaeger`: Jaeger UI's search by tags, on the evaluation spans `tracejudge
    sink otlp` sends with `emit_spans: true` (their service is the sink's, `tracejudge`)."""

    # The Jaeger UI (deploy/compose: http://localhost:16686).
    url: str = "http://localhost:16686"
    # The service of the evaluation spans: the OTLP sink's resource `service.name`.
    service: str = "tracejudge"

    _url = field_validator("url")(base_url)
    _service = field_validator("service")(token)


class TraceSearchSettings(Section):
    """`alerts.trace_search`: which trace UI the `traces_url` annotation opens (`none`: no trace link)."""

    # The trace UI the `traces_url` annotation opens; `none`: alerts carry no trace link.
    kind: Literal["mlflow", "tempo", "jaeger", "none"] = "mlflow"
    # The MLflow UI's trace search (with kind `mlflow`).
    mlflow: MlflowSearch = Field(default_factory=MlflowSearch)
    # Grafana Explore on Tempo (with kind `tempo`).
    tempo: TempoSearch = Field(default_factory=TempoSearch)
    # The Jaeger UI's search (with kind `jaeger`).
    jaeger: JaegerSearch = Field(default_factory=JaegerSearch)


class AlertsSettings(Section):
    """`alerts:`: the absolute links every alert carries (`runbook_url`, `dashboard_url`, `traces_url`)."""

    # Where the documentation site's runbooks/ are hosted: each alert's `runbook_url` is this URL (kept
    # with exactly one trailing '/') followed by `<AlertName>/`, the built page of
    # `docs/pages/runbooks/<AlertName>.md`; or a template holding `{alert}`, replaced by the alert's
    # lower-cased name (your wiki's page per alert). Absolute http(s), no query or fragment.
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL
    # Grafana (deploy/compose: http://localhost:3000); the dashboards of deploy/grafana/dashboards.
    dashboard_url: str = "http://localhost:3000"
    # The Grafana organisation the dashboards are in.
    grafana_org_id: int = Field(default=1, ge=1)
    # Which trace UI the alerts' `traces_url` opens, and where it is.
    trace_search: TraceSearchSettings = Field(default_factory=TraceSearchSettings)

    _dashboard = field_validator("dashboard_url")(base_url)

    _runbook = field_validator("runbook_base_url")(runbook_base)
