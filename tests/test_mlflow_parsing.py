"""MLflow trace JSON -> `Trace`: ids, span kinds, payloads, usage, exceptions, trace-level fields.

Traces come from the real `mlflow` package (tests/support/mlflow_apps.py), MLflow 2.22
(tests/fixtures/mlflow2) and a trace a real MLflow 3.17 tracking server returned (shared/examples).
Each parsed field is compared with what `mlflow.entities.Trace.from_json` reads from the same text.
"""

from __future__ import annotations

import base64
import copy
import json
import pathlib

import pytest
from mlflow.entities import Trace as MlflowTrace
from mlflow.genai.utils import trace_utils
from support import mlflow_apps

from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.formats.mlflow import parse_trace
from tracejudge.schemas.trace import SpanKind, SpanStatus, TokenUsage

MLFLOW2 = pathlib.Path(__file__).parent / "fixtures" / "mlflow2" / "traces.jsonl"
# Returned by a real MLflow 3.17 tracking server (sqlite), with assessments.
SERVER_EXAMPLE = pathlib.Path(__file__).parent / "fixtures" / "examples" / "mlflow_trace_v3_example.json"


@pytest.fixture(scope="module")
def traces() -> dict[str, str]:
    return mlflow_apps.run_all()


def _v2(app: str) -> str:
    for line in MLFLOW2.read_text().splitlines():
        row = json.loads(line)
        if row["app"] == app:
            return row["trace"]
    raise KeyError(app)


def _spans_agree_with_mlflow(text: str) -> None:
    ours = parse_trace(json.loads(text))
    theirs = MlflowTrace.from_json(text)
    assert [s.span_id for s in ours.spans] == [s.span_id for s in theirs.data.spans]
    assert [s.parent_id for s in ours.spans] == [s.parent_id for s in theirs.data.spans]
    assert [s.kind.value for s in ours.spans] == [s.span_type for s in theirs.data.spans]
    assert [s.name for s in ours.spans] == [s.name for s in theirs.data.spans]
    assert [(s.start_ns, s.end_ns) for s in ours.spans] == [(s.start_time_ns, s.end_time_ns)
                                                            for s in theirs.data.spans]
    assert [s.status.value for s in ours.spans] == [s.status.status_code.value for s in theirs.data.spans]
    assert [s.inputs for s in ours.spans] == [s.inputs for s in theirs.data.spans]
    assert [s.outputs for s in ours.spans] == [s.outputs for s in theirs.data.spans]
    for span, theirs_span in zip(ours.spans, theirs.data.spans, strict=True):
        usage = theirs_span.get_attribute("mlflow.chat.tokenUsage")
        expected = None if usage is None else TokenUsage(usage["input_tokens"], usage["output_tokens"],
                                                         usage["total_tokens"])
        assert span.token_usage == expected
        assert span.exception == trace_utils._get_exception_from_span(theirs_span)


@pytest.mark.parametrize("app", [*mlflow_apps.APPS, *mlflow_apps.DIFFERING_APPS])
def test_v3_spans_agree_with_mlflow(traces: dict[str, str], app: str) -> None:
    _spans_agree_with_mlflow(traces[app])


@pytest.mark.parametrize("app", ["rag", "chat", "tools", "failing"])
def test_v2_spans_agree_with_mlflow(app: str) -> None:
    _spans_agree_with_mlflow(_v2(app))


def test_server_returned_trace_agrees_with_mlflow() -> None:
    _spans_agree_with_mlflow(SERVER_EXAMPLE.read_text())


def test_ids_are_lowercase_hex(traces: dict[str, str]) -> None:
    raw = json.loads(traces["tools"])
    trace = parse_trace(raw)
    assert raw["data"]["spans"][0]["span_id"].endswith("=")  # base64 on the wire
    assert all(len(s.span_id) == 16 and s.span_id == s.span_id.lower() for s in trace.spans)
    assert trace.trace_id == raw["info"]["trace_id"].removeprefix("tr-")
    assert len(trace.trace_id) == 32


