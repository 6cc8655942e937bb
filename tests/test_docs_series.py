"""Every Prometheus series the README and the documentation's pages name exists: a metric family the code
registers (with its exposed suffixes), or a recording rule of the shipped rules files. Checked against
the families the generated metrics reference collects (docs/hooks/reference_metrics.py, each process's
own constructors on a fresh registry), so a renamed or removed series cannot stay in a runbook."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "hooks"
# A series name standing alone (not part of a recording rule's name, not a prefix such as tracejudge_sink_*).
SERIES = re.compile(r"(?<![:\w])tracejudge_[a-z0-9_]*[a-z0-9](?![:\w*…])")
# A recording rule's full name (`<w>`, a window the text leaves open, is not checked).
RULE = re.compile(r"(?<![\w:])[a-z_]+:tracejudge_[a-z0-9_]+:[a-z0-9_]+(?![\w:<])")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")
NOT_SERIES = {"tracejudge_result"}  # the results' format name (header tracejudge-format), not a series


def _families() -> set[str]:
    if str(HOOKS) not in sys.path:
        sys.path.insert(0, str(HOOKS))
    return set(importlib.import_module("reference_metrics").families())


def _recording_rules() -> set[str]:
    names: set[str] = set()
    for path in sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text(encoding="utf-8")).get("groups") or []:
            names.update(rule["record"] for rule in group.get("rules") or [] if "record" in rule)
    return names


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs" / "pages").rglob("*.md"))]


def _exists(name: str, families: set[str]) -> bool:
    return name in families or any(name.endswith(s) and name[: -len(s)] in families for s in SUFFIXES) \
        or any(f"{name}{s}" in families for s in SUFFIXES)


def test_every_series_the_documentation_names_is_registered() -> None:
    families = _families()
    unknown: dict[str, set[str]] = {}
    for doc in _docs():
        for name in SERIES.findall(doc.read_text(encoding="utf-8")):
            if name not in NOT_SERIES and not _exists(name, families):
                unknown.setdefault(name, set()).add(doc.relative_to(ROOT).as_posix())
    assert not unknown, f"series the documentation names that no process registers: {unknown}"


def test_every_recording_rule_the_documentation_names_is_in_the_shipped_rules() -> None:
    rules = _recording_rules()
    unknown: dict[str, set[str]] = {}
    for doc in _docs():
        for name in RULE.findall(doc.read_text(encoding="utf-8")):
            if name not in rules:
                unknown.setdefault(name, set()).add(doc.relative_to(ROOT).as_posix())
    assert not unknown, f"recording rules the documentation names that no rules file records: {unknown}"


def test_the_checks_see_a_name_that_does_not_exist() -> None:
    families, rules = _families(), _recording_rules()
    assert _exists("tracejudge_judge_verdicts_total", families)
    assert not _exists("tracejudge_judge_verdict_total", families)
    assert SERIES.findall("`app_judge:tracejudge_judge_pass:ratio1h` and tracejudge_sink_*") == []
    rule = "app_judge:tracejudge_judge_pass:ratio1h"
    assert RULE.findall(f"see `{rule}`") == [rule]
    assert "app_judge:tracejudge_judge_pass:ratio1h" in rules
