"""Trace assembly on its own: quiet period, maximum wait, caps, late spans, tickets and metrics.

Time is a fake clock the tests advance; tickets are counters standing in for the runner's offset
tracker (`acquire` = one more piece of work depends on the record, `release` = that piece is done).
"""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry
from support.otel_producers import Producer, encode, genai_trace, kafka_messages, to_otlp_json

from tracejudge.consumer.stages.assembly import (
    AssembledTrace,
    AssemblySettings,
    OtlpLineAssembler,
    TraceAssembler,
)
from tracejudge.metrics.telemetry.assembly import AssemblyMetrics
from tracejudge.schemas.errors import RecordError
from tracejudge.schemas.formats import otlp
from tracejudge.schemas.formats.otlp import SpanGroup


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingTicket:
    """Starts at 1: the record's own processing holds the first reference, as in the runner."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.refs = 1

    def acquire(self) -> None:
        self.refs += 1

    def release(self) -> None:
        assert self.refs > 0, f"{self.name} released more often than acquired"
        self.refs -= 1


def traces(n: int, service: str = "svc") -> list[tuple[str, list[SpanGroup]]]:
    """n real 4-span GenAI traces, each as its decoded span groups, one span per group."""
    producer = Producer(service)
    out = []
    for i in range(n):
        rec = genai_trace(producer.tracer, f"q{i}", f"a{i}")
        spans = producer.finished()  # children first, the root ends last
        groups = [otlp.decode_proto(encode([s]).SerializeToString())[0] for s in spans]
        out.append((rec.trace_id, groups))
    return out


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


@pytest.fixture
def env():
    clock, registry = Clock(), CollectorRegistry()
    metrics = AssemblyMetrics(registry)
    settings = AssemblySettings(quiet_period_s=2.0, max_wait_s=30.0)
    return clock, registry, TraceAssembler(settings, clock=clock, metrics=metrics)


def test_trace_is_emitted_after_root_and_quiet_period(env):
    clock, registry, asm = env
    ((trace_id, groups),) = traces(1)
    for group in groups[:3]:  # children only
        assert asm.add([group], source_format="otlp_proto") == []
        clock.now += 1.5
    assert asm.poll() == []  # quiet, but no root yet
    asm.add([groups[3]], source_format="otlp_proto")
    clock.now += 1.9
    assert asm.poll() == []
    assert asm.next_due() == pytest.approx(clock.now + 0.1)
    clock.now += 0.1
    (out,) = asm.poll()
    assert out.reason == "complete" and out.trace.complete is True
    assert out.trace.trace_id == trace_id and len(out.trace.spans) == 4
    assert out.record().request == "q0" and out.record().complete is True
    assert (asm.open_traces, asm.spans_held, asm.next_due()) == (0, 0, None)
    assert sample(registry, "tracejudge_assembly_traces_emitted_total", reason="complete") == 1
    assert sample(registry, "tracejudge_assembly_spans_total") == 4
    assert sample(registry, "tracejudge_assembly_open_traces") == 0


def test_a_new_span_restarts_the_quiet_period(env):
    clock, _, asm = env
    ((_, groups),) = traces(1)
    asm.add([groups[3]], source_format="otlp_proto")  # root first (another service ended later)
    clock.now += 1.5
    asm.add([groups[0]], source_format="otlp_proto")
    clock.now += 1.5
    assert asm.poll() == []
    clock.now += 0.5
    (out,) = asm.poll()
    assert len(out.trace.spans) == 2 and out.trace.complete


def test_rootless_trace_times_out_incomplete(env):
    clock, registry, asm = env
    ((_, groups),) = traces(1)
    asm.add(groups[:3], source_format="otlp_proto")
    clock.now += 29.9
    assert asm.poll() == []
    clock.now += 0.1
    (out,) = asm.poll()
    assert out.reason == "timeout" and out.trace.complete is False
    record = out.record()
    assert record.complete is False and record.request is None and record.latency_seconds is None
    assert record.app == "svc"
    assert sample(registry, "tracejudge_assembly_traces_emitted_total", reason="timeout") == 1


def test_busy_trace_is_emitted_at_max_wait_even_with_root(env):
    clock, _, asm = env
    ((_, groups),) = traces(1)
    asm.add([groups[3]], source_format="otlp_proto")
    for group in groups[:3] * 30:  # a span every second for 30 s: never quiet
        clock.now += 1.0
        asm.add([group], source_format="otlp_proto")
        emitted = asm.poll()
        if emitted:
            break
    (out,) = emitted
    assert out.reason == "timeout" and out.trace.complete is False
    assert len(out.trace.spans) == 4  # duplicates (re-deliveries) are dropped by span id


def test_open_trace_cap_evicts_oldest():
    clock, registry = Clock(), CollectorRegistry()
    asm = TraceAssembler(AssemblySettings(max_open_traces=2), clock=clock, metrics=AssemblyMetrics(registry))
    made = traces(3)
    assert asm.add([made[0][1][0]], source_format="otlp_proto") == []
    clock.now += 1
    assert asm.add([made[1][1][0]], source_format="otlp_proto") == []
    clock.now += 1
    (evicted,) = asm.add([made[2][1][0]], source_format="otlp_proto")
    assert evicted.reason == "evicted" and evicted.trace.trace_id == made[0][0]
    assert evicted.trace.complete is False
    assert asm.open_traces == 2
    assert sample(registry, "tracejudge_assembly_traces_emitted_total", reason="evicted") == 1


def test_held_span_cap_evicts_until_under_the_cap():
    clock = Clock()
    asm = TraceAssembler(AssemblySettings(max_spans_held=4), clock=clock)
    made = traces(3)
    assert asm.add(made[0][1][:2], source_format="otlp_proto") == []
    assert asm.add(made[1][1][:2], source_format="otlp_proto") == []
    out = asm.add(made[2][1][:3], source_format="otlp_proto")  # 7 held > 4: the two oldest go
    assert [o.trace.trace_id for o in out] == [made[0][0], made[1][0]]
    assert all(o.reason == "evicted" and not o.trace.complete for o in out)
    assert asm.spans_held == 3


def test_tickets_commit_a_record_only_when_every_trace_it_touched_is_exported(env):
    clock, _, asm = env
    (t1, g1), (t2, g2) = traces(2)
    rec_a, rec_b, rec_c = CountingTicket("a"), CountingTicket("b"), CountingTicket("c")
    # Record a: children of both traces, two groups of trace 1 (two resources): acquired once per trace.
    asm.add([g1[0], g1[1], g2[0]], source_format="otlp_proto", ticket=rec_a)
    rec_a.release()  # the runner is done processing record a itself
    assert rec_a.refs == 2
    asm.add([g1[2], g1[3]], source_format="otlp_proto", ticket=rec_b)  # completes trace 1
    rec_b.release()
    asm.add(g2[1:], source_format="otlp_proto", ticket=rec_c)
    rec_c.release()
    clock.now += 2.0
    out = {o.trace.trace_id: o for o in asm.poll()}
    assert set(out) == {t1, t2}
    assert [t.name for t in out[t1].tickets] == ["a", "b"]
    assert [t.name for t in out[t2].tickets] == ["a", "c"]
    out[t1].release()  # trace 1 exported
    assert (rec_a.refs, rec_b.refs, rec_c.refs) == (1, 0, 1)
    out[t1].release()  # idempotent: tickets are handed back once
    assert rec_a.refs == 1
    out[t2].release()
    assert (rec_a.refs, rec_c.refs) == (0, 0)


def test_late_spans_are_dropped_and_counted_without_holding_their_record(env):
    clock, registry, asm = env
    ((_, groups),) = traces(1)
    asm.add(groups[1:], source_format="otlp_proto")
    clock.now += 2.0
    (out,) = asm.poll()
    assert len(out.trace.spans) == 3
    late = CountingTicket("late")
    assert asm.add([groups[0]], source_format="otlp_proto", ticket=late) == []
    assert late.refs == 1 and asm.open_traces == 0
    assert sample(registry, "tracejudge_assembly_late_spans_total") == 1


def test_discard_keeps_tickets_unreleased(env):
    clock, registry, asm = env
    (t1, g1), (t2, g2) = traces(2)
    asm.add(g1, source_format="otlp_proto")
    clock.now += 2.0
    (done,) = asm.poll()
    assert done.trace.trace_id == t1
    ticket = CountingTicket("r")
    asm.add(g2[:2], source_format="otlp_proto", ticket=ticket)
    ticket.release()
    assert asm.discard() == 1
    assert ticket.refs == 1  # never released: the record stays uncommitted and is read again
    assert (asm.open_traces, asm.spans_held) == (0, 0)
    assert sample(registry, "tracejudge_assembly_traces_discarded_total") == 1
    assert sample(registry, "tracejudge_assembly_spans_held") == 0
    # Re-reading from the lowest unfinished offset: trace 2 assembles whole; spans of trace 1 (already
    # emitted, its export finishing on its own) in the re-read records are late, not a partial copy.
    asm.add(g2 + g1[:1], source_format="otlp_proto")
    clock.now += 2.0
    (again,) = asm.poll()
    assert again.trace.trace_id == t2 and len(again.trace.spans) == 4 and again.trace.complete
    assert sample(registry, "tracejudge_assembly_late_spans_total") == 1


def test_flush_emits_everything_at_end_of_input(env):
    _, registry, asm = env
    (t1, g1), (t2, g2) = traces(2)
    asm.add(g1, source_format="otlp_proto")
    asm.add(g2[:2], source_format="otlp_proto")
    out = {o.trace.trace_id: o for o in asm.flush()}
    assert (out[t1].reason, out[t1].trace.complete) == ("complete", True)
    assert (out[t2].reason, out[t2].trace.complete) == ("flushed", False)
    assert sample(registry, "tracejudge_assembly_traces_emitted_total", reason="flushed") == 1


def test_app_is_the_root_spans_service():
    clock = Clock()
    asm = TraceAssembler(AssemblySettings(quiet_period_s=1.0), clock=clock)
    ((trace_id, groups),) = traces(1, service="frontend")
    child = SpanGroup(trace_id, "backend", groups[0].spans)
    asm.add([child], source_format="otlp_proto")
    asm.add([groups[3]], source_format="otlp_proto")
    clock.now += 1.0
    (out,) = asm.poll()
    assert out.trace.app == "frontend"


def test_app_tag_names_a_root_attribute_or_trace_tag():
    producer = Producer("frontend")
    with producer.tracer.start_as_current_span("agent", attributes={
            "gen_ai.operation.name": "invoke_agent", "mlflow.traceTag.team": "search", "tenant": "acme"}):
        pass
    groups = otlp.decode_proto(encode(producer.finished()).SerializeToString())
    apps = []
    for tag in (None, "team", "tenant", "missing"):
        asm = TraceAssembler(app_tag=tag)
        asm.add(groups, source_format="otlp_proto")
        (out,) = asm.flush()
        apps.append(out.trace.app)
        assert out.trace.tags == {"team": "search"}
    assert apps == ["frontend", "search", "acme", "frontend"]


@pytest.mark.parametrize(("change", "key"), [
    ({"quiet_period_s": 0}, "quiet_period_s"),
    ({"max_wait_s": 1.0, "quiet_period_s": 5.0}, "max_wait_s"),
    ({"max_open_traces": 0}, "max_open_traces"),
    ({"max_spans_held": 1.5}, "max_spans_held"),
])
def test_settings_errors_name_the_key(change, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        TraceAssembler(AssemblySettings(**change))


def test_assembled_trace_release_without_tickets_is_harmless(env):
    clock, _, asm = env
    ((_, groups),) = traces(1)
    asm.add(groups, source_format="otlp_proto")
    clock.now += 2
    (out,) = asm.poll()
    assert isinstance(out, AssembledTrace) and out.tickets == []
    out.release()


def test_otlp_json_lines_for_eval():
    """`tracejudge eval` over a file of OTLP/JSON lines: traces span lines, a bad line is skipped."""
    producer = Producer("geo-agent")
    recs = [genai_trace(producer.tracer, f"question {i}", f"answer {i}") for i in range(3)]
    spans = producer.finished()
    lines = [v for _, v in kafka_messages(spans, per_message=3, fmt="otlp_json")]
    lines.insert(2, b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}')
    assembler = OtlpLineAssembler()
    out, errors = [], []
    for lineno, line in enumerate(lines, start=1):
        try:
            out += assembler.feed(line, lineno)
        except RecordError as exc:
            errors.append((lineno, exc.field))
    out += assembler.finish()
    assert errors == [(3, "resourceSpans[0].scopeSpans[0].spans[0].traceId")]
    by_id = {t.trace.trace_id: t for t in out}
    assert [by_id[r.trace_id].record().request for r in recs] == ["question 0", "question 1", "question 2"]
    assert by_id[recs[0].trace_id].line == 1 and by_id[recs[2].trace_id].line == 4
    assert all(t.trace.source_format == "otlp_json" and t.trace.complete for t in out)
    # A pre-parsed line (the eval loop already decoded it to detect the format) works the same.
    again = OtlpLineAssembler()
    again.feed(json.loads(to_otlp_json(encode(spans))), 1)
    assert len(again.finish()) == 3


def test_assembly_metrics_pass_promtool_lint(env):
    import subprocess

    from prometheus_client import generate_latest
    from support.deploy_files import tool

    clock, registry, asm = env
    ((_, groups),) = traces(1)
    asm.add(groups, source_format="otlp_proto")
    clock.now += 2
    asm.poll()
    text = generate_latest(registry)
    assert b'tracejudge_assembly_traces_emitted_total{reason="complete"} 1.0' in text
    proc = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=30,
                          check=False)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_entry_span_with_a_remote_parent_stands_in_for_a_root_that_never_arrives():
    """An uninstrumented gateway propagated `traceparent`: the agent's top span has a remote parent
    that is never exported. The trace still completes on its quiet period and has a root."""
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    producer = Producer("agent")
    remote = SpanContext(trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736, span_id=0x00F067AA0BA902B7,
                         is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    context = otel_trace.set_span_in_context(NonRecordingSpan(remote))
    question = json.dumps([{"role": "user", "parts": [{"type": "text", "content": "hi?"}]}])
    with (producer.tracer.start_as_current_span("invoke_agent", context=context, attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.input.messages": question}),
          producer.tracer.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat"})):
        pass
    request = encode(producer.finished())
    assert request.resource_spans[0].scope_spans[0].spans[1].flags == 0x300
    clock = Clock()
    asm = TraceAssembler(AssemblySettings(quiet_period_s=1.0), clock=clock)
    for payload in (request.SerializeToString(), to_otlp_json(request)):
        asm.add(otlp.decode(payload)[1], source_format="otlp_proto")
        clock.now += 1.0
        (out,) = asm.poll()
        assert out.reason == "complete" and out.trace.complete
        record = out.record()
        assert record.request == "hi?" and record.latency_seconds is not None
        root = next(s for s in out.trace.spans if s.parent_id is None)
        assert root.name == "invoke_agent"
        assert root.attributes["tracejudge.remote_parent_span_id"] == "00f067aa0ba902b7"
        asm = TraceAssembler(AssemblySettings(quiet_period_s=1.0), clock=clock)


def test_content_log_records_that_cannot_join_a_span_are_counted_not_held(env):
    """A content event naming no trace or span, or a span its trace never had, is dropped and
    counted; the one naming a span of the trace is kept with it."""
    from tracejudge.schemas.formats import otlp_logs

    clock, registry, asm = env
    ((trace_id, groups),) = traces(1)
    root = next(s for g in groups for s in g.spans if s.parent_id is None)
    doc = {"resourceLogs": [{"resource": {"attributes": []}, "scopeLogs": [{"logRecords": [
        {"eventName": "gen_ai.user.message", "traceId": trace_id, "spanId": root.span_id,
         "body": {"kvlistValue": {"values": [{"key": "content", "value": {"stringValue": "hi"}}]}}},
        {"eventName": "gen_ai.user.message", "traceId": trace_id, "spanId": "ab" * 8, "body": {}},
        {"eventName": "gen_ai.choice", "body": {}},  # no trace or span id
        {"eventName": "app.log", "traceId": trace_id, "spanId": root.span_id},  # not content: unread
    ]}]}]}
    events = otlp_logs.decode_json(doc)
    assert asm.add(events, source_format="otlp_json") == []
    assert registry.get_sample_value("tracejudge_assembly_log_events_unplaced_total") == 1
    for group in groups:
        asm.add([group], source_format="otlp_json")
    clock.now += 2.0
    (out,) = asm.poll()
    assert registry.get_sample_value("tracejudge_assembly_log_events_unplaced_total") == 2
    assert out.trace.trace_id == trace_id