def test_exception_events_become_span_exceptions(traces: dict[str, str]) -> None:
    tools = parse_trace(json.loads(traces["tools"]))
    flaky = next(s for s in tools.spans if s.name == "flaky_tool")
    assert flaky.exception == "ValueError: tool exploded"
    assert flaky.status == SpanStatus.ERROR and flaky.status_message == "ValueError: tool exploded"
    assert tools.state == "OK"  # the agent caught it
    failing = parse_trace(json.loads(traces["failing"]))
    assert failing.state == "ERROR"
    assert failing.spans[0].exception == "RuntimeError: model endpoint returned 503"


def test_trace_level_fields(traces: dict[str, str]) -> None:
    raw = json.loads(traces["tagged"])
    trace = parse_trace(raw)
    info = MlflowTrace.from_json(traces["tagged"]).info
    assert trace.source_format == "mlflow_v3"
    assert trace.app == f"experiment:{mlflow_apps.EXPERIMENT_ID}"
    assert trace.client_request_id == "client-42"
    assert trace.request_time_ms == info.request_time
    assert trace.duration_ms == info.execution_duration
    assert trace.tags["service"] == "checkout" and trace.tags["mlflow.trace.session"] == "sess-1"
    assert trace.tags["mlflow.trace.user"] == "user-9"
    assert trace.metadata["mlflow.trace_schema.version"] == "3"
    assert "mlflow.trace.tokenUsage" not in raw["info"]["trace_metadata"]  # this app calls no model
    assert trace.token_usage is None
    assert parse_trace(json.loads(traces["rag"])).token_usage == TokenUsage(
        **{k.removesuffix("_tokens"): v for k, v in
           MlflowTrace.from_json(traces["rag"]).info.token_usage.items()})
    record = normalise(traces["tagged"])
    assert record.request_id == "client-42" and record.trace_id == trace.trace_id
    assert record.timestamp == info.request_time / 1000


def test_app_tag_names_a_tag_or_metadata_key(traces: dict[str, str]) -> None:
    text = traces["tagged"]
    assert normalise(text, app_tag="service").app == "checkout"
    assert normalise(text, app_tag="mlflow.trace.session").app == "sess-1"
    # Absent from this trace: the experiment is the app.
    assert normalise(text, app_tag="no-such-tag").app == f"experiment:{mlflow_apps.EXPERIMENT_ID}"
    assert normalise(_v2("rag")).app.startswith("experiment:")


def test_expectations_come_from_expectation_assessments(traces: dict[str, str]) -> None:
    text = mlflow_apps.with_expectations(traces["rag"], expected_response="MLflow is a platform.",
                                         expected_facts=["open source", "ML lifecycle"],
                                         guidelines=["cite a document"],
                                         expected_retrieved_context=[{"doc_uri": "https://mlflow.org/docs/index.html"}])
    record = normalise(text)
    theirs = trace_utils.extract_expectations_from_trace(MlflowTrace.from_json(text))
    assert record.expected_response == theirs["expected_response"] == "MLflow is a platform."
    assert record.expected_facts == theirs["expected_facts"] == ["open source", "ML lifecycle"]
    assert record.guidelines == theirs["guidelines"]
    assert [d.doc_uri for d in record.expected_retrieved_context] == ["https://mlflow.org/docs/index.html"]
    # An invalidated (overridden) expectation is not used.
    raw = json.loads(text)
    for assessment in raw["info"]["assessments"]:
        if assessment["assessment_name"] == "expected_response":
            assessment["valid"] = False
    assert normalise(raw).expected_response is None


def test_server_example_expectation_and_feedback() -> None:
    record = normalise(SERVER_EXAMPLE.read_bytes())
    # Feedback assessments are judges' verdicts, not expectations.
    assert record.expected_response == "MLflow is an open-source platform."
    assert record.expected_facts is None
    assert record.request_id == "client-req-001"
    assert record.tags["env"] == "research"


