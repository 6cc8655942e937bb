"""`tracejudge run` throughput (no judges) against kafka-python's raw consume rate, same topic, same run.

A local Tansu broker gets one topic of realistic MLflow 3 traces, 8–30 KB of JSON each (bench/corpus.py:
RAG and agent traces made by the real `mlflow` package, repeated to reach --records). Then, in rounds
that alternate so every mode sees the same machine load, each mode consumes the whole topic as a fresh
consumer group:

  raw       kafka-python's KafkaConsumer.poll() loop doing nothing with the records: the ceiling
  run       `StreamRunner` as `tracejudge run` runs it by default, without judges: normalise +
            computed metrics + Prometheus export + offset tracking and commits (metrics only, no
            results topic). `stream.decode_workers: auto` decides where decoding runs: one worker
            process from two CPUs up (printed below), else this process
  1 process `run` with `stream.decode_workers: 0`: everything in this process
  +results  `run` plus one JSON result per record on a results topic, counted when acked

A mode's rate is records / (time from its first record to its last one done), so the group join is
left out; its CPU is this process's CPU time (all threads) plus its decode workers', over the same
span, per record (the broker's is not counted for any mode). Rates and
CPU are medians over the rounds (five by default: raw's own rate has been seen to swing 2.2k–10k/s
between rounds on a shared 2-core machine); "vs raw" is the median of each round's ratio to raw's
rate in that round, and the rounds alternate direction (raw first, then raw last). The CPU ratio is
the steadier figure: the wall-clock rates move with whatever else runs on the machine.

Every mode runs in this one process, so they share its allocator settings (the Dockerfile's
GLIBC_TUNABLES, see there, speed all of them up) and its collector settings (`gc_policy`, applied
as `tracejudge run` applies them), and the comparison stays like with like.

    python bench/bench_stream.py                       # 6,000 records x 5 rounds
    python bench/bench_stream.py --records 3000 --rounds 2
    python bench/bench_stream.py --signals-off          # also "run nosig": metrics.signals off
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import corpus
from kafka import KafkaConsumer, KafkaProducer

from tracejudge.consumer.config import load_settings
from tracejudge.consumer.demo.broker import LocalBroker
from tracejudge.consumer.runtime import gc_policy
from tracejudge.consumer.stages.decoding import auto_workers, available_cpus
from tracejudge.consumer.stages.run import StreamRunner
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter

GROUP_TIMINGS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}
TOPIC = "bench-traces"


def corpus_payloads(distinct: int, low: int, high: int) -> list[bytes]:
    traces = [t.encode() for t in corpus.build(distinct * 3, seed=11)]
    return [t for t in traces if low <= len(t) <= high][:distinct]


def fill_topic(bootstrap: str, payloads: list[bytes], records: int) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=512 * 1024,
                             max_request_size=4 * 1024 * 1024)
    for i in range(records):
        producer.send(TOPIC, value=payloads[i % len(payloads)], key=str(i).encode())
    producer.flush(timeout=120)
    producer.close()


def workers_cpu() -> float:
    """CPU seconds used so far by this process's decode workers (Linux /proc; the broker, also a
    child, is left out)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in pathlib.Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                if b"decode_workers import serve" not in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


