"""Derivation throughput: tracejudge's `normalise()` against MLflow's own, on the same traces.

Both start from the JSON bytes of a trace made by the real `mlflow` package (bench/corpus.py: RAG and
agent traces, 5–35 spans, 7–46 KB) and end with the fields an evaluation needs:

  tracejudge  `normalise(payload)` -> EvalRecord (request, response, retrieved context, trajectory,
              tokens, latency, failure, expectations, tags)
  mlflow      `Trace.from_json(text)` + `trace_utils.extract_request_from_trace`,
              `extract_response_from_trace`, `extract_retrieval_context_from_trace`,
              `extract_tools_called_from_trace`, `trace.info.token_usage`, `execution_duration`, `state`

Rounds alternate between the two so both see the same machine load; the figure for each is the median
round. Prints records/s of both and the ratio, measured in this one run.

    python bench/bench_derive.py                  # 300 traces x 5 rounds
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import corpus
from mlflow.entities import Trace
from mlflow.genai.utils import trace_utils

from tracejudge.schemas.detect import normalise


def tracejudge_derive(payload: bytes) -> object:
    return normalise(payload)


def mlflow_derive(payload: bytes) -> object:
    trace = Trace.from_json(payload.decode())
    return (trace_utils.extract_request_from_trace(trace), trace_utils.extract_response_from_trace(trace),
            trace_utils.extract_retrieval_context_from_trace(trace),
            trace_utils.extract_tools_called_from_trace(trace), trace.info.token_usage,
            trace.info.execution_duration, trace.info.state)


def one_round(fn: Callable[[bytes], object], payloads: list[bytes]) -> float:
    gc.collect()
    start = time.process_time()
    for payload in payloads:
        fn(payload)
    return len(payloads) / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("mlflow").setLevel(logging.ERROR)

    payloads = [t.encode() for t in corpus.build(args.traces)]
    sizes = sorted(len(p) for p in payloads)
    print(f"corpus: {len(payloads)} MLflow 3 traces, {sizes[0] / 1024:.1f}–{sizes[-1] / 1024:.1f} KB "
          f"(median {sizes[len(sizes) // 2] / 1024:.1f} KB)")
    # Warm both paths (imports, caches) before timing.
    for payload in payloads[:20]:
        tracejudge_derive(payload)
        mlflow_derive(payload)

    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(args.rounds):
        ours.append(one_round(tracejudge_derive, payloads))
        theirs.append(one_round(mlflow_derive, payloads))
    ours_rate, theirs_rate = statistics.median(ours), statistics.median(theirs)
    mb = sum(sizes) / 1e6
    print(f"tracejudge normalise()        {ours_rate:9.0f} records/s  "
          f"({ours_rate * mb / len(payloads):6.1f} MB/s)")
    print(f"mlflow from_json + trace_utils {theirs_rate:8.0f} records/s  "
          f"({theirs_rate * mb / len(payloads):6.1f} MB/s)")
    print(f"ratio                         {ours_rate / theirs_rate:9.1f}x")

    # The ratio depends on bytes per span: MLflow's cost is mostly per span, ours mostly per byte
    # (orjson's parse of the whole document is about a third of it).
    ordered = sorted(payloads, key=len)
    third = len(ordered) // 3
    for label, group in (("smallest third", ordered[:third]), ("middle third", ordered[third:2 * third]),
                         ("largest third", ordered[2 * third:])):
        ours_g = statistics.median(one_round(tracejudge_derive, group) for _ in range(3))
        theirs_g = statistics.median(one_round(mlflow_derive, group) for _ in range(3))
        print(f"  {label:14s} {len(group[0]) / 1024:5.1f}–{len(group[-1]) / 1024:4.1f} KB: "
              f"{ours_g:7.0f} vs {theirs_g:6.0f} records/s, {ours_g / theirs_g:4.1f}x")


if __name__ == "__main__":
    main()
