"""The documentation site (docs/mkdocs.yml) builds with warnings as errors and works in a real browser.

The site is built once, as `make docs` builds it (`mkdocs build --strict`, from the repository root),
and served on loopback under the path of its `site_url` (as GitHub Pages serves it, so the 404 page's
absolute links work too). One headless Chromium (tests/support/chromium.py) opens every page of it
in one tab: each renders (the Material header and navigation, an `article` with an h1), throws no
exception, logs no error, fails no request and asks nothing of any host but loopback (no web fonts,
no GitHub API); every link into the site leads to a page or file that is there (HTTP 200) and its
`#fragment` to an element id on that page as Chromium rendered it. Then every alert of the rules
`tracejudge alerts render` writes, with `alerts.runbook_base_url` pointing at the served runbooks,
opens the runbook page named after the alert.

A page with one of each fault shows that the browser reports each kind the checks rely on. A separate
build of a copy of docs/ with a broken link and a broken anchor (run beside the main build) shows that
a warning fails the build, naming the page.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml
from support.chromium import Chromium
from support.kafka import wait_until

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
BIN = Path(sys.executable).parent
BUILD_TIMEOUT = 180

# What a page tells about itself once rendered: its h1 (without the permalink's ¶), whether the
# Material header and primary navigation are there, every link (resolved to an absolute URL) and every
# id (or <a name>) a fragment can point at.
PAGE_FACTS = """(() => {
  const h1 = document.querySelector('article h1');
  let title = null;
  if (h1) {
    const copy = h1.cloneNode(true);
    copy.querySelectorAll('.headerlink').forEach(e => e.remove());
    title = copy.textContent.trim();
  }
  return {
    title: title,
    header: !!document.querySelector('header.md-header'),
    nav: !!document.querySelector('nav.md-nav--primary'),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
    ids: [...document.querySelectorAll('[id]')].map(e => e.id)
           .concat([...document.querySelectorAll('a[name]')].map(a => a.name)),
  };
})()"""


@dataclass
class Build:
    """`mkdocs build --strict` running in the background, its output going to a file."""

    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, config: Path, site_dir: Path, cwd: Path) -> Build:
        # NO_MKDOCS_2_WARNING: Material >= 9.7 prints an end-of-life banner about MkDocs 2 otherwise.
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        command = [str(BIN / "mkdocs"), "build", "--strict", "-f", str(config), "-d", str(site_dir)]
        log = site_dir.parent / f"{site_dir.name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)
        return cls(proc, log)

    def result(self) -> tuple[int, str]:
        """Its exit status and output, once it has ended (at most BUILD_TIMEOUT seconds from now)."""
        status = self.proc.wait(timeout=BUILD_TIMEOUT)
        return status, self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def site_url() -> str:
    """docs/mkdocs.yml's `site_url`, ending in / (read off its line: the file may hold MkDocs' tags)."""
    found = re.search(r"^site_url:\s*(\S+)", (DOCS / "mkdocs.yml").read_text(), re.M)
    assert found, "docs/mkdocs.yml has no site_url"
    return found.group(1).strip("'\"").rstrip("/") + "/"


def site_path() -> str:
    """The path the site is published under (its `site_url`'s): "/tracejudge/"."""
    return urlsplit(site_url()).path


@dataclass
class Site:
    root: Path  # the built files
    base: str  # http://127.0.0.1:<port>/<site path>/


@dataclass
class View:
    """One page as Chromium rendered it."""

    url: str
    problems: list[str]
    title: str | None
    header: bool
    nav: bool
    links: list[str]
    ids: set[str]


def serve(root: Path, prefix: str) -> http.server.ThreadingHTTPServer:
    """A threaded static server of `root` at `prefix` on a free loopback port (nothing outside it)."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        timeout = 30  # a connection the browser keeps open idle is closed after 30 s

        def translate_path(self, path: str) -> str:
            local = urlsplit(path).path
            if not local.startswith(prefix):
                return str(root / "no such file")
            return super().translate_path("/" + local[len(prefix):])

        def log_message(self, format: str, *args: object) -> None:
            pass

    handler = functools.partial(Handler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="docs-site", daemon=True).start()
    return server


def http_status(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
    try:
        with opener.open(url, timeout=15) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def page_urls(site: Site) -> list[str]:
    """Every HTML file of the built site, as the URL it is served at (a directory's index.html as the
    directory), the home page first."""
    urls = []
    for path in sorted(site.root.rglob("*.html")):
        relative = path.relative_to(site.root).as_posix()
        urls.append(site.base + (relative[: -len("index.html")] if path.name == "index.html" else relative))
    return sorted(urls, key=lambda u: (u != site.base, u))


def page_of(url: str) -> str:
    """The URL without its fragment, a directory's index.html as the directory."""
    plain = url.split("#", 1)[0]
    return plain[: -len("index.html")] if plain.endswith("/index.html") else plain


# --- the fixtures: one build, one server, one browser, every page opened once -------------------------

@pytest.fixture(scope="module")
def broken_build(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Build]:
    """The build of a copy of docs/ whose development.md has a broken link and a broken anchor."""
    tmp = tmp_path_factory.mktemp("docs-broken")
    root = mirror_repository(tmp)
    page = root / "docs" / "pages" / "development.md"
    page.write_text(page.read_text()
                    + "\nSee [nowhere](no-such-page.md) and [the top](index.md#no-such-anchor).\n")
    build = Build.start(root / "docs" / "mkdocs.yml", tmp / "site", root)
    try:
        yield build
    finally:
        build.stop()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, broken_build: Build) -> Path:
    """The site, built as `make docs` builds it. (The broken copy's build runs beside it: two builds
    on two cores take the time of one.)"""
    site_dir = tmp_path_factory.mktemp("docs-site") / "site"
    build = Build.start(DOCS / "mkdocs.yml", site_dir, REPO)
    try:
        status, output = build.result()
    finally:
        build.stop()
    assert status == 0, f"mkdocs build --strict failed:\n{output}"
    assert "WARNING" not in output, output
    return site_dir


