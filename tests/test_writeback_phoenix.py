"""The Phoenix sink (`tracejudge sink phoenix`) against a real Arize Phoenix server.

Phoenix is `phoenix serve` from the test extra (SQLite in a temporary directory, free loopback ports),
its traces sent by OpenInference instrumentation of the real `openai` client talking to the loopback
OpenAI-compatible stub. The sink is driven as the sink runtime drives it (`write` per partition batch)
and, for delivery across a SIGKILL, as the real `tracejudge sink phoenix` process on the Tansu broker.
A misbehaving Phoenix (429, 5xx, refusals) is the loopback stub answering on Phoenix's paths.
"""

from __future__ import annotations

import logging
import signal
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry
from support.clock import FakeClock
from support.kafka import committed_offsets, ends, produce, unique, wait_until
from support.openai_stub import OpenAIStub, Reply
from support.phoenix_server import Chat, PhoenixServer, instrumented_chats
from support.sinks import SinkProcess

from tracejudge.consumer.config import ConfigError
from tracejudge.consumer.sinks.base import Deferral, RetryLater, SinkBatch, SinkRecord, WriteReport
from tracejudge.consumer.sinks.phoenix import PhoenixSink, PhoenixSinkSettings, annotation_identifier
from tracejudge.schemas.session import SessionResult

RESULTS = "results"


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PhoenixServer]:
    with PhoenixServer(tmp_path_factory.mktemp("phoenix")) as server:
        yield server


@pytest.fixture(scope="module")
def openai_stub() -> Iterator[OpenAIStub]:
    with OpenAIStub() as stub:
        yield stub


def make_sink(url: str, registry: CollectorRegistry | None = None, clock: Any = None,
              env: dict[str, str] | None = None, **settings: Any) -> PhoenixSink:
    s = PhoenixSinkSettings.from_mapping({"endpoint": url, **settings}, env=env or {})
    extra = {"clock": clock} if clock is not None else {}
    return PhoenixSink(s, registry if registry is not None else CollectorRegistry(), env=env or {}, **extra)


def as_records(results: Iterable[dict[str, Any]], partition: int = 0) -> list[SinkRecord]:
    return [SinkRecord(RESULTS, partition, i, None, r) for i, r in enumerate(results)]


def deliver(sink: PhoenixSink, records: list[SinkRecord]) -> WriteReport:
    """One `write` of the records as one partition's batch, as the sink runtime makes it."""
    return sink.write(SinkBatch(RESULTS, records[0].partition, records))


def result_for(chat: Chat, assessments: list[dict[str, Any]]) -> dict[str, Any]:
    return {"schema_version": 6, "request_id": chat.trace_id, "trace_id": chat.trace_id,
            "root_span_id": chat.root, "session_id": None, "user_id": None, "source_format": "otlp_proto",
            "source": {"format": "otlp_proto", "topic": "spans", "partition": 2, "offset": 17},
            "metrics": {}, "assessments": assessments}


def verdicts(llm_span: str) -> list[dict[str, Any]]:
    """An LLM judge on the LLM span, a heuristic on the whole trace, an errored judge, a skipped one."""
    judge = {"endpoint": "stub", "model": "judge-model", "version": "j1"}
    return [
        {"name": "relevance_to_query", "value": "yes", "passed": True, "score": 1.0,
         "rationale": "The response answers the question.", "source": "llm:judge-model", "judge": judge,
         "span_id": llm_span, "input_tokens": 40, "output_tokens": 10, "sample_rate": 1.0},
        {"name": "groundedness", "value": 0.25, "passed": False, "score": 0.25, "threshold": 0.5,
         "rationale": "1 of 4 claims supported.", "source": "heuristic"},
        {"name": "safety", "value": None, "error": "unparseable: no verdict in the reply",
         "source": "llm:judge-model", "judge": {**judge, "version": "s1"}},
        {"name": "toxicity", "skipped": "not_sampled", "source": "llm:judge-model"},
    ]


def value_of(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"sink": "phoenix", **labels}) or 0.0


# --- settings ----------------------------------------------------------------------------------------


