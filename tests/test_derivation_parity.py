"""tracejudge's derivation agrees with MLflow's own, trace by trace.

The traces are produced here by the real `mlflow` package (tests/support/mlflow_apps.py) and by
MLflow 2.22 (tests/fixtures/mlflow2/traces.jsonl). For each, MLflow's view is computed with
`mlflow.entities.Trace.from_json` and `mlflow.genai.utils.trace_utils` / `TraceInfo`, and ours with
`normalise()` on the same JSON text. Where tracejudge deliberately differs (docs/pages/inputs/formats.md,
"Where tracejudge deliberately differs from MLflow"), the difference is asserted in its own test below,
together with what MLflow gives, so a change on either side shows up.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from mlflow.entities import Trace as MlflowTrace
from mlflow.entities.trace_state import TraceState
from mlflow.genai.utils import trace_utils
from mlflow.tracing.utils import aggregate_usage_from_spans
from support import mlflow_apps

from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.record import EvalRecord

MLFLOW2_FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "mlflow2" / "traces.jsonl"


@pytest.fixture(scope="module")
def v3_traces() -> dict[str, str]:
    return mlflow_apps.run_all()


def _v2_traces() -> dict[str, str]:
    rows = [json.loads(line) for line in MLFLOW2_FIXTURES.read_text().splitlines() if line.strip()]
    assert all(row["mlflow_version"].startswith("2.") for row in rows)
    return {f"v2-{row['app']}": row["trace"] for row in rows}


@pytest.fixture(scope="module")
def all_traces(v3_traces: dict[str, str]) -> dict[str, str]:
    return {**v3_traces, **_v2_traces()}


PARITY_V3 = list(mlflow_apps.APPS)
PARITY_V2 = list(_v2_traces())


def _mlflow(text: str) -> MlflowTrace:
    return MlflowTrace.from_json(text)


def _root_inputs(trace: MlflowTrace) -> Any:
    return trace.data._get_root_span().inputs


def _mlflow_context(trace: MlflowTrace) -> list[dict[str, Any]] | None:
    """MLflow's retrieved context, all top-level retrievers in start order, flattened."""
    by_span = trace_utils.extract_retrieval_context_from_trace(trace)
    if not by_span:
        return None
    starts = {s.span_id: s.start_time_ns for s in trace.data.spans}
    return [doc for span_id in sorted(by_span, key=starts.__getitem__) for doc in by_span[span_id]]


def _ours_context(record: EvalRecord) -> list[dict[str, Any]] | None:
    if record.retrieved_context is None:
        return None
    return [{"content": d.content, **({"doc_uri": d.doc_uri} if d.doc_uri else {})}
            for d in record.retrieved_context]


def _mlflow_tokens(trace: MlflowTrace) -> dict[str, int] | None:
    if trace.info.token_usage is not None:
        return trace.info.token_usage
    # MLflow 2 traces state no trace-level usage; MLflow's own aggregation over the spans is what
    # MLflow 3 writes at the end of a trace (see test_v2_tokens_are_summed_from_spans).
    return aggregate_usage_from_spans(trace.data.spans)


def _ours_tokens(record: EvalRecord) -> dict[str, int] | None:
    if record.tokens is None:
        return None
    t = record.tokens
    return {"input_tokens": t.input, "output_tokens": t.output, "total_tokens": t.total}


# --------------------------------------------------------------------------------------------
# agreement


@pytest.mark.parametrize("name", PARITY_V3 + PARITY_V2)
def test_response_agrees_with_mlflow(all_traces: dict[str, str], name: str) -> None:
    text = all_traces[name]
    trace = _mlflow(text)
    theirs = trace_utils.extract_response_from_trace(trace)
    if trace.data._get_root_span().outputs is None:
        # A root that returned nothing (a failed one): MLflow's blank, our None (see below).
        assert theirs == " "
        theirs = None
    assert normalise(text).response == theirs


@pytest.mark.parametrize("name", PARITY_V3 + PARITY_V2)
def test_retrieved_context_agrees_with_mlflow(all_traces: dict[str, str], name: str) -> None:
    text = all_traces[name]
    assert _ours_context(normalise(text)) == _mlflow_context(_mlflow(text))


@pytest.mark.parametrize("name", PARITY_V3 + PARITY_V2)
def test_trajectory_agrees_with_mlflow_tool_calls(all_traces: dict[str, str], name: str) -> None:
    text = all_traces[name]
    ours = [(c.tool_name, c.tool_input) for c in normalise(text).trajectory]
    theirs = [(f.name, f.arguments) for f in trace_utils.extract_tools_called_from_trace(_mlflow(text))]
    assert ours == theirs


@pytest.mark.parametrize("name", PARITY_V3 + PARITY_V2)
def test_tokens_agree_with_mlflow(all_traces: dict[str, str], name: str) -> None:
    text = all_traces[name]
    assert _ours_tokens(normalise(text)) == _mlflow_tokens(_mlflow(text))


@pytest.mark.parametrize("name", PARITY_V3 + PARITY_V2)
def test_latency_and_failure_agree_with_trace_info(all_traces: dict[str, str], name: str) -> None:
    text = all_traces[name]
    record, info = normalise(text), _mlflow(text).info
    assert record.latency_seconds * 1000 == pytest.approx(info.execution_duration)
    assert record.failed is (info.state == TraceState.ERROR)
    assert record.timestamp * 1000 == pytest.approx(info.request_time)


@pytest.mark.parametrize("name", ["plain_text", "single_turn"])
def test_request_agrees_with_mlflow_when_mlflow_gives_the_question(v3_traces: dict[str, str],
                                                                  name: str) -> None:
    text = v3_traces[name]
    assert normalise(text).request == trace_utils.extract_request_from_trace(_mlflow(text))


