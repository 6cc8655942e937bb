"""The MLflow sink's findings: each finding (`"kind": "finding"`, `consumer/sinks/findings.py`) becomes
trace tags on its example traces, so MLflow's trace search finds them:

    tags.`tracejudge.finding.groundedness` = 'doc_uri=https://docs.example.com/refunds'

| trace tag | value |
|---|---|
| `tracejudge.finding.<judge>` | `<dimension>=<value>`: the trace's top finding of the judge (1) |
| `tracejudge.finding.<judge>.<dimension>` | `<value>`, one per dimension the trace is an example of |
| `tracejudge.finding.<judge>.lift` | `<lift> [<low>, <high>]` of the top finding (`inf`: unbounded) |
| `tracejudge.finding.<judge>.rank` | its rank among the (app, judge)'s findings of the window |
| `tracejudge.finding.<judge>.window` | `<start>/<end>` of its window, ISO 8601 UTC |
| `tracejudge.finding.<judge>.app` | the app |

(1) the newest window's, of it the lowest rank. `<judge>` is the judge's name with every character
MLflow does not take in a tag key (letters, digits, `_ - . / : space`) made `_`, cut to 100 characters.
Values are cut to `TAG_VALUE_MAX` characters (MLflow keeps 8000; the findings stage cuts a value to 300
already, so a stated value is never cut in practice). The trace: an example trace id as the results
state it, `tr-<id>` unless it starts with `tr-` (MLflow 3 and OTLP traces; an MLflow 2 request id is
not found and is given up on).

Idempotent: tags are upserts, and the sink reads the traces' tags first (the same lookup as for
verdicts): a tag already holding the value is counted `already_written` and not set again, so a
redelivered finding changes nothing. A finding of an older window than the one a trace's tags hold
(`.window`'s end), or of the same window and a lower rank, does not replace the top finding
(skipped, `superseded`); its own `<judge>.<dimension>` tag is still set when its window is not older.
An example trace not on the server yet is deferred and given up on exactly as a verdict's trace
(`unknown_trace_*`); a trace of another experiment is skipped (`other_experiment`).

Personal data: the values are what the finding states: a doc_uri (the findings stage removes
credentials and query values from URLs), a tool or model name, a version, a signal, or a request
cluster's label, which is made of words from users' requests: a deployment that must not show those
in MLflow leaves `request_cluster` out of `findings.dimensions`.
"""

from __future__ import annotations

import calendar
import re
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tracejudge.consumer.sinks.base import SinkRecord, WriteReport
from tracejudge.consumer.sinks.mlflow_client import MlflowClient, TraceInfo, Transient
from tracejudge.consumer.sinks.waiting import UnknownTargets

__all__ = ["TAG_PREFIX", "TAG_VALUE_MAX", "FindingTags", "FindingWriter", "finding_tag_key", "finding_tags",
           "plan_tags"]

TAG_PREFIX = "tracejudge.finding."
# A tag value's length at most (MLflow's own limit is 8000 characters, beyond which it cuts silently).
TAG_VALUE_MAX = 1000
JUDGE_KEY_MAX = 100
_NOT_KEY = re.compile(r"[^\w.\-/: ]")


def finding_tag_key(judge: str) -> str:
    """`tracejudge.finding.<judge>`, the judge's name made a valid MLflow tag key."""
    return TAG_PREFIX + _NOT_KEY.sub("_", judge)[:JUDGE_KEY_MAX]


def _cut(text: str) -> str:
    return text if len(text) <= TAG_VALUE_MAX else text[:TAG_VALUE_MAX - 1] + "…"


