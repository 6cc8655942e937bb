"""The shipped Prometheus rules and Alertmanager config, checked by promtool/amtool themselves.

promtool's unit tests (deploy/prometheus/tests/*.test.yml) show each alert firing and staying quiet;
the mutation tests here show those unit tests would notice if a guard were dropped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.deploy_files import (
    ALERTMANAGER,
    RULE_TESTS,
    RULES,
    alerts,
    deploy_module,
    family_of,
    load_yaml,
    recording_rules,
    rule_groups,
    tool,
)

ALERT_NAMES = [a["alert"] for a in alerts()]
RULE_TEST_FILES = sorted(RULE_TESTS.glob("*.test.yml"))


def run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, cwd=cwd)


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def promql_module():
    return deploy_module("grafana/promql.py")


# --- the rule file itself -------------------------------------------------------------------------

def test_rule_file_passes_promtool_check() -> None:
    result = run(tool("promtool"), "check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups())} rules found" in result.stdout


def test_the_seven_alerts_exist_with_severity_and_annotations() -> None:
    assert sorted(ALERT_NAMES) == sorted(["GroundednessDropped", "JudgeErrorsHigh", "EvaluationsMissing",
                                          "ConsumerLagHigh", "DeadLettersRising", "WriteBackLagging",
                                          "UserFrustrationRising", "JudgeDisagreesWithHumans",
                                          "JudgeCanaryFailing", "JudgeSpendNearCap", "ReleaseRegressed"])
    for alert in alerts():
        name = alert["alert"]
        assert alert["labels"]["severity"] in ("critical", "warning"), name
        # The links are rendered from the default `alerts:` section (tests/test_alert_links.py).
        assert set(alert["annotations"]) - {"traces_url"} == {"summary", "description", "runbook_url",
                                                              "dashboard_url"}, name
        assert alert["annotations"]["runbook_url"].endswith(f"/runbooks/{name}/"), name
        assert "$labels" in alert["annotations"]["summary"], f"{name}: summary should name what is affected"
        assert re.fullmatch(r"\d+[smh]", alert["for"]), f"{name}: a `for:` keeps one bad scrape from paging"


def test_rules_read_only_contract_metrics_and_recording_rules() -> None:
    promql = promql_module()
    known = recording_rules()
    for group in rule_groups():
        for rule in group["rules"]:
            for name in promql.metric_names(rule["expr"]):
                rule_name = rule.get("alert") or rule.get("record")
                assert family_of(name) or name in known, \
                    f"{rule_name}: {name} is neither a tracejudge metric nor a recording rule"


def test_recording_rule_names_follow_level_metric_operation() -> None:
    for name in recording_rules():
        level, metric, operation = name.split(":")
        assert level and metric.startswith("tracejudge_"), name
        # min: the earliest first-seen time of a release; zscore: ReleaseRegressed's test statistic.
        assert re.fullmatch(r"(ratio|increase|min|zscore)\d+[mhd]", operation), name


def test_greater_or_equal_is_reserved_for_minimum_volume_guards() -> None:
    # shorten.py lowers every `>= N` at once; that is only right if each is a count guard.
    text = RULES.read_text()
    assert "<=" not in text
    guards = [line for line in text.splitlines() if ">=" in line and not line.lstrip().startswith("#")]
    assert len(guards) == 13
    for line in guards:
        assert "increase" in line, f"`>=` used on something that is not a volume count: {line.strip()}"


# --- promtool unit tests ----------------------------------------------------------------------------

@pytest.mark.parametrize("test_file", RULE_TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(test_file: Path) -> None:
    result = run(tool("promtool"), "test", "rules", test_file.name, cwd=RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_each_alert_has_a_unit_test_where_it_fires_and_one_where_it_stays_quiet(alert: str) -> None:
    test_file = RULE_TESTS / f"{snake(alert)}.test.yml"
    cases = [case for group in load_yaml(test_file)["tests"] for case in group.get("alert_rule_test", [])
             if case["alertname"] == alert]
    assert any(case.get("exp_alerts") for case in cases), f"{alert}: no case where it fires"
    assert any(not case.get("exp_alerts") for case in cases), f"{alert}: no case where it stays quiet"


def mutated_run(tmp_path: Path, alert: str, old: str, new: str) -> subprocess.CompletedProcess[str]:
    """Run `alert`'s unit test against a copy of the rules with `old` replaced in that alert's expr."""
    doc = load_yaml(RULES)
    replaced = 0
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                replaced = rule["expr"].count(old)
                rule["expr"] = rule["expr"].replace(old, new)
    assert replaced, f"mutation {old!r} not found in {alert}"
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / RULES.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / "tests").mkdir()
    test_file = f"{snake(alert)}.test.yml"
    shutil.copy(RULE_TESTS / test_file, tmp_path / "tests" / test_file)
    return run(tool("promtool"), "test", "rules", test_file, cwd=tmp_path / "tests")


@pytest.mark.parametrize(("alert", "guard"), [
    ("GroundednessDropped", ">= 20"),
    ("JudgeErrorsHigh", ">= 20"),
    ("EvaluationsMissing", ">= 50"),
    ("DeadLettersRising", ">= 20"),
    ("UserFrustrationRising", ">= 20"),
    ("JudgeDisagreesWithHumans", ">= 30"),
    ("JudgeCanaryFailing", ">= 10"),
    ("ReleaseRegressed", ">= 30"),
])
def test_dropping_a_minimum_volume_guard_fails_its_unit_test(tmp_path: Path, alert: str, guard: str) -> None:
    result = mutated_run(tmp_path, alert, guard, ">= 0")
    assert result.returncode != 0, f"{alert}: its unit test does not notice a missing minimum guard"
    assert "FAILED" in result.stdout + result.stderr


def test_groundedness_relative_drop_is_tested(tmp_path: Path) -> None:
    # Without the relative comparison, the day-2 drop of app "dropped" must go unnoticed by the rule.
    result = mutated_run(tmp_path, "GroundednessDropped", "0.9 * (", "0 * (")
    assert result.returncode != 0 and 'app="dropped"' in result.stdout + result.stderr


def test_groundedness_fires_without_a_baseline_is_tested(tmp_path: Path) -> None:
    # Inverting the "no usable baseline" branch silences brand-new apps: the unit test must notice.
    result = mutated_run(tmp_path, "GroundednessDropped", "unless on (app, judge)", "and on (app, judge)")
    assert result.returncode != 0 and 'app="fresh"' in result.stdout + result.stderr


def test_user_frustration_relative_rise_is_tested(tmp_path: Path) -> None:
    # Without the comparison with yesterday, chronic (40% both days) pages on day 2 as well.
    result = mutated_run(tmp_path, "UserFrustrationRising", "1.5 * (", "0 * (")
    assert result.returncode != 0 and 'app="chronic"' in result.stdout + result.stderr


def test_user_frustration_fires_without_a_baseline_is_tested(tmp_path: Path) -> None:
    # Inverting the "no usable baseline" branch silences a new app: fresh must then be missed.
    result = mutated_run(tmp_path, "UserFrustrationRising", "unless on (app)", "and on (app)")
    assert result.returncode != 0 and 'app="fresh"' in result.stdout + result.stderr


def test_user_frustration_floor_is_tested(tmp_path: Path) -> None:
    # Without the 20% floor, lowfloor (5% -> 15%, tripled) pages.
    result = mutated_run(tmp_path, "UserFrustrationRising", "ratio1h > 0.2", "ratio1h > 0")
    assert result.returncode != 0 and 'app="lowfloor"' in result.stdout + result.stderr


@pytest.mark.parametrize(("old", "new", "app"), [
    ("zscore1d > 2.33", "zscore1d > 0", "noisy"),  # a 10-point drop on 40 verdicts a side is noise
    ("ratio1d > 0.05", "ratio1d > 0", "huge"),  # significant on 20000 a side, but only 2 points
])
def test_release_regressed_significance_and_effect_size_are_tested(tmp_path: Path, old: str, new: str,
                                                                   app: str) -> None:
    result = mutated_run(tmp_path, "ReleaseRegressed", old, new)
    assert result.returncode != 0 and f'app="{app}"' in result.stdout + result.stderr


def test_release_regressed_resolves_after_a_rollback_is_tested(tmp_path: Path) -> None:
    # Without "the current release still had verdicts in the last hour", a rolled-back release pages on.
    result = mutated_run(tmp_path, "ReleaseRegressed", "[1h])) > 0", "[1h])) > -1")
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


def test_user_frustration_reads_only_the_user_frustration_judge() -> None:
    recorded = {r["record"]: r["expr"] for g in rule_groups() for r in g["rules"] if "record" in r}
    for name in ("app:tracejudge_user_frustration_verdicts:increase1h",
                 "app:tracejudge_user_frustration_unresolved:ratio1h"):
        assert 'tracejudge_session_judge_verdicts_total{judge="user_frustration"' in recorded[name], name
    assert 'verdict="unresolved"' in recorded["app:tracejudge_user_frustration_unresolved:ratio1h"]


def test_write_back_lag_summed_over_replicas_is_tested(tmp_path: Path) -> None:
    # Per replica the mlflow sink is 6000 behind, together 12000: without the sum nothing fires.
    result = mutated_run(tmp_path, "WriteBackLagging", "sum by (sink) (tracejudge_sink_lag_records)",
                         "tracejudge_sink_lag_records")
    assert result.returncode != 0 and 'sink="mlflow"' in result.stdout + result.stderr


def test_write_back_lagging_waits_fifteen_minutes_and_is_tested(tmp_path: Path) -> None:
    (alert,) = [a for a in alerts() if a["alert"] == "WriteBackLagging"]
    assert alert["for"] == "15m" and alert["labels"]["severity"] == "warning"
    # A shorter `for:` (a burst pages, a steady lag pages early) must fail the unit test.
    doc = load_yaml(RULES)
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "WriteBackLagging":
                rule["for"] = "1m"
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / RULES.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    (tmp_path / "tests").mkdir()
    shutil.copy(RULE_TESTS / "write_back_lagging.test.yml", tmp_path / "tests")
    result = run(tool("promtool"), "test", "rules", "write_back_lagging.test.yml", cwd=tmp_path / "tests")
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


# --- the fast-clock derivation ----------------------------------------------------------------------

def test_shorten_rewrites_every_window_offset_for_and_guard(tmp_path: Path) -> None:
    shorten = deploy_module("prometheus/shorten.py")
    out = shorten.shorten_file(RULES, tmp_path / "fast.yml", shorten.FAST_CLOCK, for_="2s", min_count=3,
                               interval="1s")
    result = run(tool("promtool"), "check", "rules", out)
    assert result.returncode == 0, result.stdout + result.stderr

    original, fast = load_yaml(RULES), load_yaml(out)
    windows = {w for g in fast["groups"] for r in g["rules"]
               for w in re.findall(r"\[(\w+)\]|offset (\w+)", r["expr"]) for w in w if w}
    assert windows <= set(shorten.FAST_CLOCK.values())
    for old_group, new_group in zip(original["groups"], fast["groups"], strict=True):
        assert new_group["interval"] == "1s"
        for old, new in zip(old_group["rules"], new_group["rules"], strict=True):
            assert {k: v for k, v in old.items() if k not in ("expr", "for")} == \
                   {k: v for k, v in new.items() if k not in ("expr", "for")}
            assert set(re.findall(r">=\s*(\S+)", new["expr"])) <= {"3"}
            if "alert" in new:
                assert new["for"] == "2s"


def test_shorten_refuses_a_window_it_has_no_mapping_for() -> None:
    shorten = deploy_module("prometheus/shorten.py")
    doc = {"groups": [{"name": "g", "rules": [{"record": "a:b:c", "expr": "rate(x_total[7m])"}]}]}
    with pytest.raises(shorten.ShortenError, match=r"group 'g' rule 'a:b:c': duration '7m' has no mapping"):
        shorten.shorten_rules(doc, {"5m": "10s"})


def test_shorten_command_line(tmp_path: Path) -> None:
    out = tmp_path / "fast.yml"
    result = run("python3", Path(deploy_module("prometheus/shorten.py").__file__), RULES, out,
                 "--duration", "1h=45s", "--min-count", "2", "--for", "1s")
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "[45s]" in text and "[1h]" not in text and "offset 1d" not in text and ">= 2" in text
    bad = run("python3", Path(deploy_module("prometheus/shorten.py").__file__), RULES, out,
              "--duration", "1h")
    assert bad.returncode == 2 and "expected FROM=TO" in bad.stderr


def test_shortened_groundedness_alert_fires_within_seconds(tmp_path: Path) -> None:
    """The derived rule file the end-to-end test loads: 30 s windows, 2 min baseline, 3 verdicts."""
    shorten = deploy_module("prometheus/shorten.py")
    shorten.shorten_file(RULES, tmp_path / "fast.yml", shorten.FAST_CLOCK, for_="0s", min_count=3,
                         interval="1s")
    fast = load_yaml(tmp_path / "fast.yml")
    alert = next(r for g in fast["groups"] for r in g["rules"] if r.get("alert") == "GroundednessDropped")
    # The links depend on the evaluation time; the promtool unit tests show them rendered.
    alert["annotations"] = {k: v for k, v in alert["annotations"].items() if not k.endswith("_url")}
    (tmp_path / "fast.yml").write_text(yaml.safe_dump(fast, sort_keys=False))
    annotations = {
        "summary": "Groundedness pass rate 0% for app shop",
        "description": alert["annotations"]["description"].replace("{{ $value | humanizePercentage }}", "0%")
                                                           .replace("{{ $labels.app }}", "shop"),
    }
    unit_test = {
        "rule_files": ["fast.yml"],
        "evaluation_interval": "1s",
        "tests": [{
            "interval": "1s",
            # One verdict a second: all pass for two minutes, then all fail.
            "input_series": [
                {"series": 'tracejudge_judge_verdicts_total{app="shop",judge="groundedness",verdict="pass"}',
                 "values": "0+1x120 120x60"},
                {"series": 'tracejudge_judge_verdicts_total{app="shop",judge="groundedness",verdict="fail"}',
                 "values": "0x120 1+1x60"},
            ],
            "alert_rule_test": [
                {"eval_time": "100s", "alertname": "GroundednessDropped", "exp_alerts": []},
                {"eval_time": "170s", "alertname": "GroundednessDropped", "exp_alerts": [{
                    "exp_labels": {"severity": "critical", "app": "shop", "judge": "groundedness"},
                    "exp_annotations": annotations}]},
            ],
        }],
    }
    (tmp_path / "fast.test.yml").write_text(yaml.safe_dump(unit_test, sort_keys=False))
    result = run(tool("promtool"), "test", "rules", "fast.test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# --- Alertmanager -------------------------------------------------------------------------------------

def test_alertmanager_config_passes_amtool() -> None:
    result = run(tool("amtool"), "check-config", ALERTMANAGER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize("alert", ALERT_NAMES)
def test_every_alert_routes_to_the_webhook(alert: str) -> None:
    result = run(tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER}",
                 f"alertname={alert}", "app=shop")
    assert result.stdout.strip() == "tracejudge-webhook", result.stdout + result.stderr


def test_other_alerts_do_not_reach_the_webhook() -> None:
    result = run(tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER}",
                 "alertname=KubePodCrashLooping")
    assert result.stdout.strip() == "default-null"


def test_webhook_sends_resolved_notifications() -> None:
    receiver = next(r for r in load_yaml(ALERTMANAGER)["receivers"] if r["name"] == "tracejudge-webhook")
    (webhook,) = receiver["webhook_configs"]
    assert webhook["send_resolved"] is True and webhook["url"].startswith("http")


# --- the Kubernetes PrometheusRule --------------------------------------------------------------------

def test_prometheusrule_manifest_carries_the_rule_file_unchanged() -> None:
    build = deploy_module("prometheus/build_prometheusrule.py")
    assert build.main(["--check"]) == 0, "run python deploy/prometheus/build_prometheusrule.py"
    manifest = load_yaml(build.MANIFEST)
    assert manifest["kind"] == "PrometheusRule" and manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["spec"] == load_yaml(RULES)


def test_prometheusrule_drift_is_detected(tmp_path: Path) -> None:
    build = deploy_module("prometheus/build_prometheusrule.py")
    edited = RULES.read_text().replace("< 0.8", "< 0.7")
    assert yaml.safe_load(build.render(edited))["spec"] != load_yaml(build.MANIFEST)["spec"]
