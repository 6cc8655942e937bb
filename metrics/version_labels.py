"""The `version` label of the judge verdict series: bounded per app, the most recent releases kept.

Releases are a dimension (`tracejudge_judge_verdicts_total{version}`, the `ReleaseRegressed` alert),
but an app ships a new version every few days for as long as the process runs, so a first-come cap
(what bounds the `app` label, `app_labels.AppLabelLimiter`) would freeze on the first releases.
`VersionLabelLimiter` keeps, per app label, the `max_versions` most recently first seen: a new version
is admitted as the app's newest and the oldest admitted one is retired (its series are removed
through the `retire` callbacks, so memory and series stay bounded). A record of a retired version is
exported as `other`, and `tracejudge_version_label_overflow_total` counts it. Records stating no
version get `""`, which Prometheus reads as no label at all. When a version was first seen is
published per app (`tracejudge_app_version_first_seen_timestamp_seconds`) so the rules can name the
current release (the newest) and the previous one.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from tracejudge.metrics.app_labels import label_text

__all__ = ["NO_VERSION", "OTHER_VERSION", "RETIRED_MEMORY", "VERSION_VALUE_MAX", "VersionLabelLimiter",
           "default_version_label"]

NO_VERSION = ""
OTHER_VERSION = "other"
VERSION_VALUE_MAX = 100
# Retired versions remembered per app (so a straggler of an old release maps to `other` instead of
# being admitted as the newest release); past it the oldest is forgotten.
RETIRED_MEMORY = 1000


def default_version_label(app: str, version: str | None) -> str:
    """The version as its label, uncapped (`""` when the record states none)."""
    del app
    return label_text(version[:VERSION_VALUE_MAX]) if version else NO_VERSION


class _App:
    __slots__ = ("admitted", "retired")

    def __init__(self) -> None:
        self.admitted: OrderedDict[str, float] = OrderedDict()  # version -> first seen, oldest first
        self.retired: OrderedDict[str, None] = OrderedDict()


class VersionLabelLimiter:
    """Maps (app label, record version) to a version label; see the module docstring.

    `first_seen` (a gauge labelled app, version) holds each admitted version's first-seen Unix time;
    `retire` callbacks get (app, version) when a version is retired, to remove its series.
    """

    def __init__(self, max_versions: int, overflow: Counter, first_seen: Gauge | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if max_versions < 1:
            raise ValueError("max_versions must be >= 1")
        self.max_versions = max_versions
        self._overflow = overflow
        self._first_seen = first_seen
        self._clock = clock
        self._apps: dict[str, _App] = {}
        self._retire: list[Callable[[str, str], None]] = []
        self._lock = threading.Lock()

    def on_retire(self, callback: Callable[[str, str], None]) -> None:
        """Call `callback(app, version)` when a version is retired (to remove its series)."""
        self._retire.append(callback)

    def __call__(self, app: str, version: str | None) -> str:
        if not version:
            return NO_VERSION
        if len(version) > VERSION_VALUE_MAX or not version.isascii():
            version = label_text(version[:VERSION_VALUE_MAX])
        state = self._apps.get(app)
        if state is not None and version in state.admitted:
            return version
        if version == OTHER_VERSION:  # stated as such: not a release the rules could compare
            return OTHER_VERSION
        with self._lock:
            state = self._apps.get(app)
            if state is None:
                state = self._apps[app] = _App()
            if version in state.admitted:
                return version
            too_old = version in state.retired
            retired = [] if too_old else self._admit(app, state, version)
        if too_old:
            self._overflow.inc()
            return OTHER_VERSION
        for old in retired:
            for callback in self._retire:
                callback(app, old)
        return version

    def _admit(self, app: str, state: _App, version: str) -> list[str]:
        """Admit `version` as the app's newest; returns the versions it retired (under the lock)."""
        now = self._clock()
        state.admitted[version] = now
        if self._first_seen is not None:
            self._first_seen.labels(app, version).set(now)
        retired = []
        while len(state.admitted) > self.max_versions:
            old, _ = state.admitted.popitem(last=False)
            state.retired[old] = None
            if len(state.retired) > RETIRED_MEMORY:
                state.retired.popitem(last=False)
            if self._first_seen is not None:
                self._first_seen.remove(app, old)
            retired.append(old)
        return retired

    def admitted(self, app: str) -> list[str]:
        """The app's admitted versions, oldest first (the last is the current release)."""
        state = self._apps.get(app)
        return list(state.admitted) if state is not None else []
