"""The Quality dashboard (tracejudge-quality): pass rates, scores, coverage and judge health, judge trust,
quality SLOs, cost, and conversations (the session stage and its judges)."""

from __future__ import annotations

from panels import (
    DOCS,
    NO_CALIBRATION,
    NO_CANARIES,
    NO_ELIGIBLE,
    NO_FINDINGS,
    NO_FLEET_SPEND,
    NO_HUMAN_LABELS,
    NO_RELEASES,
    NO_SESSION_JUDGES,
    NO_SESSIONS,
    NO_SLOS,
    NO_SPEND_CAP,
    NO_TRACE_COST,
    NO_VERDICTS,
    PASSED_VERDICTS,
    RATE,
    Board,
    Item,
    dashboard,
    heatmap,
    histogram_mean,
    label_variable,
    or_zero,
    quantile,
    ratio_or_zero,
    right_axis,
    row,
    session_url_variable,
    sum_rate,
    table,
    target,
    timeseries,
    total_or_zero,
    trace_url_variable,
)


def quality() -> Board:
    sel = 'app=~"$app", judge=~"$judge"'
    judge_only = 'judge=~"$judge"'
    pair = "{{app}} · {{judge}}"
    eligible = sum_rate("tracejudge_judge_eligible_total", "app, judge", sel)
    judge_eligible = sum_rate("tracejudge_judge_eligible_total", "judge", judge_only)
    return dashboard(
        "tracejudge-quality", "tracejudge / Quality",
        "LLM-as-judge verdicts and computed metrics per app: pass rates, scores, coverage, judge health; "
        "conversations: sessions, session judges, frustration.",
        [label_variable("app", "app", "tracejudge_judge_verdicts_total"),
         label_variable("judge", "judge", 'tracejudge_judge_verdicts_total{app=~"$app"}'),
         label_variable("session_judge", "judge", 'tracejudge_session_judge_verdicts_total{app=~"$app"}'),
         session_url_variable(),
         trace_url_variable()],
        [
            row("Pass rate"),
            timeseries("Pass rate per judge and app (5m)",
                       "Share of judge verdicts that passed (app_judge:tracejudge_judge_pass:ratio5m).",
                       [target(f"app_judge:tracejudge_judge_pass:ratio5m{{{sel}}}", pair)], ratio=True,
                       empty=NO_VERDICTS),
            timeseries("Pass rate per judge and app (1h) vs yesterday",
                       "The window GroundednessDropped watches (floor 80%, vs the same hour yesterday).",
                       [target(f"app_judge:tracejudge_judge_pass:ratio1h{{{sel}}}", pair),
                        target(f"app_judge:tracejudge_judge_pass:ratio1h{{{sel}}} offset 1d",
                               pair + " yesterday")],
                       ratio=True, empty=NO_VERDICTS),
            timeseries("Pass rate: current vs previous release (1d)",
                       "Each judge's pass rate over the last day for the app's current release (its most "
                       "recently first-seen version) beside the release before it: what ReleaseRegressed "
                       f"compares ({DOCS}runbooks/ReleaseRegressed/).",
                       [target(f"app_judge_version_release:tracejudge_judge_pass:ratio1d{{{sel}}}",
                               pair + " · {{release}} {{version}}")],
                       ratio=True, empty=NO_RELEASES),
            timeseries("Release drop: two-proportion z (1d)",
                       "The one-sided pooled two-proportion z of the drop from the previous release's pass "
                       "rate to the current one's (left); ReleaseRegressed fires above 2.33 with at least "
                       "30 verdicts a release (right axis) and a drop of 5 points or more.",
                       [target(f"app_judge_version_release:tracejudge_judge_pass_drop:zscore1d{{{sel}}}",
                               pair + " · z {{version}}"),
                        target(f"app_judge_version_release:tracejudge_judge_verdicts:increase1d{{{sel}}}",
                               pair + " · verdicts {{release}} {{version}}")],
                       unit="none", overrides=[right_axis("B", "short")], empty=NO_RELEASES),
            timeseries("Releases: age of each kept version",
                       "Time since each version of an app was first seen (the earliest over the replicas; "
                       "the newest line is the current release). At most prometheus.max_versions per app "
                       "are kept; verdicts of older versions are labelled other (right axis: their rate).",
                       [target("time() - min by (app, version) "
                               "(tracejudge_app_version_first_seen_timestamp_seconds{app=~\"$app\"})",
                               "{{app}} · {{version}}"),
                        target(sum_rate("tracejudge_version_label_overflow_total", ""), "verdicts of retired "
                               "versions (other)")],
                       unit="s", width=24, overrides=[right_axis("B", "reqps")],
                       empty="No version stated by the traces in range"),
            timeseries("Verdicts per second",
                       "Judge verdicts by outcome: a pass rate over few verdicts is noise.",
                       [target(sum_rate("tracejudge_judge_verdicts_total", "app, judge, verdict", sel),
                               pair + " · {{verdict}}")],
                       unit="reqps", stack=True, width=24, empty=NO_VERDICTS),
            row("Scores"),
            heatmap("Judge score distribution",
                    "Judge scores in [0, 1] over time (the buckets of tracejudge_judge_score).",
                    f"sum by (le) (increase(tracejudge_judge_score_bucket{{{sel}}}[{RATE}]))",
                    empty=NO_VERDICTS),
            timeseries("Judge score p10 / p50 (exemplars link to the trace)",
                       "Low tail and median score per judge. Each dot is one judged trace at its score "
                       "(dots near 0 failed): hover it and open the trace, with the verdict and its "
                       "rationale written back on it (the trace_url variable sets where).",
                       [target(quantile(0.1, "tracejudge_judge_score", "judge", sel), "p10 {{judge}}",
                               exemplar=True),
                        target(quantile(0.5, "tracejudge_judge_score", "judge", sel), "p50 {{judge}}",
                               exemplar=True)],
                       unit="none", empty=NO_VERDICTS),
            timeseries("Computed metrics (mean)",
                       "Mean of each computed metric in [0, 1]: document recall, trajectory precision, ...",
                       [target(histogram_mean("tracejudge_metric_value", "app, metric", 'app=~"$app"'),
                               "{{app}} · {{metric}}")],
                       ratio=True, width=24,
                       empty="No computed metric in range (the traces carry no retrieval or trajectory)"),
            row("Coverage and judge health"),
            timeseries("Judge coverage (sampled / eligible)",
                       "Share of eligible traces that were sampled for each judge.",
                       [target(ratio_or_zero(sum_rate("tracejudge_judge_sampled_total", "app, judge", sel),
                                             eligible, "app, judge"), pair)],
                       ratio=True, empty=NO_ELIGIBLE),
            timeseries("Judge skips by reason",
                       "Sampled traces a judge did not evaluate (missing inputs, budget, queue full, "
                       "...); all reasons: their sum, 0 while the judge had eligible traces, none skipped.",
                       [target(sum_rate("tracejudge_judge_skipped_total", "app, judge, reason", sel),
                               pair + " · {{reason}}"),
                        target(total_or_zero("tracejudge_judge_skipped_total", "app, judge", sel, eligible),
                               pair + " · all reasons")],
                       unit="reqps", empty=NO_ELIGIBLE),
            timeseries("Judge errors by reason",
                       "Judge calls that ended without a verdict (timeouts, HTTP errors, unparsable "
                       "replies); all reasons: their sum, 0 while the judge had eligible traces, no error.",
                       [target(sum_rate("tracejudge_judge_errors_total", "judge, reason", judge_only),
                               "{{judge}} · {{reason}}"),
                        target(total_or_zero("tracejudge_judge_errors_total", "judge", judge_only,
                                             judge_eligible), "{{judge}} · all reasons")],
                       unit="reqps", empty=NO_ELIGIBLE),
            timeseries("Judge error ratio (15m)",
                       "JudgeErrorsHigh fires above 10% with at least 20 calls in 15 minutes. 0% while "
                       "a judge that was called had no error (the recording rule has no series then).",
                       [target(or_zero(f"judge:tracejudge_judge_errors:ratio15m{{{judge_only}}}", "judge",
                                       f"(judge:tracejudge_judge_calls:increase15m{{{judge_only}}} > 0)"),
                               "{{judge}}")],
                       ratio=True, empty="No judge call in the last 15 minutes"),
            *judge_trust(),
            *slo_budget(),
            *cost(),
            *findings(),
            *conversations(),
        ])


