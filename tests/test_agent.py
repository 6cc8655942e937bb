"""The demo's synthetic agent: its traces are real MLflow traces and it makes what it is asked to make."""

from __future__ import annotations

import json
import os

import pytest
from mlflow.entities import SpanType, Trace, TraceState

from tracejudge.consumer.demo.agent import APP_TAG, APPS, GIVE_UPS, AgentSettings, SyntheticRagAgent


def produce(count: int, **settings: object) -> list:
    with SyntheticRagAgent(AgentSettings(**settings)) as agent:  # type: ignore[arg-type]
        return list(agent.traces(count))


def spans_of(trace: Trace, span_type: str) -> list:
    return [s for s in trace.data.spans if s.span_type == span_type]


def root_of(trace: Trace):
    return next(s for s in trace.data.spans if s.parent_id is None)


def test_traces_are_mlflow_v3_traces_with_retrieval_model_call_and_apps():
    made = produce(120, seed=7, failure_share=0.0)
    apps = set()
    for item in made:
        trace = Trace.from_json(item.payload.decode())
        assert trace.info.trace_id == item.trace_id and item.trace_id.startswith("tr-")
        assert json.loads(item.payload)["info"]["trace_metadata"]["mlflow.trace_schema.version"] == "3"
        assert trace.info.state == TraceState.OK
        assert trace.info.tags[APP_TAG] == item.app
        apps.add(item.app)
        root = root_of(trace)
        assert root.span_type == SpanType.AGENT
        assert root.inputs["messages"][-1]["role"] == "user"
        assert isinstance(root.outputs, str) and root.outputs
        (retriever,) = spans_of(trace, SpanType.RETRIEVER)
        assert len(retriever.outputs) == 3
        assert all(d["metadata"]["doc_uri"].startswith("https://") and d["page_content"]
                   for d in retriever.outputs)
        (chat,) = spans_of(trace, SpanType.CHAT_MODEL)
        usage = chat.get_attribute("mlflow.chat.tokenUsage")
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
        # MLflow rolled the span usage up to the trace, as it does for a tracking server.
        assert trace.info.token_usage == usage
        # Simulated, but plausible and consistent: children inside the root, root ~ execution duration.
        assert all(root.start_time_ns <= s.start_time_ns <= s.end_time_ns <= root.end_time_ns
                   for s in trace.data.spans)
        assert trace.info.execution_duration == (root.end_time_ns - root.start_time_ns) // 1_000_000 > 100
    assert apps == set(APPS)


def test_ungrounded_share_is_honoured_and_ungrounded_answers_state_nothing_retrieved():
    made = produce(400, seed=11, ungrounded_share=0.3, failure_share=0.0)
    ungrounded = [m for m in made if m.grounded is False]
    assert 0.24 <= len(ungrounded) / len(made) <= 0.36
    for item in made:
        trace = Trace.from_json(item.payload.decode())
        answer = root_of(trace).outputs
        context = " ".join(d["page_content"] for d in spans_of(trace, SpanType.RETRIEVER)[0].outputs)
        sentences = [s.strip() + "." for s in answer.split(".") if s.strip()]
        supported = [s in context for s in sentences]
        assert all(supported) if item.grounded else not any(supported), (item.grounded, answer, context)


def test_all_grounded_and_all_ungrounded_extremes():
    assert all(m.grounded for m in produce(40, seed=1, ungrounded_share=0.0, failure_share=0.0))
    assert not any(m.grounded for m in produce(40, seed=1, ungrounded_share=1.0, failure_share=0.0))


