"""Decode and score records in worker processes, so `tracejudge run` can use more than one CPU.

One Python process runs one thread at a time: kafka-python's IO thread and the poll loop take turns,
and decoding a 20 KB trace costs about twice what fetching it does. With `stream.decode_workers: N`
the poll loop hands each fetched batch of single-record formats (MLflow, agent-evaluation records,
inference logs) to a worker process, which runs the same `Pipeline.normalise` + `Pipeline.evaluate`
the loop would, and sends back each whole `EvaluationResult`:

    poll loop ──batch──▶ sender thread ──pipe──▶ worker process (Pipeline built from the same settings)
                                                        │
    RecordProcessor.finish_decoded ◀── receiver thread ◀┘   (exports, publishes, releases the ticket)

Both ways of decoding sit behind one interface, `Decoder`: `InlineDecoder` (on the poll thread) and
`WorkerPoolDecoder` (this pool, falling back to inline decoding); `RecordProcessor`
(`consumer/stages/processing.py`) hands every single-record format to its decoder and is told the
outcome through `finish_decoded`, whichever decoded it.

Nothing changes for at-least-once: a record's ticket is held by an export from the moment it is handed
over, so the in-flight cap, revocation and shutdown wait for it like for any other export. A worker that
dies (OOM-killed, a crash in native code) hands its unfinished records back to be decoded in the
consumer process (counted in tracejudge_decode_workers_lost) and is replaced by a new one, up to three
times in ten minutes; the consumer process decodes its share meanwhile, or for good past that.
OTLP topics (trace assembly) and custom format handlers stay in the consumer process.

`stream.decode_workers: auto` (the default) starts one worker when the process may use two CPUs or
more (`available_cpus`: its affinity mask, lowered by a cgroup CPU quota), none otherwise. One, not
one per CPU: with one worker the consumer process (fetching, exporting, committing) is already about
as busy as the worker, so a second one mostly waits for it; and below two CPUs the hand-over costs
more CPU than it frees.

Workers are plain subprocesses (`python -c …`) speaking over a socket pair, not multiprocessing
children: a spawned multiprocessing child re-imports the parent's `__main__`, which breaks a script
that embeds `StreamRunner` without an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pathlib
import pickle
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import msgspec

from tracejudge.consumer.runtime import gc_policy
from tracejudge.consumer.runtime.offsets import Export
from tracejudge.schemas.errors import RecordError, exception_text
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import EvaluationResult, SourceRef

if TYPE_CHECKING:
    from tracejudge.consumer.config import Settings
    from tracejudge.consumer.pipeline import Pipeline

__all__ = ["DECODE", "EVALUATE", "DecodePool", "Decoded", "Decoder", "Handed", "InlineDecoder",
           "WorkerPoolDecoder", "WorkerStartError", "auto_workers", "available_cpus", "decode_one"]

log = logging.getLogger("tracejudge.run")

# Where a record failed: its payload could not be decoded (dead-lettered with its value), or the
# computed metrics raised (dead-lettered without it, as in the consumer process).
DECODE, EVALUATE = "decode", "evaluate"
_READY = b"ready"
_STOP = b""


class Decoded(msgspec.Struct, array_like=True, gc=False):
    """What a decoder says of one record: its whole evaluation result (record, metrics, metric
    errors; the source is the consumer's to fill in), or why there is none."""

    result: EvaluationResult | None = None
    source_format: str | None = None
    failed_at: str | None = None  # DECODE or EVALUATE
    reason: str | None = None  # the dead-letter reason
    message: str | None = None
    traceback: str | None = None  # an unexpected exception's, for the consumer's log
    seconds: float = 0.0
    # The result could not cross the process boundary (an integer beyond 64 bits, which only the
    # Python-json fallback keeps): the consumer process decodes this record itself.
    redo: bool = False

    @property
    def record(self) -> EvalRecord | None:
        return None if self.result is None else self.result.record

    @property
    def metrics(self) -> dict[str, Any] | None:
        return None if self.result is None else self.result.metrics

    @property
    def metric_errors(self) -> dict[str, str] | None:
        return None if self.result is None else self.result.metric_errors


def decode_one(pipeline: Pipeline, value: bytes, fmt: str | None) -> Decoded:
    """`Pipeline.normalise` then `Pipeline.evaluate` of one payload; never raises."""
    from tracejudge.consumer.runtime.producing import PROCESSING_ERROR

    started = time.perf_counter()
    try:
        record = pipeline.normalise(value, fmt)
    except RecordError as exc:
        return Decoded(failed_at=DECODE, reason=exc.reason, message=exc.message,
                       seconds=time.perf_counter() - started)
    except Exception as exc:
        return Decoded(failed_at=DECODE, reason=PROCESSING_ERROR, message=exception_text(exc),
                       traceback=traceback.format_exc(), seconds=time.perf_counter() - started)
    try:
        # The app norms' state is the consumer process's: `RecordProcessor` applies them on return.
        result = pipeline.evaluate(record, SourceRef(format=record.source_format), norms=False)
    except Exception as exc:
        return Decoded(source_format=record.source_format, failed_at=EVALUATE, reason=PROCESSING_ERROR,
                       message=exception_text(exc), traceback=traceback.format_exc(),
                       seconds=time.perf_counter() - started)
    return Decoded(result=result, source_format=record.source_format, seconds=time.perf_counter() - started)


def serve(fd: int) -> None:
    """The worker process's entry point (`python -c`): `fd` is its end of the socket pair. The first
    message is the consumer's `sys.path` and settings (pickled: it holds the secrets the pipeline
    needs, and never leaves the pair of processes), then batches until told to stop or orphaned."""
    # The consumer process owns shutdown: Ctrl-C in a terminal reaches the whole process group, and
    # the worker must finish what it was given rather than die with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        path, settings = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    # Custom metrics are named by dotted path: the worker must find what the consumer process finds.
    sys.path[:] = path
    with contextlib.suppress(EOFError, OSError):  # EOF or a broken pipe: the consumer process is gone
        _serve(conn, settings)


def _serve(conn: Connection, settings: Settings) -> None:
    from tracejudge.consumer.pipeline import build_pipeline

    try:
        pipeline = build_pipeline(settings)
    except Exception as exc:
        conn.send_bytes(f"{type(exc).__name__}: {exc}".encode())
        return
    gc_policy.apply()  # the worker is a process of its own: its collector is ours
    conn.send_bytes(_READY)
    encoder = msgspec.msgpack.Encoder()
    while (data := conn.recv_bytes()) != _STOP:
        out = [decode_one(pipeline, value, fmt) for value, fmt in _batch(data)]
        try:
            reply = encoder.encode(out)
        except (TypeError, OverflowError, ValueError):
            reply = encoder.encode([_transferable(encoder, d) for d in out])
        conn.send_bytes(reply)


# A batch on the wire: the byte length of a msgpack header, the header ([[value length, format],
# ...]), then the values back to back. The values go out as they came from Kafka, each its own
# buffer in one writev (`_write_parts`): no copy into a message the size of the batch (~10 MB).
_LENGTH = struct.Struct("!I")
_HEADER = msgspec.msgpack.Decoder(list[tuple[int, str | None]])


def _batch_parts(values: Sequence[tuple[bytes, str | None]]) -> list[bytes]:
    header = msgspec.msgpack.encode([(len(value), fmt) for value, fmt in values])
    body = [_LENGTH.pack(len(header)), header, *(value for value, _ in values)]
    total = sum(map(len, body))
    # multiprocessing's framing, which the worker's `recv_bytes` reads: a 4-byte length, or -1 and
    # an 8-byte one past 2 GiB.
    prefix = struct.pack("!i", total) if total <= 0x7FFFFFFF else struct.pack("!iQ", -1, total)
    return [prefix, *body]


def _batch(data: bytes) -> list[tuple[bytes, str | None]]:
    view = memoryview(data)
    (size,) = _LENGTH.unpack_from(view)
    at = _LENGTH.size + size
    out = []
    for length, fmt in _HEADER.decode(view[_LENGTH.size:at]):
        out.append((data[at:at + length], fmt))
        at += length
    if at != len(data):
        raise ValueError(f"a batch of {len(data)} bytes whose header accounts for {at}")
    return out


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _write_parts(fd: int, parts: list[bytes],
                 writev: Callable[[int, Sequence[Any]], int] = os.writev) -> None:
    """Write `parts` in order and whole: a few writev calls for the lot, resuming after a short
    write (a signal can interrupt a blocking one)."""
    views = [memoryview(p) for p in parts if p]
    i = 0
    while i < len(views):
        written = writev(fd, views[i:i + _IOV_MAX])
        while written and i < len(views):
            size = views[i].nbytes
            if written >= size:
                written -= size
                i += 1
            else:  # the rest of this part goes first next time
                views[i] = views[i][written:]
                written = 0


def _transferable(encoder: msgspec.msgpack.Encoder, decoded: Decoded) -> Decoded:
    try:
        encoder.encode(decoded)
    except (TypeError, OverflowError, ValueError):
        return Decoded(redo=True)
    return decoded


# Socket buffers for the pipe to a worker (a Unix socket pair). A batch is ~500 records of ~20 KB:
# through the default ~200 KB buffers it crosses in ~50 chunks, each a system call and a wake-up on
# both sides: ~10 µs of the sending side's CPU per record in a two-process measurement, ~4 with 4 MB
# buffers (and wall time per record 21 -> 6.5 µs).
# The kernel caps the size at net.core.wmem_max / rmem_max; a smaller cap only costs speed.
_PIPE_BUFFER_BYTES = 4 * 1024 * 1024


def _widen(sock: socket.socket) -> None:
    """Raise the socket buffers of one end of the pair (each end has its own); best effort."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _PIPE_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _PIPE_BUFFER_BYTES)


def available_cpus(cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
                   proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup") -> int:
    """CPUs this process may keep busy: its affinity mask, lowered to a cgroup CPU quota (a
    container's CPU limit; cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`) rounded down, at least 1.
    A quota of 1.5 CPUs counts as 1: handing records to a worker costs CPU of its own, which pays
    off only with two whole CPUs."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota(pathlib.Path(cgroup_root), pathlib.Path(proc_cgroup))
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def _cgroup_quota(root: pathlib.Path, proc_cgroup: pathlib.Path) -> float | None:
    """The tightest CPU quota, in CPUs, over this process's cgroup and its ancestors; None if none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":  # cgroup v2: "0::/path", files under the one mount
            v2, mount = True, root
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            v2 = False
            mount = next((root / name for name in (controllers, "cpu", "cpu,cpuacct")
                          if (root / name).is_dir()), None)
            if mount is None:
                continue
        else:
            continue
        # Inside a container's cgroup namespace the path is "/" and the mount is the cgroup itself;
        # outside one, walk from the process's own cgroup up to the root.
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            directory = mount.joinpath(*parts[:depth])
            quota = _read_v2_quota(directory) if v2 else _read_v1_quota(directory)
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def _read_v2_quota(directory: pathlib.Path) -> float | None:
    try:
        limit, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        return None if limit == "max" else int(limit) / int(period or 100_000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_v1_quota(directory: pathlib.Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def auto_workers(cpus: int) -> int:
    """`stream.decode_workers: auto`: one worker from two CPUs up (see the module docstring)."""
    return 1 if cpus >= 2 else 0


class WorkerStartError(RuntimeError):
    """A decode worker could not start; the message says why."""


# One handed-over record as the consumer process keeps it: whatever the caller needs to finish it.
Item = Any
OnDecoded = Callable[[Item, Decoded], None]
OnLost = Callable[[Sequence[Item]], None]


class _Worker:
    def __init__(self, index: int, settings: Settings, on_decoded: OnDecoded, on_lost: OnLost,
                 on_exit: Callable[[_Worker, int | None], None]) -> None:
        self.index = index
        self._settings = settings
        self.process: subprocess.Popen[bytes] | None = None
        self._on_decoded, self._on_lost, self._on_exit = on_decoded, on_lost, on_exit
        # Batches sent and not yet answered, oldest first: the worker answers in order.
        self._pending: deque[list[Item]] = deque()
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        self._closing = False
        self.alive = False

    def start(self, timeout: float) -> None:
        ours, theirs = socket.socketpair()
        _widen(ours)
        _widen(theirs)
        self._conn = Connection(ours.detach())
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import serve; serve({theirs.fileno()})"],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as exc:
            self._conn.close()
            raise WorkerStartError(f"decode worker {self.index} could not start: {exc}") from None
        finally:
            theirs.close()  # the worker's copy is its own: its death reads as EOF here
        try:
            self._handshake(timeout)
        except WorkerStartError:
            self._wait(0)  # killed if it still runs, and reaped
            self._conn.close()
            raise
        self.alive = True
        self._threads = 2
        # Sending and receiving on separate threads: a large batch going out while results come
        # back would otherwise fill both pipe buffers and block both processes.
        threading.Thread(target=self._send_loop, name=f"tracejudge-decode-{self.index}-send",
                         daemon=True).start()
        threading.Thread(target=self._receive_loop, name=f"tracejudge-decode-{self.index}-receive",
                         daemon=True).start()

    def _handshake(self, timeout: float) -> None:
        """Give the worker its settings and wait for it to have built its pipeline."""
        assert self.process is not None
        try:
            self._conn.send_bytes(pickle.dumps((sys.path, self._settings)))
        except (OSError, pickle.PicklingError) as exc:
            raise WorkerStartError(f"decode worker {self.index} could not be given its settings: "
                                   f"{exc}") from None
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self.process.poll() is not None:
                break  # its exit code is reported below
            if time.monotonic() > deadline:
                raise WorkerStartError(f"decode worker {self.index} did not start within {timeout:.0f} s")
        try:
            hello = self._conn.recv_bytes()
        except (EOFError, OSError):
            raise WorkerStartError(f"decode worker {self.index} exited while starting (exit code "
                                   f"{self._wait(5)})") from None
        if hello != _READY:
            raise WorkerStartError(f"decode worker {self.index} could not build the pipeline: "
                                   f"{hello.decode(errors='replace')}")

    def _wait(self, timeout: float) -> int | None:
        """The worker's exit code once it has exited (killed after `timeout` seconds)."""
        assert self.process is not None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def submit(self, items: list[Item], parts: list[bytes]) -> bool:
        """Queue one batch; False once the worker is gone (its receiver has handed back all it held,
        so a batch queued now would never be answered nor handed back)."""
        with self._lock:
            if not self.alive:
                return False
            self._pending.append(items)
        self._outbox.put(parts)
        return True

    def close(self) -> None:
        self._closing = True
        self._outbox.put(None)

    def _send_loop(self) -> None:
        while (parts := self._outbox.get()) is not None:
            try:
                _write_parts(self._conn.fileno(), parts)
            except OSError:  # the worker is gone: the receiver hands its batches back
                break
        else:
            with contextlib.suppress(OSError):
                self._conn.send_bytes(_STOP)
        self._thread_done()

    def _thread_done(self) -> None:
        # The sender and the receiver share the socket: the last of them to end closes it. Closed
        # under a thread still writing, its descriptor number could be reused by another socket
        # (a Kafka connection, say) and receive the rest of a batch.
        with self._lock:
            self._threads -= 1
            last = self._threads == 0
        if last:
            self._conn.close()

    def _receive_loop(self) -> None:
        replies = msgspec.msgpack.Decoder(list[Decoded])
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                break
            with self._lock:
                items = self._pending.popleft()
            if self._closing:
                continue  # past the shutdown grace: these records are re-delivered
            for item, decoded in zip(items, replies.decode(data), strict=True):
                try:
                    self._on_decoded(item, decoded)
                except Exception:  # the callback's own errors are its to log; the worker goes on
                    log.exception("finishing a decoded record failed")
        with self._lock:  # `submit` checks `alive` under the same lock: nothing is queued past this
            self.alive = False
            unanswered = [item for batch in self._pending for item in batch]
            self._pending.clear()
        self._outbox.put(None)  # the sender ends too, if it has not already
        exitcode = self._wait(5)
        if not self._closing:
            self._on_exit(self, exitcode)
            if unanswered:
                self._on_lost(unanswered)
        self._thread_done()


class DecodePool:
    """`workers` decode processes fed round-robin, batch by batch.

    `on_decoded(item, decoded)` and `on_lost(items)` run on the pool's receiver threads; `on_lost`
    gets the records a dead worker held, to be decoded by the caller. `submit` returns False when no
    worker is alive (the caller decodes in-process). A worker that dies is replaced by a new one, at
    most `max_restarts` times in `restart_window` seconds: one that keeps dying (out of memory on
    every batch, say) stays dead and the caller decodes its share.
    """

    def __init__(self, settings: Settings, workers: int, *, on_decoded: OnDecoded, on_lost: OnLost,
                 on_worker_lost: Callable[[], None] | None = None, max_restarts: int = 3,
                 restart_window: float = 600.0) -> None:
        self._settings, self._on_decoded, self._on_lost = settings, on_decoded, on_lost
        self._workers = [self._new(i) for i in range(workers)]
        self._on_worker_lost = on_worker_lost
        self._next = 0
        self._timeout = 120.0
        self._max_restarts, self._restart_window = max_restarts, restart_window
        self._restarts: deque[float] = deque()
        self._starting: list[_Worker] = []  # replacements being started, for close() to stop
        self._closed = False
        self._lock = threading.Lock()
        # Read for every record, so a plain attribute, kept up to date by start, close and _exited.
        self.alive = False

    def _new(self, index: int) -> _Worker:
        return _Worker(index, self._settings, self._on_decoded, self._on_lost, self._exited)

    def start(self, timeout: float = 120.0) -> DecodePool:
        """Start every worker and wait until each has built its pipeline; `WorkerStartError` if one
        cannot (the others are stopped)."""
        self._timeout = timeout
        try:
            for worker in self._workers:
                worker.start(timeout)
        except BaseException:
            self.close(0)
            raise
        self.alive = True
        return self

    def live(self) -> int:
        """How many workers are running."""
        return sum(w.alive for w in self._workers)

    def submit(self, items: list[Item], values: list[tuple[bytes, str | None]]) -> bool:
        """Hand one batch to the next live worker; False when none is alive."""
        parts = None
        for _ in range(len(self._workers)):
            worker = self._workers[self._next]
            self._next = (self._next + 1) % len(self._workers)
            if worker.alive:
                parts = parts or _batch_parts(values)
                if worker.submit(items, parts):
                    return True
        return False

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers: each finishes the batch it is on, and is killed after `timeout`."""
        with self._lock:
            self._closed = True
            starting = list(self._starting)
        self.alive = False
        for worker in self._workers:
            worker.close()
        for worker in starting:  # its start fails on the kill, and it is not put in place
            if worker.process is not None:
                worker.process.kill()
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            if worker.process is not None:
                worker._wait(max(0.0, deadline - time.monotonic()))

    def _exited(self, worker: _Worker, exitcode: int | None) -> None:
        self.alive = any(w.alive for w in self._workers)
        now = time.monotonic()
        with self._lock:
            while self._restarts and now - self._restarts[0] > self._restart_window:
                self._restarts.popleft()
            restart = not self._closed and len(self._restarts) < self._max_restarts
            if restart:
                self._restarts.append(now)
        if restart:
            then = "starting a new one"
        else:
            then = (f"not restarted: {self._max_restarts} restarts in the last "
                    f"{self._restart_window / 60:g} min; restart tracejudge to get it back")
        log.error("decode worker %d exited unexpectedly (exit code %s); its records are decoded in the "
                  "consumer process%s; %s", worker.index, exitcode,
                  "" if self.alive else ", as are all records until a worker runs again", then)
        if self._on_worker_lost is not None:
            self._on_worker_lost()
        if restart:
            threading.Thread(target=self._restart, args=(worker.index,), daemon=True,
                             name=f"tracejudge-decode-{worker.index}-restart").start()

    def _restart(self, index: int) -> None:
        fresh = self._new(index)
        with self._lock:
            if self._closed:
                return
            self._starting.append(fresh)
        try:
            fresh.start(self._timeout)
        except WorkerStartError as exc:
            if not self._closed:
                log.error("decode worker %d could not be restarted: %s", index, exc)
            return
        finally:
            with self._lock:
                self._starting.remove(fresh)
        with self._lock:
            closed = self._closed
            if not closed:
                self._workers[index] = fresh
                self.alive = True
        if closed:  # close() ran while it started: it is not ours to keep
            fresh.close()
            fresh._wait(5)
            return
        log.info("decode worker %d restarted", index)


# -- the one interface of decoding: here, or in the pool --------------------------------------------


class Handed(NamedTuple):
    """One record handed to a decoder, as the consumer process keeps it until it is finished."""

    record: Any  # the fetched ConsumerRecord: its value, and its key and headers for a dead letter
    source: SourceRef
    export: Export  # holds the record's ticket until its result or dead letter is acknowledged
    fmt: str | None  # the topic's format; None detects it
    started: float  # time.perf_counter() when the poll loop took the record


# Export, judge and publish (or dead-letter) what a decoder made of one record; never raises.
Finish = Callable[[Handed, Decoded], None]
# Observes a record's processing time (tracejudge_record_processing_seconds).
Observe = Callable[[float], None]


class Decoder(Protocol):
    """Turns the records of single-record formats into evaluation results for `RecordProcessor`
    (consumer/stages/processing.py), which binds itself once and is told of each outcome through
    `finish`. A decoder observes each record's processing time: the poll thread's time for a record
    decoded there, the worker's for one a worker decoded."""

    def bind(self, pipeline: Pipeline, finish: Finish, observe: Observe) -> None: ...

    def submit(self, item: Handed) -> None:
        """Take over one record (its export holds the ticket); never raises."""

    def flush(self) -> None:
        """The poll's records are all in: hand on what was gathered."""

    def close(self) -> None: ...


class InlineDecoder:
    """Decodes on the calling thread (the poll loop, or a pool's receiver for what a worker gave back)."""

    def __init__(self) -> None:
        self._pipeline: Pipeline | None = None
        self._finish: Finish | None = None
        self._observe: Observe | None = None

    def bind(self, pipeline: Pipeline, finish: Finish, observe: Observe) -> None:
        self._pipeline, self._finish, self._observe = pipeline, finish, observe

    def submit(self, item: Handed) -> None:
        self.decode((item,))

    def decode(self, items: Sequence[Handed]) -> None:
        pipeline, finish, observe = self._pipeline, self._finish, self._observe
        assert pipeline is not None and finish is not None and observe is not None, "bind() first"
        for item in items:
            finish(item, decode_one(pipeline, item.record.value, item.fmt))
            observe(time.perf_counter() - item.started)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class WorkerPoolDecoder:
    """Hands a poll's records to a `DecodePool`, one batch per poll; decodes inline what no live worker
    can take, what a dead worker held and a result that could not cross the process boundary."""

    def __init__(self, settings: Settings, workers: int, *,
                 on_worker_lost: Callable[[], None] | None = None) -> None:
        self.pool = DecodePool(settings, workers, on_decoded=self._decoded, on_lost=self._lost,
                               on_worker_lost=on_worker_lost)
        self.inline = InlineDecoder()
        self._batch: list[Handed] = []
        self._finish: Finish | None = None
        self._observe: Observe | None = None

    def start(self, timeout: float = 120.0) -> WorkerPoolDecoder:
        """Start the workers (`WorkerStartError` if one cannot)."""
        self.pool.start(timeout)
        return self

    def bind(self, pipeline: Pipeline, finish: Finish, observe: Observe) -> None:
        self.inline.bind(pipeline, finish, observe)
        self._finish, self._observe = finish, observe

    def submit(self, item: Handed) -> None:
        if self.pool.alive:
            self._batch.append(item)
        else:
            self.inline.submit(item)

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if batch and not self.pool.submit(batch, [(item.record.value, item.fmt) for item in batch]):
            self.inline.decode(batch)

    def close(self) -> None:
        self.pool.close()

    def _decoded(self, item: Handed, decoded: Decoded) -> None:
        """A worker's answer (on its receiver thread)."""
        if decoded.redo:
            self.inline.decode((item,))
            return
        assert self._finish is not None and self._observe is not None, "bind() first"
        self._observe(decoded.seconds)
        self._finish(item, decoded)

    def _lost(self, items: Sequence[Handed]) -> None:
        self.inline.decode(items)
