"""`tracejudge run` against the real broker (Tansu, started once per test session).

Traces are real MLflow traces (the demo's agent, traced with MLflow) and real OpenTelemetry SDK spans
encoded with the OTLP exporter's encoder.
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading

import httpx
import orjson
import pytest
from support.kafka import (
    agent_traces,
    assigned,
    committed_offsets,
    ends,
    metric,
    partition_count,
    produce,
    read_topic,
    running,
    series,
    settings,
    unique,
    wait_until,
)
from support.otel_producers import Producer, genai_trace, interleave, kafka_messages

from tracejudge.consumer.pipeline import Pipeline
from tracejudge.consumer.runtime import producing as sinks
from tracejudge.consumer.stages.run import StreamRunner
from tracejudge.metrics.signals import ANSWER_OVERLONG, REPEATED_ANSWER, TOOL_RESULT_OVERSIZED
from tracejudge.schemas.result import Assessment, SourceRef, session_key


def result_key(line: dict) -> str:
    """The key a result line is published under: its session's, else its trace id."""
    return session_key(line["session_id"])[0] if line.get("session_id") else line["trace_id"]


def all_committed(bootstrap: str, group: str, topic: str, placed: list[tuple[int, int]]) -> bool:
    """The group committed, on every partition that has records, the offset after the last one."""
    committed = committed_offsets(bootstrap, group, topic)
    return all(committed.get(p) == end for p, end in ends(placed).items())


def coordinates(results) -> list[tuple[int, int]]:
    out = []
    for r in results:
        source = orjson.loads(r.value)["source"]
        out.append((source["partition"], source["offset"]))
    return out