def judge_trust() -> list[Item]:
    """The Judge trust row of the quality dashboard: observed vs corrected pass rates, calibration and
    its staleness, agreement with human labels, canaries (Trusting the judges:
    https://tracejudge.github.io/tracejudge/guides/trusting-the-judges/)."""
    sel, judge_only = 'app=~"$app", judge=~"$judge"', 'judge=~"$judge"'
    pair = "{{app}} · {{judge}}"
    calibration = "tracejudge_judge_calibration"
    return [
        row("Judge trust"),
        timeseries("Pass rate (1h): observed vs corrected for the judge's error",
                   "Observed: the judge's verdicts. Corrected: Rogan–Gladen with the judge's calibrated TPR "
                   "and TNR (app_judge:tracejudge_judge_pass_corrected:ratio1h); absent without a "
                   "calibration on enough labels, for a stale one, or a judge no better than chance.",
                   [target(f"app_judge:tracejudge_judge_pass:ratio1h{{{sel}}}", pair + " observed"),
                    target(f"app_judge:tracejudge_judge_pass_corrected:ratio1h{{{sel}}}",
                           pair + " corrected")],
                   ratio=True, empty=NO_VERDICTS),
        timeseries("Calibration stale (1 = re-run tracejudge calibrate)",
                   "1 when the judge's configuration (its fingerprint) changed since it was calibrated: "
                   "its corrected pass rate is withheld.",
                   [target(f"max by (judge) (tracejudge_judge_calibration_stale{{{judge_only}}})",
                           "{{judge}} stale")],
                   unit="none", empty=NO_CALIBRATION),
        timeseries("Calibration: TPR, TNR, kappa (labels on the right)",
                   "What tracejudge calibrate measured against human labels (judges.calibration_file).",
                   [target(f'max by (judge, stat) ({calibration}{{{judge_only}, stat=~"tpr|tnr|kappa"}})',
                           "{{judge}} · {{stat}}"),
                    target(f'max by (judge) ({calibration}{{{judge_only}, stat=~"n"}})',
                           "{{judge}} · labels")],
                   ratio=True, overrides=[right_axis("B", "short")], empty=NO_CALIBRATION),
        timeseries("Agreement with human labels (1d)",
                   "Share of human labels agreeing with the judge's verdict on the same trace; "
                   "JudgeDisagreesWithHumans fires under 70% on at least 30 labels.",
                   [target(f"app_judge:tracejudge_judge_agreement:ratio1d{{{sel}}}", pair),
                    target(f"app_judge:tracejudge_judge_agreement:increase1d{{{sel}}}", pair + " labels")],
                   ratio=True, overrides=[right_axis("B", "short")], empty=NO_HUMAN_LABELS),
        timeseries("Human labels by outcome",
                   "Labels taken in: matched with a verdict, unmatched (no verdict in the window), for an "
                   "unknown judge, invalid.",
                   [target(sum_rate("tracejudge_judge_labels_total", "outcome"), "{{outcome}}"),
                    target(sum_rate("tracejudge_judge_agreement_total", "judge, outcome", sel),
                           "{{judge}} · {{outcome}}")],
                   unit="reqps", empty=NO_HUMAN_LABELS),
        timeseries("Canaries: disagreement with known answers (1h)",
                   "JudgeCanaryFailing fires above 20% on at least 10 canaries: the judge itself changed.",
                   [target(f"judge:tracejudge_judge_canary_disagree:ratio1h{{{judge_only}}}", "{{judge}}"),
                    target(sum_rate("tracejudge_judge_canary_total", "judge, outcome", judge_only),
                           "{{judge}} · {{outcome}}")],
                   ratio=True, overrides=[right_axis("B", "reqps")], empty=NO_CANARIES),
    ]


