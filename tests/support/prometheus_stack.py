"""Real Prometheus and Alertmanager for tests: subprocesses on loopback, plus a webhook receiver.

    with WebhookReceiver() as hook, \\
         AlertmanagerServer(alertmanager_config(hook.url), tmp_path / "am") as am, \\
         PrometheusServer(tmp_path / "prom", targets=[metrics_address], rule_files=[rules],
                          alertmanager=am.address) as prom:
        wait_until(lambda: hook.alerts(alertname="GroundednessDropped"), 60, "the alert reaches the webhook")
        prom.query("up")

Both servers are the Debian packages' binaries (`prometheus`, `prometheus-alertmanager`), listen on a
free 127.0.0.1 port, keep their data in a temporary directory, and are stopped (SIGTERM, then SIGKILL)
on exit. Prometheus runs with exemplar storage on and a 1 s scrape and evaluation interval. A server
that does not come up fails with the tail of its log.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from support.deploy_files import ALERTMANAGER

T = TypeVar("T")

PROMETHEUS_BIN = "prometheus"
ALERTMANAGER_BIN = "prometheus-alertmanager"
START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GiveUp(Exception):
    """Raised by a `wait_until` check when waiting longer cannot help (the process died)."""


def wait_until(check: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Call `check` until it returns something truthy (returned) or `timeout` seconds pass (AssertionError).

    Exceptions from `check` count as "not yet" (the last one is reported if time runs out), except
    `GiveUp`, which ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    pause = threading.Event()  # never set: its wait() is the poll interval
    while True:
        try:
            value = check()
            if value:
                return value
        except GiveUp:
            raise
        except Exception as exc:  # the server may not be up yet
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        pause.wait(interval)


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} is not installed (apt-get install prometheus prometheus-alertmanager; "
                             ".ci/run does it)")
    return path


# --- webhook receiver ---------------------------------------------------------------------------------

class WebhookReceiver:
    """An HTTP server on 127.0.0.1 that keeps every JSON body POSTed to it (Alertmanager's webhook)."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.payloads.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/alertmanager"

    def alerts(self, *, alertname: str | None = None, status: str | None = "firing") -> list[dict[str, Any]]:
        """Alerts received so far (each payload's `alerts[]`), optionally filtered."""
        with self._lock:
            received = [a for p in self.payloads for a in p.get("alerts", [])]
        return [a for a in received
                if (alertname is None or a["labels"].get("alertname") == alertname)
                and (status is None or a["status"] == status)]

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


# --- the servers --------------------------------------------------------------------------------------

class _Server:
    """A subprocess with a log file, a base URL and a readiness endpoint."""

    name = "server"

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.log_path = self.workdir / f"{self.name}.log"
        self.http = httpx.Client(base_url=self.url, timeout=5.0)
        self._process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                             cwd=self.workdir)
        try:
            wait_until(self._ready, START_TIMEOUT, f"{self.name} on {self.address} to be ready")
        except (AssertionError, GiveUp) as exc:
            self.stop()
            raise AssertionError(f"{exc}\n--- {self.log_path} ---\n{self.log_tail()}") from None

    def _ready(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            raise GiveUp(f"{self.name} exited with {self._process.returncode}")
        return self.http.get("/-/ready").status_code == 200

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        self.http.close()

    def __enter__(self: T) -> T:
        self.start()  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PrometheusServer(_Server):
    """`prometheus` scraping `targets` (host:port) every second, with rule files and an Alertmanager."""

    name = "prometheus"

    def __init__(self, workdir: Path, *, targets: Sequence[str], rule_files: Sequence[Path] = (),
                 alertmanager: str | None = None, scrape_interval: str = "1s",
                 evaluation_interval: str = "1s", job: str = "tracejudge") -> None:
        super().__init__(workdir)
        config: dict[str, Any] = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval,
                       "scrape_timeout": scrape_interval},
            "rule_files": [str(Path(p).resolve()) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}],
        }
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def command(self) -> list[str]:
        return [binary(PROMETHEUS_BIN),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address={self.address}",
                # Alerts link back here (generatorURL), not to the machine's hostname.
                f"--web.external-url={self.url}/",
                "--enable-feature=exemplar-storage",
                # Alerts go out at once and are re-sent often, so a test sees them within seconds.
                "--rules.alert.resend-delay=1s"]

    def api(self, path: str, **params: Any) -> Any:
        response = self.http.get(f"/api/v1/{path}", params=params)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (`[{"metric": {...}, "value": [t, "v"]}, ...]`)."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def query_exemplars(self, expr: str, seconds: float = 300) -> list[dict[str, Any]]:
        now = time.time()
        return self.api("query_exemplars", query=expr, start=now - seconds, end=now)

    def targets_up(self) -> bool:
        active = self.api("targets")["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def firing(self, alertname: str) -> list[dict[str, Any]]:
        return [a for a in self.api("alerts")["alerts"]
                if a["labels"].get("alertname") == alertname and a["state"] == "firing"]


class AlertmanagerServer(_Server):
    """`prometheus-alertmanager` with the given config (a mapping), clustering off."""

    name = "alertmanager"

    def __init__(self, config: Mapping[str, Any], workdir: Path) -> None:
        super().__init__(workdir)
        self.config_path = self.workdir / "alertmanager.yml"
        self.config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False))

    def command(self) -> list[str]:
        return [binary(ALERTMANAGER_BIN),
                f"--config.file={self.config_path}",
                f"--storage.path={self.workdir / 'data'}",
                f"--web.listen-address={self.address}",
                "--cluster.listen-address="]

    def alerts(self) -> list[dict[str, Any]]:
        return self.http.get("/api/v2/alerts").json()


def alertmanager_config(webhook_url: str, source: Path = ALERTMANAGER, *, group_wait: str = "1s",
                        group_interval: str = "1s", repeat_interval: str = "1m") -> dict[str, Any]:
    """The shipped Alertmanager config with the webhook pointed at `webhook_url` and short timers."""
    config = yaml.safe_load(Path(source).read_text())
    config["route"].update(group_wait=group_wait, group_interval=group_interval,
                           repeat_interval=repeat_interval)
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = webhook_url
    return config