# With decode workers the same records are decoded in another process: the outcome must not change.
@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "decode-worker"])
def test_every_trace_is_counted_published_and_committed(broker, workers):
    bs = broker.bootstrap_servers
    topic, results, group = unique("traces"), unique("results"), unique("group")
    traces = agent_traces(60, seed=21, failure_share=0.1)
    placed = produce(bs, topic, [t.payload for t in traces], keys=[t.trace_id.encode() for t in traces])
    s = settings(bs, [f"{topic}:mlflow"], **{"stream.results_topic": results, "stream.app_tag": "app",
                                            "kafka.group_id": group, "stream.decode_workers": workers})
    runner = StreamRunner(s)
    assert runner.readiness() == (False, "connecting to Kafka")
    with running(s) as runner:
        port = runner.http_port
        wait_until(lambda: metric(port, "tracejudge_records_total", topic=topic, outcome="ok") == 60, 60)
        out = read_topic(bs, results, at_least=60)
        wait_until(lambda: all_committed(bs, group, topic, placed), 30, message="committed to the end")
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        partitions = {p for p, _ in placed}
        wait_until(lambda: all(metric(port, "tracejudge_consumer_lag_records", topic=topic, partition=str(p))
                               == 0 for p in partitions)
                   and metric(port, "tracejudge_commits_total") >= 1, 30, message="lag reported")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert runner.readiness() == (False, "stopping")
    # An embedded runner leaves its host's collector alone (only `tracejudge run` tunes it).
    assert gc.get_freeze_count() == 0 and gc.get_threshold()[0] == 700
    assert len(out) == 60 and sorted(coordinates(out)) == sorted(placed)
    # One result per trace, keyed by its session (the agent's turns state one) else its trace id,
    # exactly what the offline pipeline computes.
    pipeline = Pipeline(app_tag="app")
    by_trace = {orjson.loads(r.value)["trace_id"]: orjson.loads(r.value) for r in out}
    assert all(r.key.decode() == result_key(orjson.loads(r.value)) for r in out)
    assert set(by_trace) == {t.trace_id.removeprefix("tr-") for t in traces}
    for trace, (partition, offset) in zip(traces, placed, strict=True):
        source = SourceRef("mlflow", topic=topic, partition=partition, offset=offset)
        offline = pipeline.evaluate(pipeline.normalise(trace.payload, "mlflow"), source)
        expected = orjson.loads(offline.to_json())
        # Signals relative to the app's norm depend on the order records meet, which across
        # partitions is the poll's (tests/test_signals.py compares them on one partition).
        assert _without(by_trace[trace.trace_id.removeprefix("tr-")], NORM_SIGNALS) == \
            _without(expected, NORM_SIGNALS)
    failed = sum(t.failed for t in traces)
    assert failed > 0
    assert sum(v for k, v in _series(text, "tracejudge_traces_total").items() if "error" in k) == failed
    assert metric_in(text, "tracejudge_results_published_total") == 60
    assert metric_in(text, "tracejudge_in_flight_records") == 0


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "decode-worker"])
def test_malformed_records_are_dead_lettered_with_reasons_while_the_rest_flow(broker, workers):
    bs = broker.bootstrap_servers
    topic, results, dlq, group = unique("mixed"), unique("results"), unique("dlq"), unique("group")
    good = agent_traces(20, seed=3)
    bad = [
        (b"{not json", "invalid_json"),
        (b"\xff\xfe\x00\x81 not text", "not_utf8"),
        (b"[1, 2, 3]", "invalid_record"),
        (b'{"hello": "world"}', "unknown_format"),
        (b'{"request": ' + b'"' + b"x" * 70_000 + b'"}', "too_large"),
        (None, "invalid_record"),  # a tombstone
        (b'{"request_id": "r", "response": "an answer"}', "invalid_record"),  # no request, no trace
        (b'{"databricks_request_id": "d", "status_code": 200, "request": "{\\"messages\\": [{\\"role",'
         b' "response": "ok"}', "invalid_json"),  # a serving log's request body cut short
    ]
    # Valid, if odd: half a surrogate pair (no UTF-8 writer takes it), an inference-log row whose
    # bodies are plain text, and an integer beyond 64 bits (msgpack cannot carry it back from a
    # decode worker).
    odd = [b'{"request_id": "lone", "request": "hi \\ud800", "response": "yo"}',
           b'{"databricks_request_id": "plain", "status_code": 200, "request": "hi {there", '
           b'"response": "yo"}',
           b'{"request_id": "big", "request": "hi", "response": "yo", "reference_trajectory": '
           b'[{"tool_name": "t", "tool_input": {"n": 1180591620717411303424, "x": NaN}}]}']
    values = [t.payload for t in good[:10]] + [v for v, _ in bad] + [t.payload for t in good[10:]] + odd
    keys = [t.trace_id.encode() for t in good[:10]] + [f"bad-{i}".encode() for i in range(len(bad))] + \
        [t.trace_id.encode() for t in good[10:]] + [b"lone", b"plain", b"big"]
    placed = produce(bs, topic, values, keys=keys)
    bad_at = {f"bad-{i}": placed[10 + i] for i in range(len(bad))}
    s = settings(bs, [topic], **{"stream.results_topic": results, "stream.dead_letter_topic": dlq,
                                 "stream.max_record_bytes": 65536, "kafka.group_id": group,
                                 "stream.decode_workers": workers})
    with running(s) as runner:
        port = runner.http_port
        wait_until(lambda: metric(port, "tracejudge_records_total", topic=topic) == len(values), 60)
        letters = read_topic(bs, dlq, at_least=len(bad))
        out = read_topic(bs, results, at_least=len(good) + len(odd))
        wait_until(lambda: all_committed(bs, group, topic, placed), 30,
                   message="dead letters count as complete")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert len(letters) == len(bad) and len(out) == len(good) + len(odd)
    by_key = {r.key: orjson.loads(r.value) for r in out}
    assert by_key[b"lone"]["request"] == "hi \ufffd"
    assert (by_key[b"plain"]["request"], by_key[b"plain"]["response"]) == ("hi {there", "yo")
    assert by_key[b"big"]["reference_trajectory"][0]["tool_input"]["n"] == 2**70
    for letter in letters:
        key = letter.key.decode()
        index = int(key.split("-")[1])
        original, reason = bad[index]
        headers = dict(letter.headers)
        assert headers[sinks.HEADER_REASON].decode() == reason
        assert headers[sinks.HEADER_ERROR]
        assert headers[sinks.HEADER_TOPIC].decode() == topic
        assert (int(headers[sinks.HEADER_PARTITION]), int(headers[sinks.HEADER_OFFSET])) == bad_at[key]
        assert headers[sinks.HEADER_FORMAT] == b"auto"
        assert (letter.value or b"") == (original or b"")
    errors = {letter.key: dict(letter.headers)[sinks.HEADER_ERROR].decode() for letter in letters}
    assert errors[b"bad-6"].startswith("request: required field is missing")
    assert errors[b"bad-7"].startswith("request: looks like JSON but does not parse: unexpected end of data")
    assert b"70015 bytes, more than stream.max_record_bytes (65536)" in dict(
        next(x for x in letters if x.key == b"bad-4").headers)[sinks.HEADER_ERROR]
    assert metric_in(text, "tracejudge_records_total", outcome="dead_lettered") == len(bad)
    assert metric_in(text, "tracejudge_records_total", outcome="ok") == len(good) + len(odd)
    for reason in {r for _, r in bad}:
        expected = sum(r == reason for _, r in bad)
        assert metric_in(text, "tracejudge_dead_letters_total", reason=reason) == expected
    assert metric_in(text, "tracejudge_dead_letters_unrouted_total") == 0


