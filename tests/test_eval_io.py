"""The files of `tracejudge eval` and `tracejudge calibrate` as users have them, through the installed
console script: compressed and odd encodings, inputs never destroyed, outputs replaced only by a
successful run, and exit statuses that mean one thing each (`consumer/runtime/exit_status.py`)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.support.kafka import wait_until

TRACEJUDGE = str(Path(sys.executable).parent / "tracejudge")
TRUST = Path(__file__).resolve().parents[1] / "metrics" / "judges" / "trust"
KIT = TRUST / "calibration_kit" / "groundedness.jsonl"
OK, GATE, USAGE, OUTPUT, INTERRUPTED = 0, 1, 2, 3, 130


def run(*args: str, stdin: bytes | None = None, **kw: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([TRACEJUDGE, *args], input=stdin, capture_output=True, timeout=180, check=False,
                          **kw)  # type: ignore[call-overload]


def record(i: int) -> dict[str, object]:
    return {"request_id": f"r-{i}", "request": "What is the refund window?", "response": "30 days.",
            "retrieved_context": [{"content": "Refunds within 30 days.", "doc_uri": "kb://refunds"}]}


def jsonl(n: int) -> bytes:
    return b"".join(orjson.dumps(record(i)) + b"\n" for i in range(n))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ids(stdout: bytes) -> list[str]:
    return [orjson.loads(line)["request_id"] for line in stdout.splitlines()]


def no_traceback(stderr: bytes) -> None:
    assert b"Traceback" not in stderr and b"Exception ignored" not in stderr, stderr.decode()


# ------------------------------------------------------------------------------------- reading inputs


def test_gzip_input_named_gz_is_read(tmp_path):
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(gzip.compress(jsonl(3)))
    proc = run("eval", str(src), "-q")
    assert proc.returncode == OK, proc.stderr.decode()
    assert ids(proc.stdout) == ["r-0", "r-1", "r-2"]


@pytest.mark.parametrize("name", ["in.jsonl", "in.json", "-"])
def test_gzip_input_not_named_gz_is_refused_naming_gzip(tmp_path, name):
    data = gzip.compress(jsonl(3))
    if name == "-":
        proc = run("eval", "-", stdin=data)
    else:
        (tmp_path / name).write_bytes(data)
        proc = run("eval", str(tmp_path / name))
    assert proc.returncode == USAGE
    assert b"gzip-compressed" in proc.stderr and proc.stdout == b""
    no_traceback(proc.stderr)


def test_truncated_gzip_and_a_plain_file_named_gz_exit_2(tmp_path):
    whole = gzip.compress(jsonl(200))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    proc = run("eval", str(cut), "-o", str(tmp_path / "out.jsonl"))
    assert proc.returncode == USAGE and b"truncated" in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()
    plain = tmp_path / "plain.gz"
    plain.write_bytes(jsonl(1))
    proc = run("eval", str(plain))
    assert proc.returncode == USAGE and b"not gzip-compressed" in proc.stderr
    no_traceback(proc.stderr)


@pytest.mark.parametrize(("encoding", "named"), [("utf-16", b"UTF-16"), ("utf-16-le", b"UTF-16"),
                                                 ("utf-16-be", b"UTF-16"), ("utf-32", b"UTF-32")])
def test_utf16_and_utf32_inputs_exit_2_naming_the_encoding(tmp_path, encoding, named):
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(2).decode().encode(encoding))
    proc = run("eval", str(src))
    assert proc.returncode == USAGE, proc.stderr.decode()
    assert named in proc.stderr and b"iconv" in proc.stderr and proc.stdout == b""
    no_traceback(proc.stderr)


def test_utf8_byte_order_mark_is_skipped_in_files_gz_and_stdin(tmp_path):
    bom = b"\xef\xbb\xbf"
    plain = run("eval", "-q", "-", stdin=jsonl(2))
    src, zipped = tmp_path / "bom.jsonl", tmp_path / "bom.jsonl.gz"
    src.write_bytes(bom + jsonl(2))
    zipped.write_bytes(gzip.compress(bom + jsonl(2)))
    expected = without_source(plain.stdout)
    assert len(expected) == 2
    for proc in (run("eval", "-q", str(src)), run("eval", "-q", str(zipped)),
                 run("eval", "-q", "-", stdin=bom + jsonl(2))):
        assert proc.returncode == OK, proc.stderr.decode()
        assert without_source(proc.stdout) == expected


def without_source(stdout: bytes) -> list[dict[str, object]]:
    return [{k: v for k, v in orjson.loads(line).items() if k != "source"} for line in stdout.splitlines()]


def test_csv_file_exits_2_naming_csv(tmp_path):
    src = tmp_path / "traces.csv"
    src.write_text("request_id,request,response\nr-1,What is the refund window?,30 days.\n")
    proc = run("eval", str(src))
    assert proc.returncode == USAGE
    stderr = proc.stderr.decode()
    assert "traces.csv: no line could be read as a record (2 rejected)" in stderr
    assert "CSV" in stderr and proc.stdout == b""
    assert "not JSON: unexpected 'r', expected a JSON value at line 1, column 1" in stderr


@pytest.mark.parametrize("shape", ["object", "array"])
def test_pretty_printed_json_exits_2_with_the_jq_command(tmp_path, shape):
    src = tmp_path / "trace.json"
    value = record(0) if shape == "object" else [record(0), record(1)]
    src.write_text(json.dumps(value, indent=2))
    proc = run("eval", str(src))
    assert proc.returncode == USAGE
    assert b"pretty-printed JSON" in proc.stderr and f"jq -c . {src}".encode() in proc.stderr


def test_a_json_array_on_one_line_exits_2_with_the_jq_command(tmp_path):
    src = tmp_path / "all.json"
    src.write_text(json.dumps([record(0), record(1)]) + "\n")
    proc = run("eval", str(src))
    assert proc.returncode == USAGE and b"a JSON array on one line" in proc.stderr
    assert f"jq -c '.[]' {src}".encode() in proc.stderr


def test_an_empty_file_is_no_records_not_an_error(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_bytes(b"\n\n")
    proc = run("eval", str(src))
    assert proc.returncode == OK, proc.stderr.decode()
    assert b"empty (no lines)" in proc.stderr and proc.stdout == b""


def test_one_unreadable_file_among_good_ones_fails_the_run_and_writes_nothing(tmp_path):
    good, bad, out = tmp_path / "good.jsonl", tmp_path / "bad.jsonl", tmp_path / "out.jsonl"
    good.write_bytes(jsonl(3))
    bad.write_text("nope\nstill not json\n")
    proc = run("eval", str(good), str(bad), "-o", str(out))
    assert proc.returncode == USAGE
    assert b"bad.jsonl: no line could be read as a record (2 rejected)" in proc.stderr
    assert b"not JSON: unexpected 'n' at line 1, column 1" in proc.stderr  # not "expected 'null'"
    assert {p.name for p in tmp_path.iterdir()} == {"good.jsonl", "bad.jsonl"}  # no output, no temporary


# ------------------------------------------------------------------------------- rejects and limits


def test_200000_bad_lines_print_20_and_a_count_and_all_go_to_rejects(tmp_path):
    src, rejects = tmp_path / "bad.jsonl", tmp_path / "rejects.jsonl"
    src.write_bytes(b"nope\n" * 200_000 + orjson.dumps(record(0)) + b"\n")
    proc = run("eval", str(src), "--rejects", str(rejects), "-o", os.devnull)
    assert proc.returncode == OK, proc.stderr.decode()[-2000:]
    lines = proc.stderr.decode().splitlines()
    shown = [line for line in lines if ": rejected (invalid_json)" in line]
    assert len(shown) == 20 and shown[0].startswith(f"{src}:1: ") and shown[-1].startswith(f"{src}:20: ")
    assert f"... and 199980 more rejected lines not shown (all are in {rejects})" in lines
    assert any(line.split() == ["rejected", "lines", "200000"] for line in lines)
    assert len(lines) < 60
    assert sum(1 for _ in rejects.open("rb")) == 200_000


def test_a_line_over_max_record_bytes_is_rejected_unparsed_and_counted(tmp_path):
    config = tmp_path / "tj.yaml"
    config.write_text("stream:\n  max_record_bytes: 2000\n")
    big = {**record(1), "response": "x" * 5000}
    src, rejects = tmp_path / "in.jsonl", tmp_path / "rejects.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in (record(0), big, record(2))))
    proc = run("eval", str(src), "--config", str(config), "--rejects", str(rejects))
    assert proc.returncode == OK, proc.stderr.decode()
    assert ids(proc.stdout) == ["r-0", "r-2"]
    size = len(orjson.dumps(big))
    assert (f"{src}:2: rejected (too_large): {size} bytes, more than stream.max_record_bytes (2000); "
            "not parsed").encode() in proc.stderr
    [entry] = [orjson.loads(line) for line in rejects.read_bytes().splitlines()]
    assert entry["reason"] == "too_large" and entry["line"] == 2 and entry["bytes"] == size
    assert entry["truncated"] is True and len(entry["record"]) == 1024
    # Without --config the stream's default (4 MiB) applies: the same line is read.
    assert ids(run("eval", str(src), "-q").stdout) == ["r-0", "r-1", "r-2"]


def test_format_accepts_otlp_json_and_explains_protobuf(tmp_path):
    span = {"traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331", "name": "chat",
            "kind": 1, "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000001000000000",
            "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}}]}
    line = {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [{"spans": [span]}]}]}
    src = tmp_path / "otlp.jsonl"
    src.write_text(json.dumps(line) + "\n")
    proc = run("eval", str(src), "--format", "otlp_json", "-q")
    assert proc.returncode == OK, proc.stderr.decode()
    [result] = [orjson.loads(x) for x in proc.stdout.splitlines()]
    assert result["source_format"] == "otlp_json" and result["trace_id"] == span["traceId"]
    proc = run("eval", str(src), "--format", "otlp_proto")
    assert proc.returncode == USAGE and b"--format otlp_json" in proc.stderr


# ------------------------------------------------------------------------------ inputs never destroyed


def test_outputs_resolving_to_an_input_are_refused_and_the_input_is_unchanged(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_bytes(jsonl(3))
    before = digest(src)
    (tmp_path / "link.jsonl").symlink_to(src)
    os.link(src, tmp_path / "hard.jsonl")
    (tmp_path / "sub").mkdir()
    config = tmp_path / "tj.yaml"
    config.write_text("judges: {}\n")
    for argv in (["-o", str(src)], ["-o", str(tmp_path / "link.jsonl")],
                 ["-o", str(tmp_path / "hard.jsonl")], ["-o", str(tmp_path / "sub" / ".." / "t.jsonl")],
                 ["--rejects", str(src)],
                 ["--config", str(config), "-o", str(config)],
                 ["-o", str(tmp_path / "x.jsonl"), "--rejects", str(tmp_path / "x.jsonl")]):
        proc = run("eval", str(src), *argv, cwd=tmp_path)
        assert proc.returncode == USAGE, (argv, proc.stderr.decode())
        assert b"would destroy it" in proc.stderr, proc.stderr.decode()
        assert digest(src) == before and config.read_text() == "judges: {}\n"
    assert not (tmp_path / "x.jsonl").exists()
    # A relative path naming the input from another directory is the input too.
    proc = run("eval", "t.jsonl", "-o", "./sub/../t.jsonl", cwd=tmp_path)
    assert proc.returncode == USAGE and digest(src) == before


def test_stdout_appended_to_an_input_and_stdin_read_from_the_output_are_refused(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_bytes(jsonl(2))
    before = digest(src)
    with src.open("ab") as appended:  # `tracejudge eval t.jsonl >> t.jsonl` would never end
        proc = subprocess.run([TRACEJUDGE, "eval", str(src)], stdout=appended, stderr=subprocess.PIPE,
                              timeout=120, check=False)
    assert proc.returncode == USAGE and b"stdout is input" in proc.stderr
    assert digest(src) == before
    with src.open("rb") as stdin:  # `tracejudge eval - -o t.jsonl < t.jsonl`
        proc = subprocess.run([TRACEJUDGE, "eval", "-", "-o", str(src)], stdin=stdin, capture_output=True,
                              timeout=120, check=False)
    assert proc.returncode == USAGE and digest(src) == before


def test_calibrate_refuses_an_output_that_is_an_input_and_writes_through_atomically(tmp_path):
    kit = tmp_path / "kit.jsonl"
    kit.write_bytes(KIT.read_bytes())
    before = digest(kit)
    proc = run("calibrate", str(kit), "--labels", str(kit), "-o", str(kit))
    assert proc.returncode == USAGE and b"would destroy it" in proc.stderr and digest(kit) == before
    out = tmp_path / "cal.json"
    out.write_text("not a calibration file")
    proc = run("calibrate", str(kit), "--labels", str(kit), "-o", str(out))
    assert proc.returncode == USAGE and b"cal.json" in proc.stderr  # found before judging, kept as it was
    assert out.read_text() == "not a calibration file"
    out.unlink()
    proc = run("calibrate", str(kit), "--labels", str(kit), "-o", str(out))
    assert proc.returncode == OK, proc.stderr.decode()
    assert "groundedness" in json.loads(out.read_text())["judges"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.json", "kit.jsonl"]  # no temporary left
    proc = run("calibrate", str(kit), "--labels", str(kit), "-o", "/dev/full")
    assert proc.returncode == OUTPUT and b"No space left on device" in proc.stderr
    no_traceback(proc.stderr)


def test_calibrate_labels_file_that_is_csv_exits_2(tmp_path):
    kit = tmp_path / "kit.jsonl"
    kit.write_bytes(KIT.read_bytes())
    labels = tmp_path / "labels.csv"
    labels.write_text("trace_id,judge,label\nabc,groundedness,pass\n")
    proc = run("calibrate", str(kit), "--labels", str(labels))
    assert proc.returncode == USAGE and b"labels.csv: no line could be read as a label" in proc.stderr
    assert b"CSV" in proc.stderr


# ------------------------------------------------------------------------- outputs replaced at the end


def test_a_failed_run_leaves_the_previous_output_and_rejects_as_they_were(tmp_path):
    good, out, rejects = tmp_path / "good.jsonl", tmp_path / "out.jsonl", tmp_path / "rejects.jsonl"
    good.write_bytes(jsonl(3) + b"nope\n")
    assert run("eval", str(good), "-o", str(out), "--rejects", str(rejects), "-q").returncode == OK
    out_before, rejects_before = digest(out), digest(rejects)
    assert len(out.read_bytes().splitlines()) == 3
    out.chmod(0o640)
    csv = tmp_path / "new.csv"
    csv.write_text("a,b\n1,2\n")
    proc = run("eval", str(good), str(csv), "-o", str(out), "--rejects", str(rejects))
    assert proc.returncode == USAGE
    assert digest(out) == out_before and digest(rejects) == rejects_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.jsonl", "new.csv", "out.jsonl",
                                                          "rejects.jsonl"]
    # A successful run replaces it, keeping the file's permissions.
    good.write_bytes(jsonl(5))
    assert run("eval", str(good), "-o", str(out), "-q").returncode == OK
    assert len(out.read_bytes().splitlines()) == 5 and (out.stat().st_mode & 0o777) == 0o640


def test_an_interrupted_run_exits_130_and_leaves_the_previous_output(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("previous results\n")
    proc = subprocess.Popen([TRACEJUDGE, "eval", "-", "-o", str(out), "-q"], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(jsonl(50))
    proc.stdin.flush()
    # The run is under way (stdin still open) once its temporary output exists beside the target.
    def under_way() -> bool:
        assert proc.poll() is None, "the run ended before it was interrupted"
        return any(p.name.startswith(".out.jsonl.") for p in tmp_path.iterdir())

    wait_until(under_way, 60, message="the temporary output beside out.jsonl")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == INTERRUPTED, stderr.decode()
    assert out.read_text() == "previous results\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
    no_traceback(stderr)


def test_full_disk_exits_3_with_one_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(3) + b"nope\n")  # a rejected line for --rejects
    for argv in (["-o", "/dev/full"], ["--rejects", "/dev/full", "-o", os.devnull]):
        proc = run("eval", str(src), *argv, "-q")
        assert proc.returncode == OUTPUT, proc.stderr.decode()
        assert proc.stderr.decode().strip().splitlines() == ["tracejudge eval: cannot write /dev/full: "
                                                             "No space left on device"]
    with open("/dev/full", "wb") as full:  # `tracejudge eval in.jsonl > /dev/full`
        proc = subprocess.run([TRACEJUDGE, "eval", str(src), "-q"], stdout=full, stderr=subprocess.PIPE,
                              timeout=120, check=False)
    assert proc.returncode == OUTPUT and b"No space left on device" in proc.stderr
    no_traceback(proc.stderr)


def test_an_output_in_a_missing_directory_exits_3_before_reading(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(1))
    proc = run("eval", str(src), "-o", str(tmp_path / "no" / "such" / "out.jsonl"))
    assert proc.returncode == OUTPUT and b"No such file or directory" in proc.stderr
    no_traceback(proc.stderr)


@pytest.mark.parametrize("output", [[], ["-o", "-"], ["-o", "/dev/stdout"]])
def test_a_closed_pipe_ends_quietly_with_status_3(tmp_path, output):
    src, rejects = tmp_path / "in.jsonl", tmp_path / "rejects.jsonl"
    src.write_bytes(jsonl(3000) + b"nope\n")  # ~4 MB of results: far more than a pipe holds
    proc = subprocess.Popen([TRACEJUDGE, "eval", str(src), *output, "--rejects", str(rejects)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert orjson.loads(proc.stdout.readline())["request_id"] == "r-0"  # `| head -1`: one line, gone
    proc.stdout.close()
    stderr = proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == OUTPUT, stderr.decode()
    no_traceback(stderr)
    assert stderr == b""  # no summary, no "Broken pipe": the reader has gone, as after `cat`
    assert not rejects.exists() and [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]
