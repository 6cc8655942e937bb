"""The tests' OpenAI-compatible stub (tests/support/openai_stub.py) in its own process, for the judge
benchmarks: its CPU is not the measured process's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

STUB = Path(__file__).resolve().parents[1] / "tests" / "support" / "openai_stub.py"


def start_endpoint(delay: float) -> tuple[subprocess.Popen[str], str]:
    """(the stub's process, its base URL); it answers after `delay` seconds. Raises RuntimeError when
    the stub prints no port (it failed to start)."""
    proc = subprocess.Popen([sys.executable, str(STUB), "--delay", str(delay)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line.strip().isdigit():
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the stub endpoint did not start: it printed {line!r}, not its port")
    return proc, f"http://127.0.0.1:{int(line)}/v1"


def stop_endpoint(proc: subprocess.Popen[str]) -> None:
    """Stop the stub: it ends when its standard input closes; killed if it has not within 10 s."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
