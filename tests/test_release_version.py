"""The app's version (release) on every record (issue 26 item 4), from real producers.

MLflow traces made by the real `mlflow` package: the LoggedModel `mlflow.set_active_model` links them to
(`mlflow.modelId`, against a real sqlite tracking store), the git commit MLflow records by itself
(`mlflow.source.git.commit`), tags; spans and content log records made by the OpenTelemetry SDK with a
`Resource(service.version)`, and `gen_ai.agent.version`; rows of both row formats. Each through every
reader, and `stream.version_tag` over the conventions. Nothing states a version: None, never guessed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
import orjson
import pytest
from mlflow.entities import SpanType
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import set_span_in_context
from support import mlflow_apps
from support.otel_producers import kafka_messages

from tracejudge.consumer.config import Settings
from tracejudge.consumer.pipeline import Pipeline, build_pipeline
from tracejudge.consumer.stages.assembly import TraceAssembler
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats import otlp, otlp_logs
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.mlflow import parse_trace
from tracejudge.schemas.formats.mlflow_wire import derive_canonical_json
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import EvaluationResult, SourceRef

FIXTURES = Path(__file__).parent / "fixtures"
MODEL_ID, GIT_COMMIT = "mlflow.modelId", "mlflow.source.git.commit"


# --- MLflow traces ------------------------------------------------------------------------------------


@mlflow.trace(span_type=SpanType.AGENT)
def turn(question: str, metadata: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> str:
    """One turn with a model call stating usage (so the stream reads it on its lean path)."""
    if metadata or tags:
        mlflow.update_current_trace(metadata=metadata, tags=tags)
    return mlflow_apps.chat_model([{"role": "user", "content": question}], "An answer.")["choices"][0][
        "message"]["content"]


def every_reader(trace_json: str, pipeline: Pipeline | None = None) -> list[EvalRecord]:
    """The record from the bytes (msgspec, lean path), the text, the decoded object, and the general
    reader with every span decoded."""
    pipeline = pipeline or Pipeline()
    return [pipeline.normalise(trace_json.encode()), pipeline.normalise(trace_json),
            pipeline.normalise(orjson.loads(trace_json)),
            derive(parse_trace(orjson.loads(trace_json), everything=True, version_tag=pipeline.version_tag))]


@pytest.fixture
def tracking_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A real sqlite tracking store, so `mlflow.set_active_model(name=...)` creates a LoggedModel. In
    tmp_path as the working directory: a sqlite store puts its artifacts in ./mlruns."""
    monkeypatch.chdir(tmp_path)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        yield
    finally:
        mlflow.clear_active_model()
        mlflow.set_tracking_uri(previous)


def test_mlflow_logged_model_is_the_version_on_every_reader(tracking_store: None) -> None:
    model = mlflow.set_active_model(name="support-bot-v24")
    with mlflow_apps.capture() as traces:
        turn("Hi?")
        turn("Hi?", metadata={GIT_COMMIT: "abc1234"})
    for trace in traces:
        metadata = orjson.loads(trace)["info"]["trace_metadata"]
        assert metadata[MODEL_ID] == model.model_id  # what MLflow itself wrote
        assert derive_canonical_json(trace.encode()) is not None  # the stream's fast path reads it
        # The LoggedModel wins over the commit: it is the version the app declared.
        assert {r.version for r in every_reader(trace)} == {model.model_id}


def test_mlflow_git_commit_then_version_tag() -> None:
    with mlflow_apps.capture() as traces:
        turn("Hi?", metadata={GIT_COMMIT: "0f1e2d3c"})
        turn("Hi?", metadata={GIT_COMMIT: "0f1e2d3c"}, tags={"app_version": "2.4.1"})
        turn("Hi?", tags={"app_version": "  "})
        turn("Hi?")
    stated, tagged, blank, auto = traces
    assert {r.version for r in every_reader(stated)} == {"0f1e2d3c"}
    # `stream.version_tag` names a tag of the app's own: it wins where the trace has it.
    assert {r.version for r in every_reader(tagged, Pipeline(version_tag="app_version"))} == {"2.4.1"}
    assert {r.version for r in every_reader(stated, Pipeline(version_tag="app_version"))} == {"0f1e2d3c"}
    # A blank tag states nothing: the conventions answer (here the commit MLflow recorded by itself,
    # the checkout's, or nothing outside a git checkout, where MLflow writes "").
    recorded = orjson.loads(auto)["info"]["trace_metadata"].get(GIT_COMMIT) or None
    assert {r.version for r in every_reader(blank, Pipeline(version_tag="app_version"))} == {recorded}
    assert {r.version for r in every_reader(auto)} == {recorded}
    # On the result line, schema 6.
    record = Pipeline(version_tag="app_version").normalise(tagged.encode())
    source = SourceRef("mlflow", topic="t", partition=0, offset=1)
    line = orjson.loads(EvaluationResult(record=record, source=source).to_json())
    assert line["version"] == "2.4.1" and line["schema_version"] == 6


