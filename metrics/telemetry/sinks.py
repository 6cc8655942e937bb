"""Prometheus families of the write-back stage (`tracejudge.consumer.stages.sink`) and its sinks
(`tracejudge.consumer.sinks.mlflow`, `.otlp`).

`SinkMetrics`: the runtime's series plus the sink stage's (lag, batches, dead letters), and the verdict
outcomes counted from a sink's `WriteReport`s unless the sink registered them itself. `SinkWriteMetrics`:
those outcome series as a sink registers them itself: per verdict, written or found already written (a
redelivery), skipped for good by reason, and per batch the retries asked for by reason; the MLflow sink
also counts the earlier session feedback it deleted. Every family carries the `sink` label (its kind).

Parked results (`tracejudge.consumer.stages.parking`): records a sink deferred because it cannot write
them yet (their trace not at the backend) wait, uncommitted, to be offered again after a growing
back-off: how many wait now, how many were parked, offered again, given up on, and how many found the
parked set full (the partition was held instead).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tracejudge.metrics.telemetry.consumer import ConsumerMetrics

__all__ = ["SinkMetrics", "SinkWriteMetrics"]

_WRITES_HELP = "Verdicts a sink wrote, or found already written (a redelivered result)."
_SKIPPED_HELP = "Verdicts a sink deliberately did not write, by reason."
_RETRIES_HELP = "Batches a sink could not write and asked to be offered again, by reason."


class SinkMetrics(ConsumerMetrics):
    """The runtime's series plus the sink stage's, labelled `sink=<kind>`. The sink's own outcome
    series (`tracejudge_sink_writes_total`, `_skipped_total`, `_retries_total`) are counted here from
    its `WriteReport`s and `RetryLater`s unless the sink registered them itself (it then counts them)."""

    def __init__(self, registry: CollectorRegistry, kind: str) -> None:
        super().__init__(registry, partition_lag=False)
        r = registry
        self.kind = kind
        self._lags: dict[tuple[str, int], int] = {}
        self.lag = Gauge("tracejudge_sink_lag_records", "Results on the results topic this sink has not "
                         "written yet (fetched or not), summed over its partitions.", ["sink"],
                         registry=r).labels(kind)
        self.batches = Counter("tracejudge_sink_batches", "Batches the sink wrote (one write per partition "
                               "per checkpoint).", ["sink"], registry=r).labels(kind)
        self.dead_letters = Counter("tracejudge_sink_dead_letters", "Results-topic records that are not "
                                    "tracejudge results this sink can read, by reason.", ["sink", "reason"],
                                    registry=r)
        self.dead_letter_publish_failures = Counter(
            "tracejudge_sink_dead_letter_publish_failures", "Dead letters the producer failed to deliver "
            "(retried; the offset waits).", ["sink"], registry=r).labels(kind)
        self.writes = _counter_unless_registered(r, "tracejudge_sink_writes", _WRITES_HELP,
                                              ["sink", "outcome"])
        self.skipped = _counter_unless_registered(r, "tracejudge_sink_skipped", _SKIPPED_HELP,
                                              ["sink", "reason"])
        self.retries = _counter_unless_registered(r, "tracejudge_sink_retries", _RETRIES_HELP,
                                              ["sink", "reason"])
        if self.writes is not None:
            for outcome in ("written", "already_written"):
                self.writes.labels(kind, outcome)
        self.parked = Gauge("tracejudge_sink_parked_records", "Results waiting to be offered to the sink "
                            "again because their trace was not at the backend yet (their offsets not "
                            "committed).", ["sink"], registry=r).labels(kind)
        self.parked_records = Counter("tracejudge_sink_parked", "Results the sink deferred and the stage "
                                      "parked, to offer again after a growing back-off.", ["sink"],
                                      registry=r).labels(kind)
        self.parked_retries = Counter("tracejudge_sink_parked_retries", "Parked results offered to the sink "
                                      "again (one per result per offer).", ["sink"], registry=r).labels(kind)
        self.parked_full = Counter("tracejudge_sink_park_full", "Deferred results that found the parked set "
                                   "full (sink.max_parked_records): their partition was held instead.",
                                   ["sink"], registry=r).labels(kind)
        self.given_up = Counter("tracejudge_sink_given_up", "Results a sink gave up on after looking for "
                                "their trace until its deadline, by reason (their verdicts counted in "
                                "tracejudge_sink_skipped_total).", ["sink", "reason"], registry=r)

    def set_lag(self, topic: str, partition: int, lag: int) -> None:
        self._lags[(topic, partition)] = lag
        self.lag.set(sum(self._lags.values()))

    def remove_lag(self, topic: str, partition: int) -> None:
        self._lags.pop((topic, partition), None)
        self.lag.set(sum(self._lags.values()))

    # What `DeadLetterSink` counts.
    def count_dead_letter(self, topic: str, reason: str, routed: bool) -> None:
        self.dead_letters.labels(self.kind, reason).inc()

    def count_skipped(self, report: Any) -> None:
        """Skips the stage decided itself (no batch written); `report` is a sink's `WriteReport`."""
        if self.skipped is not None:
            for reason, n in report.skipped.items():
                self.skipped.labels(self.kind, reason).inc(n)

    def written(self, report: Any) -> None:
        """A batch written; `report` is the sink's `WriteReport`."""
        self.batches.inc()
        if self.writes is not None:
            if report.written:
                self.writes.labels(self.kind, "written").inc(report.written)
            if report.already_written:
                self.writes.labels(self.kind, "already_written").inc(report.already_written)
        if self.skipped is not None:
            for reason, n in report.skipped.items():
                self.skipped.labels(self.kind, reason).inc(n)

    def set_parked(self, n: int) -> None:
        self.parked.set(n)

    def parked_now(self, first: int, total: int, given_up: Any = ()) -> None:
        """After a write: `first` results newly parked, `total` parked now, `given_up` a Counter by reason."""
        if first:
            self.parked_records.inc(first)
        self.parked.set(total)
        for reason, n in dict(given_up).items():
            self.given_up.labels(self.kind, reason).inc(n)

    def parked_retried(self, n: int) -> None:
        self.parked_retries.inc(n)

    def park_full(self, n: int) -> None:
        self.parked_full.inc(n)

    def retried(self, reason: str) -> None:
        if self.retries is not None:
            self.retries.labels(self.kind, reason).inc()


