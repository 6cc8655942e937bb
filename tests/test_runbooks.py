"""Every alert's runbook is a page of the documentation site, and every `runbook_url` opens it.

The alerts are those of every shipped rules file: deploy/prometheus/rules/*.yml, the package's copy
(consumer/config/tracejudge.rules.yml) and what `tracejudge slo render` writes for
deploy/config/slos.example.yaml. Each has docs/pages/runbooks/<AlertName>.md, whose only h1 is the
alert's name and whose sections are those of every runbook, in the same order; every page there belongs
to one of those alerts; the alerts page and the site's navigation list each; and each rendered
`runbook_url` is `<alerts.runbook_base_url><AlertName>/`, the address MkDocs builds the page at
(`use_directory_urls`). tests/test_docs_site.py opens each rendered link on the built site in Chromium.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.deploy_files import ROOT

from tracejudge.consumer.config.alerts import DEFAULT_RUNBOOK_BASE_URL

TRACEJUDGE = str(Path(sys.executable).parent / "tracejudge")
DOCS = ROOT / "docs"
RUNBOOKS = DOCS / "pages" / "runbooks"
ALERTS_PAGE = DOCS / "pages" / "alerts" / "index.md"
SHIPPED_RULES = [*sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml")),
                 ROOT / "consumer" / "config" / "tracejudge.rules.yml"]
SLO_EXAMPLE = "deploy/config/slos.example.yaml"
# The sections of every runbook page (its h2 headings), in this order.
SECTIONS = ["What fired", "Impact", "First checks", "Likely causes and what to do", "Links"]
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def headings(text: str) -> list[tuple[int, str, str]]:
    """(level, title, the text up to the next heading) of each ATX heading of a Markdown text, outside
    fenced code blocks."""
    out: list[tuple[int, str, str]] = []
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        match = None if fenced else _HEADING.match(line)
        if match:
            out.append((len(match.group(1)), match.group(2), ""))
        elif out:
            level, title, body = out[-1]
            out[-1] = (level, title, body + line + "\n")
    return out


def alerting_rules(text: str) -> list[dict]:
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"] if "alert" in rule]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Each shipped rules file (and the SLO example's render) -> its alerting rules."""
    out = tmp_path_factory.mktemp("slo") / "slo.rules.yml"
    result = subprocess.run([TRACEJUDGE, "slo", "render", "--config", SLO_EXAMPLE, "--out", str(out)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr
    files = {str(path.relative_to(ROOT)): path.read_text() for path in SHIPPED_RULES}
    files[f"tracejudge slo render --config {SLO_EXAMPLE}"] = out.read_text()
    rules = {name: alerting_rules(text) for name, text in files.items()}
    assert all(rules.values()), {name: len(r) for name, r in rules.items()}
    return rules


@pytest.fixture(scope="module")
def alert_names(shipped: dict[str, list[dict]]) -> set[str]:
    return {rule["alert"] for rules in shipped.values() for rule in rules}


def pages() -> dict[str, Path]:
    return {path.stem: path for path in RUNBOOKS.glob("*.md")}


def test_every_alert_has_a_runbook_page_whose_only_h1_is_its_name(alert_names: set[str]) -> None:
    assert {"GroundednessDropped", "SLOBurnFast", "SLOBurnSlow"} <= alert_names
    wrong = {}
    for name in sorted(alert_names):
        page = RUNBOOKS / f"{name}.md"
        if not page.is_file():
            wrong[name] = f"no {page.relative_to(ROOT)}"
            continue
        h1 = [title for level, title, _ in headings(page.read_text()) if level == 1]
        if h1 != [name]:
            wrong[name] = f"h1 headings {h1}"
    assert wrong == {}


def test_every_runbook_page_belongs_to_a_shipped_alert(alert_names: set[str]) -> None:
    orphans = sorted(set(pages()) - alert_names)
    assert orphans == [], f"runbook pages without an alert in the shipped rules: {orphans}"


def test_every_runbook_has_the_same_sections_each_with_text() -> None:
    wrong = {}
    for name, page in sorted(pages().items()):
        sections = [(title, body) for level, title, body in headings(page.read_text()) if level == 2]
        found = [title for title, _ in sections]
        if found != SECTIONS:
            wrong[name] = f"sections {found}, expected {SECTIONS}"
            continue
        empty = [title for title, body in sections if not body.strip()]
        if empty:
            wrong[name] = f"empty sections {empty}"
    assert wrong == {}


def test_every_rendered_runbook_url_is_its_page_on_the_site(shipped: dict[str, list[dict]]) -> None:
    wrong = []
    for source, rules in shipped.items():
        for rule in rules:
            name, url = rule["alert"], rule["annotations"]["runbook_url"]
            if not url.endswith(f"/runbooks/{name}/") or url != f"{DEFAULT_RUNBOOK_BASE_URL}{name}/":
                wrong.append(f"{source}: {name}: {url}")
    assert wrong == []


def test_the_default_base_is_the_sites_runbooks_folder_built_one_directory_per_page() -> None:
    config = yaml.safe_load((DOCS / "mkdocs.yml").read_text())
    assert config["site_url"].rstrip("/") + "/runbooks/" == DEFAULT_RUNBOOK_BASE_URL
    # docs/pages/runbooks/X.md is built at runbooks/X/ (index.html) only with directory URLs.
    assert config.get("use_directory_urls", True) is True
    assert (DOCS / config["docs_dir"]).resolve() == RUNBOOKS.parent.resolve()


def test_the_alerts_page_and_the_navigation_list_every_runbook() -> None:
    names = set(pages())
    linked = set(re.findall(r"\]\(\.\./runbooks/([A-Za-z0-9_]+)\.md\)", ALERTS_PAGE.read_text()))
    assert linked == names
    nav = yaml.safe_load((DOCS / "mkdocs.yml").read_text())["nav"]
    in_nav = set()

    def walk(item: object) -> None:
        if isinstance(item, str):
            if item.startswith("runbooks/"):
                in_nav.add(item.removeprefix("runbooks/").removesuffix(".md"))
        elif isinstance(item, list):
            for child in item:
                walk(child)
        elif isinstance(item, dict):
            for child in item.values():
                walk(child)

    walk(nav)
    assert in_nav == names


def test_the_rules_name_the_pages_a_custom_base_points_at(tmp_path: Path) -> None:
    config = tmp_path / "tracejudge.yaml"
    config.write_text(yaml.safe_dump({"alerts": {"runbook_base_url": "http://127.0.0.1:8000/tj/runbooks"}}))
    result = subprocess.run([TRACEJUDGE, "alerts", "render", "--config", str(config)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    urls = {rule["alert"]: rule["annotations"]["runbook_url"] for rule in alerting_rules(result.stdout)}
    assert urls and urls == {name: f"http://127.0.0.1:8000/tj/runbooks/{name}/" for name in urls}
    assert set(urls) <= set(pages())
