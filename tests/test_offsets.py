"""OffsetTracker: out-of-order completion, ref-counted tickets, revocation, thread safety."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.structs import OffsetAndMetadata, TopicPartition

from tracejudge.consumer.runtime.offsets import OffsetTracker

TP = TopicPartition("traces", 0)
TP1 = TopicPartition("traces", 1)


def commit_point(tracker: OffsetTracker, tp: TopicPartition = TP) -> int | None:
    om = tracker.committable().get(tp)
    return om.offset if om is not None else None


def test_in_order_completion_commits_the_next_offset_to_read():
    tracker = OffsetTracker()
    tickets = [tracker.track(TP, o) for o in range(10, 13)]
    assert tracker.in_flight == 3
    # Nothing complete: the commit point is the first tracked offset, where reading started, so
    # committing it would move nothing and it is not offered.
    assert commit_point(tracker) is None
    for t in tickets:
        t.release()
    assert tracker.in_flight == 0
    assert tracker.committable() == {TP: OffsetAndMetadata(13, "", -1)}


def test_out_of_order_completion_commits_only_up_to_the_lowest_incomplete_offset():
    tracker = OffsetTracker()
    t = {o: tracker.track(TP, o) for o in range(5)}
    for o in (4, 2, 3):
        t[o].release()
    assert commit_point(tracker) is None  # 0 is still in flight: nothing moved
    t[0].release()
    assert commit_point(tracker) == 1
    t[1].release()
    assert commit_point(tracker) == 5  # 2, 3, 4 were already complete


def test_a_ticket_completes_when_its_last_reference_is_released():
    tracker = OffsetTracker()
    ticket = tracker.track(TP, 0)
    ticket.acquire()  # e.g. one per trace that had spans in the record
    ticket.acquire()
    ticket.release()  # the record's own processing
    ticket.release()
    assert commit_point(tracker) is None and not ticket.done
    ticket.release()
    assert ticket.done and commit_point(tracker) == 1
    with pytest.raises(RuntimeError, match="released more times"):
        ticket.release()
    with pytest.raises(RuntimeError, match="already complete"):
        ticket.acquire()


def test_committable_leaves_out_partitions_that_did_not_advance_since_the_last_commit():
    tracker = OffsetTracker()
    tracker.track(TP, 0).release()
    tracker.track(TP1, 7).release()
    offsets = tracker.committable()
    assert offsets == {TP: OffsetAndMetadata(1, "", -1), TP1: OffsetAndMetadata(8, "", -1)}
    tracker.mark_committed(offsets)
    assert tracker.committable() == {}
    tracker.track(TP1, 8).release()
    assert tracker.committable() == {TP1: OffsetAndMetadata(9, "", -1)}
    assert tracker.committable([TP]) == {}


def test_revoke_reports_unfinished_records_and_ignores_late_releases():
    tracker = OffsetTracker()
    done, slow, later = (tracker.track(TP, o) for o in (3, 4, 5))
    other = tracker.track(TP1, 0)
    done.release()
    later.release()
    assert tracker.in_flight_for([TP]) == 1
    assert tracker.revoke([TP]) == {TP: 4}
    assert tracker.in_flight == 1  # only TP1's record
    # The partition comes back (to us) and is tracked afresh; the old ticket must not touch it.
    fresh = tracker.track(TP, 4)
    slow.release()
    assert commit_point(tracker) is None and tracker.in_flight == 2  # 4 is where it starts again
    fresh.release()
    other.release()
    assert commit_point(tracker) == 5 and tracker.in_flight == 0
    assert tracker.revoke([TopicPartition("never", 0)]) == {}


def test_a_seek_back_restarts_the_partition_bookkeeping():
    tracker = OffsetTracker()
    tracker.track(TP, 10)
    tracker.track(TP, 11).release()
    again = tracker.track(TP, 10)  # re-delivered after a rewind
    assert tracker.in_flight == 1
    again.release()
    assert commit_point(tracker) == 11


def test_wait_idle_returns_when_the_last_ticket_is_released_from_another_thread():
    tracker = OffsetTracker()
    tickets = [tracker.track(TP, o) for o in range(50)]
    assert not tracker.wait_idle(0.01)
    threading.Thread(target=lambda: [t.release() for t in reversed(tickets)]).start()
    assert tracker.wait_idle(10)
    assert commit_point(tracker) == 50


def test_concurrent_releases_from_many_threads_lose_no_completion():
    tracker = OffsetTracker()
    tps = [TopicPartition("t", p) for p in range(4)]
    tickets = [tracker.track(tp, o) for o in range(2000) for tp in tps]
    for t in tickets:
        t.acquire()  # two references each, released by different threads
    rng = random.Random(3)
    halves = [tickets[:], tickets[:]]
    for h in halves:
        rng.shuffle(h)
    chunks = [h[i::4] for h in halves for i in range(4)]
    threads = [threading.Thread(target=lambda c=c: [t.release() for t in c]) for c in chunks]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert tracker.in_flight == 0
    assert tracker.committable() == {tp: OffsetAndMetadata(2000, "", -1) for tp in tps}


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=60).flatmap(
    lambda n: st.tuples(st.just(n), st.permutations(range(n)), st.integers(0, 1000))))
def test_commit_point_is_always_the_lowest_incomplete_offset(case):
    n, order, base = case
    tracker = OffsetTracker()
    tickets = [tracker.track(TP, base + i) for i in range(n)]
    complete: set[int] = set()
    for i in order:
        tickets[i].release()
        complete.add(i)
        lowest_incomplete = next((j for j in range(n) if j not in complete), n)
        assert commit_point(tracker) == (base + lowest_incomplete if lowest_incomplete else None)
        assert tracker.in_flight == n - len(complete)
