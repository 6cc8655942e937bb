"""`tracejudge dataset merge-labels`: people's labels become a collection's expectations; conflicts are
reported, never overwritten; the merged file is a regression set `tracejudge eval` reads as it stands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
from support.kafka import produce, unique
from support.mlflow_server import send_otlp, shared_mlflow_server
from support.otel_producers import Producer, genai_trace

TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("TRACEJUDGE_", "MLFLOW_"))}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TRACEJUDGE, *args], capture_output=True, text=True, timeout=300, check=False,
                          env=_env())


def _row(trace_id: str, **extra: Any) -> dict[str, Any]:
    row = {"trace_id": trace_id, "request_id": None, "request": f"question {trace_id}",
           "response": f"answer {trace_id}", "retrieved_context": None, "trajectory": None,
           "expected_response": None, "expected_facts": None, "expected_retrieved_context": None,
           "assessments": [], "collection": "failing", "app": None, "version": None}
    row.update(extra)
    return row


def _write(path: Path, items: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(i) + b"\n" for i in items))
    return path


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def test_labels_fill_expectations_and_conflicts_are_reported_not_overwritten(tmp_path):
    ids = [f"{i:032x}" for i in range(5)]
    collection = _write(tmp_path / "collected.jsonl", [
        _row(ids[0]), _row(ids[1]), _row(ids[2]), _row(ids[0]),  # trace 0 twice (a topic read twice)
        _row(ids[3], expected_response="already known"), _row(ids[4])])
    before = collection.read_bytes()
    labels = _write(tmp_path / "labels.jsonl", [
        {"trace_id": ids[0], "expected_response": "Paris.", "expected_facts": ["capital of France"]},
        {"trace_id": f"tr-{ids[1]}", "expectations": {"expected_retrieved_context": [{"doc_uri": "doc://7"}]}},
        {"trace_id": ids[2], "name": "expected_response", "value": "Berlin."},
        {"trace_id": ids[2], "name": "expected_response", "value": "Bonn."},         # conflicts
        {"trace_id": ids[3], "expected_response": "something else"},                 # conflicts with the row
        {"trace_id": ids[0], "expected_response": "Paris."},                          # agrees
        {"trace_id": ids[4], "judge": "correctness", "label": "pass"},               # a verdict only
        {"trace_id": "f" * 32, "expected_response": "no such row"},
        {"expected_response": "whose?"},
    ])
    out, conflicts = tmp_path / "merged.jsonl", tmp_path / "conflicts.jsonl"
    proc = _run("dataset", "merge-labels", str(collection), str(labels), "--out", str(out),
                "--conflicts", str(conflicts))
    assert proc.returncode == 1, proc.stderr  # conflicts fail the merge's check; the output is written
    assert collection.read_bytes() == before

    rows = {r["trace_id"]: r for r in _lines(out)}
    assert len(_lines(out)) == 5
    assert rows[ids[0]]["expected_response"] == "Paris."
    assert rows[ids[0]]["expected_facts"] == ["capital of France"]
    assert rows[ids[1]]["expected_retrieved_context"] == [{"content": None, "doc_uri": "doc://7"}]
    assert rows[ids[2]]["expected_response"] is None        # Berlin or Bonn: a person decides
    assert rows[ids[3]]["expected_response"] == "already known"
    assert rows[ids[4]]["expected_response"] is None
    assert rows[ids[0]]["request"] == f"question {ids[0]}"  # the rest of the row as collected

    found = {(c["trace_id"], c["field"]): [v["value"] for v in c["values"]] for c in _lines(conflicts)}
    assert found == {(ids[2], "expected_response"): ["Berlin.", "Bonn."],
                     (ids[3], "expected_response"): ["already known", "something else"]}
    err = proc.stderr
    assert f"conflict: {ids[2]} expected_response" in err
    assert "1 duplicate rows dropped" in err and "agreeing labels      1" in err
    assert "labels for no row    1" in err and "1 malformed, 1 verdict_label" in err
    assert "labels.jsonl:9" in err  # the malformed line, by its place

    # The merged collection is an evaluation input as it stands; the expectations are read from it.
    again = _run("eval", str(out), "-q")
    assert again.returncode == 0, again.stderr
    results = {r["trace_id"]: r for r in map(orjson.loads, again.stdout.splitlines())}
    assert results[ids[0]]["expected_response"] == "Paris."
    assert results[ids[0]]["expected_facts"] == ["capital of France"]
    assert results[ids[1]]["expected_retrieved_context"] == [{"content": None, "doc_uri": "doc://7"}]


def test_a_merge_without_conflicts_exits_0(tmp_path):
    collection = _write(tmp_path / "c.jsonl", [_row("a1"), _row("b2")])
    labels = _write(tmp_path / "l.jsonl", [{"trace_id": "a1", "expected_response": "yes"}])
    proc = _run("dataset", "merge-labels", str(collection), str(labels), "--out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert [r["expected_response"] for r in _lines(tmp_path / "m.jsonl")] == ["yes", None]


def test_bad_inputs_exit_2_and_write_nothing(tmp_path):
    collection = _write(tmp_path / "c.jsonl", [_row("a1")])
    before = collection.read_bytes()
    labels = _write(tmp_path / "l.jsonl", [{"trace_id": "a1", "expected_response": "yes"}])
    # The output is the collection: refused before anything is opened.
    proc = _run("dataset", "merge-labels", str(collection), str(labels), "--out", str(collection))
    assert proc.returncode == 2 and "would destroy it" in proc.stderr
    assert collection.read_bytes() == before
    # A labels file none of whose lines is a label.
    csv = tmp_path / "labels.csv"
    csv.write_text("trace_id,expected\na1,yes\n")
    proc = _run("dataset", "merge-labels", str(collection), str(csv), "--out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 2 and "no line is a label" in proc.stderr
    assert not (tmp_path / "m.jsonl").exists()
    # A collection line that is not a row.
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(orjson.dumps(_row("a1")) + b"\n[1, 2]\n")
    proc = _run("dataset", "merge-labels", str(broken), str(labels), "--out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 2 and "broken.jsonl:2: not a collected row" in proc.stderr
    # No labels at all.
    proc = _run("dataset", "merge-labels", str(collection), "--out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 2 and "no labels" in proc.stderr


def test_labels_from_the_labels_topic(broker, tmp_path):
    bs = broker.bootstrap_servers
    topic = unique("labels")
    produce(bs, topic, [orjson.dumps({"trace_id": "a1", "expected_facts": ["one", "two"]}),
                        b"not json",
                        orjson.dumps({"trace_id": "b2", "expected_response": "from the topic"})])
    collection = _write(tmp_path / "c.jsonl", [_row("a1"), _row("b2")])
    proc = _run("dataset", "merge-labels", str(collection), "--labels-topic", topic,
                "--bootstrap-servers", bs, "--out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    rows = {r["trace_id"]: r for r in _lines(tmp_path / "m.jsonl")}
    assert rows["a1"]["expected_facts"] == ["one", "two"]
    assert rows["b2"]["expected_response"] == "from the topic"
    assert "1 malformed" in proc.stderr and f"{topic}[" in proc.stderr


def test_human_expectations_on_an_mlflow_trace_become_the_rows_expected_response(tmp_path):
    server = shared_mlflow_server()
    experiment = server.create_experiment(f"merge-labels-{tmp_path.name}")
    producer = Producer("labelled-agent")
    recorded = [genai_trace(producer.tracer, f"What is the capital of France? ({i})", "Paris.")
                for i in range(3)]
    send_otlp(server.url, experiment, producer.finished())
    first, second, unlabelled = (r.trace_id for r in recorded)
    server.log_assessment(f"tr-{first}", {
        "assessment_name": "expected_response", "source": {"source_type": "HUMAN", "source_id": "ann"},
        "expectation": {"value": "Paris is the capital of France."}})
    # A person's correction logged as HUMAN feedback named like the field counts too; a judge's does not.
    server.log_assessment(f"tr-{second}", {
        "assessment_name": "expected_facts", "source": {"source_type": "HUMAN", "source_id": "bob"},
        "feedback": {"value": ["Paris is the capital"]}})
    server.log_assessment(f"tr-{unlabelled}", {
        "assessment_name": "expected_response", "source": {"source_type": "LLM_JUDGE", "source_id": "judge"},
        "feedback": {"value": "a model's guess"}})
    # Collected rows carry the hex trace id the derivation gives (MLflow stores "tr-<hex>").
    collection = _write(tmp_path / "c.jsonl", [_row(first), _row(second), _row(unlabelled), _row("9" * 32)])
    proc = _run("dataset", "merge-labels", str(collection), "--labels-from-mlflow", server.url,
                "--out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    rows = {r["trace_id"]: r for r in _lines(tmp_path / "m.jsonl")}
    assert rows[first]["expected_response"] == "Paris is the capital of France."
    assert rows[second]["expected_facts"] == ["Paris is the capital"]
    assert rows[unlabelled]["expected_response"] is None
    assert "1 not_in_mlflow" in proc.stderr
