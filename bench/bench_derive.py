"""Derivation throughput: tracejudge's `normalise()` against MLflow's own, on the same traces.

Both start from the JSON bytes of a trace made by the real `mlflow` package (bench/corpus.py: RAG and
agent traces, 5–35 spans, 7–46 KB) and end with the fields an evaluation needs:

  tracejudge  `normalise(payload)` -> EvalRecord (request, response, retrieved context, trajectory,
              tokens, latency, failure, expectations, tags)
  mlflow      `Trace.from_json(text)` + `trace_utils.extract_request_from_trace`,
              `extract_response_from_trace`, `extract_retrieval_context_from_trace`,
              `extract_tools_called_from_trace`, `trace.info.token_usage`, `execution_duration`, `state`

Both run in small batches of traces of similar size, alternating which goes first, over several
rounds, so load from other processes falls on both alike; each batch's figure is its median round
(process CPU time), and a side's rate is its traces over the sum of its batch figures. Prints
records/s of both and the ratio, measured in this one run, overall and by trace size.

Before timing, every corpus trace is read a second time through orjson and the general MLflow reader
(`parse_trace`), which the msgspec path for `Trace.to_json()`'s exact shape
(`mlflow_wire.derive_canonical_json`) stands in for, and the two records must be equal: a faster
path that changed a result would fail here, not just in tests.

    python bench/bench_derive.py                  # 300 traces x 7 rounds
    python bench/bench_derive.py --traces 100 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import logging
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import orjson

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import corpus
from mlflow.entities import Trace
from mlflow.genai.utils import trace_utils

from tracejudge.schemas.formats import mlflow as mlflow_parser
from tracejudge.schemas.formats import mlflow_wire
from tracejudge.schemas.formats.derive import derive
from tracejudge.schemas.formats.detect import normalise

BATCH = 10


def tracejudge_derive(payload: bytes) -> object:
    return normalise(payload)


def mlflow_derive(payload: bytes) -> object:
    trace = Trace.from_json(payload.decode())
    return (trace_utils.extract_request_from_trace(trace), trace_utils.extract_response_from_trace(trace),
            trace_utils.extract_retrieval_context_from_trace(trace),
            trace_utils.extract_tools_called_from_trace(trace), trace.info.token_usage,
            trace.info.execution_duration, trace.info.state)


def check_records(payloads: list[bytes]) -> int:
    """The msgspec path and the general reader must give the same record for every trace.
    Returns how many traces the msgspec path read (the others fell back to the general reader)."""
    fast = sum(mlflow_wire.derive_canonical_json(p) is not None for p in payloads)
    for i, payload in enumerate(payloads):
        reference = derive(mlflow_parser.parse_trace(orjson.loads(payload), everything=False))
        if normalise(payload) != reference:
            raise SystemExit(f"trace {i}: normalise() differs from the general reader's record")
    return fast


def timed(fn: Callable[[bytes], object], batch: list[bytes]) -> float:
    start = time.process_time()
    for payload in batch:
        fn(payload)
    return time.process_time() - start


def measure(batches: list[list[bytes]], rounds: int) -> tuple[list[float], list[float]]:
    """Median CPU seconds per batch for (tracejudge, mlflow), interleaved batch by batch."""
    ours: list[list[float]] = [[] for _ in batches]
    theirs: list[list[float]] = [[] for _ in batches]
    for r in range(rounds):
        gc.collect()
        gc.disable()  # a collection triggered by one side's garbage must not be billed to the other
        try:
            for i, batch in enumerate(batches):
                if (r + i) % 2:
                    ours[i].append(timed(tracejudge_derive, batch))
                    theirs[i].append(timed(mlflow_derive, batch))
                else:
                    theirs[i].append(timed(mlflow_derive, batch))
                    ours[i].append(timed(tracejudge_derive, batch))
        finally:
            gc.enable()
    return [statistics.median(t) for t in ours], [statistics.median(t) for t in theirs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    logging.getLogger("mlflow").setLevel(logging.ERROR)

    # Sorted by size so that each batch holds traces of similar size and the thirds below are
    # groups of whole batches.
    payloads = sorted((t.encode() for t in corpus.build(args.traces)), key=len)
    sizes = [len(p) for p in payloads]
    spans = sorted(len(orjson.loads(p)["data"]["spans"]) for p in payloads)
    print(f"corpus: {len(payloads)} MLflow 3 traces, {sizes[0] / 1024:.1f}–{sizes[-1] / 1024:.1f} KB "
          f"(median {sizes[len(sizes) // 2] / 1024:.1f} KB), {spans[0]}–{spans[-1]} spans "
          f"(median {spans[len(spans) // 2]})")
    fast = check_records(payloads)
    print(f"records: normalise() equals the general reader's record on all {len(payloads)} traces "
          f"({fast} read by the msgspec path)")
    # Warm both paths (imports, caches) before timing.
    for payload in payloads[::15]:
        tracejudge_derive(payload)
        mlflow_derive(payload)

    batches = [payloads[i:i + BATCH] for i in range(0, len(payloads), BATCH)]
    ours, theirs = measure(batches, args.rounds)

    def rates(group: slice) -> tuple[float, float]:
        n = sum(len(b) for b in batches[group])
        return n / sum(ours[group]), n / sum(theirs[group])

    ours_rate, theirs_rate = rates(slice(None))
    mb = sum(sizes) / 1e6
    print(f"tracejudge normalise()         {ours_rate:8.0f} records/s  "
          f"({ours_rate * mb / len(payloads):6.1f} MB/s)")
    print(f"mlflow from_json + trace_utils {theirs_rate:8.0f} records/s  "
          f"({theirs_rate * mb / len(payloads):6.1f} MB/s)")
    print(f"ratio                          {ours_rate / theirs_rate:8.1f}x")

    # The ratio depends on bytes per span: MLflow's cost is mostly per span, ours mostly per byte
    # (msgspec's pass over the whole document is about a third of it, the payloads derivation
    # decodes about a quarter).
    third = len(batches) // 3
    for label, group in (("smallest third", slice(0, third)), ("middle third", slice(third, 2 * third)),
                         ("largest third", slice(2 * third, None))):
        first, last = batches[group][0][0], batches[group][-1][-1]
        ours_g, theirs_g = rates(group)
        print(f"  {label:14s} {len(first) / 1024:5.1f}–{len(last) / 1024:4.1f} KB: "
              f"{ours_g:7.0f} vs {theirs_g:6.0f} records/s, {ours_g / theirs_g:4.1f}x")


if __name__ == "__main__":
    main()
