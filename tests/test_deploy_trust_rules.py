"""The corrected pass rate rule on 10,000 simulated traces (issue 18, item 10): the verdict counts in
deploy/prometheus/tests/corrected_pass_rate.test.yml are what a seeded simulation of a judge with TPR 0.9
and TNR 0.8 gives on traffic whose true pass rate is 80%; promtool (test_deploy_prometheus runs every
rule test) checks Prometheus computes the corrected rate the formula here gives; this checks that rate
is within 2 points of the truth while the observed one is not."""

from __future__ import annotations

import random
import re

from support.deploy_files import RULE_TESTS, load_yaml

from tracejudge.metrics.judges.trust.agreement import corrected_rate

TRUE_PASS, TPR, TNR, TRACES = 0.8, 0.9, 0.8, 10_000


def simulate(seed: int = 18) -> tuple[int, int]:
    """(pass, fail) verdicts of the judge on TRACES traces."""
    rng = random.Random(seed)
    passed = 0
    for _ in range(TRACES):
        truly = rng.random() < TRUE_PASS
        passed += rng.random() < (TPR if truly else 1 - TNR)
    return passed, TRACES - passed


def test_the_corrected_rate_recovers_the_true_pass_rate_and_the_observed_one_does_not() -> None:
    passed, failed = simulate()
    observed = passed / TRACES
    corrected = corrected_rate(observed, TPR, TNR)
    assert corrected is not None
    assert abs(corrected - TRUE_PASS) <= 0.02 < abs(observed - TRUE_PASS)
    # The promtool test feeds Prometheus exactly these counts (per minute over 100 minutes) ...
    doc = load_yaml(RULE_TESTS / "corrected_pass_rate.test.yml")
    per_minute = {}
    for s in doc["tests"][0]["input_series"]:
        m = re.search(r'judge="groundedness",verdict="(\w+)",pod="a"', s["series"])
        if m:
            per_minute[m.group(1)] = float(s["values"].split("+")[1].split("x")[0])
    assert per_minute == {"pass": passed / 100, "fail": failed / 100}
    # ... and expects the rule to give what the formula gives (to the 0.001 it rounds to).
    cases = {case["expr"]: {t["labels"]: t["value"] for t in case["exp_samples"]}
             for case in doc["tests"][0]["promql_expr_test"]}
    shop = '{app="shop",judge="groundedness"}'
    assert cases['round(app_judge:tracejudge_judge_pass:ratio1h{judge="groundedness"}, 0.001)'][shop] \
        == round(observed, 3)
    corrected_case = cases["round(app_judge:tracejudge_judge_pass_corrected:ratio1h, 0.001)"]
    assert corrected_case[shop] == round(corrected, 3)
