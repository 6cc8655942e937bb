"""The README's links lead somewhere: it is short now and sends readers to the documentation's pages, so
every relative link must name a file of the repository (a page moved or renamed fails here, not on the
reader), and every page of the site must be reachable from the README or the site's navigation."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


def test_every_relative_link_of_the_readme_names_a_file_of_the_repository() -> None:
    links = _relative_links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert links, "the README links to the documentation"
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, missing


def test_the_readme_links_the_documentation_sections_it_names() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in ("docs/pages/getting-started.md", "docs/pages/commands/index.md",
                 "docs/pages/alerts/index.md", "docs/pages/deploying.md"):
        assert f"]({page})" in text, page


def _nav_pages(node: object) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [p for v in node.values() for p in _nav_pages(v)]
    if isinstance(node, list):
        return [p for v in node for p in _nav_pages(v)]
    return []


def test_every_page_is_in_the_sites_navigation() -> None:
    config = yaml.load((ROOT / "docs/mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    nav = set(_nav_pages(config["nav"]))
    pages = {p.relative_to(ROOT / "docs/pages").as_posix() for p in (ROOT / "docs/pages").rglob("*.md")}
    assert pages - nav == set(), "pages no one can reach from the navigation"
    assert nav - pages == set(), "navigation entries without a page"
