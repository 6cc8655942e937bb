"""`tracejudge calibrate`, its statistics, the calibration file and the human-label sources."""

from __future__ import annotations

import io
import json
import random
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from scipy.stats import binomtest
from support import mlflow_apps
from support.mlflow_server import send_otlp, shared_mlflow_server
from support.openai_stub import OpenAIStub, Reply, StubRequest
from support.otel_producers import Producer, genai_trace

from tracejudge.consumer.commands import cli
from tracejudge.consumer.commands.calibrate import judge_every_record
from tracejudge.metrics.judges.config import load_judges_config
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.judges.trust import calibration
from tracejudge.metrics.judges.trust.agreement import (
    MINIMUM_LABELS,
    Agreement,
    Confusion,
    cohen_kappa,
    corrected_rate,
    wilson_interval,
)
from tracejudge.schemas.formats.detect import normalise
from tracejudge.schemas.formats.labels import LabelSet, label_passes
from tracejudge.schemas.result import JudgeIdentity

KIT = Path(__file__).resolve().parents[1] / "metrics" / "judges" / "trust" / "calibration_kit"


# ------------------------------------------------------------------------------------------ statistics
def test_agreement_against_hand_computed_values() -> None:
    # 100 labels: 50 human passes (40 judged pass), 50 human fails (45 judged fail).
    ag = Confusion(tp=40, fn=10, fp=5, tn=45).agreement()
    assert ag.n == 100 and ag.tpr == 0.8 and ag.tnr == 0.9
    assert ag.balanced_accuracy == pytest.approx(0.85)
    # p_o = 0.85; p_e = 0.5 * 0.45 + 0.5 * 0.55 = 0.5; kappa = 0.35 / 0.5 = 0.7;
    # se = sqrt(0.85 * 0.15 / (100 * 0.25)) = 0.0714143; 0.7 +- 1.96 se.
    assert ag.kappa == pytest.approx(0.7)
    assert ag.kappa_interval is not None
    assert ag.kappa_interval.low == pytest.approx(0.56003, abs=1e-4)
    assert ag.kappa_interval.high == pytest.approx(0.83997, abs=1e-4)
    assert ag.enough_labels  # 50 of each class >= MINIMUM_LABELS
    assert Confusion.of([(True, True), (False, True), (False, False)]) == Confusion(tp=1, fn=0, fp=1, tn=1)


def test_wilson_interval_known_values_and_scipy() -> None:
    # 8 of 10: the textbook Wilson interval [0.4902, 0.9433]; 0 of 10: [0, 0.2775].
    i = wilson_interval(8, 10)
    assert i is not None and (round(i.low, 4), round(i.high, 4)) == (0.4902, 0.9433)
    i = wilson_interval(0, 10)
    assert i is not None and i.low == 0.0 and round(i.high, 4) == 0.2775
    assert wilson_interval(0, 0) is None
    for k, n in [(1, 3), (17, 20), (90, 100), (199, 200), (30, 30)]:
        ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        ours = wilson_interval(k, n)
        assert ours is not None
        assert ours.low == pytest.approx(ci.low, abs=1e-9) and ours.high == pytest.approx(ci.high, abs=1e-9)


def test_kappa_edge_cases_and_minimum_labels() -> None:
    assert cohen_kappa(0, 0, 0, 0) == (None, None)
    # Both always said pass: chance agreement is 1, kappa undefined.
    assert cohen_kappa(10, 0, 0, 0) == (None, None)
    # Perfect agreement on both classes.
    kappa, interval = cohen_kappa(5, 0, 0, 5)
    assert kappa == 1.0 and interval is not None and interval.high == 1.0
    # Chance-level judge: kappa 0.
    assert cohen_kappa(25, 25, 25, 25)[0] == pytest.approx(0.0)
    few = Confusion(tp=MINIMUM_LABELS, fn=0, fp=0, tn=MINIMUM_LABELS - 1).agreement()
    assert not few.enough_labels and few.corrected(0.5) is None


def test_corrected_rate_rogan_gladen() -> None:
    # The notes' example: TPR 0.9, TNR 0.8, true rate 0.8 -> observed 0.76 -> corrected 0.8.
    assert corrected_rate(0.76, 0.9, 0.8) == pytest.approx(0.8)
    assert corrected_rate(0.1, 0.9, 0.8) == 0.0  # clipped
    assert corrected_rate(0.99, 0.9, 0.8) == 1.0
    assert corrected_rate(0.5, 0.5, 0.5) is None and corrected_rate(0.5, 0.4, 0.5) is None
    # 10,000 simulated traces, true pass rate 0.8, judge TPR 0.9 / TNR 0.8.
    rng = random.Random(18)
    truth = [rng.random() < 0.8 for _ in range(10_000)]
    judged = [(rng.random() < 0.9) if t else (rng.random() >= 0.8) for t in truth]
    observed = sum(judged) / len(judged)
    corrected = corrected_rate(observed, 0.9, 0.8)
    assert corrected is not None and abs(corrected - 0.8) <= 0.02
    assert abs(observed - 0.8) > 0.02