def test_without_a_dead_letter_topic_rejected_records_are_counted_and_committed(broker, caplog):
    bs = broker.bootstrap_servers
    topic, group = unique("nodlq"), unique("group")
    good = agent_traces(5, seed=8)
    placed = produce(bs, topic, [b"{oops", *(t.payload for t in good), b"[]"])
    with caplog.at_level("WARNING", logger="tracejudge"), \
            running(settings(bs, [topic], **{"kafka.group_id": group})) as runner:
        port = runner.http_port
        wait_until(lambda: metric(port, "tracejudge_records_total", topic=topic) == 7, 60)
        wait_until(lambda: all_committed(bs, group, topic, placed), 30)
        assert metric(port, "tracejudge_dead_letters_unrouted_total", reason="invalid_json") == 1
        assert metric(port, "tracejudge_dead_letters_unrouted_total", reason="invalid_record") == 1
        assert metric(port, "tracejudge_records_total", outcome="ok") == 5
    assert any("no dead-letter topic configured" in r.getMessage() and "invalid_json" in r.getMessage()
               for r in caplog.records)


def test_two_consumers_split_the_partitions_and_process_every_record_once(broker):
    bs = broker.bootstrap_servers
    topic, results, group = unique("split"), unique("results"), unique("group")
    traces = agent_traces(80, seed=13)
    keys = [t.trace_id.encode() for t in traces]
    first = produce(bs, topic, [t.payload for t in traces[:8]], keys=keys[:8])
    partitions = partition_count(bs, topic)
    assert partitions > 1
    s = settings(bs, [topic], **{"stream.results_topic": results, "kafka.group_id": group})
    with running(s) as a, running(s) as b:
        wait_until(lambda: assigned(a, b, partitions=partitions), 60, message="both hold partitions")
        rest = produce(bs, topic, [t.payload for t in traces[8:]], keys=keys[8:])
        out = read_topic(bs, results, at_least=len(traces))
        done = [metric(r.http_port, "tracejudge_records_total") for r in (a, b)]
        mine_a = {tp.partition for tp in a.assignment}
        mine_b = {tp.partition for tp in b.assignment}
    got = coordinates(out)
    assert sorted(got) == sorted(first + rest)  # every record, none twice
    assert sum(done) == len(traces)
    # After the split both did work, each on its own partitions.
    assert {p for p, _ in rest} & mine_a and {p for p, _ in rest} & mine_b
    assert not mine_a & mine_b


def test_a_consumer_joining_mid_stream_loses_nothing_and_revocation_commits_avoid_duplicates(broker):
    bs = broker.bootstrap_servers
    topic, results, group = unique("rebalance"), unique("results"), unique("group")
    traces = agent_traces(150, seed=17)
    payloads = [t.payload for t in traces]
    keys = [t.trace_id.encode() for t in traces]
    placed = produce(bs, topic, payloads[:50], keys=keys[:50])
    partitions = partition_count(bs, topic)
    # No periodic commit: only the rebalance listener (and shutdown) commit, so any record the first
    # consumer finished but did not commit at the revocation would be processed twice.
    s = settings(bs, [topic], **{"stream.results_topic": results, "kafka.group_id": group,
                                 "stream.commit_interval_ms": 3_600_000, "kafka.max_poll_records": 10})
    stop_producing = threading.Event()

    def keep_producing() -> None:
        for i in range(50, 150, 10):
            placed.extend(produce(bs, topic, payloads[i:i + 10], keys=keys[i:i + 10]))
            if stop_producing.is_set():
                break

    with running(s) as a:
        wait_until(lambda: metric(a.http_port, "tracejudge_records_total") >= 20, 60, message="mid-stream")
        producer = threading.Thread(target=keep_producing)
        producer.start()
        with running(s) as b:
            wait_until(lambda: assigned(a, b, partitions=partitions), 60, message="the group settles")
            producer.join(60)
            out = read_topic(bs, results, at_least=len(traces))
            revoked = metric(a.http_port, "tracejudge_rebalances_total", event="revoked")
            commits = metric(a.http_port, "tracejudge_commits_total")
            # Lag series follow the assignment: a revoked partition's series is removed.
            for runner in (a, b):
                others = {p for p in range(partitions)} - {tp.partition for tp in runner.assignment}
                assert all(series(runner.http_port, "tracejudge_consumer_lag_records", topic=topic,
                                  partition=str(p)) == [] for p in others)
    assert len(placed) == len(traces)
    assert revoked >= 1 and commits >= 1
    got = coordinates(out)
    assert set(got) == set(placed), "a record was lost across the rebalance"
    assert len(got) == len(set(got)), "a record finished before the revocation was processed again"


