"""The checked-in dashboards are Grafana's own dashboard model: they read back through
grafana-foundation-sdk's types unchanged, and `build_dashboards.py --check` catches a stale file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from support.deploy_files import DASHBOARDS, DEPLOY, deploy_module

NAMES = sorted(path.name for path in DASHBOARDS.glob("*.json"))
BUILDER = DEPLOY / "grafana" / "build_dashboards.py"


def read_back(data: dict[str, Any]) -> dict[str, Any]:
    """`data` decoded into the SDK's dashboard model (panels into their plugin's options and field
    config, queries into Prometheus queries) and encoded again: what the SDK's types keep of it."""
    plugins.register_default_plugins()
    return json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))


def test_the_builder_writes_every_checked_in_dashboard() -> None:
    assert NAMES == ["tracejudge-operations.json", "tracejudge-quality.json"]
    assert sorted(deploy_module("grafana/build_dashboards.py").DASHBOARDS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_dashboard_round_trips_through_the_sdk_types(name: str) -> None:
    data = json.loads((DASHBOARDS / name).read_text())
    assert read_back(data) == data
    board = Dashboard.from_json(data)
    kinds = {type(p.options).__module__.rsplit(".", 1)[-1] for p in board.panels if p.type_val != "row"}
    assert kinds <= {"timeseries", "heatmap", "table"} and "timeseries" in kinds, kinds
    queries = [t for p in board.panels if p.type_val != "row" for t in p.targets]
    assert queries and all(type(t).__module__.endswith(".prometheus") and t.expr for t in queries)


@pytest.mark.parametrize("field", ["noValeu", "legendFromat"])
def test_a_field_grafana_does_not_know_does_not_survive_the_round_trip(field: str) -> None:
    """What the round trip above checks: a misspelt field is dropped by the SDK's types."""
    data = json.loads((DASHBOARDS / "tracejudge-quality.json").read_text())
    panel = next(p for p in data["panels"] if p["type"] == "timeseries")
    if field == "noValeu":
        panel["fieldConfig"]["defaults"][field] = "nothing yet"
    else:
        panel["targets"][0][field] = "{{judge}}"
    assert read_back(data) != data


def run_builder(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The builder as a user runs it, writing into (or checking) `out`, not deploy/grafana/dashboards/."""
    return subprocess.run([sys.executable, str(BUILDER), "--out", str(out), *args], capture_output=True,
                          text=True, timeout=120)


def test_check_passes_on_fresh_files_and_names_a_stale_or_missing_one(tmp_path: Path) -> None:
    written = run_builder(tmp_path)
    assert written.returncode == 0, written.stderr
    for name in NAMES:
        assert (tmp_path / name).read_text() == (DASHBOARDS / name).read_text()
    assert run_builder(tmp_path, "--check").returncode == 0

    quality = tmp_path / "tracejudge-quality.json"
    data = json.loads(quality.read_text())
    data["panels"][1]["title"] += " (edited by hand)"
    quality.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    stale = run_builder(tmp_path, "--check")
    assert stale.returncode == 1
    assert f"{quality} is stale" in stale.stderr and "operations" not in stale.stderr
    assert "(edited by hand)" in quality.read_text(), "--check must not rewrite the file"

    (tmp_path / "tracejudge-operations.json").unlink()
    missing = run_builder(tmp_path, "--check")
    assert missing.returncode == 1 and "tracejudge-operations.json is stale" in missing.stderr

    shutil.copy(DASHBOARDS / "tracejudge-operations.json", tmp_path)
    assert run_builder(tmp_path).returncode == 0 and run_builder(tmp_path, "--check").returncode == 0
    assert quality.read_text() == (DASHBOARDS / "tracejudge-quality.json").read_text()