def _counter_unless_registered(registry: CollectorRegistry, name: str, doc: str,
                               labels: list[str]) -> Counter | None:
    try:
        return Counter(name, doc, labels, registry=registry)
    except ValueError:  # "Duplicated timeseries": the sink has its own and counts it
        return None


class SinkWriteMetrics:
    """`tracejudge_sink_writes_total{sink, outcome}`, `tracejudge_sink_skipped_total{sink, reason}`,
    `tracejudge_sink_retries_total{sink, reason}` and, with `deletes`, `tracejudge_sink_deletes_total
    {sink, outcome}`; the listed label values are exported at 0 from the start."""

    def __init__(self, kind: str, registry: CollectorRegistry, *, skip_reasons: Iterable[str] = (),
                 retry_reasons: Iterable[str] = (), deletes: bool = False) -> None:
        self.kind = kind
        self.writes = Counter("tracejudge_sink_writes", _WRITES_HELP, ["sink", "outcome"],
                           registry=registry)
        self.skipped = Counter("tracejudge_sink_skipped", _SKIPPED_HELP, ["sink", "reason"],
                           registry=registry)
        self.retries = Counter("tracejudge_sink_retries", _RETRIES_HELP, ["sink", "reason"],
                           registry=registry)
        self.deletes = Counter("tracejudge_sink_deletes", "Earlier session feedback a sink deleted because "
                               "a later evaluation of the session replaced it (rejected: the server "
                               "refused).", ["sink", "outcome"], registry=registry) if deletes else None
        for outcome in ("written", "already_written"):
            self.writes.labels(kind, outcome)
        for reason in skip_reasons:
            self.skipped.labels(kind, reason)
        for reason in retry_reasons:
            self.retries.labels(kind, reason)
        if self.deletes is not None:
            for outcome in ("deleted", "rejected"):
                self.deletes.labels(kind, outcome)
