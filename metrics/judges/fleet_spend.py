"""Fleet-wide spend caps: `usd_per_hour` / `usd_per_day` held across every replica that shares the
configuration (`judges.fleet_spend:`), not per process.

Without it each process charges its own memory (`budget.SpendCap`), so N replicas spend up to N x the
cap. With it, a replica spends only within *leases* it claimed on one Kafka partition (partition 0 of
`fleet_spend.topic`): a claim is a record `claim|endpoint|window|bucket|replica|incarnation|seq`
holding the USD it asks for and the cap it asks under. Every replica reads the partition from the
beginning and decides each claim the same way, in log order: granted when the window's granted total
plus the claim fits the claim's cap, else denied. So the granted leases of a window never exceed the
cap, whatever the number of replicas or their timing, and no replica waits for another to answer.

A lease is `cap / (4 x max_replicas)` (more when one judgement's estimate needs more, less for the
last of the cap); a replica claims the next one when what is left of its lease falls under half a
lease, and only when it has judgements to charge. A replica that charged nothing for two publish
intervals gives the unspent part back (`release|...`, applied in log order too), so a busy replica can
use the rest of the cap while the others are idle. A judgement is charged its estimate (`spending`)
against the lease and settled with what the endpoint reported.

The windows are calendar buckets in UTC (the hour / the day a charge falls in; the local sliding
`SpendCap` still applies too). The bound, per endpoint and window bucket:

    billed <= cap + overrun + fallback_replicas x cap / max_replicas

where `overrun` is usage reported above the judgements' estimates (zero while prompts are no longer
than twice the 4-characters-per-token estimate and answers stay under `max_output_tokens`) and the
last term only counts replicas that could not reach the topic (below). With every replica reaching
the topic the bound is the cap itself.

Each replica also publishes what it spent per bucket (`spend|endpoint|window|bucket|replica`, the
compacted part: the latest value per replica) every `publish_interval_s`; the sum is the fleet total
(`tracejudge_judge_spend_fleet_usd`). A replica killed mid-window leaves its claims and its last spend
record on the topic: its leases stay granted (nothing is freed) and are counted once. Restarted with
the same `replica_id` (the pod name) it resumes its spend record; under a new id the old record stays
as it was. A restart never reuses its previous incarnation's unspent lease (it cannot know what was
billed after its last record), so at most one lease and a half per kill go unused.

When the topic cannot be read for `stale_after_s` (or was never read that long after start), a
replica falls back to a conservative local share: it may spend `max(its granted leases, cap /
max_replicas)` in the bucket; `tracejudge_judge_spend_fleet_fallback{endpoint}` is 1 meanwhile and
the change is logged. The Kafka side (the reader thread and the producer) is
`tracejudge.consumer.runtime.fleet_spend`, which attaches to the ledgers made in its process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry, Gauge
from pydantic import Field, field_validator

from tracejudge.metrics.judges.budget import WINDOWS
from tracejudge.metrics.judges.endpoints import StrictSection

__all__ = ["FleetSpendConfig", "FleetSpendLedger", "FleetSpendMetrics", "unattached_ledgers"]

log = logging.getLogger("tracejudge.judges")

# A lease is the cap divided by this many times `max_replicas`.
LEASES_PER_REPLICA = 4
_EPSILON = 1e-9


class FleetSpendConfig(StrictSection):
    """`judges.fleet_spend:`: the Kafka topic the replicas share their spend on (one partition is used:
    0), and the fallback share. Every replica of a deployment (`tracejudge run`, `sessions`,
    `backfill`) must name the same topic and caps."""

    # The Kafka topic the replicas share their leases and spend on (one partition is used).
    topic: str = Field(default="tracejudge-spend", min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")
    # None: "<hostname>-<pid>" (a restart is a new replica); set it to the pod name to resume.
    replica_id: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[^|\s]+$")
    # The replicas the deployment may run at most (KEDA's maxReplicaCount): sizes the lease and the
    # fallback share (cap / max_replicas).
    max_replicas: int = Field(default=10, ge=1, le=10000)
    # How often each replica publishes what it spent.
    publish_interval_s: float = Field(default=2.0, gt=0, le=300)
    # How long a judgement waits for a lease it claimed (the first of a window, or when the next one
    # was not claimed in time) before it is skipped as budget. The runner awaits it (`charge`): the
    # other judgements on its event loop go on meanwhile.
    claim_wait_s: float = Field(default=1.0, ge=0, le=30)
    # A replica that cannot read the topic this long falls back to its local share (cap / max_replicas);
    # longer than publish_interval_s.
    stale_after_s: float = Field(default=30.0, gt=0, le=3600)

    @field_validator("stale_after_s")
    @classmethod
    def _after_publish(cls, v: float, info: Any) -> float:
        interval = info.data.get("publish_interval_s")
        if interval is not None and v <= interval:
            raise ValueError(f"must be longer than publish_interval_s ({interval:g})")
        return v

    def replica(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"


class FleetSpendMetrics:
    """`tracejudge_judge_spend_fleet_usd{endpoint,window}` and `tracejudge_judge_spend_fleet_fallback
    {endpoint}`, once per registry (trace and session runners may share one)."""

    _by_registry: ClassVar[weakref.WeakKeyDictionary[CollectorRegistry, FleetSpendMetrics]] = (
        weakref.WeakKeyDictionary())
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.fleet = Gauge("tracejudge_judge_spend_fleet_usd", "USD the whole fleet spent on a judge "
                           "endpoint in the current window bucket (UTC hour / day), as this replica sees it "
                           "(judges.fleet_spend).", ["endpoint", "window"], registry=registry)
        self.fallback = Gauge("tracejudge_judge_spend_fleet_fallback", "1 while this replica cannot read the "
                              "fleet's spend and charges a local share (cap / max_replicas) instead.",
                              ["endpoint"], registry=registry)

    @classmethod
    def of(cls, registry: CollectorRegistry) -> FleetSpendMetrics:
        with cls._lock:
            found = cls._by_registry.get(registry)
            if found is None:
                found = cls._by_registry[registry] = cls(registry)
            return found


@dataclass(slots=True)
class _View:
    """The fleet's claims and spend for one (endpoint, window, bucket), as read from the topic."""

    granted: float = 0.0
    spent: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _Lease:
    """This incarnation's lease on one (endpoint, window) in the current bucket."""

    endpoint: str
    window: str
    bucket: int
    granted: float = 0.0
    spent: float = 0.0  # charged by this incarnation (estimates in flight included)
    resumed: float = 0.0  # what earlier incarnations of the same replica id recorded
    pending: str | None = None  # the key of the claim in flight
    pending_at: float = 0.0
    releasing: float = 0.0  # given back (no longer spendable), not yet read back from the log
    released: set[str] = field(default_factory=set)  # this incarnation's releases read back

    @property
    def room(self) -> float:
        return self.granted - self.releasing - self.spent


