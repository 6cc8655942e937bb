"""From a page to its cause, end to end (issue 26, item 7): the demo's planted causes through the stream.

Each plant: the demo agent's seeded traces are produced to a topic on the real Tansu broker by the
demo's own producer (`TraceProducer`), `tracejudge run` (a process, the demo's evaluation settings from
`evaluation_overrides`: heuristic judges, no model) writes the results topic, `tracejudge findings run`
(a process, its own group, a sliding 120 s window that slides every 5 s) writes the findings topic, and
the last window that holds every result must name exactly the planted cause for the groundedness judge:

    stale-doc            doc_uri    = STALE_DOC_URI    from the first trace    (400 traces)
    failing-tool         tool_error = FAILING_TOOL     from the first trace    (400 traces)
    ungrounded-release   version    = RELEASE_VERSION  after 300 of 600 traces (a release needs a
                                                        previous one to be contrasted with)

For each plant the full chain runs: besides run and findings, the MLflow sink (`tracejudge sink
mlflow`) writes the verdicts onto the traces the agent exported to a real `mlflow server`, and a real
Prometheus scrapes `tracejudge run` with the shipped rules rendered for that MLflow (`render_rules`) and
shortened to a fast clock (`deploy/prometheus/shorten.py`: 1 h -> 30 s, 1 d -> 2 min, `for: 0s`, minimum
counts 3). The plant's alert - GroundednessDropped for stale-doc and failing-tool, ReleaseRegressed (the
new release against the previous one, both inside the shortened day) for ungrounded-release - must fire
for support-bot's groundedness, and its `traces_url`, translated as MLflow 3.17's traces view does
(`ui_filter`), must find exactly support-bot's failing groundedness traces: the link's window holds the
whole test, so that is every one of them, and no other app's, no passing one.
"""

from __future__ import annotations

import io
import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from support.deploy_files import RULES, deploy_module
from support.kafka import RunnerProcess, read_topic, shared_broker, unique, wait_until
from support.mlflow_server import shared_mlflow_server
from support.prometheus_stack import PrometheusServer
from test_alert_links_mlflow import search, ui_filter

from tracejudge.consumer.commands.findings import read_results
from tracejudge.consumer.config.alert_rules import render_rules
from tracejudge.consumer.config.alerts import AlertsSettings
from tracejudge.consumer.demo.agent import (
    APP_TAG,
    FAILING_TOOL,
    RELEASE_VERSION,
    STALE_DOC_URI,
    AgentSettings,
)
from tracejudge.consumer.demo.command import (
    DEFAULT_FAILURE_SHARE,
    DEFAULT_FRUSTRATED_SHARE,
    DEFAULT_UNGROUNDED_SHARE,
)
from tracejudge.consumer.demo.embedded import evaluation_overrides
from tracejudge.consumer.demo.producer import TraceProducer
from tracejudge.schemas.result import EvaluationResult, mlflow_trace_id

JUDGE = "groundedness"
APP = "support-bot"
HEALTHY = {"ungrounded_share": DEFAULT_UNGROUNDED_SHARE, "failure_share": DEFAULT_FAILURE_SHARE,
           "frustrated_share": DEFAULT_FRUSTRATED_SHARE, "concurrent_conversations": 8}
# plant -> (seed, AgentSettings field, after, traces, the finding it must give, the alert it must fire).
# A seed per plant: the agent's trace ids are seeded too, and MLflow's trace ids are global across the
# shared server's experiments (a second run of a seed would land on the first run's traces).
PLANTS = {
    "stale-doc": (261, "stale_doc_after", 0, 400, ("doc_uri", STALE_DOC_URI), "GroundednessDropped"),
    "failing-tool": (262, "failing_tool_after", 0, 400, ("tool_error", FAILING_TOOL), "GroundednessDropped"),
    "ungrounded-release": (264, "ungrounded_release_after", 300, 600, ("version", RELEASE_VERSION),
                           "ReleaseRegressed"),
}


def nested(dotted: dict[str, Any]) -> dict[str, Any]:
    """`load_settings` overrides (`stream.app_tag: ...`) as the nested mapping of a config file."""
    out: dict[str, Any] = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


