"""The `app` label of every Prometheus family: bounded, because a record names its app.

`AppLabelLimiter` admits at most `max_apps` distinct values (the stream's cap; the rest become `other`
and an overflow counter counts them); `default_app_label` is the uncapped form for runners without a
cap. Below the judges and the telemetry (`tracejudge.metrics.judges.series`,
`tracejudge.metrics.telemetry.evaluation`, `.sessions`, `.trust`), which all label by app.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter

__all__ = ["APP_VALUE_MAX", "OTHER_APP", "UNKNOWN_APP", "AppLabelLimiter", "default_app_label", "label_text"]

OTHER_APP = "other"
UNKNOWN_APP = "unknown"
APP_VALUE_MAX = 100


def label_text(text: str) -> str:
    """`text` as UTF-8 can write it. Records from custom format handlers may hold a lone surrogate
    (the built-in formats replace those): one in a label would fail every scrape from then on."""
    if text.isascii():
        return text
    return text.encode("utf-8", "replace").decode("utf-8")


def default_app_label(app: str | None) -> str:
    """The app as its label, uncapped (`unknown` when the record names none)."""
    return app or UNKNOWN_APP


class AppLabelLimiter:
    """Maps a record's `app` to a label value, admitting at most `max_apps` distinct values.

    A producer that puts a request id in the app field would otherwise create one series per request;
    past the cap every new value becomes `other` and `tracejudge_app_label_overflow_total` counts it.
    Records without an app get `unknown`. First come, first admitted; nothing is ever evicted, so a
    series never changes meaning while the process lives.
    """

    def __init__(self, max_apps: int, overflow: Counter) -> None:
        if max_apps < 1:
            raise ValueError("max_apps must be >= 1")
        self.max_apps = max_apps
        self._overflow = overflow
        self._admitted: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, app: str | None) -> str:
        if not app:
            return UNKNOWN_APP
        if app in self._admitted:
            return app
        if len(app) > APP_VALUE_MAX or not app.isascii():
            app = label_text(app[:APP_VALUE_MAX])
            if app in self._admitted:
                return app
        with self._lock:
            if app in self._admitted:
                return app
            if len(self._admitted) < self.max_apps:
                self._admitted.add(app)
                return app
        self._overflow.inc()
        return OTHER_APP

    @property
    def admitted(self) -> frozenset[str]:
        return frozenset(self._admitted)
