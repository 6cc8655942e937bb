"""The Prometheus series of collections (`collections:` rules, `tracejudge.consumer.collecting`): rows
collected, and every trace a rule matched but did not collect, by why (the limits that thin the
collection are counted, never silent)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter

__all__ = ["DROP_REASONS", "CollectionMetrics"]

# Why a trace a rule matched was not collected: outside the rule's sample; already collected (by trace
# id); over the rule's max_per_window; no request to evaluate again; a `finding:` condition while no
# findings can be read. A row that cannot be written is never dropped: it is retried (publish_failures).
DROP_REASONS = ("sampled_out", "duplicate", "cap", "no_request", "no_findings")


class CollectionMetrics:
    """`tracejudge_collected_total{collection}`, `tracejudge_collection_dropped_total{collection,reason}`
    and `tracejudge_collection_publish_failures_total{collection}`; `collection` is a rule's name, so
    the labels are bounded by the configuration."""

    def __init__(self, registry: CollectorRegistry | None, collections: Iterable[str]) -> None:
        r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.collected = Counter("tracejudge_collected", "Traces collected, by collection: a row "
                                 "acknowledged by the collection topic's broker (a rule with a topic), else "
                                 "written to its file.", ["collection"], registry=r)
        self.dropped = Counter("tracejudge_collection_dropped", "Traces a collection rule matched but did "
                               "not collect, by collection and reason (sampled_out, duplicate, cap, "
                               "no_request, no_findings).", ["collection", "reason"],
                               registry=r)
        self.publish_failures = Counter("tracejudge_collection_publish_failures", "Failed attempts to "
                                        "write a collected row, to its topic or its file (each is retried; "
                                        "the trace's offset waits), by collection.", ["collection"],
                                        registry=r)
        for name in collections:
            self.collected.labels(name)
            self.publish_failures.labels(name)
            for reason in DROP_REASONS:
                self.dropped.labels(name, reason)
