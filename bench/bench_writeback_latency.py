"""Verdicts in seconds: from a trace's end to its verdicts in MLflow, and to their OTLP export.

A real Tansu broker (the demo's), a real `mlflow server` (SQLite, loopback; tests/support/mlflow_server.py)
and a loopback OTLP/HTTP receiver (tests/support/otlp_receiver.py, what the tests use). Traces end at the
demo's rate (`tracejudge demo --rate`, 20 a second); each trace's result line (two verdicts) is on the
results topic as the trace ends, and the trace itself reaches MLflow 0-3 s later (uniform): results
arriving before their traces, as when an app's MLflow exporter is slower than the evaluator. The real
commands run as their own processes with default settings: `tracejudge sink mlflow` and, in its own
group on the same topic, `tracejudge sink otlp`.

  parked    the sink as shipped: verdicts of traces MLflow has are written at once, the others parked
            and looked for again after 0.5 s, 1 s, 2 s, 4 s, 5 s ... (`unknown_trace_backoff_s`,
            `unknown_trace_max_backoff_s`), the partition flowing meanwhile
  held      the same run's baseline, the former behaviour: no parking (`sink.max_parked_records: 0`) and a
            fixed 75 s re-check (the former `unknown_trace_retry_s / (unknown_trace_attempts - 1)`), so a
            batch with an unknown trace holds its partition

Latency = when the trace's verdicts are all there - when the trace ended (its root span's end). For
MLflow, "there" is the server's own record: each feedback's `create_time`, read back from the server
once the sink has written everything (`batchGetInfos`; the sink's verdicts told by their
`tracejudge.key`), the latest of the trace's two; polling the server meanwhile would load the very
server being measured (one machine). For OTLP, the receiver is polled every 0.25 s: figures up to
0.25 s late. The evaluator's own latency (trace end to result line) is not included: the result is
produced as the trace ends. Percentiles carry a distribution-free 95 % interval (order statistics).

    python bench/bench_writeback_latency.py                   # 60 s at 20 traces/s, then the baseline 30 s
    python bench/bench_writeback_latency.py --seconds 120 --no-baseline
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import pathlib
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import datetime
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.update({"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"})

import httpx  # noqa: E402
import orjson  # noqa: E402
from kafka import KafkaProducer  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from support.kafka import wait_until  # noqa: E402
from support.mlflow_server import MlflowServer, send_otlp  # noqa: E402
from support.otlp_receiver import OtlpReceiver  # noqa: E402
from support.sinks import SinkProcess  # noqa: E402

from tracejudge.consumer.demo.broker import LocalBroker  # noqa: E402
from tracejudge.consumer.demo.command import PARTITIONS, create_topic  # noqa: E402
from tracejudge.consumer.sinks.otlp import EVENT_NAME  # noqa: E402

VERDICTS = 2
POLL_S = 0.25


def result_line(trace_id: str, span_id: str, i: int) -> bytes:
    ok = i % 4 != 0
    judge = {"endpoint": "openai", "model": "gpt-4.1-mini", "version": "latency-v1"}
    return orjson.dumps({
        "schema_version": 6, "request_id": trace_id, "trace_id": trace_id,
        "mlflow_trace_id": f"tr-{trace_id}",
        "session_id": None, "user_id": None, "source_format": "otlp_proto",
        "source": {"format": "otlp_proto", "topic": "otlp_spans", "partition": 0, "offset": i},
        "metrics": {}, "assessments": [
            {"name": "relevance_to_query", "value": "yes" if ok else "no", "score": float(ok), "passed": ok,
             "rationale": "The answer addresses the question.", "source": "llm:gpt-4.1-mini", "judge": judge,
             "span_id": span_id},
            {"name": "groundedness", "value": 0.8, "score": 0.8, "passed": True, "threshold": 0.7,
             "rationale": "4/5 statements supported", "source": "heuristic",
             "judge": {"endpoint": None, "model": None, "version": "latency-h1"}}]})


class Load:
    """Traces at `rate` a second for `seconds`: the result produced at the trace's end, its spans sent to
    MLflow `U(0, max_delay)` seconds later (a sender thread). `ended[trace_id]` is the end time."""

    def __init__(self, bootstrap: str, topic: str, url: str, experiment: str, rate: float, seconds: float,
                 max_delay: float, seed: int) -> None:
        self.bootstrap, self.topic, self.url, self.experiment = bootstrap, topic, url, experiment
        self.rate, self.seconds, self.max_delay = rate, seconds, max_delay
        self.random = random.Random(seed)
        self.ended: dict[str, float] = {}
        self._due: list[tuple[float, int, list[Any]]] = []
        self._lock = threading.Condition()
        self._done = False
        self.late_sends = 0

    def run(self) -> None:
        sender = threading.Thread(target=self._sender, name="bench-sender", daemon=True)
        sender.start()
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5)
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("bench-latency")
        start, n = time.monotonic(), int(self.seconds * self.rate)
        for i in range(n):
            pause = start + i / self.rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            with tracer.start_as_current_span("agent") as root:
                root.set_attribute("gen_ai.operation.name", "invoke_agent")
                with tracer.start_as_current_span("chat") as chat:
                    chat.set_attribute("gen_ai.operation.name", "chat")
                    chat.set_attribute("gen_ai.request.model", "gpt-4o-mini")
            ended = time.time()
            trace_id = f"{root.get_span_context().trace_id:032x}"
            span_id = f"{chat.get_span_context().span_id:016x}"
            self.ended[trace_id] = ended
            producer.send(self.topic, result_line(trace_id, span_id, i), key=trace_id.encode())
            spans = exporter.get_finished_spans()
            exporter.clear()
            with self._lock:
                heapq.heappush(self._due, (ended + self.random.uniform(0, self.max_delay), i, list(spans)))
                self._lock.notify()
        producer.flush()
        producer.close()
        with self._lock:
            self._done = True
            self._lock.notify()
        sender.join()

    def _sender(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._due and self._due[0][0] <= time.time():
                        due = []
                        while self._due and self._due[0][0] <= time.time():
                            due.append(heapq.heappop(self._due))
                        break
                    if self._done and not self._due:
                        return
                    self._lock.wait(max(0.0, self._due[0][0] - time.time()) if self._due else 0.5)
            if time.time() - due[0][0] > 0.5:
                self.late_sends += 1
            spans = [s for _, _, batch in due for s in batch]
            send_otlp(self.url, self.experiment, spans)


def written_in_mlflow(url: str, trace_ids: list[str]) -> dict[str, float]:
    """Trace id -> when the server created the last of its verdicts (epoch seconds), for the traces that
    have them all."""
    out: dict[str, float] = {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(0, len(trace_ids), 100):
            r = client.post("/api/3.0/mlflow/traces/batchGetInfos",
                            json={"trace_ids": [f"tr-{t}" for t in trace_ids[i:i + 100]]})
            r.raise_for_status()
            for info in r.json().get("trace_infos") or ():
                created = [datetime.fromisoformat(a["create_time"].replace("Z", "+00:00")).timestamp()
                           for a in info.get("assessments") or ()
                           if "tracejudge.key" in (a.get("metadata") or {})]
                if len(created) >= VERDICTS:
                    out[info["trace_id"][3:]] = max(created)
    return out


def seen_by_receiver(rx: OtlpReceiver, pending: set[str]) -> dict[str, float]:
    now = time.time()
    counts = Counter(e.trace_id for e in rx.events(EVENT_NAME))
    return {t: now for t in pending if counts[t] >= VERDICTS}


def watch(name: str, load: Load, probe: Any, stop: threading.Event, out: dict[str, float]) -> None:
    """Poll `probe(pending)` every POLL_S until every trace of the load is seen or `stop` is set."""
    while not stop.is_set():
        pending = set(load.ended) - set(out)
        if pending:
            try:
                out.update(probe(pending))
            except httpx.HTTPError as exc:
                print(f"  ({name} poll failed: {type(exc).__name__})", file=sys.stderr)
        if load.seconds * load.rate <= len(out):
            return
        stop.wait(POLL_S)


def quantile_ci(xs: list[float], q: float) -> tuple[float, float, float]:
    """The q-quantile and a distribution-free 95 % interval from order statistics."""
    s = sorted(xs)
    n = len(s)
    half = 1.96 * math.sqrt(n * q * (1 - q))
    lo, hi = max(0, math.floor(n * q - half) - 1), min(n - 1, math.ceil(n * q + half))
    return s[min(n - 1, max(0, math.ceil(n * q) - 1))], s[lo], s[hi]


def describe(label: str, latencies: list[float], expected: int) -> None:
    if not latencies:
        print(f"  {label:<28} n=0 of {expected}: nothing arrived")
        return
    p50, p50_lo, p50_hi = quantile_ci(latencies, 0.5)
    p95, p95_lo, p95_hi = quantile_ci(latencies, 0.95)
    print(f"  {label:<28} n={len(latencies)}/{expected}  p50 {p50:6.2f} s [{p50_lo:.2f}, {p50_hi:.2f}]  "
          f"p95 {p95:6.2f} s [{p95_lo:.2f}, {p95_hi:.2f}]  max {max(latencies):6.2f} s  "
          f"mean {statistics.fmean(latencies):.2f} s")


def sink_process(broker: LocalBroker, kind: str, topic: str, section: dict[str, Any],
                 top: dict[str, Any] | None = None) -> SinkProcess:
    """`tracejudge sink <kind>` on `topic`, default settings but `section` (`sink.<kind>`) and `top`."""
    config = {"sink": {"results_topic": topic, "write_sessions": False, kind: section, **(top or {})},
              "logging": {"level": "WARNING"}}
    return SinkProcess(broker.bootstrap_servers, kind, config, "--group-id", f"{topic}-{kind}")


def run(mode: str, args: argparse.Namespace, broker: LocalBroker, server: MlflowServer,
        rx: OtlpReceiver | None) -> dict[str, list[float]]:
    topic = f"bench-latency-{mode}-{uuid.uuid4().hex[:8]}"
    create_topic(broker.bootstrap_servers, topic, PARTITIONS)  # the demo's; assigned before the load
    experiment = server.create_experiment(topic)
    seconds = args.seconds if mode == "parked" else args.baseline_seconds
    mlflow: dict[str, Any] = {"tracking_uri": server.url, "experiment_id": experiment}
    top: dict[str, Any] = {}
    if mode == "held":
        mlflow.update({"unknown_trace_backoff_s": 75, "unknown_trace_max_backoff_s": 75})
        top["max_parked_records"] = 0
    sinks = {"mlflow": sink_process(broker, "mlflow", topic, mlflow, top)}
    if rx is not None:
        sinks["otlp"] = sink_process(broker, "otlp", topic, {"endpoint": rx.endpoint})
    load = Load(broker.bootstrap_servers, topic, server.url, experiment, args.rate, seconds, args.max_delay,
                args.seed)
    load_before = os.getloadavg()[0]
    stop = threading.Event()
    seen: dict[str, dict[str, float]] = {"mlflow": {}, "otlp": {}}
    watchers = []
    if rx is not None:
        watchers.append(threading.Thread(target=watch, args=("otlp", load, lambda p: seen_by_receiver(rx, p),
                                                             stop, seen["otlp"]), daemon=True))
    try:
        for proc in sinks.values():
            proc.wait_ready()
            wait_until(lambda proc=proc: proc.metric("tracejudge_assigned_partitions") >= PARTITIONS, 60,
                       message="the sink's partitions assigned")
        for w in watchers:
            w.start()
        load.run()
        deadline = time.monotonic() + args.drain_seconds
        want = VERDICTS * len(load.ended)
        while time.monotonic() < deadline and sinks["mlflow"].metric(
                "tracejudge_sink_writes_total", sink="mlflow", outcome="written") < want:
            stop.wait(0.5)
        for w in watchers:
            w.join(max(0.0, deadline - time.monotonic()))
        stop.set()
        seen["mlflow"] = written_in_mlflow(server.url, sorted(load.ended))
        figures = {name: sinks["mlflow"].metric(name, sink="mlflow", **labels) for name, labels in (
            ("tracejudge_sink_writes_total", {"outcome": "written"}), ("tracejudge_sink_parked_total", {}),
            ("tracejudge_sink_parked_retries_total", {}), ("tracejudge_sink_park_full_total", {}),
            ("tracejudge_sink_retries_total", {"reason": "unknown_trace"}),
            ("tracejudge_sink_given_up_total", {"reason": "unknown_trace"}))}
    finally:
        stop.set()
        for proc in sinks.values():
            proc.signal(signal.SIGTERM)
        for proc in sinks.values():
            try:
                proc.finish(60)
            finally:
                proc.kill()
    expected = len(load.ended)
    print(f"\n{mode}: {expected} traces in {seconds:.0f} s at {args.rate:g}/s, each in MLflow 0-"
          f"{args.max_delay:g} s after its result ({load.late_sends} sends over 0.5 s late); machine load "
          f"average {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    out = {}
    for sink, times in seen.items():
        if sink == "otlp" and rx is None:
            continue
        out[sink] = [times[t] - load.ended[t] for t in times]
        describe("MLflow: end -> verdicts" if sink == "mlflow" else "OTLP: end -> events exported",
                 out[sink], expected)
    f = [figures[n] for n in ("tracejudge_sink_writes_total", "tracejudge_sink_parked_total",
                              "tracejudge_sink_parked_retries_total", "tracejudge_sink_park_full_total",
                              "tracejudge_sink_retries_total", "tracejudge_sink_given_up_total")]
    print("  sink mlflow: written {:.0f}, parked {:.0f}, offered again {:.0f}, parked set full {:.0f}, "
          "writes that met unknown traces {:.0f}, given up {:.0f}".format(*f))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="load duration of the measured run")
    p.add_argument("--rate", type=float, default=20.0, help="traces a second (the demo's default: 20)")
    p.add_argument("--max-delay", type=float, default=3.0, help="a trace reaches MLflow up to this late")
    p.add_argument("--baseline-seconds", type=float, default=30.0, help="load duration of the baseline")
    p.add_argument("--no-baseline", action="store_true", help="skip the held (former behaviour) baseline")
    p.add_argument("--drain-seconds", type=float, default=240.0, help="wait at most this long after the load")
    p.add_argument("--workers", type=int, default=2, help="mlflow server --workers")
    p.add_argument("--seed", type=int, default=26)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LocalBroker() as broker, \
            MlflowServer(pathlib.Path(tmp), workers=args.workers) as server, OtlpReceiver() as rx:
        print(f"broker {broker.bootstrap_servers}, mlflow server --workers {args.workers} (SQLite), OTLP "
              f"receiver {rx.endpoint}, {os.cpu_count()} CPUs; poll every {POLL_S} s")
        parked = run("parked", args, broker, server, rx)
        if not args.no_baseline:
            held = run("held", args, broker, server, None)
            if parked["mlflow"] and held["mlflow"]:
                for q in (0.5, 0.95):
                    new, old = quantile_ci(parked["mlflow"], q)[0], quantile_ci(held["mlflow"], q)[0]
                    print(f"MLflow p{int(q * 100)}: held {old:.2f} s / parked {new:.2f} s = "
                          f"{old / max(new, 1e-9):.1f}x faster")


if __name__ == "__main__":
    main()
