"""Agent-evaluation records -> EvalRecord: stated fields, request shapes, and the trace behind them.

"A field the record states wins over one derived from its trace": every derived field is checked
both ways (stated: the record's value; unstated: the trace's), on traces made by the real `mlflow`.
"""

from __future__ import annotations

import json

import pytest
from mlflow.entities import Trace as MlflowTrace
from support import mlflow_apps

from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.record import Document, ToolCall
from tracejudge.schemas.trace import TokenUsage


@pytest.fixture(scope="module")
def traces() -> dict[str, str]:
    return mlflow_apps.run_all(["rag", "tools", "failing"])


FULL = {
    "request_id": "eval-1",
    "request": "What is MLflow?",
    "response": "An ML platform.",
    "retrieved_context": [{"content": "MLflow is a platform.", "doc_uri": "kb://1"}, {"content": "Tracing."}],
    "expected_response": "MLflow is an open source ML platform.",
    "expected_retrieved_context": [{"doc_uri": "kb://1"}],
    "expected_facts": ["open source", "platform"],
    "guidelines": ["Be concise."],
    "reference_trajectory": [{"tool_name": "search", "tool_input": {"q": "mlflow"}}, {"tool_name": "answer"}],
}


def test_stated_fields_pass_through() -> None:
    record = normalise(json.dumps(FULL))
    assert record.source_format == "agent_eval"
    assert record.request_id == "eval-1"
    assert record.request == "What is MLflow?" and record.response == "An ML platform."
    assert record.retrieved_context == [Document("MLflow is a platform.", "kb://1"), Document("Tracing.")]
    assert record.expected_response == FULL["expected_response"]
    assert record.expected_retrieved_context == [Document(None, "kb://1")]
    assert record.expected_facts == ["open source", "platform"]
    assert record.guidelines == ["Be concise."]
    assert record.reference_trajectory == [ToolCall("search", {"q": "mlflow"}), ToolCall("answer")]
    # Nothing states these and there is no trace to derive them from.
    assert (record.trajectory, record.latency_seconds, record.failed, record.tokens, record.trace_id) == \
        (None, None, None, None, None)


@pytest.mark.parametrize(("request_value", "question"), [
    ("plain question", "plain question"),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"},
                   {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]}, "second"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "multi"},
                                                 {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "multi"),
    ({"query": "the query", "history": [{"role": "user", "content": "before"}]}, "the query"),
    ({"question": "from a field", "top_k": 3}, "from a field"),
    ({"top_k": 3, "filters": {"lang": "en"}}, '{"top_k":3,"filters":{"lang":"en"}}'),
])
def test_request_shapes(request_value: object, question: str) -> None:
    assert normalise({"request": request_value}).request == question


def test_response_shapes() -> None:
    completion = {"choices": [{"message": {"role": "assistant", "content": "from choices"}}]}
    assert normalise({"request": "q", "response": completion}).response == "from choices"
    agent_output = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "last"}]}
    assert normalise({"request": "q", "response": agent_output}).response == "last"


def test_named_guidelines_are_flattened() -> None:
    record = normalise({"request": "q",
                        "guidelines": {"tone": ["Be polite."], "scope": ["No legal advice."]}})
    assert record.guidelines == ["Be polite.", "No legal advice."]


def test_numeric_request_id() -> None:
    assert normalise({"request_id": 42, "request": "q"}).request_id == "42"


def test_trace_fills_unstated_fields(traces: dict[str, str]) -> None:
    theirs = MlflowTrace.from_json(traces["rag"])
    for trace in (traces["rag"], json.loads(traces["rag"])):  # a JSON string or an object
        record = normalise({"request_id": "eval-2", "trace": trace, "expected_response": "An ML platform."})
        assert record.request_id == "eval-2"
        assert record.request == "What is MLflow?"
        assert record.response == theirs.data._get_root_span().outputs
        assert [d.doc_uri for d in record.retrieved_context] == [u for _, u in mlflow_apps.CORPUS["mlflow"]]
        assert record.trace_id == theirs.info.trace_id.removeprefix("tr-")
        usage = theirs.info.token_usage
        assert record.tokens == TokenUsage(usage["input_tokens"], usage["output_tokens"],
                                           usage["total_tokens"])
        assert record.latency_seconds == theirs.info.execution_duration / 1000
        assert record.failed is False
        assert record.expected_response == "An ML platform."
        assert record.source_format == "agent_eval"


def test_stated_fields_win_over_the_trace(traces: dict[str, str]) -> None:
    record = normalise({**FULL, "trace": traces["tools"]})
    assert record.request == FULL["request"]
    assert record.response == FULL["response"]
    assert record.retrieved_context[0].doc_uri == "kb://1"
    # The trace still gives what the record does not state.
    assert [c.tool_name for c in record.trajectory] == ["get_weather", "lookup_order", "get_weather",
                                                        "flaky_tool"]
    assert record.reference_trajectory == [ToolCall("search", {"q": "mlflow"}), ToolCall("answer")]


def test_failed_trace(traces: dict[str, str]) -> None:
    record = normalise({"request": "Will this fail?", "trace": traces["failing"]})
    assert record.failed is True and record.error == "RuntimeError: model endpoint returned 503"
    assert record.response is None


def test_trace_expectations_fill_unstated_expected_fields(traces: dict[str, str]) -> None:
    trace = mlflow_apps.with_expectations(traces["rag"], expected_response="from the trace",
                                          expected_facts=["fact"])
    record = normalise({"request": "q", "trace": trace, "expected_facts": ["stated fact"]})
    assert record.expected_response == "from the trace"
    assert record.expected_facts == ["stated fact"]


def test_mlflow_genai_evaluate_row_shape() -> None:
    row = {"inputs": {"question": "What is a topic?"},
           "outputs": {"choices": [{"message": {"role": "assistant", "content": "A named log."}}]},
           "expectations": {"expected_response": "A named, partitioned log.", "expected_facts": ["named"],
                            "guidelines": ["Define the term."]}}
    record = normalise(row)
    assert record.request == "What is a topic?" and record.response == "A named log."
    assert record.expected_response == "A named, partitioned log."
    assert record.expected_facts == ["named"] and record.guidelines == ["Define the term."]


def test_app_from_a_field_or_a_tag(traces: dict[str, str]) -> None:
    assert normalise({"request": "q", "team": "search"}, app_tag="team").app == "search"
    assert normalise({"request": "q", "tags": {"team": "search"}}, app_tag="team").app == "search"
    experiment = f"experiment:{mlflow_apps.EXPERIMENT_ID}"
    assert normalise({"request": "q", "trace": traces["rag"]}).app == experiment
