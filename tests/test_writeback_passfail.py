"""Pass/Fail in MLflow for every verdict that has one (issue 26): against a real `mlflow server`.

A verdict with a pass/fail decision (`passed` set), LLM or heuristic, is written as MLflow's own
judges write theirs: value "yes"/"no" (the UI shows Pass/Fail), the numbers in metadata (`score`,
`threshold`, as MLflow's deepeval/ragas/trulens scorers write them). A judge with no pass/fail keeps
its number. MLflow's own trace search by the value the UI shows (`feedback.groundedness = 'no'`) finds
exactly the failing traces. The verdicts come from the real heuristic groundedness judge on real
records, as result lines (`EvaluationResult.to_dict`); the traces reach the server over OTLP.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from support.kafka import unique
from support.mlflow_server import MlflowServer, send_otlp, shared_mlflow_server
from support.otel_producers import Producer, genai_trace

from tracejudge.consumer.sinks.base import SinkBatch, SinkRecord, WriteReport
from tracejudge.consumer.sinks.mlflow import MlflowSink, MlflowSinkSettings, feedback_key
from tracejudge.metrics.judges.config import JudgeSettings
from tracejudge.metrics.judges.heuristic import HeuristicGroundedness
from tracejudge.schemas.record import Document, EvalRecord
from tracejudge.schemas.result import Assessment, EvaluationResult, JudgeIdentity, SourceRef

RESULTS = "tracejudge-results"
QUESTION = "What is the capital of France?"
# The chunks genai_trace retrieves, and answers the heuristic scores 1.0, 0.5, 1/3 and 0 against them.
CONTEXT = [Document(content="Paris is the capital of France."),
           Document(content="Paris has 2.1M inhabitants.")]
ANSWERS = {
    "grounded": "Paris is the capital of France.",
    "half": "Paris is the capital of France. Its tallest tower is made of cheese.",
    "third": "Paris is the capital of France. Its tallest tower is made of cheese. Lyon hosts 40 embassies.",
    "none": "Berlin is the capital of Germany.",
}


@pytest.fixture(scope="session")
def mlflow_server() -> MlflowServer:
    return shared_mlflow_server()


@pytest.fixture(autouse=True)
def _no_mlflow_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def make_sink(url: str, registry: CollectorRegistry | None = None) -> MlflowSink:
    settings = MlflowSinkSettings.from_mapping({"tracking_uri": url}, env={})
    return MlflowSink(settings, registry if registry is not None else CollectorRegistry(), env={})


def write(url: str, lines: list[dict[str, Any]]) -> WriteReport:
    sink = make_sink(url)
    try:
        records = [SinkRecord(RESULTS, 0, i, None, r) for i, r in enumerate(lines)]
        return sink.write(SinkBatch(RESULTS, 0, records))
    finally:
        sink.close()


def traces(server: MlflowServer, experiment: str, answers: dict[str, str]) -> dict[str, str]:
    """One OTLP trace per answer on the server: answer name -> 32-hex trace id."""
    producer = Producer("geo-agent")
    recorded = {name: genai_trace(producer.tracer, QUESTION, text) for name, text in answers.items()}
    send_otlp(server.url, experiment, producer.finished())
    return {name: rec.trace_id for name, rec in recorded.items()}


def result_line(trace_id: str, assessments: list[Assessment], response: str = "") -> dict[str, Any]:
    """The result line `tracejudge run` publishes for an OTLP record with these verdicts."""
    record = EvalRecord(trace_id=trace_id, source_format="otlp_proto", request=QUESTION, response=response,
                        retrieved_context=CONTEXT)
    source = SourceRef("otlp_proto", topic="otlp_spans", partition=0, offset=7)
    return EvaluationResult(record, source, assessments=assessments).to_dict()


def groundedness_lines(ids: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The real heuristic judge (threshold 0.5) on each answer: 1.0, 0.5 pass; 1/3, 0 fail."""
    judge = HeuristicGroundedness(settings=JudgeSettings(threshold=0.5))
    out = {}
    for name, trace_id in ids.items():
        record = EvalRecord(trace_id=trace_id, source_format="otlp_proto", request=QUESTION,
                            response=ANSWERS[name], retrieved_context=CONTEXT)
        out[name] = result_line(trace_id, [judge.judge_now(record)], ANSWERS[name])
    return out


def ours(server: MlflowServer, trace_id: str, name: str) -> list[dict[str, Any]]:
    return [a for a in server.assessments(f"tr-{trace_id}")
            if a["assessment_name"] == name and "tracejudge.key" in (a.get("metadata") or {})]


