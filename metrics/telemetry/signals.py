"""The Prometheus series of the cheap signals (`tracejudge.metrics.signals`), counted per app.

- `tracejudge_signals_total{app,signal}`: traces in which the signal was present (1.0);
- `tracejudge_signals_checked_total{app,signal}`: traces for which it could be said (0.0 or 1.0), so
  `rate(signals) / rate(signals_checked)` is the share of traces showing it, warm-up and unknowns aside;
- `tracejudge_cached_input_tokens_total{app}`: input tokens read from the prompt cache, in traces that
  state them (`tracejudge_tokens_total{direction="input"}` includes them; the ratio of the two rates is
  the token-weighted cache-hit ratio; the per-trace ratio is `tracejudge_metric_value{metric=
  "prompt_cache_hit_ratio"}`);
- the app norms' state, read at each scrape: `tracejudge_signal_state_apps`,
  `tracejudge_signal_state_answers` and `tracejudge_signal_state_dropped_total{reason}` (`app_over_cap`:
  a record whose app came past `metrics.signals.max_apps`, given no norm signal; `answer_evicted`: a
  remembered answer dropped for a newer one past `metrics.signals.answers_per_app`).

Labels are bounded: `app` by the exporter's limiter, `signal` by `SIGNALS`, `reason` by a closed set.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tracejudge.metrics.signals import ANSWER_EVICTED, APP_OVER_CAP, SIGNALS, AppNorms
from tracejudge.schemas.trace import TokenUsage

__all__ = ["SignalMetrics", "SignalStateCollector"]


# One row of counts per app: present per signal, checked per signal, then cached input tokens.
_N = len(SIGNALS)
_CACHED = 2 * _N


class SignalMetrics(Collector):
    """The signal families on `registry`, served from plain counts at each scrape; `export(app, metrics,
    tokens)` counts one result (its `app` already bounded by the exporter's limiter) under one lock: a
    prometheus_client child per signal would take a lock per increment, ten per record."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._counts: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._state: SignalStateCollector | None = None
        registry.register(self)

    def export(self, app: str, metrics: Mapping[str, Any], tokens: TokenUsage | None) -> None:
        said = list(map(metrics.get, SIGNALS))
        cached = tokens.cached_input if tokens is not None else None
        if said.count(None) == _N and not (cached is not None and cached > 0):
            return
        with self._lock:
            row = self._counts.get(app)
            if row is None:
                row = self._counts[app] = [0.0] * (_CACHED + 1)
            for i, value in enumerate(said):
                if value is not None:
                    row[_N + i] += 1
                    if value == 1.0:
                        row[i] += 1
            if cached is not None and cached > 0:
                row[_CACHED] += cached

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            rows = [(app, list(row)) for app, row in self._counts.items()]
        present = CounterMetricFamily("tracejudge_signals", "Traces showing a cheap signal (no judge), by "
                                      "app and signal: tool retry loop, oversized tool result, overlong "
                                      "answer, empty retrieval, repeated answer.", labels=["app", "signal"])
        checked = CounterMetricFamily("tracejudge_signals_checked", "Traces for which a cheap signal could "
                                      "be said (present or absent), by app and signal.",
                                      labels=["app", "signal"])
        cached = CounterMetricFamily("tracejudge_cached_input_tokens", "Input tokens read from the prompt "
                                     "cache, in traces that state them (part of the input tokens).",
                                     labels=["app"])
        for app, row in rows:
            for i, name in enumerate(SIGNALS):
                if row[_N + i]:
                    present.add_metric([app, name], row[i])
                    checked.add_metric([app, name], row[_N + i])
            if row[_CACHED]:
                cached.add_metric([app], row[_CACHED])
        yield present
        yield checked
        yield cached

    def watch(self, norms: AppNorms | None) -> None:
        """Serve the state of `norms` (the pipeline's `metrics.norms`) at each scrape; once."""
        if norms is None or self._state is not None:
            return
        self._state = SignalStateCollector(norms)
        self.registry.register(self._state)


class SignalStateCollector(Collector):
    """How much state the app norms hold and what they dropped, read at each scrape."""

    def __init__(self, norms: AppNorms) -> None:
        self.norms = norms

    def collect(self) -> Iterator[Metric]:
        norms = self.norms
        gauge = GaugeMetricFamily("tracejudge_signal_state_apps", "Apps with a norm of their own for the "
                                  "cheap signals (at most metrics.signals.max_apps).")
        gauge.add_metric([], norms.apps)
        yield gauge
        gauge = GaugeMetricFamily("tracejudge_signal_state_answers", "Recent answers remembered for the "
                                  "repeated-answer signal, over every app.")
        gauge.add_metric([], norms.answers)
        yield gauge
        family = CounterMetricFamily("tracejudge_signal_state_dropped", "Cheap-signal state not kept, by "
                                     "reason: app_over_cap (the record got no norm signal), answer_evicted.",
                                     labels=["reason"])
        dropped = dict(norms.dropped)
        for reason in (APP_OVER_CAP, ANSWER_EVICTED):
            family.add_metric([reason], dropped.get(reason, 0))
        yield family
