"""What judgements may spend and what they cost: each endpoint's request and token budgets, its hard
spend caps in USD, and each client's price.

The runner (`tracejudge.metrics.judges.runner`) reserves before a judgement's calls (`reserve`, awaited:
it may wait for a fleet lease; None means skip it as "budget"), settles after them with what the calls
really used (`settle`) and prices the assessment (`charge`, the `tracejudge_judge_cost_usd` series).
The budgets themselves are `tracejudge.metrics.judges.budget`; prices and the cost families
`tracejudge.metrics.cost`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from tracejudge.metrics.cost import JudgeCostMetrics, Price, endpoint_price
from tracejudge.metrics.judges.base import OUTPUT_TOKENS_ESTIMATE, JudgeContext
from tracejudge.metrics.judges.budget import Cost, EndpointBudget, SpendCap
from tracejudge.metrics.judges.client import JudgeClient
from tracejudge.metrics.judges.fleet_spend import FleetSpendConfig, FleetSpendLedger
from tracejudge.metrics.judges.planning import Configured
from tracejudge.schemas.errors import JudgeConfigError
from tracejudge.schemas.result import Assessment

__all__ = ["Reservation", "Spending"]


@dataclass(slots=True)
class Reservation:
    """What one judgement reserved: its estimated cost against the endpoint's budget and, when the
    endpoint has a cap and a price, its USD estimate against the cap."""

    cost: Cost
    budget: EndpointBudget | None
    price: Price | None
    cap: SpendCap | None = None
    estimate_usd: float = 0.0
    endpoint: str = ""
    fleet_buckets: dict[str, int] | None = None  # what the fleet's ledger charged (`fleet_spend`)


class Spending:
    """The budgets, caps and prices of a runner's endpoints (one per endpoint, shared by its clients)."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic,
                 fleet: FleetSpendConfig | None = None):
        self.budgets: dict[str, EndpointBudget] = {}
        # With `judges.fleet_spend`, the caps hold across the fleet too (made with the first capped
        # endpoint; tracejudge.metrics.judges.fleet_spend).
        self._fleet_config = fleet
        self.fleet: FleetSpendLedger | None = None
        self._registry = registry
        # Hard spend caps per endpoint, and each client's price (None: unknown, judgements unpriced).
        self.spend_caps: dict[str, SpendCap] = {}
        self._prices: dict[int, Price | None] = {}
        self._costs = JudgeCostMetrics.of(registry)
        self._clock = clock

    def add_client(self, name: str, cfg: Any, client: JudgeClient, model: str | None) -> None:
        """A client of endpoint `name` (`model`: a shadow's candidate model, priced as such); the
        endpoint's budget and cap are made with its first client."""
        if name not in self.budgets:
            self.budgets[name] = EndpointBudget(
                cfg.requests_per_second, cfg.tokens_per_minute, clock=self._clock
            )
            self._spend_cap(name, cfg)
        self._prices[id(client)] = endpoint_price(cfg, model)

    def _spend_cap(self, name: str, cfg: Any) -> None:
        """The endpoint's hard spend cap, when it has one: a cap needs a price to charge."""
        caps = {w: v for w, v in (("hour", cfg.usd_per_hour), ("day", cfg.usd_per_day)) if v is not None}
        if not caps:
            return
        if endpoint_price(cfg) is None:
            key = f"judges.endpoints.{name}.{'usd_per_hour' if 'hour' in caps else 'usd_per_day'}"
            raise JudgeConfigError(key, f"a spend cap needs a price, and model {cfg.model!r} is not in the "
                                   f"price table: set judges.endpoints.{name}.price "
                                   "{input_per_mtok, output_per_mtok}")
        cap = self.spend_caps[name] = SpendCap(caps, clock=self._clock)
        if self._fleet_config is not None:
            if self.fleet is None:
                self.fleet = FleetSpendLedger(self._fleet_config, self._registry)
            self.fleet.track(name, caps)
        for window, usd in caps.items():
            self._costs.cap.labels(name, window).set(usd)
            self._costs.remaining.labels(name, window).set_function(
                lambda cap=cap, window=window: cap.remaining()[window])

    @staticmethod
    def _estimate_usd(cj: Configured, cost: Cost, price: Price) -> float:
        """What a judgement can cost at most: twice the prompt-token estimate (the 4-characters-per-
        token estimate is low for code and non-Latin text) and `max_output_tokens` per request."""
        assert cj.client is not None
        prompt = max(0, cost.tokens - cost.requests * OUTPUT_TOKENS_ESTIMATE) * 2
        inp, out = price.of(prompt, cost.requests * cj.client.config.max_output_tokens)
        return inp + out

    async def reserve(self, cj: Configured, cost: Cost) -> Reservation | None:
        """Reserve a judgement's cost; None when the budget or the cap has no room (nothing is held,
        also when the judgement is cancelled while it waits for a fleet lease)."""
        assert cj.client is not None
        if cj.budget is not None and not cj.budget.try_acquire(cost):
            return None
        r = Reservation(cost, cj.budget, self._prices.get(id(cj.client)))
        cap = self.spend_caps.get(cj.client.name)
        if cap is not None and r.price is not None:
            r.cap, r.estimate_usd = cap, self._estimate_usd(cj, cost, r.price)
            r.endpoint = cj.client.name
            charged = False
            try:
                charged = await self._charge_caps(r, cap)
            finally:
                if not charged and cj.budget is not None:  # nothing was sent: the budgets get it back
                    cj.budget.settle(cost, requests_made=0, tokens_used=0)
            if not charged:
                return None
        return r

    async def _charge_caps(self, r: Reservation, cap: SpendCap) -> bool:
        """Charge the process's cap, then the fleet's lease (`fleet_spend`, awaited: it may wait up to
        `claim_wait_s` for a claim's decision while the loop runs the other judgements); all or nothing."""
        if not cap.try_charge(r.estimate_usd):
            return False
        if self.fleet is None:
            return True
        try:
            r.fleet_buckets = await self.fleet.charge(r.endpoint, r.estimate_usd)
        finally:
            if r.fleet_buckets is None:  # refused, or cancelled while waiting
                cap.settle(r.estimate_usd, 0.0)
        return r.fleet_buckets is not None

    def close(self) -> None:
        """The runner closed: its fleet ledger leaves the process's registry (idempotent)."""
        if self.fleet is not None:
            self.fleet.close()

    def settle(self, r: Reservation, ctx: JudgeContext) -> None:
        """Replace the reservation by what the judgement's calls used."""
        if r.budget is not None:
            used = ctx.input_tokens + ctx.output_tokens
            r.budget.settle(r.cost, requests_made=ctx.requests, tokens_used=used)
        if r.cap is not None and r.price is not None:
            spent_in, spent_out = r.price.of(ctx.input_tokens, ctx.output_tokens)
            r.cap.settle(r.estimate_usd, spent_in + spent_out)
            if self.fleet is not None and r.fleet_buckets is not None:
                self.fleet.settle(r.endpoint, r.fleet_buckets, r.estimate_usd, spent_in + spent_out)

    def charge(self, r: Reservation, judge: str, a: Assessment) -> None:
        """The assessment's cost in USD from its reported usage (unset when unpriced or unreported)."""
        if r.price is not None and a.input_tokens is not None and a.output_tokens is not None:
            cost_in, cost_out = r.price.of(a.input_tokens, a.output_tokens)
            a.cost_usd = round(cost_in + cost_out, 9)
            self._costs.cost.labels(judge).inc(a.cost_usd)
