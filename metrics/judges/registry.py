"""Which judge a configured name means: name -> factory for the built-in LLM judges
(`tracejudge.metrics.judges.builtin` and the model tool-call judges of `tool_calls`) and for the
model-free ones (`heuristic`, and the code tool-call judges of `tool_calls`).

This is what the runner asks (`tracejudge.metrics.judges.runner`): it sits above every judge module, so
none of them needs to import another to be found. Session judges have their own table
(`tracejudge.metrics.judges.sessions.SESSION_FACTORIES`); custom judges are built from their
configuration (`tracejudge.metrics.judges.custom.CustomJudge`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tracejudge.metrics.judges.base import Judge
from tracejudge.metrics.judges.builtin import (
    AnswerRelevancy,
    ChunkRelevance,
    ContextSufficiency,
    Correctness,
    FactCheck,
    Groundedness,
    Guidelines,
    RelevanceToQuery,
    Safety,
)
from tracejudge.metrics.judges.heuristic import HeuristicGroundedness, HeuristicJudge, HeuristicRelevance
from tracejudge.metrics.judges.tool_calls import (
    CodeToolCallCorrectness,
    CodeToolCallEfficiency,
    ToolCallCorrectness,
    ToolCallEfficiency,
)

__all__ = ["BUILTIN_FACTORIES", "HEURISTIC_FACTORIES", "heuristic_judges"]

BUILTIN_FACTORIES: dict[str, Callable[..., Judge]] = {
    "groundedness": Groundedness,
    "relevance_to_query": RelevanceToQuery,
    "safety": Safety,
    "correctness": Correctness,
    "context_sufficiency": ContextSufficiency,
    "chunk_relevance": ChunkRelevance,
    "answer_relevancy": AnswerRelevancy,
    "fact_check": FactCheck,
    "guidelines": Guidelines,
    "tool_call_correctness": ToolCallCorrectness,
    "tool_call_efficiency": ToolCallEfficiency,
}

HEURISTIC_FACTORIES: dict[str, Callable[..., HeuristicJudge]] = {
    "groundedness": HeuristicGroundedness,
    "relevance_to_query": HeuristicRelevance,
    "tool_call_correctness": CodeToolCallCorrectness,
    "tool_call_efficiency": CodeToolCallEfficiency,
}


def heuristic_judges(names: Sequence[str]) -> list[HeuristicJudge]:
    """The model-free judges of `names`, with their default settings."""
    return [HEURISTIC_FACTORIES[n]() for n in names]
