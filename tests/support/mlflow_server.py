"""A real MLflow tracking server for tests and benchmarks: `mlflow server` with a SQLite backend.

    with MlflowServer(tmp_path / "mlflow") as server:          # its own server, stopped on exit
        experiment = server.create_experiment("sink")
        ids = log_traces(server.url, experiment, ["What is MLflow?"])   # real `mlflow` tracing
        server.stop(); server.start()                           # same port, same database

    server = shared_mlflow_server()                             # one per test process (session)
    migrated_database(path)                    # an empty database at MLflow's schema, for `mlflow server`

The server is the full `mlflow` package's `mlflow server` (test extra only), on a free 127.0.0.1
port, its database and artifacts in a directory of its own, with MLflow's telemetry and job runner
off (no network, no huey consumer). It counts as up when `/health` answers 200; it is stopped with
SIGTERM to its process group (the CLI, uvicorn and its workers), then SIGKILL. A server that does not
come up fails with the tail of its log. A new server's database starts as a copy of an empty one
already migrated to MLflow's schema (`migrated_database`): MLflow's ~60 schema migrations take 5 s of
CPU and far longer on a busy machine, and they are the same every time; they run once per test run
(shared by pytest-xdist's workers through `TJTEST_SHARED_DIR`, set by tests/conftest.py).

Traces reach it two ways, as they do in production:
- `log_traces(url, experiment, questions)`: a small RAG agent traced with `@mlflow.trace`, run in a
  subprocess (MLflow's tracing state is process-global) that logs to the server through MLflow's own
  client and prints each finished trace's `Trace.to_json()` — the same bytes can go to Kafka.
- `send_otlp(url, experiment, spans)`: OpenTelemetry SDK spans, encoded by the SDK's OTLP encoder and
  POSTed to the server's `/v1/traces` (OTLP/HTTP protobuf) with `x-mlflow-experiment-id`; MLflow stores
  each trace as `tr-<32 hex>`.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

START_TIMEOUT = 90.0
MLFLOW_BIN = str(Path(sys.executable).with_name("mlflow"))
# MLflow's usage telemetry and its background job runner stay off in every process we start.
QUIET_ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
             "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def _template_dir() -> Path:
    """Where the migrated template lives: the test run's shared directory, else one for this process."""
    global _own_template_dir
    shared = os.environ.get("TJTEST_SHARED_DIR")
    if shared:
        return Path(shared)
    if _own_template_dir is None:
        _own_template_dir = tempfile.mkdtemp(prefix="mlflow-template-")
        atexit.register(shutil.rmtree, _own_template_dir, True)
    return Path(_own_template_dir)


_own_template_dir: str | None = None