def _iso(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return ""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _bound(x: Any) -> str:
    return "inf" if x is None else f"{x:.3g}"


@dataclass(frozen=True, slots=True)
class FindingTags:
    """One finding's tags on one trace, and how it ranks against the tags already there."""

    record: SinkRecord
    trace_id: str
    key: str  # tracejudge.finding.<judge>
    top: dict[str, str]  # the top-finding tags: key, .lift, .rank, .window, .app
    dimension: tuple[str, str]  # tracejudge.finding.<judge>.<dimension> -> value
    order: tuple[float, int]  # (window end, -rank): larger replaces smaller


def finding_tags(record: SinkRecord, trace_id: str) -> FindingTags:
    """The tags a (checked) finding line puts on one of its example traces."""
    f = record.result
    key = finding_tag_key(f["judge"])
    window = f.get("window") or {}
    low, high = f["lift_interval"]
    top = {key: _cut(f"{f['dimension']}={f['value']}"),
           f"{key}.lift": f"{f['lift']:.3g} [{_bound(low)}, {_bound(high)}]",
           f"{key}.rank": str(f["rank"]),
           f"{key}.window": f"{_iso(window.get('start'))}/{_iso(window.get('end'))}",
           f"{key}.app": _cut(f["app"])}
    end = window.get("end")
    return FindingTags(record, trace_id, key, top, (f"{key}.{f['dimension']}", _cut(f["value"])),
                       (float(int(end)) if isinstance(end, int | float) else 0.0, -int(f["rank"])))


def _held_order(tags: Mapping[str, str], key: str) -> tuple[float, int] | None:
    """The (window end, -rank) of the top finding a trace's tags hold for `key`; None: none."""
    if key not in tags:
        return None
    end = tags.get(f"{key}.window", "").partition("/")[2]
    try:
        ts = float(calendar.timegm(time.strptime(end, "%Y-%m-%dT%H:%M:%SZ"))) if end else 0.0
    except ValueError:
        ts = 0.0
    rank = tags.get(f"{key}.rank", "")
    return ts, -int(rank) if rank.isdigit() else 0


def plan_tags(items: list[FindingTags], info: TraceInfo, skipped: Counter[str]) -> list[tuple[str, str]]:
    """The tags to set on one trace for the batch's findings on it, and count the superseded ones: per
    judge the top finding (the newest window, then the lowest rank, against what the trace holds), every
    dimension tag of a finding whose window is not older. Tags that already hold their value included
    (the caller counts them `already_written`)."""
    out: dict[str, str] = {}
    by_key: dict[str, list[FindingTags]] = {}
    for item in items:
        by_key.setdefault(item.key, []).append(item)
    for key, group in by_key.items():
        held = _held_order(info.tags, key)
        best = max(group, key=lambda t: t.order)
        for item in group:
            if held is not None and item.order[0] < held[0]:
                skipped["superseded"] += 1
                continue
            out[item.dimension[0]] = item.dimension[1]
            if item is not best or (held is not None and item.order < held):
                skipped["superseded"] += 1
        if held is None or best.order >= held:
            out.update(best.top)
    return list(out.items())


class FindingWriter:
    """Writes a batch's finding records as trace tags (see the module docstring)."""

    def __init__(self, client: MlflowClient, unknown: UnknownTargets, experiment_id: str | None) -> None:
        self._client = client
        self._unknown = unknown
        self._experiment_id = experiment_id

    def write(self, records: list[SinkRecord], report: WriteReport, skipped: Counter[str]) -> list[Transient]:
        """Set the tags, count outcomes in `report` / `skipped`, defer or give up on unknown traces;
        return the transient failures (the caller asks for the batch again)."""
        by_trace: dict[str, list[FindingTags]] = {}
        for record in records:
            for tid in dict.fromkeys(record.result["example_trace_ids"]):
                trace_id = tid if tid.startswith("tr-") else f"tr-{tid}"
                by_trace.setdefault(trace_id, []).append(finding_tags(record, trace_id))
        infos = self._client.lookup(list(by_trace))  # Unavailable passes to the sink
        todo: list[tuple[str, str, str]] = []
        waiting: dict[int, tuple[SinkRecord, float]] = {}
        given_up: dict[int, SinkRecord] = {}
        for trace_id, items in by_trace.items():
            info = infos.get(trace_id)
            if info is None:
                if self._unknown.seen(trace_id):
                    skipped["unknown_trace"] += len(items)
                    given_up.update((t.record.offset, t.record) for t in items)
                else:
                    wait = self._unknown.wait_s(trace_id)
                    for t in items:
                        earlier = waiting.get(t.record.offset)
                        waiting[t.record.offset] = (t.record, min(wait, earlier[1]) if earlier else wait)
                continue
            self._unknown.found(trace_id)
            if self._experiment_id and info.experiment_id not in (None, self._experiment_id):
                skipped["other_experiment"] += len(items)
                continue
            for key, value in plan_tags(items, info, skipped):
                if info.tags.get(key) == value:
                    report.already_written += 1
                else:
                    todo.append((trace_id, key, value))
        transient: list[Transient] = []
        for (trace_id, _, _), outcome in zip(todo, self._client.map(self._client.set_tag, todo), strict=True):
            if isinstance(outcome, Transient):
                transient.append(outcome)
            elif outcome == "written":
                report.written += 1
            elif outcome == "unknown":  # gone between the lookup and the write: looked for again
                for t in by_trace[trace_id]:
                    waiting.setdefault(t.record.offset, (t.record, self._unknown.wait_s(trace_id)))
            else:
                skipped[outcome] += 1
        if transient:
            return transient
        for record, wait in waiting.values():
            report.defer(record, "unknown_trace", wait)
        if n := len([o for o in given_up if o not in waiting]):
            report.give_up("unknown_trace", n)
        return []