def found(server: MlflowServer, experiment: str, filter_string: str) -> set[str]:
    """The trace ids MLflow's own trace search returns (the search the UI's filter box runs)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=server.url)
    hits = client.search_traces(locations=[experiment], filter_string=filter_string, include_spans=False)
    return {t.info.trace_id for t in hits}


def test_heuristic_verdicts_are_pass_fail_and_mlflow_search_finds_the_failures(mlflow_server: MlflowServer
                                                                                ) -> None:
    experiment = mlflow_server.create_experiment(unique("passfail"))
    ids = traces(mlflow_server, experiment, ANSWERS)
    lines = groundedness_lines(ids)
    assert [lines[n]["assessments"][0]["passed"] for n in ANSWERS] == [True, True, False, False]

    assert write(mlflow_server.url, list(lines.values())).written == 4

    shown = {}
    for name, trace_id in ids.items():
        (fb,) = ours(mlflow_server, trace_id, "groundedness")
        shown[name] = fb["feedback"]
        meta = fb["metadata"]
        assert fb["source"] == {"source_type": "CODE", "source_id": "tracejudge.heuristic"}
        # The number is kept, in metadata: MLflow's scorers' `score`, and the existing keys.
        score = lines[name]["assessments"][0]["score"]
        assert meta["score"] == meta["tracejudge.score"] == str(score if score % 1 else int(score)), name
        assert meta["tracejudge.passed"] == ("true" if name in ("grounded", "half") else "false")
        assert "tracejudge.value" not in meta  # the heuristic's value is its score: not repeated
        assert meta["threshold"] == "0.5"  # the threshold the real judge applied (Assessment.threshold)
    # A passing 0.5 and a failing 0.33 no longer look alike.
    assert shown == {"grounded": {"value": "yes"}, "half": {"value": "yes"},
                     "third": {"value": "no"}, "none": {"value": "no"}}
    assert ours(mlflow_server, ids["third"], "groundedness")[0]["metadata"]["score"] == "0.3333333333333333"

    # MLflow's own search, by the value its UI shows: exactly the failing traces, then the passing ones.
    assert found(mlflow_server, experiment, "feedback.groundedness = 'no'") == \
        {f"tr-{ids['third']}", f"tr-{ids['none']}"}
    assert found(mlflow_server, experiment, "feedback.groundedness = 'yes'") == \
        {f"tr-{ids['grounded']}", f"tr-{ids['half']}"}


def test_numeric_judges_keep_numbers_scaled_and_labelled_verdicts_say_pass_fail(mlflow_server: MlflowServer
                                                                                ) -> None:
    experiment = mlflow_server.create_experiment(unique("passfail-kinds"))
    (trace_id,) = traces(mlflow_server, experiment, {"one": ANSWERS["grounded"]}).values()
    plugin = JudgeIdentity(None, None, "0123456789ab")
    llm = JudgeIdentity("openai", "gpt-4.1-mini", "ba9876543210")
    verdicts = [
        # A numeric-only custom judge (no threshold, no pass/fail): its number, as it was.
        Assessment("answer_length_ratio", value=3.5, source="plugin", judge=plugin, rationale="3.5x"),
        # A custom judge on a 1-5 scale that passes at 3: Pass, its 4 and its [0, 1] score in metadata.
        Assessment("tone", value=4, score=0.75, passed=True, source="llm:gpt-4.1-mini", judge=llm,
                   rationale="Polite."),
        # A categorical verdict keeps its label, as MLflow's own judge of that name writes it.
        Assessment("user_frustration", value="unresolved", score=0.0, passed=False, source="heuristic",
                   judge=plugin, rationale="still frustrated"),
        # An LLM yes/no judge: as before.
        Assessment("relevance_to_query", value="no", score=0.0, passed=False, source="llm:gpt-4.1-mini",
                   judge=llm, rationale="About Rome."),
    ]
    line = result_line(trace_id, verdicts)
    # A result that states the threshold its verdict applied gets it in metadata, as MLflow's scorers.
    line["assessments"][1]["threshold"] = 0.5
    assert write(mlflow_server.url, [line]).written == 4

    by_name = {a["assessment_name"]: a for a in mlflow_server.assessments(f"tr-{trace_id}")}
    ratio = by_name["answer_length_ratio"]
    assert ratio["feedback"] == {"value": 3.5}
    assert not {"score", "threshold", "tracejudge.value"} & set(ratio["metadata"])
    tone = by_name["tone"]
    assert tone["feedback"] == {"value": "yes"}
    assert {k: tone["metadata"][k] for k in ("score", "threshold", "tracejudge.value", "tracejudge.passed")} \
        == {"score": "0.75", "threshold": "0.5", "tracejudge.value": "4", "tracejudge.passed": "true"}
    assert by_name["user_frustration"]["feedback"] == {"value": "unresolved"}
    assert by_name["user_frustration"]["metadata"]["tracejudge.passed"] == "false"
    relevance = by_name["relevance_to_query"]
    assert relevance["feedback"] == {"value": "no"} and relevance["metadata"]["score"] == "0"
    assert found(mlflow_server, experiment, "feedback.answer_length_ratio > 3") == {f"tr-{trace_id}"}
    assert found(mlflow_server, experiment, "feedback.tone = 'yes'") == {f"tr-{trace_id}"}


def test_redelivery_and_feedback_written_in_the_old_numeric_form_are_not_duplicated(
        mlflow_server: MlflowServer) -> None:
    experiment = mlflow_server.create_experiment(unique("passfail-again"))
    ids = traces(mlflow_server, experiment, {"half": ANSWERS["half"], "third": ANSWERS["third"]})
    lines = groundedness_lines(ids)
    # An older sink wrote the failing verdict with its number as the value, under the same key.
    old = lines["third"]["assessments"][0]
    key = feedback_key(f"tr-{ids['third']}", "groundedness", old["judge"]["version"])
    mlflow_server.log_assessment(f"tr-{ids['third']}", {
        "assessment_name": "groundedness",
        "source": {"source_type": "CODE", "source_id": "tracejudge.heuristic"},
        "feedback": {"value": old["value"]}, "rationale": old["rationale"],
        "metadata": {"tracejudge.score": str(old["score"]), "tracejudge.passed": "false",
                     "tracejudge.key": key}})

    first = write(mlflow_server.url, [lines["half"], lines["third"]])
    assert (first.written, first.already_written) == (1, 1)  # the old-form verdict is the same verdict
    again = write(mlflow_server.url, [lines["half"], lines["third"], lines["half"]])
    assert (again.written, again.already_written) == (0, 3)
    counts = {name: Counter(str(a["feedback"].get("value")) for a in ours(mlflow_server, tid, "groundedness"))
              for name, tid in ids.items()}
    # One feedback per trace; the old one is left as it was written (its key says it is this verdict).
    assert counts == {"half": {"yes": 1}, "third": {"0.3333333333333333": 1}}
