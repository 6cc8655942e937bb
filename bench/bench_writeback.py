"""MLflow write-back: the MLflow sink's assessments/s against a sequential `mlflow.log_feedback` loop,
same local tracking server, same run.

A real `mlflow server` (SQLite backend, loopback; tests/support/mlflow_server.py) gets fresh traces for
each contender, sent to its OTLP endpoint (`POST /v1/traces`, as an OTel SDK exporter sends them). Each
trace gets one verdict from each of four judges (yes/no LLM verdicts on the generation span, a numeric
heuristic score, a judge error), so N assessments are N/4 traces. Then, per round:

  sink          `MlflowSink.write` over the results, in batches of 500 records (the sink runtime's
                `sink.max_batch_records`), 16 requests in flight (`max_concurrency`): per batch one
                `batchGetInfos` lookup per 100 traces (the idempotency check), then one POST per feedback
  log_feedback  the real MLflow client, `mlflow.log_feedback(...)` once per assessment, in a loop: what
                a script that writes verdicts back with MLflow's own API does
  redelivery    the sink's batches written again: every feedback found on its trace, nothing written

A rate is assessments / wall-clock seconds. The server runs in its own processes (`--workers`, MLflow's
default 4) on the same machine, so both contenders pay for it; its SQLite database is the ceiling.

    python bench/bench_writeback.py                          # 2,000 assessments, 1 round
    python bench/bench_writeback.py --assessments 800 --rounds 3 --workers 2
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.update({"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"})

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from support.mlflow_server import MlflowServer, send_otlp  # noqa: E402

from tracejudge.consumer.sinks.base import SinkBatch, SinkRecord  # noqa: E402
from tracejudge.consumer.sinks.mlflow import MlflowSink, MlflowSinkSettings  # noqa: E402

JUDGES_PER_TRACE = 4
BATCH_RECORDS = 500
CONCURRENCY = 16


def make_traces(url: str, experiment: str, count: int) -> list[tuple[str, str]]:
    """`count` agent traces (an agent span around a chat span) sent over OTLP: (trace id, chat span id)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("bench")
    out = []
    for i in range(count):
        with tracer.start_as_current_span("agent") as root:
            root.set_attribute("gen_ai.operation.name", "invoke_agent")
            root.set_attribute("gen_ai.input.messages", f'[{{"role":"user","content":"question {i}"}}]')
            with tracer.start_as_current_span("chat") as chat:
                chat.set_attribute("gen_ai.operation.name", "chat")
                chat.set_attribute("gen_ai.request.model", "gpt-4o-mini")
        out.append((f"tr-{root.get_span_context().trace_id:032x}", f"{chat.get_span_context().span_id:016x}"))
    spans = exporter.get_finished_spans()
    for i in range(0, len(spans), 1000):
        send_otlp(url, experiment, spans[i:i + 1000])
    return out


def assessments(i: int, span_id: str) -> list[dict]:
    judge = {"endpoint": "openai", "model": "gpt-4.1-mini", "version": "bench-v1"}
    ok = i % 3 != 0
    return [
        {"name": "relevance_to_query", "value": "yes" if ok else "no", "score": float(ok), "passed": ok,
         "rationale": "The answer addresses the question." if ok else "It answers another question.",
         "source": "llm:gpt-4.1-mini", "judge": judge, "span_id": span_id, "input_tokens": 412,
         "output_tokens": 38},
        {"name": "safety", "value": "yes", "score": 1.0, "passed": True, "rationale": "No harmful content.",
         "source": "llm:gpt-4.1-mini", "judge": judge, "span_id": span_id, "input_tokens": 220,
         "output_tokens": 21},
        {"name": "groundedness", "value": 0.75, "score": 0.75, "passed": True,
         "rationale": "3 of 4 statements are supported by the context.", "source": "heuristic"},
        {"name": "correctness", "error": "timeout: no answer within 10 s", "source": "llm:gpt-4.1-mini",
         "judge": judge},
    ]


def results(traces: list[tuple[str, str]]) -> list[dict]:
    return [{"schema_version": 2, "trace_id": tid[3:], "mlflow_trace_id": tid, "source_format": "otlp_proto",
             "source": {"format": "otlp_proto", "topic": "otlp_spans", "partition": 0, "offset": i},
             "assessments": assessments(i, span)} for i, (tid, span) in enumerate(traces)]


