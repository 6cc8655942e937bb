"""`tracejudge sessions`: memory per open turn held, and turns/s against kafka-python's raw consume.

A local Tansu broker gets one results topic (3 partitions) of --sessions sessions of --turns turns
each (100,000 x 5 by default, issue 17's figure): real result lines (`EvaluationResult.to_json()`,
about 1.5 KB each: a question of ~150 characters, an answer of ~400), keyed by session id as
`tracejudge run` keys them, every session's turns interleaved with the others'. Then, in this one
process (same allocator, same collector settings, `gc_policy` as `tracejudge sessions` applies it):

  raw        kafka-python's KafkaConsumer.poll() loop over the whole topic doing nothing: the ceiling
  sessions   `SessionRunner` without judges, `sessions.inactivity_s` high so every session stays open:
             decode each line (`decode_turn`), place its turn, hold it, track its offset

A mode's rate is turns / (time from its first turn to its last one held), so the group join is left
out. Memory is measured twice: the stage's resident set growth while it fills (RSS after every turn
is held, minus RSS before it started; the allocator's reuse of memory freed earlier can only make it
smaller), and `tracemalloc`'s count of what a `Sessionizer` plus its `OffsetTracker` keep for the same
turns fed directly (everything the stage holds per turn, measured exactly; slower, so done apart).
Targets (issue 17): under 4 KB per open turn held, at least 50% of the raw rate without judges.

    python bench/bench_sessions.py                              # 100,000 sessions x 5 turns
    python bench/bench_sessions.py --sessions 20000 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer
from kafka.structs import TopicPartition
from prometheus_client import CollectorRegistry

from tracejudge.consumer.config import load_settings
from tracejudge.consumer.demo.broker import LocalBroker
from tracejudge.consumer.demo.command import create_topic
from tracejudge.consumer.runtime import gc_policy
from tracejudge.consumer.runtime.offsets import OffsetTracker
from tracejudge.consumer.stages.sessions import Sessionizer, SessionRunner
from tracejudge.metrics.telemetry.sessions import SessionMetrics
from tracejudge.schemas.record import EvalRecord, TokenUsage, ToolCall
from tracejudge.schemas.result import Assessment, EvaluationResult, SourceRef
from tracejudge.schemas.session import decode_turn

GROUP_TIMINGS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}
TOPIC = "bench-results"
PARTITIONS = 3
WORDS = ("account", "billing", "invoice", "password", "reset", "export", "report", "plan", "seat", "team",
         "error", "sync", "calendar", "upload", "limit", "token", "webhook", "refund", "upgrade", "login")


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def result_lines(sessions: int, turns: int, seed: int = 7) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of every turn: session after session within a window of 64 sessions interleaved,
    so turns of many sessions alternate on each partition as they do live."""
    rng = random.Random(seed)
    start = time.time() - 3600
    window = 64
    for base in range(0, sessions, window):
        ids = range(base, min(sessions, base + window))
        order = [(n, i) for n in ids for i in range(turns)]
        order.sort(key=lambda t: (t[1], rng.random()))
        for n, i in order:
            sid = f"session-{n:07d}"
            result = EvaluationResult(
                record=EvalRecord(
                    request_id=f"{sid}-{i}", trace_id=f"{n:024x}{i:08x}", app="helpdesk",
                    source_format="otlp_proto", request=_text(rng, 150), response=_text(rng, 400),
                    latency_seconds=1.2, failed=False, timestamp=start + n * 0.01 + i, session_id=sid,
                    user_id=f"user-{n % 1000}", tokens=TokenUsage(input=120, output=260),
                    trajectory=[ToolCall(tool_name="search")]),
                source=SourceRef(format="otlp_proto", topic="traces", partition=n % 6, offset=n),
                assessments=[Assessment(name="groundedness", value="yes", score=1.0, passed=True,
                                        source="heuristic")])
            yield sid.encode(), result.to_json()


def fill_topic(bootstrap: str, sessions: int, turns: int) -> tuple[int, float]:
    """Produce every line; returns (records, mean bytes a line)."""
    create_topic(bootstrap, TOPIC, PARTITIONS)
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=512 * 1024,
                             max_request_size=4 * 1024 * 1024)
    count = size = 0
    for key, value in result_lines(sessions, turns):
        producer.send(TOPIC, value=value, key=key)
        count += 1
        size += len(value)
    producer.flush(timeout=600)
    producer.close()
    return count, size / count


