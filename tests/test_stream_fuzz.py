"""Whatever arrives on a topic, the consumer survives it: every record is either processed or
dead-lettered with a reason, and its offset completes. Arbitrary bytes and mutated real records
(MLflow traces, agent-eval records, inference-log rows, OTLP proto and JSON from the OTel SDK) go
through the runner's per-record path for every topic format, then a sample through the real broker.
"""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.consumer.fetcher import ConsumerRecord
from kafka.structs import TopicPartition
from support.kafka import (
    agent_traces,
    metric,
    produce,
    read_topic,
    running,
    shared_broker,
    unique,
    wait_until,
)
from support.kafka import settings as runner_settings
from support.otel_producers import Producer, encode, genai_trace, openinference_trace, to_otlp_json

from tracejudge.consumer.pipeline import Pipeline
from tracejudge.consumer.runtime import producing as sinks
from tracejudge.consumer.runtime.offsets import OffsetTracker
from tracejudge.consumer.runtime.producing import DeadLetterSink, ResultSink
from tracejudge.consumer.stages.assembly import AssemblySettings, TraceAssembler
from tracejudge.consumer.stages.processing import RecordProcessor
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.errors import REASONS

FORMATS = ("auto", "agent_eval", "mlflow", "inference_log", "otlp_proto", "otlp_json")
KNOWN_REASONS = REASONS | {sinks.PROCESSING_ERROR}


def _seeds() -> dict[str, bytes]:
    trace = agent_traces(1, seed=2)[0].payload
    otel = Producer("fuzz")
    genai_trace(otel.tracer, "What is a partition?", "An ordered log.")
    openinference_trace(otel.tracer, "Who reads it?", "A consumer group.")
    request = encode(otel.finished())
    return {
        "mlflow": trace,
        "agent_eval": orjson.dumps({"request_id": "r1", "request": "q", "response": "a",
                                    "retrieved_context": [{"content": "c", "doc_uri": "u"}],
                                    "expected_facts": ["f"], "trace": orjson.loads(trace)}),
        "inference_log": orjson.dumps({
            "databricks_request_id": "d1", "status_code": 200, "execution_duration_ms": 10,
            "served_entity_id": "e", "request": json.dumps({"messages": [{"role": "user", "content": "q"}]}),
            "response": json.dumps({"choices": [{"message": {"content": "a"}}],
                                    "databricks_output": {"trace": orjson.loads(trace)}})}),
        "otlp_proto": request.SerializeToString(),
        "otlp_json": to_otlp_json(request),
    }


SEEDS = _seeds()

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
           | st.text(max_size=20))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.extend(_paths(v, (*prefix, i)))
    return out


@st.composite
def mutated_json(draw: st.DrawFn, seed: bytes) -> bytes:
    """A real record with one value replaced by arbitrary JSON, or one key removed."""
    obj = orjson.loads(seed)
    path = draw(st.sampled_from(_paths(obj)[1:]))
    parent = obj
    for part in path[:-1]:
        parent = parent[part]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(json_values)
    # The stdlib writes integers beyond 64 bits too (orjson refuses them; producers need not).
    return json.dumps(obj).encode()