def test_settings_validate_every_key_and_name_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as bad:
        PhoenixSinkSettings.from_mapping({"endpoint": "ftp://x", "timeout_s": 0, "max_batch_annotations": 0,
                                          "unknown_span_attempts": "many", "colour": 1}, env={})
    text = str(bad.value)
    for key in ("sink.phoenix.endpoint", "sink.phoenix.timeout_s", "sink.phoenix.max_batch_annotations",
                "sink.phoenix.unknown_span_attempts", "sink.phoenix.colour"):
        assert key in text, (key, text)
    with pytest.raises(ConfigError, match=r"sink\.phoenix\.endpoint: required"):
        PhoenixSinkSettings.from_mapping({}, env={})
    assert PhoenixSinkSettings.from_mapping({}, env={"PHOENIX_COLLECTOR_ENDPOINT": "http://p:6006/"}
                                            ).endpoint == "http://p:6006"
    with pytest.raises(ConfigError, match=r"sink\.phoenix\.endpoint"):
        PhoenixSinkSettings.from_mapping({"endpoint": "http://user:pw@p:6006"}, env={})
    with pytest.raises(ConfigError, match=r"sink.phoenix.api_key_file: cannot read"):
        PhoenixSinkSettings.from_mapping({"endpoint": "http://p", "api_key_file": str(tmp_path / "no")},
                                         env={})
    s = PhoenixSinkSettings.from_mapping({"endpoint": "http://p", "api_key_env": "MY_KEY"},
                                         env={"MY_KEY": "k-123"})
    assert s.api_key({"MY_KEY": "k-123"}) == "k-123" and "k-123" not in str(s.redacted())


# --- against a real Phoenix ----------------------------------------------------------------------------


def test_each_verdict_is_an_annotation_on_its_span_and_a_redelivery_doubles_nothing(
        phoenix: PhoenixServer, openai_stub: OpenAIStub) -> None:
    project = unique("proj")
    chats = instrumented_chats(phoenix.url, openai_stub.base_url, ["What is Phoenix?", "And Kafka?"],
                               project=project)
    records = as_records([result_for(c, verdicts(c.llm)) for c in chats])
    registry = CollectorRegistry()
    sink = make_sink(phoenix.url, registry, project_name=project)
    try:
        sink.setup()
        first = deliver(sink, records)
        again = deliver(sink, records)  # a redelivery (restart, rebalance)
    finally:
        sink.close()
    assert (first.written, dict(first.skipped), first.deferred) == (6, {}, {})
    assert again.written == 6
    for chat in chats:
        on = phoenix.span_annotations(project, [chat.root, chat.llm])
        assert Counter((a["span_id"], a["name"]) for a in on) == {
            (chat.llm, "relevance_to_query"): 1, (chat.root, "groundedness"): 1, (chat.root, "safety"): 1}
        by_name = {a["name"]: a for a in on}
        rel, grounded, safety = by_name["relevance_to_query"], by_name["groundedness"], by_name["safety"]
        assert rel["annotator_kind"] == "LLM" and rel["result"] == {
            "label": "pass", "score": 1.0, "explanation": "The response answers the question."}
        assert rel["identifier"] == annotation_identifier(chat.trace_id, "relevance_to_query", "j1", chat.llm)
        assert rel["metadata"]["tracejudge.judgeModel"] == "judge-model"
        assert rel["metadata"]["tracejudge.input_tokens"] == 40
        assert grounded["annotator_kind"] == "CODE" and grounded["result"] == {
            "label": "fail", "score": 0.25, "explanation": "1 of 4 claims supported."}
        assert grounded["metadata"]["tracejudge.threshold"] == 0.5
        assert grounded["metadata"]["tracejudge.traceId"] == chat.trace_id
        assert safety["result"]["label"] == "error" and "unparseable" in safety["result"]["explanation"]
    assert value_of(registry, "tracejudge_sink_writes_total", outcome="written") == 12


def test_a_session_verdict_is_a_session_annotation_replaced_by_a_later_evaluation(
        phoenix: PhoenixServer, openai_stub: OpenAIStub) -> None:
    project, session_id = unique("proj"), unique("session")
    chats = instrumented_chats(phoenix.url, openai_stub.base_url, ["Hi", "Help me"], project=project,
                               session=session_id)

    def record(evaluation: int, passed: bool, offset: int) -> SinkRecord:
        line = {"schema_version": 6, "kind": "session", "session_id": session_id, "user_id": None,
                "app": None, "status": "closed", "close_reason": "idle", "started_at": None,
                "ended_at": None, "evaluation": evaluation,
                "turns": [{"trace_id": c.trace_id, "root_span_id": c.root} for c in chats],
                "assessments": [{"name": "user_frustration", "value": "none" if passed else "unresolved",
                                 "passed": passed, "rationale": f"evaluation {evaluation}",
                                 "source": "llm:judge-model",
                                 "judge": {"endpoint": "stub", "model": "m", "version": "v1"}}]}
        return SinkRecord("sessions", 0, offset, None, line, SessionResult.from_dict(line))

    sink = make_sink(phoenix.url, project_name=project)
    try:
        assert deliver(sink, [record(1, True, 0)]).written == 1
        # A turn arrived after the session closed: evaluation 2 replaces 1; a redelivery of both ends on 2.
        assert deliver(sink, [record(2, False, 1)]).written == 1
        assert deliver(sink, [record(1, True, 0), record(2, False, 1)]).written == 1
    finally:
        sink.close()
    (only,) = phoenix.session_annotations(project, [session_id])
    assert only["name"] == "user_frustration" and only["result"]["label"] == "fail"
    assert only["result"]["explanation"] == "evaluation 2" and only["metadata"]["tracejudge.evaluation"] == 2