def test_mlflow_3_5_hex_ids_and_status_names(traces: dict[str, str]) -> None:
    """MLflow 3.5 wrote hex span ids, the "tr-" id as span trace_id and "OK"/"ERROR" codes."""
    raw = json.loads(traces["tools"])
    old = copy.deepcopy(raw)
    for span in old["data"]["spans"]:
        for key in ("span_id", "parent_span_id"):
            if span[key]:
                span[key] = base64.b64decode(span[key]).hex()
        span["trace_id"] = raw["info"]["trace_id"]
        span["status"]["code"] = span["status"]["code"].removeprefix("STATUS_CODE_")
    ours_new, ours_old = parse_trace(raw), parse_trace(old)
    assert [(s.span_id, s.parent_id, s.status) for s in ours_old.spans] == \
        [(s.span_id, s.parent_id, s.status) for s in ours_new.spans]
    # MLflow 3.17 reads the old form the same way.
    assert [s.span_id for s in MlflowTrace.from_json(json.dumps(old)).data.spans] == \
        [s.span_id for s in ours_old.spans]


def test_proto_json_forms_are_read(traces: dict[str, str]) -> None:
    """Proto-JSON writers (MLflow 3.0-3.4, the REST API) give int64 as strings, a root parent as ""
    and the duration as a proto Duration."""
    raw = json.loads(traces["rag"])
    expected = normalise(raw)
    raw["data"]["spans"][0]["parent_span_id"] = ""
    for span in raw["data"]["spans"]:
        span["start_time_unix_nano"] = str(span["start_time_unix_nano"])
        span["end_time_unix_nano"] = str(span["end_time_unix_nano"])
    duration_ms = raw["info"].pop("execution_duration_ms")
    raw["info"]["execution_duration"] = f"{duration_ms / 1000}s"
    record = normalise(raw)
    assert record.latency_seconds == pytest.approx(expected.latency_seconds)
    assert (record.request, record.response, record.retrieved_context, record.tokens) == \
        (expected.request, expected.response, expected.retrieved_context, expected.tokens)


def test_v2_trace_fields() -> None:
    text = _v2("tools")
    trace = parse_trace(json.loads(text))
    info = MlflowTrace.from_json(text).info
    assert trace.source_format == "mlflow_v2"
    assert trace.trace_id == info.trace_id
    assert trace.state == "OK" and trace.duration_ms == info.execution_duration
    assert trace.request_time_ms == info.request_time
    assert [s.kind for s in trace.spans].count(SpanKind.TOOL) == 3
    failing = parse_trace(json.loads(_v2("failing")))
    assert failing.state == "ERROR"


def test_only_derivation_payloads_are_decoded_on_the_hot_path(traces: dict[str, str]) -> None:
    raw = json.loads(traces["rag"])
    full, lean = parse_trace(raw), parse_trace(raw, everything=False)
    chat_full = next(s for s in full.spans if s.kind == SpanKind.CHAT_MODEL)
    chat_lean = next(s for s in lean.spans if s.kind == SpanKind.CHAT_MODEL)
    assert chat_full.inputs["messages"] and chat_lean.inputs is None and chat_lean.outputs is None
    assert chat_lean.token_usage == chat_full.token_usage
    assert lean.spans[0].inputs == full.spans[0].inputs
    assert derive(full) == derive(lean)


def test_custom_attributes_are_decoded_and_kept() -> None:
    text = _v2("rag")
    raw = json.loads(text)
    raw["data"]["spans"][0]["attributes"]["custom.flag"] = '{"a": 1}'
    raw["data"]["spans"][0]["attributes"]["plain.text"] = "not json"  # set directly on the OTel span
    root = parse_trace(raw).spans[0]
    assert root.attributes == {"custom.flag": {"a": 1}, "plain.text": "not json"}
