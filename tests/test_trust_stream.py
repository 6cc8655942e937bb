"""Judge trust on the stream: calibration gauges and staleness, agreement with labels that come with the
traces (the real `tracejudge run` pipeline, in-process), and the agreement stage joining a labels topic
with the results topic on the real broker (matched, unknown, invalid, and unmatched once the window ends).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest
from support.kafka import FAST_GROUP, produce, read_topic, running, settings, unique, wait_until

from tracejudge.consumer.config import ConfigError, load_settings
from tracejudge.consumer.stages.agreement import AgreementRunner
from tracejudge.consumer.stages.run import StreamRunner
from tracejudge.metrics.judges.trust.agreement import Confusion
from tracejudge.metrics.judges.trust.calibration import Calibration, CalibrationFile, save
from tracejudge.metrics.telemetry.trust import label_passed
from tracejudge.schemas.record import Document, EvalRecord, HumanLabel
from tracejudge.schemas.result import Assessment, EvaluationResult, JudgeIdentity, SourceRef

pytestmark = pytest.mark.timeout(120)

HEURISTIC_JUDGES = {"judges": {"sample_rate": 1.0}}


def calibration(judge: str, version: str, *, tp: int, fn: int, fp: int, tn: int) -> Calibration:
    agreement = Confusion.of([(True, True)] * tp + [(True, False)] * fn + [(False, True)] * fp
                             + [(False, False)] * tn).agreement()
    return Calibration.measured(judge, JudgeIdentity(None, None, version), agreement)


def runner_settings(tmp_path: Path, bootstrap: str = "127.0.0.1:9", **judges: Any) -> Any:
    return settings(bootstrap, [f"{unique('traces')}:agent_eval"], judges=HEURISTIC_JUDGES["judges"] | judges,
                    stream__results_topic=unique("results"))


def gauge(runner: Any, name: str, **labels: str) -> float | None:
    return runner.registry.get_sample_value(name, labels)


def test_calibration_gauges_and_a_stale_judge_from_the_calibration_file(tmp_path, caplog):
    probe = StreamRunner(runner_settings(tmp_path), judges=None)
    versions = {n: i.version for n, i in probe.judges.identities().items()}
    probe.judges.close()
    assert set(versions) == {"groundedness", "relevance_to_query"}
    cal = CalibrationFile()
    cal.put(calibration("relevance_to_query", versions["relevance_to_query"], tp=90, fn=10, fp=12, tn=48))
    cal.put(calibration("groundedness", "000000000000", tp=80, fn=20, fp=10, tn=40))  # another version
    path = tmp_path / "calibration.json"
    save(path, cal)

    with caplog.at_level(logging.WARNING, logger="tracejudge.trust"):
        runner = StreamRunner(runner_settings(tmp_path, calibration_file=str(path)))
    try:
        assert gauge(runner, "tracejudge_judge_calibration", judge="relevance_to_query", stat="tpr") == 0.9
        assert gauge(runner, "tracejudge_judge_calibration", judge="relevance_to_query", stat="tnr") == 0.8
        assert gauge(runner, "tracejudge_judge_calibration", judge="relevance_to_query", stat="n") == 160
        kappa = gauge(runner, "tracejudge_judge_calibration", judge="relevance_to_query", stat="kappa")
        assert kappa is not None and 0.6 < kappa < 0.75
        assert gauge(runner, "tracejudge_judge_calibration_stale", judge="relevance_to_query") == 0
        # The changed judge keeps its old numbers for the dashboard, marked stale, with one line naming it.
        assert gauge(runner, "tracejudge_judge_calibration_stale", judge="groundedness") == 1
        assert gauge(runner, "tracejudge_judge_calibration", judge="groundedness", stat="tpr") == 0.8
        stale_lines = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
        assert len(stale_lines) == 1 and "groundedness" in stale_lines[0]
        assert versions["groundedness"] in stale_lines[0]
    finally:
        runner.judges.close()


def test_too_few_labels_export_only_n_and_an_unreadable_file_is_a_config_error(tmp_path):
    probe = StreamRunner(runner_settings(tmp_path))
    version = probe.judges.identities()["groundedness"].version
    probe.judges.close()
    cal = CalibrationFile()
    cal.put(calibration("groundedness", version, tp=5, fn=1, fp=1, tn=3))
    save(tmp_path / "small.json", cal)
    runner = StreamRunner(runner_settings(tmp_path, calibration_file=str(tmp_path / "small.json")))
    runner.judges.close()
    assert gauge(runner, "tracejudge_judge_calibration", judge="groundedness", stat="n") == 10
    assert gauge(runner, "tracejudge_judge_calibration", judge="groundedness", stat="tpr") is None
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError) as info:
        StreamRunner(runner_settings(tmp_path, calibration_file=str(tmp_path / "bad.json")))
    assert "judges.calibration_file" in info.value.report()


@pytest.mark.parametrize(("value", "passed"), [("pass", True), ("FAIL", False), (True, True), (0.2, False),
                                               (0.9, True), ("maybe", None), (7, None), (None, None),
                                               ("yes", True), ("no", False)])
def test_label_values(value, passed):
    assert label_passed(value) is passed


# -- labels that come with the traces, through `tracejudge run` -----------------------------------------


def labelled_record(i: int, labels: list[HumanLabel]) -> EvalRecord:
    grounded = i % 2 == 0
    context = "The Eiffel Tower is in Paris and is 330 metres tall."
    return EvalRecord(request_id=f"req-{i}", trace_id=f"{i:032x}", app="shop", source_format="agent_eval",
                      request="How tall is the Eiffel Tower?",
                      response="The Eiffel Tower is 330 metres tall." if grounded
                      else "Bananas are rich in potassium and grow in tropical countries.",
                      retrieved_context=[Document(content=context)], human_labels=labels)


def eval_record_handler(payload: bytes, source: SourceRef, ticket: Any, emit: Any) -> None:
    """Decodes the test's records as they are (labels included), so the labels reach the run pipeline
    whatever the source format's own decoder does with them."""
    emit(msgspec.json.decode(payload, type=EvalRecord), source, ticket)


