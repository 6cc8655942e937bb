"""Scale-out: N replicas of `tracejudge run` in one consumer group against N raw kafka-python consumers.

One local Tansu broker (loopback), one topic with --partitions partitions (at least the largest N), filled
once with --records MLflow 3 traces (bench/corpus.py, the smallest of them: 9–15 KB of JSON). Then for
each N in --replicas, two phases, each with a fresh consumer group over the whole topic:

  raw  N processes, each a kafka-python KafkaConsumer.poll() loop doing nothing with the records
  run  N `tracejudge run` processes (no judges, no results topic, metrics on a free loopback port,
       `stream.decode_workers: auto` as deployed)

A phase's clock starts when the group is complete — every one of the N members has partitions and
together they hold all of them — and stops when the last record is counted (raw: each process's counter
in shared memory; run: `tracejudge_records_total` on each replica's /metrics, polled). Its rate is the
records counted in between divided by that span, so process start-up and the group's join are left
out; "before" says how many records the first members had already read while the others were joining
(the rate is meaningless when that is most of them: raise --records). Completion is counted against
what was produced, not against the broker's end offsets.

Efficiency is rate_N / (N/N₀ × rate_N₀), N₀ the smallest N measured (1 by default), per mode; "run/raw"
is run's rate over raw's at the same N. Every figure is the median over --rounds rounds (3), which
alternate the order of the modes. The broker's CPU is its utime+stime (/proc) over the whole
phase, start-up included. On a 2-core machine the broker, the consumers and (for `run`) their decode
workers share two cores, so efficiency there says more about the machine than about the scaling:
run `--replicas 1,2,4,8` on a bigger one.

    python bench/bench_scaleout.py                          # N = 1, 2; 20,000 records; 8 partitions; 3 rounds
    python bench/bench_scaleout.py --replicas 1,2,4,8 --records 80000
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized, SynchronizedArray

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import corpus
from kafka import KafkaConsumer, KafkaProducer

from tracejudge.consumer.demo.broker import LocalBroker
from tracejudge.consumer.demo.command import create_topic

TOPIC = "bench-scaleout"
GROUP_TIMINGS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}
POLL_S = 0.05
PHASE_TIMEOUT_S = 180.0
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    """One mode at one N: the rate over the complete group's span, and what surrounds it."""

    rate: float  # records/s while all N members held partitions
    before: int  # records read before the group was complete
    join_s: float  # phase start to group complete
    span_s: float  # group complete to the last record
    broker_cpu_s: float  # broker utime+stime over the whole phase


def median_phase(phases: list[Phase]) -> Phase:
    """Each figure's median over the rounds (the machine is shared: one round can be slow)."""
    return Phase(*(statistics.median(getattr(p, f) for p in phases)
                   for f in ("rate", "before", "join_s", "span_s", "broker_cpu_s")))


def payloads(distinct: int, high: int) -> list[bytes]:
    traces = sorted((t.encode() for t in corpus.build(distinct * 3, seed=11)), key=len)
    small = [t for t in traces if len(t) <= high][:distinct]
    return small or traces[:distinct]


def fill_topic(bootstrap: str, values: list[bytes], records: int) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=512 * 1024,
                             max_request_size=4 * 1024 * 1024)
    for i in range(records):
        producer.send(TOPIC, value=values[i % len(values)], key=str(i).encode())
    producer.flush(timeout=120)
    producer.close()


def broker_pid(port: int) -> int:
    """The broker is a child of this process: found by its listener URL, so LocalBroker's internals
    stay private."""
    needle = f"tcp://127.0.0.1:{port}".encode()
    for task in pathlib.Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if needle in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
    raise RuntimeError(f"no broker process listening on {needle.decode()} among this process's children")


def cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


# -- raw kafka-python consumers -----------------------------------------------------------------------


def raw_consumer(bootstrap: str, group: str, slot: int, counts: SynchronizedArray,
                 assigned: SynchronizedArray, stop: Synchronized) -> None:
    """One member: counts what it polls and how many partitions it holds, in shared memory."""
    consumer = KafkaConsumer(TOPIC, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                             auto_offset_reset="earliest", **GROUP_TIMINGS)
    try:
        while not stop.value:
            batch = consumer.poll(timeout_ms=100)
            n = sum(len(part) for part in batch.values())
            if n:
                counts[slot] += n
            assigned[slot] = len(consumer.assignment())
    finally:
        consumer.close(autocommit=False)


