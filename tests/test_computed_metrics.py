"""Computed metrics: definitions, empty cases, and user metric functions."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from tracejudge.metrics.computed import (
    ComputedMetrics,
    CustomMetric,
    CustomMetricConfig,
    MetricLoadError,
    MetricsConfig,
    document_recall,
    trajectory_metrics,
)
from tracejudge.schemas.record import Document, EvalRecord, TokenUsage, ToolCall


def calls(*names: str) -> list[ToolCall]:
    return [ToolCall(n, {"q": n}) for n in names]


def test_builtin_metrics_from_a_full_record():
    record = EvalRecord(
        latency_seconds=1.5, failed=False, tokens=TokenUsage(10, 4, 14),
        retrieved_context=[Document("a", "u1"), Document("b", "u2")],
        expected_retrieved_context=[Document(None, "u1"), Document(None, "u3")],
    )
    values, errors = ComputedMetrics().compute(record)
    assert errors == {}
    assert values["latency_seconds"] == 1.5
    assert values["failed"] == 0.0
    assert (values["input_tokens"], values["output_tokens"], values["total_tokens"]) == (10, 4, 14)
    assert values["retrieved_documents"] == 2
    assert values["document_recall"] == 0.5


def test_unknown_inputs_stay_unknown_and_reference_metrics_are_absent():
    values, _ = ComputedMetrics().compute(EvalRecord())
    assert values["latency_seconds"] is None and values["failed"] is None
    assert values["input_tokens"] is None and values["retrieved_documents"] is None
    assert "document_recall" not in values
    assert not any(k.startswith("trajectory_") for k in values)


def test_document_recall_cases():
    expected = [Document(None, "u1"), Document(None, "u2")]
    assert document_recall(EvalRecord(expected_retrieved_context=expected)) == 0.0  # nothing retrieved
    assert document_recall(EvalRecord(retrieved_context=[Document("x", "u2")],
                                      expected_retrieved_context=expected)) == 0.5
    # Expected chunks without URIs give nothing to recall: the metric is not computed, not 0 or 1.
    assert document_recall(EvalRecord(retrieved_context=[Document("x", "u2")],
                                      expected_retrieved_context=[Document("text only")])) is None


@pytest.mark.parametrize(
    ("predicted", "reference", "expected"),
    [
        # identical
        (calls("a", "b"), calls("a", "b"), dict(exact=1, in_order=1, any_order=1, precision=1, recall=1)),
        # extra call in between: in order, not exact
        (calls("a", "x", "b"), calls("a", "b"), dict(exact=0, in_order=1, any_order=1, precision=2 / 3,
                                                      recall=1)),
        # reversed order
        (calls("b", "a"), calls("a", "b"), dict(exact=0, in_order=0, any_order=1, precision=1, recall=1)),
        # a missing call
        (calls("a"), calls("a", "b"), dict(exact=0, in_order=0, any_order=0, precision=1, recall=0.5)),
        # a repeated call counts once against the reference (multiset matching)
        (calls("a", "a"), calls("a"), dict(exact=0, in_order=1, any_order=1, precision=0.5, recall=1)),
        # empty cases
        ([], [], dict(exact=1, in_order=1, any_order=1, precision=1, recall=1)),
        ([], calls("a"), dict(exact=0, in_order=0, any_order=0, precision=0, recall=0)),
        (calls("a"), [], dict(exact=0, in_order=1, any_order=1, precision=0, recall=1)),
    ],
)
def test_trajectory_metrics(predicted, reference, expected):
    got = trajectory_metrics(predicted, reference)
    for short, value in expected.items():
        key = {"exact": "exact_match", "in_order": "in_order_match", "any_order": "any_order_match"}.get(
            short, short)
        assert math.isclose(got[f"trajectory_{key}"], value), (short, got)


def test_tool_inputs_compare_as_values_not_as_text():
    assert trajectory_metrics([ToolCall("s", {"a": 1, "b": [1, 2]})],
                              [ToolCall("s", {"b": [1, 2], "a": 1})])["trajectory_exact_match"] == 1
    assert trajectory_metrics([ToolCall("s", {"a": 1})],
                              [ToolCall("s", {"a": 2})])["trajectory_exact_match"] == 0


def test_reference_from_record_wins_over_configured_default_and_single_tool_use():
    metrics = ComputedMetrics(single_tool="search", reference_trajectory=calls("search"))
    values, _ = metrics.compute(EvalRecord(trajectory=calls("search", "calc")))
    assert values["trajectory_recall"] == 1.0 and values["trajectory_precision"] == 0.5
    assert values["trajectory_single_tool_use"] == 1.0
    values, _ = metrics.compute(EvalRecord(trajectory=calls("search"), reference_trajectory=calls("calc")))
    assert values["trajectory_recall"] == 0.0
    values, _ = metrics.compute(EvalRecord(trajectory=calls("calc")))
    assert values["trajectory_single_tool_use"] == 0.0


@pytest.fixture
def user_metrics_module(tmp_path, monkeypatch):
    (tmp_path / "my_metrics.py").write_text(textwrap.dedent("""
        def response_words(record):
            return len((record.response or "").split())

        def lengths(record):
            return {"request_chars": len(record.request or ""), "response_chars": len(record.response or "")}

        def explodes(record):
            raise RuntimeError("boom on " + str(record.request_id))

        def not_a_number(record):
            return "seven"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_metrics"
    sys.modules.pop("my_metrics", None)


def test_custom_metrics_by_dotted_path(user_metrics_module):
    config = MetricsConfig(custom=[
        CustomMetricConfig(name="words", function=f"{user_metrics_module}:response_words"),
        CustomMetricConfig(name="len", function=f"{user_metrics_module}.lengths"),
        CustomMetricConfig(name="boom", function=f"{user_metrics_module}:explodes"),
        CustomMetricConfig(name="nan", function=f"{user_metrics_module}:not_a_number"),
    ])
    values, errors = ComputedMetrics.from_config(config).compute(
        EvalRecord(request_id="r7", request="hi there", response="one two three"))
    assert values["words"] == 3
    assert values["len.request_chars"] == 8 and values["len.response_chars"] == 13
    # A failing user function is that metric's error, never a crash, and the built-ins still come out.
    assert values["boom"] is None and errors["boom"] == "RuntimeError: boom on r7"
    assert values["nan"] is None and "expected a finite number" in errors["nan"]
    assert "latency_seconds" in values


def test_custom_metric_that_cannot_be_loaded_is_a_startup_error(user_metrics_module):
    with pytest.raises(MetricLoadError, match=r"metrics.custom\[x\].function: .* has no callable 'nope'"):
        CustomMetric.load(CustomMetricConfig(name="x", function=f"{user_metrics_module}:nope"))
    with pytest.raises(MetricLoadError, match="cannot import 'no_such_module_xyz'"):
        CustomMetric.load(CustomMetricConfig(name="x", function="no_such_module_xyz:f"))
    with pytest.raises(ValueError, match="already taken"):
        MetricsConfig(custom=[CustomMetricConfig(name="latency_seconds", function="m:f")])
