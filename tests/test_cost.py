"""What traces cost the agent and what judgements cost, and the judges' hard spend caps.

Stated cost comes from real MLflow traces (MLflow's own cost functions set `mlflow.llm.cost` on the
model-call spans and the `mlflow.trace.cost` roll-up, as its client does for backends that need
client-side cost); priced cost from real OpenTelemetry GenAI spans; the caps run against the loopback
OpenAI stub."""

from __future__ import annotations

import json
from typing import Any

import mlflow
import orjson
import pytest
from genai_prices import Usage, calc_price
from mlflow.entities import SpanType
from mlflow.entities import Trace as MlflowTrace
from mlflow.tracing.utils import aggregate_cost_from_spans, set_span_cost_attribute
from prometheus_client import CollectorRegistry
from support import mlflow_apps
from support.openai_stub import OpenAIStub, Reply, StubRequest
from support.otel_producers import Producer, genai_trace, kafka_messages

from tracejudge.consumer.pipeline import Pipeline
from tracejudge.consumer.stages.assembly import TraceAssembler
from tracejudge.metrics.cost import PriceTable, trace_cost
from tracejudge.metrics.judges.budget import SpendCap
from tracejudge.metrics.judges.config import JudgeConfigError
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.formats import otlp
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.record import Cost, Document, EvalRecord, TokenUsage
from tracejudge.schemas.result import EvaluationResult, SourceRef

# --- the agent's cost: stated by MLflow ----------------------------------------------------------


def _costed_chat(question: str, model: str, tokens: tuple[int, int]) -> str:
    with mlflow.start_span("chat", span_type=SpanType.CHAT_MODEL) as span:
        span.set_inputs({"messages": [{"role": "user", "content": question}]})
        span.set_outputs({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})
        span.set_attribute("mlflow.chat.tokenUsage", {"input_tokens": tokens[0], "output_tokens": tokens[1],
                                                      "total_tokens": sum(tokens)})
        span.set_attribute("mlflow.llm.model", model)
        set_span_cost_attribute(span)  # MLflow's own pricing of the span
    return "ok"


@mlflow.trace(span_type=SpanType.AGENT)
def two_model_agent(question: str) -> str:
    _costed_chat(question, "gpt-4o-mini", (1200, 80))
    _costed_chat(question, "gpt-4o", (300, 40))
    return _costed_chat(question, "gpt-4o-mini", (100, 20))


def _mlflow_costed_trace(**metadata_cost: Any) -> tuple[str, dict[str, float]]:
    """A real MLflow trace with span costs and the `mlflow.trace.cost` roll-up MLflow's client writes
    (`aggregate_cost_from_spans`); `metadata_cost` overrides the roll-up (a partial sum)."""
    with mlflow_apps.capture() as sink:
        mlflow_apps.call(two_model_agent, ("What does it cost?",))
    (text,) = sink
    trace = MlflowTrace.from_json(text)
    stated = aggregate_cost_from_spans(trace.data.spans)
    assert stated and stated["total_cost"] > 0
    doc = json.loads(text)
    doc["info"]["trace_metadata"]["mlflow.trace.cost"] = json.dumps({**stated, **metadata_cost})
    return json.dumps(doc), stated


def test_mlflow_stated_cost_is_what_mlflow_stated_on_every_reader() -> None:
    payload, stated = _mlflow_costed_trace()
    pipeline = Pipeline()
    for text in (payload, payload.encode()):
        record = pipeline.normalise(text)
        result = pipeline.evaluate(record, SourceRef(format=record.source_format))
        cost = result.record.cost
        assert cost is not None and cost.source == "stated"
        assert cost.total == pytest.approx(stated["total_cost"], rel=1e-12)
        assert cost.input == pytest.approx(stated["input_cost"], rel=1e-12)
        assert cost.output == pytest.approx(stated["output_cost"], rel=1e-12)
        # Per-model usage: a trace calling two models keeps them apart.
        assert record.model_usage == {"gpt-4o-mini": TokenUsage(1300, 100, 1400),
                                      "gpt-4o": TokenUsage(300, 40, 340)}
    # The general reader (orjson + every form) agrees with the msgspec fast path.
    from tracejudge.schemas.formats import mlflow as mlflow_parser
    general = derive(mlflow_parser.parse_trace(json.loads(payload), everything=False))
    assert general.cost == normalise(payload).cost and general.model_usage == normalise(payload).model_usage