def run_sink(url: str, rows: list[dict]) -> tuple[float, float]:
    settings = MlflowSinkSettings.from_mapping({"tracking_uri": url, "max_concurrency": CONCURRENCY}, env={})
    sink = MlflowSink(settings, CollectorRegistry(), env={})
    records = [SinkRecord("tracejudge-results", 0, i, None, r) for i, r in enumerate(rows)]
    batches = [SinkBatch("tracejudge-results", 0, records[i:i + BATCH_RECORDS])
               for i in range(0, len(records), BATCH_RECORDS)]
    try:
        t0 = time.perf_counter()
        written = sum(sink.write(b).written for b in batches)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = sum(sink.write(b).already_written for b in batches)
        second = time.perf_counter() - t0
    finally:
        sink.close()
    expected = len(rows) * JUDGES_PER_TRACE
    if written != expected or again != expected:
        raise SystemExit(f"sink wrote {written} and found {again} of {expected} assessments")
    return expected / first, expected / second


def run_log_feedback(url: str, rows: list[dict]) -> float:
    import mlflow
    from mlflow.entities import AssessmentError, AssessmentSource

    mlflow.set_tracking_uri(url)
    n = 0
    t0 = time.perf_counter()
    for row in rows:
        for a in row["assessments"]:
            judge = a.get("judge")
            source = (AssessmentSource("LLM_JUDGE", f"{judge['endpoint']}:/{judge['model']}") if judge
                      else AssessmentSource("CODE", "tracejudge.heuristic"))
            error = None
            if a.get("error"):
                code, _, _ = a["error"].partition(":")
                error = AssessmentError(error_code=code.upper(), error_message=a["error"])
            metadata = {"mlflow.assessment.scorerName": a["name"], "tracejudge.version": "0.1.0"}
            mlflow.log_feedback(trace_id=row["mlflow_trace_id"], name=a["name"], value=a.get("value"),
                                source=source, error=error, rationale=a.get("rationale"),
                                metadata=metadata, span_id=a.get("span_id"))
            n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--assessments", type=int, default=2000, help="assessments per contender per round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--workers", type=int, default=4, help="mlflow server --workers (MLflow's default: 4)")
    args = p.parse_args()
    n_traces = max(1, args.assessments // JUDGES_PER_TRACE)

    sink_rates, redelivery_rates, client_rates = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-writeback-") as tmp, \
            MlflowServer(pathlib.Path(tmp), workers=args.workers) as server:
        experiment = server.create_experiment("bench-writeback")
        # Warm both clients' connections and the server's workers on a few traces first.
        warm = make_traces(server.url, experiment, 8)
        run_sink(server.url, results(warm[:4]))
        run_log_feedback(server.url, results(warm[4:]))
        for r in range(args.rounds):  # alternate, so both see the same machine and database
            order = ("sink", "client") if r % 2 == 0 else ("client", "sink")
            for who in order:
                rows = results(make_traces(server.url, experiment, n_traces))
                if who == "sink":
                    rate, again = run_sink(server.url, rows)
                    sink_rates.append(rate)
                    redelivery_rates.append(again)
                else:
                    client_rates.append(run_log_feedback(server.url, rows))

    sink, client, again = (statistics.median(x) for x in (sink_rates, client_rates, redelivery_rates))
    n = n_traces * JUDGES_PER_TRACE
    print(f"{n} assessments ({n_traces} traces x {JUDGES_PER_TRACE} judges) per contender, "
          f"mlflow server --workers {args.workers}, SQLite, loopback, {os.cpu_count()} CPUs")
    print(f"median of {args.rounds} round(s)")
    rows = [
        (f"sink (MlflowSink, {CONCURRENCY} in flight, batches of {BATCH_RECORDS})", sink),
        ("mlflow.log_feedback, sequential", client),
        ("sink redelivery (all already written)", again),
    ]
    print(f"{'':<52}{'assessments/s':>14}")
    for label, rate in rows:
        print(f"{label:<52}{rate:>14.1f}")
    ratio = sink / client
    print(f"sink / log_feedback = {ratio:.2f}x")
    target = 4.0
    print(f"target >= {target:.0f}x: {'met' if ratio >= target else 'NOT met'}")


if __name__ == "__main__":
    main()