@pytest.fixture(scope="module")
def site(built: Path) -> Iterator[Site]:
    prefix = site_path()
    server = serve(built, prefix)
    try:
        yield Site(built, f"http://127.0.0.1:{server.server_address[1]}{prefix}")
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    with Chromium() as chromium:
        yield chromium


@pytest.fixture(scope="module")
def views(site: Site, browser: Chromium) -> dict[str, View]:
    out = {}
    for url in page_urls(site):
        page = browser.navigate(url)
        facts = browser.evaluate(PAGE_FACTS)
        out[url] = View(url, page.problems(), facts["title"], facts["header"], facts["nav"], facts["links"],
                        set(facts["ids"]))
    return out


# --- the tests ----------------------------------------------------------------------------------------

def test_every_page_is_there(site: Site, views: dict[str, View]) -> None:
    # Every page of the nav (sitemap.xml, written for site_url) is among the pages opened.
    sitemap = (site.root / "sitemap.xml").read_text()
    published = site_url()
    locs = [loc.split("</loc>")[0] for loc in sitemap.split("<loc>")[1:]]
    assert len(locs) > 10, sitemap[:500]
    missing = [loc for loc in locs if loc.replace(published, site.base, 1) not in views]
    assert missing == []
    assert site.base + "404.html" in views


def test_every_page_renders_without_errors(views: dict[str, View]) -> None:
    broken = {url: v.problems for url, v in views.items() if v.problems}
    assert broken == {}
    untitled = [url for url, v in views.items() if not v.title]
    assert untitled == [], "pages without an h1 in their article"
    bare = [url for url, v in views.items() if not (v.header and v.nav)]
    assert bare == [], "pages without the Material header or navigation"