@st.composite
def mutated_bytes(draw: st.DrawFn, seed: bytes) -> bytes:
    """A real record truncated, or with bytes overwritten or inserted."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        action = draw(st.sampled_from(["flip", "insert", "truncate"]))
        if action == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at:]
    return bytes(data)


payloads = st.one_of(
    st.binary(max_size=300),
    st.sampled_from(sorted(SEEDS.values())),
    *[mutated_bytes(seed) for seed in SEEDS.values()],
    *[mutated_json(seed) for name, seed in SEEDS.items() if name != "otlp_proto"],
)


class Harness:
    """The runner's per-record path with every sink in place but no topic (logged and counted)."""

    def __init__(self, fmt: str) -> None:
        self.exporter = PrometheusExporter()
        self.tracker = OffsetTracker()
        dead_letters = DeadLetterSink(None, None, self.exporter)
        results = ResultSink(None, None, self.exporter, dead_letters)
        limits = AssemblySettings(quiet_period_s=1.0, max_wait_s=2.0, max_open_traces=50)
        self.assembler = TraceAssembler(limits, clock=lambda: 0.0)
        self.processor = RecordProcessor(Pipeline(), self.tracker, self.exporter, results, dead_letters,
                                         {"t": fmt}, max_record_bytes=64 * 1024, assembler=self.assembler)
        self.offset = 0

    def feed(self, payload: bytes | None) -> None:
        record = ConsumerRecord("t", 0, -1, self.offset, 0, 0, b"k", payload, [], None, 1,
                                len(payload or b""), 0)
        self.processor.process(TopicPartition("t", 0), record)
        self.offset += 1

    def outcomes(self) -> dict[str, float]:
        out: dict[str, float] = {"ok": 0.0, "dead_lettered": 0.0}
        for family in (*self.exporter.records.collect(), *self.exporter.dead_letters.collect()):
            for sample in family.samples:
                if sample.name == "tracejudge_records_total":
                    out[sample.labels["outcome"]] += sample.value
                elif sample.name == "tracejudge_dead_letters_total":
                    out[f"reason:{sample.labels['reason']}"] = sample.value
        return out


HARNESSES = {fmt: Harness(fmt) for fmt in FORMATS}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(FORMATS), payload=payloads)
def test_every_record_is_processed_or_dead_lettered_with_a_reason(fmt, payload):
    harness = HARNESSES[fmt]
    before = harness.outcomes()
    harness.feed(payload)
    after = harness.outcomes()
    changed = {k for k in after if after[k] != before.get(k, 0)}
    assert changed in ({"ok"}, {"dead_lettered", *(k for k in changed if k.startswith("reason:"))}), changed
    if "dead_lettered" in changed:
        reasons = [k for k in changed if k.startswith("reason:")]
        assert len(reasons) == 1 and reasons[0].removeprefix("reason:") in KNOWN_REASONS
    # Nothing is left hanging: single-record formats complete at once; span formats once assembly
    # emits the traces they fed.
    for trace in harness.assembler.flush():
        harness.processor.emit_assembled(trace)
    assert harness.tracker.in_flight == 0
    assert harness.processor.exports.count == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_tombstones_and_oversized_records_are_dead_lettered_without_parsing(fmt):
    harness = Harness(fmt)
    harness.feed(None)
    harness.feed(b"{" + b" " * 70_000 + b"}")
    assert harness.outcomes() == {"ok": 0, "dead_lettered": 2, "reason:invalid_record": 1,
                                  "reason:too_large": 1}
    assert harness.tracker.in_flight == 0


def test_a_stream_of_mutated_records_through_the_broker_loses_nothing():
    bs = shared_broker().bootstrap_servers
    topic, results, dlq, group = unique("fuzz"), unique("results"), unique("dlq"), unique("group")
    rng = random.Random(5)
    seeds = [SEEDS["mlflow"], SEEDS["agent_eval"], SEEDS["inference_log"]]
    values = []
    for i in range(120):
        data = bytearray(rng.choice(seeds))
        if i % 3:  # two thirds damaged: bytes overwritten, or cut short
            if rng.random() < 0.5:
                for _ in range(rng.randint(1, 5)):
                    data[rng.randrange(len(data))] = rng.randrange(256)
            else:
                del data[rng.randrange(len(data)):]
        values.append(bytes(data))
    produce(bs, topic, values)
    s = runner_settings(bs, [topic], **{"stream.results_topic": results, "stream.dead_letter_topic": dlq,
                                        "kafka.group_id": group})
    with running(s) as runner:
        wait_until(lambda: metric(runner.http_port, "tracejudge_records_total") == len(values), 60)
        ok = metric(runner.http_port, "tracejudge_records_total", outcome="ok")
        rejected = metric(runner.http_port, "tracejudge_records_total", outcome="dead_lettered")
        assert ok + rejected == len(values) and rejected > 0 and ok >= 40
        out = read_topic(bs, results, at_least=int(ok))
        letters = read_topic(bs, dlq, at_least=int(rejected))
    assert len(out) == ok and len(letters) == rejected
    for letter in letters:
        headers = dict(letter.headers)
        assert headers[sinks.HEADER_REASON].decode() in KNOWN_REASONS
        assert headers[sinks.HEADER_ERROR]

