"""The operational HTTP endpoint: `/metrics`, `/healthz`, `/readyz`.

`/metrics` negotiates the exposition format with prometheus_client's `choose_encoder`: Prometheus
(2.x and 3.x) asks for OpenMetrics and gets the exemplars; `curl` gets the classic text format.
`/healthz` answers whether the process is alive (the poll loop turns); `/readyz` whether it does its
job (partitions assigned, broker reachable). Both answer 200 or 503 with a one-line reason.

A small threaded `http.server`: scrapes are rare and cheap, and it keeps the runner free of a web
framework. Requests are logged at DEBUG only, so scrapes do not flood the log.
"""

from __future__ import annotations

import gzip
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

__all__ = ["HealthCheck", "OperationsServer"]

log = logging.getLogger(__name__)

# () -> (ok, reason)
HealthCheck = Callable[[], tuple[bool, str]]


def _always_ok() -> tuple[bool, str]:
    return True, "ok"


class OperationsServer:
    """Serves the registry and the health checks on `host:port` from a daemon thread.

    `port=0` binds a free port; read the bound one from `.port` after `start()`.
    """

    def __init__(self, registry: CollectorRegistry, *, host: str = "0.0.0.0", port: int = 9464,
                 liveness: HealthCheck = _always_ok, readiness: HealthCheck = _always_ok) -> None:
        self.registry = registry
        self.host = host
        self._requested_port = port
        self.liveness = liveness
        self.readiness = readiness
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the server is not started")
        return int(self._httpd.server_address[1])

    def start(self) -> OperationsServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    encoder, content_type = choose_encoder(self.headers.get("Accept"))
                    body = encoder(server.registry)
                    encoding = None
                    if "gzip" in (self.headers.get("Accept-Encoding") or ""):
                        body, encoding = gzip.compress(body), "gzip"
                    self._send(200, content_type, body, encoding)
                elif path in ("/healthz", "/readyz"):
                    check = server.liveness if path == "/healthz" else server.readiness
                    try:
                        ok, reason = check()
                    except Exception as exc:  # a broken check must answer, not hang the probe
                        ok, reason = False, f"health check failed: {type(exc).__name__}: {exc}"
                    self._send(200 if ok else 503, "text/plain; charset=utf-8", (reason + "\n").encode())
                elif path == "/":
                    self._send(200, "text/plain; charset=utf-8",
                               b"tracejudge: /metrics /healthz /readyz\n")
                else:
                    self._send(404, "text/plain; charset=utf-8", b"not found\n")

            def _send(self, status: int, content_type: str, body: bytes, encoding: str | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                if encoding:
                    self.send_header("Content-Encoding", encoding)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_HEAD = do_GET

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http %s %s", self.address_string(), format % args)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._httpd = Server((self.host, self._requested_port), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="tracejudge-http", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> OperationsServer:
        return self if self._httpd is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
