"""`tracejudge findings FILE...` over result files, the `findings:` section's errors, and the "failures
have in common" block of the `tracejudge eval` summary."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import orjson
import pytest
from test_findings import planted, result

from tracejudge.consumer.commands import cli
from tracejudge.consumer.config import ConfigError, load_settings

FINDING_KEYS = {"kind", "app", "judge", "dimension", "value", "label", "failing", "total", "support",
                "lift", "lift_interval", "failure_rate_with", "failure_rate_without", "window_failing",
                "window_total", "rank", "example_trace_ids", "window", "conditioned_on", "sampled",
                "label_words"}


def results_file(path: Path, seed: int = 3) -> Path:
    path.write_bytes(b"".join(r.to_json() + b"\n" for r in planted(seed)))
    return path


def test_a_ranked_table_and_json_lines_with_example_trace_ids(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    src = results_file(tmp_path / "results.jsonl")
    out = tmp_path / "findings.jsonl"
    assert cli.main(["findings", str(src), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.splitlines()[0].split()[:5] == ["app", "judge", "rank", "dimension", "value"]
    assert "docs://kb/doc-7" in printed.out and "search_v2" in printed.out
    assert "1000 verdicts" in printed.err
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert {(f["dimension"], f["value"]) for f in lines} >= {
        ("doc_uri", "docs://kb/doc-7"), ("tool", "search_v2"), ("version", "2.0")}
    for f in lines:
        assert set(f) == FINDING_KEYS and f["kind"] == "finding"
        assert 1.0 < f["lift_interval"][0] < f["lift"] < f["lift_interval"][1]
        assert 1 <= len(f["example_trace_ids"]) <= 5
        assert all(t.startswith("t") for t in f["example_trace_ids"])
        assert f["window"] == {"start": 1000.0, "end": 1999.0}
        assert f["support"] == pytest.approx(f["failing"] / f["window_failing"], abs=1e-6)
    # The same from a gzip file and stdin-free: the flags override the section.
    gz = tmp_path / "results.jsonl.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    assert cli.main(["findings", str(gz), "--top-k", "1", "--fail-on-findings"]) == 1
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2


def test_no_finding_says_so_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "few.jsonl"
    src.write_bytes(b"".join(result(i, i % 2 == 0, docs=("d",)).to_json() + b"\n" for i in range(8)))
    assert cli.main(["findings", str(src), "--fail-on-findings"]) == 0
    assert "no finding" in capsys.readouterr().out


def test_a_bad_line_is_status_2_naming_the_file_and_line(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_bytes(result(1, True).to_json() + b"\n\n" + b'{"not": "a result"}\n')
    out = tmp_path / "findings.jsonl"
    out.write_text("previous\n")
    assert cli.main(["findings", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{src}:3: not a tracejudge result" in err
    assert out.read_text() == "previous\n"  # a failed run leaves a previous output as it was
    src.write_bytes(b"{not json\n")
    assert cli.main(["findings", str(src)]) == 2
    assert f"{src}:1: not JSON" in capsys.readouterr().err
    assert cli.main(["findings", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_usage_errors_are_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = results_file(tmp_path / "results.jsonl")
    assert cli.main(["findings", str(src), "--out", str(src)]) == 2  # never overwrites its input
    assert "would destroy it" in capsys.readouterr().err
    assert cli.main(["findings", str(src), "--bootstrap-servers", "x:1"]) == 2
    assert "--bootstrap-servers applies to `tracejudge findings run` only" in capsys.readouterr().err
    assert cli.main(["findings", "run", str(src)]) == 2
    config = tmp_path / "bad.yaml"
    config.write_text(json.dumps({"findings": {"min_share": 2, "dimensions": ["doc_uri", "colour"]}}))
    assert cli.main(["findings", str(src), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "findings.min_share" in err and "findings.dimensions" in err and "'colour'" in err


def test_run_checks_its_configuration_before_anything_connects(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"findings": {"window_s": 600}}))
    assert cli.main(["findings", "run", "--config", str(config), "--bootstrap-servers", "127.0.0.1:9"]) == 2
    assert "findings.input_topic: is required" in capsys.readouterr().err
    config.write_text(json.dumps({"stream": {"results_topic": "res"}, "findings": {"findings_topic": "res"}}))
    assert cli.main(["findings", "run", "--config", str(config)]) == 2
    assert "findings.findings_topic: is the input topic 'res'" in capsys.readouterr().err
    config.write_text(json.dumps({"stream": {"results_topic": "res"}, "findings": {"slide_s": 300}}))
    assert cli.main(["findings", "run", "--config", str(config), "--check-config"]) == 0
    shown = capsys.readouterr().out
    assert "findings.slide_s = 300.0" in shown and "http.port = 9469" in shown
    assert 'findings.group_id (effective) = "tracejudge-findings"' in shown
    assert 'findings.input_topic (effective) = "res"' in shown


def test_output_error_is_status_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = results_file(tmp_path / "results.jsonl")
    assert cli.main(["findings", str(src), "--out", str(tmp_path / "no" / "such" / "dir.jsonl")]) == 3


def test_the_section_names_its_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(None, overrides={"findings.window_s": 60, "findings.slide_s": 7}, require_topics=False)
    assert "findings.slide_s" in str(info.value) and "whole panes" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_settings(None, overrides={"findings.clustering.threshold": 0}, require_topics=False)
    assert "findings.clustering.threshold" in str(info.value)
    s = load_settings(None, overrides={"findings.window_s": 60, "findings.slide_s": 15,
                                       "findings.dimensions": "tool,version"}, require_topics=False)
    assert s.findings.panes == 4 and s.findings.options().dimensions == ("tool", "version")


GROUNDED = {"request": "What is the refund window?", "response": "Refunds are accepted within 30 days.",
            "retrieved_context": [{"content": "Refunds are accepted within 30 days of purchase.",
                                   "doc_uri": "kb://refunds"}]}
STALE = {"request": "What is the refund window?", "response": "Refunds take 90 days and cost 15 euros.",
         "retrieved_context": [{"content": "Our old policy: store credit only, no cash.",
                                "doc_uri": "kb://stale-policy"}]}


def test_eval_summary_says_what_the_failures_have_in_common(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tracejudge.yaml"
    config.write_text("judges: {}\n")  # the model-free heuristic judges
    rows = [{**GROUNDED, "request_id": f"g{i}"} for i in range(40)]
    rows += [{**STALE, "request_id": f"s{i}"} for i in range(12)]
    rows += [{**GROUNDED, "response": "Refunds take 90 days and cost 15 euros.", "request_id": f"m{i}"}
             for i in range(3)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["eval", str(src), "--config", str(config), "-o", str(tmp_path / "out.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "failures have in common" in err
    line = next(li for li in err.splitlines() if "groundedness fails with" in li)
    assert "doc_uri=kb://stale-policy: 12 of 12 failed" in line and "lift" in line
    # The results it wrote give the same finding offline.
    assert cli.main(["findings", str(tmp_path / "out.jsonl")]) == 0
    assert "kb://stale-policy" in capsys.readouterr().out
    # Without failures there is no block.
    src.write_text("".join(json.dumps({**GROUNDED, "request_id": f"g{i}"}) + "\n" for i in range(20)))
    assert cli.main(["eval", str(src), "--config", str(config), "-o", str(tmp_path / "out2.jsonl")]) == 0
    assert "failures have in common" not in capsys.readouterr().err


def test_the_sample_of_the_conditioned_tests_is_a_checked_key() -> None:
    assert load_settings(environ={}, overrides={"findings.sample": 2000},
                         offline=True).findings.options().sample == 2000
    with pytest.raises(ConfigError) as raised:
        load_settings(environ={}, overrides={"findings.sample": 10}, offline=True)
    assert "findings.sample" in raised.value.report()