def test_failures_raise_and_are_recorded_on_the_failing_span_and_the_root():
    made = produce(60, seed=5, failure_share=1.0)
    kinds = set()
    for item in made:
        assert item.failed and item.grounded is None
        trace = Trace.from_json(item.payload.decode())
        assert trace.info.state == TraceState.ERROR
        root = root_of(trace)
        assert root.status.status_code == "ERROR"
        (event,) = [e for e in root.events if e.name == "exception"]
        assert root.status.description == f"{event.attributes['exception.type']}: " \
                                          f"{event.attributes['exception.message']}"
        assert "Traceback" in event.attributes["exception.stacktrace"]
        failing = [s for s in trace.data.spans if s is not root and s.status.status_code == "ERROR"]
        assert len(failing) == 1 and failing[0].events[0].name == "exception"
        kinds.add(failing[0].span_type)
        # A request that failed produced no answer and, when the model call failed, no usage.
        assert root.outputs is None
    assert kinds == {SpanType.RETRIEVER, SpanType.TOOL, SpanType.CHAT_MODEL}


def test_failure_share_is_honoured():
    made = produce(400, seed=2, failure_share=0.1)
    assert 0.06 <= sum(m.failed for m in made) / len(made) <= 0.14


def test_some_requests_call_tools_recorded_as_tool_spans():
    made = produce(100, seed=3, failure_share=0.0)
    with_tools = [m for m in made if m.tools]
    assert 0.2 <= len(with_tools) / len(made) <= 0.6
    names = set()
    for item in with_tools:
        (tool,) = spans_of(Trace.from_json(item.payload.decode()), SpanType.TOOL)
        assert (tool.name,) == item.tools and tool.inputs and tool.outputs
        names.add(tool.name)
    assert len(names) >= 3


def test_a_seed_reproduces_ids_and_content():
    def content(payload: bytes) -> list:
        spans = json.loads(payload)["data"]["spans"]
        return [(s["span_id"], s["name"], s["attributes"].get("mlflow.spanInputs"),
                 s["attributes"].get("mlflow.spanOutputs")) for s in spans]

    first, second = produce(15, seed=42), produce(15, seed=42)
    assert [m.trace_id for m in first] == [m.trace_id for m in second]
    assert [content(m.payload) for m in first] == [content(m.payload) for m in second]
    assert [m.trace_id for m in produce(15, seed=43)] != [m.trace_id for m in first]


def test_writes_nothing_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    produce(20, seed=1)
    assert os.listdir(tmp_path) == []


def test_one_agent_at_a_time_and_shares_are_validated():
    with SyntheticRagAgent(AgentSettings(seed=1)), pytest.raises(RuntimeError, match="another"):
        SyntheticRagAgent().open()
    # The first agent's close released MLflow's tracer for the next one.
    assert len(produce(1)) == 1
    with pytest.raises(ValueError, match="ungrounded_share"):
        AgentSettings(ungrounded_share=1.5)
    with pytest.raises(ValueError, match="apps"):
        AgentSettings(apps=("nope",))


def test_tracejudge_normalises_the_agents_traces_into_what_the_agent_did():
    from tracejudge.schemas.formats.detect import normalise

    made = produce(80, seed=9, failure_share=0.2)
    for item in made:
        record = normalise(item.payload, app_tag=APP_TAG)
        assert record.source_format == "mlflow_v3"
        assert record.app == item.app
        # docs/pages/concepts/record.md promises `tr-…`; either way the OTel trace id must survive.
        assert record.trace_id.endswith(item.trace_id.removeprefix("tr-"))
        assert record.request and record.request.endswith("?")
        assert record.failed is item.failed
        assert record.latency_seconds is not None and record.latency_seconds > 0
        assert [c.tool_name for c in record.trajectory or []] == list(item.tools) or item.failed
        if item.failed:
            assert record.response is None and record.error
        else:
            assert record.response and record.error is None
            assert len(record.retrieved_context) == 3
            assert all(d.content and d.doc_uri for d in record.retrieved_context)
            assert record.tokens.total == record.tokens.input + record.tokens.output > 0
    # Without the tag setting the app is the MLflow experiment, one per app.
    assert {normalise(m.payload).app for m in made} == {"experiment:1", "experiment:2"}


