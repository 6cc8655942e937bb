"""A real Arize Phoenix server for tests: `phoenix serve` with SQLite, and traces sent to it by
OpenInference instrumentation.

    with PhoenixServer(tmp_path / "phoenix") as server:      # its own server, stopped on exit
        traces = instrumented_chats(server.url, stub.base_url, ["Hi?"], project="p", session="s1")
        server.span_annotations("p", [t.root for t in traces])

The server is `arize-phoenix` from PyPI (test extra only), its SQLite database in `PHOENIX_WORKING_DIR`,
HTTP and gRPC on free 127.0.0.1 ports, telemetry off. It counts as up when `/healthz` answers 200
(bounded wait; a server that does not come up fails with the tail of its log) and is stopped with
SIGTERM to its process group, then SIGKILL.

`instrumented_chats` is an app as users trace it: an agent span around an OpenAI chat call (the real
`openai` client against the loopback OpenAI-compatible stub), instrumented by
`openinference-instrumentation-openai`, exported by the OpenTelemetry SDK's OTLP/HTTP exporter to
Phoenix's `/v1/traces`, within OpenInference's `using_session` so Phoenix groups the turns in a session.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from support.kafka import wait_until
from support.mlflow_server import free_port

PHOENIX_BIN = str(Path(sys.executable).with_name("phoenix"))
START_TIMEOUT = 90.0


class PhoenixServer:
    """`phoenix serve` on free loopback ports, SQLite in `workdir`; `stop()`/`start()` keep both."""

    def __init__(self, workdir: Path | str | None = None) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="phoenix-server-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "server.log"
        self._process: subprocess.Popen[bytes] | None = None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> PhoenixServer:
        if self._process is not None and self._process.poll() is None:
            return self
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PHOENIX_", "OTEL_"))}
        env.update({"PHOENIX_WORKING_DIR": str(self.workdir), "PHOENIX_HOST": "127.0.0.1",
                    "PHOENIX_PORT": str(self.port), "PHOENIX_GRPC_PORT": str(self.grpc_port),
                    "PHOENIX_TELEMETRY_ENABLED": "false", "DO_NOT_TRACK": "true"})
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen([PHOENIX_BIN, "serve"], stdout=log, stderr=subprocess.STDOUT,
                                             cwd=self.workdir, env=env, start_new_session=True)
        try:
            wait_until(self._ready, START_TIMEOUT, interval=0.2,
                       message=lambda: f"phoenix on {self.url} to answer /healthz")
        except AssertionError as exc:
            self.stop()
            raise AssertionError(f"{exc}\n--- {self.log_path} ---\n{self.log_tail()}") from None
        return self

    def _ready(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            raise AssertionError(f"phoenix exited with {self._process.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        proc, self._process = self._process, None
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PhoenixServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- REST helpers (what the tests assert against) ---------------------------------------------

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", params=params, timeout=30)

    def spans(self, project: str) -> list[dict[str, Any]]:
        r = self.get(f"/v1/projects/{project}/spans", limit=1000)
        if r.status_code == 404:
            return []
        r.raise_for_status()
        return list(r.json()["data"])

    def span_annotations(self, project: str, span_ids: Sequence[str]) -> list[dict[str, Any]]:
        """Every annotation (not notes) on the spans, all pages."""
        r = self.get(f"/v1/projects/{project}/span_annotations", span_ids=list(span_ids), limit=10000)
        if r.status_code == 404:
            return []
        r.raise_for_status()
        return list(r.json()["data"])

    def session_annotations(self, project: str, session_ids: Sequence[str]) -> list[dict[str, Any]]:
        r = self.get(f"/v1/projects/{project}/session_annotations", session_ids=list(session_ids),
                     limit=10000)
        if r.status_code == 404:
            return []
        r.raise_for_status()
        return list(r.json()["data"])


@dataclass(frozen=True)
class Chat:
    """One traced turn: its trace, its root (agent) span and its LLM span, hex as Phoenix stores them."""

    trace_id: str
    root: str
    llm: str


def instrumented_chats(phoenix_url: str, openai_url: str, questions: Sequence[str], *, project: str,
                       session: str | None = None) -> list[Chat]:
    """Run one instrumented turn per question and wait until Phoenix has every span of them."""
    from openai import OpenAI
    from openinference.instrumentation import using_session
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from openinference.semconv.resource import ResourceAttributes
    from openinference.semconv.trace import SpanAttributes
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({ResourceAttributes.PROJECT_NAME: project}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{phoenix_url}/v1/traces")))
    tracer = provider.get_tracer("tracejudge-tests")
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    chats: list[Chat] = []
    try:
        client = OpenAI(base_url=openai_url, api_key="sk-test", max_retries=0)
        for question in questions:
            with using_session(session) if session else _nothing(), \
                    tracer.start_as_current_span("agent") as root:
                root.set_attribute(SpanAttributes.OPENINFERENCE_SPAN_KIND, "AGENT")
                root.set_attribute(SpanAttributes.INPUT_VALUE, question)
                client.chat.completions.create(model="gpt-4o-mini",
                                               messages=[{"role": "user", "content": question}])
                ctx = root.get_span_context()
                chats.append(Chat(f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", ""))
        provider.force_flush()
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    server = PhoenixServer.__new__(PhoenixServer)
    server.url = phoenix_url
    wanted = {c.trace_id for c in chats}

    def stored() -> list[dict[str, Any]] | None:
        spans = [s for s in server.spans(project) if s["context"]["trace_id"] in wanted]
        return spans if len(spans) >= 2 * len(wanted) else None

    spans = wait_until(stored, 60, message=lambda: f"{len(wanted)} traces in Phoenix")
    llm = {s["context"]["trace_id"]: s["context"]["span_id"] for s in spans if s.get("parent_id")}
    return [Chat(c.trace_id, c.root, llm[c.trace_id]) for c in chats]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
