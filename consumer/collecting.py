"""Collections: the traces a `collections:` rule matches, as agent-evaluation rows
(`schemas/formats/collected.py`), for `tracejudge run` (a topic and/or an appended file) and
`tracejudge eval` (a file written whole, `consumer/commands/collect_files.py`).

    EvaluationResult ──rule's conditions──▶ sample (by trace id) ──▶ dedupe (by trace id) ──▶ cap ──▶ row

Per rule, in this order: the conditions (`consumer/config/collections.py`); the sample, a pure function
of the trace id seeded with the rule's name (`metrics/judges/sampling.py`: every replica and a replay
take the same traces, independently of the judges' own sample); the dedupe, a bounded LRU of the trace
ids the rule collected in this process (`DEDUPE_SIZE`); the cap, `max_per_window` rows per tumbling
`window_s` (per process). Each trace matched and not collected is counted by reason
(`tracejudge_collection_dropped_total`), each collected one in `tracejudge_collected_total`.

Across restarts: a row is keyed by its trace id, so a compacted collection topic (cleanup.policy=compact)
keeps one row per trace, and `merge-labels` keeps the first row of a trace id; a file of `tracejudge
run` is read at start-up and the trace ids already in it are not appended again.

`finding:` conditions match against the current findings (`FindingIndex`: per (app, judge) the values
of its latest window's findings) through `Collector.findings`, a `FindingSource`. `tracejudge eval`
sets it once the run's own findings are known (`collect_files.py`); `tracejudge run` reads the findings
topic (`consumer/runtime/findings_feed.py`). A trace is matched when it is offered: a finding that
arrives after the trace was processed does not collect it afterwards. While no findings can be read,
a rule with a `finding:` condition collects nothing and each trace its other conditions matched is
counted as dropped (`no_findings`).

In `tracejudge run` the hook is the results publisher the runtime's producer makes
(`CollectingResults`, an extra output of the same producer): a result's offset is released only when
its result and each of its rows are out (acknowledged by the broker, written and synced to the file).
A row whose file cannot be appended to (disk full, permissions) is written again after a growing
back-off (`FILE_RETRY_S`, up to `FILE_RETRY_MAX_S`) while its offset waits, each failed attempt counted
in `tracejudge_collection_publish_failures_total`: it is never dropped, and a process stopped meanwhile
leaves the offset uncommitted, so the record is evaluated and the row collected again after a restart.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from tracejudge.consumer.config.collections import CollectionRule, Condition, FindingCondition
from tracejudge.consumer.runtime.offsets import Releasable
from tracejudge.consumer.runtime.producing import DeadLetterSink, Publisher, RateLimitedLog, ResultSink
from tracejudge.metrics.findings.dimensions import dimension_values
from tracejudge.metrics.findings.window import APP_MAX_CHARS
from tracejudge.metrics.judges.sampling import is_sampled, sampling_key
from tracejudge.metrics.telemetry.collections import CollectionMetrics
from tracejudge.schemas.errors import StartupError
from tracejudge.schemas.formats.collected import collected_row, row_bytes, row_key
from tracejudge.schemas.result import EvaluationResult, assessment_status

__all__ = ["ASSUMED", "DEDUPE_SIZE", "FILE_RETRY_MAX_S", "FILE_RETRY_S", "FINDING_PAIRS", "AppendedFile",
           "Collected", "CollectingResults", "Collector", "FindingIndex", "FindingSource", "matches",
           "open_files", "run_hook", "uses_findings"]

log = logging.getLogger("tracejudge.collections")

# A failed append to a collection file is tried again after FILE_RETRY_S, doubling up to FILE_RETRY_MAX_S.
FILE_RETRY_S = 0.5
FILE_RETRY_MAX_S = 30.0

# Trace ids remembered per rule for the dedupe (about 100 bytes each): past it the oldest is forgotten.
DEDUPE_SIZE = 100_000
HEADER_COLLECTION = "tracejudge-collection"
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
    "!=": operator.ne}


@dataclass(frozen=True, slots=True)
class Collected:
    """One row a rule collected: its rule, key (trace id) and JSON line (no newline)."""

    rule: CollectionRule
    key: str
    line: bytes


# (app, judge) pairs a `FindingIndex` keeps (the findings window's own `max_groups` default); values kept
# per pair (a window's top_k findings per pair, 10 by default).
FINDING_PAIRS = 1000
FINDING_VALUES = 100


class FindingSource(Protocol):
    """Where a collector reads the current findings."""

    def available(self) -> bool:
        """False while the findings cannot be read (then finding conditions match nothing)."""
        ...

    def values(self, app: str, judge: str) -> Mapping[str, Collection[str]] | None:
        """The current findings' values of (app, judge), by dimension; None: no finding."""
        ...


