"""End to end: Kafka -> `tracejudge run` -> Prometheus (the shipped rules) -> Alertmanager -> webhook.

Everything is real and on loopback: the Tansu broker, `tracejudge run` as a process with the heuristic
groundedness judge (and an LLM judge against an OpenAI-compatible stub, so judge tokens and errors
exist), Debian's Prometheus and Alertmanager, and a webhook receiver in this process. Traffic comes from
the synthetic agent traced with real MLflow, plus OpenTelemetry SDK traces on an otlp_proto topic.

Prometheus loads a fast-clock copy of deploy/prometheus/rules/tracejudge.rules.yml derived by
deploy/prometheus/shorten.py (1 h -> 30 s, 1 d -> 2 min, `for: 0s`, minimum 3 verdicts) and
Alertmanager the shipped config with the webhook pointed here. The app answers from its documents
first: the alert must stay quiet, and every dashboard query must return data. Then it starts making
answers up: GroundednessDropped must reach the webhook.
"""

from __future__ import annotations

import itertools
import signal
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml
from kafka import KafkaProducer
from support.deploy_files import (
    FINDINGS_METRICS,
    FLEET_SPEND_METRICS,
    RULES,
    SESSION_METRICS,
    SINK_METRICS,
    deploy_module,
    family_of,
    rule_groups,
    slo_recording_rules,
)
from support.kafka import RunnerProcess, agent_traces, shared_broker, unique
from support.openai_stub import OpenAIStub, Reply, StubRequest
from support.otel_producers import Producer, genai_trace, kafka_messages
from support.prometheus_stack import (
    AlertmanagerServer,
    PrometheusServer,
    WebhookReceiver,
    alertmanager_config,
    wait_until,
)

from tracejudge.consumer.demo.agent import APP_TAG

APP = "support-bot"
# Dashboard queries run with these: the scrape is 1 s, so 15 s holds a dozen samples, and the
# "same hour yesterday" panel looks 20 s back instead of a day.
RATE_INTERVAL = "15s"
DASHBOARD_CLOCK = {"15s": "15s", "1d": "20s"}


class Traffic:
    """Produces until stopped, in a background thread: agent traces (grounded, or after `make_up()`
    ungrounded), an OTLP trace every 4th tick and a malformed record every 25th. Bounded in count."""

    def __init__(self, bootstrap: str, mlflow_topic: str, otlp_topic: str, *, rate: float = 8.0,
                 limit: int = 4000) -> None:
        self.grounded = agent_traces(60, seed=3, ungrounded_share=0.0, failure_share=0.1, apps=(APP,))
        self.ungrounded = agent_traces(60, seed=4, ungrounded_share=1.0, failure_share=0.1, apps=(APP,))
        otel = Producer("geo-agent")
        for i in range(12):
            genai_trace(otel.tracer, f"What is the capital of France? ({i})",
                        "Paris is the capital of France.")
        self.otlp = kafka_messages(otel.finished(), per_message=4, by_trace_id=True)
        # A tool the agent calls: `trajectory_single_tool_use` on it gives every trace a computed ratio.
        self.tool = next(tool for trace in self.grounded for tool in trace.tools)
        self.topics = (mlflow_topic, otlp_topic)
        self.interval, self.limit = 1.0 / rate, limit
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
        self.sent = 0
        self._ungrounded = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def make_up(self) -> None:
        self._ungrounded.set()

    def _run(self) -> None:
        mlflow_topic, otlp_topic = self.topics
        grounded, ungrounded, otlp = (itertools.cycle(x) for x in (self.grounded, self.ungrounded, self.otlp))
        # Event.wait paces the producer; it synchronises nothing in the test.
        for tick in range(self.limit):
            if self._stop.wait(self.interval):
                return
            trace = next(ungrounded if self._ungrounded.is_set() else grounded)
            self.producer.send(mlflow_topic, key=trace.trace_id.encode(), value=trace.payload)
            if tick % 4 == 0:
                key, value = next(otlp)
                self.producer.send(otlp_topic, key=key, value=value)
            if tick % 25 == 0:
                self.producer.send(mlflow_topic, value=b'{"not": "a trace"')
            self.sent = tick + 1

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.producer.close(timeout=5)


