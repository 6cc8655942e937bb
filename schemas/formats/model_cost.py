"""Which model a model-call span called and the cost it states, under every convention.

Read by derivation (`derive_usage`, `derive`) and the msgspec MLflow reader (`mlflow_wire`) for the
record's per-model usage and stated cost; values are kept as stated, `tracejudge.metrics.cost`
checks and prices them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from tracejudge.schemas.formats.attribute_values import strict_json

__all__ = ["GENAI_COST", "MLFLOW_SPAN_COST", "MLFLOW_TRACE_COST", "MODEL_ATTRIBUTES", "OPENINFERENCE_COST",
           "span_cost", "span_model", "stated_cost_parts"]

# Which model a model-call span called, by priority: the model that answered over the one asked for
# (a dated snapshot prices right), OTel GenAI / Traceloop, OpenInference, MLflow 3, older Traceloop.
MODEL_ATTRIBUTES: Final = ("gen_ai.response.model", "gen_ai.request.model", "llm.model_name",
                           "mlflow.llm.model", "llm.response.model", "llm.request.model")
# The cost a span states: MLflow 3's JSON `{"input_cost", "output_cost", "total_cost"}` (USD, priced
# by MLflow with LiteLLM's map), OpenInference's `llm.cost.*` (USD), and the `gen_ai.usage.cost`
# total some GenAI producers (Langfuse's SDKs) write.
MLFLOW_SPAN_COST: Final = "mlflow.llm.cost"
OPENINFERENCE_COST: Final = ("llm.cost.prompt", "llm.cost.completion", "llm.cost.total")
GENAI_COST: Final = "gen_ai.usage.cost"
# MLflow's trace-level roll-up of its spans' costs, in `info.trace_metadata`.
MLFLOW_TRACE_COST: Final = "mlflow.trace.cost"


def span_model(attrs: Mapping[str, Any]) -> str | None:
    """The model a span names (`MODEL_ATTRIBUTES`), or None; MLflow's JSON-encoded string is decoded."""
    for key in MODEL_ATTRIBUTES:
        value = attrs.get(key)
        if type(value) is str and value:
            if value[0] == '"':
                value = strict_json(value)
                if type(value) is not str or not value:
                    continue
            return value
    return None


def _cost_number(value: Any) -> float | None:
    """A stated cost as a float; NaN for a value that is there but is no number (counted later)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return math.nan
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


def stated_cost_parts(value: Any) -> tuple[float | None, float | None, float | None] | None:
    """(input, output, total) of an MLflow cost object (a dict or its JSON text); None when absent or
    not an object. Values are as stated: checking them (negative, absurd) is the pricer's job."""
    value = strict_json(value)
    if not isinstance(value, Mapping):
        return None if value is None else (None, None, math.nan)
    parts = (_cost_number(value.get("input_cost")), _cost_number(value.get("output_cost")),
             _cost_number(value.get("total_cost")))
    return None if parts == (None, None, None) else parts


def span_cost(attrs: Mapping[str, Any]) -> tuple[float | None, float | None, float | None] | None:
    """(input, output, total) cost a span states under any convention, or None."""
    if MLFLOW_SPAN_COST in attrs:
        return stated_cost_parts(attrs[MLFLOW_SPAN_COST])
    prompt, completion, total = (attrs.get(k) for k in OPENINFERENCE_COST)
    if prompt is not None or completion is not None or total is not None:
        return _cost_number(prompt), _cost_number(completion), _cost_number(total)
    if GENAI_COST in attrs:
        return None, None, _cost_number(attrs[GENAI_COST])
    return None