class FindingIndex:
    """The current findings: per (app, judge), the values of its latest window's findings. A finding of a
    later window replaces the pair's values, one of the same window adds to them, one of an earlier window
    is ignored. Bounded: `max_pairs` pairs and `FINDING_VALUES` values per pair; the findings past them are
    counted in `ignored` (`add` says False)."""

    def __init__(self, max_pairs: int = FINDING_PAIRS) -> None:
        self.max_pairs = max_pairs
        self._pairs: dict[tuple[str, str], tuple[float, dict[str, set[str]]]] = {}
        self._lock = threading.Lock()
        self.ignored = 0

    @classmethod
    def of(cls, findings: Iterable[Any]) -> FindingIndex:
        """The index of `Finding`s (or their `to_dict` lines)."""
        index = cls()
        for f in findings:
            index.add(f if isinstance(f, dict) else f.to_dict())
        return index

    def add(self, line: Mapping[str, Any]) -> bool:
        """One finding line (`Finding.to_dict`); False when it is not a finding or is over the bounds."""
        app, judge, dim, value = (line.get(k) for k in ("app", "judge", "dimension", "value"))
        if not all(isinstance(x, str) for x in (app, judge, dim, value)):
            return False
        window = line.get("window")
        end = window.get("end") if isinstance(window, dict) else None
        when = float(end) if isinstance(end, int | float) else float("-inf")
        key = (str(app)[:APP_MAX_CHARS], str(judge))
        with self._lock:
            held = self._pairs.get(key)
            if held is None or when > held[0]:
                if held is None and len(self._pairs) >= self.max_pairs:
                    self.ignored += 1
                    return False
                held = self._pairs[key] = (when, {})
            elif when < held[0]:
                return True  # an older window's: the pair's latest window is known
            values = held[1]
            if sum(len(v) for v in values.values()) >= FINDING_VALUES:
                self.ignored += 1
                return False
            values.setdefault(str(dim), set()).add(str(value))
        return True

    def available(self) -> bool:
        return True

    def values(self, app: str, judge: str) -> Mapping[str, Collection[str]] | None:
        with self._lock:
            held = self._pairs.get((app[:APP_MAX_CHARS], judge))
            return None if held is None else {d: frozenset(v) for d, v in held[1].items()}

    def __len__(self) -> int:
        return len(self._pairs)


class _Assumed:
    """`matches(..., findings=ASSUMED)`: a finding condition holds whenever its verdict does (whether the
    rule could collect the trace once the findings are known)."""


ASSUMED = _Assumed()


def _finding_holds(cond: FindingCondition, result: EvaluationResult,
                   findings: FindingSource | _Assumed | None) -> bool:
    if findings is None or not any(a.name == cond.judge and a.shadow_of is None
                                   and assessment_status(a) in cond.verdict for a in result.assessments):
        return False
    if isinstance(findings, _Assumed):
        return True
    current = findings.values((result.record.app or "unknown")[:APP_MAX_CHARS], cond.judge)
    if not current:
        return False
    dims = (cond.dimension,) if cond.dimension else tuple(current)
    mine = dimension_values(result, dims)
    return any(v in current.get(d, ()) for d, vals in mine.items() for v in vals)


def uses_findings(rule: CollectionRule) -> bool:
    """Whether a rule has a `finding:` condition."""
    return any(c.finding is not None for c in rule.when)