def slo_budget() -> list[Item]:
    """The Quality SLOs row: each SLO's error budget left and its burn rate per window, from the rules
    `tracejudge slo render` writes (Quality SLOs: https://tracejudge.github.io/tracejudge/guides/slos/);
    empty, with the reason, without them."""
    sel, slo = 'app=~"$app", judge=~"$judge"', "app_judge_slo:tracejudge_slo"
    budget = f"(1 - {slo}_objective:ratio{{{sel}}})"
    burn = [target(f"{slo}_error:ratio{w}{{{sel}}} / on (app, judge, slo) {budget}", "{{slo}} · " + w)
            for w in ("5m", "1h", "6h", "1d", "3d")]
    return [
        row("Quality SLOs"),
        timeseries("SLO error budget remaining",
                   "Share of the SLO window's error budget (1 - objective) not yet spent: 100% none spent, "
                   "0% all, below 0 overspent.",
                   [target(f"{slo}_error_budget_remaining:ratio{{{sel}}}", "{{slo}}")],
                   unit="percentunit", empty=NO_SLOS),
        timeseries("SLO burn rate per window (1 = budget spent exactly)",
                   "Error ratio over each window divided by the budget. SLOBurnFast pages on the 5m, 1h/5m "
                   f"and 6h/30m pairs, SLOBurnSlow opens a ticket on 1d/2h and 3d/6h ({DOCS}guides/slos/).",
                   burn, unit="none", empty=NO_SLOS),
    ]


