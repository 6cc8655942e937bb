"""The Grafana dashboards: generated = checked in, portable, and every query reads real metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.deploy_files import (
    DASHBOARDS,
    METRICS,
    SINK_METRICS,
    deploy_module,
    family_of,
    recording_rules,
    tool,
)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
EXEMPLAR_FAMILIES = {"tracejudge_trace_latency_seconds", "tracejudge_judge_score"}


def promql():
    return deploy_module("grafana/promql.py")


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def query_variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in dashboard["templating"]["list"] if v["type"] == "query"]


def families(expr: str) -> set[str]:
    return {family_of(n) or n for n in promql().metric_names(expr)}


def test_checked_in_dashboards_are_what_the_generator_writes() -> None:
    build = deploy_module("grafana/build_dashboards.py")
    assert build.main(["--check"]) == 0, "run python deploy/grafana/build_dashboards.py"
    assert sorted(build.DASHBOARDS) == sorted(dashboards())


def test_dashboards_have_fixed_unique_uids() -> None:
    uids = {name: d["uid"] for name, d in dashboards().items()}
    assert uids == {"tracejudge-operations.json": "tracejudge-operations",
                    "tracejudge-quality.json": "tracejudge-quality"}
    for d in dashboards().values():
        assert d["id"] is None and isinstance(d["schemaVersion"], int) and "tracejudge" in d["tags"]


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_datasource_is_a_variable_everywhere(name: str) -> None:
    d = dashboards()[name]
    variables = d["templating"]["list"]
    assert variables[0]["type"] == "datasource" and variables[0]["query"] == "prometheus"
    assert variables[0]["name"] == "datasource"
    for panel in d["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    for variable in query_variables(d):
        assert variable["datasource"] == DATASOURCE, variable["name"]
    # No datasource is named any other way (an exported-for-sharing ${DS_...} would not provision).
    text = json.dumps(d)
    assert "DS_" not in text and "__inputs" not in text


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_every_panel_queries_contract_metrics_or_recording_rules(name: str) -> None:
    known = set(METRICS) | recording_rules()
    for panel in panels(dashboards()[name]):
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), f"{panel['title']} {target['refId']}: empty query"
            names = families(target["expr"])
            assert names, f"{panel['title']}: reads no metric"
            assert names <= known, f"{panel['title']}: unknown series {sorted(names - known)}"


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_variable_queries_read_contract_metrics(name: str) -> None:
    for variable in query_variables(dashboards()[name]):
        match = re.fullmatch(r"label_values\((\w+)(\{.*\})?, (\w+)\)", variable["definition"])
        assert match, variable["definition"]
        family = family_of(match.group(1))
        assert family and match.group(3) in METRICS[family].labels, variable["definition"]


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_legends_name_labels_the_query_keeps(name: str) -> None:
    for panel in panels(dashboards()[name]):
        for target in panel["targets"]:
            labels = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
            grouped = {label.strip() for clause in re.findall(r"\bby \(([^)]*)\)", target["expr"])
                       for label in clause.split(",")}
            available = grouped or {label for f in families(target["expr"]) if f in METRICS
                                    for label in METRICS[f].labels}
            if not grouped:  # a recording rule keeps its `sum by` labels; read them from its name
                available |= {part for f in families(target["expr"]) if ":" in f
                              for part in f.split(":")[0].split("_")}
            assert labels <= available | {"le"}, f"{panel['title']}: legend uses {labels - available}"


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_template_variables_are_only_used_in_regex_matchers(name: str) -> None:
    # promql.py fills them with `.*`, the "All" value; that is only valid inside =~ "...".
    for panel in panels(dashboards()[name]):
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "")
            for use in re.finditer(r"\$\{?\w+", expr):
                assert re.search(r'=~"\$' + re.escape(use.group()[1:]) + '"', expr), \
                    f"{panel['title']}: {use.group()} outside a =~ matcher"


def test_histograms_with_trace_id_exemplars_ask_for_them() -> None:
    seen = set()
    for d in dashboards().values():
        for panel in panels(d):
            for target in panel["targets"]:
                exemplar_families = families(target["expr"]) & EXEMPLAR_FAMILIES
                if exemplar_families and "histogram_quantile" in target["expr"]:
                    assert target["exemplar"] is True, panel["title"]
                    seen |= exemplar_families
    assert seen == EXEMPLAR_FAMILIES


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_every_variable_is_the_datasource_a_label_query_or_the_trace_link(name: str) -> None:
    kinds = [(v["name"], v["type"]) for v in dashboards()[name]["templating"]["list"]]
    assert kinds[0] == ("datasource", "datasource") and kinds[-1] == ("trace_url", "textbox")
    assert {kind for _, kind in kinds[1:-1]} == {"query"}


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_trace_link_variable_defaults_to_the_mlflow_trace_view(name: str) -> None:
    """Exemplar links end in the exemplar's trace id: MLflow 3 names an OpenTelemetry trace
    `tr-<32 hex>` and opens it in the experiment's Traces tab with `selectedEvaluationId`."""
    (variable,) = [v for v in dashboards()[name]["templating"]["list"] if v["name"] == "trace_url"]
    default = variable["query"]
    assert variable["current"]["value"] == default and variable["hide"] == 0
    url = httpx.URL(default)
    assert url.scheme == "http" and url.port == 5000  # the compose stack's MLflow, published on the host
    assert re.fullmatch(r"/experiments/\d+/traces\?selectedEvaluationId=tr-", url.fragment), url.fragment
    # The link is completed by appending the trace id: the default must end where the id goes.
    assert default.endswith("selectedEvaluationId=tr-")


