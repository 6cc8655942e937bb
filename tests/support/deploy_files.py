"""Where the deployment files live, their helper scripts as modules, and the public metric contract.

`deploy/` is not a Python package (it ships YAML/JSON plus a few scripts), so its scripts are loaded
from their paths here. `METRICS` is the list of metric families the dashboards and rules may query:
the public contract of tracejudge's /metrics (tests check the exporters really export each of them):
`RUN_METRICS` from `tracejudge run`, `FLEET_SPEND_METRICS` from it with judges.fleet_spend,
`SINK_METRICS` from `tracejudge sink <kind>`, `SESSION_METRICS` from `tracejudge sessions` (the stage's
and its session judges'), `FINDINGS_METRICS` from `tracejudge findings run`.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "rules" / "tracejudge.rules.yml"
# Rendered by `tracejudge slo render` from deploy/config/slos.example.yaml (a test fails on drift).
SLO_RULES = DEPLOY / "prometheus" / "rules" / "tracejudge.slo.example.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests"
ALERTMANAGER = DEPLOY / "prometheus" / "alertmanager.yml"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose"


@cache
def deploy_module(relative: str) -> ModuleType:
    """Import a script under deploy/ (e.g. "prometheus/shorten.py") as a module."""
    path = DEPLOY / relative
    name = "deploy_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def tool(name: str) -> str:
    """Path of a command-line tool: the venv's bin first (pip-installed tools), then PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise AssertionError(f"{name} is not installed; CI installs it (see .ci/run and the test extras)")
    return found


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def rule_groups() -> list[dict[str, Any]]:
    return load_yaml(RULES)["groups"]


def recording_rules() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def slo_recording_rules() -> set[str]:
    """The recording rules of the example SLO rules: the names every `tracejudge slo render` file uses."""
    return {r["record"] for g in load_yaml(SLO_RULES)["groups"] for r in g["rules"] if "record" in r}


def alerts() -> list[dict[str, Any]]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


class Family(NamedTuple):
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    meaning: str


# Counters carry their exposed `_total` name; histograms their base name (`_bucket`/`_sum`/`_count`).
# Exported by `tracejudge run`.
RUN_METRICS: dict[str, Family] = {
    "tracejudge_records_total": Family("counter", ("topic", "outcome"),
                                       "Kafka records consumed; outcome ok or dead_lettered."),
    "tracejudge_dead_letters_total": Family("counter", ("reason",),
                                            "Records sent to the dead-letter topic, by reason."),
    "tracejudge_traces_total": Family("counter", ("app", "status"),
                                      "Evaluated traces; status error when the trace failed."),
    "tracejudge_trace_latency_seconds": Family("histogram", ("app",),
                                               "End-to-end trace latency (50 ms-120 s); trace_id exemplar."),
    "tracejudge_tokens_total": Family("counter", ("app", "direction"),
                                      "Tokens the agent used; direction input or output."),
    "tracejudge_retrieved_documents": Family("histogram", ("app",), "Documents retrieved per trace."),
    "tracejudge_metric_value": Family("histogram", ("app", "metric"),
                                      "Computed metrics in [0, 1] (document_recall, trajectory_*)."),
    "tracejudge_consumer_lag_records": Family("gauge", ("topic", "partition"),
                                              "Records between the consumer position and the partition end."),
    "tracejudge_commits_total": Family("counter", (), "Successful offset commits."),
    "tracejudge_judge_verdicts_total": Family("counter", ("app", "judge", "verdict", "version"),
                                              "Judge verdicts; verdict pass or fail; the app's version."),
    "tracejudge_app_version_first_seen_timestamp_seconds": Family(
        "gauge", ("app", "version"), "When each of an app's most recent versions was first seen."),
    "tracejudge_version_label_overflow_total": Family(
        "counter", (), "Verdicts whose version was exported as 'other' (older than the kept ones)."),
    "tracejudge_judge_score": Family("histogram", ("app", "judge"),
                                     "Judge scores in [0, 1] (1 = good); trace_id exemplar."),
    "tracejudge_judge_eligible_total": Family("counter", ("app", "judge"),
                                              "Traces a judge could judge (filters passed, inputs present)."),
    "tracejudge_judge_sampled_total": Family("counter", ("app", "judge"),
                                             "Eligible traces chosen by the judge's sample rate."),
    "tracejudge_judge_skipped_total": Family("counter", ("app", "judge", "reason"),
                                             "Sampled judgements not run, by reason."),
    "tracejudge_judge_errors_total": Family("counter", ("judge", "reason"),
                                            "Judgements that ran but gave no verdict, by reason."),
    "tracejudge_judge_duration_seconds": Family("histogram", ("judge",),
                                                "Wall time of one judge on one trace, retries included."),
    "tracejudge_judge_tokens_total": Family("counter", ("judge", "direction"),
                                            "Tokens sent to / received from judge endpoints."),
    "tracejudge_assembly_open_traces": Family("gauge", (), "OTel traces being assembled."),
    "tracejudge_assembly_spans_held": Family("gauge", (), "Spans held in memory by trace assembly."),
    "tracejudge_assembly_traces_emitted_total": Family("counter", ("reason",),
                                                       "Assembled traces emitted, by why."),
    # Judge trust (metrics/telemetry/trust.py); `tracejudge agreement` exports the last two as well.
    "tracejudge_judge_calibration": Family("gauge", ("judge", "stat"),
                                           "Calibration file stats; stat tpr, tnr, kappa, n."),
    "tracejudge_judge_calibration_stale": Family("gauge", ("judge",),
                                                 "1: the judge's fingerprint is not its calibration's."),
    "tracejudge_judge_agreement_total": Family("counter", ("app", "judge", "outcome"),
                                               "Human labels vs verdicts; outcome agree or disagree."),
    "tracejudge_judge_labels_total": Family("counter", ("outcome",),
                                            "Human labels taken in, by outcome."),
    # Canaries (metrics/judges/trust/canaries.py); the JudgeCanaryFailing alert reads them.
    "tracejudge_judge_canary_total": Family("counter", ("judge", "outcome"),
                                            "Canary judgements; outcome agree, disagree or error."),
    # Cost (metrics/cost.py): the Cost row and JudgeSpendNearCap read them.
    "tracejudge_cost_usd_total": Family("counter", ("app",), "What traces cost the agent, USD."),
    "tracejudge_trace_cost_usd": Family("histogram", ("app",), "Cost per trace (known cost), USD."),
    "tracejudge_judge_cost_usd_total": Family("counter", ("judge",), "What judgements cost, USD."),
    "tracejudge_judge_budget_remaining_usd": Family("gauge", ("endpoint", "window"),
                                                    "USD an endpoint's spend cap still allows."),
    "tracejudge_judge_budget_cap_usd": Family("gauge", ("endpoint", "window"),
                                              "An endpoint's spend cap, USD (per process)."),
}