# ------------------------------------------------------------------------------------------ labels
def test_labels_file_errors_name_their_lines(tmp_path: Path) -> None:
    lines = [
        {"trace_id": "tr-ABC", "judge": "groundedness", "label": "pass"},
        "not json",
        {"request_id": "r1", "judge": "groundedness", "label": "maybe"},
        {"request_id": "r2", "judge": "nonexistent", "label": "fail"},
        {"request_id": "r3", "label": "fail"},
        [1, 2],
        {"request_id": "r4", "judge": "groundedness", "label": 0.2},
        {"request_id": "r5", "judge": "groundedness", "label": 3},
        {"request_id": "r4", "judge": "groundedness", "label": True},
    ]
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n\n"
    labels = LabelSet(judges=frozenset({"groundedness"}))
    added = labels.read_jsonl(io.BytesIO(text.encode()), "labels.jsonl")
    assert added == 3 and len(labels) == 2
    assert labels.problems == {"malformed": 5, "unknown_judge": 1, "conflicting": 1}
    where = [r.split(": ")[0] for r in labels.reported]
    assert where == ["labels.jsonl:2", "labels.jsonl:3", "labels.jsonl:4", "labels.jsonl:5", "labels.jsonl:6",
                     "labels.jsonl:8", "labels.jsonl:9"]
    assert "nonexistent" in labels.reported[2] and "groundedness" in labels.reported[2]
    # "tr-ABC" is the MLflow form of the record's trace id "abc".
    assert labels.labels[("abc", "groundedness")] is True and labels.labels[("r4", "groundedness")] is True
    assert [label_passes(v) for v in ("PASS", "no", False, 1, 0.5, "", None, 1.5)] == \
        [True, False, False, True, True, None, None, None]


def test_human_feedback_read_from_a_real_mlflow_trace() -> None:
    from mlflow.entities import AssessmentSource, Expectation, Feedback, Trace

    trace = Trace.from_json(mlflow_apps.run("rag"))
    tid = trace.info.trace_id
    trace.info.assessments = [
        Feedback(name="groundedness", value="no", trace_id=tid,
                 source=AssessmentSource(source_type="HUMAN", source_id="alice")),
        Feedback(name="relevance_to_query", value=True, trace_id=tid,
                 source=AssessmentSource(source_type="HUMAN", source_id="bob")),
        # A judge's feedback and an expectation are not human labels.
        Feedback(name="safety", value="yes", trace_id=tid,
                 source=AssessmentSource(source_type="LLM_JUDGE", source_id="openai:/gpt-4.1-mini")),
        Expectation(name="expected_response", value="MLflow is a platform.", trace_id=tid,
                    source=AssessmentSource(source_type="HUMAN", source_id="alice")),
    ]
    text = trace.to_json()
    fast = normalise(text.encode())
    general = normalise(orjson.loads(text))  # the dict path, not the msgspec reader
    for record in (fast, general):
        assert record.human_labels is not None
        got = [(h.name, h.value, h.source, h.source_id) for h in record.human_labels]
        assert got == [("groundedness", "no", "HUMAN", "alice"), ("relevance_to_query", True, "HUMAN", "bob")]
        assert record.expected_response == "MLflow is a platform."
    labels = LabelSet(judges=frozenset({"groundedness"}))
    assert labels.read_records([fast]) == 1 and labels.problems == {"unknown_judge": 1}
    assert labels.of(fast, "groundedness") is False
    # No assessments: no labels (and the fast path unchanged).
    assert normalise(mlflow_apps.run("rag").encode()).human_labels is None