@contextmanager
def process(bootstrap: str, *args: str, command: tuple[str, ...] = ("run",)) -> Iterator[RunnerProcess]:
    """A tracejudge process, ready; stopped with SIGTERM (and its exit status checked) on the way out."""
    proc = RunnerProcess(bootstrap, *args, command=command)
    try:
        proc.wait_ready()
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.signal(signal.SIGTERM)
        try:
            code = proc.finish(timeout=60)
        finally:
            proc.kill()
        assert code == 0, proc.log[-3000:]


def produce(bootstrap: str, topic: str, settings: AgentSettings, count: int, rate: float) -> int:
    """The demo's producer at `rate` until it has sent `count` traces (then its clean stop finishes the
    open conversations, a few more); returns how many it sent."""
    producer = TraceProducer(bootstrap, topic, rate, settings)
    producer.start()
    try:
        wait_until(lambda: producer.snapshot().produced >= count or producer.error is not None,
                   count / rate * 4 + 60, message=f"{count} traces produced")
    finally:
        producer.stop()
        producer.join(timeout=60)
    assert producer.error is None, producer.error
    stats = producer.snapshot()
    assert stats.send_errors == 0, stats.last_send_error
    return stats.produced


def results_of(bootstrap: str, topic: str, count: int) -> list[EvaluationResult]:
    records = read_topic(bootstrap, topic, at_least=count, timeout=180)
    return list(read_results(io.BytesIO(b"\n".join(r.value for r in records)), topic, 1 << 26))


def failing_traces(results: list[EvaluationResult], app: str) -> set[str]:
    """The MLflow trace ids of `app`'s results the groundedness judge failed."""
    return {mlflow_trace_id(r.record) for r in results if r.record.app == app
            and any(a.name == JUDGE and a.passed is False for a in r.assessments)}


def last_complete_window(bootstrap: str, topic: str, finder: RunnerProcess, results: int) -> list[dict]:
    """The findings of the first window closed after the stage had counted every result: the topic is
    read once the stage's windows counter has moved past the value it had then."""
    wait_until(lambda: finder.metric("tracejudge_findings_records_total", outcome="ok") >= results, 180,
               message=lambda: f"{results} results in the findings stage; log:\n{finder.log[-2000:]}")
    closed = finder.metric("tracejudge_findings_windows_total")
    wait_until(lambda: finder.metric("tracejudge_findings_windows_total") > closed, 60,
               message="a window closed after the last result")
    found = [orjson.loads(r.value) for r in read_topic(bootstrap, topic, at_least=1, timeout=60)]
    last = max(f["window"]["end"] for f in found)
    return [f for f in found if f["window"]["end"] == last]


def traces_link_finds(prom: PrometheusServer, alertname: str, url: str, experiment: str,
                      expected: set[str]) -> None:
    """`alertname` fires for APP's groundedness, and its traces link finds exactly `expected` in MLflow."""

    def firing() -> list[dict[str, Any]]:
        return [a for a in prom.firing(alertname) if a["labels"]["app"] == APP
                and a["labels"]["judge"] == JUDGE]

    (alert,) = wait_until(firing, 120, message=f"{alertname} firing for {APP}")
    traces_url = alert["annotations"]["traces_url"]
    assert traces_url.startswith(f"{url}/#/experiments/{experiment}/traces?")
    linked, filter_string = ui_filter(traces_url)
    assert linked == experiment
    assert f"tags.{APP_TAG} = '{APP}'" in filter_string
    assert f"feedback.`{JUDGE}` = 'no'" in filter_string
    # The sink writes asynchronously: wait until MLflow holds every failing verdict, then compare.
    found: set[str] = set()

    def complete() -> bool:
        found.clear()
        found.update(search(url, experiment, filter_string))
        return found >= expected

    try:
        wait_until(complete, 120, message="the failing verdicts in MLflow")
    except AssertionError as exc:
        by_verdict = search(url, experiment, f"feedback.`{JUDGE}` = 'no'")
        by_app = search(url, experiment, f"tags.{APP_TAG} = '{APP}'")
        raise AssertionError(f"{exc}: missing {len(expected - found)}, extra {len(found - expected)}; "
                             f"failing verdicts in MLflow {len(by_verdict)}, traces tagged {APP} "
                             f"{len(by_app)}; filter {filter_string}") from None
    assert found == expected


