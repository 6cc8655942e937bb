"""Findings: results/s through the window and the analysis against a baseline of only decoding the
result lines, and the peak memory of a window fed far more distinct values than it keeps.

Real result lines (`EvaluationResult.to_json()`, about 1.2 KB: a request of ~120 characters, two
retrieved documents, a tool or two, a version, a model, two judges' verdicts) are made once, then, in
this one process:

  decode     `EvaluationResult.from_dict(orjson.loads(line))` for every line: what any stage reading
             the results topic pays, the baseline
  findings   the same decode, then `FindingsWindow.add` (every dimension, request clustering on) and at
             the end `analyse()`: the findings stage's work per result

The ratio findings / decode is the share of the decode-only rate the analysis keeps. Memory: a window
(max_values 1000, the default) is fed `--distinct` results each with a doc_uri, a tool and a request
seen nowhere else; `tracemalloc` reports the peak while it fills, which stays flat past the cap
(the values forgotten are counted in `dropped_values`) where an unbounded count would grow with them.

    python bench/bench_findings.py                       # 50,000 results, 200,000 distinct values
    python bench/bench_findings.py --results 20000 --distinct 50000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc

import orjson

from tracejudge.metrics.findings import DIMENSIONS, FindingsOptions, FindingsWindow, RequestClusterer
from tracejudge.schemas.record import Document, EvalRecord, TokenUsage, ToolCall
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef

_LETTERS = random.Random(0)
# A vocabulary of 3,000 made-up words, and 300 request topics of 6 words each: a request is its topic's
# words, 2 words from anywhere and a case number, as templated traffic looks (300 clusters form).
VOCABULARY = ["".join(_LETTERS.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_LETTERS.randint(4, 9)))
              for _ in range(3000)]
TOPICS = [_LETTERS.sample(VOCABULARY, 6) for _ in range(300)]


def make_result(i: int, rng: random.Random, *, distinct: bool = False) -> EvaluationResult:
    """One result line's worth: planted failures on doc 7 and version 2.0 so the analysis has findings."""
    doc = f"docs://unique/{i}" if distinct else f"docs://kb/{rng.randrange(200)}"
    version = rng.choice(["1.0", "1.1", "2.0"])
    fails = rng.random() < (0.6 if doc.endswith("/7") or version == "2.0" else 0.1)
    words = " ".join(rng.choice(TOPICS) + rng.sample(VOCABULARY, 2))
    request = f"How do I {words} for case {i}?" + (" " + "".join(rng.choices("abcdefghij", k=12))
                                                   if distinct else "")
    record = EvalRecord(trace_id=f"{i:032x}", app="shop", request=request, response="ok " * 60,
                        retrieved_context=[Document("some text " * 20, doc),
                                           Document("other text " * 10, f"docs://kb/{rng.randrange(200)}")],
                        trajectory=[ToolCall(f"tool-{i}" if distinct else rng.choice(["search", "lookup"]))],
                        version=version, model_usage={"gpt-4o-mini": TokenUsage(100, 50, 150)},
                        timestamp=1.8e9 + i)
    return EvaluationResult(record, SourceRef("agent_eval"), metrics={"signal_empty_retrieval": 0.0},
                            assessments=[Assessment("correctness", score=0.2 if fails else 0.9,
                                                    passed=not fails),
                                         Assessment("relevance", score=0.8, passed=True)])


def decode_only(lines: list[bytes]) -> float:
    started = time.perf_counter()
    for line in lines:
        EvaluationResult.from_dict(orjson.loads(line))
    return len(lines) / (time.perf_counter() - started)


def with_findings(lines: list[bytes], options: FindingsOptions) -> tuple[float, int]:
    window = FindingsWindow(options, RequestClusterer())
    started = time.perf_counter()
    for line in lines:
        window.add(EvaluationResult.from_dict(orjson.loads(line)))
    findings = window.analyse()
    return len(lines) / (time.perf_counter() - started), len(findings)


def peak_memory(n: int, max_values: int = 1000) -> tuple[int, int, int]:
    """(peak bytes at n/10 results, peak bytes at n results, values dropped) of a window fed n results
    whose doc_uri, tool and request are each seen once."""
    rng = random.Random(2)
    window = FindingsWindow(FindingsOptions(max_values=max_values), RequestClusterer())
    results = (make_result(i, rng, distinct=True) for i in range(n))
    tracemalloc.start()
    early = 0
    for i, result in enumerate(results, 1):
        window.add(result)
        if i == n // 10:
            early = tracemalloc.get_traced_memory()[1]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return early, peak, sum(window.dropped_values.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=int, default=50_000)
    parser.add_argument("--distinct", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(1)
    lines = [make_result(i, rng).to_json() for i in range(args.results)]
    size = statistics.mean(len(line) for line in lines)
    print(f"{len(lines)} result lines, {size:.0f} bytes each")
    no_clusters = FindingsOptions(dimensions=tuple(d for d in DIMENSIONS if d != "request_cluster"))
    base, full, plain, found = [], [], [], 0
    for _ in range(args.rounds):
        base.append(decode_only(lines))
        rate, found = with_findings(lines, FindingsOptions())
        full.append(rate)
        plain.append(with_findings(lines, no_clusters)[0])
    b, f, p = statistics.median(base), statistics.median(full), statistics.median(plain)
    print(f"decode only                    {b:10,.0f} results/s")
    print(f"decode+findings                {f:10,.0f} results/s  ({found} findings)")
    print(f"decode+findings, no clustering {p:10,.0f} results/s")
    print(f"ratio {f / b:.2f} (findings keeps {f / b:.0%} of the decode-only rate; {p / b:.0%} without "
          "request clustering)")
    early, peak, dropped = peak_memory(args.distinct)
    print(f"memory: {args.distinct:,} results with distinct values: peak {early / 1e6:.1f} MB after "
          f"{args.distinct // 10:,}, {peak / 1e6:.1f} MB after {args.distinct:,} "
          f"({dropped:,} values forgotten and counted; max_values 1000 per dimension)")
    early, peak, _ = peak_memory(args.distinct, max_values=10**9)
    print(f"        the same without the cap: {early / 1e6:.1f} MB after {args.distinct // 10:,}, "
          f"{peak / 1e6:.1f} MB after {args.distinct:,}")


if __name__ == "__main__":
    main()
