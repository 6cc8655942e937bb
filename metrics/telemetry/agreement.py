"""The Prometheus series of the online-agreement stage (`tracejudge agreement`,
`consumer/stages/agreement.py`): the runtime's series, the judges' trust series (`trust.py`) and the
join's own (`tracejudge_agreement_*`)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from tracejudge.metrics.app_labels import AppLabelLimiter
from tracejudge.metrics.telemetry.consumer import ConsumerMetrics
from tracejudge.metrics.telemetry.trust import TrustMetrics

__all__ = ["SIDES", "AgreementMetrics"]

# The two sides of the join: a judge's verdict waiting for its label, a label waiting for its verdict.
SIDES = ("verdict", "label")


class AgreementMetrics(ConsumerMetrics):
    """The runtime's series, the trust series (`TrustMetrics`) and the join's own."""

    def __init__(self, registry: CollectorRegistry, *, max_apps: int, judges: Iterable[str] | None) -> None:
        super().__init__(registry)
        r = registry
        self.app_overflow = Counter("tracejudge_app_label_overflow", "Labels whose app was exported as "
                                    "'other' because the distinct-app cap was reached.", registry=r)
        self.apps = AppLabelLimiter(max_apps, self.app_overflow)
        self.trust = TrustMetrics(r, self.apps, judges=judges)
        self.pending = Gauge("tracejudge_agreement_pending", "Verdicts waiting for labels and labels "
                             "waiting for verdicts, by side.", ["side"], registry=r)
        self.evicted = Counter("tracejudge_agreement_evicted", "Entries dropped before their window ended "
                               "because agreement.max_pending was reached, by side.", ["side"], registry=r)
        self.records = Counter("tracejudge_agreement_records", "Records read, by input (results or labels) "
                               "and outcome (ok, invalid).", ["input", "outcome"], registry=r)
        for side in SIDES:
            self.evicted.labels(side)
        for kind in ("results", "labels"):
            for outcome in ("ok", "invalid"):
                self.records.labels(kind, outcome)
