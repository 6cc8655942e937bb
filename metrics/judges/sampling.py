"""Which traces the judges see: deterministic sampling and filters.

The sampling decision is a pure function of the trace id, so every replica of a consumer group, and a
replay of the same topic, judges the same traces:

    point(trace) = BLAKE2b(seed + "\\x00" + key, digest_size=8), big-endian integer / 2**64   ∈ [0, 1)
    sampled      = point(trace) < sample_rate

`key` is the trace id, else the request id, else (for records that carry neither) a hash of the
request and response text, which is still stable across replays.

The same point is used for every judge (no per-judge salt). Consequences, all intended:
- nesting: a trace sampled at rate r is sampled by every judge whose rate is >= r, so the traces a
  cheap judge sees at 10% are a subset of those another judge sees at 50%, and the most-sampled traces
  carry every judge's verdict (comparable across judges, and easy to inspect together);
- changing one judge's rate never changes which traces another judge sees.
`sampling_seed` changes the chosen set as a whole (for example to look at a fresh slice of traffic);
all replicas must share it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from tracejudge.metrics.judges.config import FiltersConfig
from tracejudge.schemas.record import EvalRecord

__all__ = ["TraceFilter", "is_sampled", "sample_point", "sampling_key", "trace_status"]

_SCALE = float(2**64)


def sample_point(key: str, seed: str = "") -> float:
    """A uniform, deterministic point in [0, 1) for `key`."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE


def sampling_key(record: EvalRecord) -> str:
    if record.trace_id:
        return record.trace_id
    if record.request_id:
        return "request:" + record.request_id
    text = f"{record.request or ''}\x00{record.response or ''}"
    return "content:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def is_sampled(key: str, rate: float, seed: str = "") -> bool:
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    return sample_point(key, seed) < rate


def trace_status(record: EvalRecord) -> str:
    """ "failed", "incomplete", "ok" or "unknown" (failure not stated)."""
    if record.failed:
        return "failed"
    if not record.complete:
        return "incomplete"
    return "ok" if record.failed is False else "unknown"


class TraceFilter:
    """A compiled `FiltersConfig`."""

    __slots__ = ("apps", "statuses", "tags")

    def __init__(self, config: FiltersConfig | None = None):
        config = config or FiltersConfig()
        self.apps = frozenset(config.apps) if config.apps is not None else None
        self.statuses = frozenset(config.status) if config.status is not None else None
        self.tags: Mapping[str, frozenset[str]] = {
            k: frozenset([v] if isinstance(v, str) else v) for k, v in config.tags.items()
        }

    def matches(self, record: EvalRecord, status: str | None = None) -> bool:
        if self.apps is not None and record.app not in self.apps:
            return False
        if self.statuses is not None and (status or trace_status(record)) not in self.statuses:
            return False
        return all(record.tags.get(tag) in accepted for tag, accepted in self.tags.items())
