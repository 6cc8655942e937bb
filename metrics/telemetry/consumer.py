"""The consumer's own series, the same for every stage on the runtime (`tracejudge run`, each
`tracejudge sink`): commits, rebalances, lag, in-flight records, back-pressure. `PrometheusExporter`
(the evaluation stage's families) extends it; a sink's `SinkMetrics` too."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["ConsumerMetrics"]


class ConsumerMetrics:
    """The runtime's series on `registry`, named as `tracejudge run` names them (the metrics reference,
    docs/pages/reference/metrics.md). `partition_lag=False` leaves `tracejudge_consumer_lag_records`
    out: a stage that reports its lag otherwise (a sink: `tracejudge_sink_lag_records`) overrides
    `set_lag`."""

    def __init__(self, registry: CollectorRegistry, *, partition_lag: bool = True) -> None:
        r = registry
        self.commits = Counter("tracejudge_commits", "Successful offset commits.", registry=r)
        self.commit_failures = Counter("tracejudge_commit_failures", "Offset commits that failed (the "
                                       "records are re-delivered unless a later commit succeeds).",
                                       registry=r)
        self.consumer_lag = Gauge("tracejudge_consumer_lag_records", "Records between the consumer's "
                                  "position and the partition high watermark.", ["topic", "partition"],
                                  registry=r) if partition_lag else None
        self.assigned_partitions = Gauge("tracejudge_assigned_partitions", "Partitions assigned to this "
                                         "consumer.", registry=r)
        self.rebalances = Counter("tracejudge_rebalances", "Partition assignment changes by event "
                                  "(assigned, revoked, lost).", ["event"], registry=r)
        self.revoked_unfinished = Counter("tracejudge_revoked_unfinished_records", "Records still in "
                                          "flight after the grace period when their partition was "
                                          "revoked or the consumer stopped; they are re-delivered.",
                                          registry=r)
        self.backpressure_pauses = Counter("tracejudge_backpressure_pauses", "Times fetching paused "
                                           "because the in-flight cap was reached.", registry=r)
        self.backpressure_seconds = Counter("tracejudge_backpressure_seconds", "Time spent with "
                                            "fetching paused by the in-flight cap.", registry=r)
        self.in_flight = Gauge("tracejudge_in_flight_records", "Records fetched and not yet fully "
                               "exported.", registry=r)

    def set_lag(self, topic: str, partition: int, lag: int) -> None:
        if self.consumer_lag is not None:
            self.consumer_lag.labels(topic, str(partition)).set(lag)

    def remove_lag(self, topic: str, partition: int) -> None:
        if self.consumer_lag is not None:
            with contextlib.suppress(KeyError):
                self.consumer_lag.remove(topic, str(partition))
