"""Regenerate the trace fixture of an instrumented app that does not install beside the test extra.

Some agent frameworks pin versions of shared packages (opentelemetry, openai, pydantic, httpx, …)
that conflict with each other or with the test extra, so they cannot all run live in the suite. For
those, the same app module runs once in a virtual environment of its own, made from a pinned
requirements file, and its output is checked in:

    python tests/support/instrumented/generate.py APP            # one app
    python tests/support/instrumented/generate.py --all          # every app with a requirements file

reads  tests/fixtures/instrumented/APP/requirements.txt
writes tests/fixtures/instrumented/APP/traces.json

The environment lives in a temporary directory (or `--venv DIR`, kept for the next run). Nothing
leaves the machine but the package installs: the app talks to the loopback OpenAI stub. The tests
(`tests/test_instrumented_apps.py`) run the same assertions on these fixtures as on the live apps.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE.parents[1] / "fixtures" / "instrumented"


def generate(app: str, venv: pathlib.Path | None) -> pathlib.Path:
    requirements = FIXTURES / app / "requirements.txt"
    if not requirements.is_file():
        raise SystemExit(f"{requirements} does not exist: {app} is not a fixture app")
    with tempfile.TemporaryDirectory(prefix=f"tj-{app}-") as tmp:
        env_dir = venv or pathlib.Path(tmp) / "venv"
        python = env_dir / "bin" / "python"
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(requirements)],
                       check=True)
        out = FIXTURES / app / "traces.json"
        subprocess.run([str(python), str(HERE / "harness.py"), app, str(out)], check=True)
    print(f"wrote {out}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("apps", nargs="*", help="app module names (apps/<name>.py)")
    parser.add_argument("--all", action="store_true", help="every app with a requirements file")
    parser.add_argument("--venv", type=pathlib.Path, help="reuse this virtual environment")
    args = parser.parse_args()
    apps = sorted(p.parent.name for p in FIXTURES.glob("*/requirements.txt")) if args.all else args.apps
    if not apps:
        parser.error("name an app, or --all")
    for app in apps:
        generate(app, args.venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
