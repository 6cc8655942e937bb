"""`tracejudge backfill` against the real broker: records with explicit timestamps in three windows on a
multi-partition topic; a backfill of the middle window judges exactly those records, marks the results,
resumes from its committed offsets after a stop, and publishes nothing new when re-run when done."""

from __future__ import annotations

import argparse
import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaProducer
from support.kafka import partition_count, read_topic, settings, unique

from tracejudge.consumer.commands import backfill, cli
from tracejudge.consumer.demo.broker import LocalBroker
from tracejudge.consumer.stages.backfill import BackfillError, BackfillRun, parse_time, run_id

BASE = 1_763_625_600.0  # 2025-11-20T08:00:00Z
WINDOWS = [(BASE, BASE + 100), (BASE + 100, BASE + 200), (BASE + 200, BASE + 300)]
PER_WINDOW = 12


def _row(window: int, i: int) -> bytes:
    return json.dumps({
        "request_id": f"w{window}-{i}",
        "request": "What is the refund window?",
        "response": "Refunds are accepted within 30 days." if i % 3 else "I cannot say.",
        "retrieved_context": [{"content": "Refunds are accepted within 30 days of purchase."}],
    }).encode()


def _produce_windows(bootstrap: str, topic: str) -> None:
    """PER_WINDOW records per window, timestamps spread inside it, in time order."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    try:
        futures = [producer.send(topic, value=_row(w, i), key=f"w{w}-{i}".encode(),
                                 timestamp_ms=int((start + i * 7) * 1000))
                   for w, (start, _) in enumerate(WINDOWS) for i in range(PER_WINDOW)]
        producer.flush(timeout=30)
        for f in futures:
            f.get(timeout=30)
    finally:
        producer.close(timeout=5)


@pytest.fixture
def topics(broker: LocalBroker) -> tuple[str, str]:
    source = unique("backfill-in")
    _produce_windows(broker.bootstrap_servers, source)
    assert partition_count(broker.bootstrap_servers, source) > 1
    return source, unique("backfill-out")


def _settings(broker: LocalBroker, source: str, results: str) -> Any:
    return settings(broker.bootstrap_servers, [f"{source}:agent_eval"], stream__results_topic=results,
                    judges={})


def _ids(records: list[Any]) -> list[str]:
    return [json.loads(r.value)["request_id"] for r in records]


def test_backfill_judges_exactly_the_range_and_a_rerun_publishes_nothing_new(
        broker: LocalBroker, topics: tuple[str, str]) -> None:
    source, results = topics
    start, end = WINDOWS[1]
    progress = io.StringIO()
    run = BackfillRun(_settings(broker, source, results), start=start, end=end, out=progress,
                      progress_seconds=0.0)
    tally = run.run()
    assert f"... backfill {run.run_id}: " in progress.getvalue() and "ETA" in progress.getvalue()

    assert run.completed and not run.interrupted
    published = read_topic(broker.bootstrap_servers, results, at_least=PER_WINDOW)
    assert sorted(_ids(published)) == sorted(f"w1-{i}" for i in range(PER_WINDOW))
    for r in published:
        body = json.loads(r.value)
        assert body["backfill"] == {"run": run.run_id, "start": start, "end": end}
        names = {a["name"] for a in body["assessments"]}
        assert names == {"groundedness", "relevance_to_query"}
        assert all(a["judge"]["version"] for a in body["assessments"])
    assert tally.judged == PER_WINDOW
    # Window 0 may be read (a broker that cannot seek by time) but is never judged: skipped, counted.
    assert tally.skipped.get("before_range", 0) == tally.read - PER_WINDOW
    assert tally.judges["groundedness"].verdicts == PER_WINDOW
    assert 0 < tally.judges["groundedness"].passed < PER_WINDOW
    assert "judge groundedness" in tally.render()

    again = BackfillRun(_settings(broker, source, results), start=start, end=end)
    assert again.run_id == run.run_id and again.group_id == run.group_id
    second = again.run()
    assert again.completed and second.judged == 0 and second.resumed > 0
    assert len(read_topic(broker.bootstrap_servers, results, at_least=PER_WINDOW)) == PER_WINDOW


def test_a_stopped_backfill_resumes_where_it_left_off(broker: LocalBroker, topics: tuple[str, str]) -> None:
    source, results = topics
    start, end = WINDOWS[1]
    first = BackfillRun(_settings(broker, source, results), start=start, end=end, judges=["groundedness"],
                        limit=5)
    first.run()
    assert first.interrupted and not first.completed
    stopped_at = first.tally.judged
    assert stopped_at == 5

    rest = BackfillRun(_settings(broker, source, results), start=start, end=end, judges=["groundedness"])
    assert rest.group_id == first.group_id
    rest.run()
    assert rest.completed and rest.tally.resumed > 0
    published = read_topic(broker.bootstrap_servers, results, at_least=PER_WINDOW)
    # Offsets were committed only for acknowledged results: nothing lost, nothing judged twice.
    assert sorted(_ids(published)) == sorted(f"w1-{i}" for i in range(PER_WINDOW))
    assert rest.tally.judged == PER_WINDOW - stopped_at
    assert all([a["name"] for a in json.loads(r.value)["assessments"]] == ["groundedness"] for r in published)


def test_the_command_stops_with_130_and_the_resume_command_then_finishes(
        broker: LocalBroker, topics: tuple[str, str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source, results = topics
    config = tmp_path / "tracejudge.yaml"
    config.write_text(json.dumps({"stream": {"topics": [f"{source}:agent_eval"], "results_topic": results},
                                  "judges": {}}))
    argv = ["--from", "2025-11-20T08:03:20Z", "--to", str(BASE + 300), "--config", str(config),
            "--bootstrap-servers", broker.bootstrap_servers, "--judges", "relevance_to_query"]
    parser = argparse.ArgumentParser()
    backfill.add_arguments(parser)
    stop = threading.Event()
    stop.set()  # what Ctrl-C does: the run commits what it published and reports
    assert backfill.main(parser.parse_args(argv), stop_event=stop) == 130
    err = capsys.readouterr().err
    assert "resume with the same command" in err
    resume = err.split("resume with the same command:\n", 1)[1].strip()
    assert resume.startswith("tracejudge backfill --from 2025-11-20T08:03:20.000Z")

    assert cli.main(resume.split()[1:]) == 0
    err = capsys.readouterr().err
    assert "summary" in err and "judge relevance_to_query" in err and "results published" in err
    published = read_topic(broker.bootstrap_servers, results, at_least=PER_WINDOW)
    assert sorted(_ids(published)) == sorted(f"w2-{i}" for i in range(PER_WINDOW))


def test_bad_arguments_are_reported_not_raised(broker: LocalBroker, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tracejudge.yaml"
    config.write_text(json.dumps({"stream": {"topics": ["in"], "results_topic": "out"}, "judges": {}}))
    base = ["backfill", "--config", str(config), "--bootstrap-servers", broker.bootstrap_servers]
    assert cli.main([*base, "--from", "yesterday-ish"]) == 2
    assert "is not a time" in capsys.readouterr().err
    assert cli.main([*base, "--from", "2h", "--judges", "nope"]) == 2
    assert "--judges: nope (configured: groundedness, relevance_to_query)" in capsys.readouterr().err
    assert cli.main([*base, "--from", "2h", "--to", "3h"]) == 2
    assert "--to must be after --from" in capsys.readouterr().err
    with pytest.raises(BackfillError, match="no judges"):
        BackfillRun(settings(broker.bootstrap_servers, ["in"], stream__results_topic="out"), start=0.0)


def test_times_and_run_ids() -> None:
    assert parse_time("2025-11-20T08:00:00Z") == BASE == parse_time("2025-11-20T08:00:00")
    assert parse_time(str(BASE)) == BASE
    assert parse_time("6h", now=BASE) == BASE - 6 * 3600
    # The run id is the range and the judges: the same command resumes, another range is another run.
    assert run_id(["a"], BASE, None, ["x", "y"]) == run_id(["a"], BASE, None, ["y", "x"])
    assert run_id(["a"], BASE, None, ["x"]) != run_id(["a"], BASE, BASE + 1, ["x"])


def test_otlp_spans_split_over_records_are_assembled_as_the_stream_does(broker: LocalBroker) -> None:
    from support.otel_producers import Producer, genai_trace, kafka_messages

    bootstrap = broker.bootstrap_servers
    source, results = unique("backfill-otlp"), unique("backfill-otlp-out")
    service = Producer("geo-agent")
    traces: list[list[str]] = []
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    try:
        futures = []
        for w, (start, _) in enumerate(WINDOWS[:2]):
            recorded = [genai_trace(service.tracer, f"Capital of {w}-{i}?", f"City {w}-{i}.")
                        for i in range(2)]
            traces.append([r.trace_id for r in recorded])
            # Two spans a record: no trace sits in one record, as with the Collector's exporter.
            for n, (_, value) in enumerate(kafka_messages(service.finished(), per_message=2)):
                futures.append(producer.send(source, value=value, timestamp_ms=int((start + n) * 1000)))
        producer.flush(timeout=30)
        for f in futures:
            f.get(timeout=30)
    finally:
        producer.close(timeout=5)
    run = BackfillRun(settings(bootstrap, [f"{source}:otlp_proto"], stream__results_topic=results, judges={}),
                      start=WINDOWS[1][0], end=WINDOWS[1][1])
    run.run()
    assert run.completed
    published = [json.loads(r.value) for r in read_topic(bootstrap, results, at_least=2)]
    assert sorted(r["trace_id"] for r in published) == sorted(traces[1])
    assert all(r["backfill"]["run"] == run.run_id and r["request"].startswith("Capital of 1-")
               for r in published)
