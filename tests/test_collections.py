"""Collections (`collections:` rules): validated at start-up, applied by `tracejudge eval` to files and by
`tracejudge run` to a topic; a collected file is an evaluation input as it stands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from support.kafka import committed_offsets, ends, produce, read_topic, running, unique, wait_until
from support.kafka import settings as kafka_settings
from support.openai_stub import Reply

from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.metrics.judges.sampling import is_sampled

TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]
JUDGE = "relevance_to_query"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}


def _yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def _judges(base_url: str) -> dict[str, Any]:
    return {"endpoints": {"default": {"base_url": base_url, "model": "judge-model"}}, "sample_rate": 1.0,
            "builtin": {JUDGE: {}}}


def _row(i: int, bad: bool) -> dict[str, Any]:
    return {"trace_id": f"{i:032x}", "request": f"question {i}" + (" BAD" if bad else ""),
            "response": f"answer {i}",
            "retrieved_context": [{"content": f"chunk {i}", "doc_uri": f"doc://{i}"}],
            "trajectory": [{"tool_name": "search", "tool_input": {"q": f"question {i}"}}]}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _judge_fails_bad_requests(stub: Any) -> None:
    stub.responder = lambda req: (Reply.verdict("no", rationale="off topic") if "BAD" in req.prompt
                                  else Reply.verdict("yes", rationale="on topic"))


# -- configuration errors, before anything runs ------------------------------------------------------

def _load(tmp_path: Path, collections: list[dict[str, Any]], judges: dict[str, Any] | None = None) -> Any:
    config: dict[str, Any] = {"collections": collections}
    if judges is not None:
        config["judges"] = judges
    return load_settings(_yaml(tmp_path / "c.yaml", config), offline=True)


def _problems(tmp_path: Path, collections: list[dict[str, Any]], judges: Any = None) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, collections, judges)
    return {key.split(" (from")[0]: msg for key, msg in caught.value.problems}


def test_a_rule_naming_an_unknown_judge_or_metric_is_refused_naming_the_rule_and_key(tmp_path):
    heuristic = {"builtin": {"groundedness": {"provider": "heuristic"}}}
    found = _problems(tmp_path, [
        {"name": "a", "file": "a.jsonl", "when": [{"judge": "groundednes", "verdict": "failed"},
                                                   {"metric": {"name": "latency", "op": ">", "value": 1}}]},
        {"name": "a", "topic": "t"}], heuristic)
    assert "'groundednes' is not a configured trace judge (groundedness)" in \
        found["collections[0].when[0].judge"]
    assert "'latency' is not a computed metric" in found["collections[0].when[1].metric.name"]
    assert "used by an earlier rule" in found["collections[1].name"]


def test_a_judge_condition_without_a_judges_section_is_refused(tmp_path):
    found = _problems(tmp_path, [{"name": "a", "file": "a.jsonl", "when": [{"judge": "safety",
                                                                            "verdict": "failed"}]}])
    assert "none: add a judges: section" in found["collections[0].when[0].judge"]


@pytest.mark.parametrize(("rule", "key", "words"), [
    ({"name": "a", "when": []}, "collections[0].topic", "needs a topic, a file, or both"),
    ({"name": "A b", "file": "x"}, "collections[0].name", "lowercase identifier"),
    ({"name": "a", "file": "x", "when": [{"app": "x", "version": "1"}]}, "collections[0].when[0]",
     "exactly one of judge, metric, app, version, finding (got app, version)"),
    ({"name": "a", "file": "x", "when": [{"judge": "safety"}]}, "collections[0].when[0].verdict", "required"),
    ({"name": "a", "file": "x", "sample_rate": 2}, "collections[0].sample_rate", "must be <= 1"),
    ({"name": "a", "file": "x", "max_per_window": 0}, "collections[0].max_per_window", "must be >= 1"),
    ({"name": "a", "topic": "no spaces"}, "collections[0].topic", "not a valid Kafka topic name"),
    ({"name": "a", "file": "x", "when": [{"metric": {"name": "failed", "op": "~", "value": 1}}]},
     "collections[0].when[0].metric.op", "must be one of"),
])
def test_bad_rules_are_config_errors_naming_their_key(tmp_path, rule, key, words):
    found = _problems(tmp_path, [rule])
    assert key in found, found
    assert words in found[key]


def test_eval_exits_2_on_a_bad_rule_before_writing_anything(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps(_row(1, False)) + b"\n")
    config = _yaml(tmp_path / "c.yaml", {"collections": [{"name": "a", "file": str(tmp_path / "a.jsonl"),
                                                          "when": [{"judge": "nope", "verdict": "failed"}]}]})
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config)], capture_output=True,
                          timeout=120, check=False, env=_env())
    assert proc.returncode == 2
    assert b"collections[0].when[0].judge" in proc.stderr
    assert proc.stdout == b"" and not (tmp_path / "a.jsonl").exists()


# -- tracejudge eval ----------------------------------------------------------------------------------

def test_eval_collects_exactly_the_failing_rows_deduplicated_capped_and_sampled(tmp_path, stub):
    _judge_fails_bad_requests(stub)
    bad = list(range(20))
    rows = [_row(i, bad=i in bad) for i in range(30)]
    rows.insert(5, _row(0, bad=True))  # trace 0 again: collected once
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    failing = {"judge": JUDGE, "verdict": "failed"}
    config = _yaml(tmp_path / "c.yaml", {"judges": _judges(stub.base_url), "collections": [
        {"name": "failing", "when": [failing], "file": str(tmp_path / "failing.jsonl")},
        {"name": "capped", "when": [failing], "max_per_window": 3, "window_s": 86400,
         "file": str(tmp_path / "capped.jsonl")},
        {"name": "sampled", "when": [failing], "sample_rate": 0.5, "file": str(tmp_path / "sampled.jsonl")},
        {"name": "live_only", "when": [failing], "topic": "tracejudge-collected"},
    ]})
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config), "-o",
                           str(tmp_path / "results.jsonl")], capture_output=True, timeout=300, check=False,
                          env=_env())
    assert proc.returncode == 0, proc.stderr.decode()

    collected = _lines(tmp_path / "failing.jsonl")
    ids = [r["trace_id"] for r in collected]
    assert sorted(ids) == sorted(f"{i:032x}" for i in bad)  # exactly the failing traces, each once
    first = next(r for r in collected if r["trace_id"] == f"{3:032x}")
    assert first["request"] == "question 3 BAD" and first["response"] == "answer 3"
    assert first["retrieved_context"] == [{"content": "chunk 3", "doc_uri": "doc://3"}]
    assert first["trajectory"] == [{"tool_name": "search", "tool_input": {"q": "question 3"}}]
    assert first["expected_response"] is None and first["expected_facts"] is None
    assert first["collection"] == "failing"
    verdict = next(a for a in first["assessments"] if a["name"] == JUDGE)
    assert verdict["status"] == "failed" and verdict["rationale"] == "off topic"

    capped = _lines(tmp_path / "capped.jsonl")
    assert [r["trace_id"] for r in capped] == [f"{i:032x}" for i in (0, 1, 2)]

    want = {f"{i:032x}" for i in bad if is_sampled(f"{i:032x}", 0.5, seed="collection\x00sampled")}
    sampled = {r["trace_id"] for r in _lines(tmp_path / "sampled.jsonl")}
    assert sampled == want

    err = proc.stderr.decode()
    assert "collection failing: 20 rows" in err and "1 duplicate" in err
    # 21 matched (trace 0 twice): 3 collected, then trace 0's second row is a duplicate, 17 over the cap.
    assert "collection capped: 3 rows" in err and "1 duplicate, 17 cap" in err
    # Trace 0's second row is sampled out again when its first one was.
    again = 0 if f"{0:032x}" in want else 1
    assert f"collection sampled: {len(want)} rows" in err and f"{20 - len(want) + again} sampled_out" in err
    assert 0 < len(want) < 20
    assert "collection live_only: a topic only" in err


def test_a_collected_file_is_an_eval_input_as_it_stands(tmp_path, stub):
    _judge_fails_bad_requests(stub)
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(_row(i, bad=i % 2 == 0)) + b"\n" for i in range(6)))
    config = _yaml(tmp_path / "c.yaml", {"judges": _judges(stub.base_url), "collections": [
        {"name": "failing", "when": [{"judge": JUDGE, "verdict": "failed"}],
         "file": str(tmp_path / "f.jsonl")}]})
    first = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config), "-q"],
                           capture_output=True, timeout=300, check=False, env=_env())
    assert first.returncode == 0, first.stderr.decode()
    collected = tmp_path / "f.jsonl"
    before = collected.read_bytes()
    again = subprocess.run([*TRACEJUDGE, "eval", str(collected), "--format", "agent_eval"],
                           capture_output=True, timeout=300, check=False, env=_env())
    assert again.returncode == 0, again.stderr.decode()
    assert re.search(r"rejected lines\s+0\n", again.stderr.decode())
    results = [orjson.loads(line) for line in again.stdout.splitlines()]
    rows = _lines(collected)
    assert len(results) == len(rows) == 3
    for row, result in zip(rows, results, strict=True):
        for key in ("trace_id", "request", "response", "retrieved_context"):
            assert result[key] == row[key], key
        # A row states a call's `error` only when it failed; the result line always has it (schema 6).
        assert result["trajectory"] == [{**call, "error": call.get("error")} for call in row["trajectory"]]
    assert collected.read_bytes() == before  # read, never written
    # Auto-detected too.
    auto = subprocess.run([*TRACEJUDGE, "eval", str(collected), "-q"], capture_output=True, timeout=300,
                          check=False, env=_env())
    assert auto.returncode == 0 and len(auto.stdout.splitlines()) == 3


def test_eval_refuses_a_collection_file_that_is_an_input(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(orjson.dumps(_row(1, False)) + b"\n")
    before = src.read_bytes()
    config = _yaml(tmp_path / "c.yaml", {"collections": [{"name": "every", "file": str(src)}]})
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config)], capture_output=True,
                          timeout=120, check=False, env=_env())
    assert proc.returncode == 2
    assert b"collections[0].file" in proc.stderr and b"would destroy it" in proc.stderr
    assert src.read_bytes() == before


def test_a_failed_eval_leaves_the_previous_collection_file(tmp_path):
    previous = tmp_path / "every.jsonl"
    previous.write_bytes(b'{"kept": true}\n')
    src = tmp_path / "in.csv"
    src.write_text("a,b\n1,2\n")  # no line is a record: exit 2
    config = _yaml(tmp_path / "c.yaml", {"collections": [{"name": "every", "file": str(previous)}]})
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config), "-q"], capture_output=True,
                          timeout=120, check=False, env=_env())
    assert proc.returncode == 2
    assert previous.read_bytes() == b'{"kept": true}\n'
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_conditions_on_metrics_app_and_any(tmp_path):
    rows = [dict(_row(i, False), tags={"app": "a" if i < 2 else "b"}) for i in range(4)]
    rows[3].pop("retrieved_context")
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    config = _yaml(tmp_path / "c.yaml", {"stream": {"app_tag": "app"}, "collections": [
        {"name": "app_a", "when": [{"app": ["a"]}], "file": str(tmp_path / "a.jsonl")},
        {"name": "no_docs_or_b", "match": "any", "file": str(tmp_path / "b.jsonl"),
         "when": [{"metric": {"name": "retrieved_documents", "op": "==", "value": 0}}, {"app": "b"}]},
        {"name": "one_doc", "file": str(tmp_path / "c.jsonl"),
         "when": [{"metric": {"name": "retrieved_documents", "op": ">=", "value": 1}}, {"app": "b"}]},
    ]})
    proc = subprocess.run([*TRACEJUDGE, "eval", str(src), "--config", str(config), "-q"], capture_output=True,
                          timeout=120, check=False, env=_env())
    assert proc.returncode == 0, proc.stderr.decode()
    ids = {name: [r["trace_id"] for r in _lines(tmp_path / f"{name}.jsonl")] for name in "abc"}
    assert ids["a"] == [f"{0:032x}", f"{1:032x}"]
    assert ids["b"] == [f"{2:032x}", f"{3:032x}"]
    assert ids["c"] == [f"{2:032x}"]


# -- tracejudge run -----------------------------------------------------------------------------------

def _committed_to(bs: str, group: str, topic: str, placed: list[tuple[int, int]]) -> bool:
    want = ends(placed)
    got = committed_offsets(bs, group, topic)
    return all(got.get(p) == end for p, end in want.items())


def test_run_publishes_collected_rows_to_the_topic_and_commits_after(broker, stub, tmp_path):
    _judge_fails_bad_requests(stub)
    bs = broker.bootstrap_servers
    topic, results, collected, group = unique("traces"), unique("results"), unique("collected"), unique("g")
    rows = [_row(i, bad=i % 3 == 0) for i in range(12)]
    rows.append(_row(0, bad=True))  # a trace seen twice: one row
    placed = produce(bs, topic, [orjson.dumps(r) for r in rows])
    bad = sorted({r["trace_id"] for r in rows if "BAD" in r["request"]})
    appended = tmp_path / "collected.jsonl"
    rules = [{"name": "failing", "when": [{"judge": JUDGE, "verdict": ["failed"]}], "topic": collected,
              "file": str(appended)},
             {"name": "capped", "when": [{"judge": JUDGE, "verdict": "failed"}], "topic": collected,
              "max_per_window": 2, "window_s": 86400}]
    s = kafka_settings(bs, [f"{topic}:agent_eval"], **{
        "stream.results_topic": results, "kafka.group_id": group, "judges": _judges(stub.base_url),
        "collections": rules})
    with running(s) as runner:
        wait_until(lambda: _committed_to(bs, group, topic, placed), 90, message="committed to the end")
        # Committed means every result and row was acknowledged first: they are all there now.
        out = read_topic(bs, collected, at_least=len(bad) + 2, timeout=5)
        registry = runner.registry
        assert registry.get_sample_value("tracejudge_collected_total", {"collection": "failing"}) == len(bad)
        assert registry.get_sample_value("tracejudge_collected_total", {"collection": "capped"}) == 2
        assert registry.get_sample_value("tracejudge_collection_dropped_total",
                                         {"collection": "failing", "reason": "duplicate"}) == 1
        # Judges finish in any order: trace 0's second row is a duplicate only if its first was collected.
        capped = {reason: registry.get_sample_value("tracejudge_collection_dropped_total",
                                                    {"collection": "capped", "reason": reason})
                  for reason in ("cap", "duplicate")}
        assert capped["cap"] + capped["duplicate"] == len(bad) + 1 - 2 and capped["cap"] >= len(bad) - 2
    by_collection: dict[str, list[str]] = {}
    for record in out:
        row = orjson.loads(record.value)
        assert record.key.decode() == row["trace_id"]
        assert dict(record.headers)["tracejudge-collection"] == row["collection"].encode()
        by_collection.setdefault(row["collection"], []).append(row["trace_id"])
    assert sorted(by_collection["failing"]) == bad
    assert len(by_collection["capped"]) == 2
    assert sorted(r["trace_id"] for r in _lines(appended)) == bad

    # A restart reading the topic again appends nothing new to the file: its trace ids were read back.
    s2 = kafka_settings(bs, [f"{topic}:agent_eval"], **{
        "kafka.group_id": unique("g"), "judges": _judges(stub.base_url), "collections": rules[:1]})
    with running(s2) as again:
        wait_until(lambda: again.registry.get_sample_value("tracejudge_collection_dropped_total",
                                                           {"collection": "failing", "reason": "duplicate"})
                   == len(bad) + 1, 90, message="every failing trace seen as already collected")
    assert sorted(r["trace_id"] for r in _lines(appended)) == bad


# -- a collection file that cannot be appended to: retried, the offset held, nothing dropped -----------

class _Ticket:
    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


def test_a_row_whose_file_cannot_be_written_is_retried_with_its_offset_held(tmp_path):
    """A full disk (/dev/full: every write fails with ENOSPC) does not drop the row nor release the
    record's offset; once the file can be written again the row is appended once and the offset goes."""
    from prometheus_client import CollectorRegistry

    from tracejudge.consumer.collecting import AppendedFile, CollectingResults, Collector
    from tracejudge.consumer.config.collections import CollectionRule
    from tracejudge.consumer.runtime.producing import DeadLetterSink
    from tracejudge.schemas.record import EvalRecord
    from tracejudge.schemas.result import EvaluationResult, SourceRef

    target = tmp_path / "collected.jsonl"
    rule = CollectionRule(name="everything", file=str(target))
    registry = CollectorRegistry()
    collector = Collector.build([rule], registry)
    assert collector is not None
    appended = AppendedFile(str(target))
    appended.open(collector)
    good_fd = appended.fd
    appended.fd = os.open("/dev/full", os.O_WRONLY)
    results = CollectingResults(None, None, None, DeadLetterSink(None, None, None), collector,
                                {str(target): appended})
    tickets = [_Ticket(), _Ticket()]
    for t, trace in zip(tickets, ("ab" * 16, "cd" * 16), strict=True):  # the second waits behind the first
        record = EvalRecord(request="why is the invoice late?", response="it is not", trace_id=trace)
        results.publish(EvaluationResult(record, SourceRef("agent_eval")), t)

    def failures() -> float:
        return registry.get_sample_value("tracejudge_collection_publish_failures_total",
                                         {"collection": "everything"}) or 0
    wait_until(lambda: failures() >= 2, 30, message="the append retried")
    assert [t.released for t in tickets] == [0, 0] and target.read_bytes() == b""
    assert registry.get_sample_value("tracejudge_collected_total", {"collection": "everything"}) == 0
    full_fd, appended.fd = appended.fd, good_fd
    wait_until(lambda: [t.released for t in tickets] == [1, 1], 30,
               message="the rows written and the offsets released")
    os.close(full_fd)
    assert [row["trace_id"] for row in _lines(target)] == ["ab" * 16, "cd" * 16]  # in order, once each
    assert registry.get_sample_value("tracejudge_collected_total", {"collection": "everything"}) == 2
    # Not dropped for any reason: every series of the drop counter, whatever reasons it has, stays at 0.
    dropped = {sample.labels["reason"]: sample.value for family in registry.collect()
               if family.name == "tracejudge_collection_dropped" for sample in family.samples
               if sample.name == "tracejudge_collection_dropped_total"}
    assert dropped and not any(dropped.values()), dropped
    appended.close()
