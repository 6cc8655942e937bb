"""Session and user identity on every record (issue 17, items 1–2), from real producers.

MLflow traces made by the real `mlflow` package with `mlflow.update_current_trace(metadata=...)`,
spans made by the OpenTelemetry SDK through OpenInference's tracer (`using_session`/`using_user`), by
OpenLLMetry's LangChain instrumentation (association properties from the run's metadata), by Google
ADK (`gen_ai.conversation.id`, a recorded fixture) and by hand with the GenAI attributes; rows of
both row formats. Each is read through `Pipeline.normalise` (or trace assembly, for spans) and
through `tracejudge eval`; results go to the broker keyed by session (an id over 256 bytes by its
hash, counted). Nothing states a session: None, never guessed.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import orjson
import pytest
from mlflow.entities import SpanType
from opentelemetry.trace import SpanKind
from support import mlflow_apps
from support.kafka import metric, produce, read_topic, running, settings, unique, wait_until
from support.otel_producers import Producer, kafka_messages

from tracejudge.consumer.pipeline import Pipeline
from tracejudge.consumer.stages.assembly import TraceAssembler
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats import otlp
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.mlflow import parse_trace
from tracejudge.schemas.formats.mlflow_wire import derive_canonical_json
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import EvaluationResult, SourceRef, session_key

FIXTURES = Path(__file__).parent / "fixtures"
SESSION, USER = "mlflow.trace.session", "mlflow.trace.user"


# --- MLflow traces ------------------------------------------------------------------------------------


@mlflow.trace(span_type=SpanType.AGENT)
def chat_turn(question: str, metadata: dict[str, str] | None = None, tags: dict[str, str] | None = None
              ) -> str:
    """One turn of a chat app: its session and user set as MLflow's docs say, and a model call
    with usage (so MLflow writes the trace's token usage and the stream reads it on its lean path)."""
    if metadata or tags:
        mlflow.update_current_trace(metadata=metadata, tags=tags)
    messages = [{"role": "user", "content": question}]
    return mlflow_apps.chat_model(messages, "An answer.")["choices"][0]["message"]["content"]


def mlflow_turns(*calls: tuple[str, dict[str, str] | None, dict[str, str] | None]) -> list[str]:
    with mlflow_apps.capture() as traces:
        for question, metadata, tags in calls:
            chat_turn(question, metadata, tags)
    assert len(traces) == len(calls)
    return traces


def every_reader(trace_json: str, pipeline: Pipeline | None = None) -> list[EvalRecord]:
    """The record of an MLflow trace from the bytes (msgspec, lean path), the text and the decoded
    object (the general reader), and the general reader with every span decoded."""
    pipeline = pipeline or Pipeline()
    tag = pipeline.session_tag
    return [pipeline.normalise(trace_json.encode()), pipeline.normalise(trace_json),
            pipeline.normalise(orjson.loads(trace_json)),
            derive(parse_trace(orjson.loads(trace_json), everything=True, session_tag=tag))]


def test_mlflow_v3_trace_metadata_gives_session_and_user_on_every_reader():
    with_ids, without = mlflow_turns(("Hi?", {SESSION: "s1", USER: "u1"}, None), ("Hi?", None, None))
    info = orjson.loads(with_ids)["info"]
    assert info["trace_metadata"][SESSION] == "s1" and "mlflow.trace.tokenUsage" in info["trace_metadata"]
    # The stream's fast path reads this trace (it states its usage: the lean span walk).
    assert derive_canonical_json(with_ids.encode()) is not None
    for record in every_reader(with_ids):
        assert (record.session_id, record.user_id) == ("s1", "u1")
        assert record.source_format == "mlflow_v3"
        # Still a tag too, as before (usable in sampling filters).
        assert record.tags[SESSION] == "s1"
    for record in every_reader(without):
        assert (record.session_id, record.user_id) == (None, None)


def test_mlflow_session_id_argument_and_session_tag():
    """`update_current_trace(session_id=..., user=...)` (MLflow 3's keywords) lands in the same
    metadata; `stream.session_tag` names a tag whose value is the session instead, when present."""
    with mlflow_apps.capture() as traces:
        mlflow_apps.tagged_agent("Where?")
    (tagged,) = traces
    for record in every_reader(tagged):
        assert (record.session_id, record.user_id) == ("sess-1", "user-9")
    for record in every_reader(tagged, Pipeline(session_tag="team")):
        assert (record.session_id, record.user_id) == ("payments", "user-9")
    # A tag the trace does not have leaves the conventions' answer.
    for record in every_reader(tagged, Pipeline(session_tag="conversation")):
        assert record.session_id == "sess-1"


def test_mlflow_v2_trace_request_metadata_and_tags():
    """A trace recorded by MLflow 2 (fixture), with the session keys added the two ways MLflow 2 apps
    set them: in `request_metadata` (the keys MLflow 3 reads) or as tags (MLflow 2's
    `update_current_trace` took tags only)."""
    first = (FIXTURES / "mlflow2" / "traces.jsonl").read_text().splitlines()[0]
    v2 = orjson.loads(json.loads(first)["trace"])
    assert Pipeline().normalise(v2).session_id is None
    v2["info"]["request_metadata"].update({SESSION: "v2-s", USER: "v2-u"})
    as_metadata = orjson.dumps(v2)
    v2["info"]["request_metadata"] = {k: v for k, v in v2["info"]["request_metadata"].items()
                                      if k not in (SESSION, USER)}
    v2["info"]["tags"].update({SESSION: "v2-t", USER: "v2-tu"})
    as_tags = orjson.dumps(v2)
    for payload, want in ((as_metadata, ("v2-s", "v2-u")), (as_tags, ("v2-t", "v2-tu"))):
        record = Pipeline().normalise(payload)
        assert record.source_format == "mlflow_v2"
        assert (record.session_id, record.user_id) == want


# --- OpenTelemetry spans --------------------------------------------------------------------------------


def assembled(messages: list[bytes], session_tag: str | None = None) -> dict[str, EvalRecord]:
    """Decode, assemble and derive, as the stream does: one record per trace id."""
    assembler = TraceAssembler(session_tag=session_tag)
    for payload in messages:
        fmt, groups = otlp.decode(payload)
        assembler.add(groups, source_format=fmt)
    return {t.trace.trace_id: t.record() for t in assembler.flush()}


def both_encodings(spans: list[Any], session_tag: str | None = None) -> list[dict[str, EvalRecord]]:
    return [assembled([v for _, v in kafka_messages(spans, per_message=2, fmt=fmt)], session_tag)
            for fmt in ("otlp_proto", "otlp_json")]


def test_openinference_session_and_user_context():
    """OpenInference's tracer puts `using_session`/`using_user` on every span it starts."""
    from openinference.instrumentation import OITracer, TraceConfig, using_session, using_user

    producer = Producer("support-bot")
    tracer = OITracer(producer.tracer, TraceConfig())
    with (using_session("conv-1"), using_user("alice"),
          tracer.start_as_current_span("agent", openinference_span_kind="agent") as root):
        root.set_input("Where is my order?")
        root.set_output("On its way.")
        with tracer.start_as_current_span("llm", openinference_span_kind="llm"):
            pass
    with tracer.start_as_current_span("agent", openinference_span_kind="agent") as other:
        other.set_input("And without a session?")
    spans = producer.finished()
    turn, alone = f"{root.get_span_context().trace_id:032x}", f"{other.get_span_context().trace_id:032x}"
    for records in both_encodings(spans):
        assert (records[turn].session_id, records[turn].user_id) == ("conv-1", "alice")
        assert records[turn].request == "Where is my order?"
        assert (records[alone].session_id, records[alone].user_id) == (None, None)


def test_openllmetry_langchain_association_properties():
    """OpenLLMetry's LangChain instrumentation writes the run's metadata as Traceloop association
    properties on every span (`traceloop.association.properties.session_id` / `user_id`)."""
    from langchain_core.runnables import RunnableLambda
    from opentelemetry.instrumentation.langchain import LangchainInstrumentor

    producer = Producer("lc-app")
    instrumentor = LangchainInstrumentor()
    instrumentor.instrument(tracer_provider=producer.provider)
    try:
        chain = RunnableLambda(lambda q: q.upper()) | RunnableLambda(lambda s: s + "!")
        assert chain.invoke("hi", config={"metadata": {"session_id": "lc-s1", "user_id": "lc-u1"}}) == "HI!"
        chain.invoke("no session")
    finally:
        instrumentor.uninstrument()
    spans = producer.finished()
    assert any("traceloop.association.properties.session_id" in (s.attributes or {}) for s in spans)
    for records in both_encodings(spans):
        got = sorted((r.session_id or "", r.user_id or "") for r in records.values())
        assert got == [("", ""), ("lc-s1", "lc-u1")]


def test_google_adk_conversation_id_fixture():
    """Google ADK (recorded fixture) states its session as `gen_ai.conversation.id` on its spans,
    one conversation per run; it states no user."""
    doc = json.loads((FIXTURES / "instrumented" / "google_adk" / "traces.json").read_text())
    stated: dict[str, set[str]] = {}
    for rs in doc["otlp_json"]["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                attrs = {a["key"]: a["value"].get("stringValue") for a in span.get("attributes", [])}
                if "gen_ai.conversation.id" in attrs:
                    stated.setdefault(span["traceId"].lower(), set()).add(attrs["gen_ai.conversation.id"])
    assert len(stated) == len(doc["cases"]) and all(len(ids) == 1 for ids in stated.values())
    records = assembled([orjson.dumps(doc["otlp_json"])])
    assert {tid: r.session_id for tid, r in records.items()} == {t: ids.pop() for t, ids in stated.items()}
    assert all(r.user_id is None for r in records.values())


def _hex(span: Any) -> str:
    return f"{span.get_span_context().trace_id:032x}"


def test_genai_conversation_id_below_an_http_root_and_root_preference():
    """An HTTP server root without them: the app span's `gen_ai.conversation.id` and `user.id`.
    A root stating its own session wins over a different one below it; a number is read as its
    text; an empty value states nothing (the next span's counts)."""
    producer = Producer("chat-api")
    t = producer.tracer
    with (t.start_as_current_span("POST /chat", kind=SpanKind.SERVER) as http,
          t.start_as_current_span("invoke_agent helper", attributes={
              "gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "thread-7",
              "user.id": "u-7"})):
        pass
    with (t.start_as_current_span("invoke_agent a", attributes={
              "gen_ai.operation.name": "invoke_agent", "session.id": "root-s"}) as preferred,
          t.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat",
                                                      "session.id": "child-s", "user.id": 42})):
        pass
    with (t.start_as_current_span("invoke_agent b", attributes={
              "gen_ai.operation.name": "invoke_agent", "session.id": "", "user.id": " "}) as blank,
          t.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat",
                                                      "gen_ai.conversation.id": 1234})):
        pass
    spans = producer.finished()
    for records in both_encodings(spans):
        assert (records[_hex(http)].session_id, records[_hex(http)].user_id) == ("thread-7", "u-7")
        assert (records[_hex(preferred)].session_id, records[_hex(preferred)].user_id) == ("root-s", "42")
        assert (records[_hex(blank)].session_id, records[_hex(blank)].user_id) == ("1234", None)
    # `stream.session_tag` names an attribute of the app's own instead.
    with t.start_as_current_span("invoke_agent c", attributes={
            "gen_ai.operation.name": "invoke_agent", "session.id": "conventional",
            "app.conversation": "from-tag"}) as own:
        pass
    with t.start_as_current_span("invoke_agent d", attributes={
            "gen_ai.operation.name": "invoke_agent", "session.id": "conventional"}) as untagged:
        pass
    spans = producer.finished()
    for records in both_encodings(spans, session_tag="app.conversation"):
        assert records[_hex(own)].session_id == "from-tag"
        assert records[_hex(untagged)].session_id == "conventional"


