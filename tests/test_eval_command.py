"""`tracejudge eval` as a user runs it: the installed console script on files and stdin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import orjson

TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]


def run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*TRACEJUDGE, *args], input=stdin, capture_output=True, timeout=120, check=False)


def write_lines(path: Path, *lines: object) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


RECORD = {
    "request_id": "r-1",
    "request": {"messages": [{"role": "user", "content": "What is the refund window?"}]},
    "response": "30 days.",
    "retrieved_context": [{"content": "Refunds within 30 days.", "doc_uri": "kb://refunds"}],
    "expected_retrieved_context": [{"content": "Refunds within 30 days.", "doc_uri": "kb://refunds"},
                                   {"content": "Ask support.", "doc_uri": "kb://support"}],
}


def test_results_line_per_record_rejects_with_line_numbers(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", RECORD, "{not json", "", ["a", "list"],
                      {**RECORD, "request_id": "r-2"})
    out, rejects = tmp_path / "out.jsonl", tmp_path / "rejects.jsonl"
    proc = run("eval", str(src), "--output", str(out), "--rejects", str(rejects))
    assert proc.returncode == 0, proc.stderr.decode()
    results = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["request_id"] for r in results] == ["r-1", "r-2"]
    first = results[0]
    assert first["request"] == "What is the refund window?"
    assert first["metrics"]["document_recall"] == 0.5
    assert first["metrics"]["retrieved_documents"] == 1
    assert first["assessments"] == []
    assert first["source"] == {"format": "agent_eval", "file": str(src), "line": 1, "topic": None,
                               "partition": None, "offset": None}
    rejected = [orjson.loads(line) for line in rejects.read_bytes().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejected] == [(2, "invalid_json"), (4, "invalid_record")]
    assert rejected[0]["record"] == "{not json"
    stderr = proc.stderr.decode()
    assert f"{src}:2: rejected (invalid_json)" in stderr
    assert f"{src}:4: rejected" in stderr
    assert re.search(r"rejected lines +2\n", stderr)
    assert "mean document_recall" in stderr


SERVING_ROW = {"databricks_request_id": "d-1", "status_code": 200, "execution_duration_ms": 12,
               "served_entity_id": "billing-bot",
               "request": json.dumps({"messages": [{"role": "user", "content": "Refund window?"}]}),
               "response": json.dumps({"choices": [{"message": {"role": "assistant",
                                                                 "content": "30 days."}}]})}


def test_records_without_a_request_or_with_a_broken_json_body_are_rejected_naming_the_field(tmp_path):
    truncated = SERVING_ROW["request"][:-9]
    src = write_lines(tmp_path / "in.jsonl",
                      {"request_id": "no-request", "response": "30 days."},       # neither request nor trace
                      {**SERVING_ROW, "request": truncated},                      # request body cut short
                      {**SERVING_ROW, "response": SERVING_ROW["response"][:-2]},  # response body cut short
                      # Valid but odd, kept: bodies that are plain text, and a record with no response.
                      {**SERVING_ROW, "databricks_request_id": "text", "request": "Refund window? {plain}",
                       "response": "30 days [policy]"},
                      {"request_id": "no-response", "request": "Refund window?"})
    rejects = tmp_path / "rejects.jsonl"
    proc = run("eval", str(src), "--rejects", str(rejects))
    assert proc.returncode == 0, proc.stderr.decode()
    results = {r["request_id"]: r for r in map(orjson.loads, proc.stdout.splitlines())}
    assert set(results) == {"text", "no-response"}
    assert results["text"]["request"] == "Refund window? {plain}"
    assert results["text"]["response"] == "30 days [policy]"
    rejected = [orjson.loads(line) for line in rejects.read_bytes().splitlines()]
    assert [(r["line"], r["reason"], r["error"].split(":")[0]) for r in rejected] == [
        (1, "invalid_record", "request"), (2, "invalid_json", "request"), (3, "invalid_json", "response")]
    assert rejected[1]["record"] == json.dumps({**SERVING_ROW, "request": truncated})
    stderr = proc.stderr.decode()
    assert f"{src}:1: rejected (invalid_record): request: required field is missing" in stderr
    assert f"{src}:2: rejected (invalid_json): request: looks like JSON but does not parse" in stderr
    assert f"{src}:3: rejected (invalid_json): response: looks like JSON but does not parse" in stderr
    assert re.search(r"rejected lines +3\n", stderr)


def test_stdin_and_several_inputs(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", {**RECORD, "request_id": "a"})
    proc = run("eval", str(a), "-", "--quiet", stdin=json.dumps({**RECORD, "request_id": "b"}).encode())
    assert proc.returncode == 0, proc.stderr.decode()
    ids = [orjson.loads(line)["request_id"] for line in proc.stdout.splitlines()]
    assert ids == ["a", "b"]
    assert proc.stderr == b""


def test_unreadable_input_or_bad_option_exits_2_before_writing(tmp_path):
    good = write_lines(tmp_path / "a.jsonl", RECORD)
    out = tmp_path / "out.jsonl"
    proc = run("eval", str(good), str(tmp_path / "missing.jsonl"), "--output", str(out))
    assert proc.returncode == 2
    assert b"cannot read" in proc.stderr and b"missing.jsonl" in proc.stderr
    assert not out.exists()
    assert run("eval", str(good), "--format", "nope").returncode == 2


def test_otlp_json_lines_are_assembled_across_lines_and_interleaved_with_other_formats(tmp_path):
    from support.mlflow_apps import run as run_app
    from support.otel_producers import Producer, genai_trace, interleave, kafka_messages

    producer = Producer("geo-agent")
    a = genai_trace(producer.tracer, "What is the capital of France?", "Paris.")
    spans_a = producer.finished()
    b = genai_trace(producer.tracer, "How many people live in Paris?", "About 2.1 million.")
    spans_b = producer.finished()
    # Two spans per line, the two traces interleaved: no line holds a whole trace.
    otlp_lines = [value.decode() for _, value in
                  kafka_messages(interleave(spans_a, spans_b), per_message=2, fmt="otlp_json")]
    mlflow_line = run_app("rag")
    src = write_lines(tmp_path / "mixed.jsonl", otlp_lines[0], mlflow_line, *otlp_lines[1:])
    proc = run("eval", str(src), "--quiet")
    assert proc.returncode == 0, proc.stderr.decode()
    lines = [orjson.loads(line) for line in proc.stdout.splitlines()]
    results = {r["trace_id"]: r for r in lines if r.get("kind") != "session"}
    assert len(results) == 3
    # Both OTLP traces carry `session.id` "sess-1": one session, its line after the trace results.
    assert [(r.get("kind"), r.get("session_id")) for r in lines[3:]] == [("session", "sess-1")]
    assert len(lines[3]["turns"]) == 2
    for rec in (a, b):
        got = results[rec.trace_id]
        assert got["source_format"] == "otlp_json" and got["app"] == "geo-agent"
        assert got["request"] == rec.question and got["response"] == rec.answer
        assert got["complete"] is True
        assert got["tokens"] == {"input": rec.input_tokens, "output": rec.output_tokens,
                                 "total": rec.input_tokens + rec.output_tokens, "cached_input": None}
        assert [d["doc_uri"] for d in got["retrieved_context"]] == [uri for _, uri in rec.documents]
        assert got["source"]["line"] == 1  # the first line holding one of its spans
    [mlflow_result] = [r for r in results.values() if r["source_format"] == "mlflow_v3"]
    assert mlflow_result["source"]["line"] == 2 and mlflow_result["response"]


GROUNDED = {"request": "What is the refund window?", "response": "Refunds are accepted within 30 days.",
            "retrieved_context": [{"content": "Refunds are accepted within 30 days of purchase.",
                                   "doc_uri": "kb://refunds"}]}
MADE_UP = {"request": "What is the refund window?", "response": "Refunds take 90 days and cost 15 euros.",
           "retrieved_context": [{"content": "Refunds are accepted within 30 days of purchase.",
                                  "doc_uri": "kb://refunds"}]}


def test_config_file_custom_metrics_judges_and_fail_under(tmp_path):
    (tmp_path / "eval_metrics.py").write_text("def words(record):\n    return len(record.response.split())\n")
    config = tmp_path / "tracejudge.yaml"
    config.write_text(
        "metrics:\n  custom:\n    - {name: words, function: 'eval_metrics:words'}\n"
        "judges: {}\n"  # no endpoint: the model-free heuristic judges
    )
    src = write_lines(tmp_path / "in.jsonl", *[{**GROUNDED, "request_id": f"g{i}"} for i in range(3)],
                      {**MADE_UP, "request_id": "m0"})
    env_path = f"{tmp_path}"
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config), "--fail-under",
                           "groundedness=0.5"], capture_output=True, timeout=120, check=False,
                          env={**_env(), "PYTHONPATH": env_path})
    assert proc.returncode == 0, proc.stderr.decode()
    results = {r["request_id"]: r for r in map(orjson.loads, proc.stdout.splitlines())}
    assert results["g0"]["metrics"]["words"] == 6
    verdicts = {rid: {a["name"]: a for a in r["assessments"]} for rid, r in results.items()}
    assert verdicts["g0"]["groundedness"]["passed"] is True
    assert verdicts["g0"]["groundedness"]["source"] == "heuristic"
    assert verdicts["m0"]["groundedness"]["passed"] is False
    assert "judge groundedness" in proc.stderr.decode()

    # Only the made-up answer: the mean groundedness falls under the gate -> exit 1, naming the judge.
    bad = write_lines(tmp_path / "bad.jsonl", MADE_UP)
    proc = subprocess.run([*TRACEJUDGE, "eval", str(bad), "--config", str(config), "--quiet",
                           "--fail-under", "groundedness=0.5"], capture_output=True, timeout=120,
                          check=False, env={**_env(), "PYTHONPATH": env_path})
    assert proc.returncode == 1
    assert b"groundedness: mean score" in proc.stderr and b"below --fail-under 0.5" in proc.stderr


def test_fail_under_names_an_unknown_judge_and_a_bad_config_key(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", GROUNDED)
    proc = run("eval", str(src), "--fail-under", "groundedness=0.5")
    assert proc.returncode == 2 and b"'groundedness' is not a configured judge" in proc.stderr
    config = tmp_path / "bad.yaml"
    config.write_text("metrics:\n  custom:\n    - {name: x, function: 'no_such_mod_abc:f'}\n")
    proc = run("eval", str(src), "--config", str(config))
    assert proc.returncode == 2
    assert b"metrics.custom[x].function" in proc.stderr and b"no_such_mod_abc" in proc.stderr
    assert proc.stdout == b""


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}


def test_judge_calls_log_no_http_request_line_unless_debug(tmp_path, stub):
    """httpx logs "HTTP Request: POST … 200 OK" at INFO for every judge call: only with --log-level DEBUG."""
    src = write_lines(tmp_path / "in.jsonl", GROUNDED)
    config = tmp_path / "judges.yaml"
    config.write_text(json.dumps({"judges": {"endpoints": {"default": {"base_url": stub.base_url,
                                                                       "model": "judge-model"}},
                                             "sample_rate": 1.0, "builtin": {"relevance_to_query": {}}}}))
    quiet = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config)], capture_output=True,
                           timeout=120, check=False, env=_env())
    assert quiet.returncode == 0, quiet.stderr.decode()
    assert stub.count("/chat/completions") == 1
    assert b"HTTP Request" not in quiet.stderr and b"httpx" not in quiet.stderr
    assert b"judge relevance_to_query" in quiet.stderr  # the summary is still there
    debug = subprocess.run([*TRACEJUDGE, "--log-level", "DEBUG", "eval", str(src), "--config", str(config)],
                           capture_output=True, timeout=120, check=False, env=_env())
    assert debug.returncode == 0 and stub.count("/chat/completions") == 2
    assert b"INFO httpx: HTTP Request: POST " + stub.base_url.encode() in debug.stderr