# The open ledgers of this process (a ledger leaves when its runner closes: `close`), and how many
# were ever made per configured replica id (names the second runner's "~1", the third's "~2", ...:
# never a name a ledger of this process had, even a closed one whose last record is still on the topic).
_LEDGERS: weakref.WeakSet[FleetSpendLedger] = weakref.WeakSet()
_MADE: dict[str, int] = {}
_LEDGERS_LOCK = threading.Lock()

# `_attempt`'s answer when the charge may fit once a claim in flight is decided.
_WAIT: Any = object()


def unattached_ledgers() -> list[FleetSpendLedger]:
    """The open ledgers of this process that no Kafka transport serves yet (the runtime attaches them)."""
    with _LEDGERS_LOCK:
        return [ledger for ledger in list(_LEDGERS) if not ledger.attached]


class FleetSpendLedger:
    """One runner's view of the fleet's spend: charges against leases, decides claims from the log,
    and queues the records its transport sends. See the module docstring.

    Threads: the runner's event loop charges (`charge`, or `try_charge` from a plain thread) and the
    transport's thread applies the log (`apply`, `synced`, ...). `_lock` guards every field, the
    waiters included. A judgement waiting for a claim's decision registers a waker under `_lock` in
    the same critical section as the attempt that found no room, so no decision is missed; the
    transport's thread calls the wakers after releasing `_lock`, and a waker only hands its loop a
    callback (`loop.call_soon_threadsafe`): the asyncio objects are touched on their loop alone."""

    def __init__(self, config: FleetSpendConfig, registry: CollectorRegistry | None = None, *,
                 wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        with _LEDGERS_LOCK:  # a second runner in the process (session judges) is a replica of its own
            same = _MADE.get(config.replica(), 0)
            _MADE[config.replica()] = same + 1
        self.replica = config.replica() + (f"~{same}" if same else "")
        self.incarnation = uuid.uuid4().hex[:12]
        self.attached = False
        self.closed = False
        self._wall, self._clock = wall, clock
        self._metrics = FleetSpendMetrics.of(registry) if registry is not None else None
        self._caps: dict[str, dict[str, float]] = {}
        self._leases: dict[tuple[str, str], _Lease] = {}
        self._views: dict[tuple[str, str, int], _View] = {}
        self._outbox: list[tuple[str, bytes]] = []
        self._last_charge: dict[str, float] = {}
        self._seq = 0
        self._lock = threading.Lock()
        self._granted = threading.Condition(self._lock)  # notified when a claim of this replica is decided
        self._waiters: set[Callable[[], None]] = set()  # the wakers of `charge`s waiting for a decision
        # Per loop and endpoint, the queue of `charge`s waiting for room (`_gate`).
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
            weakref.WeakKeyDictionary())
        self._started = clock()
        self._synced = self._ever_synced = False
        self._fresh_at: float | None = None
        self._fallback: bool | None = None
        with _LEDGERS_LOCK:
            _LEDGERS.add(self)

    # -- the endpoints ------------------------------------------------------------------------------
    def track(self, endpoint: str, caps: dict[str, float]) -> None:
        """Hold `endpoint`'s caps fleet-wide."""
        with self._lock:
            self._caps[endpoint] = dict(caps)
        if self._metrics is not None:
            self._metrics.fallback.labels(endpoint).set(0)
            for window in caps:
                self._metrics.fleet.labels(endpoint, window).set_function(
                    lambda e=endpoint, w=window: self.fleet_spent(e, w))

    @property
    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._caps)

    @property
    def ready(self) -> bool:
        """Whether the transport has read the topic to its end (claims can be made)."""
        with self._lock:
            return self._synced

    @property
    def waiting(self) -> int:
        """How many `charge`s wait for a claim's decision right now."""
        with self._lock:
            return len(self._waiters)

    def lease_size(self, cap: float) -> float:
        return cap / (LEASES_PER_REPLICA * self.config.max_replicas)

    # -- charging (the runner's loop) ---------------------------------------------------------------
    async def charge(self, endpoint: str, usd: float) -> dict[str, int] | None:
        """Charge `usd` to every window's lease of `endpoint`, or nothing (None: skip as budget); the
        buckets charged, for `settle`. Without room it waits up to `claim_wait_s` for the claims it
        made, without blocking the event loop (the other judgements run meanwhile).

        One judgement per endpoint (and loop) waits at a time; the others that find no room queue
        behind it in arrival order, and each starts its own `claim_wait_s` at the head of the queue.
        That keeps the pace the fleet was measured at: a burst of judgements does not all give up
        within the same `claim_wait_s` while a claim or an idle replica's release is on its way (a
        busy replica would skip the rest of the cap as budget); a judgement can so wait up to the
        queue's length x `claim_wait_s` (the queue is bounded by the judgements in flight)."""
        with self._lock:
            out = self._attempt(endpoint, usd)
        if out is not _WAIT:
            return out
        async with self._gate(endpoint):
            return await self._wait_for_room(endpoint, usd)

    def _gate(self, endpoint: str) -> asyncio.Lock:
        """The queue of `endpoint`'s waiters on the running loop (an asyncio.Lock: first come, first
        served; one per loop, since a lock belongs to the loop it first waited on)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            gates = self._gates.get(loop)
            if gates is None:
                gates = self._gates[loop] = {}
            return gates.setdefault(endpoint, asyncio.Lock())

    async def _wait_for_room(self, endpoint: str, usd: float) -> dict[str, int] | None:
        """Try again each time a claim of this ledger is decided, for up to `claim_wait_s`: the event
        it awaits is set by the transport's thread through `loop.call_soon_threadsafe` (see the class
        docstring)."""
        loop = asyncio.get_running_loop()
        decided = asyncio.Event()  # touched on `loop` only

        def wake() -> None:  # the transport's thread (or `close`), outside `_lock`
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits on it any more
                loop.call_soon_threadsafe(decided.set)

        deadline: float | None = None
        expired = False
        try:
            while True:
                with self._lock:
                    if deadline is None:
                        deadline = self._clock() + self.config.claim_wait_s
                    out = self._attempt(endpoint, usd)
                    if out is not _WAIT:
                        return out
                    left = deadline - self._clock()
                    if expired or left <= 0:
                        return None
                    decided.clear()
                    self._waiters.add(wake)  # in the attempt's critical section: no decision is missed
                try:
                    await asyncio.wait_for(decided.wait(), left)
                except TimeoutError:
                    expired = True  # one more attempt (a decision may have come with the deadline)
        finally:
            with self._lock:
                self._waiters.discard(wake)

    def try_charge(self, endpoint: str, usd: float) -> dict[str, int] | None:
        """`charge` for a plain thread: the wait for a claim's decision blocks the calling thread, so
        never call it on an event loop."""
        with self._lock:
            deadline = self._clock() + self.config.claim_wait_s
            while True:
                out = self._attempt(endpoint, usd)
                left = deadline - self._clock()
                if out is not _WAIT or left <= 0:
                    return None if out is _WAIT else out
                self._granted.wait(left)

    def _attempt(self, endpoint: str, usd: float) -> Any:
        """One try under `_lock`: the buckets charged, None (no room and nothing to wait for), or
        `_WAIT` (no room yet, but every short window has a claim in flight)."""
        caps = self._caps.get(endpoint)
        if caps is None or not self.attached:  # no transport (eval, calibrate, the API): per process
            return {}
        if self.closed:  # its runner closed: nothing more is charged
            return None
        self._last_charge[endpoint] = self._clock()
        fallback = self._in_fallback()
        leases = {w: self._lease(endpoint, w) for w in caps}
        short = [w for w, cap in caps.items() if not self._fits(leases[w], cap, usd, fallback)]
        if short:
            waiting = not fallback and all(leases[w].pending is not None for w in short)
            return _WAIT if waiting else None
        for window, cap in caps.items():
            lease = leases[window]
            lease.spent += usd
            if not fallback and lease.room < self.lease_size(cap) / 2:
                self._claim(endpoint, window, cap, lease, 0.0)  # the next lease, before it is needed
        return {w: lease.bucket for w, lease in leases.items()}

    def close(self) -> None:
        """Its runner closed: leave the process's registry (no transport attaches to it any more; its
        transport, if any, publishes its last spend record and stops), charge nothing more, and end
        the waits in flight (skipped as budget)."""
        with _LEDGERS_LOCK:
            _LEDGERS.discard(self)
        with self._lock:
            self.closed = True
            self._granted.notify_all()
            wakers = list(self._waiters)
        for wake in wakers:
            wake()

    def _fits(self, lease: _Lease, cap: float, usd: float, fallback: bool) -> bool:
        """Whether `usd` fits the lease (or the local share in fallback); claims what it lacks if not."""
        own = lease.granted - lease.releasing
        allowed = max(own, cap / self.config.max_replicas) if fallback else own
        if lease.spent + usd <= allowed + _EPSILON:
            return True
        if not fallback:
            self._claim(lease.endpoint, lease.window, cap, lease, usd - lease.room)
        return False

    def settle(self, endpoint: str, charged: dict[str, int], estimate: float, actual: float) -> None:
        """Replace a charged estimate by what the judgement cost, in the buckets it was charged to (a
        bucket that has ended keeps the estimate)."""
        with self._lock:
            for window, bucket in charged.items():
                lease = self._lease(endpoint, window)
                if lease.bucket == bucket:
                    lease.spent += actual - estimate

    def _lease(self, endpoint: str, window: str) -> _Lease:
        bucket = self._bucket(window)
        lease = self._leases.get((endpoint, window))
        if lease is None or lease.bucket != bucket:
            view = self._views.get((endpoint, window, bucket))
            resumed = view.spent.get(self.replica, 0.0) if view is not None else 0.0
            lease = self._leases[(endpoint, window)] = _Lease(endpoint, window, bucket, resumed=resumed)
            self._prune()
        return lease

    def _bucket(self, window: str) -> int:
        return int(self._wall() // WINDOWS[window])

    def _live_view(self, endpoint: str, window: str, bucket: int) -> _View | None:
        """The view of a record's bucket, made on first sight; None for a window this replica does not
        know or a bucket already past (its records change nothing). Call holding `_lock`."""
        if window not in WINDOWS or bucket < self._bucket(window):
            return None
        return self._views.setdefault((endpoint, window, bucket), _View())

    def _claim(self, endpoint: str, window: str, cap: float, lease: _Lease, short: float) -> None:
        """Queue a claim for what `lease` lacks (`short`) or the next lease, unless one is in flight,
        the topic was not read yet, or the cap has no room left as far as this replica has read."""
        if not self._synced:
            return
        if lease.pending is not None and self._clock() - lease.pending_at < self.config.stale_after_s:
            return
        view = self._views.get((endpoint, window, lease.bucket)) or _View()
        free = cap - view.granted
        amount = min(max(self.lease_size(cap), short), free)
        if amount <= _EPSILON or amount + _EPSILON < short:
            return
        self._seq += 1
        key = f"claim|{endpoint}|{window}|{lease.bucket}|{self.replica}|{self.incarnation}|{self._seq}"
        lease.pending, lease.pending_at = key, self._clock()
        self._outbox.append((key, json.dumps({"usd": amount, "cap": cap}).encode()))

    # -- the transport's side -----------------------------------------------------------------------
    def apply(self, key: str | None, value: bytes | None) -> None:
        """One record of the topic, in log order (others' and this replica's own)."""
        if not key:
            return
        parts = key.split("|")
        try:
            body = json.loads(value) if value else None
            if parts[0] == "claim" and len(parts) == 7 and isinstance(body, dict):
                self._apply_claim(parts, float(body["usd"]), float(body["cap"]))
            elif parts[0] == "release" and len(parts) == 7 and isinstance(body, dict):
                self._apply_release(parts, float(body["usd"]))
            elif parts[0] == "spend" and len(parts) == 5 and isinstance(body, dict):
                self._apply_spend(parts, float(body["usd"]))
        except (ValueError, KeyError, TypeError):
            log.debug("fleet spend: ignoring a malformed record %r", key)

    def _apply_claim(self, parts: list[str], usd: float, cap: float) -> None:
        _, endpoint, window, bucket_s, replica, incarnation, _seq = parts
        bucket = int(bucket_s)
        with self._lock:
            if (view := self._live_view(endpoint, window, bucket)) is None:
                return
            granted = usd > 0 and view.granted + usd <= cap + _EPSILON
            if granted:
                view.granted += usd
            if replica != self.replica or incarnation != self.incarnation:
                return
            lease = self._leases.get((endpoint, window))
            if lease is None or lease.bucket != bucket:
                return
            if granted:
                lease.granted += usd
            if lease.pending == "|".join(parts):
                lease.pending = None
            self._granted.notify_all()
            wakers = list(self._waiters)
        for wake in wakers:  # outside `_lock`: each only schedules a callback on its loop
            wake()

    def _apply_release(self, parts: list[str], usd: float) -> None:
        _, endpoint, window, bucket_s, replica, incarnation, _seq = parts
        bucket = int(bucket_s)
        with self._lock:
            if (view := self._live_view(endpoint, window, bucket)) is None:
                return
            view.granted = max(0.0, view.granted - usd)
            lease = self._leases.get((endpoint, window))
            mine = replica == self.replica and incarnation == self.incarnation
            if not mine or lease is None or lease.bucket != bucket:
                return
            lease.granted -= usd
            key = "|".join(parts)
            if key not in lease.released:  # read for the first time (not a re-read after a reconnect)
                lease.released.add(key)
                lease.releasing -= usd

    def release_idle(self) -> None:
        """Give back the unspent part of the leases of endpoints this replica has not charged for two
        publish intervals, so a busy replica can claim it (called by the transport every interval)."""
        with self._lock:
            if not self._synced or self._in_fallback():
                return
            idle_since = self._clock() - 2 * self.config.publish_interval_s
            for lease in self._leases.values():
                free = lease.room
                if (free <= _EPSILON or lease.pending is not None
                        or self._last_charge.get(lease.endpoint, idle_since) > idle_since):
                    continue
                lease.releasing += free
                self._seq += 1
                key = (f"release|{lease.endpoint}|{lease.window}|{lease.bucket}|{self.replica}|"
                       f"{self.incarnation}|{self._seq}")
                self._outbox.append((key, json.dumps({"usd": free}).encode()))

    def _apply_spend(self, parts: list[str], usd: float) -> None:
        _, endpoint, window, bucket_s, replica = parts
        bucket = int(bucket_s)
        with self._lock:
            if (view := self._live_view(endpoint, window, bucket)) is None:
                return
            view.spent[replica] = usd
            lease = self._leases.get((endpoint, window))
            own = replica == self.replica and not self._ever_synced
            if own and lease is not None and lease.bucket == bucket:
                lease.resumed = usd

    def synced(self) -> None:
        """The transport read the topic up to its end: claims may be made, the view is fresh."""
        with self._lock:
            self._synced = self._ever_synced = True
            self._fresh_at = self._clock()

    def reread(self) -> None:
        """The transport reads the topic from the beginning again (a reconnect): forget what was read,
        so no claim counts twice; this incarnation's claims come back with the log."""
        with self._lock:
            self._synced = False
            self._views.clear()
            for lease in self._leases.values():
                lease.granted = 0.0

    def fresh(self) -> None:
        """The transport reached the broker just now."""
        with self._lock:
            if self._synced:
                self._fresh_at = self._clock()

    def take_outbox(self) -> list[tuple[str, bytes]]:
        """The claims to send, in the order they were made."""
        with self._lock:
            out, self._outbox = self._outbox, []
            return out

    def spend_records(self) -> list[tuple[str, bytes]]:
        """This replica's spend per (endpoint, window, bucket): published every interval (none before
        the topic was read, which would overwrite a resumed record)."""
        with self._lock:
            if not self._synced:
                return []
            out = []
            for (endpoint, window), lease in self._leases.items():
                usd = max(0.0, lease.resumed + lease.spent)
                self._views.setdefault((endpoint, window, lease.bucket), _View()).spent[self.replica] = usd
                out.append((f"spend|{endpoint}|{window}|{lease.bucket}|{self.replica}",
                            json.dumps({"usd": round(usd, 9)}).encode()))
            return out

    # -- what it sees -------------------------------------------------------------------------------
    def fleet_spent(self, endpoint: str, window: str) -> float:
        """The fleet's spend in the current bucket: the others' last records and this replica's own."""
        with self._lock:
            lease = self._lease(endpoint, window)
            view = self._views.get((endpoint, window, lease.bucket)) or _View()
            others = sum(v for r, v in view.spent.items() if r != self.replica)
            return others + max(0.0, lease.resumed + lease.spent)

    def granted(self, endpoint: str, window: str) -> tuple[float, float]:
        """(this incarnation's granted leases, the fleet's) in the current bucket."""
        with self._lock:
            lease = self._lease(endpoint, window)
            view = self._views.get((endpoint, window, lease.bucket)) or _View()
            return lease.granted - lease.releasing, view.granted

    def in_fallback(self) -> bool:
        with self._lock:
            return self._in_fallback()

    def _in_fallback(self) -> bool:
        since = self._fresh_at if self._fresh_at is not None else self._started
        fallback = self._clock() - since > self.config.stale_after_s
        if fallback != self._fallback:
            before, self._fallback = self._fallback, fallback
            self._report_fallback(fallback, before)
        return fallback

    def _report_fallback(self, fallback: bool, before: bool | None) -> None:
        if fallback:
            log.warning("fleet spend: topic %r not read for %.0f s (judges.fleet_spend.stale_after_s): "
                        "charging a local share of each cap (cap / %d max_replicas)", self.config.topic,
                        self.config.stale_after_s, self.config.max_replicas)
        elif before is not None:
            log.info("fleet spend: topic %r read again; charging the fleet's leases", self.config.topic)
        if self._metrics is not None:
            for endpoint in self._caps:
                self._metrics.fallback.labels(endpoint).set(1 if fallback else 0)

    def _prune(self) -> None:
        """Forget the views of buckets that have ended (bounded state)."""
        for key in [k for k in self._views if k[2] < self._bucket(k[1])]:
            del self._views[key]
