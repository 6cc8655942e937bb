"""`tracejudge eval` as a user runs it: the installed console script on files and stdin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson

TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.cli"]


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
    src = write_lines(tmp_path / "in.jsonl", RECORD, "{not json", "", ["a", "list"], {**RECORD, "request_id": "r-2"})
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
    assert [(r["line"], r["reason"]) for r in rejected] == [(2, "invalid_json"), (4, "unknown_format")]
    assert rejected[0]["record"] == "{not json"
    stderr = proc.stderr.decode()
    assert f"{src}:2: rejected (invalid_json)" in stderr
    assert f"{src}:4: rejected" in stderr
    assert "records" in stderr and "rejected lines           2" in stderr
    assert "mean document_recall" in stderr


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