def test_exemplar_panels_say_where_the_dots_lead() -> None:
    for d in dashboards().values():
        for panel in panels(d):
            if any(t["exemplar"] for t in panel["targets"]):
                assert "exemplars link to the trace" in panel["title"], panel["title"]


def read_by_dashboard() -> dict[str, set[str]]:
    return {d["uid"]: {f for p in panels(d) for t in p["targets"] for f in families(t["expr"])}
            for d in dashboards().values()}


def test_quality_dashboard_covers_pass_rate_scores_coverage_errors_and_skips() -> None:
    quality = read_by_dashboard()["tracejudge-quality"]
    assert {"app_judge:tracejudge_judge_pass:ratio5m", "app_judge:tracejudge_judge_pass:ratio1h",
            "tracejudge_judge_score", "tracejudge_judge_sampled_total", "tracejudge_judge_eligible_total",
            "tracejudge_judge_errors_total", "tracejudge_judge_skipped_total",
            "tracejudge_metric_value"} <= quality
    heatmaps = [p for p in panels(dashboards()["tracejudge-quality.json"]) if p["type"] == "heatmap"]
    assert heatmaps and heatmaps[0]["targets"][0]["format"] == "heatmap"


def test_operations_dashboard_covers_traffic_latency_tokens_judges_and_kafka() -> None:
    operations = read_by_dashboard()["tracejudge-operations"]
    assert {"tracejudge_traces_total", "tracejudge_trace_latency_seconds", "tracejudge_tokens_total",
            "tracejudge_judge_duration_seconds", "tracejudge_judge_tokens_total",
            "tracejudge_consumer_lag_records", "tracejudge_dead_letters_total", "tracejudge_records_total",
            "tracejudge_commits_total"} <= operations
    latency = [t["expr"] for p in panels(dashboards()["tracejudge-operations.json"]) for t in p["targets"]
               if "tracejudge_trace_latency_seconds_bucket" in t["expr"]]
    assert {re.match(r"histogram_quantile\(([\d.]+)", e).group(1) for e in latency} == {"0.5", "0.95", "0.99"}


def test_operations_dashboard_has_a_write_back_row() -> None:
    operations = dashboards()["tracejudge-operations.json"]
    titles = [p["title"] for p in operations["panels"]]
    row = titles.index("Write-back (tracejudge sink)")
    below = {f for p in operations["panels"][row + 1:] for t in p.get("targets", [])
             for f in families(t["expr"])}
    assert set(SINK_METRICS) <= below
    assert operations["panels"][row]["type"] == "row"
    lag = next(t["expr"] for p in operations["panels"][row + 1:] for t in p["targets"]
               if "tracejudge_sink_lag_records" in t["expr"])
    assert lag.startswith("sum by (sink) (")  # the sum WriteBackLagging alerts on
    assert {"sink"} <= {v["name"] for v in query_variables(operations)}


def test_every_contract_metric_is_on_some_dashboard() -> None:
    shown = set().union(*read_by_dashboard().values())
    assert set(METRICS) - shown == set()


# --- the PromQL extraction script ---------------------------------------------------------------------

def test_extracted_expressions_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each resolved panel query (as a recording rule) - no Prometheus needed."""
    queries = promql().all_queries()
    assert len(queries) == sum(len(p["targets"]) for d in dashboards().values() for p in panels(d))
    rules = [{"record": f"dashboard:query_{i}:check", "expr": q.resolved("1m")}
             for i, q in enumerate(queries)]
    for rule in rules:
        assert "$" not in rule["expr"], rule["expr"]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_extraction_command_line_prints_one_resolved_query_per_line() -> None:
    script = Path(promql().__file__)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert len(lines) == len(promql().all_queries())
    assert all("$" not in line and "\n" not in line for line in lines)
    assert 'tracejudge_traces_total{app=~".*"}[1m]' in plain.stdout

    as_json = subprocess.run([sys.executable, str(script), "--json", "--raw",
                              str(DASHBOARDS / "tracejudge-quality.json")],
                             capture_output=True, text=True, timeout=60)
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert {r["dashboard"] for r in rows} == {"tracejudge-quality"}
    assert any("$__rate_interval" in r["expr"] for r in rows)
    assert all(r["panel"] and r["ref_id"] for r in rows)


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (app) (rate(a_total{x="y", z=~"$v"}[5m]))', {"a_total"}),
    ("histogram_quantile(0.9, sum by (le) (rate(h_bucket[1m] offset 1d)))", {"h_bucket"}),
    ("x:y:ratio5m < on (app) 0.9 * (x:y:ratio5m offset 1d) and on (app) c >= 20", {"x:y:ratio5m", "c"}),
    ('increase({__name__=~"a_total|b_total"}[15m]) unless ignoring(le) d', {"a_total", "b_total", "d"}),
    ('sum(rate(e_total{reason="by (x)"}[1m])) / 1e3', {"e_total"}),
    ("rate(f_total[$__rate_interval]) or vector(0)", {"f_total"}),
])
def test_metric_names_reads_selectors_not_functions_labels_or_keywords(expr: str, names: set[str]) -> None:
    assert promql().metric_names(expr) == names