def _holds(cond: Condition, result: EvaluationResult, findings: FindingSource | _Assumed | None) -> bool:
    record = result.record
    if cond.finding is not None:
        return _finding_holds(cond.finding, result, findings)
    if cond.judge is not None:
        verdicts = cond.verdict or []
        return any(a.name == cond.judge and assessment_status(a) in verdicts for a in result.assessments)
    if cond.metric is not None:
        value = result.metrics.get(cond.metric.name)
        return isinstance(value, int | float) and _OPS[cond.metric.op](float(value), cond.metric.value)
    if cond.app is not None:
        return record.app in cond.app
    if cond.version is not None:
        return record.version in cond.version
    return False


def matches(rule: CollectionRule, result: EvaluationResult,
            findings: FindingSource | _Assumed | None = None) -> bool:
    """The rule's conditions on one result (no conditions: every result); `finding:` conditions against
    `findings` (None: they do not hold)."""
    if not rule.when:
        return True
    held = (_holds(c, result, findings) for c in rule.when)
    return any(held) if rule.match == "any" else all(held)


class _RuleState:
    """One rule's dedupe memory and current window."""

    __slots__ = ("count", "seen", "started")

    def __init__(self) -> None:
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.started: float | None = None
        self.count = 0


class Collector:
    """The rules, their state and their counters. Thread-safe: `tracejudge run` offers results from
    whatever thread finished judging them."""

    def __init__(self, rules: Iterable[CollectionRule], metrics: CollectionMetrics, *,
                 dedupe_size: int = DEDUPE_SIZE, clock: Callable[[], float] = time.monotonic) -> None:
        self.rules = list(rules)
        self.metrics = metrics
        self.dedupe_size = dedupe_size
        self.clock = clock
        self._state = {r.name: _RuleState() for r in self.rules}
        self._lock = threading.Lock()
        # The current findings of `finding:` conditions (None: none can be read yet).
        self.findings: FindingSource | None = None
        self._no_findings_logged = False

    @classmethod
    def build(cls, rules: list[CollectionRule], registry: Any = None) -> Collector | None:
        """None without rules; the counters go to `registry` (a private one by default)."""
        if not rules:
            return None
        return cls(rules, CollectionMetrics(registry, [r.name for r in rules]))

    @property
    def topics(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.topic for r in self.rules if r.topic))

    def offer(self, result: EvaluationResult,
              rules: Iterable[CollectionRule] | None = None) -> list[Collected]:
        """The rows of `result` to write, one per rule (of `rules`, default all) that collects it (drops
        counted)."""
        out: list[Collected] = []
        findings = self.findings if self.findings is not None and self.findings.available() else None
        for rule in self.rules if rules is None else rules:
            if findings is None and uses_findings(rule):
                if matches(rule, result, ASSUMED):
                    self._no_findings(rule)
                continue
            if not matches(rule, result, findings):
                continue
            row = self._take(rule, result)
            if row is not None:
                out.append(row)
        return out

    def _take(self, rule: CollectionRule, result: EvaluationResult) -> Collected | None:
        record, name = result.record, rule.name
        if not record.request:
            # A row without its request could never be evaluated again.
            return self._drop(name, "no_request")
        if not is_sampled(sampling_key(record), rule.sample_rate, seed=f"collection\x00{name}"):
            return self._drop(name, "sampled_out")
        key = row_key(record) or sampling_key(record)
        with self._lock:
            state = self._state[name]
            if key in state.seen:
                state.seen.move_to_end(key)
                return self._drop(name, "duplicate")
            if rule.max_per_window is not None:
                now = self.clock()
                if state.started is None or now - state.started >= rule.window_s:
                    state.started, state.count = now, 0
                if state.count >= rule.max_per_window:
                    return self._drop(name, "cap")
                state.count += 1
            self._remember(state, key)
        return Collected(rule, key, row_bytes(collected_row(result, name)))

    def _no_findings(self, rule: CollectionRule) -> None:
        self._drop(rule.name, "no_findings")
        if not self._no_findings_logged:
            self._no_findings_logged = True
            log.warning("collection %s: no findings can be read yet, so its finding: conditions match "
                        "nothing; counted in tracejudge_collection_dropped_total{reason=\"no_findings\"}",
                        rule.name)

    def _drop(self, name: str, reason: str) -> None:
        self.metrics.dropped.labels(name, reason).inc()

    def _remember(self, state: _RuleState, key: str) -> None:
        state.seen[key] = None
        if len(state.seen) > self.dedupe_size:
            state.seen.popitem(last=False)

    def seen(self, name: str, key: str) -> None:
        """`key` is already in collection `name` (a row read back from its file)."""
        with self._lock:
            self._remember(self._state[name], key)

    def written(self, item: Collected) -> None:
        self.metrics.collected.labels(item.rule.name).inc()


