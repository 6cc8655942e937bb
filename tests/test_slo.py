"""Quality SLOs: the `slos:` section, `tracejudge slo render` and the rules it writes.

The alerts' behaviour (a 50-point drop pages in 3 minutes, a 2-point dip never, a slow burn opens a
ticket, too few judged traces stay quiet, the corrected rate is read) is promtool's unit test
deploy/prometheus/tests/slo_burn.test.yml on the rendered example (run by test_deploy_prometheus); here:
the configuration's checks, the renderer's output and drift, the command's statuses, and a mutation
showing the unit test notices a missing min_judged guard.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.deploy_files import ROOT, RULE_TESTS, RULES, SLO_RULES, tool

from tracejudge.consumer.commands import cli
from tracejudge.consumer.commands.slo import render
from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.config.slo_rules import (
    PAIRS,
    SHARP,
    SHARP_FALSE_PAGE,
    factor,
    render_slo_rules,
    sharp_minimum,
    slo_rule_names,
)
from tracejudge.consumer.config.slos import SloSpec

EXAMPLE = "deploy/config/slos.example.yaml"


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(tmp_path: Path, text: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text), require_topics=False)
    return {key.split(" (")[0]: message for key, message in info.value.problems}


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *map(str, args)], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


# --- the slos: section ----------------------------------------------------------------------------------

def test_an_slo_gets_its_defaults_and_a_name_from_app_judge_and_objective(tmp_path: Path) -> None:
    text = "slos:\n  - {app: shop, judge: groundedness, objective: 0.995}\n"
    settings = load_settings(write(tmp_path, text), require_topics=False)
    (slo,) = settings.slos
    assert (slo.window, slo.min_judged, slo.corrected) == ("28d", 100, "auto")
    assert slo.slo == "shop-groundedness-99.5" and slo.budget == pytest.approx(0.005)


def test_bad_values_are_named_by_their_key_path(tmp_path: Path) -> None:
    got = problems(tmp_path, 'slos:\n  - {app: "a\\"b", judge: "g r", objective: 1, window: 3d,'
                   ' min_judged: 0, corrected: sometimes}\n')
    assert set(got) >= {"slos[0].app", "slos[0].judge", "slos[0].objective", "slos[0].window",
                        "slos[0].min_judged", "slos[0].corrected"}
    assert "7d to 90d" in got["slos[0].window"]
    assert "duration" in problems(tmp_path, "slos:\n  - {app: a, judge: g, objective: 0.9, window: month}\n")[
        "slos[0].window"]


def test_duplicates_unknown_judges_and_corrected_without_calibration_are_refused(tmp_path: Path) -> None:
    got = problems(tmp_path, """
judges: {builtin: {groundedness: {}}}
slos:
  - {app: shop, judge: groundedness, objective: 0.95}
  - {app: shop, judge: groundedness, objective: 0.9}
  - {app: shop, judge: safety, objective: 0.9}
  - {app: shop2, judge: groundedness, objective: 0.9, corrected: true}