def test_human_feedback_read_from_an_mlflow_tracking_server(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """HUMAN feedback logged on a real server's traces (the REST call `mlflow.log_feedback` makes) is
    read by experiment with the mlflow client; a judge's feedback is not a label."""
    server = shared_mlflow_server()
    experiment = server.create_experiment(f"calibrate-{tmp_path.name}")
    producer = Producer("labelled-agent")
    recorded = [genai_trace(producer.tracer, f"What is the capital of France? ({i})", "Paris.")
                for i in range(3)]
    send_otlp(server.url, experiment, producer.finished())
    ids = [f"tr-{r.trace_id}" for r in recorded]
    with server.client() as c:
        for trace_id, (source, value) in zip(ids, [("HUMAN", "pass"), ("HUMAN", False), ("LLM_JUDGE", "yes")],
                                             strict=True):
            r = c.post(f"/api/3.0/mlflow/traces/{trace_id}/assessments", json={"assessment": {
                "assessment_name": "groundedness", "trace_id": trace_id,
                "source": {"source_type": source, "source_id": "reviewer"}, "feedback": {"value": value}}})
            r.raise_for_status()
    labels = LabelSet(judges=frozenset({"groundedness"}))
    assert labels.read_mlflow(server.url, [experiment], page_size=2) == 2
    assert labels.labels == {(recorded[0].trace_id, "groundedness"): True,
                             (recorded[1].trace_id, "groundedness"): False}
    # The command reads them too (here with records that match none of them).
    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps({"request_id": "a", "request": "q", "response": "r"}) + "\n")
    rc, _, err = _run(["calibrate", str(records), "--labels-from-mlflow", server.url,
                       "--experiment", experiment], capsys)
    assert rc == 2 and "no record carries a label" in err


# ------------------------------------------------------------------------------------------ file
def test_calibration_file_round_trip_merge_and_staleness(tmp_path: Path) -> None:
    ident = JudgeIdentity("default", "m", "aaaaaaaaaaaa")
    c = calibration.Calibration.measured("groundedness", ident, Confusion(40, 10, 5, 45).agreement())
    f = calibration.CalibrationFile()
    f.put(c)
    path = tmp_path / "calibration.json"
    calibration.save(path, f)
    other = calibration.CalibrationFile()
    other.put(calibration.Calibration.measured("groundedness", JudgeIdentity("default", "m2", "bbbbbbbbbbbb"),
                                               Confusion(3, 1, 1, 3).agreement()))
    calibration.save(path, other)  # merged, not replaced
    loaded = calibration.load(path)
    assert loaded.get("groundedness", ident) == c
    assert set(loaded.judges["groundedness"]) == {"aaaaaaaaaaaa", "bbbbbbbbbbbb"}
    assert not loaded.stale("groundedness", ident)
    assert loaded.stale("groundedness", JudgeIdentity("default", "m3", "cccccccccccc"))
    assert not loaded.stale("safety", ident)  # never calibrated: unknown, not stale
    assert c.calibrated and c.corrected(0.76) is not None
    assert not loaded.judges["groundedness"]["bbbbbbbbbbbb"].calibrated
    assert loaded.judges["groundedness"]["bbbbbbbbbbbb"].corrected(0.5) is None
    (tmp_path / "bad.json").write_text('{"judges": {"g": {"v": {"n": 1}}}}')
    with pytest.raises(calibration.CalibrationError, match=r"bad.json: judges.g.v: malformed"):
        calibration.load(tmp_path / "bad.json")


