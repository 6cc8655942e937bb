"""Prometheus families for trace assembly (`tracejudge.consumer.stages.assembly`).

Assembly holds spans in memory until their trace is whole, so its state is what an operator watches
when memory grows or traces come out incomplete: how much is held, and why traces left.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

# Why a trace left assembly (bounded label set).
REASON_COMPLETE: Final = "complete"  # root span seen, then a quiet period with no new span
REASON_TIMEOUT: Final = "timeout"  # the maximum wait passed first: emitted incomplete
REASON_EVICTED: Final = "evicted"  # forced out by the open-trace or held-span cap: emitted incomplete
REASON_FLUSHED: Final = "flushed"  # end of a finite input (a file) before its root span arrived
REASONS: Final = (REASON_COMPLETE, REASON_TIMEOUT, REASON_EVICTED, REASON_FLUSHED)


class AssemblyMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.open_traces = Gauge(
            "tracejudge_assembly_open_traces",
            "Traces being assembled: some spans received, not yet emitted.",
            registry=registry)
        self.spans_held = Gauge(
            "tracejudge_assembly_spans_held",
            "Spans held in memory by trace assembly.",
            registry=registry)
        self.spans = Counter(
            "tracejudge_assembly_spans",
            "Spans received by trace assembly.",
            registry=registry)
        self.emitted = Counter(
            "tracejudge_assembly_traces_emitted",
            "Traces emitted by assembly, by why they were emitted (all but complete are incomplete).",
            ["reason"], registry=registry)
        self.late_spans = Counter(
            "tracejudge_assembly_late_spans",
            "Spans dropped because their trace had already been emitted (arrived after its quiet "
            "period, maximum wait or eviction).",
            registry=registry)
        self.log_events_unplaced = Counter(
            "tracejudge_assembly_log_events_unplaced",
            "Content log records (otlp_logs_* topics) dropped because they name no trace or span, or "
            "a span their trace did not have when it was emitted.",
            registry=registry)
        self.discarded = Counter(
            "tracejudge_assembly_traces_discarded",
            "Open traces dropped unevaluated on partition revocation or shutdown; their records "
            "stay uncommitted and are read again.",
            registry=registry)
        for reason in REASONS:
            self.emitted.labels(reason)