def test_a_session_phoenix_does_not_know_yet_is_deferred(phoenix: PhoenixServer) -> None:
    line = {"schema_version": 6, "kind": "session", "session_id": unique("nowhere"), "user_id": None,
            "app": None, "status": "closed", "close_reason": "idle", "started_at": None, "ended_at": None,
            "turns": [], "assessments": [{"name": "user_frustration", "value": "none", "passed": True,
                                          "source": "llm:m"}]}
    record = SinkRecord("sessions", 0, 4, None, line, SessionResult.from_dict(line))
    registry = CollectorRegistry()
    sink = make_sink(phoenix.url, registry)
    try:
        report = deliver(sink, [record])
    finally:
        sink.close()
    assert (report.written, report.deferred) == (0, {4: Deferral("unknown_session", 0.5)})
    assert value_of(registry, "tracejudge_sink_retries_total", reason="unknown_session") == 1


def test_an_unknown_span_is_deferred_on_a_growing_backoff_then_skipped_and_counted(
        phoenix: PhoenixServer, openai_stub: OpenAIStub) -> None:
    project = unique("proj")
    (chat,) = instrumented_chats(phoenix.url, openai_stub.base_url, ["Known?"], project=project)
    never = Chat("5" * 32, "5" * 16, "6" * 16)
    records = as_records([result_for(chat, verdicts(chat.llm)), result_for(never, verdicts(never.llm))])
    clock, registry = FakeClock(), CollectorRegistry()
    sink = make_sink(phoenix.url, registry, clock, unknown_span_attempts=3, unknown_span_retry_s=60)
    try:
        first = deliver(sink, records)
        # The known spans' verdicts are written at once; the unknown trace's record is deferred, not the
        # batch held: offered again after a back-off doubling from 0.5 s.
        assert (first.written, dict(first.skipped)) == (3, {})
        assert first.deferred == {1: Deferral("unknown_span", 0.5)}
        waits = []
        for step in (20, 20, 10):  # four looks, but only 50 s of the 60 s window
            clock.now += step
            again = deliver(sink, records[1:])
            assert again.written == 0 and not again.skipped and list(again.deferred) == [1]
            waits.append(again.deferred[1].after_s)
        assert waits == [1.0, 2.0, 4.0]
        clock.now += 10
        last = deliver(sink, records[1:])  # the fifth look, 60 s after the first: given up
    finally:
        sink.close()
    assert (last.written, dict(last.skipped), last.deferred) == (0, {"unknown_span": 3}, {})
    assert last.given_up == {"unknown_span": 1}
    assert len(phoenix.span_annotations(project, [chat.root, chat.llm])) == 3
    assert value_of(registry, "tracejudge_sink_retries_total", reason="unknown_span") == 4
    assert value_of(registry, "tracejudge_sink_skipped_total", reason="unknown_span") == 3


def test_a_span_that_reaches_phoenix_after_its_result_is_written(phoenix: PhoenixServer,
                                                                 openai_stub: OpenAIStub) -> None:
    project = unique("proj")
    (early,) = instrumented_chats(phoenix.url, openai_stub.base_url, ["First"], project=project)
    sink = make_sink(phoenix.url)
    try:
        # The result names spans Phoenix does not have yet (their trace is still being exported).
        pending = Chat("7" * 32, "7" * 16, "8" * 16)
        records = as_records([result_for(pending, verdicts(pending.llm)[:2])])
        assert deliver(sink, records).deferred == {0: Deferral("unknown_span", 0.5)}
        (late,) = instrumented_chats(phoenix.url, openai_stub.base_url, ["Second"], project=project)
        records = as_records([result_for(late, verdicts(late.llm)[:2])])
        assert deliver(sink, records).written == 2
    finally:
        sink.close()
    assert {a["name"] for a in phoenix.span_annotations(project, [late.root, late.llm])} == \
        {"relevance_to_query", "groundedness"}
    assert phoenix.span_annotations(project, [early.root, early.llm]) == []


# --- a misbehaving Phoenix: the loopback stub on Phoenix's paths -------------------------------------------