def rss() -> int:
    """Resident set size of this process, bytes (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def raw(bootstrap: str, group: str, records: int) -> float:
    consumer = KafkaConsumer(TOPIC, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                             auto_offset_reset="earliest", **GROUP_TIMINGS)
    seen = 0
    started = 0.0
    try:
        while seen < records:
            batch = consumer.poll(timeout_ms=250)
            if batch and not seen:
                started = time.perf_counter()
            for part in batch.values():
                seen += len(part)
        return records / (time.perf_counter() - started)
    finally:
        consumer.close(autocommit=False)


def sessions_stage(bootstrap: str, group: str, records: int) -> tuple[float, float, int]:
    """(turns/s, resident bytes grown per open turn held, open sessions)."""
    overrides = {"kafka.bootstrap_servers": bootstrap, "sessions.group_id": group,
                 "sessions.input_topic": TOPIC, "sessions.results_topic": f"{TOPIC}-sessions",
                 "sessions.inactivity_s": 1e6, "http.port": 0, "http.bind_address": "127.0.0.1",
                 # Every session held: no cap may close one (500,000 turns of 1.5 KB pass the default
                 # 512 MB of sessions.max_bytes_held, as estimated).
                 "sessions.max_open_sessions": max(records, 1), "sessions.max_turns_held": max(records, 1),
                 "sessions.max_bytes_held": 1 << 40,
                 **{f"kafka.{k}": v for k, v in GROUP_TIMINGS.items()}}
    settings = load_settings(environ={}, overrides=overrides, require_topics=False)
    gc.collect()
    before = rss()
    runner = SessionRunner(settings, registry=CollectorRegistry(auto_describe=True), judges=False)
    received = runner.session_metrics.turns._value
    runner.start()
    pause = threading.Event()
    try:
        deadline = time.monotonic() + 1800
        while received.get() == 0:
            if runner.error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the session stage read nothing: {runner.error!r}")
            pause.wait(0.0005)
        started = time.perf_counter()
        while received.get() < records:
            if runner.error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"only {received.get():.0f} of {records} turns: {runner.error!r}")
            pause.wait(0.001)
        rate = records / (time.perf_counter() - started)
        held = runner.sessionizer.turns_open
        grown = rss() - before
        return rate, grown / max(1, held), runner.sessionizer.open_sessions
    finally:
        runner.stop()
        runner.join(120)


def traced_bytes_per_turn(sessions: int, turns: int) -> float:
    """What a `Sessionizer` and its `OffsetTracker` hold per turn, by `tracemalloc`, fed the lines
    directly (decoded as the stage decodes them)."""
    settings = load_settings(environ={}, overrides={"sessions.inactivity_s": 1e6}, require_topics=False)
    metrics = SessionMetrics(CollectorRegistry())
    closed: list[object] = []
    sessionizer = Sessionizer(settings.sessions, metrics, closed.append)
    tracker = OffsetTracker()
    tps = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
    lines = [(hash(k) % PARTITIONS, v) for k, v in result_lines(sessions, turns)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    now, arrival = time.monotonic(), time.time()
    for offset, (p, value) in enumerate(lines):
        tp = tps[p]
        sessionizer.add(tp, decode_turn(value), tracker.track(tp, offset), offset, arrival, now)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert not closed and sessionizer.turns_open == len(lines)
    return held / len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--traced-sessions", type=int, default=20_000,
                        help="sessions fed to the tracemalloc measurement (it is slower)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for name in ("kafka", "tracejudge"):
        logging.getLogger(name).setLevel(logging.ERROR)

    per_turn_traced = traced_bytes_per_turn(args.traced_sessions, args.turns)
    gc.collect()
    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        started = time.perf_counter()
        records, mean = fill_topic(bs, args.sessions, args.turns)
        print(f"topic: {args.sessions:,} sessions x {args.turns} turns = {records:,} result lines "
              f"({mean / 1024:.2f} KB each), {PARTITIONS} partitions; produced in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
        gc.collect()
        gc_policy.apply()  # as `tracejudge sessions` applies it, for both modes
        rates: dict[str, list[float]] = {"raw": [], "sessions": []}
        grown: list[float] = []
        for r in range(args.rounds):
            # The sessions stage first in round one: its resident growth is measured on a fresh heap.
            order = ("sessions", "raw") if r % 2 == 0 else ("raw", "sessions")
            for mode in order:
                if mode == "raw":
                    rates["raw"].append(raw(bs, f"raw-{r}", records))
                else:
                    rate, per_turn, open_sessions = sessions_stage(bs, f"sessions-{r}", records)
                    rates["sessions"].append(rate)
                    grown.append(per_turn)
                    assert open_sessions == args.sessions, open_sessions
            print(f"round {r + 1}: raw {rates['raw'][-1]:,.0f} turns/s, sessions "
                  f"{rates['sessions'][-1]:,.0f} turns/s ({args.sessions:,} sessions open), "
                  f"RSS +{grown[-1]:,.0f} B per turn held",
                  flush=True)
    paired = statistics.median(s / r for s, r in zip(rates["sessions"], rates["raw"], strict=True))
    print(f"\n{'mode':<10}{'turns/s':>11}{'vs raw':>8}")
    for mode in rates:
        print(f"{mode:<10}{statistics.median(rates[mode]):>11,.0f}"
              f"{(paired if mode == 'sessions' else 1.0):>8.0%}")
    print(f"\nmemory per open turn held: {per_turn_traced:,.0f} B by tracemalloc (Sessionizer + offset "
          f"tracker, {args.traced_sessions:,} sessions), {grown[0]:,.0f} B by resident set growth of the "
          f"stage ({args.sessions:,} sessions). Target: under 4,096 B.")
    print(f"tracejudge sessions (no judges): {paired:.0%} of kafka-python's raw consume rate. "
          f"Target: at least 50%.")


if __name__ == "__main__":
    sys.exit(main())
