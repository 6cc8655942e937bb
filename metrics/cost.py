"""What a trace cost the agent, and what a judgement cost, in US dollars.

A trace's cost is taken, in this order:

1. **stated**: what the trace says it cost: the model-call spans' `mlflow.llm.cost` (or
   OpenInference's `llm.cost.*`, `gen_ai.usage.cost`) when every counted call states one, else
   MLflow's trace-level `mlflow.trace.cost` (read by `tracejudge.schemas.formats.derive`);
2. **priced**: the record's per-model token usage (`EvalRecord.model_usage`) x each model's price;
3. **unknown**: otherwise. A model the price table does not know is never guessed at, and usage no
   model call names (a model call without a model attribute) makes the whole trace unknown rather
   than under-priced.

A stated cost or a token count that is negative, not a number or absurd (`MAX_TRACE_COST_USD`,
`MAX_CALL_TOKENS`) is ignored: the record falls back to the next source and the result carries the
reason in `metric_errors["cost"]` (`tracejudge_cost_ignored_total{reason}`), so a producer's bug
never reaches a dashboard as a dollar figure.

Prices come from `genai-prices` (PyPI, MIT, maintained by the Pydantic team), pinned in
pyproject.toml. Chosen because it is a small pure-Python package whose versioned price database
ships inside the wheel (no network at run time, no model download), it matches provider and model
names with their aliases and dated snapshots ("gpt-4o-2024-08-06"), and it is updated with each
release, so upgrading the pin is how prices are kept current. LiteLLM's price map (what MLflow uses)
would bring the whole `litellm` client and its dependencies for one JSON file. A price set in the
config (`endpoints.<name>.price`) wins for judge endpoints: self-hosted models have no list price.

`genai_prices.calc_price` takes a few hundred microseconds (it searches providers and computes in
`Decimal`), so each model's per-token price is looked up once and cached (unknown names too). A
model priced in tiers by prompt size is taken at its first tier.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from tracejudge.schemas.record import Cost, EvalRecord, TokenUsage

if TYPE_CHECKING:
    from tracejudge.metrics.judges.endpoints import EndpointConfig

__all__ = [
    "COST_ERROR_KEY",
    "IGNORED_REASONS",
    "MAX_CALL_TOKENS",
    "MAX_TRACE_COST_USD",
    "UNKNOWN_REASONS",
    "JudgeCostMetrics",
    "Price",
    "PriceTable",
    "TraceCost",
    "default_prices",
    "endpoint_price",
    "ignored_reason",
    "trace_cost",
    "unknown_reason",
]

# A single trace that states more than this is taken for a producer's bug (a cost in cents or
# micro-dollars, a counter written as a cost): ignored and counted.
MAX_TRACE_COST_USD = 1_000.0
# No model call reads or writes this many tokens (the largest context windows are ~10M).
MAX_CALL_TOKENS = 100_000_000
# `metric_errors["cost"]` starts with one of these (the `reason` label).
IGNORED_REASONS = ("negative_cost", "absurd_cost", "not_a_number", "negative_tokens", "absurd_tokens")
# Why a cost is unknown (the `reason` label of tracejudge_cost_unknown_total).
UNKNOWN_REASONS = ("no_usage", "unnamed_model", "unknown_model")
COST_ERROR_KEY = "cost"


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million input and output tokens."""

    input_per_mtok: float
    output_per_mtok: float

    def of(self, input_tokens: int, output_tokens: int) -> tuple[float, float]:
        return input_tokens * self.input_per_mtok / 1e6, output_tokens * self.output_per_mtok / 1e6


class PriceTable:
    """Model name -> `Price`, from `genai-prices`, with `overrides` (exact model names) first.
    Thread-safe; lookups are cached."""

    def __init__(self, overrides: Mapping[str, Price] | None = None) -> None:
        self._overrides = dict(overrides or {})
        self._cache: dict[str, Price | None] = {}
        self._lock = threading.Lock()

    def price(self, model: str) -> Price | None:
        """The model's price, or None when neither the overrides nor the table know it."""
        found = self._overrides.get(model)
        if found is not None:
            return found
        try:
            return self._cache[model]
        except KeyError:
            pass
        found = _library_price(model)
        with self._lock:
            if len(self._cache) < 10_000:  # model names come from traces: bound the cache
                self._cache[model] = found
        return found


def _library_price(model: str) -> Price | None:
    from genai_prices import Usage, calc_price

    candidates = [model]
    if "/" in model:  # "openai/gpt-4o", "azure/gpt-4o-mini": the provider, then the model
        provider, _, name = model.partition("/")
        candidates.append(name)
    else:
        provider = None
    for i, ref in enumerate(candidates):
        try:
            # Probed with a thousand tokens each way: a model priced in tiers by prompt size (Gemini,
            # Claude over 200k tokens) is taken at its first tier, where nearly every call falls.
            calc = calc_price(Usage(input_tokens=1_000, output_tokens=1_000), model_ref=ref,
                              provider_id=provider if i == 1 else None)
        except (LookupError, ValueError):
            continue
        return Price(float(calc.input_price) * 1_000, float(calc.output_price) * 1_000)
    return None


_DEFAULT: PriceTable | None = None