def test_mlflow_v2_trace_request_metadata_and_tags() -> None:
    """A trace recorded by MLflow 2 (fixture): its `request_metadata`, or a tag (MLflow 2 apps)."""
    first = (FIXTURES / "mlflow2" / "traces.jsonl").read_text().splitlines()[0]
    v2 = orjson.loads(json.loads(first)["trace"])
    assert Pipeline().normalise(v2).version is None
    v2["info"]["request_metadata"][MODEL_ID] = "m-v2model"
    assert Pipeline().normalise(orjson.dumps(v2)).version == "m-v2model"
    del v2["info"]["request_metadata"][MODEL_ID]
    v2["info"]["tags"][GIT_COMMIT] = "feedbeef"
    record = Pipeline().normalise(orjson.dumps(v2))
    assert (record.source_format, record.version) == ("mlflow_v2", "feedbeef")


# --- OpenTelemetry spans and content logs ---------------------------------------------------------------


class Service:
    """One instrumented service whose resource may state `service.version`."""

    def __init__(self, name: str, version: Any = None) -> None:
        attrs = {"service.name": name}
        if version is not None:
            attrs["service.version"] = version
        self.resource = Resource.create(attrs)
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(resource=self.resource)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("tracejudge.tests", "1.0")

    def finished(self) -> list[Any]:
        spans = list(self.exporter.get_finished_spans())
        self.exporter.clear()
        return spans


def trace_id(span: Any) -> str:
    return f"{span.get_span_context().trace_id:032x}"


def assembled(messages: list[tuple[str, bytes]], version_tag: str | None = None) -> dict[str, EvalRecord]:
    """Decode, assemble and derive as the stream does (`messages`: (format, payload))."""
    assembler = TraceAssembler(version_tag=version_tag)
    for fmt, payload in messages:
        if fmt in otlp_logs.FORMATS:
            assembler.add(otlp_logs.decode(payload, fmt), source_format=otlp_logs.ENCODING[fmt])
        else:
            fmt, groups = otlp.decode(payload)
            assembler.add(groups, source_format=fmt)
    return {t.trace.trace_id: t.record() for t in assembler.flush()}


def both_encodings(spans: list[Any], version_tag: str | None = None) -> list[dict[str, EvalRecord]]:
    return [assembled([(fmt, v) for _, v in kafka_messages(spans, per_message=2, fmt=fmt)], version_tag)
            for fmt in ("otlp_proto", "otlp_json")]


