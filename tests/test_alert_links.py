"""`tracejudge alerts render` and the `alerts:` section: every alert of a rules file gets absolute links,
rendered by Prometheus itself (promtool's unit tests, expected values written out by hand here).

The shipped rules are rendered with the defaults (deploy/prometheus/build_prometheusrule.py; the test of
the manifest fails on drift); their promtool unit tests (deploy/prometheus/tests) show the defaults'
annotations. The real-MLflow check of the trace search is tests/test_alert_links_mlflow.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from support.deploy_files import DASHBOARDS, RULES, alerts, deploy_module, load_yaml, tool

from tracejudge.consumer.commands.alerts import packaged_rules
from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.config.alert_links import (
    DASHBOARDS as LINKED_DASHBOARDS,
)
from tracejudge.consumer.config.alert_links import (
    PANELS,
    AlertShape,
    link_annotations,
    panel_id,
    shape_of,
)
from tracejudge.consumer.config.alert_rules import render_rules
from tracejudge.consumer.config.alerts import AlertsSettings
from tracejudge.schemas.errors import InputError

TRACEJUDGE = str(Path(sys.executable).parent / "tracejudge")

CUSTOM = {
    "stream": {"app_tag": "app"},
    "alerts": {
        "runbook_base_url": "https://wiki.example.com/runbooks",
        "dashboard_url": "https://grafana.example.com/",
        "grafana_org_id": 3,
        "trace_search": {"kind": "mlflow",
                         "mlflow": {"tracking_url": "https://mlflow.example.com", "experiment_id": "42"}},
    },
}
# GroundednessDropped's description for an app whose every verdict failed.
GROUNDED = ("Only 0% of the last hour's groundedness verdicts for app {} passed (floor 80%, at least 20 "
            "verdicts), below 90% of the same hour yesterday or with no comparable hour yesterday: answers "
            "drift away from the retrieved context.")


def tracejudge(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TRACEJUDGE, *map(str, args)], capture_output=True, text=True, timeout=120,
                          cwd=cwd, check=False)


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *map(str, args)], capture_output=True, text=True, timeout=120,
                          cwd=cwd, check=False)


def write_config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "tracejudge.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def unit_test(tmp_path: Path, rules: Path, series: list[dict], cases: list[dict]
              ) -> subprocess.CompletedProcess[str]:
    """Run promtool's unit test of `rules` on `series` (1 minute apart) with `cases`."""
    doc = {"rule_files": [str(rules)], "evaluation_interval": "1m",
           "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}]}
    test = tmp_path / "links.test.yml"
    test.write_text(yaml.safe_dump(doc, sort_keys=False, width=10_000))
    return promtool("test", "rules", test)


# --- the rendered annotations, as Prometheus renders them ----------------------------------------------

def test_custom_config_renders_absolute_links_promtool_checks_and_expands(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    result = tracejudge("alerts", "render", "--config", write_config(tmp_path, CUSTOM), "--rules", RULES,
                        "--out", f"{out}/")
    assert result.returncode == 0, result.stderr
    rendered = out / RULES.name
    check = promtool("check", "rules", rendered)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr

    window = "startTimeLabel=CUSTOM&startTime=1970-01-01T00:45:00.000Z&endTime=1970-01-01T02:00:00.000Z"
    failed = "filter=ASSESSMENT%3A%3A%3D%3A%3Ano%3A%3Agroundedness"
    quality = "https://grafana.example.com/d/tracejudge-quality/?orgId=3&viewPanel=7864743"
    grounded = {
        # An app named by a tag (stream.app_tag): the configured experiment, filtered on the tag (the
        # traces page's `filter=` and MLflow 3.17's `tag=app=<app>`, encoded inside as it decodes it).
        "shop assistant": f"https://mlflow.example.com/#/experiments/42/traces?{window}&{failed}"
                          "&filter=TAG%3A%3A%3D%3A%3Ashop+assistant%3A%3Aapp&tag=app%3Dshop%2520assistant",
        # An MLflow trace's app when no tag names it: its own experiment, no app filter.
        "experiment:7": f"https://mlflow.example.com/#/experiments/7/traces?{window}&{failed}",
    }
    verdicts = 'tracejudge_judge_verdicts_total{{app="{}",judge="groundedness",verdict="fail"}}'
    series = [{"series": verdicts.format(app), "values": "0+1x150"} for app in grounded]
    series.append({"series": 'tracejudge_consumer_lag_records{topic="otlp_spans",partition="0"}',
                   "values": "20000x150"})
    exp = [{"exp_labels": {"severity": "critical", "app": app, "judge": "groundedness"},
            "exp_annotations": {
                "summary": f"Groundedness pass rate 0% for app {app}",
                "description": GROUNDED.format(app),
                "runbook_url": "https://wiki.example.com/runbooks/GroundednessDropped/",
                "dashboard_url": f"{quality}&var-app={app.replace(' ', '+').replace(':', '%3A')}"
                                 "&var-judge=groundedness&from=-14400000&to=7200000",
                "traces_url": traces}} for app, traces in grounded.items()]
    lag = [{"exp_labels": {"severity": "warning", "topic": "otlp_spans"}, "exp_annotations": {
        "summary": "tracejudge is 20k records behind on topic otlp_spans",
        "description": "The consumer group has been more than 10000 records behind the end of topic "
                       "otlp_spans for 15 minutes: scores and alerts describe old traffic.",
        # No app: the runbook and the panel, no trace search.
        "runbook_url": "https://wiki.example.com/runbooks/ConsumerLagHigh/",
        "dashboard_url": "https://grafana.example.com/d/tracejudge-operations/?orgId=3&viewPanel=5564645"
                         "&var-topic=otlp_spans&from=-14400000&to=7200000"}}]
    result = unit_test(tmp_path, rendered, series, [
        {"eval_time": "2h", "alertname": "GroundednessDropped", "exp_alerts": exp},
        {"eval_time": "2h", "alertname": "ConsumerLagHigh", "exp_alerts": lag}])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("kind", "expected"), [
    ("tempo", "https://grafana.example.com/explore?schemaVersion=1&orgId=3&panes=%7B%22alert%22%3A%7B%22datasource"
              "%22%3A%22tempo%22%2C%22queries%22%3A%5B%7B%22refId%22%3A%22A%22%2C%22datasource%22%3A%7B%22type"
              "%22%3A%22tempo%22%2C%22uid%22%3A%22tempo%22%7D%2C%22queryType%22%3A%22traceql%22%2C%22limit"
              "%22%3A100%2C%22query%22%3A%22%7B%20span.tracejudge.app%20%3D%20%5C%22shop+assistant%5C%22%20%26"
              "%26%20span.gen_ai.evaluation.name%20%3D%20%5C%22groundedness%5C%22%20%26%26%20span.gen_ai."
              "evaluation.score.label%20%3D%20%5C%22fail%5C%22%20%7D%22%7D%5D%2C%22range%22%3A%7B%22from%22"
              "%3A%222700000%22%2C%22to%22%3A%227200000%22%7D%7D%7D"),
    ("jaeger", "http://localhost:16686/search?service=tracejudge&tags=%7B%22tracejudge.app%22%3A%22shop+assistant"
               "%22%2C%22gen_ai.evaluation.name%22%3A%22groundedness%22%2C%22gen_ai.evaluation.score.label%22"
               "%3A%22fail%22%7D&start=2700000000&end=7200000000&limit=100&lookback=custom"),
])
def test_otlp_trace_searches_expand_to_the_evaluation_spans_query(tmp_path: Path, kind: str,
                                                                  expected: str) -> None:
    alerts_cfg = AlertsSettings(dashboard_url="https://grafana.example.com", grafana_org_id=3,
                                trace_search={"kind": kind})
    rules = tmp_path / "rules.yml"
    rules.write_text(render_rules(RULES.read_text(), alerts_cfg))
    series = [{"series": 'tracejudge_judge_verdicts_total{app="shop assistant",judge="groundedness",'
                         'verdict="fail"}', "values": "0+1x150"}]
    annotations = next(a for a in yaml.safe_load(rules.read_text())["groups"][0]["rules"]
                       if a.get("alert") == "GroundednessDropped")["annotations"]
    assert set(annotations) >= {"traces_url", "runbook_url", "dashboard_url"}
    # promtool renders exactly the URL written out above...
    case = {"eval_time": "2h", "alertname": "GroundednessDropped", "exp_alerts": [{
        "exp_labels": {"severity": "critical", "app": "shop assistant", "judge": "groundedness"},
        "exp_annotations": {
            "summary": "Groundedness pass rate 0% for app shop assistant",
            "description": GROUNDED.format("shop assistant"),
            "runbook_url": "https://tracejudge.github.io/tracejudge/runbooks/GroundednessDropped/",
            "dashboard_url": "https://grafana.example.com/d/tracejudge-quality/?orgId=3&viewPanel=7864743"
                             "&var-app=shop+assistant&var-judge=groundedness&from=-14400000&to=7200000",
            "traces_url": expected}}]}
    result = unit_test(tmp_path, rules, series, [case])
    assert result.returncode == 0, result.stdout + result.stderr
    # ...which the trace UI reads as a search of the failed evaluation spans of the app in the window.
    query = parse_qs(urlsplit(expected).query)
    if kind == "tempo":
        (pane,) = json.loads(query["panes"][0]).values()
        assert pane["queries"][0]["query"] == (
            '{ span.tracejudge.app = "shop assistant" && span.gen_ai.evaluation.name = "groundedness" && '
            'span.gen_ai.evaluation.score.label = "fail" }')
        assert pane["range"] == {"from": "2700000", "to": "7200000"}
    else:
        assert json.loads(query["tags"][0]) == {"tracejudge.app": "shop assistant", "gen_ai.evaluation.name":
                                                "groundedness", "gen_ai.evaluation.score.label": "fail"}
        assert (query["start"], query["end"]) == (["2700000000"], ["7200000000"])


# --- generic over the alerts of a file ------------------------------------------------------------------

NEW_ALERTS = textwrap.dedent("""\
    groups:
      - name: theirs
        rules:
          - record: app_judge_version:tracejudge_judge_pass:ratio6h
            expr: sum by (app, judge, version) (increase(tracejudge_judge_verdicts_total{verdict="pass"}[6h]))
          # An alert someone adds without links, reading a recording rule.
          - alert: VersionPassLow
            expr: app_judge_version:tracejudge_judge_pass:ratio6h < 0.5
            for: 30m
            labels:
              severity: warning
            annotations:
              summary: "Version {{ $labels.version }} of {{ $labels.app }} is low"
              runbook: "README.md#versionpasslow"
          # One without annotations at all, and no app.
          - alert: SinkStuck
            expr: sum by (sink) (tracejudge_sink_lag_records) > 0
    """)


def test_every_alert_of_any_file_gets_its_links_and_the_file_stays_valid(tmp_path: Path) -> None:
    rendered = render_rules(NEW_ALERTS, AlertsSettings())
    (tmp_path / "theirs.yml").write_text(rendered)
    check = promtool("check", "rules", tmp_path / "theirs.yml")
    assert check.returncode == 0, check.stdout + check.stderr
    doc = yaml.safe_load(rendered)
    version, stuck = (r for r in doc["groups"][0]["rules"] if "alert" in r)
    assert set(version["annotations"]) == {"summary", "runbook_url", "dashboard_url", "traces_url"}
    assert version["annotations"]["runbook_url"] == "https://tracejudge.github.io/tracejudge/runbooks/VersionPassLow/"
    # The window: 6h of verdicts read through the recording rule, plus `for: 30m`.
    assert 'query "time() - 23400"' in version["annotations"]["traces_url"]
    assert set(stuck["annotations"]) == {"runbook_url", "dashboard_url"}
    assert "/d/tracejudge-operations/?" in stuck["annotations"]["dashboard_url"]
    assert "var-sink={{ $labels.sink | urlquery }}" in stuck["annotations"]["dashboard_url"]
    # The comments and everything but the link annotations stay as written; rendering again changes nothing.
    assert "# An alert someone adds without links, reading a recording rule." in rendered
    assert render_rules(rendered, AlertsSettings()) == rendered
    recording = {"app_judge_version:tracejudge_judge_pass:ratio6h": doc["groups"][0]["rules"][0]["expr"]}
    assert shape_of(version, recording) == AlertShape.of("VersionPassLow", {"app", "judge", "version"}, 23400)


def test_the_shipped_rules_are_rendered_with_the_defaults_and_packaged() -> None:
    text = RULES.read_text()
    stale = "run python deploy/prometheus/build_prometheusrule.py"
    assert render_rules(text, AlertsSettings()) == text, stale
    assert packaged_rules() == text
    build = deploy_module("prometheus/build_prometheusrule.py")
    assert build.main(["--check"]) == 0
    for alert in alerts():
        notes = alert["annotations"]
        assert notes["runbook_url"].startswith("https://"), alert
        assert notes["dashboard_url"].startswith("http://"), alert
        assert ("traces_url" in notes) == ("$labels.app" in notes["summary"] + notes["description"]), alert


def test_the_module_others_call_gives_links_for_a_shape() -> None:
    links = link_annotations(AlertsSettings(), AlertShape.of("SloBurnFast", ["app", "judge"], 3600))
    assert links["runbook_url"] == "https://tracejudge.github.io/tracejudge/runbooks/SloBurnFast/"
    assert 'query "time() - 3600"' in links["traces_url"]
    assert "traces_url" not in link_annotations(AlertsSettings(), AlertShape.of("Quiet", ["topic"], 60))
    off = AlertsSettings(trace_search={"kind": "none"})
    assert "traces_url" not in link_annotations(off, AlertShape.of("X", ["app", "judge"], 60))


@pytest.mark.parametrize(("base", "folder"), [
    ("https://docs.example.com/tj/runbooks", "https://docs.example.com/tj/runbooks/"),
    ("https://docs.example.com/tj/runbooks/", "https://docs.example.com/tj/runbooks/"),
    ("https://docs.example.com/tj/runbooks///", "https://docs.example.com/tj/runbooks/"),
    ("https://docs.example.com", "https://docs.example.com/"),
])
def test_the_runbook_is_the_alerts_page_under_the_base_with_exactly_one_slash(base: str, folder: str) -> None:
    settings = AlertsSettings(runbook_base_url=base)
    assert settings.runbook_base_url == folder
    links = link_annotations(settings, AlertShape.of("GroundednessDropped", ["app", "judge"], 4500))
    assert links["runbook_url"] == f"{folder}GroundednessDropped/"


def test_a_runbook_template_names_each_alert_in_the_teams_own_wiki() -> None:
    settings = AlertsSettings(runbook_base_url="https://wiki.example.com/oncall/tracejudge-{alert}")
    links = link_annotations(settings, AlertShape.of("GroundednessDropped", ["app", "judge"], 4500))
    assert links["runbook_url"] == "https://wiki.example.com/oncall/tracejudge-groundednessdropped"


@pytest.mark.parametrize("text", ["groups: {}\n", "[1, 2]\n", "groups:\n  - name: g\n", "groups: [\n",
                                  "groups:\n  - name: g\n    rules:\n      - alert: A\n",
                                  "groups:\n  - name: g\n    rules:\n      - {alert: A, expr: up, for: x}\n"])
def test_a_file_that_is_not_rules_is_refused(text: str) -> None:
    with pytest.raises(InputError):
        render_rules(text, AlertsSettings())


def test_flow_style_annotations_are_refused_not_damaged() -> None:
    text = "groups:\n  - name: g\n    rules:\n      - {alert: A, expr: up == 0, annotations: {summary: s}}\n"
    with pytest.raises(InputError, match="block mapping"):
        render_rules(text, AlertsSettings())


# --- dashboards: stable panel links -----------------------------------------------------------------------

def test_alert_panels_exist_with_the_ids_the_links_use() -> None:
    boards = {d["uid"]: d for d in (load_yaml(p) for p in DASHBOARDS.glob("*.json"))}
    for uid, variables in LINKED_DASHBOARDS.items():
        names = {v["name"] for v in boards[uid]["templating"]["list"]}
        assert set(variables) <= names, uid
        for panel in boards[uid]["panels"]:
            assert panel["id"] == panel_id(panel["title"]), f"{uid}: regenerate the dashboards"
    for alert, (uid, title) in PANELS.items():
        assert any(p["title"] == title for p in boards[uid]["panels"]), f"{alert}: no {title!r} in {uid}"
    builder = deploy_module("grafana/build_dashboards.py")
    assert all(builder.panel_id(t) == panel_id(t) for t in ("Consumer lag (records)", "x", ""))


# --- the configuration ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("alerts_section", "key", "words"), [
    ({"dashboard_url": "http://admin:hunter2@grafana:3000"}, "alerts.dashboard_url", "credentials"),
    ({"runbook_base_url": "README.md"}, "alerts.runbook_base_url", "http(s) URL"),
    ({"runbook_base_url": "https://wiki/{alert}/{app}"}, "alerts.runbook_base_url",
     "may hold '{alert}' and no other"),
    ({"runbook_base_url": "https://github.com/o/r/blob/main/README.md#"}, "alerts.runbook_base_url",
     "'#' fragment"),
    ({"runbook_base_url": "https://docs.example.com/runbooks/#alerts"}, "alerts.runbook_base_url",
     "not a README anchor"),
    ({"runbook_base_url": "https://docs.example.com/runbooks/?v=1"}, "alerts.runbook_base_url", "query"),
    ({"runbook_base_url": "https://u:hunter2@docs.example.com/runbooks/"}, "alerts.runbook_base_url",
     "credentials"),
    ({"trace_search": {"kind": "zipkin"}}, "alerts.trace_search.kind", "must be one of"),
    ({"trace_search": {"mlflow": {"tracking_url": "http://m:5000/?token=abc"}}},
     "alerts.trace_search.mlflow.tracking_url", "query"),
    ({"trace_search": {"mlflow": {"experiment_id": "1/../2"}}}, "alerts.trace_search.mlflow.experiment_id",
     "letters"),
    ({"trace_search": {"jaeger": {"url": "ftp://j"}}}, "alerts.trace_search.jaeger.url", "http(s)"),
    ({"dashbaord_url": "http://g"}, "alerts.dashbaord_url", "did you mean 'dashboard_url'"),
])
def test_bad_alerts_keys_are_config_errors_naming_the_key(tmp_path: Path, alerts_section: dict, key: str,
                                                         words: str) -> None:
    config = write_config(tmp_path, {"alerts": alerts_section})
    with pytest.raises(ConfigError) as caught:
        load_settings(config, require_topics=False, environ={})
    assert caught.value.key == f"{key} (from {config})", caught.value.report()
    assert words in caught.value.detail
    result = tracejudge("alerts", "render", "--config", config)
    assert result.returncode == 2 and key in result.stderr and result.stdout == ""
    assert "hunter2" not in result.stderr and "abc" not in result.stderr