class AppendedFile:
    """A collection file `tracejudge run` appends to: one `write` per row on an O_APPEND descriptor
    (a row is never interleaved with another writer's), synced before the row counts as out. The rows
    already in it are read at `open` so a restart does not append the same trace again."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self._lock = threading.Lock()

    def open(self, collector: Collector) -> int:
        """Read the trace ids already in the file into `collector`; open it for appending. Returns how
        many rows it holds. `StartupError` when it cannot be read or opened."""
        held = 0
        names = {r.name for r in collector.rules}
        try:
            if os.path.exists(self.path):
                with open(self.path, "rb") as existing:
                    for line in existing:
                        key, name = _row_identity(line)
                        if key is not None and name in names:
                            collector.seen(name, key)
                            held += 1
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as exc:
            raise StartupError(f"collection file {self.path}: {exc.strerror or exc}") from exc
        return held

    def write(self, line: bytes) -> None:
        assert self.fd is not None
        data = line + b"\n"
        with self._lock:
            written = os.write(self.fd, data)
            if written != len(data):
                raise OSError(f"short write: {written} of {len(data)} bytes")
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _row_identity(line: bytes) -> tuple[str | None, str | None]:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(row, dict):
        return None, None
    key = row.get("trace_id") or row.get("request_id")
    name = row.get("collection")
    return (key if isinstance(key, str) else None), (name if isinstance(name, str) else None)


class _Fanout:
    """Releases `inner` once each of `parts` pieces of work (the result, each row) is out."""

    __slots__ = ("_inner", "_lock", "_parts")

    def __init__(self, inner: Releasable, parts: int) -> None:
        self._inner = inner
        self._parts = parts
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._parts -= 1
            last = self._parts == 0
        if last:
            self._inner.release()


@dataclass(frozen=True, slots=True)
class _RowCounters:
    """The two counters `ResultSink.send` increments, pointed at one collection's series."""

    results_published: Any
    result_publish_failures: Any


