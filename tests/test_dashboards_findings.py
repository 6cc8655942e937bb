"""The quality dashboard's findings panels, answered by a real Prometheus scraping the findings stage.

The `FindingsMetrics` of `tracejudge findings run` (imported from the installed package, on its own
registry, served on 127.0.0.1) export two findings of one window; Prometheus (tests/support/
prometheus_stack.py, exemplar storage on) scrapes them. The table's queries, with the dashboard variables
filled in as `promql.py` does, must give one row per finding with its lift, lower bound, failure rate,
failing and total verdicts, the app variable must filter them, and the counter panel beside the table
must lead to the finding's example failing trace through its exemplar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from support.deploy_files import DASHBOARDS, deploy_module
from support.prometheus_stack import PrometheusServer, free_port, wait_until

from tracejudge.metrics.findings import Finding
from tracejudge.metrics.telemetry.findings import FindingsMetrics

TABLE = "What the failures have in common"
EXEMPLARS = "Failing verdicts per finding (exemplars link to the trace)"


def finding(app: str, dimension: str, value: str, failing: int, total: int, lift: float,
            interval: tuple[float, float], trace_id: str) -> Finding:
    return Finding(app=app, judge="groundedness", dimension=dimension, value=value, label=None,
                   failing=failing, total=total, window_failing=40, window_total=200, lift=lift,
                   lift_interval=interval, failure_rate_with=failing / total, failure_rate_without=0.1,
                   rank=1, example_trace_ids=[trace_id], window_start=0.0, window_end=900.0)


FINDINGS = [finding("shop", "document", "doc-7", 30, 50, 4.5, (3.1, 6.0), "a" * 32),
            finding("bank", "tool", "search", 12, 40, 2.2, (1.3, 3.4), "b" * 32)]


def quality_panel(title: str) -> dict[str, Any]:
    board = json.loads((DASHBOARDS / "tracejudge-quality.json").read_text())
    (panel,) = [p for p in board["panels"] if p["title"] == title]
    return panel


def answer(prom: PrometheusServer, expr: str, app: str | None = None) -> dict[frozenset, float]:
    values = {"app": app} if app else None
    resolved = deploy_module("grafana/promql.py").fill_variables(expr, rate_interval="1m", values=values)
    return {frozenset((k, v) for k, v in s["metric"].items() if k != "__name__"): float(s["value"][1])
            for s in prom.query(resolved)}


@pytest.fixture
def findings_target() -> Any:
    registry = CollectorRegistry()
    metrics = FindingsMetrics(registry)
    assert metrics.show(FINDINGS) == 2
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_the_findings_table_shows_each_finding_and_the_counter_panel_leads_to_its_trace(
        tmp_path: Path, findings_target: str) -> None:
    with PrometheusServer(tmp_path / "prom", targets=[findings_target]) as prom:
        wait_until(prom.targets_up, 30, "the findings target to be scraped")
        wait_until(lambda: len(prom.query("tracejudge_failure_concentration_lower")) == 2, 30,
                   "both findings' lower bounds")
        table = quality_panel(TABLE)
        headers = {t["refId"]: t["legendFormat"] for t in table["targets"]}
        columns = {headers[t["refId"]]: answer(prom, t["expr"]) for t in table["targets"]}
        shop_only = {headers[t["refId"]]: answer(prom, t["expr"], app="shop") for t in table["targets"]}
        counter = quality_panel(EXEMPLARS)["targets"][0]["expr"]
        resolved = deploy_module("grafana/promql.py").fill_variables(counter, rate_interval="1m")
        exemplars = wait_until(lambda: prom.query_exemplars(resolved), 30, "the finding's exemplars")

    rows = [frozenset({"app": f.app, "judge": f.judge, "dimension": f.dimension, "value": f.value}.items())
            for f in FINDINGS]
    for f, key in zip(FINDINGS, rows, strict=True):
        assert columns["lift"][key] == pytest.approx(f.lift)
        assert columns["lift lower bound"][key] == pytest.approx(f.lift_interval[0])
        assert columns["failure rate with the value"][key] == pytest.approx(f.failing / f.total)
        assert columns["failing"][key] == f.failing and columns["verdicts"][key] == f.total
    # Every column has exactly the findings' rows (Grafana merges the columns on these labels).
    assert all(set(column) == set(rows) for column in columns.values()), columns
    # The dashboard's app variable filters the rows.
    assert all(set(column) == {rows[0]} for column in shop_only.values()), shop_only
    trace_ids = {e["labels"]["trace_id"] for series in exemplars for e in series["exemplars"]}
    assert trace_ids == {"a" * 32, "b" * 32}