def agent_turn(service: Service, attributes: dict[str, Any] | None = None,
               child: dict[str, Any] | None = None) -> Any:
    t = service.tracer
    with (t.start_as_current_span("invoke_agent bot", attributes={"gen_ai.operation.name": "invoke_agent",
                                                                  **(attributes or {})}) as root,
          t.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat", **(child or {})})):
        pass
    return root


def test_otel_service_version_agent_version_and_version_tag() -> None:
    svc = Service("support-bot", "1.4.2")
    plain = agent_turn(svc)
    agent = agent_turn(svc, child={"gen_ai.agent.version": "agent-7"})
    both = agent_turn(svc, {"gen_ai.agent.version": "root-agent"}, {"gen_ai.agent.version": "child"})
    numbered = agent_turn(svc, {"gen_ai.agent.version": 3})
    blank = agent_turn(svc, {"gen_ai.agent.version": "", "app.release": True})
    tagged = agent_turn(svc, {"gen_ai.agent.version": "a", "app.release": "2026.11.27"})
    spans = svc.finished()
    for records in both_encodings(spans):
        assert records[trace_id(plain)].version == "1.4.2"
        # The agent's own version is more specific than its service's; the root's wins.
        assert records[trace_id(agent)].version == "agent-7"
        assert records[trace_id(both)].version == "root-agent"
        assert records[trace_id(numbered)].version == "3"  # a number is its text
        assert records[trace_id(blank)].version == "1.4.2"  # blank states nothing
    for records in both_encodings(spans, version_tag="app.release"):
        assert records[trace_id(tagged)].version == "2026.11.27"
        assert records[trace_id(blank)].version == "1.4.2"  # a bool states nothing
        assert records[trace_id(plain)].version == "1.4.2"


def test_otel_version_is_the_apps_service_never_another() -> None:
    """The app is the root's service: a downstream service's version is not the app's."""
    front, back = Service("frontend"), Service("backend", "9.9")
    with front.tracer.start_as_current_span("invoke_agent front") as root:
        context = set_span_in_context(root)
    with back.tracer.start_as_current_span("chat", context=context):
        pass
    unversioned = Service("bare")
    alone = agent_turn(unversioned)
    spans = front.finished() + back.finished() + unversioned.finished()
    for records in both_encodings(spans):
        assert records[trace_id(root)].app == "frontend"
        assert records[trace_id(root)].version is None
        assert records[trace_id(alone)].version is None


def test_otel_content_logs_resource_states_the_version() -> None:
    """Spans whose resource states no version; the same service's content log records (the GenAI
    instrumentors' events, on a logs topic) do."""
    svc = Service("chat-app")
    logs = InMemoryLogExporter()
    resource = Resource.create({"service.name": "chat-app", "service.version": "5.0"})
    provider = LoggerProvider(resource=resource)
    provider.add_log_record_processor(SimpleLogRecordProcessor(logs))
    with svc.tracer.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat"}) as span:
        provider.get_logger("openai").emit(event_name="gen_ai.user.message", body={"content": "Hi?"},
                                           context=set_span_in_context(span))
    payload = encode_logs(logs.get_finished_logs()).SerializeToString()
    spans = [("otlp_proto", p) for _, p in kafka_messages(svc.finished(), per_message=5)]
    record = assembled([("otlp_logs_proto", payload), *spans])[trace_id(span)]
    assert (record.app, record.version, record.request) == ("chat-app", "5.0", "Hi?")


# --- rows -----------------------------------------------------------------------------------------------


def test_agent_evaluation_rows() -> None:
    with mlflow_apps.capture() as traces:
        turn("Hi?", metadata={GIT_COMMIT: "trace-commit"})
    (trace,) = traces
    normalise = Pipeline().normalise
    row = {"request": "What is MLflow?", "response": "A platform."}
    assert normalise(row).version is None
    assert normalise({**row, "version": "v3"}).version == "v3"
    assert normalise({**row, "version": 12}).version == "12"
    assert normalise({**row, "version": " "}).version is None
    for embedded in (trace, orjson.loads(trace)):
        assert normalise({**row, "trace": embedded}).version == "trace-commit"
        # The row's own column wins over its trace's.
        assert normalise({**row, "trace": embedded, "version": "row"}).version == "row"
    tagged = Pipeline(version_tag="release").normalise
    assert tagged({**row, "version": "row", "release": "r-1"}).version == "r-1"
    assert tagged({**row, "version": "row", "tags": {"release": "r-2"}}).version == "r-2"
    with mlflow_apps.capture() as traces:
        turn("Hi?", tags={"release": "r-3"})
    assert tagged({**row, "version": "row", "trace": traces[0]}).version == "r-3"
    for bad in ([1], {"v": 1}, True):
        with pytest.raises(RecordError) as exc:
            normalise({**row, "version": bad})
        assert exc.value.field == "version"


def test_inference_log_rows() -> None:
    with mlflow_apps.capture() as traces:
        turn("Hi?", metadata={MODEL_ID: "m-served"})
    normalise = Pipeline().normalise
    row = {"databricks_request_id": "d-1", "status_code": 200,
           "request": json.dumps({"messages": [{"role": "user", "content": "Hi?"}]}),
           "response": json.dumps({"choices": [{"message": {"role": "assistant", "content": "Hello."}}]})}
    assert normalise(row).version is None
    assert normalise({**row, "version": 7}).version == "7"
    # A legacy table's request_metadata names the served model's version.
    legacy = {**row, "request_metadata": {"endpoint_name": "bot", "model_name": "bot", "model_version": "4"}}
    assert normalise(legacy).version == "4"
    assert normalise({**legacy, "version": "col"}).version == "col"
    answer = {"choices": [{"message": {"role": "assistant", "content": "Hi."}}]}
    output = {"trace": orjson.loads(traces[0])}
    served = {**row, "response": json.dumps({**answer, "databricks_output": output})}
    assert normalise(served).version == "m-served"
    assert normalise({**served, "version": "col"}).version == "col"
    tagged = Pipeline(version_tag="release").normalise
    assert tagged({**served, "version": "col", "release": "r"}).version == "r"
    with pytest.raises(RecordError) as exc:
        normalise({**row, "version": ["a"]})
    assert exc.value.field == "version"


def test_stream_version_tag_is_configuration() -> None:
    settings = Settings.model_validate({"stream": {"topics": ["traces"], "version_tag": "app_version"}})
    assert build_pipeline(settings).version_tag == "app_version"
    assert build_pipeline(Settings.model_validate({"stream": {"topics": ["traces"]}})).version_tag is None