def test_every_internal_link_resolves(site: Site, views: dict[str, View]) -> None:
    origin = "{0.scheme}://{0.netloc}".format(urlsplit(site.base))
    statuses: dict[str, int] = {}
    broken = []
    checked = 0
    for url, view in views.items():
        for link in view.links:
            if not link.startswith(origin + "/"):
                continue
            checked += 1
            target = page_of(link)
            fragment = unquote(link.split("#", 1)[1]) if "#" in link else ""
            if target in views:
                if fragment and fragment not in views[target].ids:
                    broken.append(f"{url}: {link} (no element with id {fragment!r} on {target})")
                continue
            if target not in statuses:
                statuses[target] = http_status(target)
            if statuses[target] != 200:
                broken.append(f"{url}: {link} (HTTP {statuses[target]})")
            elif fragment:
                broken.append(f"{url}: {link} (a fragment into {target}, which is not a page)")
    assert broken == []
    assert checked > 10 * len(views)  # the navigation alone links every page from every page


def test_every_alerts_runbook_url_opens_its_runbook(site: Site, browser: Chromium, tmp_path: Path) -> None:
    config = tmp_path / "tracejudge.yaml"
    config.write_text(yaml.safe_dump({"alerts": {"runbook_base_url": site.base + "runbooks/"}}))
    result = subprocess.run([str(BIN / "tracejudge"), "alerts", "render", "--config", str(config)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    rules = [rule for group in yaml.safe_load(result.stdout)["groups"] for rule in group["rules"]]
    alerts = {rule["alert"]: rule["annotations"]["runbook_url"] for rule in rules if "alert" in rule}
    assert len(alerts) >= 10, sorted(alerts)
    wrong = {}
    for name, url in alerts.items():
        page = browser.navigate(url)
        facts = browser.evaluate(PAGE_FACTS)
        fragment = unquote(url.split("#", 1)[1]) if "#" in url else ""
        if page.problems() or facts["title"] != name or (fragment and fragment not in facts["ids"]):
            wrong[name] = f"{url}: h1 {facts['title']!r}, problems {page.problems()}"
    assert wrong == {}


# A page with one of each thing the browser must report.
FAULTY_PAGE = """<!doctype html><title>faulty</title><h1 id="here">faulty</h1>
<script>console.error("logged an error");</script>
<script>fetch("missing.json"); fetch("http://example.invalid/elsewhere").catch(() => {});</script>
<script>throw new Error("thrown on purpose");</script>
"""


def test_the_browser_reports_what_goes_wrong(browser: Chromium, tmp_path: Path) -> None:
    # The checks above are only as good as what the browser reports: one of each, on a page of its own.
    (tmp_path / "index.html").write_text(FAULTY_PAGE)
    server = serve(tmp_path, "/")
    try:
        page = browser.navigate(f"http://127.0.0.1:{server.server_address[1]}/")

        def reported() -> bool:
            browser.evaluate("0")  # reads the events that came meanwhile
            return (any("thrown on purpose" in e for e in page.exceptions)
                    and any("logged an error" in e for e in page.console_errors)
                    and any("missing.json: HTTP 404" in e for e in page.failed_requests)
                    and page.foreign_requests == ["http://example.invalid/elsewhere"])

        wait_until(reported, 30, message=lambda: f"all four reported: {page.problems()}")
        assert browser.evaluate("document.querySelector('h1').id") == "here"
    finally:
        server.shutdown()
        server.server_close()


def mirror_repository(tmp_path: Path) -> Path:
    """The repository with docs/ copied (without its built site) and everything else linked, so the
    copy builds as the original does (hooks and snippets read the repository root)."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name != "docs":
            (root / entry.name).symlink_to(entry)
    shutil.copytree(DOCS, root / "docs", ignore=shutil.ignore_patterns("site", "__pycache__"))
    return root


def test_a_warning_fails_the_build(broken_build: Build) -> None:
    status, output = broken_build.result()
    assert status != 0, output
    assert "Aborted with" in output and "in strict mode" in output, output
    warnings = [line for line in output.splitlines() if line.startswith("WARNING")]
    assert any("development.md" in w and "no-such-page.md" in w for w in warnings), output
    assert any("development.md" in w and "no-such-anchor" in w for w in warnings), output