def cost() -> list[Item]:
    """The Cost row of the quality dashboard: what the agent's traces and the judges cost, and how much
    of each judge endpoint's hard spend cap is left (What it costs: agent and judges:
    https://tracejudge.github.io/tracejudge/guides/cost/)."""
    app, judge_only = 'app=~"$app"', 'judge=~"$judge"'
    return [
        row("Cost"),
        timeseries("Agent cost per hour by app",
                   "What the evaluated traces cost the agent, in USD per hour: the cost each trace states "
                   "(MLflow) or its per-model tokens x the model's price. Traces of unknown cost are not "
                   "in it (tracejudge_cost_unknown_total counts them by reason).",
                   [target(f"{sum_rate('tracejudge_cost_usd_total', 'app', app)} * 3600", "{{app}}")],
                   unit="currencyUSD", empty=NO_TRACE_COST),
        timeseries("Agent cost per 1,000 traces",
                   "Mean cost of a trace of known cost, times 1,000, per app.",
                   [target(f"1000 * {histogram_mean('tracejudge_trace_cost_usd', 'app', app)}", "{{app}}")],
                   unit="currencyUSD", empty=NO_TRACE_COST),
        timeseries("Judge cost per hour by judge",
                   "What judging costs, in USD per hour: each judgement's reported usage x the judge "
                   "model's price (or the endpoint's configured price).",
                   [target(f"{sum_rate('tracejudge_judge_cost_usd_total', 'judge', judge_only)} * 3600",
                           "{{judge}}")],
                   unit="currencyUSD", empty="No priced judgement in range (no judge called, or no price "
                                             "for its model: endpoints.<name>.price)"),
        timeseries("Judge spend cap: remaining vs cap",
                   "USD each judge endpoint's hard cap (usd_per_hour / usd_per_day, per process) still "
                   "allows; judgements over it are skipped (budget). JudgeSpendNearCap fires at 80% spent.",
                   [target("min by (endpoint, window) (tracejudge_judge_budget_remaining_usd)",
                           "{{endpoint}} · {{window}} remaining"),
                    target("max by (endpoint, window) (tracejudge_judge_budget_cap_usd)",
                           "{{endpoint}} · {{window}} cap")],
                   unit="currencyUSD", empty=NO_SPEND_CAP),
        timeseries("Judge spend of the whole fleet vs cap",
                   "With judges.fleet_spend, an endpoint's cap holds for all replicas together: the fleet's "
                   "spend in the current UTC hour / day as each replica sees it (the highest), beside the "
                   "cap. Fallback (right axis): 1 while a replica cannot read the fleet's spend and charges "
                   "a local share (cap / max_replicas) instead.",
                   [target("max by (endpoint, window) (tracejudge_judge_spend_fleet_usd)",
                           "{{endpoint}} · {{window}} fleet spend"),
                    target("max by (endpoint, window) (tracejudge_judge_budget_cap_usd)"
                           " and on (endpoint) tracejudge_judge_spend_fleet_fallback",
                           "{{endpoint}} · {{window}} cap"),
                    target("sum by (endpoint) (tracejudge_judge_spend_fleet_fallback)",
                           "{{endpoint}} · replicas on a local share")],
                   unit="currencyUSD", width=24, overrides=[right_axis("C", "short")], empty=NO_FLEET_SPEND),
    ]