# Exported by `tracejudge run` (and `tracejudge sessions`) with judges.fleet_spend only
# (metrics/judges/fleet_spend.py): the fleet-wide spend caps.
FLEET_SPEND_METRICS: dict[str, Family] = {
    "tracejudge_judge_spend_fleet_usd": Family("gauge", ("endpoint", "window"),
                                               "The fleet's spend on an endpoint this hour / day, USD."),
    "tracejudge_judge_spend_fleet_fallback": Family("gauge", ("endpoint",),
                                                    "1 while a replica charges a local share of the cap."),
}

# Exported by `tracejudge sink <kind>` (the write-back runtime and its sinks), not by `tracejudge run`.
SINK_METRICS: dict[str, Family] = {
    "tracejudge_sink_writes_total": Family("counter", ("sink", "outcome"),
                                           "Verdicts written; outcome written or already_written."),
    "tracejudge_sink_skipped_total": Family("counter", ("sink", "reason"),
                                            "Verdicts deliberately not written, by reason."),
    "tracejudge_sink_retries_total": Family("counter", ("sink", "reason"),
                                            "Batches offered again after a RetryLater, by reason."),
    "tracejudge_sink_lag_records": Family("gauge", ("sink",),
                                          "Results between the sink's position and the partitions' end."),
    "tracejudge_sink_batches_total": Family("counter", ("sink",),
                                            "Batches written (one per partition per checkpoint)."),
    "tracejudge_sink_dead_letters_total": Family("counter", ("sink", "reason"),
                                                 "Results-topic records the sink dead-lettered, by reason."),
    # Parked results (the sink runtime, metrics/telemetry/sinks.py): deferred, offered again later.
    "tracejudge_sink_parked_records": Family("gauge", ("sink",), "Deferred results waiting to be offered."),
    "tracejudge_sink_parked_total": Family("counter", ("sink",), "Results parked (first time)."),
    "tracejudge_sink_parked_retries_total": Family("counter", ("sink",), "Parked results offered again."),
    "tracejudge_sink_park_full_total": Family("counter", ("sink",),
                                              "Deferred results that found the parked set full."),
    "tracejudge_sink_given_up_total": Family("counter", ("sink", "reason"),
                                             "Parked results given up on at their deadline, by reason."),
}