@contextlib.contextmanager
def raw_group(bootstrap: str, group: str, n: int) -> Iterator[Callable[[], tuple[int, list[int]]]]:
    ctx = mp.get_context("spawn")
    counts, assigned = ctx.Array("q", n), ctx.Array("i", n)
    stop = ctx.Value("b", 0)
    procs = [ctx.Process(target=raw_consumer, args=(bootstrap, group, i, counts, assigned, stop), daemon=True)
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        yield lambda: (sum(counts[:]), list(assigned[:]))
    finally:
        stop.value = 1
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join(5)


# -- tracejudge run replicas --------------------------------------------------------------------------


PORT_LINE = re.compile(rb"serving /metrics, /healthz, /readyz on http://127\.0\.0\.1:(\d+)")
RECORDS = re.compile(r"^tracejudge_records_total\{[^}]*\} ([0-9.e+]+)$", re.M)
ASSIGNED = re.compile(r"ok: (\d+) partitions assigned")


class Replica:
    """One `tracejudge run` process; its port is read from its log (it picks a free one)."""

    def __init__(self, bootstrap: str, group: str, config: pathlib.Path, logs: pathlib.Path) -> None:
        self.log_path = logs
        cmd = [sys.executable, "-m", "tracejudge.consumer.commands.cli", "run", "--config", str(config),
               "--bootstrap-servers", bootstrap, "--topic", TOPIC, "--group-id", group,
               "--metrics-port", "0", "--metrics-bind-address", "127.0.0.1"]
        with open(logs, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.port: int | None = None

    def url(self, path: str) -> str | None:
        if self.port is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tracejudge run exited with {self.proc.returncode}; see {self.log_path}")
            found = PORT_LINE.search(self.log_path.read_bytes())
            if not found:
                return None
            self.port = int(found.group(1))
        return f"http://127.0.0.1:{self.port}{path}"

    def records(self) -> int:
        url = self.url("/metrics")
        if url is None:
            return 0
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(sum(float(v) for v in RECORDS.findall(resp.read().decode())))

    def assigned(self) -> int:
        url = self.url("/readyz")
        if url is None:
            return 0
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = resp.read().decode()
        except urllib.error.HTTPError:  # 503: not ready (no partitions yet)
            return 0
        found = ASSIGNED.search(body)
        return int(found.group(1)) if found else 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # drains and commits, stops its decode worker
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(5)


@contextlib.contextmanager
def run_group(bootstrap: str, group: str, n: int, workdir: pathlib.Path
              ) -> Iterator[Callable[[], tuple[int, list[int]]]]:
    config = workdir / "tracejudge.yaml"
    config.write_text("kafka:\n" + "".join(f"  {k}: {v}\n" for k, v in GROUP_TIMINGS.items()))
    replicas: list[Replica] = []
    try:
        for i in range(n):
            replicas.append(Replica(bootstrap, group, config, workdir / f"{group}-{i}.log"))
        yield lambda: (sum(r.records() for r in replicas), [r.assigned() for r in replicas])
    finally:
        for r in replicas:
            r.stop()


# -- a phase ------------------------------------------------------------------------------------------


def measure(progress: Callable[[], tuple[int, list[int]]], records: int, partitions: int, broker: int,
            started: float, cpu0: float) -> Phase:
    """Poll until every record is counted (bounded by PHASE_TIMEOUT_S)."""
    ready_at: float | None = None
    before = 0
    deadline = started + PHASE_TIMEOUT_S
    while True:
        now = time.perf_counter()
        done, held = progress()
        if ready_at is None and all(held) and sum(held) >= partitions:
            ready_at, before = now, done
        if done >= records:
            if ready_at is None:  # all read before the group was complete: no span to measure
                ready_at, before = now, done
            span = now - ready_at
            rate = (done - before) / span if span > 0 else float("nan")
            return Phase(rate, before, ready_at - started, span, cpu_seconds(broker) - cpu0)
        if now > deadline:
            raise RuntimeError(f"{done} of {records} records counted within {PHASE_TIMEOUT_S:.0f}s "
                               f"(partitions held: {held})")
        time.sleep(POLL_S)


def phase(mode: str, bootstrap: str, n: int, records: int, partitions: int, broker: int,
          workdir: pathlib.Path) -> Phase:
    group = f"{mode}-{n}-{time.time_ns()}"
    cpu0, started = cpu_seconds(broker), time.perf_counter()
    members = raw_group(bootstrap, group, n) if mode == "raw" else run_group(bootstrap, group, n, workdir)
    with members as progress:
        return measure(progress, records, partitions, broker, started, cpu0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="1,2", help="comma-separated N to measure (default 1,2)")
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="medians over this many rounds")
    parser.add_argument("--distinct", type=int, default=40, help="distinct traces, repeated to --records")
    args = parser.parse_args()
    ns = sorted({int(x) for x in args.replicas.split(",") if x.strip()})
    if not ns or ns[0] < 1 or args.rounds < 1:
        parser.error(f"--replicas {args.replicas!r}: give positive counts, e.g. 1,2,4 (and --rounds >= 1)")
    if args.partitions < ns[-1]:
        parser.error(f"--partitions {args.partitions} is below the largest N ({ns[-1]}): "
                     "extra replicas would sit idle")

    values = payloads(args.distinct, 15 * 1024)
    sizes = sorted(len(v) for v in values)
    print(f"corpus: {len(values)} distinct MLflow 3 traces, {sizes[0] / 1024:.1f}–{sizes[-1] / 1024:.1f} KB "
          f"(median {statistics.median(sizes) / 1024:.1f} KB), repeated to {args.records} records on "
          f"{args.partitions} partitions; {os.cpu_count()} CPUs", flush=True)
    rounds: dict[tuple[str, int], list[Phase]] = {}
    with LocalBroker() as broker, tempfile.TemporaryDirectory(prefix="bench-scaleout-") as tmp:
        bs = broker.bootstrap_servers
        create_topic(bs, TOPIC, args.partitions)
        fill_topic(bs, values, args.records)
        pid = broker_pid(broker.port)
        for r in range(args.rounds):
            # raw first, then run first: a drift of the machine's speed favours neither mode.
            for n in ns:
                for mode in ("raw", "run") if r % 2 == 0 else ("run", "raw"):
                    got = phase(mode, bs, n, args.records, args.partitions, pid, pathlib.Path(tmp))
                    rounds.setdefault((mode, n), []).append(got)
                    print(f"round {r + 1} N={n} {mode}: {got.rate:,.0f} records/s ({got.before:,} read "
                          f"while joining, join {got.join_s:.1f}s, span {got.span_s:.1f}s, broker CPU "
                          f"{got.broker_cpu_s:.1f}s)", flush=True)
    results = {key: median_phase(v) for key, v in rounds.items()}

    n0 = ns[0]

    def efficiency(mode: str, n: int) -> float:
        return results[mode, n].rate / (n / n0 * results[mode, n0].rate)

    print(f"\n{'N':>3}{'raw rec/s':>11}{'raw eff':>9}{'run rec/s':>11}{'run eff':>9}{'run/raw':>9}"
          f"{'broker CPU s raw':>18}{'run':>6}{'before raw/run':>16}")
    for n in ns:
        r, t = results["raw", n], results["run", n]
        print(f"{n:>3}{r.rate:>11,.0f}{efficiency('raw', n):>9.0%}"
              f"{t.rate:>11,.0f}{efficiency('run', n):>9.0%}{t.rate / r.rate:>9.0%}"
              f"{r.broker_cpu_s:>18.1f}{t.broker_cpu_s:>6.1f}"
              f"{f'{r.before:,}/{t.before:,}':>16}")
    top = ns[-1]
    print(f"\n{top} replicas of `tracejudge run`: {results['run', top].rate:,.0f} records/s, "
          f"{efficiency('run', top):.0%} scaling efficiency from N={n0} "
          f"(raw kafka-python: {results['raw', top].rate:,.0f}/s, {efficiency('raw', top):.0%}); "
          f"run/raw {results['run', top].rate / results['raw', top].rate:.0%} at N={top}, "
          f"{results['run', n0].rate / results['raw', n0].rate:.0%} at N={n0}; on {os.cpu_count()} CPUs.")


if __name__ == "__main__":
    main()
