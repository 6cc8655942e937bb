"""tracejudge: evaluate LLM agent traces — offline, in tests, and live from Kafka — with one code path.

For tests and scripts:

    from tracejudge import evaluate

    result = evaluate(request="What is the refund window?", response="Refunds within 30 days.",
                      context=["Refunds are accepted within 30 days of purchase."], judges={})
    assert result.assessment("groundedness").passed, result.assessment("groundedness").rationale

`judges={}` runs the model-free heuristic judges; pass the `judges:` section of your configuration
(endpoints, built-in and custom judges) to use an LLM, or `config="tracejudge.yaml"` to read the
file `tracejudge run` reads. `Evaluator` keeps the judge client open across many records.
"""

from tracejudge.consumer.evaluator import Evaluator, evaluate
from tracejudge.metrics.judge_config import JudgeConfigError
from tracejudge.metrics.judging import JudgeRunner
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.record import Document, EvalRecord, TokenUsage, ToolCall
from tracejudge.schemas.result import Assessment, EvaluationResult

__version__ = "0.1.0"

__all__ = [
    "Assessment",
    "Document",
    "EvalRecord",
    "EvaluationResult",
    "Evaluator",
    "JudgeConfigError",
    "JudgeRunner",
    "RecordError",
    "TokenUsage",
    "ToolCall",
    "__version__",
    "evaluate",
]
