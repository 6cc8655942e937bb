"""Token usage and cost of a trace's model calls, as derivation (`derive`) reads them from its spans.

Each model call is counted once: a wrapper span that rolls up its inner call's usage is counted and
the inner call is not (`usage_spans`, as MLflow's `aggregate_usage_from_spans`). The counted calls
give the record's per-model usage and the cost they state (`model_usage_and_cost`); the msgspec
MLflow reader (`mlflow_wire`) walks its own wire spans with the same `usage_walk` and applies the same
`one_model_calls`, so both readers agree. Values are kept as stated; `tracejudge.metrics.cost` checks
and prices them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, TypeVar

from tracejudge.schemas.formats.model_cost import span_cost, span_model
from tracejudge.schemas.record import Cost
from tracejudge.schemas.trace import Span, TokenUsage

__all__ = ["CostParts", "ModelCall", "has_negative_tokens", "model_calls", "model_usage_and_cost",
           "one_model_calls", "stated_cost", "sum_token_usage", "usage_spans", "usage_sum", "usage_walk"]

T = TypeVar("T")
U = TypeVar("U")


def _add(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else a + b


def usage_spans(spans: list[Span]) -> list[Span]:
    """The spans whose usage counts, each model call once: a depth-first walk from the roots that
    does not descend below a span with its own usage, so a wrapper span that rolls up its inner
    model call's usage is counted and the inner call is not (MLflow's `aggregate_usage_from_spans`
    does the same)."""
    return [span for span, _ in usage_walk(spans, _span_id, _parent_id, _token_usage)]


_span_id, _parent_id, _token_usage = attrgetter("span_id"), attrgetter("parent_id"), attrgetter("token_usage")


def usage_walk(spans: Sequence[T], span_id: Callable[[T], Any], parent_id: Callable[[T], Any],
               usage: Callable[[T], U | None]) -> list[tuple[T, U]]:
    """`usage_spans`' walk over spans of any shape (the MLflow wire reader's too): each counted span
    with its usage, in the walk's order. A span is a root when it has no parent, a parent no span
    has, or itself as parent."""
    ids = {span_id(s) for s in spans}
    children: dict[Any, list[T]] = {}
    stack: list[T] = []
    for span in spans:
        parent = parent_id(span)
        if parent and parent in ids and parent != span_id(span):
            children.setdefault(parent, []).append(span)
        else:
            stack.append(span)
    counted: list[tuple[T, U]] = []
    seen: set[int] = set()
    while stack:
        span = stack.pop()
        if id(span) in seen:  # duplicate span ids can make a node reachable twice
            continue
        seen.add(id(span))
        stated = usage(span)
        if stated is not None:
            counted.append((span, stated))
            continue
        stack.extend(children.get(span_id(span), ()))
    return counted


def usage_sum(counted: list[Span]) -> TokenUsage | None:
    """The usage of the counted spans (`usage_spans`) summed, with its total; None when none states any."""
    total: TokenUsage | None = None
    for span in counted:
        usage = span.token_usage
        if usage is None:
            continue
        if total is None:
            total = TokenUsage(usage.input, usage.output, usage.total, usage.cached_input)
        else:
            total = TokenUsage(_add(total.input, usage.input), _add(total.output, usage.output),
                               _add(total.total, usage.total), _add(total.cached_input, usage.cached_input))
    return total.with_total() if total is not None else None


def sum_token_usage(spans: list[Span]) -> TokenUsage | None:
    """Usage summed over the spans that state it, each model call counted once (`usage_spans`)."""
    return usage_sum(usage_spans(spans))


# One counted model call as cost reads it: (model, usage, stated cost (input, output, total)).
CostParts = tuple[float | None, float | None, float | None]


ModelCall = tuple[str | None, TokenUsage | None, CostParts | None]


def model_calls(counted: list[Span]) -> list[ModelCall]:
    """The model, usage and stated cost of each counted model call (`usage_spans`)."""
    return [(span_model(attrs), span.token_usage, span_cost(attrs)) if (attrs := span.attributes)
            else (None, span.token_usage, None) for span in counted]


def one_model_calls(calls: list[ModelCall], tokens: TokenUsage | None) -> list[ModelCall]:
    """For a trace that states its usage (`tokens`): when every counted call names the same model and
    none states a cost, that model's usage is the trace's (MLflow's trace-level roll-up sums the same
    calls), one call; else the calls as they are. Both MLflow readers apply it, so they agree."""
    model = calls[0][0]
    for m, _, stated in calls:
        if m != model or stated is not None:
            return calls
    return [(model, tokens, None)]


def model_usage_and_cost(calls: list[ModelCall]) -> tuple[dict[str, TokenUsage] | None, Cost | None]:
    """Per-model usage of the counted model calls (`model_calls`) that name their model, and the
    cost they state (summed, source "stated") when every one of them states one: MLflow's
    trace-level roll-up can be a partial sum under asynchronous logging, its spans' costs are not.
    Values are as stated; `tracejudge.metrics.cost` checks them."""
    if len(calls) == 1:  # the usual trace: one model call
        model, usage, stated = calls[0]
        return ({model: usage.with_total()} if model is not None and usage is not None else None,
                None if stated is None else stated_cost(stated))
    sums: dict[str, list[int | None]] | None = None
    costs: list[CostParts] = []
    every_cost = True
    for model, usage, stated in calls:
        if model is not None and usage is not None:
            i, o, t, c = usage.input, usage.output, usage.total, usage.cached_input
            if t is None and i is not None and o is not None:
                t = i + o
            if sums is None:
                sums = {}
            had = sums.get(model)
            if had is None:
                sums[model] = [i, o, t, c]
            else:
                had[0], had[1], had[2] = _add(had[0], i), _add(had[1], o), _add(had[2], t)
                had[3] = _add(had[3], c)
        if stated is None:
            every_cost = False
        elif every_cost:
            costs.append(stated)
    by_model = None if sums is None else {m: TokenUsage(*u) for m, u in sums.items()}
    if not costs or not every_cost:
        return by_model, None
    if len(costs) == 1:
        return by_model, stated_cost(costs[0])
    # fsum: the same total whatever order a reader met the spans in.
    return by_model, stated_cost((_fsum([c[0] for c in costs]), _fsum([c[1] for c in costs]),
                              _fsum([c[2] for c in costs])))


def _fsum(values: list[float | None]) -> float | None:
    return None if None in values else math.fsum(values)  # type: ignore[arg-type]


def stated_cost(parts: tuple[float | None, float | None, float | None]) -> Cost:
    """A cost as stated (input, output, total), its total the sum of the two parts when unstated."""
    inp, out, total = parts
    if total is None and inp is not None and out is not None:
        total = inp + out
    return Cost(inp, out, total, source="stated")


def has_negative_tokens(tokens: TokenUsage) -> bool:
    """A token count below zero: the usage is set aside (`NEGATIVE_TOKENS`) rather than summed."""
    inp, out, total, cached = tokens.input, tokens.output, tokens.total, tokens.cached_input
    return ((inp is not None and inp < 0) or (out is not None and out < 0)
            or (total is not None and total < 0) or (cached is not None and cached < 0))