# --- rows -----------------------------------------------------------------------------------------------


def test_agent_evaluation_rows():
    (trace,) = mlflow_turns(("Hi?", {SESSION: "trace-s", USER: "trace-u"}, None))
    normalise = Pipeline().normalise
    row = {"request": "What is MLflow?", "response": "A platform."}
    assert (normalise(row).session_id, normalise(row).user_id) == (None, None)
    got = normalise({**row, "session_id": "row-s", "user_id": 7})
    assert (got.session_id, got.user_id) == ("row-s", "7")
    # The embedded trace's metadata fills what the row leaves out; the row's own columns win.
    for embedded in (trace, orjson.loads(trace)):
        got = normalise({**row, "trace": embedded})
        assert (got.session_id, got.user_id) == ("trace-s", "trace-u")
        got = normalise({**row, "trace": embedded, "session_id": "row-s", "user_id": ""})
        assert (got.session_id, got.user_id) == ("row-s", "trace-u")
    # `stream.session_tag`: a field of the row, a key of its tags, or a tag of its trace.
    tagged = Pipeline(session_tag="conversation").normalise
    assert tagged({**row, "session_id": "row-s", "conversation": "c-1"}).session_id == "c-1"
    assert tagged({**row, "session_id": "row-s", "tags": {"conversation": "c-2"}}).session_id == "c-2"
    (with_tag,) = mlflow_turns(("Hi?", {SESSION: "trace-s"}, {"conversation": "c-3"}))
    assert tagged({**row, "session_id": "row-s", "trace": with_tag}).session_id == "c-3"
    assert tagged({**row, "session_id": "row-s"}).session_id == "row-s"
    # An id that identifies nothing is bad input, named.
    for bad in ([1], {"id": 1}, True):
        with pytest.raises(RecordError) as exc:
            normalise({**row, "session_id": bad})
        assert exc.value.field == "session_id"