def findings() -> list[Item]:
    """The findings row of the quality dashboard: what the failing verdicts of the last findings window
    have in common (`tracejudge findings run`; What the failures have in common:
    https://tracejudge.github.io/tracejudge/guides/findings/)."""
    sel = 'app=~"$app", judge=~"$judge"'
    keys = "app, judge, dimension, value"
    series = "tracejudge_failure_concentration"

    def finding(suffix: str) -> str:
        return f"max by ({keys}) ({series}{suffix}{{{sel}}})"

    return [
        row("What the failures have in common (tracejudge findings run)"),
        table("What the failures have in common",
              "The values (retrieved document, tool, version, model, signal, request cluster) over-"
              "represented among an app's and judge's failing verdicts in the last findings window: lift = "
              "failure rate with the value / without it, with the lower bound of its simultaneous interval "
              "(above 1 for every finding; sorted by it). Top findings.top_k per app and judge.",
              [(finding(""), "lift", "none"), (finding("_lower"), "lift lower bound", "none"),
               (f"{finding('_failing')} / {finding('_verdicts')}", "failure rate with the value",
                "percentunit"),
               (finding("_failing"), "failing", "short"), (finding("_verdicts"), "verdicts", "short")],
              ["app", "judge", "dimension", "value"], sort_by="lift lower bound", width=16,
              empty=NO_FINDINGS),
        timeseries("Failing verdicts per finding (exemplars link to the trace)",
                   "Each finding's failing verdicts over the last hour (the findings windows' counts added "
                   "up). Each dot is an example failing trace of the finding: hover it and open the trace "
                   "(the trace_url variable sets where).",
                   [target(f"sum by ({keys}) (increase({series}_failures_total{{{sel}}}[1h]))",
                           "{{app}} · {{judge}} · {{dimension}}={{value}}", exemplar=True)],
                   unit="short", width=8, empty=NO_FINDINGS),
    ]