def rules_for(tmp_path: Path, url: str, experiment: str) -> Path:
    """The shipped rules with their links rendered for this MLflow experiment, on the fast clock."""
    alerts = AlertsSettings(trace_search={"kind": "mlflow", "mlflow": {
        "tracking_url": url, "experiment_id": experiment, "app_tag": APP_TAG}})
    rendered = tmp_path / "rules.yml"
    rendered.write_text(render_rules(RULES.read_text(), alerts))
    shorten = deploy_module("prometheus/shorten.py")
    return shorten.shorten_file(rendered, tmp_path / "fast.rules.yml", shorten.FAST_CLOCK, for_="0s",
                                min_count=3, interval="1s")


def write_config(path: Path, config: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


@pytest.mark.parametrize("plant", list(PLANTS))
def test_the_page_leads_to_exactly_the_planted_cause(tmp_path: Path, plant: str) -> None:
    seed, field, after, count, cause, alertname = PLANTS[plant]
    bootstrap = shared_broker().bootstrap_servers
    traces, results_topic = unique("p2c-traces"), unique("p2c-results")
    findings_topic = unique("p2c-findings")
    server = shared_mlflow_server()
    experiment = server.create_experiment(unique("page-to-cause"))
    agent = AgentSettings(seed=seed, **HEALTHY, **{field: after}, mlflow_tracking_uri=server.url,
                          mlflow_experiment_id=experiment)
    demo = nested(evaluation_overrides())  # the app and version tags, the heuristic judges
    run_config = {**demo, "kafka": {"group_id": unique("p2c-run")}, "stream": {
        **demo.get("stream", {}), "topics": [{"name": traces, "format": "mlflow"}],
        "results_topic": results_topic, "dead_letter_topic": unique("p2c-dead")}}
    sink_config = {"sink": {"results_topic": results_topic, "group_id": unique("p2c-sink"),
                            "mlflow": {"tracking_uri": server.url}}}
    findings_config = {"findings": {"window_s": 120, "slide_s": 5, "input_topic": results_topic,
                                    "findings_topic": findings_topic}}
    with ExitStack() as stack:
        stack.enter_context(process(bootstrap, "--config", write_config(tmp_path / "sink.yaml", sink_config),
                                    command=("sink", "mlflow")))
        runner = stack.enter_context(process(bootstrap, "--config",
                                             write_config(tmp_path / "run.yaml", run_config)))
        finder = stack.enter_context(process(
            bootstrap, "run", "--config", write_config(tmp_path / "findings.yaml", findings_config),
            "--group-id", unique("p2c-findings"), command=("findings",)))
        rules = rules_for(tmp_path, server.url, experiment)
        prom = stack.enter_context(PrometheusServer(tmp_path / "prometheus", rule_files=[rules],
                                                    targets=[f"127.0.0.1:{runner.port}"]))
        wait_until(lambda: [s for s in prom.query("up") if s["value"][1] == "1"], 60,
                   message="Prometheus scraping tracejudge run")
        # Paced: Prometheus sees the verdicts arrive over several scrapes, as rates need.
        produced = produce(bootstrap, traces, agent, count, rate=25.0)
        results = results_of(bootstrap, results_topic, produced)
        assert len(results) == produced

        window = last_complete_window(bootstrap, findings_topic, finder, produced)
        grounded = [f for f in window if f["judge"] == JUDGE]
        shown = [(f["app"], f["dimension"], f["value"], f["failing"], f["total"], f["lift_interval"])
                 for f in window]
        # Exactly the cause, once per app it touched, ranked first and clearing the threshold.
        assert grounded and {(f["dimension"], f["value"]) for f in grounded} == {cause}, shown
        assert len({f["app"] for f in grounded}) == len(grounded), shown
        for f in grounded:
            assert f["rank"] == 1 and f["conditioned_on"] == [], f
            assert f["lift_interval"][0] > 1.0 and f["failing"] >= 5, f
            assert f["window_total"] == sum(
                1 for r in results if r.record.app == f["app"]
                and any(a.name == JUDGE and a.passed is not None for a in r.assessments)), f
        traces_link_finds(prom, alertname, server.url, experiment, failing_traces(results, APP))
