"""tracejudge: evaluate LLM agent traces — offline, in tests, and live from Kafka — with one code path.

For tests and scripts:

    from tracejudge import evaluate

    result = evaluate(request="What is the refund window?", response="Refunds within 30 days.",
                      context=["Refunds are accepted within 30 days of purchase."], judges={})
    assert result.assessment("groundedness").passed, result.assessment("groundedness").rationale

`judges={}` runs the model-free heuristic judges; pass the `judges:` section of your configuration
(endpoints, built-in and custom judges) to use an LLM, or `config="tracejudge.yaml"` to read the
file `tracejudge run` reads. `Evaluator` keeps the judge client open across many records.

A conversation (a list of turns) is evaluated as one session by `evaluate_session`: session metrics and
the session judges (`user_frustration`, heuristic without an endpoint), as `tracejudge sessions` does live:

    session = evaluate_session([{"request": "Reset my password?", "response": "Use the sign-in link."},
                                {"request": "Forget it.", "response": "Sorry."}], judges={})
    session.metrics["turns"], session.assessment("user_frustration").value

What to catch: `RecordError` for a record that cannot be read, `ConfigError` for a configuration that
cannot work (`JudgeConfigError`, the `judges:` section's, and `MetricLoadError`, a custom metric's, are
kinds of it; each names the key path). All are defined in `tracejudge.schemas.errors`.
"""

from tracejudge.evaluator import Evaluator, evaluate, evaluate_session
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.schemas.errors import ConfigError, JudgeConfigError, MetricLoadError, RecordError
from tracejudge.schemas.record import Document, EvalRecord, TokenUsage, ToolCall
from tracejudge.schemas.result import Assessment, EvaluationResult
from tracejudge.schemas.session import SessionResult
from tracejudge.schemas.version import __version__

__all__ = [
    "Assessment",
    "ConfigError",
    "Document",
    "EvalRecord",
    "EvaluationResult",
    "Evaluator",
    "JudgeConfigError",
    "JudgeRunner",
    "MetricLoadError",
    "RecordError",
    "SessionResult",
    "TokenUsage",
    "ToolCall",
    "__version__",
    "evaluate",
    "evaluate_session",
]