def conversations() -> list[Item]:
    """The Conversations row of the quality dashboard: `tracejudge sessions` and its session judges."""
    app, sel, judge_only = 'app=~"$app"', 'app=~"$app", judge=~"$session_judge"', 'judge=~"$session_judge"'
    verdicts = "tracejudge_session_judge_verdicts_total"
    pair = "{{app}} · {{judge}}"
    # 0% for a judge none of whose verdicts passed (it has no passing series at all).
    passed = ratio_or_zero(sum_rate(verdicts, "app, judge", sel + ", " + PASSED_VERDICTS),
                           sum_rate(verdicts, "app, judge", sel), "app, judge")
    session_eligible = sum_rate("tracejudge_session_judge_eligible_total", "judge", judge_only)
    sampled = sum_rate("tracejudge_session_judge_sampled_total", "judge", judge_only)
    unresolved = f"app:tracejudge_user_frustration_unresolved:ratio1h{{{app}}}"
    return [
        row("Conversations (tracejudge sessions)"),
        timeseries("Sessions closed per minute by status",
                   "Sessions the session stage closed: complete (inactivity, end of input) or incomplete "
                   "(max_turns, max_duration_s, or closed early at a memory cap).",
                   [target("60 * " + sum_rate("tracejudge_sessions_total", "app, status", app),
                           "{{app}} · {{status}}")],
                   stack=True, empty=NO_SESSIONS),
        timeseries("Turns per session p50 / p90",
                   "Turns of the sessions closed in the window (tracejudge_session_turns).",
                   [target(quantile(q, "tracejudge_session_turns", "app", app),
                           f"p{round(q * 100)} {{{{app}}}}") for q in (0.5, 0.9)],
                   empty=NO_SESSIONS),
        timeseries("Session duration p50 / p90",
                   "First turn to last turn of the sessions closed in the window.",
                   [target(quantile(q, "tracejudge_session_duration_seconds", "app", app),
                           f"p{round(q * 100)} {{{{app}}}}") for q in (0.5, 0.9)],
                   unit="s", empty=NO_SESSIONS),
        timeseries("Sessions ending unresolved (user_frustration, 1h) vs yesterday",
                   "Share of the judged sessions the user_frustration judge found ending with the user "
                   "frustrated and unresolved, with the number judged (right axis). UserFrustrationRising: "
                   "over 20% on at least 20 sessions and over 1.5 times the same hour yesterday.",
                   [target(unresolved, "{{app}} unresolved"),
                    target(unresolved + " offset 1d", "{{app}} unresolved yesterday"),
                    target(f"app:tracejudge_user_frustration_verdicts:increase1h{{{app}}}",
                           "{{app}} sessions judged")],
                   unit="percentunit", overrides=[right_axis("C", "short")],
                   empty="No session judged by user_frustration in the last hour (sessions.judges)"),
        timeseries("Session judge pass rate",
                   "Share of session verdicts that passed (user_frustration: not unresolved).",
                   [target(passed, pair)], ratio=True, empty=NO_SESSION_JUDGES),
        timeseries("Session verdicts per minute",
                   "Session judge verdicts by value: a pass rate over few sessions is noise.",
                   [target("60 * " + sum_rate(verdicts, "app, judge, verdict", sel),
                           pair + " · {{verdict}}")],
                   stack=True, empty=NO_SESSION_JUDGES),
        timeseries("Session judge score p10 / p50 (exemplars link to the session)",
                   "Each dot is one judged session at its score: hover it and open the conversation, its "
                   "turns and the verdicts written back (the session_url variable sets where).",
                   [target(quantile(q, "tracejudge_session_judge_score", "judge", sel), f"p{round(q * 100)} "
                           "{{judge}}", exemplar=True) for q in (0.1, 0.5)],
                   unit="none", empty=NO_SESSION_JUDGES),
        timeseries("Session judge coverage (sampled / eligible)",
                   "Share of the closed sessions each session judge could judge that were sampled.",
                   [target(ratio_or_zero(sampled, session_eligible, "judge"), "{{judge}}")],
                   ratio=True, empty=NO_SESSION_JUDGES),
        timeseries("Session judge skips and errors by reason",
                   "Sampled sessions not judged (budget, overloaded, ...) and judgements without a verdict; "
                   "all reasons: their sums, 0 while the judge had eligible sessions and none.",
                   [target(sum_rate("tracejudge_session_judge_skipped_total", "judge, reason", judge_only),
                           "skipped {{judge}} · {{reason}}"),
                    target(sum_rate("tracejudge_session_judge_errors_total", "judge, reason", judge_only),
                           "error {{judge}} · {{reason}}"),
                    target(total_or_zero("tracejudge_session_judge_skipped_total", "judge", judge_only,
                                         session_eligible), "skipped {{judge}} · all reasons"),
                    target(total_or_zero("tracejudge_session_judge_errors_total", "judge", judge_only,
                                         session_eligible), "error {{judge}} · all reasons")],
                   unit="reqps", empty=NO_SESSION_JUDGES),
        timeseries("Sessions closed early and reopened per minute",
                   "Closed early: at max_turns, max_duration or evicted at a memory cap (then incomplete). "
                   "Reopened: a late turn for a remembered closed session, evaluated again. Forgotten: no "
                   "longer remembered, so a later turn starts a new session (evaluation 1).",
                   [target("60 * " + sum_rate("tracejudge_sessions_closed_early_total", "reason"),
                           "closed early · {{reason}}"),
                    target("60 * " + sum_rate("tracejudge_sessions_reopened_total", ""), "reopened"),
                    target("60 * " + sum_rate("tracejudge_sessions_forgotten_total", "reason"),
                           "forgotten · {{reason}}")],
                   empty=NO_SESSIONS),
        timeseries("Open sessions and turns held",
                   "Sessions waiting for more turns and the turns they hold, over all session-stage "
                   "replicas (caps: sessions.max_open_sessions, sessions.max_turns_held), and the closed "
                   "sessions remembered so a late turn reopens them (sessions.max_closed_sessions).",
                   [target("sum(tracejudge_sessions_open)", "open sessions"),
                    target("sum(tracejudge_session_turns_held)", "turns held"),
                    target("sum(tracejudge_sessions_remembered)", "closed sessions remembered")],
                   empty=NO_SESSIONS),
        timeseries("Bytes held by open sessions",
                   "Memory of the held turns, over all replicas (cap per replica: sessions.max_bytes_held).",
                   [target("sum(tracejudge_session_bytes_held)", "bytes held")],
                   unit="bytes", empty=NO_SESSIONS),
    ]
