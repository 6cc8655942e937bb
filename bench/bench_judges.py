"""Judge throughput from one process against a loopback endpoint that answers after 200 ms.

The endpoint is the OpenAI-compatible stub of the tests (tests/support/openai_stub.py), run in its own
process so its CPU is not charged to the judge side. Each record asks one judge (relevance_to_query):
one Chat Completions call with a JSON-schema response format, a strict parse of the answer, sampling,
budget and breaker checks, and the Prometheus observations. In the same run it measures:

  judges          JudgeRunner.judge_many over N records (max_concurrency requests in flight)
  httpx, pools    the same POSTs from bare httpx.AsyncClients with the judge client's pooling (pools of
                  8 connections): the ceiling the judge layer could reach on this machine
  httpx, 1 pool   the same from one httpx.AsyncClient holding every connection, the obvious client;
                  httpcore's pool bookkeeping is quadratic in its connections, hence the pooling
  theory          max_concurrency / latency: the ceiling if the client cost nothing

Rounds alternate between the two httpx-pooled contenders; each figure is the median round. Also printed:
the process's resident memory before and after a judged round, with the most records that were
in flight at once (bounded by judges.max_in_flight whatever N is).

    python bench/bench_judges.py                         # 3 rounds x 2000 records, 64 concurrent, 200 ms
    python bench/bench_judges.py --records 6000 --rounds 1 --concurrency 32 --latency 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from pathlib import Path

import httpx
import orjson
from prometheus_client import CollectorRegistry

from tracejudge.metrics.judges.client import POOL_SHARD
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.schemas.record import Document, EvalRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stub_endpoint import start_endpoint, stop_endpoint


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def records(n: int) -> list[EvalRecord]:
    ctx = [Document("Items can be returned within 30 days of delivery.", "kb://returns")]
    return [
        EvalRecord(
            trace_id=f"{i:032x}",
            app="shop",
            failed=False,
            retrieved_context=ctx,
            request=f"Question {i}: how long is the return window for order {i}?",
            response="Items can be returned within 30 days of delivery.",
        )
        for i in range(n)
    ]


def run_judges(url: str, n: int, concurrency: int, max_in_flight: int) -> dict[str, float]:
    config = {
        "endpoints": {
            "default": {
                "base_url": url,
                "model": "judge-model",
                "max_concurrency": concurrency,
                "timeout_seconds": 10,
            }
        },
        "sample_rate": 1.0,
        "max_in_flight": max_in_flight,
        "builtin": {"relevance_to_query": {}},
    }
    runner = JudgeRunner(config, registry=CollectorRegistry())
    # Warm the connection pool so both contenders start from open connections.
    list(runner.judge_many(records(concurrency), window=concurrency))
    data = records(n)
    peak_in_flight = 0
    rss0 = rss_mb()
    cpu0, t0 = time.process_time(), time.perf_counter()
    judged = 0
    for assessments in runner.judge_many(data):
        peak_in_flight = max(peak_in_flight, runner.in_flight)
        judged += assessments[0].value == "yes"
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rss1 = rss_mb()
    runner.close()
    if judged != n:
        raise SystemExit(f"only {judged}/{n} judgements gave a verdict")
    return {
        "rate": n / elapsed,
        "elapsed": elapsed,
        "cpu_ms": cpu / n * 1000,
        "rss0": rss0,
        "rss1": rss1,
        "peak": peak_in_flight,
    }


async def raw_httpx(url: str, n: int, concurrency: int, per_pool: int) -> dict[str, float]:
    """N bare POSTs at `concurrency`, over pools of `per_pool` connections (least busy pool first)."""
    body = orjson.dumps(
        {
            "model": "judge-model",
            "temperature": 0.0,
            "max_tokens": 512,
            "messages": [{"role": "user", "content": "Does the response address the request?"}],
            "response_format": {"type": "json_object"},
        }
    )
    shards = math.ceil(concurrency / per_pool)
    limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
    pools = [
        httpx.AsyncClient(
            base_url=url, limits=limits, timeout=10, headers={"content-type": "application/json"}
        )
        for _ in range(shards)
    ]
    load = [0] * shards
    remaining = 0

    async def worker() -> None:
        # One worker per connection, each posting until the shared count runs out: no waiting tasks.
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            i = min(range(shards), key=load.__getitem__)
            load[i] += 1
            try:
                r = await pools[i].post("/chat/completions", content=body)
            finally:
                load[i] -= 1
            orjson.loads(r.content)["choices"][0]["message"]["content"]

    remaining = concurrency  # warm-up: open the connections
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    remaining = n
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for pool in pools:
        await pool.aclose()
    return {"rate": n / elapsed, "elapsed": elapsed, "cpu_ms": cpu / n * 1000, "n": n}


def median_round(rounds: list[dict[str, float]]) -> dict[str, float]:
    return sorted(rounds, key=lambda r: r["rate"])[len(rounds) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=2000, help="judge calls per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64, help="endpoint max_concurrency")
    p.add_argument("--max-in-flight", type=int, default=256, help="judges.max_in_flight")
    p.add_argument("--latency", type=float, default=0.2, help="endpoint answer delay, seconds")
    args = p.parse_args()

    proc, url = start_endpoint(args.latency)
    raws, judged = [], []
    try:
        # A single pool of `concurrency` connections is slow enough that fewer calls measure it well.
        naive = asyncio.run(raw_httpx(url, min(args.records, 600), args.concurrency, args.concurrency))
        for _ in range(args.rounds):  # alternate, so both see the same machine load
            raws.append(asyncio.run(raw_httpx(url, args.records, args.concurrency, POOL_SHARD)))
            judged.append(run_judges(url, args.records, args.concurrency, args.max_in_flight))
    finally:
        stop_endpoint(proc)
    raw, judges = median_round(raws), median_round(judged)
    theory = args.concurrency / args.latency

    print(
        f"{args.records} judge calls, {args.concurrency} concurrent, endpoint latency "
        f"{args.latency * 1000:.0f} ms, loopback, endpoint in its own process"
    )
    print(f"median of {args.rounds} alternating rounds")
    print(f"{'':<30}{'calls/s':>9}{'CPU ms/call':>13}{'vs theory':>11}")
    rows = [
        ("theory (concurrency/latency)", theory, None),
        (f"httpx, 1 pool of {args.concurrency} ({naive['n']:.0f} calls)", naive["rate"], naive["cpu_ms"]),
        (f"httpx, pools of {POOL_SHARD}", raw["rate"], raw["cpu_ms"]),
        ("judges (JudgeRunner)", judges["rate"], judges["cpu_ms"]),
    ]
    for label, rate, cpu in rows:
        cpu_text = f"{cpu:.2f}" if cpu is not None else ""
        print(f"{label:<30}{rate:>9.1f}{cpu_text:>13}{rate / theory:>11.2f}")
    print(
        f"judges / httpx pools of {POOL_SHARD} = {judges['rate'] / raw['rate']:.2f}; "
        f"judges / httpx 1 pool = {judges['rate'] / naive['rate']:.2f}"
    )
    print(
        f"RSS {judges['rss0']:.0f} -> {judges['rss1']:.0f} MB over {args.records} records; peak records in "
        f"flight {judges['peak']:.0f} (max_in_flight {args.max_in_flight})"
    )
    target = 150.0
    print(
        f"target >= {target:.0f} judge calls/s: {'met' if judges['rate'] >= target else 'NOT met'} "
        f"({judges['rate']:.0f}/s)"
    )


if __name__ == "__main__":
    main()