class HeldJudge:
    """Judges that finish only when the test says so, in the order it chooses (the asynchronous
    LLM judges' completion pattern), to exercise out-of-order completion and the in-flight cap."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, concurrent.futures.Future]] = []
        self.lock = threading.Lock()

    def submit(self, record):
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.pending.append((record.request_id, future))
        return future

    def finish(self, request_id: str) -> None:
        with self.lock:
            future = next(f for rid, f in self.pending if rid == request_id)
        future.set_result([Assessment("held", value="yes", score=1.0, passed=True)])

    def unfinished(self) -> list[str]:
        with self.lock:
            return [rid for rid, f in self.pending if not f.done()]

    def judge_names(self) -> list[str]:
        return ["held"]

    def close(self) -> None:
        pass


def test_out_of_order_completion_commits_the_lowest_unfinished_offset_and_the_cap_pauses(broker):
    bs = broker.bootstrap_servers
    topic, results, group = unique("ooo"), unique("results"), unique("group")
    rows = [orjson.dumps({"request_id": f"r{i}", "request": f"question {i}", "response": "answer"})
            for i in range(12)]
    placed = produce(bs, topic, rows, keys=[b"one-partition"] * len(rows))
    partition = placed[0][0]
    assert {p for p, _ in placed} == {partition}
    judge = HeldJudge()
    s = settings(bs, [f"{topic}:agent_eval"], **{"stream.results_topic": results, "kafka.group_id": group,
                                                  "stream.max_in_flight": 5, "stream.commit_interval_ms": 50})
    with running(s, judges=judge) as runner:
        port = runner.http_port
        wait_until(lambda: len(judge.pending) == 5, 60, message="five records in flight")
        wait_until(lambda: metric(port, "tracejudge_backpressure_pauses_total") >= 1, 60)
        assert len(judge.pending) == 5  # the cap holds fetching
        assert metric(port, "tracejudge_in_flight_records") == 5
        # Finish all but the first, last first: nothing can be committed past offset 0.
        for i in (4, 3, 2, 1):
            judge.finish(f"r{i}")
        wait_until(lambda: metric(port, "tracejudge_results_published_total") == 4, 30)
        wait_until(lambda: len(judge.pending) >= 9, 30, message="room again: fetching resumed")
        assert committed_offsets(bs, group, topic)[partition] is None
        judge.finish("r0")
        wait_until(lambda: committed_offsets(bs, group, topic)[partition] == 5, 30)
        for rid in judge.unfinished():
            judge.finish(rid)
        wait_until(lambda: len(judge.pending) == 12, 30, message="the last records fetched")
        for rid in judge.unfinished():
            judge.finish(rid)
        wait_until(lambda: metric(port, "tracejudge_results_published_total") == 12, 30)
        wait_until(lambda: committed_offsets(bs, group, topic)[partition] == 12, 30)
        assert metric(port, "tracejudge_backpressure_seconds_total") > 0
    out = read_topic(bs, results, at_least=12)
    assert {orjson.loads(r.value)["assessments"][0]["name"] for r in out} == {"held"}


def test_otlp_spans_are_assembled_into_traces_and_committed_once_exported(broker):
    bs = broker.bootstrap_servers
    topic, results, group = unique("spans"), unique("results"), unique("group")
    producer = Producer("support-bot")
    recorded = [genai_trace(producer.tracer, f"question {i}", f"answer {i}") for i in range(6)]
    spans = producer.finished()
    by_trace: dict[str, list] = {}
    for span in spans:
        by_trace.setdefault(format(span.context.trace_id, "032x"), []).append(span)
    # Export batches of 3 spans from interleaved traces: every trace spans several records.
    messages = kafka_messages(interleave(*by_trace.values()), per_message=3)
    assert len(messages) > len(recorded)
    placed = produce(bs, topic, [v for _, v in messages], keys=[b"collector"] * len(messages))
    s = settings(bs, [f"{topic}:otlp_proto"], **{"stream.results_topic": results, "kafka.group_id": group,
                                                 "otlp.assembly.quiet_period_s": 0.3,
                                                 "otlp.assembly.max_wait_s": 10})
    with running(s) as runner:
        out = read_topic(bs, results, at_least=len(recorded))
        wait_until(lambda: all_committed(bs, group, topic, placed), 30)
        port = runner.http_port
        assert metric(port, "tracejudge_records_total", outcome="ok") == len(messages)
        assert metric(port, "tracejudge_traces_total", app="support-bot") == len(recorded)
        assert metric(port, "tracejudge_assembly_traces_emitted_total", reason="complete") == len(recorded)
    results_by_trace = {orjson.loads(r.value)["trace_id"]: orjson.loads(r.value) for r in out}
    assert all(r.key.decode() == result_key(orjson.loads(r.value)) for r in out)
    assert set(results_by_trace) == {r.trace_id for r in recorded}
    for rec in recorded:
        got = results_by_trace[rec.trace_id]
        assert (got["request"], got["response"]) == (rec.question, rec.answer)


# -- small readers of the exposition text -------------------------------------------------------------


NORM_SIGNALS = (ANSWER_OVERLONG, TOOL_RESULT_OVERSIZED, REPEATED_ANSWER)


def _without(line: dict, metrics: tuple[str, ...]) -> dict:
    return {**line, "metrics": {k: v for k, v in line["metrics"].items() if k not in metrics}}


def _series(text: str, name: str) -> dict[str, float]:
    from support.kafka import samples

    return {str(sorted(labels)): v for (n, labels), v in samples(text).items() if n == name}


def metric_in(text: str, name: str, **labels: str) -> float:
    from support.kafka import value

    return value(text, name, **labels)


@pytest.fixture(autouse=True)
def _quiet_kafka_logs(caplog):
    caplog.set_level("WARNING", logger="kafka")


def test_a_decode_worker_killed_mid_stream_loses_no_record(broker):
    bs = broker.bootstrap_servers
    topic, results, group = unique("traces"), unique("results"), unique("group")
    traces = agent_traces(40, seed=5)
    values = [t.payload for t in traces] * 10
    placed = produce(bs, topic, values)
    s = settings(bs, [topic], **{"stream.results_topic": results, "kafka.group_id": group,
                                 "stream.decode_workers": 1, "kafka.max_poll_records": 20})
    with running(s) as runner:
        port = runner.http_port
        wait_until(lambda: (metric(port, "tracejudge_records_total", topic=topic, outcome="ok") or 0) > 0, 60)
        killed = runner._decoder._workers[0].process
        killed.kill()
        wait_until(lambda: metric(port, "tracejudge_decode_workers_lost_total") == 1, 30)
        # Its unanswered batches are decoded in the consumer process, and a new worker takes over.
        wait_until(lambda: metric(port, "tracejudge_decode_workers") == 1
                   and runner._decoder._workers[0].process is not killed, 60, message="a new worker")
        wait_until(lambda: metric(port, "tracejudge_records_total", topic=topic, outcome="ok")
                   == len(values), 60)
        out = read_topic(bs, results, at_least=len(values))
        wait_until(lambda: all_committed(bs, group, topic, placed), 30, message="committed to the end")
    assert sorted(coordinates(out)) == sorted(placed)


def test_a_result_that_cannot_be_written_is_dead_lettered_not_held(broker):
    # A custom format handler may build a record no JSON writer takes (here: half a surrogate pair,
    # which the built-in formats replace). Its result is dead-lettered; the partition is not held.
    from tracejudge.schemas.record import EvalRecord

    def handler(payload, source, ticket, emit):
        text = payload.decode()
        ticket.acquire()
        emit(EvalRecord(request_id=text, response="odd \ud800" if text == "odd" else "fine"), source, ticket)
        ticket.release()

    bs = broker.bootstrap_servers
    topic, results, dlq, group = unique("custom"), unique("results"), unique("dlq"), unique("group")
    placed = produce(bs, topic, [b"a", b"odd", b"b"], keys=[b"a", b"odd", b"b"])
    s = settings(bs, [f"{topic}:agent_eval"], **{"stream.results_topic": results, "kafka.group_id": group,
                                                "stream.dead_letter_topic": dlq})
    with running(s, handlers={"agent_eval": handler}):
        letters = read_topic(bs, dlq, at_least=1)
        out = read_topic(bs, results, at_least=2)
        wait_until(lambda: all_committed(bs, group, topic, placed), 30, message="committed past it")
    assert sorted(orjson.loads(r.value)["request_id"] for r in out) == ["a", "b"]
    headers = dict(letters[0].headers)
    assert headers[sinks.HEADER_REASON] == b"result_rejected"
    assert b"result could not be written: UnicodeEncodeError" in headers[sinks.HEADER_ERROR]
    assert (int(headers[sinks.HEADER_PARTITION]), int(headers[sinks.HEADER_OFFSET])) == placed[1]