def test_labels_on_traces_are_compared_with_the_verdicts_in_the_run_pipeline(broker, tmp_path):
    s = runner_settings(tmp_path, broker.bootstrap_servers)
    labels = {0: [HumanLabel("groundedness", "pass")], 1: [HumanLabel("groundedness", "pass")],
              2: [HumanLabel("groundedness", "fail"), HumanLabel("relevance_to_query", True)],
              3: [HumanLabel("groundedness", False)], 4: [HumanLabel("no_such_judge", "pass")],
              5: [HumanLabel("groundedness", "perhaps")], 6: [HumanLabel("groundedness", 1.0)]}
    records = [labelled_record(i, labels.get(i, [])) for i in range(8)]
    produce(broker.bootstrap_servers, s.stream.topics[0].name, [msgspec.json.encode(r) for r in records])
    with running(s, handlers={"agent_eval": eval_record_handler}) as runner:
        out = read_topic(broker.bootstrap_servers, s.stream.results_topic, at_least=len(records))
        lines = {line["request_id"]: line for line in (orjson.loads(r.value) for r in out)}
        wait_until(lambda: gauge(runner, "tracejudge_judge_labels_total", outcome="matched") == 6, 60,
                   message="the six comparable labels are matched")
        expected = {"agree": 0.0, "disagree": 0.0}
        for i, ls in labels.items():
            verdicts = {a["name"]: a["passed"] for a in lines[f"req-{i}"]["assessments"]}
            for label in ls:
                human = label_passed(label.value)
                if label.name in verdicts and human is not None and verdicts[label.name] is not None:
                    expected["agree" if human == verdicts[label.name] else "disagree"] += 1
        got = {o: sum(gauge(runner, "tracejudge_judge_agreement_total", app="shop", judge=j, outcome=o) or 0
                      for j in ("groundedness", "relevance_to_query")) for o in ("agree", "disagree")}
        assert got == expected and sum(got.values()) == 6
        # The heuristic judge calls the off-topic answer ungrounded: a person saying "pass" disagrees.
        assert lines["req-1"]["assessments"][0]["passed"] is False
        assert gauge(runner, "tracejudge_judge_labels_total", outcome="unknown_judge") == 1
        assert gauge(runner, "tracejudge_judge_labels_total", outcome="invalid") == 1
        assert gauge(runner, "tracejudge_judge_labels_total", outcome="unmatched") == 0


# -- the agreement stage: a labels topic joined with the results topic ------------------------------------


def result_line(trace: str, app: str, passed: bool, *, shadow: bool = False) -> bytes:
    assessments = [Assessment(name="groundedness", value="yes" if passed else "no", passed=passed)]
    if shadow:
        assessments.append(Assessment(name="groundedness_v2", passed=not passed, shadow_of="groundedness"))
    return EvaluationResult(record=EvalRecord(request_id=f"req-{trace}", trace_id=trace, app=app),
                            source=SourceRef(format="agent_eval"), assessments=assessments).to_json()