def test_parity_corpus_covers_every_derived_field(all_traces: dict[str, str]) -> None:
    """The agreement tests above are only as good as the traces: each field is non-trivial somewhere."""
    records = {name: normalise(all_traces[name]) for name in PARITY_V3 + PARITY_V2}
    assert any(len(r.retrieved_context or []) >= 4 for r in records.values())
    assert any(len(r.trajectory) >= 4 for r in records.values())
    assert any(r.failed for r in records.values()) and any(r.failed is False for r in records.values())
    assert sum(r.tokens is not None for r in records.values()) >= 8
    assert {r.source_format for r in records.values()} == {"mlflow_v3", "mlflow_v2"}
    failing = records["failing"]
    assert failing.error == "RuntimeError: model endpoint returned 503"
    assert records["v2-failing"].error == "RuntimeError: model endpoint returned 503"


def test_wrapper_span_usage_is_counted_once(v3_traces: dict[str, str]) -> None:
    """An LLM span that rolls up its inner model call's usage: the inner call is not added again."""
    trace = _mlflow(v3_traces["wrapper_llm"])
    spans = {s.name: s for s in trace.data.spans}
    inner = spans["inner_chat"].get_attribute("mlflow.chat.tokenUsage")
    second = spans["second_call"].get_attribute("mlflow.chat.tokenUsage")
    assert spans["llm_wrapper"].get_attribute("mlflow.chat.tokenUsage") == inner
    tokens = normalise(v3_traces["wrapper_llm"]).tokens
    assert tokens.total == inner["total_tokens"] + second["total_tokens"]
    # The span-level sum is used when the trace states no usage: strip it and derive again.
    stripped = json.loads(v3_traces["wrapper_llm"])
    del stripped["info"]["trace_metadata"]["mlflow.trace.tokenUsage"]
    assert normalise(stripped).tokens == tokens


# --------------------------------------------------------------------------------------------
# deliberate differences, each with what MLflow gives


def test_request_from_function_arguments_is_the_question_not_a_python_repr(v3_traces: dict[str, str]) -> None:
    text = v3_traces["rag"]
    assert trace_utils.extract_request_from_trace(_mlflow(text)) == "{'question': 'What is MLflow?'}"
    assert normalise(text).request == "What is MLflow?"


def test_request_of_a_chat_with_several_messages_is_the_last_user_turn(v3_traces: dict[str, str]) -> None:
    text = v3_traces["multi_turn"]
    messages = _root_inputs(_mlflow(text))["messages"]
    assert trace_utils.extract_request_from_trace(_mlflow(text)) == json.dumps(messages)
    assert normalise(text).request == "And offsets?"
    # A system prompt followed by one user turn: MLflow also returns all messages as JSON.
    chat = v3_traces["chat"]
    assert trace_utils.extract_request_from_trace(_mlflow(chat)).startswith('[{"role": "system"')
    assert normalise(chat).request == "What is a consumer group?"


def test_request_of_query_and_history_is_the_query(v3_traces: dict[str, str]) -> None:
    text = v3_traces["query_history"]
    assert trace_utils.extract_request_from_trace(_mlflow(text)).startswith("{'query': 'What is MLflow?'")
    assert normalise(text).request == "What is MLflow?"


def test_request_of_a_nested_responses_request_is_the_user_input(v3_traces: dict[str, str]) -> None:
    text = v3_traces["responses"]
    assert trace_utils.extract_request_from_trace(_mlflow(text)).startswith("{'request': {'input'")
    assert normalise(text).request == "Are partitions ordered?"


def test_response_of_an_answer_dict_is_the_answer_text(v3_traces: dict[str, str]) -> None:
    text = v3_traces["query_history"]
    theirs = trace_utils.extract_response_from_trace(_mlflow(text))
    assert json.loads(theirs)["answer"] == normalise(text).response
    assert normalise(text).response == mlflow_apps.CORPUS["mlflow"][0][0]


def test_missing_output_is_none_not_a_blank(v3_traces: dict[str, str]) -> None:
    text = v3_traces["no_output"]
    assert trace_utils.extract_response_from_trace(_mlflow(text)) == " "
    assert normalise(text).response is None


def test_string_documents_are_kept(v3_traces: dict[str, str]) -> None:
    text = v3_traces["string_docs"]
    assert list(trace_utils.extract_retrieval_context_from_trace(_mlflow(text)).values()) == [[]]
    assert _ours_context(normalise(text)) == [{"content": "Plain string passage one."},
                                              {"content": "Plain string passage two."}]


def test_v2_tokens_are_summed_from_spans() -> None:
    text = _v2_traces()["v2-rag"]
    assert _mlflow(text).info.token_usage is None
    usage = aggregate_usage_from_spans(_mlflow(text).data.spans)
    assert usage is not None and _ours_tokens(normalise(text)) == usage


def test_json_text_fallback_is_compact_utf8_and_equal_as_json() -> None:
    """When neither side finds text, both give JSON: ours is compact UTF-8 (orjson), MLflow's is
    `json.dumps` (spaced, ASCII-escaped); they are equal as JSON."""
    trace = json.loads(mlflow_apps.run("query_history"))
    root = trace["data"]["spans"][0]
    root["attributes"]["mlflow.spanOutputs"] = json.dumps({"résumé": ["café", 1]})
    text = json.dumps(trace)
    theirs = trace_utils.extract_response_from_trace(_mlflow(text))
    ours = normalise(text).response
    assert theirs == '{"r\\u00e9sum\\u00e9": ["caf\\u00e9", 1]}'
    assert ours == '{"résumé":["café",1]}'
    assert json.loads(ours) == json.loads(theirs)
