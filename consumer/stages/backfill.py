"""`tracejudge backfill`: re-judge a time range of the input topics and publish the verdicts marked as
backfill, e.g. to score last week's traffic with a new judge version.

    offsets_for_times(--from) ──seek──▶ poll ──▶ RecordProcessor (the stream's decode, assembly,
         (or the group's committed offset)        computed metrics, judges) ──▶ results topic,
                                                   each result marked `backfill=Backfill(run, start, end)`
                                                          │ broker ack
                                                          ▼
                                  OffsetTracker ──lowest incomplete offset──▶ commit (own group)

Why it is built this way:
- Same scores as the stream: records go through `RecordProcessor` (`consumer/stages/processing.py`),
  the very per-record path of `tracejudge run`, OTLP spans through the same trace assembly; only the sinks
  differ (results are marked, rejects are counted and logged rather than dead-lettered again), set
  into the runtime's producer (`consumer/runtime/producer.py`), which sends, re-sends and drains.
- Resumable: its own consumer group, named after a run id derived from the topics, the range and the
  judges, so the same command finds its committed offsets and continues where it stopped. Offsets
  are committed only once the results before them are acknowledged by the broker (tickets, as in
  the stream), so a Ctrl-C or a crash never skips a record; it may re-publish a few (at-least-once).
- Leaves the live stream's Prometheus series alone: its judges count into a private registry that is
  never served, so `tracejudge_judge_*` on the dashboards stays the live traffic's. The terminal gets
  the progress and the summary; `/metrics` on `--metrics-port` (default 9468) only the run's own
  `tracejudge_backfill_*` progress.
- Its end does not trust the broker's answers: per partition it stops at the first record whose
  timestamp is at or after `--to`, or at the high watermark the first fetch reported (the end as of
  the start), whichever comes first. Tansu answers ListOffsets for a time with the partition's first
  offset whatever the time, and its `end_offsets()` can be short, so the start offset from
  `offsets_for_times` is used only as where to begin reading: records before `--from` are skipped
  and counted (`before_range`), which on a conforming broker is the rare out-of-order timestamp.
- Judges are never thinned for capacity: at most `judges.max_in_flight` records are judged at once
  and reading waits for a free slot, where the live stream would skip as `overloaded`. Sampling
  (`sample_rate`) and filters still apply, so a backfill judges the same deterministic sample.

Neighbours: the command (arguments, the progress endpoint, the summary, the resume command) is
`consumer/commands/backfill.py`, its progress series `metrics/telemetry/backfill.py`, the judges' tally
`metrics/summary.py`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from tracejudge.consumer.config import Settings
from tracejudge.consumer.pipeline import build_pipeline
from tracejudge.consumer.runtime.fleet_spend import start_fleet_spend
from tracejudge.consumer.runtime.offsets import Exports, OffsetTracker, Releasable
from tracejudge.consumer.runtime.producer import Outputs, Producing
from tracejudge.consumer.runtime.producing import DeadLetterSink, Publisher, ResultSink
from tracejudge.consumer.stages.processing import ASSEMBLED, RecordProcessor
from tracejudge.metrics.judges.config import JudgeConfigError
from tracejudge.metrics.judges.runner import JudgeRunner
from tracejudge.metrics.summary import JudgeTally
from tracejudge.metrics.telemetry.backfill import ProgressSnapshot
from tracejudge.metrics.telemetry.evaluation import PrometheusExporter
from tracejudge.schemas.errors import BackfillError, StartupError
from tracejudge.schemas.record import EvalRecord
from tracejudge.schemas.result import Assessment, Backfill, EvaluationResult, SourceRef

__all__ = ["BackfillError", "BackfillRun", "BackfillTally", "parse_time", "run_id"]

log = logging.getLogger("tracejudge.backfill")

PROGRESS_EVERY_SECONDS = 5.0
COMMIT_EVERY_SECONDS = 1.0
BEFORE_RANGE = "before_range"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(text: str, now: float | None = None) -> float:
    """Seconds since the epoch from ISO 8601 (`2026-11-20T08:00:00Z`; no offset means UTC), epoch
    seconds (`1763625600`), or a duration ago (`90m`, `6h`, `7d`). Rounded to milliseconds, Kafka's
    resolution, so the time printed in the resume command gives the same run id again."""
    value = text.strip()
    if match := _DURATION.match(value):
        return round((time.time() if now is None else now) - float(match[1]) * _UNIT_SECONDS[match[2]], 3)
    try:
        return round(float(value), 3)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise BackfillError(f"{text!r} is not a time: use ISO 8601 (2026-11-20T08:00:00Z), epoch "
                            "seconds, or a duration ago (90m, 6h, 7d)") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return round(parsed.timestamp(), 3)


def run_id(topics: Sequence[str], start: float, end: float | None, judges: Sequence[str]) -> str:
    """The run's id: the same topics, range and judges give the same id (and consumer group), so
    re-running a command resumes it."""
    key = json.dumps({"topics": sorted(topics), "from": start, "to": end, "judges": sorted(judges)},
                     sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class _SelectedJudges(JudgeRunner):
    """A `JudgeRunner` over a subset of the configured judges (`--judges`), configured exactly as the
    live runner configures them (shadow candidates included), then narrowed by name."""

    def __init__(self, config: Any, only: Sequence[str] | None) -> None:
        self._only = None if only is None else set(only)
        super().__init__(config)  # a private registry: the live series are not touched

    def _configure_all(self, env: Mapping[str, str] | None) -> list[Any]:
        return [c for c in super()._configure_all(env) if self._only is None or c.name in self._only]


@dataclass
class _Partition:
    tp: TopicPartition
    start: int
    stop_at: int | None = None
    done: bool = False
    read: int = 0
    judged: int = 0


@dataclass
class BackfillTally:
    """What the run did, for the progress lines and the summary table."""

    read: int = 0
    judged: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    judges: dict[str, JudgeTally] = field(default_factory=dict)
    partitions: dict[TopicPartition, _Partition] = field(default_factory=dict)
    resumed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def skip(self, reason: str) -> None:
        with self._lock:
            self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def add(self, result: EvaluationResult) -> None:
        with self._lock:
            self.judged += 1
            src = result.source
            if src.topic is not None and src.partition is not None:
                part = self.partitions.get(TopicPartition(src.topic, src.partition))
                if part is not None:
                    part.judged += 1
            for a in result.assessments:
                self.judges.setdefault(a.name, JudgeTally()).add(a)

    def snapshot(self) -> ProgressSnapshot:
        """The tally as the progress series read it (`metrics/telemetry/backfill.py`)."""
        with self._lock:
            parts = list(self.partitions.values())
            return ProgressSnapshot(read=self.read, published=self.judged, skipped=dict(self.skipped),
                                    partitions_done=sum(1 for p in parts if p.done), partitions=len(parts))

    def remaining(self, position: Callable[[TopicPartition], int | None]) -> int | None:
        """Records left to read, when every partition's end is known."""
        left = 0
        for part in self.partitions.values():
            if part.done:
                continue
            pos = position(part.tp)
            if part.stop_at is None or pos is None:
                return None
            left += max(0, part.stop_at - pos)
        return left

    def render(self) -> str:
        rows = [("records read", str(self.read)),
                ("results published", str(self.judged))]
        for reason in sorted(self.skipped):
            rows.append((f"skipped: {reason}", str(self.skipped[reason])))
        for name in sorted(self.judges):
            t = self.judges[name]
            rate = "-" if not t.verdicts else f"{100.0 * t.passed / t.verdicts:.1f}%"
            rows.append((f"judge {name}", f"judged {t.verdicts}, passed {t.passed} ({rate}), "
                                          f"{t.errors} errors, {t.skipped} skipped"))
        for tp in sorted(self.partitions, key=lambda t: (t.topic, t.partition)):
            p = self.partitions[tp]
            stop = "?" if p.stop_at is None else str(p.stop_at)
            rows.append((f"{tp.topic}[{tp.partition}]", f"read {p.read}, judged {p.judged}, "
                                                        f"offsets {p.start}..{stop}"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


class _MarkedResults(ResultSink):
    """The results sink of the stream, marking each result as this run's backfill and tallying it."""

    def __init__(self, marker: Backfill, tally: BackfillTally, *args: Any) -> None:
        super().__init__(*args)
        self.marker = marker
        self.tally = tally

    def publish(self, result: EvaluationResult, ticket: Releasable) -> None:
        result.backfill = self.marker
        self.tally.add(result)
        super().publish(result, ticket)


class _CountedRejects(DeadLetterSink):
    """Records that cannot be decoded: the live stream dead-lettered them already, so here they are
    only counted by reason and logged with their offset."""

    def __init__(self, tally: BackfillTally, metrics: PrometheusExporter) -> None:
        super().__init__(None, None, metrics)
        self.tally = tally

    def send(self, *, source: SourceRef, reason: str, error: str, ticket: Releasable, value: bytes | None,
             key: bytes | None = None, headers: Sequence[tuple[str, bytes]] = (),
             timestamp_ms: int | None = None, count_record: bool = True) -> None:
        self.tally.skip(reason)
        self._log.warning(f"rejected ({reason})", "%s[%s]@%s rejected (%s): %s", source.topic,
                          source.partition, source.offset, reason, error)
        ticket.release()


class BackfillRun:
    """One backfill: `run()` reads the range, publishes the results and returns the tally; True in
    `completed` when it reached the range's end (else it was stopped: `stop_event`, or after `limit`
    records in the range, for tests). Committed offsets make a new `BackfillRun` with the same
    arguments resume."""

    def __init__(self, settings: Settings, *, start: float, end: float | None = None,
                 judges: Sequence[str] | None = None, group_id: str | None = None,
                 results_topic: str | None = None, stop_event: threading.Event | None = None,
                 limit: int | None = None, out: IO[str] | None = None,
                 progress_seconds: float = PROGRESS_EVERY_SECONDS) -> None:
        if end is not None and end <= start:
            raise BackfillError("--to must be after --from")
        if settings.judges is None:
            raise BackfillError("no judges: add a judges: section to the configuration")
        self.settings = settings
        self.start = start
        self.end = end
        self.results_topic = results_topic or settings.stream.results_topic
        if not self.results_topic:
            raise BackfillError("no results topic: set stream.results_topic or pass --results-topic")
        try:
            self.judges = _SelectedJudges(settings.judges, judges)
        except JudgeConfigError as exc:
            raise BackfillError(f"judges.{exc.key}: {exc.detail}") from None
        names = self.judges.judge_names()
        unknown = sorted(set(judges or ()) - set(names))
        if unknown or not names:
            configured = ", ".join(settings.judges.judge_settings()) or "none"
            self.judges.close()
            chosen = ", ".join(unknown) or "no judge chosen"
            raise BackfillError(f"--judges: {chosen} (configured: {configured})")
        self.topics = [t.name for t in settings.stream.topics]
        self.run_id = run_id(self.topics, start, end, names)
        self.group_id = group_id or f"tracejudge-backfill-{self.run_id}"
        self.marker = Backfill(run=self.run_id, start=start, end=end)
        self.stop_event = stop_event or threading.Event()
        self.limit = limit
        self._taken = 0
        self.out = out
        self.progress_seconds = progress_seconds
        self.tally = BackfillTally()
        self.completed = False
        self.interrupted = False
        # At most this many records are being judged; reading waits for a free slot (never thins).
        self._slots = threading.BoundedSemaphore(self.judges.config.max_in_flight)

    # -- the run ------------------------------------------------------------------------------------

    def run(self) -> BackfillTally:
        s = self.settings
        config = {**s.kafka.consumer_config(), "group_id": self.group_id, "auto_offset_reset": "earliest"}
        exporter = PrometheusExporter(max_apps=s.prometheus.max_apps)  # private, never served
        producing = self._producing(exporter)
        try:
            consumer = KafkaConsumer(**config)
            try:
                try:
                    producing.open()
                except StartupError as exc:
                    raise BackfillError(str(exc)) from exc
                fleet = start_fleet_spend(s)  # fleet-wide spend caps (judges.fleet_spend)
                try:
                    self._run(consumer, producing, exporter)
                finally:
                    fleet.close()
                    producing.close()
            finally:
                consumer.close(autocommit=False)
        finally:
            self.judges.close()
        return self.tally

    def _judge(self, record: EvalRecord) -> concurrent.futures.Future[list[Assessment]]:
        self._slots.acquire()
        try:
            future = self.judges.submit(record)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _f: self._slots.release())
        return future

    def _producing(self, exporter: PrometheusExporter) -> Producing:
        """The runtime's producer with the backfill's publishers: results marked as this run's,
        rejects only counted (the live stream dead-lettered them already)."""

        def results(publisher: Publisher | None, rejects: DeadLetterSink) -> ResultSink:
            return _MarkedResults(self.marker, self.tally, publisher, self.results_topic, exporter, rejects)

        return Producing(self.settings, Outputs(
            metrics=exporter, results_topic=self.results_topic, make_results=results,
            make_dead_letters=lambda _publisher: _CountedRejects(self.tally, exporter)), logger=log)

    def _run(self, consumer: KafkaConsumer, producing: Producing, exporter: PrometheusExporter) -> None:
        s = self.settings
        results, rejects = producing.results, producing.dead_letters
        formats = {t.name: t.format for t in s.stream.topics}
        assembler = None
        if any(f in ASSEMBLED for f in formats.values()):
            from tracejudge.consumer.stages.assembly import TraceAssembler

            assembler = TraceAssembler(s.otlp.assembly.to_settings(), app_tag=s.stream.app_tag,
                                       session_tag=s.stream.session_tag, version_tag=s.stream.version_tag)
        tracker = OffsetTracker()
        exports = Exports()
        processor = RecordProcessor(build_pipeline(s), tracker, exporter, results, rejects, formats,
                                    max_record_bytes=s.stream.max_record_bytes, exports=exports,
                                    assembler=assembler, judge=self._judge)
        parts = self._assign(consumer)
        started = last_progress = last_commit = time.monotonic()
        while not self.completed:
            if self.stop_event.is_set():
                break
            batches = consumer.poll(timeout_ms=200)
            producing.run_due_retries()
            limited = False
            for tp, records in batches.items():
                limited = not self._take(parts[tp], records, processor, tracker) or limited
            if limited:
                break  # the records past the limit were fetched, not taken: they stay uncommitted
            processor.emit_due()
            self._check_ends(consumer, parts)
            self.completed = all(p.done for p in parts.values())
            now = time.monotonic()
            if now - last_commit >= COMMIT_EVERY_SECONDS:
                self._commit(consumer, tracker)
                last_commit = now
            if self.out is not None and now - last_progress >= self.progress_seconds:
                last_progress = now
                self._progress(consumer, now - started)
        if self.completed and assembler is not None:
            # The range's end is the input's end: traces still assembling are emitted as they are.
            for trace in assembler.flush():
                processor.emit_assembled(trace)
        else:
            # Stopped early: their records stay uncommitted and are read again on resume.
            processor.discard_assembly()
        self.interrupted = not self.completed
        producing.settle(time.monotonic() + 30.0, lambda: exports.count, wait=exports.wait_idle)
        producing.flush(10)
        self._commit(consumer, tracker)

    def _assign(self, consumer: KafkaConsumer) -> dict[TopicPartition, _Partition]:
        tps: list[TopicPartition] = []
        for topic in self.topics:
            partitions = consumer.partitions_for_topic(topic)
            if not partitions:
                raise BackfillError(f"topic {topic!r} does not exist (stream.topics)")
            tps += [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        hints = consumer.offsets_for_times({tp: int(self.start * 1000) for tp in tps})
        parts: dict[TopicPartition, _Partition] = {}
        for tp in tps:
            committed = consumer.committed(tp)
            if committed is not None:
                self.tally.resumed += 1
                offset = committed
            elif hints.get(tp) is not None:
                offset = hints[tp].offset
            else:
                offset = None  # no record at or after --from
            part = _Partition(tp, offset if offset is not None else 0, done=offset is None)
            if offset is not None:
                consumer.seek(tp, offset)
            parts[tp] = part
        self.tally.partitions = parts
        done = [p.tp for p in parts.values() if p.done]
        if done:
            consumer.pause(*done)
        return parts

    def _take(self, part: _Partition, records: list[Any], processor: RecordProcessor,
              tracker: OffsetTracker) -> bool:
        """Take a partition's fetched records up to its end; False when `limit` stopped it."""
        end_ms = None if self.end is None else self.end * 1000
        start_ms = self.start * 1000
        for record in records:
            if part.done or (part.stop_at is not None and record.offset >= part.stop_at):
                return True
            if end_ms is not None and record.timestamp >= end_ms:
                part.stop_at = record.offset  # the first offset at or after --to: the range's end here
                return True
            in_range = record.timestamp >= start_ms
            if in_range and self.limit is not None and self._taken >= self.limit:
                return False
            part.read += 1
            self.tally.read += 1
            if not in_range:
                self.tally.skip(BEFORE_RANGE)
                tracker.track(part.tp, record.offset).release()
                continue
            self._taken += 1
            processor.process(part.tp, record)
        return True

    def _check_ends(self, consumer: KafkaConsumer, parts: dict[TopicPartition, _Partition]) -> None:
        finished = []
        for part in parts.values():
            if part.done:
                continue
            if part.stop_at is None and (high := consumer.highwater(part.tp)) is not None:
                part.stop_at = high  # the end as of the first fetch: records appended later wait
            if part.stop_at is not None and consumer.position(part.tp) >= part.stop_at:
                part.done = True
                finished.append(part.tp)
        if finished:
            consumer.pause(*finished)

    def _commit(self, consumer: KafkaConsumer, tracker: OffsetTracker) -> None:
        offsets = tracker.committable()
        if not offsets:
            return
        try:
            consumer.commit(offsets)
        except Exception as exc:  # the next commit (or the resume) catches up
            log.warning("committing the backfill's offsets failed: %s: %s", type(exc).__name__, exc)
            return
        tracker.mark_committed(offsets)

    def _progress(self, consumer: KafkaConsumer, elapsed: float) -> None:
        t = self.tally
        left = t.remaining(lambda tp: consumer.position(tp))
        rate = t.read / elapsed if elapsed > 0 else 0.0
        eta = "?" if left is None or rate <= 0 else f"{left / rate:.0f}s"
        per = ", ".join(f"{tp.topic}[{tp.partition}] {p.read}/{p.judged}" for tp, p in t.partitions.items()
                        if not p.done or p.read)
        skipped = sum(t.skipped.values())
        print(f"... backfill {self.run_id}: {t.read} read, {t.judged} judged, {skipped} skipped "
              f"({rate:.0f}/s, ETA {eta}); read/judged: {per}", file=self.out, flush=True)