def test_429_5xx_and_rejections(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = "phx-s3cr3t-key"
    (tmp_path / "key").write_text(key + "\n")
    chat = Chat("1" * 32, "1" * 16, "2" * 16)
    records = as_records([result_for(chat, verdicts(chat.llm)[:2])])
    registry = CollectorRegistry()
    with OpenAIStub() as server, caplog.at_level(logging.DEBUG, logger="tracejudge"):
        url = f"http://127.0.0.1:{server.port}"
        sink = make_sink(url, registry, api_key_file=str(tmp_path / "key"))
        try:
            server.enqueue(Reply(status=429, body=b"slow down", headers={"retry-after": "7"}))
            with pytest.raises(RetryLater) as retry:
                deliver(sink, records)
            assert (retry.value.reason, retry.value.after_s) == ("rate_limited", 7)
            server.enqueue(Reply(status=502, body=b"bad gateway"))
            with pytest.raises(RetryLater, match="server_error"):
                deliver(sink, records)
            # The request of two is refused; each alone: one taken, one refused.
            server.enqueue(Reply(status=422, body=b"invalid"), Reply.raw(b'{"data": [{"id": "1"}]}'),
                           Reply(status=422, body=b"invalid"))
            report = deliver(sink, records)
        finally:
            sink.close()
        requests = list(server.requests)
    assert (report.written, dict(report.skipped)) == (1, {"rejected": 1})
    assert value_of(registry, "tracejudge_sink_retries_total", reason="rate_limited") == 1
    assert value_of(registry, "tracejudge_sink_retries_total", reason="server_error") == 1
    assert value_of(registry, "tracejudge_sink_skipped_total", reason="rejected") == 1
    assert {(r.method, r.path) for r in requests} == {("POST", "/v1/span_annotations")}
    assert {r.headers.get("authorization") for r in requests} == {f"Bearer {key}"}
    assert key not in caplog.text


def test_refused_credentials_are_a_config_error_at_setup(caplog: pytest.LogCaptureFixture) -> None:
    with OpenAIStub() as server, caplog.at_level(logging.DEBUG, logger="tracejudge"):
        sink = make_sink(f"http://127.0.0.1:{server.port}", env={"PHOENIX_API_KEY": "wrong-key-42"})
        try:
            server.enqueue(Reply(status=401, body=b"Invalid token"))
            with pytest.raises(ConfigError, match=r"sink\.phoenix\.api_key_env: Phoenix refused"):
                sink.setup()
        finally:
            sink.close()
        (request,) = server.requests
    assert request.headers.get("authorization") == "Bearer wrong-key-42"
    assert "wrong-key-42" not in caplog.text


# --- `tracejudge sink phoenix`: SIGKILLed mid-stream, restarted -------------------------------------------


def test_tracejudge_sink_phoenix_killed_mid_stream_then_restarted_writes_each_verdict_once(
        broker: Any, phoenix: PhoenixServer, openai_stub: OpenAIStub) -> None:
    bs = broker.bootstrap_servers
    project, results_topic, group = unique("proj"), unique("results"), unique("sink-phoenix")
    chats = instrumented_chats(phoenix.url, openai_stub.base_url, [f"Question {i}?" for i in range(40)],
                               project=project)
    lines = [result_for(c, verdicts(c.llm)) for c in chats]
    placed = produce(bs, results_topic, [orjson.dumps(line) for line in lines],
                     keys=[c.trace_id.encode() for c in chats])
    # Commits far apart: the SIGKILL lands after writes whose offsets are not committed.
    config = {"stream": {"lag_interval_seconds": 0.5, "commit_interval_ms": 600_000},
              "sink": {"results_topic": results_topic, "max_batch_records": 2, "checkpoint_interval_ms": 100,
                       "phoenix": {"endpoint": phoenix.url, "project_name": project}}}

    def written(proc: SinkProcess) -> float:
        return proc.metric("tracejudge_sink_writes_total", sink="phoenix", outcome="written")

    first = SinkProcess(bs, "phoenix", config, "--group-id", group).wait_ready()
    try:
        wait_until(lambda: written(first) >= 30, 60, message=lambda: f"writes; log:\n{first.log[-2000:]}")
    finally:
        first.kill()
    committed = committed_offsets(bs, group, results_topic)
    assert sum(o or 0 for o in committed.values()) < len(lines), "killed after the end: not mid-stream"
    config["stream"]["commit_interval_ms"] = 200
    second = SinkProcess(bs, "phoenix", config, "--group-id", group).wait_ready()
    try:
        wait_until(lambda: committed_offsets(bs, group, results_topic) == ends(placed), 120,
                   message=lambda: f"committed to the end; log:\n{second.log[-2000:]}")
        rewritten = written(second)
        second.signal(signal.SIGTERM)
        assert second.finish() == 0
    finally:
        second.kill()
    assert rewritten == 3 * len(lines) - sum(o or 0 for o in committed.values()) * 3
    spans = [s for c in chats for s in (c.root, c.llm)]
    on = phoenix.span_annotations(project, spans)
    assert Counter(a["name"] for a in on) == {"relevance_to_query": 40, "groundedness": 40, "safety": 40}
    assert max(Counter((a["span_id"], a["name"]) for a in on).values()) == 1