def stub_responder() -> Any:
    """Verdict "yes" with token usage, but every 8th call fails with HTTP 500 (judge errors exist)."""
    calls = itertools.count(1)

    def respond(request: StubRequest) -> Reply:
        return Reply.error(500) if next(calls) % 8 == 0 else Reply.verdict("yes")

    return respond


def runner_config(path: Path, stub: OpenAIStub, topics: tuple[str, str], dead_letters: str,
                  tool: str) -> Path:
    mlflow_topic, otlp_topic = topics
    config = {
        "kafka": {"group_id": unique("e2e-alerting")},
        "stream": {"topics": [{"name": mlflow_topic, "format": "mlflow"},
                              {"name": otlp_topic, "format": "otlp_proto"}],
                   "dead_letter_topic": dead_letters, "app_tag": APP_TAG},
        "otlp": {"assembly": {"quiet_period_s": 0.5, "max_wait_s": 5}},
        "metrics": {"trajectory": {"single_tool_use": tool}},
        "judges": {
            # Priced and capped, so the Cost row's judge panels have data.
            "endpoints": {"stub": {"base_url": stub.base_url, "model": "stub", "max_retries": 0,
                                   "breaker_failure_threshold": 100, "usd_per_day": 1000.0,
                                   "price": {"input_per_mtok": 0.15, "output_per_mtok": 0.6}}},
            "builtin": {"groundedness": {"provider": "heuristic", "sample_rate": 1.0},
                        "relevance_to_query": {"provider": "heuristic", "sample_rate": 1.0},
                        "safety": {"sample_rate": 1.0}},
        },
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# What `tracejudge run` exports only with people's labels or a canary set configured (a calibration
# file, human labels on traces, `judges.canary`); none is part of this test's traffic.
NEEDS_LABELS = {"tracejudge_judge_calibration", "tracejudge_judge_calibration_stale",
                "tracejudge_judge_agreement_total", "tracejudge_judge_labels_total",
                "tracejudge_judge_canary_total"}
# What needs two releases of an app in the traffic (the comparison of the current with the previous);
# this test's traces state one version at most (MLflow records the checkout's commit).
NEEDS_TWO_RELEASES = {"app_judge_version_release:tracejudge_judge_pass_drop:ratio1d",
                      "app_judge_version_release:tracejudge_judge_pass_drop:zscore1d"}


def not_exported_here() -> set[str]:
    """The series no process of this test exports: `tracejudge sink` and `tracejudge sessions`
    metrics (neither runs here), those that need labels (`NEEDS_LABELS`), and the recording rules
    computed from them."""
    promql = deploy_module("grafana/promql.py")
    out = (set(SINK_METRICS) | set(SESSION_METRICS) | set(FINDINGS_METRICS) | set(FLEET_SPEND_METRICS)
           | NEEDS_LABELS | NEEDS_TWO_RELEASES | slo_recording_rules())
    for group in rule_groups():
        for rule in group["rules"]:
            if "record" in rule and {family_of(n) for n in promql.metric_names(rule["expr"])} & out:
                out.add(rule["record"])
    return out


def dashboard_queries() -> dict[str, str]:
    """Every dashboard panel query of `tracejudge run`'s metrics, variables filled and the one-day
    offset shortened. The write-back, conversation and findings panels read `tracejudge sink`,
    `tracejudge sessions` and `tracejudge findings run` metrics, and the fleet-spend panel those of
    `judges.fleet_spend`, the SLO panels the rules `tracejudge slo render` writes; none of them
    runs or is loaded here."""
    promql, shorten = deploy_module("grafana/promql.py"), deploy_module("prometheus/shorten.py")
    skip = not_exported_here()
    return {f"{q.dashboard} / {q.panel} / {q.ref_id}":
            shorten.shorten_expr(q.resolved(RATE_INTERVAL), DASHBOARD_CLOCK)
            for q in promql.all_queries()
            if not {family_of(n) or n for n in promql.metric_names(q.expr)} & skip}


def groundedness(prom: PrometheusServer) -> float | None:
    result = prom.query(f'app_judge:tracejudge_judge_pass:ratio1h{{app="{APP}",judge="groundedness"}}')
    return float(result[0]["value"][1]) if result else None


def test_ungrounded_answers_page_through_the_shipped_rules_and_alertmanager(tmp_path: Path) -> None:
    bootstrap = shared_broker().bootstrap_servers
    topics = (unique("e2e-mlflow"), unique("e2e-otlp"))
    shorten = deploy_module("prometheus/shorten.py")
    rules = shorten.shorten_file(RULES, tmp_path / "fast.rules.yml", shorten.FAST_CLOCK, for_="0s",
                                 min_count=3, interval="1s")

    with OpenAIStub(stub_responder()) as stub, WebhookReceiver() as hook, \
         AlertmanagerServer(alertmanager_config(hook.url), tmp_path / "alertmanager") as am:
        traffic = Traffic(bootstrap, *topics)
        config = runner_config(tmp_path / "tracejudge.yaml", stub, topics, unique("e2e-dead-letters"),
                               traffic.tool)
        runner = RunnerProcess(bootstrap, "--config", str(config))
        try:
            with PrometheusServer(tmp_path / "prometheus", targets=[f"127.0.0.1:{runner.port}"],
                                  rule_files=[rules], alertmanager=am.address) as prom:
                runner.wait_ready()
                with traffic:
                    # Grounded answers: the pass rate is 100% and nothing pages.
                    wait_until(lambda: groundedness(prom) == 1.0, 90, "a 100% groundedness pass rate")
                    missing: list[str] = []

                    def every_dashboard_query_has_data() -> bool:
                        missing[:] = [name for name, expr in dashboard_queries().items()
                                      if not prom.query(expr)]
                        return not missing

                    try:
                        wait_until(every_dashboard_query_has_data, 60, "data for every dashboard query")
                    except AssertionError as exc:
                        raise AssertionError(f"{exc}; empty: {missing}") from None
                    assert groundedness(prom) == 1.0
                    assert not [a for a in prom.firing("GroundednessDropped") if a["labels"]["app"] == APP]
                    assert not hook.alerts(alertname="GroundednessDropped")

                    # The agent starts making answers up: the alert reaches the webhook.
                    traffic.make_up()
                    alerts = wait_until(lambda: hook.alerts(alertname="GroundednessDropped"), 120,
                                        "GroundednessDropped at the webhook")
                    assert traffic.sent > 0

                (alert, *_) = [a for a in alerts if a["labels"]["app"] == APP]
                assert alert["labels"] == {"alertname": "GroundednessDropped", "app": APP,
                                           "judge": "groundedness", "severity": "critical"}
                assert alert["annotations"]["summary"].startswith("Groundedness pass rate ")
                assert alert["annotations"]["summary"].endswith(f" for app {APP}")
                # The links are absolute, filled in by Prometheus at the evaluation that fired.
                notes = alert["annotations"]
                assert notes["runbook_url"].startswith("https://")
                assert notes["runbook_url"].endswith("/runbooks/GroundednessDropped/")
                assert notes["dashboard_url"].startswith("http://localhost:3000/d/tracejudge-quality/?")
                assert f"var-app={APP}&var-judge=groundedness" in notes["dashboard_url"]
                window = parse_qs(urlsplit(urlsplit(notes["traces_url"]).fragment).query)
                assert window["filter"] == ["ASSESSMENT::=::no::groundedness"]
                start, end = (datetime.fromisoformat(window[k][0]) for k in ("startTime", "endTime"))
                assert (end - start).total_seconds() == 4500  # 1h of verdicts + `for: 15m`
                assert abs((datetime.now(UTC) - end).total_seconds()) < 120
                assert alert["generatorURL"].startswith(prom.url)
                assert any(a["labels"]["alertname"] == "GroundednessDropped" for a in am.alerts())
                rate = groundedness(prom)
                assert rate is not None and rate < 0.8

                # Exemplars: a judged trace's id is attached to the score histogram.
                exemplars = prom.query_exemplars('tracejudge_judge_score_bucket{judge="groundedness"}')
                assert any(e["labels"].get("trace_id") for s in exemplars for e in s["exemplars"])
        finally:
            if runner.proc.poll() is None:
                runner.signal(signal.SIGTERM)
            code = runner.finish(timeout=60)
    assert code == 0, runner.log[-3000:]
