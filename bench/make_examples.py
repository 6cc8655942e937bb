"""Write consumer/examples/traces.jsonl: the bundled example file for `tracejudge eval`, the README's tour
and the docs' examples.

A dozen lines mixing every single-record format, each made by its real producer where there is one:

* agent-evaluation records with expected_* fields and a reference trajectory (one carries its trace);
* MLflow 3 traces made by the real `mlflow` package (tests/support/mlflow_apps.py), one with
  expectation assessments attached as MLflow serialises them;
* an MLflow 2.22 trace (tests/fixtures/mlflow2/traces.jsonl, made by mlflow 2.22.5);
* model-serving inference-log rows, one with the agent's trace in `databricks_output.trace` and one
  rejected by the rate limiter.

    python bench/make_examples.py            # rewrites consumer/examples/traces.jsonl

Ids are seeded, so re-running changes only the timestamps.
"""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support import mlflow_apps  # noqa: E402

OUT = ROOT / "consumer" / "examples" / "traces.jsonl"


def _v2_trace(app: str) -> dict:
    for line in (ROOT / "tests" / "fixtures" / "mlflow2" / "traces.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["app"] == app:
            return json.loads(row["trace"])
    raise KeyError(app)


def main() -> None:
    traces = mlflow_apps.run_all(["rag", "tools", "failing", "multi_retriever", "chat_completion"], seed=11)
    rag_with_expectations = json.loads(mlflow_apps.with_expectations(
        traces["rag"], expected_response="MLflow is an open source platform for managing the ML lifecycle.",
        expected_facts=["MLflow is open source", "MLflow manages the ML lifecycle"]))
    chat_request = {"messages": [{"role": "system", "content": "You answer questions about Kafka."},
                                 {"role": "user", "content": "What does a consumer group do?"}]}
    chat_response = {"id": "chatcmpl-41", "object": "chat.completion", "model": "gpt-4o-mini",
                     "choices": [{"index": 0, "finish_reason": "stop", "message": {
                         "role": "assistant",
                         "content": "It shares the partitions of a topic among consumers."}}],
                     "usage": {"prompt_tokens": 28, "completion_tokens": 11, "total_tokens": 39}}
    lines = [
        {"request_id": "eval-001", "request": "What is MLflow?",
         "response": "MLflow is an open source platform for the machine learning lifecycle.",
         "retrieved_context": [{"content": "MLflow is an open source platform for the machine learning "
                                           "lifecycle.", "doc_uri": "https://mlflow.org/docs/index.html"}],
         "expected_response": "MLflow is an open source platform for managing the ML lifecycle.",
         "expected_retrieved_context": [{"doc_uri": "https://mlflow.org/docs/index.html"}],
         "expected_facts": ["MLflow is open source"], "guidelines": ["Answer in one sentence."]},
        {"request_id": "eval-002",
         "request": {"messages": [{"role": "user",
                                   "content": "Is order A-17 shipped, and the weather in Paris?"}]},
         "response": "Order A-17 has shipped; it is sunny in Paris.",
         "reference_trajectory": [{"tool_name": "get_weather", "tool_input": {"city": "Paris"}},
                                  {"tool_name": "lookup_order",
                                   "tool_input": {"order_id": "A-17", "include_items": True}}],
         "trace": traces["tools"]},
        {"request_id": "eval-003", "request": {"query": "How are offsets committed?",
                                               "history": [{"role": "user", "content": "What is Kafka?"},
                                                           {"role": "assistant", "content": "A log."}]},
         "response": "Offsets are committed per partition.",
         "retrieved_context": [{"content": "Offsets are committed per partition.",
                                "doc_uri": "https://kafka.apache.org/offsets"}],
         "expected_facts": ["offsets are per partition"]},
        rag_with_expectations,
        json.loads(traces["multi_retriever"]),
        json.loads(traces["failing"]),
        json.loads(traces["chat_completion"]),
        _v2_trace("rag"),
        {"databricks_request_id": "4f6c1d2e-0001", "client_request_id": None, "request_date": "2026-11-22",
         "request_time": "2026-11-22T10:15:30.250Z", "status_code": 200, "sampling_fraction": 1.0,
         "execution_duration_ms": 840, "request": json.dumps(chat_request),
         "response": json.dumps(chat_response),
         "logging_error_codes": [], "served_entity_id": "kafka-helper", "requester": "svc-frontend"},
        {"databricks_request_id": "4f6c1d2e-0002", "request_time": "2026-11-22T10:15:31.003Z",
         "status_code": 200, "execution_duration_ms": 1320, "served_entity_id": "docs-agent",
         "request": json.dumps({"messages": [{"role": "user", "content": "What is MLflow?"}],
                                "databricks_options": {"return_trace": True}}),
         "response": json.dumps({"choices": [{"index": 0, "message": {
             "role": "assistant", "content": "MLflow is an open source platform for the ML lifecycle."}}],
             "databricks_output": {"databricks_request_id": "4f6c1d2e-0002",
                                   "trace": json.loads(traces["rag"])}})},
        {"databricks_request_id": "4f6c1d2e-0003", "request_time": "2026-11-22T10:15:32.410Z",
         "status_code": 429, "execution_duration_ms": 3, "served_entity_id": "kafka-helper",
         "request": json.dumps(chat_request),
         "response": json.dumps({"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "Exceeded rate limit"})},
        {"databricks_request_id": "9a1", "date": "2026-11-22", "timestamp_ms": 1795342533000,
         "status_code": 200,
         "execution_time_ms": 95, "request_metadata": {"endpoint_name": "legacy-qa", "model_name": "qa",
                                                        "model_version": "4"},
         "request": json.dumps({"dataframe_records": [{"query": "What is a topic?"}]}),
         "response": json.dumps({"predictions": ["A topic is a named, partitioned log."]})},
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines))
    print(f"wrote {len(lines)} records to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