def test_the_alerts_section_is_printed_with_urls_redacted() -> None:
    shown = load_settings(None, require_topics=False,
                          environ={"TRACEJUDGE_ALERTS__DASHBOARD_URL": "https://grafana.example.com"}).redacted()
    assert shown["alerts.dashboard_url"] == "https://grafana.example.com"
    assert shown["alerts.trace_search.kind"] == "mlflow"
    assert shown["alerts.trace_search.mlflow.tracking_url"] == "http://localhost:5000"


def test_environment_variables_set_the_section(tmp_path: Path) -> None:
    settings = load_settings(None, require_topics=False,
                             environ={"TRACEJUDGE_ALERTS__DASHBOARD_URL": "https://g.example.com"})
    assert settings.alerts.dashboard_url == "https://g.example.com"


# --- the command ------------------------------------------------------------------------------------------

def test_default_renders_the_packaged_rules_to_stdout() -> None:
    result = tracejudge("alerts", "render")
    assert result.returncode == 0, result.stderr
    assert result.stdout == RULES.read_text()


def test_never_overwrites_its_input(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(NEW_ALERTS)
    for out in (rules, tmp_path):  # the file itself, or the directory it would be written into
        result = tracejudge("alerts", "render", "--rules", rules, "--out", out)
        assert result.returncode == 2 and "would destroy it" in result.stderr, result.stderr
        assert rules.read_text() == NEW_ALERTS


def test_several_files_need_a_directory_and_keep_their_names(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "slo.yml").write_text(NEW_ALERTS)
    out = tmp_path / "out"
    result = tracejudge("alerts", "render", "--rules", RULES, "--rules", tmp_path / "a" / "slo.yml", "--out",
                        tmp_path / "out.yml")
    assert result.returncode == 2 and "directory" in result.stderr
    out.mkdir()
    result = tracejudge("alerts", "render", "--rules", RULES, "--rules", tmp_path / "a" / "slo.yml",
                        "--out", out)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([RULES.name, "slo.yml"])


def test_unreadable_input_is_2_and_unwritable_output_is_3(tmp_path: Path) -> None:
    missing = tracejudge("alerts", "render", "--rules", tmp_path / "none.yml")
    assert missing.returncode == 2 and "cannot read --rules" in missing.stderr
    garbage = tmp_path / "garbage.yml"
    garbage.write_text("groups: [\n")
    bad = tracejudge("alerts", "render", "--rules", garbage)
    assert bad.returncode == 2 and "not valid YAML" in bad.stderr
    unwritable = tracejudge("alerts", "render", "--out", tmp_path / "no" / "such" / "dir" / "r.yml")
    assert unwritable.returncode == 3 and "cannot write" in unwritable.stderr
    assert not list(tmp_path.glob("**/.*.tmp"))
