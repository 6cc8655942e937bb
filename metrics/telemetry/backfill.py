"""The Prometheus series of `tracejudge backfill` (`consumer/stages/backfill.py`): the run's progress,
`tracejudge_backfill_*`, read from its tally at each scrape and served on `--metrics-port` by the command
(`consumer/commands/backfill.py`). Never the judges' own series, which stay the live stream's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["BackfillProgress", "ProgressSnapshot"]


@dataclass(frozen=True)
class ProgressSnapshot:
    """The run's tally at one moment, taken under its lock."""

    read: int = 0
    published: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    partitions_done: int = 0
    partitions: int = 0


class BackfillProgress(Collector):
    """The run's tally as Prometheus series, read at each scrape: what a dashboard or a Job's scrape
    needs to follow a long backfill."""

    def __init__(self, snapshot: Callable[[], ProgressSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        t = self.snapshot()
        family = CounterMetricFamily("tracejudge_backfill_records_read", "Records of the range read.")
        family.add_metric([], t.read)
        yield family
        family = CounterMetricFamily("tracejudge_backfill_results_published",
                                     "Results published to the results topic, marked as this backfill.")
        family.add_metric([], t.published)
        yield family
        family = CounterMetricFamily("tracejudge_backfill_records_skipped",
                                     "Records read but not judged, by reason (before_range, undecodable).",
                                     labels=["reason"])
        for reason, n in sorted(t.skipped.items()):
            family.add_metric([reason], n)
        yield family
        gauge = GaugeMetricFamily("tracejudge_backfill_partitions",
                                  "Partitions of the range: reading, or done (read to the range's end).",
                                  labels=["state"])
        gauge.add_metric(["done"], t.partitions_done)
        gauge.add_metric(["reading"], t.partitions - t.partitions_done)
        yield gauge