def test_calibration_runs_every_labelled_record_with_the_same_fingerprint() -> None:
    config = {"endpoints": {"default": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
              "sample_rate": 0.01, "filters": {"apps": ["shop"]},
              "builtin": {"groundedness": {"sample_rate": 0.1, "filters": {"apps": ["x"]}}},
              "custom": {"tone": {"prompt": "Polite? {response}", "sample_rate": 0.2}}}
    live = JudgeRunner(config)
    opened = JudgeRunner(judge_every_record(load_judges_config(config)))
    assert opened.identities() == live.identities()
    assert opened.config.sample_rate_of("groundedness", opened.config.judge_settings()["groundedness"]) == 1.0
    assert opened.config.sample_rate_of("tone", opened.config.judge_settings()["tone"]) == 1.0


# ------------------------------------------------------------------------------------------ command
def _stub_config(tmp_path: Path, stub: OpenAIStub) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps({"judges": {
        "endpoints": {"default": {"base_url": stub.base_url, "model": "judge-model",
                                  "backoff_initial_seconds": 0.01}},
        "sample_rate": 0.05,  # calibration judges every labelled record anyway
        "builtin": {"groundedness": {}},
    }}))
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_calibrate_reports_a_scripted_judges_error_rates(tmp_path: Path, stub: OpenAIStub,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A judge that answers wrong on a scripted 10% of human passes and 20% of human fails, over 220
    labelled records: calibrate's intervals contain 0.9 and 0.8."""
    rng = random.Random(7)
    wrong: dict[int, bool] = {}
    records, labels = [], []
    for i in range(220):
        human_pass = i < 120
        wrong[i] = rng.random() < (0.1 if human_pass else 0.2)
        records.append({"request_id": f"r{i}", "request": "Where is the office?",
                        "response": f"The office is in room case{i}.",
                        "retrieved_context": [{"content": f"Room case{i} is the office."}]})
        labels.append({"request_id": f"r{i}", "judge": "groundedness",
                       "label": "pass" if human_pass else "fail"})
    # A record without a label is not judged; a label without a record is simply unused.
    records.append({"request_id": "unlabelled", "request": "q", "response": "a case999."})
    labels.append({"request_id": "no-such-record", "judge": "groundedness", "label": "pass"})

    def responder(req: StubRequest) -> Reply:
        i = int(re.search(r"case(\d+)", req.prompt).group(1))  # type: ignore[union-attr]
        says_pass = (i < 120) != wrong[i]
        return Reply.verdicts({1: "yes" if says_pass else "no"})

    stub.responder = responder
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "{broken\n")
    (tmp_path / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in labels))
    out_file = tmp_path / "calibration.json"
    argv = ["calibrate", str(tmp_path / "records.jsonl"), "--labels", str(tmp_path / "labels.jsonl"),
            "--config", str(_stub_config(tmp_path, stub))]
    rc, out, err = _run([*argv, "-o", str(out_file)], capsys)
    assert rc == 0, err
    assert stub.count("/chat/completions") == 220
    assert "records.jsonl:222: rejected" in err
    entry = json.loads(out_file.read_text())["judges"]["groundedness"]
    (version, c), = entry.items()
    assert c["n"] == 220 and c["calibrated"] is True and c["model"] == "judge-model"
    assert c["tp"] + c["fn"] == 120 and c["tn"] + c["fp"] == 100
    assert c["fn"] == sum(wrong[i] for i in range(120)) and c["fp"] == sum(wrong[i] for i in range(120, 220))
    assert c["tpr_interval"][0] <= 0.9 <= c["tpr_interval"][1]
    assert c["tnr_interval"][0] <= 0.8 <= c["tnr_interval"][1]
    assert c["kappa_interval"][0] <= c["kappa"] <= c["kappa_interval"][1]
    assert f"groundedness  (version {version}" in out and "human fail" in out and "calibrated" in out
    assert "221 records read (1 rejected), 220 labelled" in out
    # The gate: this judge's kappa is about 0.7.
    assert _run([*argv, "--min-kappa", "0.5"], capsys)[0] == 0
    rc, _, err = _run([*argv, "--min-kappa", "0.95"], capsys)
    assert rc == 1 and "groundedness: kappa" in err and "below --min-kappa 0.95" in err


def test_calibrate_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps({"request_id": "a", "request": "q", "response": "r"}) + "\n")
    labels = tmp_path / "l.jsonl"
    labels.write_text(json.dumps({"request_id": "a", "judge": "unknown_judge", "label": "pass"}) + "\n")
    rc, _, err = _run(["calibrate", str(records), "--labels", str(labels)], capsys)
    assert rc == 2 and "l.jsonl:1" in err and "no record carries a label" in err
    rc, _, err = _run(["calibrate", str(records), "--labels", str(tmp_path / "missing.jsonl")], capsys)
    assert rc == 2 and "cannot read" in err
    bad_config = tmp_path / "c.yaml"
    bad_config.write_text("judges: {builtin: {nonsense: {}}}\n")
    rc, _, err = _run(["calibrate", str(records), "--labels", str(labels), "--config", str(bad_config)],
                      capsys)
    assert rc == 2 and "judges.builtin.nonsense" in err
    rc, _, err = _run(["calibrate", str(records), "--experiment", "1"], capsys)
    assert rc == 2 and "go together" in err


def test_heuristic_on_the_calibration_kit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The kit is its own labels file; docs/pages/guides/trusting-the-judges.md quotes these figures."""
    kit = KIT / "groundedness.jsonl"
    rows: list[dict[str, Any]] = [json.loads(line) for line in kit.read_text().splitlines()]
    assert len(rows) >= 40
    assert {r["kind"] for r in rows} >= {"grounded", "unsupported", "subtle", "paraphrase"}
    correctness = [json.loads(line) for line in (KIT / "correctness.jsonl").read_text().splitlines()]
    assert len(correctness) >= 30 and all(r["expected_response"] for r in correctness)
    out_file = tmp_path / "cal.json"
    rc, out, err = _run(["calibrate", str(kit), "--labels", str(kit), "-o", str(out_file)], capsys)
    assert rc == 0, err
    (c,) = json.loads(out_file.read_text())["judges"]["groundedness"].values()
    assert (c["n"], c["tp"], c["fn"], c["fp"], c["tn"]) == (44, 14, 2, 9, 19)
    assert c["calibrated"] is False and "NOT calibrated" in out
    ag = Agreement.of(Confusion(c["tp"], c["fn"], c["fp"], c["tn"]))
    assert round(ag.kappa or 0, 2) == 0.51