class Span:
    """Wall and CPU time (this process and its decode workers) from the first record to the last."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time() + workers_cpu()

    def stop(self, records: int) -> tuple[float, float]:
        """(records/s, CPU seconds per record)"""
        cpu = time.process_time() + workers_cpu() - self.cpu
        return records / (time.perf_counter() - self.wall), cpu / records


def raw(bootstrap: str, group: str, records: int) -> tuple[float, float]:
    consumer = KafkaConsumer(TOPIC, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                             auto_offset_reset="earliest", **GROUP_TIMINGS)
    span = Span()
    seen = 0
    try:
        while seen < records:
            batch = consumer.poll(timeout_ms=250)
            if batch and not seen:
                span.start()
            for part in batch.values():
                seen += len(part)
        return span.stop(records)
    finally:
        consumer.close(autocommit=False)


class _TimedExporter(PrometheusExporter):
    """Starts the span at the first record counted, signals at the last."""

    def __init__(self, records: int, span: Span, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.target = records
        self.span = span
        self.counted = 0
        self.done = threading.Event()

    def count_ok(self, topic: str) -> None:
        super().count_ok(topic)
        if not self.counted:
            self.span.start()
        self.counted += 1
        if self.counted >= self.target:
            self.done.set()


def run(bootstrap: str, group: str, records: int, results: str | None = None,
        workers: int | str = "auto", signals: bool = True) -> tuple[float, float]:
    overrides = {"stream.decode_workers": workers, "kafka.bootstrap_servers": bootstrap,
                 "kafka.group_id": group, "stream.topics": [TOPIC],
                 "http.port": 0, "http.bind_address": "127.0.0.1", "stream.results_topic": results,
                 "metrics.signals.enabled": signals,
                 **{f"kafka.{k}": v for k, v in GROUP_TIMINGS.items()}}
    settings = load_settings(environ={}, overrides=overrides)
    span = Span()
    exporter = _TimedExporter(records, span, max_apps=settings.prometheus.max_apps)
    runner = StreamRunner(settings, exporter=exporter, judges=False)
    runner.start()
    try:
        if not exporter.done.wait(600):
            raise RuntimeError(f"only {exporter.counted} of {records} records processed: {runner.error!r}")
        if results:
            published = exporter.results_published
            while published._value.get() < records:  # acks trail the processing by milliseconds
                time.sleep(0.001)
        return span.stop(records)
    finally:
        runner.stop()
        runner.join(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--distinct", type=int, default=150, help="distinct traces, repeated to --records")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--signals-off", action="store_true",
                        help="also run as by default with metrics.signals.enabled: false (what they cost)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for name in ("kafka", "tracejudge"):
        logging.getLogger(name).setLevel(logging.ERROR)

    payloads = corpus_payloads(args.distinct, 8 * 1024, 30 * 1024)
    sizes = sorted(len(p) for p in payloads)
    print(f"corpus: {len(payloads)} distinct MLflow 3 traces, {sizes[0] / 1024:.1f}–{sizes[-1] / 1024:.1f} "
          f"KB (median {statistics.median(sizes) / 1024:.1f} KB), repeated to {args.records} records")
    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        fill_topic(bs, payloads, args.records)
        # The collector set as `tracejudge run` sets it, for every mode alike (raw included).
        gc_policy.apply()
        modes = {
            "raw": lambda r: raw(bs, f"raw-{r}", args.records),
            "run": lambda r: run(bs, f"run-{r}", args.records),
            "1 process": lambda r: run(bs, f"one-{r}", args.records, workers=0),
            "+results": lambda r: run(bs, f"results-{r}", args.records, results=f"bench-results-{r}"),
        }
        if args.signals_off:
            modes["run nosig"] = lambda r: run(bs, f"nosig-{r}", args.records, signals=False)
        measured: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
        for r in range(args.rounds):
            # Forward, then backward: a slow drift of the machine's speed favours no mode.
            for mode in list(modes) if r % 2 == 0 else reversed(modes):
                measured[mode].append(modes[mode](r))
            print(f"round {r + 1}: " + ", ".join(f"{m} {v[-1][0]:,.0f}/s" for m, v in measured.items()),
                  flush=True)
    rate = {m: statistics.median(x[0] for x in v) for m, v in measured.items()}
    cpu = {m: statistics.median(x[1] for x in v) for m, v in measured.items()}
    # Each mode against raw in the same round, then the median of those: paired, so a round that
    # ran on a slow machine slows both sides of its ratio.
    paired = {m: statistics.median(x[0] / raw_[0] for x, raw_ in zip(v, measured["raw"], strict=True))
              for m, v in measured.items()}
    print(f"\n{'mode':<11}{'records/s':>11}{'vs raw':>8}{'CPU µs/record':>15}{'raw/CPU':>9}")
    for mode in modes:
        print(f"{mode:<11}{rate[mode]:>11,.0f}{paired[mode]:>8.0%}{cpu[mode] * 1e6:>15.0f}"
              f"{cpu['raw'] / cpu[mode]:>9.0%}")
    cpus = available_cpus()
    workers = auto_workers(cpus)
    print(f"\ntracejudge run (no judges; stream.decode_workers: auto = {workers} worker"
          f"{'' if workers == 1 else 's'} on {cpus} CPU{'' if cpus == 1 else 's'}): {paired['run']:.0%} of "
          f"kafka-python's raw consume rate; in one process {paired['1 process']:.0%}. Target: at least 50%.")


if __name__ == "__main__":
    main()
