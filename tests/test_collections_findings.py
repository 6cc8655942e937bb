"""`finding:` collection conditions: a trace whose verdict of a judge shares a value with a current finding
for its app and judge. `tracejudge eval` matches against the run's own findings, `tracejudge run`
against the findings topic; config errors before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from kafka import KafkaProducer
from support.kafka import committed_offsets, ends, produce, running, unique, wait_until
from support.kafka import settings as kafka_settings
from support.openai_stub import Reply

from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.stages.run import StreamRunner

TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]
JUDGE = "relevance_to_query"
BAD_DOC = "doc://handbook/refunds"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}


def _yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _judges(base_url: str) -> dict[str, Any]:
    return {"endpoints": {"default": {"base_url": base_url, "model": "judge-model"}}, "sample_rate": 1.0,
            "builtin": {JUDGE: {}}}


def _row(i: int, bad: bool, doc: str | None = None) -> dict[str, Any]:
    return {"trace_id": f"{i:032x}", "request": f"question {i}" + (" BAD" if bad else ""),
            "response": f"answer {i}",
            "retrieved_context": [{"content": f"chunk {i}", "doc_uri": doc or f"doc://{i}"}],
            "trajectory": [{"tool_name": "search", "tool_input": {"q": f"question {i}"}}]}


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _judge_fails_bad_requests(stub: Any) -> None:
    stub.responder = lambda req: (Reply.verdict("no", rationale="off topic") if "BAD" in req.prompt
                                  else Reply.verdict("yes", rationale="on topic"))


def _planted() -> tuple[list[dict[str, Any]], set[str], set[str]]:
    """40 traces: 12 failing on BAD_DOC, 2 passing on BAD_DOC, 3 failing and 23 passing elsewhere.
    Returns the rows, the failing BAD_DOC trace ids, and all BAD_DOC trace ids."""
    rows = []
    for i in range(40):
        on_bad = i < 14
        rows.append(_row(i, bad=i < 12 or 14 <= i < 17, doc=BAD_DOC if on_bad else None))
    failing = {f"{i:032x}" for i in range(12)}
    return rows, failing, {f"{i:032x}" for i in range(14)}


# -- configuration errors, before anything runs ------------------------------------------------------

def _problems(tmp_path: Path, when: list[dict[str, Any]]) -> dict[str, str]:
    config = {"judges": {"builtin": {"groundedness": {"provider": "heuristic"}}},
              "collections": [{"name": "a", "file": "a.jsonl", "when": when}]}
    with pytest.raises(ConfigError) as caught:
        load_settings(_yaml(tmp_path / "c.yaml", config), offline=True)
    return {key.split(" (from")[0]: msg for key, msg in caught.value.problems}


@pytest.mark.parametrize(("finding", "key", "words"), [
    ({"judge": "groundednes"}, "collections[0].when[0].finding.judge",
     "'groundednes' is not a configured live trace judge"),
    ({"judge": "groundedness", "dimension": "doc"}, "collections[0].when[0].finding.dimension",
     "'doc' is not a findings dimension (doc_uri, tool"),
    ({"judge": "groundedness", "dimension": "request_cluster"}, "collections[0].when[0].finding.dimension",
     "request_cluster cannot be matched"),
    ({"judge": "groundedness", "verdict": "bad"}, "collections[0].when[0].finding.verdict[0]", "got 'bad'"),
    ({"dimension": "doc_uri"}, "collections[0].when[0].finding.judge", "required"),
])
def test_a_bad_finding_condition_is_a_config_error_naming_the_rule_and_key(tmp_path, finding, key, words):
    found = _problems(tmp_path, [{"finding": finding}])
    assert key in found, found
    assert words in found[key]


def test_run_refuses_a_finding_rule_without_a_findings_topic(tmp_path):
    s = kafka_settings("127.0.0.1:1", ["t:agent_eval"], **{
        "judges": {"builtin": {"groundedness": {"provider": "heuristic"}}},
        "collections": [{"name": "a", "file": str(tmp_path / "a.jsonl"),
                         "when": [{"finding": {"judge": "groundedness"}}]}]})
    with pytest.raises(ConfigError) as caught:
        StreamRunner(s, judges=False)
    assert "findings.findings_topic" in str(caught.value)
    assert not (tmp_path / "a.jsonl").exists()


def test_eval_exits_2_on_an_unknown_dimension_before_writing_anything(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps(_row(1, False)) + b"\n")
    config = _yaml(tmp_path / "c.yaml", {
        "judges": {"builtin": {"groundedness": {"provider": "heuristic"}}},
        "collections": [{"name": "a", "file": str(tmp_path / "a.jsonl"),
                         "when": [{"finding": {"judge": "groundedness", "dimension": "page"}}]}]})
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config)], capture_output=True,
                          timeout=120, check=False, env=_env())
    assert proc.returncode == 2
    assert b"collections[0].when[0].finding.dimension" in proc.stderr
    assert proc.stdout == b"" and not (tmp_path / "a.jsonl").exists()


# -- tracejudge eval: the run's own findings ----------------------------------------------------------

def test_eval_collects_exactly_the_traces_sharing_a_finding_value(tmp_path, stub):
    _judge_fails_bad_requests(stub)
    rows, failing_bad, all_bad = _planted()
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    shared = tmp_path / "shared.jsonl"
    config = _yaml(tmp_path / "c.yaml", {"judges": _judges(stub.base_url), "collections": [
        {"name": "on_finding_doc", "file": str(tmp_path / "doc.jsonl"),
         "when": [{"finding": {"judge": JUDGE, "dimension": "doc_uri"}}]},
        {"name": "any_dimension", "file": str(shared), "when": [{"finding": {"judge": JUDGE}}]},
        {"name": "any_verdict", "file": str(tmp_path / "any.jsonl"),
         "when": [{"finding": {"judge": JUDGE, "dimension": "doc_uri", "verdict": ["passed", "failed"]}}]},
        {"name": "on_finding_tool", "file": str(tmp_path / "tool.jsonl"),
         "when": [{"finding": {"judge": JUDGE, "dimension": "tool"}}]},
        {"name": "failing", "file": str(shared), "when": [{"judge": JUDGE, "verdict": "failed"}]},
    ]})
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config), "-o",
                           str(tmp_path / "results.jsonl")], capture_output=True, timeout=300, check=False,
                          env=_env())
    assert proc.returncode == 0, proc.stderr.decode()
    err = proc.stderr.decode()
    assert BAD_DOC in err  # the summary names the finding the rules matched against

    doc = _lines(tmp_path / "doc.jsonl")
    assert sorted(r["trace_id"] for r in doc) == sorted(failing_bad)  # not the 3 failing elsewhere
    assert all(r["collection"] == "on_finding_doc" for r in doc)
    assert {r["trace_id"] for r in _lines(tmp_path / "any.jsonl")} == all_bad
    # Every trace calls `search`: it is no finding, so a tool-dimension rule collects nothing.
    assert _lines(tmp_path / "tool.jsonl") == []
    by_rule: dict[str, set[str]] = {}
    for r in _lines(shared):
        by_rule.setdefault(r["collection"], set()).add(r["trace_id"])
    assert by_rule["any_dimension"] == failing_bad
    # A spooled result's row is the row the result itself gives (as the other rule's row of the trace).
    rows_of = {(r["collection"], r["trace_id"]): r for r in _lines(shared)}
    for tid in failing_bad:
        later, now = rows_of[("any_dimension", tid)], rows_of[("failing", tid)]
        assert {**later, "collection": None} == {**now, "collection": None}
    assert len(by_rule["failing"]) == 15
    assert "collection on_finding_doc: 12 rows" in err and "findings" in err


def test_eval_without_findings_collects_nothing_by_a_finding_rule(tmp_path, stub):
    stub.responder = lambda req: Reply.verdict("yes", rationale="on topic")  # nothing fails: no finding
    rows, _, _ = _planted()
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    config = _yaml(tmp_path / "c.yaml", {"judges": _judges(stub.base_url), "collections": [
        {"name": "on_finding", "file": str(tmp_path / "f.jsonl"),
         "when": [{"finding": {"judge": JUDGE, "verdict": ["passed", "failed"]}}]}]})
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config), "-o",
                           str(tmp_path / "results.jsonl")], capture_output=True, timeout=300, check=False,
                          env=_env())
    assert proc.returncode == 0, proc.stderr.decode()
    assert _lines(tmp_path / "f.jsonl") == []
    assert "collection on_finding: 0 rows" in proc.stderr.decode()


# -- tracejudge run: the findings topic ---------------------------------------------------------------

def _finding(value: str, end: float, app: str = "unknown", judge: str = JUDGE) -> bytes:
    return orjson.dumps({"kind": "finding", "app": app, "judge": judge, "dimension": "doc_uri",
                         "value": value, "label": None, "failing": 12, "total": 14, "rank": 1,
                         "window": {"start": end - 900, "end": end}})


def _produce_keyed(bs: str, topic: str, values: list[bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=bs, acks="all")
    try:
        for v in values:
            producer.send(topic, key=b"unknown/" + JUDGE.encode(), value=v).get(timeout=30)
    finally:
        producer.close(timeout=5)


def _committed(bs: str, group: str, topic: str, placed: list[tuple[int, int]]) -> bool:
    want = ends(placed)
    got = committed_offsets(bs, group, topic)
    return all(got.get(p) == end for p, end in want.items())


def _sample(runner: Any, name: str, **labels: str) -> float:
    return runner.registry.get_sample_value(name, labels) or 0.0


def test_run_collects_the_traces_matching_the_latest_findings_on_the_topic(broker, stub, tmp_path):
    _judge_fails_bad_requests(stub)
    bs = broker.bootstrap_servers
    topic, findings, group = unique("traces"), unique("findings"), unique("g")
    # The latest window names BAD_DOC; a later line of an earlier window (doc://old) is ignored, and so
    # is another app's finding on doc://7.
    _produce_keyed(bs, findings, [_finding("doc://older-window", 1000.0), _finding(BAD_DOC, 2000.0),
                                  _finding("doc://old", 1500.0), _finding("doc://7", 2000.0, app="other")])
    rows, failing_bad, _ = _planted()
    rows.append(_row(50, bad=True, doc="doc://old"))
    rows.append(_row(51, bad=True, doc="doc://older-window"))
    rows.append(_row(7 + 100, bad=True, doc="doc://7"))
    rows.append(_row(60, bad=True, doc="doc://late"))
    appended = tmp_path / "collected.jsonl"
    s = kafka_settings(bs, [f"{topic}:agent_eval"], **{
        "kafka.group_id": group, "judges": _judges(stub.base_url), "findings.findings_topic": findings,
        "collections": [{"name": "on_finding", "file": str(appended),
                         "when": [{"finding": {"judge": JUDGE, "dimension": "doc_uri"}}]}]})
    with running(s) as runner:
        feed = runner.stage.findings_feed
        wait_until(feed.available, 60, message="the findings topic read to its end")
        placed = produce(bs, topic, [orjson.dumps(r) for r in rows])
        wait_until(lambda: _committed(bs, group, topic, placed), 90, message="committed to the end")
        assert _sample(runner, "tracejudge_collected_total", collection="on_finding") == len(failing_bad)
        assert _sample(runner, "tracejudge_collection_dropped_total", collection="on_finding",
                       reason="no_findings") == 0
        assert sorted(r["trace_id"] for r in _lines(appended)) == sorted(failing_bad)

        # A later window's finding replaces the pair's values while the run goes on; it collects the
        # traces evaluated after it arrived, not trace 60 (evaluated before, with the same document).
        _produce_keyed(bs, findings, [_finding("doc://late", 3000.0)])
        wait_until(lambda: "doc://late" in (feed.values("unknown", JUDGE) or {}).get("doc_uri", ()), 30,
                   message="the new finding read")
        more = produce(bs, topic, [orjson.dumps(_row(61, bad=True, doc="doc://late")),
                                   orjson.dumps(_row(62, bad=True, doc=BAD_DOC))])
        wait_until(lambda: _committed(bs, group, topic, [*placed, *more]), 90, message="committed again")
    assert sorted(r["trace_id"] for r in _lines(appended)) == sorted({*failing_bad, f"{61:032x}"})


def test_run_with_an_unreadable_findings_topic_counts_and_collects_nothing(broker, stub, tmp_path):
    _judge_fails_bad_requests(stub)
    bs = broker.bootstrap_servers
    topic, group = unique("traces"), unique("g")
    rows, _, _ = _planted()
    placed = produce(bs, topic, [orjson.dumps(r) for r in rows])
    on_finding, failing = tmp_path / "on_finding.jsonl", tmp_path / "failing.jsonl"
    s = kafka_settings(bs, [f"{topic}:agent_eval"], **{
        "kafka.group_id": group, "judges": _judges(stub.base_url),
        # Nothing ever published to it: the topic does not exist.
        "findings.findings_topic": unique("no-findings"),
        "collections": [{"name": "on_finding", "file": str(on_finding),
                         "when": [{"finding": {"judge": JUDGE, "dimension": "doc_uri"}}]},
                        {"name": "failing", "file": str(failing),
                         "when": [{"judge": JUDGE, "verdict": "failed"}]}]})
    with running(s) as runner:
        wait_until(lambda: _committed(bs, group, topic, placed), 90, message="committed to the end")
        assert not runner.stage.findings_feed.available()
        # Each failing trace the finding rule could have taken is counted, none collected.
        assert _sample(runner, "tracejudge_collection_dropped_total", collection="on_finding",
                       reason="no_findings") == 15
        assert _sample(runner, "tracejudge_collected_total", collection="on_finding") == 0
        assert _sample(runner, "tracejudge_collected_total", collection="failing") == 15
    assert _lines(on_finding) == []
    assert len(_lines(failing)) == 15
