"""A commit that moves nothing is neither sent nor counted.

The consumer runtime commits on a timer (`stream.commit_interval_ms`), on revocation and at shutdown;
each commit sends what `OffsetTracker.committable()` offers and counts it in
`tracejudge_commits_total`. Before a partition's first record completes, its commit point is the offset
reading started from: committing it would move nothing, so it must not be offered. Here a sink holds
one partition (its backend says "retry later") while the others are written, and the commit timer
fires many times: the held partition is never committed and the counter moves only with commits that
moved an offset. Against the real broker, through the real `SinkRunner`.
"""

from __future__ import annotations

from kafka.structs import OffsetAndMetadata, TopicPartition
from prometheus_client import CollectorRegistry
from support.kafka import FAST_GROUP, committed_offsets, ends, metric, produce, unique, wait_until
from support.sinks import RecordingSink
from test_sink_runtime import by_partition, result_lines

from tracejudge.consumer.config import load_settings
from tracejudge.consumer.runtime.offsets import OffsetTracker
from tracejudge.consumer.stages.sink import SinkRunner

TP = TopicPartition("results", 0)


def test_a_partition_whose_records_are_all_in_flight_offers_no_commit():
    tracker = OffsetTracker()
    tickets = [tracker.track(TP, o) for o in range(40, 45)]
    assert tracker.committable() == {} and tracker.committable([TP]) == {}
    tickets[3].release()  # out of order: 40 still holds the commit point where reading started
    assert tracker.committable() == {}
    tickets[0].release()
    assert tracker.committable() == {TP: OffsetAndMetadata(41, "", -1)}


def test_revoking_a_partition_that_did_not_advance_offers_no_commit():
    tracker = OffsetTracker()
    tracker.track(TP, 7)
    other = TopicPartition("results", 1)
    tracker.track(other, 3).release()
    # What the runtime commits on revocation: only the partition that moved.
    assert tracker.committable([TP, other]) == {other: OffsetAndMetadata(4, "", -1)}
    assert tracker.revoke([TP]) == {TP: 7}
    # Re-delivered from 7 (to us again): starting over at 7 moves nothing either.
    again = tracker.track(TP, 7)
    assert TP not in tracker.committable()
    again.release()
    assert tracker.committable([TP]) == {TP: OffsetAndMetadata(8, "", -1)}


def test_the_commit_timer_neither_sends_nor_counts_a_commit_that_moves_nothing(broker):
    bs = broker.bootstrap_servers
    topic, kind = unique("results"), unique("noop")
    lines = result_lines(60, seed=21)
    placed = produce(bs, topic, [v for _, v in lines], keys=[k for k, _ in lines])
    parts = by_partition(placed)
    assert len(parts) > 1
    held = max(parts, key=lambda p: len(parts[p]))
    others = [(p, o) for p, o in placed if p != held]
    sink = RecordingSink()
    sink.refuse[held] = "backend_down"
    sink.retry_after_s = 0.05
    # A commit timer far shorter than the time the held partition is offered below.
    settings = load_settings(environ={}, require_topics=False, overrides={
        "kafka.bootstrap_servers": bs, "sink.results_topic": topic, "sink.checkpoint_interval_ms": 0,
        "stream.commit_interval_ms": 20, "sink.max_retry_backoff_s": 0.05, "http.port": 0,
        "http.bind_address": "127.0.0.1", **FAST_GROUP})
    runner = SinkRunner(settings, kind, sink, registry=CollectorRegistry(auto_describe=True))
    runner.start()
    try:
        wait_until(lambda: runner.http_port is not None or runner.error is not None, 30)
        assert runner.error is None, runner.error
        port, group = runner.http_port, runner.group_id

        def committed() -> dict[int, int | None]:
            return committed_offsets(bs, group, topic)

        def commits_settled() -> float:
            """The commit counter once the poll loop has turned twice more: a commit seen on the broker
            is counted before the loop offers the held batch again (both on the poll thread)."""
            offers = sink.offers(held)
            wait_until(lambda: sink.offers(held) >= offers + 2, 60, message="the held batch offered again")
            return metric(port, "tracejudge_commits_total")

        wait_until(lambda: all(committed().get(p) == end for p, end in ends(others).items()), 60,
                   message=lambda: f"the other partitions committed to the end: {committed()}")
        before = commits_settled()
        assert before >= 1
        # Each re-offer of the held batch comes at least retry_after_s (50 ms) after the last one, in
        # the poll loop that also runs the 20 ms commit timer: 30 more offers span at least 1.45 s,
        # dozens of timer turns, however loaded the machine is.
        offers = sink.offers(held)
        wait_until(lambda: sink.offers(held) >= offers + 30, 60, message="the held batch offered again")
        assert metric(port, "tracejudge_commits_total") == before
        assert committed()[held] is None, "the held partition's starting offset was committed"
        assert metric(port, "tracejudge_commit_failures_total") == 0
        # One more result on another partition: exactly one commit moves it, and only that one counts.
        key = next(k for (k, _), (p, _) in zip(lines, placed, strict=True) if p != held)
        moved = produce(bs, topic, [result_lines(1, seed=22)[0][1]], keys=[key])
        assert moved[0][0] != held
        wait_until(lambda: committed().get(moved[0][0]) == moved[0][1] + 1, 60, message="one more commit")
        assert commits_settled() == before + 1
        assert committed()[held] is None
        del sink.refuse[held]
        wait_until(lambda: committed().get(held) == ends(placed)[held], 60,
                   message=lambda: f"the held partition committed once written: {committed()}")
        wait_until(lambda: metric(port, "tracejudge_commits_total") > before + 1, 30)
    finally:
        runner.stop()
        assert runner.join(60), "the sink did not stop within 60 s"
    assert runner.error is None, runner.error
    assert sorted(sink.offsets()) == sorted(placed + moved)