def test_inference_log_rows():
    (trace,) = mlflow_turns(("Hi?", {SESSION: "served-s", USER: "served-u"}, None))
    normalise = Pipeline().normalise
    row = {"databricks_request_id": "d-1", "status_code": 200,
           "request": json.dumps({"messages": [{"role": "user", "content": "Hi?"}]}),
           "response": json.dumps({"choices": [{"message": {"role": "assistant", "content": "Hello."}}]})}
    got = normalise(row)
    assert got.source_format == "inference_log" and (got.session_id, got.user_id) == (None, None)
    got = normalise({**row, "session_id": 99, "user_id": "u"})
    assert (got.session_id, got.user_id) == ("99", "u")
    answer = {"choices": [{"message": {"role": "assistant", "content": "Hi."}}]}
    served = {**row, "response": json.dumps({**answer, "databricks_output": {"trace": orjson.loads(trace)}})}
    got = normalise(served)
    assert (got.session_id, got.user_id) == ("served-s", "served-u")
    assert normalise({**served, "session_id": "col-s"}).session_id == "col-s"
    assert Pipeline(session_tag="thread").normalise({**served, "thread": "t-1"}).session_id == "t-1"
    with pytest.raises(RecordError) as exc:
        normalise({**row, "user_id": ["a"]})
    assert exc.value.field == "user_id"