# Exported by `tracejudge sessions` (the session stage, metrics/telemetry/sessions.py, and its session
# judges, metrics/judges/sessions.py), not by `tracejudge run` (which exports the hashed-id counter too).
SESSION_STAGE_METRICS: dict[str, Family] = {
    "tracejudge_sessions_total": Family("counter", ("app", "status"),
                                        "Closed sessions; status complete or incomplete."),
    "tracejudge_session_turns": Family("histogram", ("app",), "Turns per closed session."),
    "tracejudge_session_duration_seconds": Family("histogram", ("app",),
                                                  "First turn to last turn of a closed session."),
    "tracejudge_sessions_open": Family("gauge", (), "Sessions held open, waiting for more turns."),
    "tracejudge_session_turns_held": Family("gauge", (), "Turns held in memory by open sessions."),
    "tracejudge_session_bytes_held": Family("gauge", (), "Bytes of turns held by open sessions."),
    "tracejudge_sessions_remembered": Family("gauge", (), "Closed sessions remembered for reopening."),
    "tracejudge_sessions_closed_early_total": Family("counter", ("reason",),
                                                     "Sessions closed before inactivity, by reason."),
    "tracejudge_sessions_reopened_total": Family("counter", (),
                                                 "Closed sessions a late turn reopened (evaluated again)."),
    "tracejudge_sessions_forgotten_total": Family("counter", ("reason",),
                                                  "Remembered closed sessions forgotten, by reason."),
    # Not `tracejudge_session_turns_total`: it would collide with the `tracejudge_session_turns` histogram.
    "tracejudge_session_turns_received_total": Family("counter", (),
                                                      "Turns (trace results) taken into sessions."),
    "tracejudge_session_turns_placed_by_arrival_total": Family(
        "counter", ("reason",), "Turns whose timestamp was missing or absurd, placed by arrival."),
    "tracejudge_session_turns_ignored_total": Family("counter", ("reason",),
                                                     "Results not taken into a session, by reason."),
    "tracejudge_session_ids_hashed_total": Family("counter", (),
                                                  "Session ids over 256 bytes, hashed into the key."),
    "tracejudge_session_results_published_total": Family("counter", (),
                                                         "Session result lines the broker acknowledged."),
    "tracejudge_session_dead_letters_total": Family("counter", ("reason",),
                                                    "Records the stage cannot read, by reason."),
}
SESSION_JUDGE_METRICS: dict[str, Family] = {
    "tracejudge_session_judge_verdicts_total": Family(
        "counter", ("app", "judge", "verdict"),
        "Session judge verdicts; user_frustration: none, resolved or unresolved."),
    "tracejudge_session_judge_score": Family("histogram", ("app", "judge"),
                                             "Session judge scores in [0, 1]; session_id exemplar."),
    "tracejudge_session_judge_eligible_total": Family("counter", ("judge",),
                                                      "Sessions a session judge could judge."),
    "tracejudge_session_judge_sampled_total": Family("counter", ("judge",),
                                                     "Eligible sessions chosen by the sample."),
    "tracejudge_session_judge_skipped_total": Family("counter", ("judge", "reason"),
                                                     "Sampled sessions not judged, by reason."),
    "tracejudge_session_judge_errors_total": Family("counter", ("judge", "reason"),
                                                    "Session judgements that gave no verdict, by reason."),
}
SESSION_METRICS: dict[str, Family] = {**SESSION_STAGE_METRICS, **SESSION_JUDGE_METRICS}

# Exported by `tracejudge findings run` (metrics/telemetry/findings.py): the last window's findings.
_FINDING = ("app", "judge", "dimension", "value")
FINDINGS_METRICS: dict[str, Family] = {
    "tracejudge_failure_concentration": Family("gauge", _FINDING, "Lift of a finding of the last window."),
    "tracejudge_failure_concentration_lower": Family("gauge", _FINDING, "The lift's lower bound."),
    "tracejudge_failure_concentration_failing": Family("gauge", _FINDING, "Failing verdicts with the value."),
    "tracejudge_failure_concentration_verdicts": Family("gauge", _FINDING, "Verdicts with the value."),
    "tracejudge_failure_concentration_failures_total": Family(
        "counter", _FINDING, "Failing verdicts of a finding, added per window; trace_id exemplar."),
}
METRICS: dict[str, Family] = {**RUN_METRICS, **FLEET_SPEND_METRICS, **SINK_METRICS, **SESSION_METRICS,
                              **FINDINGS_METRICS}

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def family_of(series_name: str) -> str | None:
    """The contract family a series name belongs to (`x_bucket` -> `x` for histograms), else None."""
    if series_name in METRICS:
        return series_name
    for suffix in HISTOGRAM_SUFFIXES:
        base = series_name.removesuffix(suffix)
        if base != series_name and METRICS.get(base, Family("", (), "")).type == "histogram":
            return base
    return None