class CollectingResults(ResultSink):
    """The run stage's results publisher with the collections as an extra output of the same producer:
    each result's rows go to their topics (keyed by trace id) and files, and its ticket is released
    when the result and every row are out."""

    def __init__(self, publisher: Publisher | None, topic: str | None, metrics: Any,
                 dead_letters: DeadLetterSink, collector: Collector, files: dict[str, AppendedFile]) -> None:
        super().__init__(publisher, topic, metrics, dead_letters)
        self.collector = collector
        self.files = files
        m = collector.metrics
        self.rows = {r.name: ResultSink(publisher, r.topic, _RowCounters(m.collected.labels(r.name),
                                                                         m.publish_failures.labels(r.name)),
                                        dead_letters) for r in collector.rules if r.topic}
        self._log = RateLimitedLog(log)
        self._backlogs: dict[str, _FileBacklog] = {}

    def publish(self, result: EvaluationResult, ticket: Releasable) -> None:
        try:
            items = self.collector.offer(result)
        except Exception:  # a bug in a rule must not hold the offset back
            log.exception("collecting the result of %s failed", result.source.topic)
            items = []
        if not items:
            super().publish(result, ticket)
            return
        fan = _Fanout(ticket, 1 + sum(bool(it.rule.topic) + bool(it.rule.file) for it in items))
        src = result.source
        for item in items:
            if item.rule.file:
                self._write_file(item, fan)
            if item.rule.topic:
                headers = [("content-type", b"application/json"),
                           (HEADER_COLLECTION, item.rule.name.encode())]
                self.rows[item.rule.name].send(item.line, item.key.encode(), headers, fan, source=src,
                                               kind=f"row of collection {item.rule.name}")
        super().publish(result, fan)

    def _write_file(self, item: Collected, fan: _Fanout) -> None:
        """Append the row to its file and release its part of the ticket; on an OS error (or while
        earlier rows of the file wait), hand it to the file's backlog, which writes it again in order
        with the offset held."""
        assert item.rule.file is not None
        backlog = self._backlogs.get(item.rule.file)
        if backlog is not None and backlog.waiting():
            backlog.add(item, fan)
            return
        try:
            self.files[item.rule.file].write(item.line)
        except OSError as exc:
            self._append_failed(item, exc, FILE_RETRY_S)
            if backlog is None:
                backlog = self._backlogs.setdefault(item.rule.file, _FileBacklog(
                    self.files[item.rule.file], self._append_failed, self._appended))
            backlog.add(item, fan)
            return
        self._appended(item, fan)

    def _appended(self, item: Collected, fan: _Fanout) -> None:
        if not item.rule.topic:  # with a topic too, the broker's ack counts the row (once)
            self.collector.written(item)
        fan.release()

    def _append_failed(self, item: Collected, exc: OSError, delay: float) -> None:
        self.collector.metrics.publish_failures.labels(item.rule.name).inc()
        self._log.warning("collection file", "cannot append to collection file %s: %s; the row of trace %s "
                          "is written again in %.1f s, its offset waits", item.rule.file,
                          exc.strerror or exc, item.key, delay)


class _FileBacklog:
    """The rows of one collection file whose append failed, and those behind them: written again in
    order by one daemon thread (started with the first), after a back-off that grows while the file
    keeps failing. A process stopping meanwhile leaves their offsets uncommitted: collected again later.
    Bounded as the records in flight are (`stream.max_in_flight`): each row holds its record's offset."""

    def __init__(self, file: AppendedFile, failed: Callable[[Collected, OSError, float], None],
                 written: Callable[[Collected, _Fanout], None]) -> None:
        self.file = file
        self._failed = failed
        self._written = written
        self._queue: deque[tuple[Collected, _Fanout]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def waiting(self) -> bool:
        with self._cond:
            return bool(self._queue)

    def add(self, item: Collected, fan: _Fanout) -> None:
        with self._cond:
            self._queue.append((item, fan))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"collection-file {self.file.path}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        delay = FILE_RETRY_S  # the first row is here because its append failed
        while True:
            with self._cond:
                if not self._queue:
                    while not self._queue:
                        self._cond.wait()
                    delay = FILE_RETRY_S  # an empty backlog takes a row only when its append failed
                item, fan = self._queue[0]
            if delay:
                time.sleep(delay)
            try:
                self.file.write(item.line)
            except OSError as exc:
                delay = min(max(delay, FILE_RETRY_S) * 2, FILE_RETRY_MAX_S)
                self._failed(item, exc, delay)
                continue
            with self._cond:
                self._queue.popleft()
            self._written(item, fan)
            delay = 0.0  # the rows behind it at once, while the file takes them


def run_hook(collector: Collector, results_topic: str | None,
             metrics: Any) -> tuple[Callable[[Publisher | None, DeadLetterSink], ResultSink],
                                    dict[str, AppendedFile]]:
    """The `make_results` factory of the run stage's `Outputs` (results to `results_topic`, counted in
    `metrics`), and the files it appends to (open them with `open_files` before the stage starts)."""
    files = {r.file: AppendedFile(r.file) for r in collector.rules if r.file}

    def make(publisher: Publisher | None, dead_letters: DeadLetterSink) -> ResultSink:
        return CollectingResults(publisher, results_topic, metrics, dead_letters, collector, files)

    return make, files


def open_files(collector: Collector, files: dict[str, AppendedFile]) -> None:
    """Open every appended file, reading the trace ids it already holds; `StartupError` when one cannot."""
    for f in files.values():
        held = f.open(collector)
        log.info("collection file %s: %d rows already collected", f.path, held)