def test_requests_are_turns_of_interleaved_conversations_some_frustrated():
    """Conversations carry MLflow's session and user metadata; a frustrated user asks, repeats the
    question and gives up; no conversation waits more than two rounds for its next turn."""
    with SyntheticRagAgent(AgentSettings(seed=12, frustrated_share=0.3, failure_share=0.0,
                                         concurrent_conversations=5)) as agent:
        made = list(agent.traces(300))
        assert agent.open_conversations == 5
        made += list(agent.finish_conversations())
        assert agent.open_conversations == 0
    by_session: dict[str, list] = {}
    first_seen: dict[str, int] = {}
    last_seen: dict[str, int] = {}
    for i, item in enumerate(made):
        trace = Trace.from_json(item.payload.decode())
        assert trace.info.trace_metadata["mlflow.trace.session"] == item.session_id
        assert trace.info.trace_metadata["mlflow.trace.user"] == item.user_id
        # What MLflow's OTLP ingest reads for the session (trace metadata is not sent over OTLP).
        assert root_of(trace).attributes["session.id"] == item.session_id
        if item.session_id in last_seen:
            assert i - last_seen[item.session_id] <= 2 * 5
        last_seen[item.session_id] = i
        first_seen.setdefault(item.session_id, i)
        text = root_of(trace).inputs["messages"][-1]["content"]
        by_session.setdefault(item.session_id, []).append((item, text))
    # Interleaved: most conversations' turns are not next to each other.
    spread = [last_seen[sid] - first_seen[sid] >= len(turns) for sid, turns in by_session.items()
              if len(turns) > 1]
    assert sum(spread) > len(spread) / 2
    frustrated = [turns for turns in by_session.values() if turns[0][0].frustrated]
    assert 0.2 <= len(frustrated) / len(by_session) <= 0.4
    for turns in by_session.values():
        items = [t for t, _ in turns]
        assert [t.turn for t in items] == list(range(1, len(items) + 1))
        assert [t.conversation_ended for t in items] == [False] * (len(items) - 1) + [True]
        assert len({t.app for t in items}) == 1 and len({t.user_id for t in items}) == 1
        texts = [text for _, text in turns]
        if items[0].frustrated:
            assert len(items) in (3, 4)
            assert all(texts[0] in repeat for repeat in texts[1:-1])
            assert texts[-1] in GIVE_UPS
        else:
            assert 1 <= len(items) <= 4
            assert len(set(texts)) == len(texts) and all(t.endswith("?") for t in texts)


def test_the_heuristic_frustration_judge_finds_exactly_the_conversations_the_agent_made_unresolved():
    """The demo's comparison without a broker: each conversation of the agent as one session (the
    offline grouping of `tracejudge eval`), judged by the heuristic user_frustration judge."""
    from prometheus_client import CollectorRegistry

    from tracejudge.consumer.pipeline import Pipeline
    from tracejudge.metrics.judges.sessions import SessionJudgeRunner
    from tracejudge.schemas.result import SourceRef
    from tracejudge.sessions import SessionEvaluation, SessionGrouper

    pipeline = Pipeline(app_tag=APP_TAG)
    grouper = SessionGrouper()
    expected: dict[str, bool] = {}
    with SyntheticRagAgent(AgentSettings(seed=21, frustrated_share=0.25, failure_share=0.1)) as agent:
        for item in [*agent.traces(400), *agent.finish_conversations()]:
            record = pipeline.normalise(item.payload)
            grouper.add(pipeline.evaluate(record, SourceRef("mlflow_v3")))
            if item.conversation_ended:
                expected[item.session_id] = item.frustrated or item.failed
    judges = SessionJudgeRunner({}, CollectorRegistry())
    try:
        sessions = list(SessionEvaluation(judges).results(grouper.close_all()))
    finally:
        judges.close()
    assert {s.session_id for s in sessions} == set(expected)
    verdicts = {s.session_id: s.assessment("user_frustration").value for s in sessions}
    unresolved = {sid for sid, v in verdicts.items() if v == "unresolved"}
    assert unresolved == {sid for sid, e in expected.items() if e}
    assert sum(expected.values()) >= 10