""")
    assert "one SLO per app and judge" in got["slos[1].judge"]
    assert "not a configured trace judge" in got["slos[2].judge"]
    assert "judges.calibration_file" in got["slos[3].corrected"]


def test_without_a_judges_section_any_judge_name_is_taken(tmp_path: Path) -> None:
    text = "slos:\n  - {app: shop, judge: my_judge, objective: 0.9, corrected: true}\n"
    assert load_settings(write(tmp_path, text), require_topics=False).slos[0].judge == "my_judge"


# --- the renderer ---------------------------------------------------------------------------------------

def test_factors_are_the_workbook_table_scaled_to_the_window() -> None:
    thirty, twenty_eight = 30 * 86400, 28 * 86400
    assert [factor(p, thirty) for p in PAIRS] == [14.4, 6.0, 3.0, 1.0]
    assert [factor(p, twenty_eight) for p in PAIRS] == [13.44, 5.6, 2.8, 0.9333]
    assert factor(SHARP, twenty_eight) == 5.6


def binomial_tail(n: int, p: float, ratio: float) -> float:
    """P(X > ratio * n), X ~ Binomial(n, p), by direct summation (exact, for small n)."""
    return sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(math.floor(ratio * n) + 1, n + 1))


@pytest.mark.parametrize("objective", [0.9, 0.95, 0.99])
def test_the_sharp_pair_needs_enough_verdicts_for_a_one_in_a_million_false_page(objective: float) -> None:
    slo = SloSpec(app="a", judge="g", objective=objective, min_judged=20)
    n = sharp_minimum(slo)
    threshold = factor(SHARP, slo.window_s) * slo.budget
    assert n >= 20 and binomial_tail(n, slo.budget, threshold) < SHARP_FALSE_PAGE
    if n > 20:  # the minimum grows by at most 5% a step: a count 6% smaller is not enough
        smaller = math.floor(n / 1.06)
        assert smaller < 20 or binomial_tail(smaller, slo.budget, threshold) >= SHARP_FALSE_PAGE


def test_the_example_rules_are_what_the_example_configuration_renders(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    text, count = render(EXAMPLE)
    assert count == 3
    assert SLO_RULES.read_text() == text, "run: tracejudge slo render --config " + EXAMPLE + " --out " + \
        str(SLO_RULES.relative_to(ROOT))


def test_the_example_rules_pass_promtool_check_and_name_only_known_rules() -> None:
    result = promtool("check", "rules", SLO_RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    doc = yaml.safe_load(SLO_RULES.read_text())
    records = {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}
    assert records <= slo_rule_names(["28d", "30d"])
    alerts = [r for g in doc["groups"] for r in g["rules"] if "alert" in r]
    assert sorted({a["alert"] for a in alerts}) == ["SLOBurnFast", "SLOBurnSlow"]
    for alert in alerts:
        assert alert["labels"]["severity"] == ("page" if alert["alert"] == "SLOBurnFast" else "ticket")
        assert alert["annotations"]["runbook_url"].endswith(f"/runbooks/{alert['alert']}/")
        assert "judged traces" in alert["annotations"]["description"]


def test_every_aggregation_sums_by_app_and_judge_and_every_guard_is_min_judged() -> None:
    slo = SloSpec(app="shop", judge="groundedness", objective=0.95, min_judged=321)
    text = render_slo_rules([slo])
    for rule in (r for g in yaml.safe_load(text)["groups"] for r in g["rules"]):
        expr = str(rule["expr"])
        if "tracejudge_judge_verdicts_total" in expr:
            assert expr.count("sum by (app, judge) (") == expr.count("tracejudge_judge_verdicts_total"), expr
        if "alert" in rule:
            assert ">= 321" in expr
    rules = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert {line.split(">= ")[1] for line in rules if ">= " in line} == {"321"}


def test_the_shipped_rules_need_no_slo() -> None:
    assert "tracejudge_slo" not in RULES.read_text()
    result = promtool("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dropping_the_min_judged_guard_fails_the_unit_test(tmp_path: Path) -> None:
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    mutated = SLO_RULES.read_text().replace(">= 100", ">= 0").replace(">= 200", ">= 0")
    (tmp_path / "rules" / SLO_RULES.name).write_text(mutated)
    shutil.copy(RULE_TESTS / "slo_burn.test.yml", tmp_path / "tests" / "slo_burn.test.yml")
    result = promtool("test", "rules", "slo_burn.test.yml", cwd=tmp_path / "tests")
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr
    assert "time: 1h39m" in result.stdout + result.stderr  # the too-few case now fires


# --- the command ----------------------------------------------------------------------------------------

def test_render_writes_the_file_and_never_the_configuration(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "slos:\n  - {app: shop, judge: groundedness, objective: 0.95}\n")
    out = tmp_path / "slo.rules.yml"
    assert cli.main(["slo", "render", "--config", str(cfg), "--out", str(out)]) == 0
    assert promtool("check", "rules", out).returncode == 0
    assert "wrote 1 SLO(s)" in capsys.readouterr().err
    before = cfg.read_text()
    assert cli.main(["slo", "render", "--config", str(cfg), "--out", str(cfg)]) == 2
    assert cfg.read_text() == before and "would destroy it" in capsys.readouterr().err
    assert cli.main(["slo", "render", "--config", str(cfg)]) == 0
    assert capsys.readouterr().out == out.read_text()


def test_a_configuration_error_is_status_2_and_names_the_key(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "slos:\n  - {app: shop, judge: groundedness, objective: 95}\n")
    out = tmp_path / "out.yml"
    assert cli.main(["slo", "render", "--config", str(cfg), "--out", str(out)]) == 2
    assert "slos[0].objective" in capsys.readouterr().err and not out.exists()


def test_no_slos_renders_an_empty_valid_rules_file(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "kafka: {}\n")
    out = tmp_path / "out.yml"
    assert cli.main(["slo", "render", "--config", str(cfg), "--out", str(out)]) == 0
    assert "no slos: section" in capsys.readouterr().err
    assert yaml.safe_load(out.read_text()) == {"groups": []}
    assert promtool("check", "rules", out).returncode == 0


def test_an_unwritable_output_is_status_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path, "slos:\n  - {app: shop, judge: groundedness, objective: 0.95}\n")
    assert cli.main(["slo", "render", "--config", str(cfg), "--out", str(tmp_path / "no" / "x.yml")]) == 3
    assert "cannot write" in capsys.readouterr().err