def test_spans_cost_wins_over_a_partial_trace_roll_up() -> None:
    # Asynchronous logging can store a roll-up that missed a span: the spans' own costs are used.
    payload, stated = _mlflow_costed_trace(total_cost=0.000001, input_cost=0.000001, output_cost=0.0)
    record = normalise(payload)
    assert record.cost is not None and record.cost.total == pytest.approx(stated["total_cost"], rel=1e-12)


def test_a_negative_stated_cost_is_ignored_counted_and_never_exported() -> None:
    record = EvalRecord(trace_id="t1", app="shop", tokens=TokenUsage(1000, 100, 1100),
                        model_usage={"gpt-4o-mini": TokenUsage(1000, 100, 1100)})
    record.cost = Cost(-2.0, 0.5, -1.5, source="stated")
    exporter = PrometheusExporter()
    result = Pipeline().evaluate(record, SourceRef(format="agent_eval"))
    assert result.record.cost is not None and result.record.cost.source == "priced"
    assert result.record.cost.total and result.record.cost.total > 0
    assert result.metric_errors["cost"].startswith("negative_cost")
    # The result reports what was set aside; its cost, the dashboards' figure, is the priced one.
    line = orjson.loads(result.to_json())
    assert line["cost"]["source"] == "priced"
    assert min(line["cost"][k] for k in ("input", "output", "total")) > 0
    exporter.export(result)
    reg = exporter.registry
    assert reg.get_sample_value("tracejudge_cost_ignored_total", {"reason": "negative_cost"}) == 1
    assert reg.get_sample_value("tracejudge_metric_errors_total", {"metric": "cost"}) is None
    # Absurd token counts are set aside the same way: the cost is then unknown, not guessed.
    bad = EvalRecord(trace_id="t2", model_usage={"gpt-4o-mini": TokenUsage(10**12, 5, None)})
    result = Pipeline().evaluate(bad, SourceRef(format="agent_eval"))
    assert result.record.cost is not None and result.record.cost.source == "unknown"
    assert result.metric_errors["cost"].startswith("absurd_tokens")


# --- the agent's cost: priced from OpenTelemetry GenAI spans -------------------------------------------


def _otel_records(model: str | None = None) -> list[EvalRecord]:
    """One real OpenTelemetry GenAI trace (the producers' `genai_trace`, or one chat call to `model`)."""
    producer = Producer("geo-agent")
    if model is None:
        genai_trace(producer.tracer, "What is the capital of France?", "Paris.")
    else:
        with producer.tracer.start_as_current_span("chat", attributes={
                "gen_ai.operation.name": "chat", "gen_ai.provider.name": "acme",
                "gen_ai.request.model": model, "gen_ai.usage.input_tokens": 31,
                "gen_ai.usage.output_tokens": 9}):
            pass
    assembler = TraceAssembler()
    for _, payload in kafka_messages(producer.finished(), per_message=2):
        fmt, groups = otlp.decode(payload)
        assembler.add(groups, source_format=fmt)
    return [derive(a.trace) for a in assembler.flush()]


def test_otel_genai_trace_is_priced_from_its_model_and_usage() -> None:
    (record,) = _otel_records()
    assert record.model_usage == {"gpt-4o": TokenUsage(31, 9, 40)}
    assert record.cost is None  # nothing stated
    exporter = PrometheusExporter()
    result = Pipeline().evaluate(record, SourceRef(format=record.source_format))
    expected = calc_price(Usage(input_tokens=31, output_tokens=9), model_ref="gpt-4o")
    cost = result.record.cost
    assert cost is not None and cost.source == "priced"
    assert cost.input == pytest.approx(float(expected.input_price))
    assert cost.output == pytest.approx(float(expected.output_price))
    assert cost.total == pytest.approx(float(expected.total_price))
    exporter.export(result)
    reg = exporter.registry
    app = {"app": "geo-agent"}
    assert reg.get_sample_value("tracejudge_cost_usd_total", app) == pytest.approx(cost.total)
    assert reg.get_sample_value("tracejudge_trace_cost_usd_count", {"app": "geo-agent"}) == 1
    assert "cost" not in result.metric_errors


