"""The findings stage (`tracejudge findings run`) on the real broker: results in, each window's findings
out on the findings topic (JSON lines keyed by app/judge) and in /metrics (top K, with an exemplar),
series removed when their finding drops out, bad records counted."""

from __future__ import annotations

import orjson
from support.clock import FakeClock
from support.kafka import FAST_GROUP, produce, read_topic, scrape, unique, value, wait_until
from test_findings import planted

from tracejudge.consumer.config import load_settings
from tracejudge.consumer.stages.findings import FindingsRunner, Windows
from tracejudge.schemas.session import SESSION_KIND

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def test_a_sliding_window_spans_its_panes_and_forgets_the_oldest() -> None:
    s = load_settings(environ={}, require_topics=False, overrides={
        "findings.window_s": 60, "findings.slide_s": 20, "stream.results_topic": "r"})
    windows = Windows(s, 1000.0)
    for r in planted(2):
        windows.add(r)
    assert not windows.due(1019.9) and windows.due(1020.0)
    _, first = windows.close(1020.0)
    assert first and all(f.window_start == 1000.0 and f.window_end == 1020.0 for f in first)
    _, second = windows.close(1040.0)  # the planted pane is still inside the 60 s window
    assert [(f.dimension, f.value, f.failing) for f in second] == \
        [(f.dimension, f.value, f.failing) for f in first]
    assert all(f.window_start == 1000.0 and f.window_end == 1040.0 for f in second)
    windows.close(1060.0)
    _, gone = windows.close(1080.0)  # three empty panes later the planted one has slid out
    assert gone == []
    # An idle stretch longer than the window skips ahead instead of closing every pane it missed.
    windows.close(5000.0)
    assert len(windows.panes) <= 3 and windows.pane_end == 5020.0


def test_results_in_findings_out_on_the_topic_and_in_metrics(broker) -> None:
    bs = broker.bootstrap_servers
    results, findings_topic = unique("results"), unique("findings")
    s = load_settings(environ={}, require_topics=False, overrides={
        "kafka.bootstrap_servers": bs, "http.port": 0, "http.bind_address": "127.0.0.1", **FAST_GROUP,
        "findings.input_topic": results, "findings.findings_topic": findings_topic,
        "findings.group_id": unique("findings"), "findings.window_s": 60, "findings.top_k": 2})
    lines = [r.to_json() for r in planted(5)]
    session_line = orjson.dumps({"schema_version": 3, "kind": SESSION_KIND, "session_id": "s1",
                                 "user_id": None, "app": "shop", "status": "complete",
                                 "close_reason": "inactivity", "turns": [], "started_at": None,
                                 "ended_at": None, "assessments": []})
    produce(bs, results, [*lines, b"not json", session_line])
    clock = FakeClock(1_800_000_000.0)
    runner = FindingsRunner(s, clock=clock)
    runner.start()
    try:
        def metric(name: str, **labels: str) -> float:
            return runner.registry.get_sample_value(name, labels) or 0.0

        wait_until(lambda: metric("tracejudge_findings_records_total", outcome="ok") == len(lines), 60,
                   message="every result counted")
        wait_until(lambda: metric("tracejudge_findings_records_total", outcome="skipped") == 1, 30,
                   message="the session line set aside")
        assert metric("tracejudge_findings_records_total", outcome="invalid") == 1
        assert metric("tracejudge_findings_verdicts_total", outcome="passed") + \
            metric("tracejudge_findings_verdicts_total", outcome="failed") == len(lines)
        assert metric("tracejudge_findings_windows_total") == 0  # the window is still open
        clock.now += 60
        wait_until(lambda: metric("tracejudge_findings_windows_total") == 1, 30, message="the window closes")

        published = read_topic(bs, findings_topic, at_least=2)
        found = [orjson.loads(r.value) for r in published]
        assert {r.key for r in published} == {b"shop/correctness"}
        assert [f["rank"] for f in found] == [1, 2]  # top_k 2
        assert all(f["kind"] == "finding" and f["lift_interval"][0] > 1 for f in found)
        assert all(f["window"] == {"start": 1_800_000_000.0, "end": 1_800_000_060.0} for f in found)
        planted_values = {("doc_uri", "docs://kb/doc-7"), ("tool", "search_v2"), ("version", "2.0")}
        assert {(f["dimension"], f["value"]) for f in found} <= planted_values

        text = scrape(runner.http_port).text
        for f in found:
            labels = {"app": "shop", "judge": "correctness", "dimension": f["dimension"], "value": f["value"]}
            assert abs(value(text, "tracejudge_failure_concentration", **labels) - f["lift"]) < 1e-5
            assert abs(value(text, "tracejudge_failure_concentration_lower", **labels)
                       - f["lift_interval"][0]) < 1e-5
            assert value(text, "tracejudge_failure_concentration_failing", **labels) == f["failing"]
            assert value(text, "tracejudge_failure_concentration_failures_total", **labels) == f["failing"]
        assert len([line for line in text.splitlines()
                    if line.startswith("tracejudge_failure_concentration{")]) == 2
        exposed = scrape(runner.http_port, OPENMETRICS).text
        exemplars = [line for line in exposed.splitlines()
                     if line.startswith("tracejudge_failure_concentration_failures_total{") and "# {" in line]
        assert len(exemplars) == 2 and all('trace_id="t' in line for line in exemplars)

        # A window without results: the findings drop out and their series go.
        clock.now += 60
        wait_until(lambda: metric("tracejudge_findings_windows_total") == 2, 30, message="the next window")
        assert "tracejudge_failure_concentration{" not in scrape(runner.http_port).text
    finally:
        runner.stop()
        assert runner.join(60)
    assert runner.error is None
