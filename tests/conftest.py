"""Fixtures shared across test files. Test helpers that talk to real parts live in tests/support/.

The suite runs in parallel under pytest-xdist (`make test` passes `-n 4`): every
worker is its own process with its own broker (the session-scoped `broker` below) and its own MLflow
server, and names topics, groups and ports uniquely, so tests never share a server across workers.
What is worth sharing across workers (the migrated MLflow database template) lives in one directory
per run, `TJTEST_SHARED_DIR`, made here by the controlling process and removed when the run ends.

Scheduling, for any test file, old or new, without marking anything:
- the tests of a module that has a module- or class-scoped fixture run on one worker, so an
  expensive module fixture is set up once, not once per worker; every other test goes to whichever
  worker is free (`ModuleFixtureScheduling`, in place of xdist's default `--dist load`; xdist's own
  `loadgroup` marks do not take with pytest 9, whose node ids xdist can no longer suffix);
- the longest work goes first (longest-processing-time order), so one slow test does not start last
  and leave the other workers idle: each test's last duration is kept in pytest's cache
  (`tracejudge/durations`), seeded on a fresh clone by tests/support/durations.json.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.kafka import shared_broker
from support.openai_stub import OpenAIStub

from tracejudge.consumer.demo.broker import LocalBroker

_shared_dir: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _shared_dir
    # xdist workers inherit the variable from the controller, which starts them after this hook.
    if not os.environ.get("TJTEST_SHARED_DIR") and not hasattr(config, "workerinput"):
        _shared_dir = tempfile.mkdtemp(prefix="tracejudge-tests-")
        os.environ["TJTEST_SHARED_DIR"] = _shared_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    global _shared_dir
    if _shared_dir is not None:
        shutil.rmtree(_shared_dir, ignore_errors=True)
        os.environ.pop("TJTEST_SHARED_DIR", None)
        _shared_dir = None


DURATIONS_KEY = "tracejudge/durations"
SEED_DURATIONS = Path(__file__).parent / "support" / "durations.json"
_durations: dict[str, float] = {}


def _known_durations(config: pytest.Config) -> dict[str, float]:
    known: dict[str, float] = json.loads(SEED_DURATIONS.read_text()) if SEED_DURATIONS.exists() else {}
    cache = getattr(config, "cache", None)
    if cache is not None:
        known.update(cache.get(DURATIONS_KEY, {}))
    return known


def _shared_scope(item: pytest.Item) -> str | None:
    """The module whose tests must stay on one worker: it has a module- or class-scoped fixture."""
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", None)
    if defs is None:  # another pytest: keep each module together, as `--dist loadfile` would
        return item.nodeid.split("::", 1)[0]
    for fixturedefs in defs.values():
        if any(d.scope in ("module", "class", "package") for d in fixturedefs):
            return item.nodeid.split("::", 1)[0]
    return None


def _groups_file() -> Path | None:
    shared = os.environ.get("TJTEST_SHARED_DIR")
    return Path(shared) / "xdist-module-groups.json" if shared else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # one process: keep the files' order
        return
    known = _known_durations(config)
    units: dict[str, float] = {}
    unit_of: dict[str, str] = {}
    for item in items:
        unit = _shared_scope(item) or item.nodeid
        unit_of[item.nodeid] = unit
        units[unit] = units.get(unit, 0.0) + known.get(item.nodeid, 1.0)
    # Every worker collects and must order alike: the same cache, the same stable sort.
    items.sort(key=lambda item: -units[unit_of[item.nodeid]])
    path = _groups_file()
    if path is not None:  # for the controller's scheduler; every worker writes the same list
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(sorted({u for u in unit_of.values() if "::" not in u})))
        partial.replace(path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`-n N` (xdist's default `--dist load`): schedule with `ModuleFixtureScheduling`."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        """A module with a module- or class-scoped fixture is one unit of work (one worker); any
        other test is a unit of its own. Units go out in collection order (longest first)."""

        grouped: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.grouped is None:
                path = _groups_file()
                # Without the workers' list (not written yet): whole modules, like --dist loadfile.
                if path is None or not path.exists():
                    return nodeid.split("::", 1)[0]
                self.grouped = set(json.loads(path.read_text()))
            module = nodeid.split("::", 1)[0]
            return module if module in self.grouped else nodeid

    return ModuleFixtureScheduling(config, log)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    cache = getattr(config, "cache", None)
    if cache is None or hasattr(config, "workerinput") or not _durations:
        return
    known = cache.get(DURATIONS_KEY, {})
    known.update({k: round(v, 2) for k, v in _durations.items()})
    cache.set(DURATIONS_KEY, known)


@pytest.fixture
def stub() -> Iterator[OpenAIStub]:
    """A real OpenAI-compatible HTTP server on loopback with scripted answers."""
    with OpenAIStub() as s:
        yield s


@pytest.fixture(scope="session")
def broker() -> LocalBroker:
    """One Tansu broker on a free loopback port for the whole run (topics and groups are unique per test)."""
    return shared_broker()
