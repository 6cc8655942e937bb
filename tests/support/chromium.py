"""A headless Chromium driven over the Chrome DevTools Protocol, for tests that open pages in a real
browser (tests/test_docs_site.py). No Selenium or Playwright: the browser is Debian's `chromium`
(installed by `make test`, tests/support/ensure_system_packages.sh; `CHROMIUM=/path/to/chrome` picks
another Chrome or Chromium), and the protocol is JSON over one WebSocket (`websockets`).

    with Chromium() as browser:
        page = browser.navigate("http://127.0.0.1:8000/")   # waits for the load event
        page.problems()                                      # exceptions, console errors, failed requests
        browser.evaluate("document.title")                   # a JSON-able value

One browser with one tab; every navigation collects what went wrong on that page: exceptions thrown
(`Runtime.exceptionThrown`), errors logged by the page (`console.error` and failed `console.assert`,
`Runtime.consoleAPICalled`) and by the browser (`Log.entryAdded`, level error), requests that
failed (`Network.loadingFailed`, not counting those cancelled by leaving the page) or were answered
with a status >= 400, and requests to any host other than loopback. The browser runs with a profile
in a temporary directory, on a DevTools port it picks itself (read from `DevToolsActivePort`), and
is killed and its directory removed on close.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from websockets.sync.client import ClientConnection, connect

from .kafka import wait_until

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
FLAGS = [
    "--headless", "--disable-gpu", "--disable-quic", "--no-first-run", "--no-default-browser-check",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--no-proxy-server", "--remote-debugging-port=0",
]


class ChromiumError(RuntimeError):
    pass


def executable() -> str:
    """The browser to run: `$CHROMIUM`, else `chromium` on PATH (Debian's package)."""
    chosen = os.environ.get("CHROMIUM") or shutil.which("chromium")
    if not chosen:
        raise ChromiumError("no `chromium` on PATH: `make test` installs Debian's chromium package "
                            "(tests/support/ensure_system_packages.sh); elsewhere set CHROMIUM to a "
                            "Chrome or Chromium binary")
    return chosen


@dataclass
class Page:
    """What one navigation brought: the URL asked for and everything that went wrong loading it."""

    url: str
    exceptions: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    foreign_requests: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        return ([f"exception: {e}" for e in self.exceptions]
                + [f"console error: {e}" for e in self.console_errors]
                + [f"failed request: {e}" for e in self.failed_requests]
                + [f"request off loopback: {e}" for e in self.foreign_requests])


class Chromium:
    """One headless browser, one tab (see the module docstring). Close it (or use `with`)."""

    def __init__(self, *, start_timeout: float = 30.0, command_timeout: float = 30.0) -> None:
        self.command_timeout = command_timeout
        self.profile = Path(tempfile.mkdtemp(prefix="tracejudge-chromium-"))
        self.log = self.profile / "chromium.log"
        self._ids = itertools.count(1)
        self._requests: dict[str, str] = {}  # requestId: URL, to name the ones that fail
        self._ws: ClientConnection | None = None
        self._session = ""
        self.page = Page("about:blank")
        flags = [*FLAGS, f"--user-data-dir={self.profile / 'profile'}"]
        if os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        try:
            with self.log.open("wb") as log:
                self._proc = subprocess.Popen([executable(), *flags, "about:blank"], stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            port_file = self.profile / "profile" / "DevToolsActivePort"
            lines = wait_until(lambda: self._port_lines(port_file), start_timeout,
                               message=lambda: f"Chromium's DevToolsActivePort; its log:\n{self._log_tail()}")
            self._ws = connect(f"ws://127.0.0.1:{lines[0]}{lines[1]}", proxy=None, max_size=None,
                               open_timeout=start_timeout, compression=None)
            target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
            self._session = attached["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.send(f"{domain}.enable", session=True)
        except BaseException:
            self.close()
            raise

    def _port_lines(self, port_file: Path) -> list[str] | None:
        if self._proc.poll() is not None:
            raise ChromiumError(f"Chromium exited ({self._proc.returncode}):\n{self._log_tail()}")
        try:
            lines = port_file.read_text().split()
        except FileNotFoundError:
            return None
        return lines if len(lines) == 2 else None  # written, not half-written

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except FileNotFoundError:
            return ""

    # --- the protocol -----------------------------------------------------------------------------

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: bool = False,
             timeout: float | None = None) -> dict[str, Any]:
        """Send one command and return its result; events read meanwhile go to the current page."""
        assert self._ws is not None
        ident = next(self._ids)
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        self._ws.send(json.dumps(message))
        reply = self._read_until(lambda m: m.get("id") == ident, timeout or self.command_timeout, method)
        if "error" in reply:
            raise ChromiumError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def _read_until(self, done: Any, timeout: float, what: str) -> dict[str, Any]:
        assert self._ws is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChromiumError(f"no answer to {what} within {timeout:g}s")
            try:
                message = json.loads(self._ws.recv(timeout=left))
            except TimeoutError:
                continue  # the deadline check above ends it
            if done(message):
                return message
            if "method" in message:
                self._record(message)

    def _record(self, event: dict[str, Any]) -> None:
        method, params = event["method"], event.get("params", {})
        page = self.page
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            page.exceptions.append(f"{text} ({details.get('url', '')}:{details.get('lineNumber', '')})")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = params.get("args", [])
            page.console_errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            page.console_errors.append(f"{entry.get('text', '')} ({entry.get('url', '')})")
        elif method == "Network.requestWillBeSent":
            url = params.get("request", {}).get("url", "")
            self._requests[params.get("requestId", "")] = url
            parts = urlsplit(url)
            if parts.scheme in ("http", "https", "ws", "wss") and parts.hostname not in LOOPBACK:
                page.foreign_requests.append(url)
        elif method == "Network.responseReceived":
            response = params.get("response", {})
            if response.get("status", 0) >= 400:
                page.failed_requests.append(f"{response.get('url')}: HTTP {response.get('status')}")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            url = self._requests.get(params.get("requestId", ""), params.get("requestId"))
            page.failed_requests.append(f"{url}: {params.get('errorText')}")

    # --- what the tests use -----------------------------------------------------------------------

    def navigate(self, url: str, *, timeout: float | None = None) -> Page:
        """Open `url` in the tab and wait for its load event (at most `timeout` seconds); returns the
        page's record of problems, which keeps filling until the next navigation."""
        timeout = timeout or self.command_timeout
        self.page = Page(url)
        self._requests.clear()
        result = self.send("Page.navigate", {"url": url}, session=True, timeout=timeout)
        if result.get("errorText"):
            self.page.failed_requests.append(f"{url}: {result['errorText']}")
            return self.page
        if result.get("loaderId"):  # a new document (a fragment on the same page loads nothing)
            self._read_until(lambda m: m.get("method") == "Page.loadEventFired"
                             and m.get("sessionId") == self._session, timeout, f"the load event of {url}")
        return self.page

    def evaluate(self, expression: str, *, timeout: float | None = None) -> Any:
        """The value of a JavaScript expression in the page (awaited if a promise), as JSON gives it."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session=True, timeout=timeout)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise ChromiumError(f"{expression!r} threw: "
                                f"{details.get('exception', {}).get('description') or details.get('text')}")
        return result.get("result", {}).get("value")

    def close(self) -> None:
        """Kill the browser (its whole process group) and remove its profile directory."""
        if self._ws is not None:
            with contextlib.suppress(Exception):  # the browser is killed next anyway
                self._ws.close()
            self._ws = None
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
