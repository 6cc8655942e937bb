"""OTLP topics through the real runner and the real (Tansu) broker: spans from the OpenTelemetry SDK,
encoded by the OTLP encoder, split over many Kafka records and interleaved with other traces,
assembled, evaluated and published; and a crash in the middle of assembly loses no trace."""

from __future__ import annotations

import json
import signal

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from support.kafka import (
    RunnerProcess,
    committed_offsets,
    produce,
    read_topic,
    settings,
    unique,
    wait_until,
)
from support.otel_producers import (
    Producer,
    genai_trace,
    interleave,
    kafka_messages,
    mlflow_otlp_batches,
    openinference_trace,
    traceloop_trace,
)

from tracejudge.consumer.stages.run import StreamRunner


def calls(result: dict) -> list[dict]:
    """The result's tool calls without their `error` (schema 6; a failing tool's is checked apart)."""
    return [{k: v for k, v in c.items() if k != "error"} for c in result["trajectory"] or []]


def results_by_trace(bootstrap: str, topic: str, at_least: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for record in read_topic(bootstrap, topic, at_least=at_least, timeout=60):
        result = json.loads(record.value)
        out.setdefault(result["trace_id"], []).append(result)
    return out


def all_committed(bootstrap: str, group: str, topic: str, produced: list[tuple[int, int]]) -> bool:
    """Every produced record committed. (Compared with the producer's acks: Tansu's end offsets
    count batches, not records.)"""
    expected: dict[int, int] = {}
    for partition, offset in produced:
        expected[partition] = max(expected.get(partition, 0), offset + 1)
    committed = committed_offsets(bootstrap, group, topic)
    return all(committed.get(p) == end for p, end in expected.items())


def test_otlp_proto_and_json_topics_assemble_traces_split_over_records(broker):
    """SDK traces under three conventions and MLflow's own OTLP export, split over records."""
    bootstrap = broker.bootstrap_servers
    proto_topic, json_topic, results, group = (unique("otlp-proto"), unique("otlp-json"),
                                              unique("otlp-results"), unique("otlp-group"))
    geo, docs, weather = Producer("geo-agent"), Producer("docs-agent"), Producer("weather-bot")
    recs = [genai_trace(geo.tracer, f"Capital of country {i}?", f"City {i}.", tool_fails=i == 1)
            for i in range(3)]
    recs += [openinference_trace(docs.tracer, f"What is MLflow {i}?", f"A platform {i}.") for i in range(2)]
    spans_geo, spans_docs = geo.finished(), docs.finished()
    recs += [traceloop_trace(weather.tracer, f"Weather {i}?", f"Rain {i}.") for i in range(2)]
    # Export batches of 3 spans mixing both services' traces: no trace sits in one record.
    proto_records = kafka_messages(interleave(spans_geo, spans_docs), per_message=3)
    # partition_traces_by_id: each record holds one trace, keyed by its hex id; a trace still spans
    # several records.
    json_records = kafka_messages(weather.finished(), per_message=2, fmt="otlp_json", by_trace_id=True)
    assert len(proto_records) >= 6 and all(k is not None for k, _ in json_records)
    # MLflow's own OTLP export (two traces, two spans a batch) on the same protobuf topic.
    mlflow_batches = mlflow_otlp_batches(2, service="mlflow-shop", batch_size=2)

    runner = StreamRunner(settings(bootstrap, [f"{proto_topic}:otlp_proto", f"{json_topic}:otlp_json"],
                                   kafka__group_id=group, stream__results_topic=results,
                                   stream__commit_interval_ms=100, otlp__assembly__quiet_period_s=0.3),
                          judges=False)
    runner.start()
    try:
        proto_values = interleave([v for _, v in proto_records], mlflow_batches)
        acks_proto = produce(bootstrap, proto_topic, proto_values)
        acks_json = produce(bootstrap, json_topic, [v for _, v in json_records],
                            keys=[k for k, _ in json_records])
        got = results_by_trace(bootstrap, results, at_least=len(recs) + 2)
        mlflow_results = [r for (r,) in got.values() if r["app"] == "mlflow-shop"]
        assert sorted(r["request"] for r in mlflow_results) == ["question 0", "question 1 fail"]
        assert all(r["response"] == f"answer {r['request']}" and r["complete"] for r in mlflow_results)
        assert set(got) - {r["trace_id"] for r in mlflow_results} == {r.trace_id for r in recs}
        for rec in recs:
            (result,) = got[rec.trace_id]
            assert result["request"] == rec.question and result["response"] == rec.answer
            assert result["complete"] is True
            assert calls(result) == [{"tool_name": rec.tool, "tool_input": rec.tool_args}]
            assert result["tokens"]["total"] == rec.input_tokens + rec.output_tokens
        assert {got[r.trace_id][0]["app"] for r in recs} == {"geo-agent", "docs-agent", "weather-bot"}
        # The geo trace whose tool span ended in error: its call carries the status message.
        failed, ok = got[recs[1].trace_id][0], got[recs[0].trace_id][0]
        assert [c["error"] for c in failed["trajectory"]] == ["population service timed out"]
        assert [c["error"] for c in ok["trajectory"]] == [None]
        assert {got[r.trace_id][0]["source_format"] for r in recs[5:]} == {"otlp_json"}
        assert got[recs[0].trace_id][0]["source"]["topic"] == proto_topic
        # Every record's offset is committed once the traces it fed are exported.
        wait_until(lambda: all_committed(bootstrap, group, proto_topic, acks_proto)
                   and all_committed(bootstrap, group, json_topic, acks_json), 30, interval=0.2,
                   message="all offsets committed")
        registry = runner.registry
        assert registry.get_sample_value("tracejudge_assembly_traces_emitted_total",
                                         {"reason": "complete"}) == len(recs) + 2
        assert registry.get_sample_value("tracejudge_assembly_open_traces") == 0
        assert registry.get_sample_value("tracejudge_assembly_spans_total") == 4 * 5 + 3 * 2 + 4 * 2
    finally:
        runner.stop()
        assert runner.join(60)


def produce_to_partition_0(bootstrap: str, topic: str, values: list[bytes]) -> list[int]:
    """Produce in order to partition 0 (topics auto-create with several): offsets say the order."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    try:
        futures = [producer.send(topic, value=v, partition=0) for v in values]
        producer.flush(timeout=30)
        return [f.get(timeout=30).offset for f in futures]
    finally:
        producer.close(timeout=5)


def test_crash_in_the_middle_of_assembly_loses_no_trace(broker):
    """SIGKILL while traces are half assembled: their records were not committed, so the restarted
    runner reads them again and every trace comes out whole."""
    bootstrap = broker.bootstrap_servers
    topic, results, group = unique("otlp-crash"), unique("otlp-crash-results"), unique("otlp-crash-group")
    producer = Producer("geo-agent")
    early = [genai_trace(producer.tracer, f"early {i}?", f"early answer {i}.") for i in range(2)]
    early_records = [v for _, v in kafka_messages(producer.finished(), per_message=3)]
    held = [genai_trace(producer.tracer, f"held {i}?", f"held answer {i}.") for i in range(3)]
    held_spans = producer.finished()
    # The held traces' children arrive before the crash, their roots (which end last) after it.
    children = [v for _, v in kafka_messages([s for s in held_spans if s.parent is not None], per_message=2)]
    roots = [v for _, v in kafka_messages([s for s in held_spans if s.parent is None], per_message=1)]
    args = ("--topic", f"{topic}:otlp_proto", "--group-id", group, "--results-topic", results)
    env = {"TRACEJUDGE_STREAM__COMMIT_INTERVAL_MS": "100",
           "TRACEJUDGE_OTLP__ASSEMBLY__QUIET_PERIOD_S": "0.3",
           "TRACEJUDGE_OTLP__ASSEMBLY__MAX_WAIT_S": "600"}

    offsets = produce_to_partition_0(bootstrap, topic, early_records + children)
    first_held = offsets[len(early_records)]
    runner = RunnerProcess(bootstrap, *args, env=env).wait_ready()
    try:
        got = results_by_trace(bootstrap, results, at_least=len(early))
        assert set(got) == {r.trace_id for r in early}
        wait_until(lambda: runner.metric("tracejudge_assembly_spans_held") == 3 * len(held), 30,
                   message="the held traces' children in assembly")
        # The early records are committed; the commit stops at the first record a held trace holds.
        wait_until(lambda: committed_offsets(bootstrap, group, topic).get(0) == first_held, 30,
                   interval=0.2, message=f"offset {first_held} committed")
        assert runner.metric("tracejudge_assembly_open_traces") == len(held)
        runner.signal(signal.SIGKILL)
        runner.finish(30)
    finally:
        runner.kill()
    assert committed_offsets(bootstrap, group, topic).get(0) == first_held

    offsets += produce_to_partition_0(bootstrap, topic, roots)
    restarted = RunnerProcess(bootstrap, *args, env=env).wait_ready()
    try:
        got = results_by_trace(bootstrap, results, at_least=len(early) + len(held))
        assert {t: len(r) for t, r in got.items()} == {r.trace_id: 1 for r in early + held}
        for rec in held:
            (result,) = got[rec.trace_id]
            assert result["complete"] is True
            assert result["request"] == rec.question and result["response"] == rec.answer
            # The children came from records read before the crash: read again, not lost.
            assert calls(result) == [{"tool_name": rec.tool, "tool_input": rec.tool_args}]
            assert result["tokens"]["total"] == rec.input_tokens + rec.output_tokens
            assert [d["doc_uri"] for d in result["retrieved_context"]] == [u for _, u in rec.documents]
        wait_until(lambda: all_committed(bootstrap, group, topic, [(0, o) for o in offsets]), 30,
                   interval=0.2,
                   message="all offsets committed after the restart")
        restarted.signal(signal.SIGTERM)
        assert restarted.finish(60) == 0
    finally:
        restarted.kill()


def test_rebalance_mid_assembly_reads_the_held_records_again(broker):
    """A rebalance revokes every partition (eager assignors): traces still assembling are dropped
    unreleased, and when the partition comes back to the same runner it seeks back to their records
    (kafka-python would otherwise resume at its in-memory position and skip them)."""
    bootstrap = broker.bootstrap_servers
    topic, results, group = unique("otlp-rb"), unique("otlp-rb-results"), unique("otlp-rb-group")
    producer = Producer("geo-agent")
    held = [genai_trace(producer.tracer, f"held {i}?", f"held answer {i}.") for i in range(2)]
    spans = producer.finished()
    children = [v for _, v in kafka_messages([s for s in spans if s.parent is not None], per_message=3)]
    roots = [v for _, v in kafka_messages([s for s in spans if s.parent is None], per_message=1)]
    offsets = produce_to_partition_0(bootstrap, topic, children)

    runner = StreamRunner(settings(bootstrap, [f"{topic}:otlp_proto"], kafka__group_id=group,
                                   stream__results_topic=results, stream__commit_interval_ms=100,
                                   otlp__assembly__quiet_period_s=0.3), judges=False)
    registry = runner.registry
    runner.start()
    intruder = None
    try:
        wait_until(lambda: registry.get_sample_value("tracejudge_assembly_open_traces") == len(held), 60,
                   message="held traces open")
        # Another member joins: the group rebalances and every partition is revoked. The range assignor
        # orders members by id (client id first): the runner ("tracejudge-…") gets partition 0 back.
        intruder = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, client_id="zz-intruder",
                                 enable_auto_commit=False, session_timeout_ms=6000,
                                 heartbeat_interval_ms=1000)
        wait_until(lambda: intruder.poll(timeout_ms=100) is not None and intruder.assignment(), 60,
                   interval=0.0, message="the second member's assignment")
        assert TopicPartition(topic, 0) not in intruder.assignment()
        wait_until(lambda: registry.get_sample_value("tracejudge_assembly_traces_discarded_total") == 2
                   and registry.get_sample_value("tracejudge_assembly_open_traces") == len(held), 60,
                   message="held traces dropped at the revocation and read again")
        offsets += produce_to_partition_0(bootstrap, topic, roots)
        got = results_by_trace(bootstrap, results, at_least=len(held))
        assert {t: len(r) for t, r in got.items()} == {r.trace_id: 1 for r in held}
        for rec in held:
            (result,) = got[rec.trace_id]
            assert result["complete"] is True
            assert calls(result) == [{"tool_name": rec.tool, "tool_input": rec.tool_args}]
        wait_until(lambda: all_committed(bootstrap, group, topic, [(0, o) for o in offsets]), 30,
                   interval=0.2, message="all offsets committed")
    finally:
        if intruder is not None:
            intruder.close(autocommit=False)
        runner.stop()
        assert runner.join(60)