def migrated_database(path: Path) -> Path:
    """Copy an empty MLflow SQLite database at the installed MLflow's latest schema to `path` (made
    once per run with `mlflow db upgrade`, under a file lock so parallel workers make it once)."""
    directory = _template_dir()
    directory.mkdir(parents=True, exist_ok=True)
    template = directory / "mlflow-template.db"
    with open(directory / "mlflow-template.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            partial = directory / "mlflow-template.db.partial"
            partial.unlink(missing_ok=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OTEL_"))}
            env.update(QUIET_ENV)
            proc = subprocess.run([MLFLOW_BIN, "db", "upgrade", f"sqlite:///{partial}"], env=env,
                                  capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode != 0:
                raise AssertionError(f"mlflow db upgrade failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            partial.rename(template)
    shutil.copyfile(template, path)
    return path


def _wait(check: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not met within {timeout:g}s: {what}")
        pause.wait(interval)


class MlflowServer:
    """`mlflow server --backend-store-uri sqlite:///<dir>/mlflow.db` on a free loopback port.

    `stop()` and `start()` may be called again: the port and the database are kept, so a restarted
    server has every trace and assessment it had (a server "down for a while")."""

    # One uvicorn worker by default: it serves the sink's concurrent requests from its thread pool, and
    # each extra worker is another process importing MLflow at every start (the tests start servers
    # often); bench/bench_writeback.py asks for MLflow's production default of 4.
    def __init__(self, workdir: Path | str | None = None, *, workers: int = 1, port: int | None = None
                 ) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mlflow-server-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.workers = workers
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "server.log"
        self._process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [MLFLOW_BIN, "server", "--backend-store-uri", f"sqlite:///{self.workdir / 'mlflow.db'}",
                "--default-artifact-root", str(self.workdir / "artifacts"),
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(self.workers)]

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> MlflowServer:
        if self.running:
            return self
        if not (self.workdir / "mlflow.db").exists():
            migrated_database(self.workdir / "mlflow.db")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OTEL_"))}
        env.update(QUIET_ENV)
        with self.log_path.open("ab") as log:
            # Its own session: stop() signals the CLI, uvicorn and the workers together, and only them.
            self._process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                             cwd=self.workdir, env=env, start_new_session=True)
        try:
            _wait(self._ready, START_TIMEOUT, f"mlflow server on {self.url} to answer /health")
        except AssertionError as exc:
            self.stop()
            raise AssertionError(f"{exc}\n--- {self.log_path} ---\n{self.log_tail()}") from None
        return self

    def _ready(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            raise AssertionError(f"mlflow server exited with {self._process.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        proc, self._process = self._process, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # uvicorn's workers leave with their parent; make sure none still holds the port.
        _wait(lambda: _port_free(self.port), 15, f"port {self.port} released")

    def close(self) -> None:
        """Stop the server and remove its directory when it made one."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> MlflowServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- REST helpers (plain HTTP: what the tests assert against) ----------------------------------

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)

    def create_experiment(self, name: str) -> str:
        with self.client() as c:
            r = c.post("/api/2.0/mlflow/experiments/create", json={"name": name})
            r.raise_for_status()
            return str(r.json()["experiment_id"])

    def trace_info(self, trace_id: str) -> dict[str, Any] | None:
        """The trace's info as the REST API returns it (with `assessments`), None when unknown."""
        with self.client() as c:
            r = c.get(f"/api/3.0/mlflow/traces/{trace_id}")
            if r.status_code == 404:
                return None
            r.raise_for_status()
            return r.json()["trace"]["trace_info"]

    def assessments(self, trace_id: str) -> list[dict[str, Any]]:
        info = self.trace_info(trace_id)
        if info is None:
            raise AssertionError(f"trace {trace_id} is not on the server")
        return list(info.get("assessments") or [])

    def log_assessment(self, trace_id: str, assessment: dict[str, Any]) -> dict[str, Any]:
        with self.client() as c:
            r = c.post(f"/api/3.0/mlflow/traces/{trace_id}/assessments",
                       json={"assessment": {"trace_id": trace_id, **assessment}})
            r.raise_for_status()
            return r.json()["assessment"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


_shared: MlflowServer | None = None
_shared_lock = threading.Lock()


def shared_mlflow_server() -> MlflowServer:
    """One server per test process, started on first use and stopped at exit (tests that stop or
    restart a server start their own)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.running:
            _shared = MlflowServer().start()
            atexit.register(_shared.close)
        return _shared


# -- traces ---------------------------------------------------------------------------------------


def log_traces(url: str, experiment_id: str, questions: Sequence[str], *, timeout: float = 180.0
               ) -> list[dict[str, Any]]:
    """Run the traced agent once per question in a subprocess that logs to `url`; returns, per
    question, `{"trace_id": "tr-…", "json": Trace.to_json(), "spans": {name: span_id}}` once the
    server has every trace."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OTEL_"))}
    env.update(QUIET_ENV)
    env.update({"MLFLOW_TRACKING_URI": url, "MLFLOW_EXPERIMENT_ID": experiment_id,
                "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING": "false"})
    proc = subprocess.run([sys.executable, __file__, "log-traces"], input=json.dumps(list(questions)),
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"tracing subprocess failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def send_otlp(url: str, experiment_id: str, spans: Iterable[Any]) -> None:
    """POST SDK spans to the server's OTLP/HTTP endpoint, protobuf, as an OTLP exporter does."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    body = encode_spans(list(spans)).SerializeToString()
    r = httpx.post(f"{url}/v1/traces", content=body, timeout=30,
                   headers={"content-type": "application/x-protobuf",
                            "x-mlflow-experiment-id": experiment_id})
    if r.status_code != 200:
        raise AssertionError(f"OTLP ingest answered {r.status_code}: {r.text[:500]}")


def _log_traces_main() -> None:
    import mlflow
    from mlflow.entities import Document, SpanType

    mlflow.set_experiment(experiment_id=os.environ["MLFLOW_EXPERIMENT_ID"])
    kb = {
        "refund": "Refunds are accepted within 30 days of purchase with a receipt.",
        "shipping": "Standard shipping takes 3 to 5 business days within the country.",
        "warranty": "The warranty covers manufacturing defects for two years.",
    }

    @mlflow.trace(span_type=SpanType.RETRIEVER)
    def retrieve(query: str) -> list[Document]:
        hits = [k for k in kb if k in query.lower()] or ["shipping"]
        return [Document(page_content=kb[k], metadata={"doc_uri": f"kb://{k}"}, id=k) for k in hits]

    @mlflow.trace(span_type=SpanType.CHAT_MODEL)
    def generate(messages: list[dict[str, str]], docs: list[Document]) -> dict[str, Any]:
        return {"choices": [{"message": {"role": "assistant", "content": docs[0].page_content}}]}

    @mlflow.trace(span_type=SpanType.AGENT)
    def agent(question: str) -> str:
        docs = retrieve(question)
        reply = generate([{"role": "user", "content": question}], docs)
        return reply["choices"][0]["message"]["content"]

    for question in json.loads(sys.stdin.read()):
        agent(question)
        trace_id = mlflow.get_last_active_trace_id()
        trace = mlflow.get_trace(trace_id)
        spans = {s.name: s.span_id for s in trace.data.spans}
        print(json.dumps({"trace_id": trace_id, "json": trace.to_json(), "spans": spans}), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["log-traces"]:
    _log_traces_main()