def test_an_unknown_model_is_counted_and_never_guessed() -> None:
    (record,) = _otel_records(model="in-house-llm-7")
    assert record.model_usage == {"in-house-llm-7": TokenUsage(31, 9, 40)}
    exporter = PrometheusExporter()
    result = Pipeline().evaluate(record, SourceRef(format=record.source_format))
    assert result.record.cost is not None and result.record.cost.source == "unknown"
    assert result.record.cost.total is None
    exporter.export(result)
    reg = exporter.registry
    assert reg.get_sample_value("tracejudge_cost_unknown_total", {"reason": "unknown_model"}) == 1
    assert reg.get_sample_value("tracejudge_cost_usd_total", {"app": "geo-agent"}) == 0
    # A configured price for the model prices it.
    priced = trace_cost(record, PriceTable({"in-house-llm-7": _price(1.0, 2.0)}))
    assert priced.cost.source == "priced" and priced.cost.total == pytest.approx((31 * 1 + 9 * 2) / 1e6)


def _price(i: float, o: float) -> Any:
    from tracejudge.metrics.cost import Price
    return Price(i, o)


# --- judges: cost and hard caps ------------------------------------------------------------------------

PRICE = {"input_per_mtok": 1000.0, "output_per_mtok": 2000.0}  # dear, so a few judgements reach the cap


def _record(i: int) -> EvalRecord:
    return EvalRecord(trace_id=f"{i:032x}", app="shop", failed=False,
                      request=f"How long is return window {i}?",
                      response="Items can be returned within 30 days.",
                      retrieved_context=[Document("Items can be returned within 30 days of delivery.")])


def _runner(stub: OpenAIStub, registry: CollectorRegistry, **endpoint: Any) -> JudgeRunner:
    config = {"endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model",
                                        "backoff_initial_seconds": 0.01, **endpoint}},
              "sample_rate": 1.0, "builtin": {"relevance_to_query": {}}, "max_in_flight": 8}
    return JudgeRunner(config, registry=registry)