def label_line(judge: str, value: Any, *, trace: str | None = None, request: str | None = None) -> bytes:
    body = {"name": judge, "value": value, "source": "reviewer"}
    body |= {"trace_id": trace} if trace else {"request_id": request}
    return json.dumps(body).encode()


def test_the_agreement_stage_joins_labels_and_verdicts_and_counts_the_unmatched(broker):
    bs = broker.bootstrap_servers
    results, labels = unique("results"), unique("labels")
    s = load_settings(environ={}, require_topics=False, overrides={
        "kafka.bootstrap_servers": bs, "http.port": 0, "http.bind_address": "127.0.0.1", **FAST_GROUP,
        "judges": {"sample_rate": 1.0}, "agreement.results_topic": results, "agreement.labels_topic": labels,
        "agreement.group_id": unique("agreement"), "agreement.window_s": 2.0})
    produce(bs, results, [result_line("t1", "shop", True), result_line("t2", "shop", False, shadow=True),
                          result_line("t3", "desk", True), b"not json"])
    produce(bs, labels, [
        label_line("groundedness", "pass", trace="tr-T1"),     # agree (MLflow's spelling of the id)
        label_line("groundedness", "pass", request="req-t2"),  # disagree (by request id)
        label_line("groundedness", "fail", trace="t3"),        # disagree
        label_line("groundedness", "pass", trace="t9"),        # no verdict: unmatched after the window
        label_line("toxicity", "pass", trace="t1"),            # unknown judge
        label_line("groundedness", "sure", trace="t1"),        # invalid value
        b"[1, 2]",                                             # not a label
    ])
    runner = AgreementRunner(s)
    runner.start()
    try:
        def value(name: str, **labels: str) -> float:
            return runner.registry.get_sample_value(name, labels) or 0.0

        wait_until(lambda: value("tracejudge_judge_labels_total", outcome="matched") == 3, 30,
                   message="three labels matched")
        assert value("tracejudge_judge_agreement_total", app="shop", judge="groundedness",
                     outcome="agree") == 1
        assert value("tracejudge_judge_agreement_total", app="shop", judge="groundedness",
                     outcome="disagree") == 1
        assert value("tracejudge_judge_agreement_total", app="desk", judge="groundedness",
                     outcome="disagree") == 1
        assert value("tracejudge_judge_agreement_total", judge="groundedness_v2", app="shop",
                     outcome="agree") == 0
        assert value("tracejudge_judge_labels_total", outcome="unknown_judge") == 1
        assert value("tracejudge_judge_labels_total", outcome="invalid") == 2
        assert value("tracejudge_agreement_records_total", input="results", outcome="invalid") == 1
        wait_until(lambda: value("tracejudge_judge_labels_total", outcome="unmatched") == 1, 60,
                   message="the label without a verdict is counted unmatched once its window ends")
        wait_until(lambda: value("tracejudge_agreement_pending", side="verdict") == 0, 60,
                   message="the verdicts' window ends")
        assert value("tracejudge_agreement_pending", side="label") == 0
    finally:
        runner.stop()
        assert runner.join(60)
    assert runner.error is None


def test_the_join_is_bounded(tmp_path):
    from prometheus_client import CollectorRegistry

    from tracejudge.consumer.stages.agreement import Joiner
    from tracejudge.metrics.telemetry.agreement import AgreementMetrics

    metrics = AgreementMetrics(CollectorRegistry(), max_apps=5, judges=["groundedness"])
    joiner = Joiner(metrics, window_s=10, max_pending=2)
    for i in range(4):
        joiner.add_label(f"t{i}", "groundedness", "pass", now=0.0)
        joiner.add_verdict([f"v{i}"], "shop", "groundedness", True, now=0.0)
    assert len(joiner.labels) == len(joiner.verdicts) == 2
    assert metrics.evicted.labels("label")._value.get() == 2
    assert metrics.evicted.labels("verdict")._value.get() == 2
    assert metrics.trust.labels.labels("unmatched")._value.get() == 2
    joiner.add_verdict(["t3"], "shop", "groundedness", True, now=1.0)   # the label waiting for it
    assert metrics.trust.agreement.labels("shop", "groundedness", "agree")._value.get() == 1
    assert joiner.expire(now=10.5) == 1   # t2's label
    assert metrics.trust.labels.labels("unmatched")._value.get() == 3
    assert joiner.next_expiry() == 11.0