# --- tracejudge eval --------------------------------------------------------------------------------------


def _eval(src: Path, config: Path | None = None) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "tracejudge.consumer.commands.cli", "eval", str(src), "--quiet"]
    if config is not None:
        cmd += ["--config", str(config)]
    proc = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    # Trace result lines only: a session's own result line (`"kind": "session"`) is another shape.
    return [x for x in map(orjson.loads, proc.stdout.splitlines()) if x.get("kind") != "session"]


def test_eval_writes_session_and_user_of_every_format(tmp_path):
    from openinference.instrumentation import OITracer, TraceConfig, using_session

    mlflow_turn, mlflow_alone = mlflow_turns(("Turn one?", {SESSION: "m-s", USER: "m-u"}, {"thread": "t-9"}),
                                             ("Alone?", None, None))
    producer = Producer("otel-app")
    tracer = OITracer(producer.tracer, TraceConfig())
    with using_session("o-s"), tracer.start_as_current_span("agent", openinference_span_kind="agent") as root:
        root.set_input("Turn two?")
        root.set_output("Yes.")
    otlp_lines = [v.decode() for _, v in kafka_messages(producer.finished(), per_message=5, fmt="otlp_json")]
    src = tmp_path / "turns.jsonl"
    src.write_text("\n".join([
        mlflow_turn, mlflow_alone, *otlp_lines,
        json.dumps({"request_id": "row-1", "request": "Turn three?", "response": "Ok.", "session_id": "a-s",
                    "user_id": "a-u"}),
        json.dumps({"databricks_request_id": "d-1", "status_code": 200, "request": "Turn four?",
                    "response": "Ok.", "session_id": 5}),
        json.dumps({"request_id": "row-2", "request": "No session?", "response": "None."}),
    ]) + "\n")
    lines = _eval(src)
    assert all(x["schema_version"] == 6 for x in lines)
    got = {x["request"]: (x["session_id"], x["user_id"]) for x in lines}
    assert got == {"Turn one?": ("m-s", "m-u"), "Alone?": (None, None), "Turn two?": ("o-s", None),
                   "Turn three?": ("a-s", "a-u"), "Turn four?": ("5", None), "No session?": (None, None)}
    # `stream.session_tag` from the configuration file.
    config = tmp_path / "tracejudge.yaml"
    config.write_text("stream:\n  session_tag: thread\n")
    got = {x["request"]: x["session_id"] for x in _eval(src, config)}
    assert got["Turn one?"] == "t-9" and got["Turn two?"] == "o-s" and got["No session?"] is None