def default_prices() -> PriceTable:
    """The process's shared table (the library's prices, no overrides)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PriceTable()
    return _DEFAULT


@dataclass(frozen=True, slots=True)
class TraceCost:
    """`cost` for the record; `ignored`: why a stated value was set aside ("<reason>: <detail>")."""

    cost: Cost
    ignored: str | None = None


def _bad_amount(value: float | None) -> str | None:
    if value is None:
        return None
    if math.isnan(value) or math.isinf(value):
        return "not_a_number"
    if value < 0:
        return "negative_cost"
    if value > MAX_TRACE_COST_USD:
        return "absurd_cost"
    return None


def _bad_tokens(usage: TokenUsage) -> str | None:
    for n in (usage.input, usage.output, usage.total):
        if n is None:
            continue
        if n < 0:
            return "negative_tokens"
        if n > MAX_CALL_TOKENS:
            return "absurd_tokens"
    return None


def trace_cost(record: EvalRecord, prices: PriceTable | None = None) -> TraceCost:
    """The record's cost: stated, else priced from its per-model usage, else unknown (see the module
    docstring). Never raises for what a trace states."""
    ignored: str | None = None
    stated = record.cost
    if stated is not None and stated.source == "stated":
        for value in (stated.input, stated.output, stated.total):
            reason = _bad_amount(value)
            if reason is not None:
                ignored = f"{reason}: stated cost {value!r} USD"
                break
        else:
            if stated.total is not None or (stated.input is not None and stated.output is not None):
                total = stated.total if stated.total is not None else stated.input + stated.output  # type: ignore[operator]
                return TraceCost(Cost(stated.input, stated.output, total, stated.currency, "stated"))
    usage = record.model_usage
    if not usage:
        return TraceCost(Cost(source="unknown"), ignored)
    table = prices or default_prices()
    cost_in = cost_out = 0.0
    tokens_in = tokens_out = 0
    for model, u in usage.items():
        reason = _bad_tokens(u)
        if reason is not None:
            return TraceCost(Cost(source="unknown"), ignored or f"{reason}: model {model[:64]!r} usage {u!r}")
        price = table.price(model)
        if price is None or u.input is None or u.output is None:
            return TraceCost(Cost(source="unknown"), ignored)
        a, b = price.of(u.input, u.output)
        cost_in, cost_out = cost_in + a, cost_out + b
        tokens_in, tokens_out = tokens_in + u.input, tokens_out + u.output
    if _unnamed_usage(record.tokens, tokens_in, tokens_out):
        return TraceCost(Cost(source="unknown"), ignored)
    return TraceCost(Cost(cost_in, cost_out, cost_in + cost_out, "USD", "priced"), ignored)


def _unnamed_usage(tokens: TokenUsage | None, named_in: int, named_out: int) -> bool:
    """More tokens in the trace's usage than in its named model calls: some call names no model."""
    if tokens is None:
        return False
    return (tokens.input or 0) > named_in or (tokens.output or 0) > named_out


def unknown_reason(record: EvalRecord, prices: PriceTable | None = None) -> str:
    """Why `record.cost` is unknown: no usage at all, usage no call names a model for, or a model
    the price table does not know."""
    usage = record.model_usage
    if not usage:
        return "no_usage" if record.tokens is None else "unnamed_model"
    table = prices or default_prices()
    if any(table.price(m) is None for m in usage):
        return "unknown_model"
    return "unnamed_model"


def ignored_reason(error: str) -> str:
    """The `reason` label of a `metric_errors["cost"]` text."""
    reason = error.partition(":")[0]
    return reason if reason in IGNORED_REASONS else "other"


# ----------------------------------------------------------------------------------------------
# judges


def endpoint_price(config: EndpointConfig, model: str | None = None) -> Price | None:
    """A judge endpoint's price: its configured `price`, else the table's for `model` (default: the
    endpoint's own model; a shadow judge's candidate model on the same endpoint has its own)."""
    if config.price is not None:
        return Price(config.price.input_per_mtok, config.price.output_per_mtok)
    return default_prices().price(model or config.model)


class JudgeCostMetrics:
    """`tracejudge_judge_cost_usd_total{judge}` and `tracejudge_judge_budget_remaining_usd{endpoint,
    window}`, registered once per registry (trace and session judge runners may share one)."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, JudgeCostMetrics]] = (
        weakref.WeakKeyDictionary())
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.cost = Counter("tracejudge_judge_cost_usd", "What judgements cost in USD: the usage the judge "
                            "endpoint reported x the judge model's price.", ["judge"], registry=registry)
        self.remaining = Gauge("tracejudge_judge_budget_remaining_usd", "USD a judge endpoint's spend cap "
                               "still allows over the window (usd_per_hour / usd_per_day).",
                               ["endpoint", "window"], registry=registry)
        self.cap = Gauge("tracejudge_judge_budget_cap_usd", "A judge endpoint's spend cap in USD over the "
                         "window (usd_per_hour / usd_per_day), per process.", ["endpoint", "window"],
                         registry=registry)

    @classmethod
    def of(cls, registry: CollectorRegistry) -> JudgeCostMetrics:
        with cls._lock:
            found = cls._by_registry.get(registry)
            if found is None:
                found = cls._by_registry[registry] = cls(registry)
            return found
