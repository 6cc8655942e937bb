"""The Operations dashboard (tracejudge-operations): agent traffic, judges, Kafka, OpenTelemetry trace
assembly, write-back (tracejudge sink) and the session stage."""

from __future__ import annotations

from panels import (
    NO_OTLP,
    NO_SESSIONS,
    NO_SINK,
    Board,
    dashboard,
    histogram_mean,
    label_variable,
    or_zero,
    quantile,
    ratio_or_zero,
    right_axis,
    row,
    sum_rate,
    target,
    timeseries,
    total_or_zero,
    trace_url_variable,
)


def operations() -> Board:
    app, topic, judge, sink = 'app=~"$app"', 'topic=~"$topic"', 'judge=~"$judge"', 'sink=~"$sink"'
    traces = "tracejudge_traces_total"
    failed = sum_rate(traces, "app", app + ', status="error"')
    no_traces = "No trace evaluated in range (is tracejudge run scraped?)"
    no_records = "No record read in range (is tracejudge run scraped?)"
    no_judge_calls = "No judge call in range (no judge configured, or no trace sampled)"
    batches = sum_rate("tracejudge_sink_batches_total", "sink", sink)
    return dashboard(
        "tracejudge-operations", "tracejudge / Operations",
        "Traffic, latency, tokens and failures of the evaluated agents; judge cost; Kafka consumption; "
        "writing verdicts back onto traces (tracejudge sink); the session stage (tracejudge sessions).",
        [label_variable("app", "app", traces),
         label_variable("topic", "topic", "tracejudge_records_total"),
         label_variable("judge", "judge", "tracejudge_judge_duration_seconds_count"),
         label_variable("sink", "sink", "tracejudge_sink_lag_records"),
         trace_url_variable()],
        [
            row("Agent traffic"),
            timeseries("Traces per second", "Evaluated traces by app and status.",
                       [target(sum_rate(traces, "app, status", app), "{{app}} · {{status}}")],
                       unit="reqps", stack=True, empty=no_traces),
            timeseries("Trace failure rate",
                       "Share of traces whose status is error: 0% while none failed.",
                       [target(ratio_or_zero(failed, sum_rate(traces, "app", app), "app"), "{{app}}")],
                       ratio=True, empty=no_traces),
            timeseries("Trace latency p50 / p95 / p99 (exemplars link to the trace)",
                       "End-to-end latency of the agent's traces; exemplar dots carry the trace_id.",
                       [target(quantile(q, "tracejudge_trace_latency_seconds", "app", app),
                               f"p{round(q * 100)} {{{{app}}}}", exemplar=True) for q in (0.5, 0.95, 0.99)],
                       unit="s", empty="No trace with a latency in range"),
            timeseries("Tokens per second", "Tokens the agents used, by direction.",
                       [target(sum_rate("tracejudge_tokens_total", "app, direction", app),
                               "{{app}} · {{direction}}")],
                       unit="short", stack=True, empty="No trace with token counts in range"),
            timeseries("Retrieved documents per trace (mean)",
                       "Documents retrieved per trace (the tracejudge_retrieved_documents histogram).",
                       [target(histogram_mean("tracejudge_retrieved_documents", "app", app), "{{app}}")],
                       unit="short", width=24, empty="No trace with retrieval in range"),
            row("Judges"),
            timeseries("Judge latency p50 / p95", "Duration of one judge call.",
                       [target(quantile(q, "tracejudge_judge_duration_seconds", "judge", judge),
                               f"p{round(q * 100)} {{{{judge}}}}") for q in (0.5, 0.95)],
                       unit="s", empty=no_judge_calls),
            timeseries("Judge tokens per second",
                       "Tokens the judges spent, by direction: the cost of evaluation.",
                       [target(sum_rate("tracejudge_judge_tokens_total", "judge, direction", judge),
                               "{{judge}} · {{direction}}")],
                       unit="short", stack=True, empty=no_judge_calls),
            row("Kafka"),
            timeseries("Records per second by outcome",
                       "Records read per topic: evaluated (ok) or dead-lettered.",
                       [target(sum_rate("tracejudge_records_total", "topic, outcome", topic),
                               "{{topic}} · {{outcome}}")],
                       unit="reqps", stack=True, empty=no_records),
            timeseries("Consumer lag (records)",
                       "Records between the consumer's position and the partition's end (alert: > 10000).",
                       [target(f"sum by (topic, partition) (tracejudge_consumer_lag_records{{{topic}}})",
                               "{{topic}} [{{partition}}]")],
                       unit="short", empty="No partition assigned (is tracejudge run scraped?)"),
            timeseries("Dead letters by reason",
                       "Records written to the dead-letter topic, by reason, and over all reasons: 0 while "
                       "records are read and none is dead-lettered.",
                       [target(sum_rate("tracejudge_dead_letters_total", "reason"), "{{reason}}"),
                        target(total_or_zero("tracejudge_dead_letters_total", "", "",
                                             sum_rate("tracejudge_records_total", "")), "all reasons")],
                       unit="reqps", empty=no_records),
            timeseries("Dead-letter ratio (15m)",
                       "DeadLettersRising fires above 1% with at least 20 records in 15 minutes. 0% while "
                       "records are read and none is dead-lettered (the recording rule has no series then).",
                       [target(or_zero(f"topic:tracejudge_records_dead_lettered:ratio15m{{{topic}}}",
                                       "topic", f"(topic:tracejudge_records:increase15m{{{topic}}} > 0)"),
                               "{{topic}}")],
                       ratio=True, empty="No record read in the last 15 minutes"),
            timeseries("Offset commits per second",
                       "Offsets are committed only after a record's results are exported: flat means stuck.",
                       [target(sum_rate("tracejudge_commits_total", ""), "commits")],
                       unit="reqps", width=24, empty="No tracejudge run scraped in range"),
            row("OpenTelemetry trace assembly"),
            timeseries("Traces being assembled",
                       "Open traces and held spans, waiting for a trace's root span or its idle timeout.",
                       [target("sum(tracejudge_assembly_open_traces)", "open traces"),
                        target("sum(tracejudge_assembly_spans_held)", "spans held")],
                       unit="short", empty=NO_OTLP),
            timeseries("Assembled traces emitted by reason",
                       "Why a trace was taken as complete (root seen, idle timeout, evicted at a limit).",
                       [target(sum_rate("tracejudge_assembly_traces_emitted_total", "reason"), "{{reason}}")],
                       unit="reqps", empty=NO_OTLP),
            row("Write-back (tracejudge sink)"),
            timeseries("Sink lag (results not yet written back)",
                       "Records between each sink's position on the results topic and its end, summed "
                       "over partitions and replicas (WriteBackLagging: > 10000 for 15 minutes).",
                       [target(f"sum by (sink) (tracejudge_sink_lag_records{{{sink}}})", "{{sink}}")],
                       unit="short", empty=NO_SINK),
            timeseries("Verdicts written back per second by outcome",
                       "written: a new assessment/event; already_written: found on the trace already "
                       "(a redelivery after a restart or rebalance), so not written twice.",
                       [target(sum_rate("tracejudge_sink_writes_total", "sink, outcome", sink),
                               "{{sink}} · {{outcome}}")],
                       unit="reqps", stack=True, empty=NO_SINK),
            timeseries("Verdicts skipped by reason",
                       "Deliberately not written. unknown_trace: the trace never reached the trace "
                       "backend within the retry window (traces not logged there). All reasons: 0 while the "
                       "sink runs and skipped none.",
                       [target(sum_rate("tracejudge_sink_skipped_total", "sink, reason", sink),
                               "{{sink}} · {{reason}}"),
                        target(total_or_zero("tracejudge_sink_skipped_total", "sink", sink, batches),
                               "{{sink}} · all reasons")],
                       unit="reqps", empty=NO_SINK),
            timeseries("Write retries by reason",
                       "Batches offered again after network errors, 429, 5xx or a trace not there yet: "
                       "lag grows meanwhile, nothing is lost. All reasons: 0 while the sink runs and "
                       "retried none.",
                       [target(sum_rate("tracejudge_sink_retries_total", "sink, reason", sink),
                               "{{sink}} · {{reason}}"),
                        target(total_or_zero("tracejudge_sink_retries_total", "sink", sink, batches),
                               "{{sink}} · all reasons")],
                       unit="reqps", empty=NO_SINK),
            timeseries("Parked results: waiting, parked, looked for again, given up",
                       "Results a sink deferred (MLflow: their trace not on the server yet) wait, their "
                       "offsets uncommitted, and are offered again after a growing back-off. Waiting now "
                       "(right axis); parked, offered again, and given up at the deadline (all reasons: 0 "
                       "while the sink runs and gave up on none; their verdicts are in Verdicts skipped); "
                       "parked set full: the partition was held instead (raise sink.max_parked_records).",
                       [target(sum_rate("tracejudge_sink_parked_total", "sink", sink), "{{sink}} · parked"),
                        target(sum_rate("tracejudge_sink_parked_retries_total", "sink", sink),
                               "{{sink}} · offered again"),
                        target(sum_rate("tracejudge_sink_given_up_total", "sink, reason", sink),
                               "{{sink}} · given up · {{reason}}"),
                        target(total_or_zero("tracejudge_sink_given_up_total", "sink", sink, batches),
                               "{{sink}} · given up · all reasons"),
                        target(sum_rate("tracejudge_sink_park_full_total", "sink", sink),
                               "{{sink}} · parked set full"),
                        target(f"sum by (sink) (tracejudge_sink_parked_records{{{sink}}})",
                               "{{sink}} · waiting now")],
                       unit="reqps", overrides=[right_axis("F", "short")], empty=NO_SINK),
            timeseries("Sink dead letters by reason",
                       "Results-topic records that are not tracejudge results (or of an unknown schema "
                       "version), sent to sink.dead_letter_topic. All reasons: 0 while the sink runs and "
                       "dead-lettered none.",
                       [target(sum_rate("tracejudge_sink_dead_letters_total", "sink, reason", sink),
                               "{{sink}} · {{reason}}"),
                        target(total_or_zero("tracejudge_sink_dead_letters_total", "sink", sink, batches),
                               "{{sink}} · all reasons")],
                       unit="reqps", empty=NO_SINK),
            timeseries("Batches written per second",
                       "One batch per partition per checkpoint, committed after it is written: flat "
                       "while the lag grows means the sink is stuck.",
                       [target(batches, "{{sink}}")],
                       unit="reqps", empty=NO_SINK),
            row("Session stage (tracejudge sessions)"),
            timeseries("Turns in, session results out",
                       "Trace results taken into sessions, and session results the broker acknowledged "
                       "(only then are the turns' offsets committed): turns flowing while no result "
                       "comes out means sessions never close.",
                       [target(sum_rate("tracejudge_session_turns_received_total", ""), "turns"),
                        target(sum_rate("tracejudge_session_results_published_total", ""),
                               "session results published")],
                       unit="reqps", empty=NO_SESSIONS),
            timeseries("Results not taken into a session, by reason",
                       "no_session: the trace has no session id (released at once: single-turn traffic); "
                       "session_result: a session result line; duplicate: a turn the session already holds "
                       "(a redelivery).",
                       [target(sum_rate("tracejudge_session_turns_ignored_total", "reason"), "{{reason}}")],
                       unit="reqps", empty=NO_SESSIONS),
            timeseries("Session dead letters by reason",
                       "Results-topic records the session stage cannot read (not a result, a newer schema "
                       "version), sent to sessions.dead_letter_topic. All reasons: 0 while the stage "
                       "runs and dead-lettered none.",
                       [target(sum_rate("tracejudge_session_dead_letters_total", "reason"), "{{reason}}"),
                        target(total_or_zero("tracejudge_session_dead_letters_total", "", "",
                                             sum_rate("tracejudge_session_turns_received_total", "")),
                               "all reasons")],
                       unit="reqps", empty=NO_SESSIONS),
            timeseries("Turns placed by arrival, session ids hashed",
                       "Turns whose timestamp was missing or absurd (far future, before 2000), placed by "
                       "their arrival time instead; session ids over 256 bytes, hashed into the key.",
                       [target(sum_rate("tracejudge_session_turns_placed_by_arrival_total", "reason"),
                               "placed by arrival · {{reason}}"),
                        target(sum_rate("tracejudge_session_ids_hashed_total", ""), "session ids hashed")],
                       unit="reqps", empty=NO_SESSIONS),
        ])