# --- keyed by session on the results topic -----------------------------------------------------------------

LONG_SESSION = "conv-" + "é" * 150  # 155 characters, 305 UTF-8 bytes


def test_the_result_key_is_the_session_key():
    def key(**ids: Any) -> str | None:
        return EvaluationResult(EvalRecord(request_id="r", trace_id="t", **ids), SourceRef("mlflow_v3")).key

    assert key() == "t" and key(session_id="s") == "s" and key(user_id="u") == "t"
    exactly = "x" * 256
    assert key(session_id=exactly) == exactly and session_key(exactly) == (exactly, False)
    digest = hashlib.sha256(LONG_SESSION.encode()).hexdigest()
    assert key(session_id=LONG_SESSION) == f"sha256:{digest}"
    assert session_key(LONG_SESSION) == (f"sha256:{digest}", True)


@contextmanager
def _stream(broker: Any, topic: str, results: str) -> Iterator[Any]:
    s = settings(broker.bootstrap_servers, [f"{topic}:mlflow"],
                 **{"stream.results_topic": results, "kafka.group_id": unique("group"),
                    "stream.decode_workers": 0})
    with running(s) as runner:
        yield runner


def test_the_stream_keys_turns_by_session_and_counts_hashed_ids(broker):
    """Real MLflow turns through the broker: both turns of a session under its id, a 305-byte id
    under its hash (counted), a trace without a session under its trace id."""
    bs = broker.bootstrap_servers
    topic, results = unique("turns"), unique("results")
    traces = mlflow_turns(("One?", {SESSION: "short-s", USER: "u1"}, None),
                          ("Two?", {SESSION: "short-s"}, None),
                          ("Long?", {SESSION: LONG_SESSION}, None), ("None?", None, None))
    trace_ids = [orjson.loads(t)["info"]["trace_id"].removeprefix("tr-") for t in traces]
    produce(bs, topic, [t.encode() for t in traces], keys=[i.encode() for i in trace_ids])
    with _stream(broker, topic, results) as runner:
        port = runner.http_port
        wait_until(lambda: metric(port, "tracejudge_results_published_total") == 4, 60,
                   message="4 results published")
        assert metric(port, "tracejudge_session_ids_hashed_total") == 1
    out = read_topic(bs, results, at_least=4)
    keys = {orjson.loads(r.value)["request"]: r.key.decode() for r in out}
    digest = hashlib.sha256(LONG_SESSION.encode()).hexdigest()
    assert keys == {"One?": "short-s", "Two?": "short-s", "Long?": f"sha256:{digest}", "None?": trace_ids[3]}
    lines = {orjson.loads(r.value)["request"]: orjson.loads(r.value) for r in out}
    # The line keeps the whole id; only the key is hashed.
    assert lines["Long?"]["session_id"] == LONG_SESSION and lines["One?"]["user_id"] == "u1"
    # Turns of one session share a partition.
    assert len({r.partition for r in out if r.key == b"short-s"}) == 1