def _largest_usage(req: StubRequest) -> Reply:
    """The largest usage a judgement can be billed under the cap's estimate: twice the 4-characters-
    per-token prompt estimate, and every output token the request allowed."""
    prompt_tokens = (len(req.prompt) // 4 + 1) * 2
    return Reply.verdict("yes", prompt_tokens=prompt_tokens, completion_tokens=req.body["max_tokens"])


def test_judge_cost_is_reported_usage_times_the_price() -> None:
    registry = CollectorRegistry()
    with (OpenAIStub(lambda req: Reply.verdict("yes", prompt_tokens=400, completion_tokens=30)) as stub,
          _runner(stub, registry, price=PRICE) as runner):
        (a,) = runner.judge_sync(_record(0))
    assert a.passed is True and a.cost_usd == pytest.approx((400 * 1000 + 30 * 2000) / 1e6)
    assert registry.get_sample_value("tracejudge_judge_cost_usd_total",
                                     {"judge": "relevance_to_query"}) == pytest.approx(a.cost_usd)


def test_spend_cap_is_never_exceeded_by_more_than_the_in_flight_estimate() -> None:
    cap_usd = 10.0
    registry = CollectorRegistry()
    with (OpenAIStub(_largest_usage) as stub,
          _runner(stub, registry, price=PRICE, usd_per_hour=cap_usd, max_output_tokens=512) as runner):
        results = list(runner.judge_many(_record(i) for i in range(60)))
        remaining = runner.spend_caps["default"].remaining()["hour"]
        gauge = registry.get_sample_value("tracejudge_judge_budget_remaining_usd",
                                          {"endpoint": "default", "window": "hour"})
    judged = [a for (a,) in results if a.skipped is None]
    skipped = [a for (a,) in results if a.skipped == "budget"]
    assert judged and skipped and len(judged) + len(skipped) == 60
    # What the endpoint billed (its reported usage), recomputed from the stub's own answers.
    billed = sum((orjson.loads(reply.body)["usage"]["prompt_tokens"] * PRICE["input_per_mtok"]
                  + orjson.loads(reply.body)["usage"]["completion_tokens"] * PRICE["output_per_mtok"]) / 1e6
                 for _, reply in stub.answered)
    assert billed == pytest.approx(sum(a.cost_usd for a in judged))
    # The bound: each admitted judgement was charged its estimate while in flight, and its reported
    # usage never exceeded it, so the settled spend stays within the cap.
    one_estimate = max(a.cost_usd for a in judged)
    assert billed <= cap_usd + 1e-9
    assert billed > cap_usd - 2 * one_estimate  # the cap was used, not left idle
    assert remaining == pytest.approx(cap_usd - billed) and gauge == pytest.approx(remaining)
    labels = {"app": "shop", "judge": "relevance_to_query", "reason": "budget"}
    assert registry.get_sample_value("tracejudge_judge_skipped_total", labels) == len(skipped)


def test_usage_beyond_the_estimate_overruns_by_that_much_then_everything_waits() -> None:
    cap = SpendCap({"day": 1.0}, clock=lambda: 0.0)
    assert cap.try_charge(0.6) and not cap.try_charge(0.6)  # in flight: 0.6 of 1.0 taken
    cap.settle(0.6, 1.5)  # the endpoint billed more than the estimate allowed
    assert cap.remaining()["day"] == pytest.approx(-0.5)
    assert not cap.try_charge(0.01)


def test_a_cap_without_a_price_is_a_configuration_error_naming_the_key() -> None:
    with OpenAIStub() as stub:
        with pytest.raises(JudgeConfigError) as err:
            _runner(stub, CollectorRegistry(), model="in-house-llm-7", usd_per_day=5.0)
        assert err.value.key == "judges.endpoints.default.usd_per_day"
        assert "price" in err.value.detail
        # The table's price for a listed model, or a configured one, makes the same cap valid.
        _runner(stub, CollectorRegistry(), model="gpt-4o-mini", usd_per_day=5.0).close()
        _runner(stub, CollectorRegistry(), model="in-house-llm-7", usd_per_day=5.0, price=PRICE).close()


def test_cost_row_results_round_trip() -> None:
    (record,) = _otel_records()
    result = Pipeline().evaluate(record, SourceRef(format=record.source_format))
    back = EvaluationResult.from_dict(orjson.loads(result.to_json()))
    assert back.record.cost == result.record.cost and back.record.model_usage == record.model_usage


def test_inference_log_rows_are_priced_by_the_model_the_response_names() -> None:
    response = {"model": "gpt-4o-mini", "choices": [{"message": {"role": "assistant", "content": "Yes."}}],
                "usage": {"prompt_tokens": 2000, "completion_tokens": 100, "total_tokens": 2100}}
    row = {"databricks_request_id": "r1", "status_code": 200, "served_entity_id": "bot-v3",
           "request": json.dumps({"messages": [{"role": "user", "content": "Refund?"}]}),
           "response": json.dumps(response)}
    record = normalise(json.dumps(row))
    assert record.model_usage == {"gpt-4o-mini": TokenUsage(2000, 100, 2100)}
    cost = trace_cost(record).cost
    expected = calc_price(Usage(input_tokens=2000, output_tokens=100), model_ref="gpt-4o-mini")
    assert cost.source == "priced" and cost.total == pytest.approx(float(expected.total_price))
    # No model in the body: the served entity names it (an endpoint name no price table knows).
    del response["model"]
    record = normalise(json.dumps({**row, "response": json.dumps(response)}))
    assert record.model_usage == {"bot-v3": TokenUsage(2000, 100, 2100)}
    assert trace_cost(record).cost.source == "unknown"
