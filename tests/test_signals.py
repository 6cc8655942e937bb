"""Cheap signals without a judge (`tracejudge.metrics.signals`): each signal on crafted records and on
traces made by real producers (the OpenTelemetry SDK, MLflow tracing, OpenAI-shaped inference-log rows),
the warm-up, the bounds, the configuration, `tracejudge eval`'s output and the counters of a real run."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import mlflow
import orjson
import pytest
from mlflow.entities import SpanType
from opentelemetry.trace import SpanKind
from support import mlflow_apps
from support.kafka import metric, produce, read_topic, running, samples, settings, unique, wait_until
from support.otel_producers import Producer, encode

from tracejudge.consumer.config.loading import load_settings
from tracejudge.consumer.pipeline import Pipeline, build_pipeline
from tracejudge.consumer.stages.assembly import TraceAssembler
from tracejudge.metrics.computed import ComputedMetrics
from tracejudge.metrics.signals import (
    ANSWER_EVICTED,
    ANSWER_OVERLONG,
    APP_OVER_CAP,
    CACHE_HIT_RATIO,
    EMPTY_RETRIEVAL,
    REPEATED_ANSWER,
    SIGNALS,
    TOOL_RESULT_OVERSIZED,
    TOOL_RETRY_LOOP,
    AppNorms,
    P2Quantile,
    SignalsConfig,
)
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.errors import ConfigError
from tracejudge.schemas.formats import mlflow as mlflow_parser
from tracejudge.schemas.formats import mlflow_wire, otlp
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.record import Document, EvalRecord, ToolCall
from tracejudge.schemas.result import SourceRef
from tracejudge.schemas.trace import TokenUsage

SRC = SourceRef("test")


def metrics_of(record: EvalRecord, pipeline: Pipeline | None = None) -> dict[str, float | None]:
    return (pipeline or Pipeline()).evaluate(record, SRC).metrics


# -- per record --------------------------------------------------------------------------------------


def test_retry_loop_is_the_same_tool_with_equal_arguments_again():
    again = [ToolCall("search", {"q": "x", "k": 3}), ToolCall("fetch", {"id": 1}),
             ToolCall("search", {"k": 3, "q": "x"})]  # the same arguments in another key order
    assert metrics_of(EvalRecord(trajectory=again))[TOOL_RETRY_LOOP] == 1.0
    other_args = [ToolCall("search", {"q": "x"}), ToolCall("search", {"q": "y"})]
    assert metrics_of(EvalRecord(trajectory=other_args))[TOOL_RETRY_LOOP] == 0.0
    assert metrics_of(EvalRecord(trajectory=[]))[TOOL_RETRY_LOOP] == 0.0
    assert TOOL_RETRY_LOOP not in metrics_of(EvalRecord(response="no trajectory"))


def test_empty_retrieval_is_a_retrieval_step_with_no_document():
    assert metrics_of(EvalRecord(retrieved_context=[]))[EMPTY_RETRIEVAL] == 1.0
    assert metrics_of(EvalRecord(retrieved_context=[Document("a doc")]))[EMPTY_RETRIEVAL] == 0.0
    # No retrieval step at all is not "retrieved nothing".
    assert EMPTY_RETRIEVAL not in metrics_of(EvalRecord(response="x"))


def test_cache_hit_ratio_only_when_cached_tokens_are_stated():
    assert metrics_of(EvalRecord(tokens=TokenUsage(200, 10, 210, 150)))[CACHE_HIT_RATIO] == 0.75
    assert metrics_of(EvalRecord(tokens=TokenUsage(200, 10, 210, 0)))[CACHE_HIT_RATIO] == 0.0
    assert CACHE_HIT_RATIO not in metrics_of(EvalRecord(tokens=TokenUsage(200, 10, 210)))
    # More cached than input tokens, or no input tokens, is no ratio.
    assert CACHE_HIT_RATIO not in metrics_of(EvalRecord(tokens=TokenUsage(100, 10, 110, 150)))
    assert CACHE_HIT_RATIO not in metrics_of(EvalRecord(tokens=TokenUsage(None, 10, None, 5)))


def test_signals_off_compute_nothing():
    off = Pipeline(metrics=ComputedMetrics(signals=SignalsConfig(enabled=False)))
    record = EvalRecord(request="q", response="a", retrieved_context=[],
                        trajectory=[ToolCall("t"), ToolCall("t")], tokens=TokenUsage(10, 1, 11, 5),
                        max_tool_result_chars=10)
    assert not {*SIGNALS, CACHE_HIT_RATIO} & set(off.evaluate(record, SRC).metrics)
    only = Pipeline(metrics=ComputedMetrics(signals=SignalsConfig(tool_retry_loop=False)))
    got = only.evaluate(record, SRC).metrics
    assert TOOL_RETRY_LOOP not in got and got[EMPTY_RETRIEVAL] == 1.0


# -- real producers ----------------------------------------------------------------------------------


def _otel_trace(producer: Producer, *, cached: int | None, tool_args: list[dict], result: str) -> str:
    tracer = producer.tracer
    with tracer.start_as_current_span("invoke_agent bot", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "bot",
            "gen_ai.input.messages": json.dumps([{"role": "user",
                                                  "parts": [{"type": "text", "content": "q"}]}]),
            "gen_ai.output.messages": json.dumps([{"role": "assistant",
                                                   "parts": [{"type": "text", "content": "a"}]}])}) as root:
        for args in tool_args:
            with tracer.start_as_current_span("execute_tool lookup", attributes={
                    "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
                    "gen_ai.tool.call.arguments": json.dumps(args), "gen_ai.tool.call.result": result}):
                pass
        attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
                 "gen_ai.usage.input_tokens": 400, "gen_ai.usage.output_tokens": 20}
        if cached is not None:
            attrs["gen_ai.usage.cache_read.input_tokens"] = cached
        with tracer.start_as_current_span("chat gpt-4o", kind=SpanKind.CLIENT, attributes=attrs):
            pass
    return format(root.get_span_context().trace_id, "032x")


def _otlp_record(producer: Producer) -> EvalRecord:
    """The one trace the producer recorded, as `tracejudge run` reads it from OTLP protobuf."""
    assembler = TraceAssembler()
    fmt, groups = otlp.decode(encode(producer.finished()).SerializeToString())
    assert not assembler.add(groups, source_format=fmt)
    (assembled,) = assembler.flush()
    return derive(assembled.trace)


def test_otel_sdk_spans_give_retry_loop_tool_result_size_and_cache_ratio():
    producer = Producer("agent-svc")
    _otel_trace(producer, cached=300, tool_args=[{"city": "Oslo"}, {"city": "Oslo"}], result="x" * 1234)
    record = _otlp_record(producer)
    assert record.tokens == TokenUsage(400, 20, 420, 300)
    assert record.max_tool_result_chars == 1234
    got = metrics_of(record)
    assert got[TOOL_RETRY_LOOP] == 1.0 and got[CACHE_HIT_RATIO] == 0.75

    _otel_trace(producer, cached=None, tool_args=[{"city": "Oslo"}, {"city": "Rome"}], result="rain")
    record = _otlp_record(producer)
    assert record.tokens.cached_input is None and record.max_tool_result_chars == 4
    got = metrics_of(record)
    assert got[TOOL_RETRY_LOOP] == 0.0 and CACHE_HIT_RATIO not in got


def test_openinference_cached_tokens():
    producer = Producer("oi")
    with producer.tracer.start_as_current_span("llm", attributes={
            "openinference.span.kind": "LLM", "llm.token_count.prompt": 80, "llm.token_count.completion": 5,
            "llm.token_count.prompt_details.cache_read": 64, "input.value": "q", "output.value": "a"}):
        pass
    assert _otlp_record(producer).tokens == TokenUsage(80, 5, 85, 64)


def test_openai_cached_tokens_of_an_inference_log_row():
    usage = {"prompt_tokens": 2006, "completion_tokens": 300, "total_tokens": 2306,
             "prompt_tokens_details": {"cached_tokens": 1920, "audio_tokens": 0}}
    response = {"id": "c-1", "object": "chat.completion", "model": "gpt-4o", "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}
    row = {"databricks_request_id": "r-1", "request_time": "2026-11-22T10:15:30Z", "status_code": 200,
           "execution_duration_ms": 10, "served_entity_id": "bot",
           "request": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
           "response": json.dumps(response)}
    record = normalise(json.dumps(row))
    assert record.tokens == TokenUsage(2006, 300, 2306, 1920)
    assert metrics_of(record)[CACHE_HIT_RATIO] == pytest.approx(1920 / 2006)
    # The Responses API states them under input_tokens_details.
    response["usage"] = {"input_tokens": 100, "output_tokens": 5, "total_tokens": 105,
                         "input_tokens_details": {"cached_tokens": 40}}
    row["response"] = json.dumps(response)
    assert normalise(json.dumps(row)).tokens == TokenUsage(100, 5, 105, 40)


@mlflow.trace(span_type=SpanType.TOOL)
def _search(query: str) -> str:
    return "result " * 50


@mlflow.trace(span_type=SpanType.AGENT)
def _looping_agent(question: str) -> str:
    _search("same")
    _search("same")
    with mlflow.start_span("llm", span_type=SpanType.CHAT_MODEL) as span:
        span.set_attribute("mlflow.chat.tokenUsage", {"input_tokens": 500, "output_tokens": 10,
                                                      "total_tokens": 510, "cache_read_input_tokens": 400})
    return "answer"


def test_mlflow_traces_give_the_same_signals_through_both_readers():
    with mlflow_apps.capture() as traces:
        _looping_agent("q")
    payload = traces[0]
    fast = mlflow_wire.derive_canonical_json(payload)
    general = derive(mlflow_parser.parse_trace(orjson.loads(payload), everything=False))
    assert fast is not None and fast == general
    assert fast.tokens.cached_input == 400 and fast.max_tool_result_chars == len(json.dumps("result " * 50))
    got = metrics_of(normalise(payload))
    assert got[TOOL_RETRY_LOOP] == 1.0 and got[CACHE_HIT_RATIO] == 0.8


# -- relative to the app's norm ----------------------------------------------------------------------


def _answers(n: int, seed: int = 3) -> list[EvalRecord]:
    rng = random.Random(seed)
    return [EvalRecord(app="bot", request=f"question {i}", response="w" * rng.randint(80, 120),
                       max_tool_result_chars=rng.randint(900, 1100)) for i in range(n)]


def test_nothing_is_said_until_the_warmup_then_outliers_are_flagged():
    pipeline = Pipeline(metrics=ComputedMetrics(signals=SignalsConfig(warmup=20)))
    for record in _answers(20):
        got = metrics_of(record, pipeline)
        assert ANSWER_OVERLONG not in got and TOOL_RESULT_OVERSIZED not in got
    normal = metrics_of(EvalRecord(app="bot", request="q", response="w" * 110, max_tool_result_chars=1000),
                        pipeline)
    assert normal[ANSWER_OVERLONG] == 0.0 and normal[TOOL_RESULT_OVERSIZED] == 0.0
    long = metrics_of(EvalRecord(app="bot", request="q2", response="w" * 400, max_tool_result_chars=9000),
                      pipeline)
    assert long[ANSWER_OVERLONG] == 1.0 and long[TOOL_RESULT_OVERSIZED] == 1.0
    # Another app has a norm of its own, not warmed up yet.
    other = EvalRecord(app="other", request="q", response="w" * 400)
    assert ANSWER_OVERLONG not in metrics_of(other, pipeline)


def test_the_norm_follows_the_configured_factor():
    strict = Pipeline(metrics=ComputedMetrics(signals=SignalsConfig(warmup=20, answer_factor=1.0)))
    for record in _answers(40):
        strict.evaluate(record, SRC)
    # 125 characters is longer than every answer seen (80–120), but not 1.5 x their p95.
    assert metrics_of(EvalRecord(app="bot", response="w" * 125), strict)[ANSWER_OVERLONG] == 1.0
    loose = Pipeline(metrics=ComputedMetrics(signals=SignalsConfig(warmup=20)))
    for record in _answers(40):
        loose.evaluate(record, SRC)
    assert metrics_of(EvalRecord(app="bot", response="w" * 125), loose)[ANSWER_OVERLONG] == 0.0


@pytest.mark.parametrize("p", [0.5, 0.95])
def test_p2_estimates_the_quantile(p):
    # 20,000 log-normal lengths: the estimate within 3% of the exact sample quantile (whose own
    # standard error at n = 20,000 is under 1.5% for p = 0.95).
    rng = random.Random(7)
    values = [math.exp(rng.gauss(5, 0.6)) for _ in range(20_000)]
    estimate = P2Quantile(p)
    for v in values:
        estimate.add(v)
    exact = sorted(values)[int(p * len(values))]
    assert estimate.value() == pytest.approx(exact, rel=0.03)
    again = P2Quantile(p)
    for v in values:
        again.add(v)
    assert again.value() == estimate.value()  # deterministic


def test_the_same_answer_to_different_questions():
    pipeline = Pipeline()
    first = metrics_of(EvalRecord(app="a", request="How do I reset?", response="I cannot help with that."),
                       pipeline)
    assert first[REPEATED_ANSWER] == 0.0
    # The same question again (folded) with the same answer is not a repeat.
    same = metrics_of(EvalRecord(app="a", request="how do I  reset?", response="I cannot help with that."),
                      pipeline)
    assert same[REPEATED_ANSWER] == 0.0
    other = metrics_of(EvalRecord(app="a", request="Where is my order?",
                                  response="I CANNOT help with that. "), pipeline)
    assert other[REPEATED_ANSWER] == 1.0
    # Another app's answers are its own.
    assert metrics_of(EvalRecord(app="b", request="x", response="I cannot help with that."),
                      pipeline)[REPEATED_ANSWER] == 0.0
    assert REPEATED_ANSWER not in metrics_of(EvalRecord(app="a", request=None, response="r"), pipeline)
    assert REPEATED_ANSWER not in metrics_of(EvalRecord(app="a", request="q", response="  "), pipeline)


def test_state_stays_bounded_and_what_is_dropped_is_counted():
    norms = AppNorms(SignalsConfig(max_apps=3, answers_per_app=5, warmup=5))
    for i in range(10):
        values: dict = {}
        norms.apply(EvalRecord(app=f"app-{i}", request="q", response="a"), values)
        assert bool(values) == (i < 3)
    assert norms.apps == 3 and norms.dropped[APP_OVER_CAP] == 7
    for i in range(1000):
        norms.apply(EvalRecord(app="app-0", request=f"q{i}", response=f"answer {i}"), {})
    assert norms.answers == 5 + 2  # app-0 full, app-1 and app-2 one each
    assert norms.dropped[ANSWER_EVICTED] == 1 + 1000 - 5
    # An evicted answer is forgotten: asked again, it is not a repeat.
    values = {}
    norms.apply(EvalRecord(app="app-0", request="new", response="answer 0"), values)
    assert values[REPEATED_ANSWER] == 0.0


# -- configuration -----------------------------------------------------------------------------------


def test_configuration_keys_and_their_errors(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("metrics:\n  signals:\n    warmup: 10\n    answer_factor: 2\n"
                      "    repeated_answer: false\n")
    s = load_settings(config, environ={}, offline=True)
    metrics = build_pipeline(s).metrics
    assert metrics.signals.warmup == 10 and metrics.signals.answer_factor == 2
    assert metrics.norms is not None and not metrics.signals.repeated_answer
    for body, key in [("warmup: 2", "metrics.signals.warmup"), ("quantile: 1.5", "metrics.signals.quantile"),
                      ("answer_factor: 0", "metrics.signals.answer_factor"),
                      ("max_apps: 0", "metrics.signals.max_apps"), ("warmpu: 10", "metrics.signals.warmpu")]:
        config.write_text(f"metrics:\n  signals:\n    {body}\n")
        with pytest.raises(ConfigError) as exc:
            load_settings(config, environ={}, offline=True)
        assert key in str(exc.value)


# -- tracejudge eval and the exporter ----------------------------------------------------------------


def _rows(n: int) -> list[dict]:
    rng = random.Random(5)
    rows = []
    for i in range(n):
        answer = "canned reply" if i % 10 == 9 else f"{i:03d} " + "w" * rng.randint(80, 120)
        rows.append({"request": f"q{i}", "response": answer if i != n - 1 else "w" * 900,
                     "retrieved_context": [] if i % 7 == 0 else [{"content": "d"}],
                     "trajectory": [{"tool_name": "t", "tool_input": {"i": 1}}] * (2 if i % 5 == 0 else 1),
                     "tags": {"app": "shop"}})
    return rows


def test_eval_writes_the_signals_in_record_order(tmp_path):
    rows = _rows(80)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "c.yaml"
    config.write_text("stream:\n  app_tag: app\nmetrics:\n  signals:\n    warmup: 20\n")
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "tracejudge.consumer.commands.cli", "eval", str(data),
                           "--config", str(config), "-o", str(out), "-q"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = [json.loads(line)["metrics"] for line in out.read_text().splitlines()]
    assert [m[TOOL_RETRY_LOOP] for m in got] == [float(i % 5 == 0) for i in range(80)]
    assert [m[EMPTY_RETRIEVAL] for m in got] == [float(i % 7 == 0) for i in range(80)]
    assert all(ANSWER_OVERLONG not in m for m in got[:20])
    assert got[-1][ANSWER_OVERLONG] == 1.0
    # The canned reply is a repeat from its second use on.
    assert got[9][REPEATED_ANSWER] == 0.0
    repeats = [i for i, m in enumerate(got) if m[REPEATED_ANSWER] == 1.0]
    assert repeats == list(range(19, 79, 10))
    # The same values as the pipeline gives in the same order.
    pipeline = build_pipeline(load_settings(config, environ={}, offline=True))
    for row, metrics in zip(rows, got, strict=True):
        assert pipeline.evaluate(pipeline.normalise(json.dumps(row)), SRC).metrics == metrics


def test_exporter_counts_signals_per_app_and_passes_promtool(tmp_path):
    exporter = PrometheusExporter(max_apps=5)
    pipeline = Pipeline(metrics=ComputedMetrics(signals=SignalsConfig(warmup=20)))
    exporter.signals.watch(pipeline.metrics.norms)
    rows = _rows(80)
    for row in rows:
        record = normalise(json.dumps(row), app_tag="app")
        record.tokens = TokenUsage(100, 5, 105, 25)
        exporter.export(pipeline.evaluate(record, SRC))
    from prometheus_client import generate_latest

    text = generate_latest(exporter.registry).decode()
    table = samples(text)

    def val(name, **labels):
        return sum(v for (n, ls), v in table.items() if n == name and set(labels.items()) <= ls)

    assert val("tracejudge_signals_total", app="shop", signal=TOOL_RETRY_LOOP) == 16
    assert val("tracejudge_signals_checked_total", app="shop", signal=TOOL_RETRY_LOOP) == 80
    assert val("tracejudge_signals_total", app="shop", signal=EMPTY_RETRIEVAL) == 12
    assert val("tracejudge_signals_checked_total", app="shop", signal=ANSWER_OVERLONG) == 60
    assert val("tracejudge_cached_input_tokens_total", app="shop") == 80 * 25
    assert val("tracejudge_metric_value_count", app="shop", metric=CACHE_HIT_RATIO) == 80
    assert val("tracejudge_signal_state_apps") == 1
    assert val("tracejudge_signal_state_dropped_total", reason=APP_OVER_CAP) == 0
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


# -- the stream --------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "decode-worker"])
def test_a_run_counts_the_signals_it_publishes(broker, workers):
    bs = broker.bootstrap_servers
    topic, results = unique("rows"), unique("results")
    rows = _rows(60)
    # One partition: the stream meets the rows in the order `tracejudge eval` reads them.
    produce(bs, topic, [json.dumps(r).encode() for r in rows], keys=[b"k"] * len(rows))
    s = settings(bs, [f"{topic}:agent_eval"], **{"stream.results_topic": results, "stream.app_tag": "app",
                                                 "stream.decode_workers": workers,
                                                 "metrics.signals.warmup": 20})
    with running(s) as runner:
        port = runner.http_port
        wait_until(lambda: metric(port, "tracejudge_signals_checked_total", app="shop",
                                  signal=TOOL_RETRY_LOOP) == 60, 60, message="every row counted")
        out = [orjson.loads(r.value) for r in read_topic(bs, results, at_least=60)]
        counted = {sig: metric(port, "tracejudge_signals_total", app="shop", signal=sig) for sig in SIGNALS}
        assert metric(port, "tracejudge_signal_state_apps") == 1
    published = {sig: sum(r["metrics"].get(sig) == 1.0 for r in out) for sig in SIGNALS}
    assert counted == published
    assert published[TOOL_RETRY_LOOP] == 12 and published[EMPTY_RETRIEVAL] == 9
    # In record order, as offline.
    out.sort(key=lambda r: r["source"]["offset"])
    pipeline = build_pipeline(s)
    for row, result in zip(rows, out, strict=True):
        assert pipeline.evaluate(pipeline.normalise(json.dumps(row)), SRC).metrics == result["metrics"]
    assert published[REPEATED_ANSWER] == 4 and published[ANSWER_OVERLONG] >= 1
