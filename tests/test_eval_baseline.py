"""`tracejudge eval --fail-if-worse-than BASELINE`: the release gate on a dataset, with a real judge
endpoint and real apps (tests/support/eval_apps.py): a broken release fails against the good release's
baseline, the good release passes against itself, two flipped rows of twelve are noise; the interval's
arithmetic and coverage; a bad or unrelated baseline is exit 2; the GitHub Actions example of the
docs' "Gate a release on a dataset" (docs/pages/guides/gate-a-release.md) parses."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.eval_apps import DATASET, FLIPPED, correctness_responder
from support.openai_stub import OpenAIStub
from support.readme_examples import blocks_of

from tracejudge.metrics.compare import Difference, PairedRuns, newcombe_paired, outcomes, wilson
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef

REPO = Path(__file__).resolve().parents[1]
TRACEJUDGE = [sys.executable, "-m", "tracejudge.consumer.commands.cli"]
APPS = "tests.support.eval_apps"


@pytest.fixture(scope="module")
def judge() -> Iterator[OpenAIStub]:
    with OpenAIStub(correctness_responder) as s:
        yield s


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, judge: OpenAIStub) -> dict[str, Path]:
    """The dataset, the judges' configuration, and the good release's results: the baseline."""
    d = tmp_path_factory.mktemp("release")
    (d / "dataset.jsonl").write_text("".join(json.dumps(r) + "\n" for r in DATASET))
    (d / "judges.yaml").write_text(json.dumps({"judges": {
        "endpoints": {"default": {"base_url": judge.base_url, "model": "judge-model"}},
        "sample_rate": 1.0, "builtin": {"correctness": {}}}}))
    files = {"dataset": d / "dataset.jsonl", "config": d / "judges.yaml", "baseline": d / "baseline.jsonl"}
    proc = run(files, "good_app", "-o", str(files["baseline"]))
    assert proc.returncode == 0, proc.stderr
    return files


def run(files: dict[str, Path], app: str, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}
    return subprocess.run([*TRACEJUDGE, "eval", str(files["dataset"]), "--config", str(files["config"]),
                           "--app", f"{APPS}:{app}", *flags], capture_output=True, text=True, timeout=180,
                          check=False, cwd=REPO, env=env)


def row_of(stderr: str, name: str) -> str:
    return next(line for line in stderr.splitlines() if line.strip().startswith(name + " "))


# ------------------------------------------------------------------ the gate


def test_a_broken_release_fails_against_the_good_baseline(setup, tmp_path):
    proc = run(setup, "broken_app", "-o", str(tmp_path / "new.jsonl"), "--fail-if-worse-than",
               str(setup["baseline"]))
    assert proc.returncode == 1, proc.stderr
    assert "12 rows paired by request (0 only in this run, 0 only in the baseline)" in proc.stderr
    correctness = row_of(proc.stderr, "correctness")
    assert "100.0% (12/12)" in correctness and "0.0% (0/12)" in correctness
    assert correctness.endswith("worse") and "-100.0% [-100.0%, -65.7%]" in correctness
    assert row_of(proc.stderr, "retrieval_hit_rate").endswith("worse")
    assert "correctness: worse than the baseline: -100.0% [-100.0%, -65.7%] on 12 paired rows" in proc.stderr
    assert len((tmp_path / "new.jsonl").read_text().splitlines()) == 12  # the results are written anyway


def test_the_good_release_passes_against_itself(setup, tmp_path):
    proc = run(setup, "good_app", "-o", str(tmp_path / "new.jsonl"), "--fail-if-worse-than",
               str(setup["baseline"]))
    assert proc.returncode == 0, proc.stderr
    assert row_of(proc.stderr, "correctness").split()[-6:] == ["+0.0%", "[-24.2%,", "+24.2%]", "no",
                                                               "significant", "change"]
    assert "baseline gate passed: no judge or metric significantly worse (2 compared)" in proc.stderr


def test_two_flipped_rows_of_twelve_are_noise_not_a_regression(setup, tmp_path):
    proc = run(setup, "mostly_good_app", "-o", str(tmp_path / "new.jsonl"), "--fail-if-worse-than",
               str(setup["baseline"]))
    assert proc.returncode == 0, proc.stderr
    correctness = row_of(proc.stderr, "correctness")
    assert "83.3% (10/12)" in correctness and correctness.endswith("no significant change")
    low, high = (float(x) for x in re.findall(r"([-+]\d+\.\d)%", correctness)[1:3])
    assert low < -16.7 < 0 < high  # the drop is inside an interval that reaches above 0
    assert len(FLIPPED) == 2
    # The same drop with a tolerated margin is still no failure; a demand of no drop at all is the default.
    margin = run(setup, "mostly_good_app", "-o", str(tmp_path / "m.jsonl"), "--fail-if-worse-than",
                 str(setup["baseline"]), "--worse-margin", "0.05")
    assert margin.returncode == 0 and "margin 0.05" in margin.stderr


def test_the_margin_lets_a_bounded_drop_through():
    """Thirty of 300 rows lost (10 points): significant at margin 0, within a 20-point margin."""
    d, low, high = newcombe_paired(270, 0, 30, 0)
    strict = Difference("correctness", 300, 300, 270, d, low, high, margin=0.0)
    lenient = Difference("correctness", 300, 300, 270, d, low, high, margin=0.2)
    assert strict.verdict == "worse" and lenient.verdict == "no significant change"
    assert -0.2 < low < high < 0


def test_app_errors_count_as_failures_against_the_baseline(setup, tmp_path):
    """An app that cannot be reached answers nothing: every row is an app error, each a failure."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEJUDGE_")}
    proc = subprocess.run([*TRACEJUDGE, "eval", str(setup["dataset"]), "--config", str(setup["config"]),
                           "--app-endpoint", "http://127.0.0.1:9/v1", "--app-retries", "0", "-o",
                           str(tmp_path / "new.jsonl"), "--fail-if-worse-than", str(setup["baseline"])],
                          capture_output=True, text=True, timeout=180, check=False, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "12 app errors (connection 12)" in proc.stderr
    assert row_of(proc.stderr, "correctness").endswith("worse")
    assert "0.0% (0/12)" in row_of(proc.stderr, "correctness")


def test_it_composes_with_fail_under(setup, tmp_path):
    proc = run(setup, "mostly_good_app", "-o", str(tmp_path / "new.jsonl"), "--fail-if-worse-than",
               str(setup["baseline"]), "--fail-under", "correctness=0.9")
    assert proc.returncode == 1
    assert "mean score 0.833 is below --fail-under 0.9" in proc.stderr
    assert "baseline gate passed" in proc.stderr


# ------------------------------------------------------------------ bad baselines


def test_a_bad_baseline_line_is_exit_2_naming_the_file_and_line(setup, tmp_path):
    lines = setup["baseline"].read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], lines[1], "{this is not json", *lines[2:]]) + "\n")
    out = tmp_path / "new.jsonl"
    proc = run(setup, "good_app", "-o", str(out), "--fail-if-worse-than", str(bad))
    assert proc.returncode == 2, proc.stderr
    assert f"--fail-if-worse-than {bad}:3: not JSON" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()  # refused before the app was called or anything written
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(lines[0] + "\n" + json.dumps({"schema_version": 6, "assessments": "many"}) + "\n")
    proc = run(setup, "good_app", "-o", str(out), "--fail-if-worse-than", str(wrong))
    assert proc.returncode == 2 and f"{wrong}:2: not a tracejudge eval result line" in proc.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = run(setup, "good_app", "-o", str(out), "--fail-if-worse-than", str(empty))
    assert proc.returncode == 2 and "no result lines" in proc.stderr
    missing = run(setup, "good_app", "-o", str(out), "--fail-if-worse-than", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_a_baseline_over_other_requests_is_exit_2_no_overlap(setup, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(
        json.dumps({**json.loads(line), "request": "Something else entirely?"}) + "\n"
        for line in setup["baseline"].read_text().splitlines()[:1]))
    proc = run(setup, "good_app", "-o", str(tmp_path / "new.jsonl"), "--fail-if-worse-than", str(other))
    assert proc.returncode == 2, proc.stderr
    assert "no overlap: none of its 1 results has a request of this run's 12" in proc.stderr


def test_the_output_may_not_be_the_baseline_and_margin_needs_a_baseline(setup, tmp_path):
    copy = tmp_path / "baseline.jsonl"
    copy.write_bytes(setup["baseline"].read_bytes())
    before = copy.read_bytes()
    proc = run(setup, "good_app", "-o", str(copy), "--fail-if-worse-than", str(copy))
    assert proc.returncode == 2 and copy.read_bytes() == before
    alone = run(setup, "good_app", "--worse-margin", "0.1")
    assert alone.returncode == 2 and "--worse-margin applies to --fail-if-worse-than" in alone.stderr
    bad = run(setup, "good_app", "--fail-if-worse-than", str(copy), "--worse-margin", "5")
    assert bad.returncode == 2 and "expected a proportion from 0 to 1" in bad.stderr


# ------------------------------------------------------------------ the statistics


def test_wilson_and_newcombe_on_values_worked_by_hand():
    # Wilson 0/10: (0, z^2/(n+z^2)) = (0, 0.2775).
    assert wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    # All 12 rows lost (a margin is empty, so phi = 0): p1 = 0, p2 = 1, u1 - p1 = p2 - l2 = 0.2425, so
    # high = d + sqrt((u1 - p1)^2 + (p2 - l2)^2) = -1 + sqrt(2) * 0.2425 = -0.6571.
    d, low, high = newcombe_paired(0, 0, 12, 0)
    assert (d, low) == (-1.0, -1.0)
    assert high == pytest.approx(-1 + 2 ** 0.5 * (1 - wilson(12, 12)[0]), abs=1e-9)
    assert high == pytest.approx(-0.6571, abs=1e-4)
    # No change on rows that all pass: symmetric about 0.
    d, low, high = newcombe_paired(12, 0, 0, 0)
    assert d == 0 and low == pytest.approx(-high) and high == pytest.approx(1 - wilson(12, 12)[0])
    # The interval widens as the pairs disagree more, for the same difference.
    narrow = newcombe_paired(40, 0, 4, 6)
    wide = newcombe_paired(26, 10, 14, 0)
    assert narrow[0] == pytest.approx(wide[0]) and narrow[2] - narrow[1] < wide[2] - wide[1]


def test_newcombe_paired_covers_the_true_difference_about_95_percent_of_the_time():
    """Simulated paired runs of 30 rows with known pass probabilities: the 95% interval holds the true
    difference in at least 93% of 2,000 runs in every scenario (Newcombe reports coverage near 95%)."""
    rng = random.Random(20261127)
    # P(both), P(new only), P(baseline only), P(neither)
    scenarios = [(0.70, 0.05, 0.15, 0.10), (0.45, 0.10, 0.10, 0.35), (0.85, 0.02, 0.08, 0.05)]
    for cells in scenarios:
        truth = cells[1] - cells[2]
        covered = 0
        for _ in range(2000):
            table = [0, 0, 0, 0]
            for _ in range(30):
                table[_draw(rng, cells)] += 1
            _, low, high = newcombe_paired(*table)
            covered += low <= truth <= high
        assert covered / 2000 >= 0.93, (cells, covered)


def _draw(rng: random.Random, cells: tuple[float, ...]) -> int:
    x, acc = rng.random(), 0.0
    for i, p in enumerate(cells):
        acc += p
        if x < acc:
            return i
    return len(cells) - 1


def _result(request: str, *, passed: bool | None = True, failed: bool = False, shadow: bool = False,
            skipped: str | None = None) -> EvaluationResult:
    assessments = [Assessment("correctness", passed=passed, skipped=skipped)]
    if shadow:
        assessments.append(Assessment("correctness_v2", passed=False, shadow_of="correctness"))
    return EvaluationResult(EvalRecord(request=request, failed=failed), SourceRef("agent_eval"),
                            metrics={"retrieval_hit_rate": 1.0, "retrieval_mrr": 0.5},
                            assessments=assessments)


def test_what_a_row_says_for_each_judge_and_metric():
    assert outcomes(_result("q", shadow=True)) == {"correctness": True, "retrieval_hit_rate": True}
    assert outcomes(_result("q", passed=False)) == {"correctness": False, "retrieval_hit_rate": True}
    # A judge that did not judge is no evidence; a failed trace (an app error) fails everything.
    assert outcomes(_result("q", passed=None, skipped="budget"))["correctness"] is None
    assert outcomes(_result("q", failed=True, passed=None, skipped="failed_trace")) == {
        "correctness": False, "retrieval_hit_rate": False}


def test_pairs_are_by_request_and_rows_without_evidence_are_left_out():
    runs = PairedRuns(baseline={("a", 0): {"correctness": True}, ("b", 0): {"correctness": True},
                                ("c", 0): {"correctness": None}},
                      new={("a", 0): {"correctness": False}, ("b", 0): {"correctness": True},
                           ("c", 0): {"correctness": False}, ("d", 0): {"correctness": False}})
    diff = runs.differences()["correctness"]
    assert diff is not None and (diff.n, diff.baseline_passed, diff.new_passed) == (2, 2, 1)
    assert runs.common == [("a", 0), ("b", 0), ("c", 0)]


# ------------------------------------------------------------------ the docs' workflow


def test_the_documented_github_actions_workflow_parses_and_gates_on_the_baseline():
    blocks = [b for b in blocks_of(REPO / "docs" / "pages" / "guides" / "gate-a-release.md")
              if b.heading == "Gate a release on a dataset" and b.lang == "yaml"]
    workflows = [b for b in blocks if "jobs:" in b.text]
    assert len(workflows) == 1, [b.where for b in blocks]
    workflow: dict[Any, Any] = yaml.safe_load(workflows[0].text)
    assert "pull_request" in workflow[True]  # YAML 1.1 reads the key `on` as true
    steps = [s for job in workflow["jobs"].values() for s in job["steps"]]
    commands = "\n".join(s.get("run", "") for s in steps)
    assert "tracejudge eval" in commands and "--fail-if-worse-than" in commands
    assert all("uses" in s or "run" in s for s in steps)
