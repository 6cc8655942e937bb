"""What the cheap signals cost: a record's normalise + evaluate + export with `metrics.signals` on
against the same with them off, on the same traces, in this one run.

Traces are the bench corpus's (bench/corpus.py: MLflow 3 RAG and agent traces made by the real `mlflow`
package, 1–12 tool calls each), all of one app, so the app's norms warm up and are then consulted on
every record. Both sides run in alternating rounds (process CPU time); each side's figure is its median
round. Prints µs per record of both and the signals' cost as a share of the record's path.

    python bench/bench_signals.py                    # 150 traces x 4, 9 rounds
    python bench/bench_signals.py --traces 100 --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from corpus import build

from tracejudge.consumer.pipeline import Pipeline
from tracejudge.metrics.computed import ComputedMetrics
from tracejudge.metrics.signals import SignalsConfig
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.result import SourceRef


def one_round(payloads: list[bytes], enabled: bool) -> float:
    """µs of CPU per record: normalise, evaluate (computed metrics, signals, cost) and export."""
    pipeline = Pipeline(metrics=ComputedMetrics(signals=SignalsConfig(enabled=enabled, warmup=20)))
    exporter = PrometheusExporter()
    exporter.signals.watch(pipeline.metrics.norms)
    source = SourceRef("mlflow")
    gc.collect()
    started = time.process_time()
    for payload in payloads:
        exporter.export(pipeline.evaluate(pipeline.normalise(payload, "mlflow"), source))
    return (time.process_time() - started) / len(payloads) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=150)
    parser.add_argument("--repeat", type=int, default=4, help="each trace evaluated this many times a round")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    payloads = [p.encode() for p in build(args.traces)] * args.repeat
    on: list[float] = []
    off: list[float] = []
    for i in range(args.rounds):
        order = (True, False) if i % 2 else (False, True)
        for enabled in order:
            (on if enabled else off).append(one_round(payloads, enabled))
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"corpus: {args.traces} MLflow 3 traces x {args.repeat}, one app, {args.rounds} rounds")
    print(f"signals off   {m_off:7.1f} µs/record  (rounds {min(off):.1f}–{max(off):.1f})")
    print(f"signals on    {m_on:7.1f} µs/record  (rounds {min(on):.1f}–{max(on):.1f})")
    print(f"signals cost  {m_on - m_off:7.1f} µs/record, {100 * (m_on / m_off - 1):+.1f}% of normalise + "
          "evaluate + export")


if __name__ == "__main__":
    main()
