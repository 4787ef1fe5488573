"""racecheck.hb: host accesses against pending copies, and unordered device accesses, by byte range.

A host thread may touch host memory that a queued copy reads or writes only once it has observed
the copy complete, itself or through a hand-off. When another host thread saw it complete and no
hand-off the checker follows carries that over, the conflict is a note, never a hazard."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from racecheck.hb import DEVICE, EVENT_READ, HOST, HOST_READ, HOST_WRITE, HOST_LOG_SWEEP_AT, PENDING_PRUNE_AT, HappensBefore, Hazard

BUF = ("host", 7)
DEV = ("dev", 1)


def checker(*streams: str) -> tuple[HappensBefore, list[int]]:
    hb = HappensBefore()
    return hb, [hb.add_stream(name) for name in streams]


def kinds(hazards: list[Hazard]) -> list[str]:
    return [h.kind for h in hazards]


# -- host write vs. pending copy -----------------------------------------------------------------

def test_the_docstring_example_holds():
    hb, (s,) = checker("main")
    copy = hb.enqueue(s, "copy#1")
    hb.copy_reads_host(BUF, copy)
    hb.host_write(BUF, "host write")
    (hazard,) = hb.hazards
    assert hazard == Hazard(HOST_WRITE, "host 7", "copy#1", "host write", hazard.message)
    assert f"| `{HOST_WRITE}` |" in (Path(__file__).resolve().parents[1] / "docs" / "sanitizer.md").read_text()  # a documented kind
    assert re.fullmatch(r"host write to host 7 by host write while copy#1 may not have read it yet: no event "
                        r"or synchronisation observed by the host orders the copy before the write "
                        r"\(the vLLM #48085 hazard\)", str(hazard))
    assert hb.notes == []


def test_a_host_write_to_other_bytes_of_the_buffer_is_not_a_hazard():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"), [(0, 8)])
    hb.host_write(BUF, "write slot 1", ranges=[(8, 16)])
    assert hb.hazards == []
    hb.host_write(BUF, "write slots 0 and 1", ranges=[(4, 12)])
    assert kinds(hb.hazards) == [HOST_WRITE]


def test_a_host_write_to_the_whole_buffer_meets_a_copy_of_any_bytes():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"), [(100, 104)])
    hb.host_write(BUF, "fill")
    assert kinds(hb.hazards) == [HOST_WRITE]


def test_a_host_write_to_another_buffer_is_not_a_hazard():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_write(("host", 8), "other buffer")
    assert hb.hazards == []


def test_a_host_that_synchronised_the_stream_may_write():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_observes_stream(s)
    hb.host_write(BUF, "host write")
    assert hb.hazards == [] and hb.notes == []


def test_a_host_that_observed_an_event_recorded_after_the_copy_may_write():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    event = hb.snapshot(s)
    hb.host_observes(event)
    hb.host_write(BUF, "host write")
    assert hb.hazards == []


def test_an_event_recorded_before_the_copy_does_not_order_the_write():
    hb, (s,) = checker("main")
    event = hb.snapshot(s)
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_observes(event)
    hb.host_write(BUF, "host write")
    assert kinds(hb.hazards) == [HOST_WRITE]


def test_observing_every_stream_orders_every_copy():
    hb, (a, b) = checker("a", "b")
    hb.copy_reads_host(BUF, hb.enqueue(a, "copy#1"))
    hb.copy_reads_host(BUF, hb.enqueue(b, "copy#2"))
    hb.host_observes_all()
    hb.host_write(BUF, "host write")
    assert hb.hazards == []


def test_observing_one_stream_leaves_the_copy_on_another_pending():
    hb, (a, b) = checker("a", "b")
    hb.copy_reads_host(BUF, hb.enqueue(a, "copy#1"))
    hb.copy_reads_host(BUF, hb.enqueue(b, "copy#2"))
    hb.host_observes_stream(a)
    hb.host_write(BUF, "host write")
    assert [h.first for h in hb.hazards] == ["copy#2"]


def test_a_host_write_meets_a_pending_device_to_host_copy_too():
    hb, (s,) = checker("main")
    hb.copy_writes_host(BUF, hb.enqueue(s, "d2h#1"))
    hb.host_write(BUF, "host write")
    assert kinds(hb.hazards) == [HOST_WRITE]
    assert hb.hazards[0].first == "d2h#1"


def test_a_host_write_under_a_pending_device_to_host_copy_says_the_copy_writes_it():
    hb, (s,) = checker("main")
    hb.copy_writes_host(BUF, hb.enqueue(s, "d2h#1"))
    hb.host_write(BUF, "host write")
    assert re.match(r"host write to host 7 by host write while d2h#1 may not have written it yet", str(hb.hazards[0]))


# -- host read vs. pending copy -------------------------------------------------------------------

def test_a_host_read_of_bytes_a_pending_device_to_host_copy_writes_is_a_hazard():
    hb, (s,) = checker("main")
    hb.name_resource(BUF, "pinned output buffer")
    hb.copy_writes_host(BUF, hb.enqueue(s, "d2h#1"), [(0, 16)])
    hb.host_read(BUF, "tolist", ranges=[(8, 12)])
    (hazard,) = hb.hazards
    assert hazard.kind == HOST_READ == "host-read-vs-pending-copy"
    assert (hazard.resource, hazard.first, hazard.second) == ("pinned output buffer", "d2h#1", "tolist")
    assert re.fullmatch(r"host read of pinned output buffer by tolist while d2h#1 may not have written it yet: "
                        r"no event or synchronisation observed by the host orders the copy before the read "
                        r"\(the vLLM #36013 hazard\)", hazard.message)


def test_a_host_read_of_other_bytes_than_a_pending_copy_writes_is_not_a_hazard():
    hb, (s,) = checker("main")
    hb.copy_writes_host(BUF, hb.enqueue(s, "d2h#1"), [(0, 16)])
    hb.host_read(BUF, "tolist", ranges=[(16, 32)])
    assert hb.hazards == []


def test_a_host_read_of_bytes_a_pending_copy_only_reads_is_not_a_hazard():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "h2d#1"))
    hb.host_read(BUF, "tolist")
    assert hb.hazards == []


def test_a_host_read_after_observing_the_copy_is_not_a_hazard():
    hb, (s,) = checker("main")
    hb.copy_writes_host(BUF, hb.enqueue(s, "d2h#1"))
    hb.host_observes_stream(s)
    hb.host_read(BUF, "tolist")
    assert hb.hazards == []


def test_pending_writes_lists_the_unobserved_copies_into_the_bytes_asked():
    hb, (s,) = checker("main")
    first = hb.enqueue(s, "d2h#1")
    hb.copy_writes_host(BUF, first, [(0, 8)])
    hb.copy_reads_host(BUF, hb.enqueue(s, "h2d#2"), [(0, 8)])  # reads: never a pending write
    second = hb.enqueue(s, "d2h#3")
    hb.copy_writes_host(BUF, second, [(8, 16)])
    assert hb.pending_writes(BUF) == [first, second]
    assert hb.pending_writes(BUF, ranges=[(0, 4)]) == [first]
    assert hb.pending_writes(BUF, ranges=[(16, 32)]) == []
    assert hb.pending_writes(("host", 8)) == []
    assert hb.pending_writes(BUF) == [first, second]  # asking changes nothing
    assert hb.hazards == []


def test_pending_writes_are_those_the_asking_host_thread_has_not_observed():
    hb, (a, b) = checker("a", "b")
    worker = hb.add_host("worker")
    on_a = hb.enqueue(a, "d2h on a")
    on_b = hb.enqueue(b, "d2h on b")
    hb.copy_writes_host(BUF, on_a)
    hb.copy_writes_host(BUF, on_b)
    hb.host_observes_stream(a)
    assert hb.pending_writes(BUF) == [on_b]
    assert hb.pending_writes(BUF, host=worker) == [on_a, on_b]


# -- several host threads -------------------------------------------------------------------------

def test_another_host_thread_that_did_not_see_the_copy_gets_a_note_when_some_thread_saw_it():
    hb, (s,) = checker("main")
    worker = hb.add_host("worker")  # started before the copy: it knows nothing of it
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_observes_stream(s)  # the main thread saw it complete
    hb.host_write(BUF, "worker write", host=worker)
    assert hb.hazards == []
    (note,) = hb.notes
    assert note.kind == HOST_WRITE
    assert re.fullmatch(r"host write to host 7 by worker write while copy#1 may not have read it yet: .*"
                        r"\(the vLLM #48085 hazard\); another host thread saw the copy complete first, and a "
                        r"hand-off the checker does not follow may order it", note.message)


def test_another_host_thread_reading_gets_a_note_when_some_thread_saw_the_copy():
    hb, (s,) = checker("main")
    worker = hb.add_host("worker")
    hb.copy_writes_host(BUF, hb.enqueue(s, "d2h#1"))
    hb.host_observes_stream(s)
    hb.host_read(BUF, "worker read", host=worker)
    assert hb.hazards == []
    assert kinds(hb.notes) == [HOST_READ]
    assert hb.notes[0].message.endswith("a hand-off the checker does not follow may order it")


def test_another_host_thread_gets_a_hazard_when_no_thread_saw_the_copy():
    hb, (s,) = checker("main")
    worker = hb.add_host("worker")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_write(BUF, "worker write", host=worker)
    assert kinds(hb.hazards) == [HOST_WRITE]
    assert hb.notes == []


def test_a_hand_off_from_the_thread_that_saw_the_copy_orders_the_access():
    hb, (s,) = checker("main")
    worker = hb.add_host("worker")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_observes_stream(s)
    hb.host_acquires(worker, hb.host_snapshot(HOST))
    hb.host_write(BUF, "worker write", host=worker)
    assert hb.hazards == [] and hb.notes == []


def test_a_hand_off_made_before_the_thread_saw_the_copy_does_not_order_it():
    hb, (s,) = checker("main")
    worker = hb.add_host("worker")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    stale = hb.host_snapshot(HOST)
    hb.host_observes_stream(s)
    hb.host_acquires(worker, stale)
    hb.host_write(BUF, "worker write", host=worker)
    assert hb.hazards == [] and len(hb.notes) == 1


def test_a_host_thread_started_after_the_parent_saw_the_copy_knows_it():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_observes_stream(s)
    child = hb.add_host("worker")  # parent defaults to HOST
    hb.host_write(BUF, "child write", host=child)
    assert hb.hazards == [] and hb.notes == []


def test_a_host_thread_with_no_parent_knows_nothing():
    hb, (s,) = checker("main")
    copy = hb.enqueue(s, "copy#1")
    hb.host_observes_stream(s)
    stranger = hb.add_host("met late", parent=None)
    assert hb.host_has_seen(copy)
    assert not hb.host_has_seen(copy, stranger)
    assert hb.seen_by_some_host(copy)


def test_only_the_thread_that_observed_has_seen_the_copy():
    hb, (s,) = checker("main")
    worker = hb.add_host("worker")
    copy = hb.enqueue(s, "copy#1")
    assert not hb.seen_by_some_host(copy)
    hb.host_observes_stream(s, host=worker)
    assert hb.host_has_seen(copy, worker)
    assert not hb.host_has_seen(copy)
    assert hb.seen_by_some_host(copy)


def test_the_thread_that_observed_the_copy_writes_without_a_note():
    hb, (s,) = checker("main")
    worker = hb.add_host("worker")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_observes_stream(s, host=worker)
    hb.host_write(BUF, "worker write", host=worker)
    assert hb.hazards == [] and hb.notes == []


# -- reported once --------------------------------------------------------------------------------

def test_a_pending_copy_is_reported_once_however_many_host_writes_follow():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_write(BUF, "write 1")
    hb.host_write(BUF, "write 2")
    assert [(h.first, h.second) for h in hb.hazards] == [("copy#1", "write 1")]


def test_a_noted_pending_copy_is_not_noted_again():
    hb, (s,) = checker("main")
    worker = hb.add_host("worker")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.host_observes_stream(s)
    hb.host_write(BUF, "write 1", host=worker)
    hb.host_write(BUF, "write 2", host=worker)
    assert len(hb.notes) == 1 and hb.hazards == []


def test_each_pending_copy_is_reported_once_by_one_write():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"), [(0, 8)])
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#2"), [(8, 16)])
    hb.host_write(BUF, "fill")
    hb.host_write(BUF, "fill again")
    assert [(h.first, h.second) for h in hb.hazards] == [("copy#1", "fill"), ("copy#2", "fill")]


def test_a_copy_kept_pending_by_a_write_elsewhere_is_reported_when_its_bytes_are_written():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"), [(0, 8)])
    hb.host_write(BUF, "elsewhere", ranges=[(64, 72)])
    hb.host_write(BUF, "elsewhere again", ranges=[(64, 72)])
    hb.host_write(BUF, "there", ranges=[(0, 1)])
    assert [(h.first, h.second) for h in hb.hazards] == [("copy#1", "there")]


def test_a_copy_behind_hundreds_of_pending_copies_into_other_bytes_is_still_reported():
    # The HiCache probe in small: 432 device-to-host copies queued into one host pool, slot by slot,
    # then the host rewrites the first slot; a cap of 256 had dropped the copy into it.
    hb, (s,) = checker("write stream")
    stamps = [hb.enqueue(s, f"copy#{i}") for i in range(PENDING_PRUNE_AT + 176)]
    for i, stamp in enumerate(stamps):
        hb.copy_writes_host(BUF, stamp, [(8 * i, 8 * i + 8)])
    hb.host_write(BUF, "prefetch", ranges=[(0, 8)])
    assert [(h.first, h.second) for h in hb.hazards] == [("copy#0", "prefetch")]


def test_copies_whose_bytes_later_copies_on_their_stream_cover_are_reported_through_the_newest():
    hb, (s, other) = checker("main", "other")
    first = hb.enqueue(other, "other#0")
    hb.copy_reads_host(BUF, first, [(0, 8)])
    stamps = [hb.enqueue(s, f"copy#{i}") for i in range(PENDING_PRUNE_AT + 10)]
    for stamp in stamps:
        hb.copy_reads_host(BUF, stamp)
    assert len(hb._host_readers[BUF]) < PENDING_PRUNE_AT  # one per stream is all a host access needs
    hb.host_write(BUF, "write", ranges=[(4, 5)])
    firsts = [h.first for h in hb.hazards]
    assert firsts[0] == "other#0" and firsts[-1] == stamps[-1].label and len(firsts) < PENDING_PRUNE_AT


def test_pending_copies_some_host_saw_are_dropped_beyond_the_limit():
    hb, (s,) = checker("main")
    worker = hb.add_host("worker")
    seen = [hb.enqueue(s, f"seen#{i}") for i in range(10)]
    for stamp in seen:
        hb.copy_reads_host(BUF, stamp)
    hb.host_observes_stream(s, host=worker)
    fresh = [hb.enqueue(s, f"fresh#{i}") for i in range(PENDING_PRUNE_AT - 5)]
    for i, stamp in enumerate(fresh):  # each into its own bytes: none covers another
        hb.copy_reads_host(BUF, stamp, [(8 * i, 8 * i + 8)])
    hb.host_write(BUF, "write")
    assert hb.notes == []  # the seen ones were dropped, not noted
    assert [h.first for h in hb.hazards] == [stamp.label for stamp in fresh]


# -- device accesses ------------------------------------------------------------------------------

def test_device_accesses_from_two_streams_to_other_bytes_are_not_a_hazard():
    hb, (a, b) = checker("a", "b")
    hb.device_access(DEV, hb.enqueue(a, "zero rows 0-3"), write=True, ranges=[(0, 64)])
    hb.device_access(DEV, hb.enqueue(b, "write rows 4-7"), write=True, ranges=[(64, 128)])
    assert hb.hazards == []


def test_device_accesses_from_two_streams_to_the_same_bytes_are_a_hazard():
    hb, (a, b) = checker("a", "b")
    hb.name_resource(DEV, "kv cache")
    hb.device_access(DEV, hb.enqueue(a, "zero#1"), write=True, ranges=[(0, 64)])
    hb.device_access(DEV, hb.enqueue(b, "gather#2"), write=False, ranges=[(32, 96)])
    (hazard,) = hb.hazards
    assert hazard.kind == DEVICE == "unordered-device-access"
    assert (hazard.resource, hazard.first, hazard.second) == ("kv cache", "zero#1", "gather#2")
    assert re.fullmatch(r"kv cache: zero#1 writes it and gather#2 reads it with no event path between "
                        r"stream 'a' and stream 'b'", hazard.message)


def test_a_device_write_after_an_unordered_read_says_reads_then_writes():
    hb, (a, b) = checker("a", "b")
    hb.device_access(DEV, hb.enqueue(a, "gather#1"), write=False)
    hb.device_access(DEV, hb.enqueue(b, "zero#2"), write=True)
    assert re.fullmatch(r"dev 1: gather#1 reads it and zero#2 writes it with no event path between "
                        r"stream 'a' and stream 'b'", hb.hazards[0].message)


def test_device_reads_from_two_streams_are_not_a_hazard():
    hb, (a, b) = checker("a", "b")
    hb.device_access(DEV, hb.enqueue(a, "r1"), write=False)
    hb.device_access(DEV, hb.enqueue(b, "r2"), write=False)
    assert hb.hazards == []


def test_an_event_wait_orders_device_accesses():
    hb, (a, b) = checker("a", "b")
    hb.device_access(DEV, hb.enqueue(a, "zero"), write=True)
    hb.stream_waits(b, hb.snapshot(a))
    hb.device_access(DEV, hb.enqueue(b, "read"), write=False)
    assert hb.hazards == []


def test_a_wait_on_an_event_never_recorded_orders_nothing():
    hb, (a, b) = checker("a", "b")
    hb.device_access(DEV, hb.enqueue(a, "zero"), write=True)
    hb.stream_waits(b, None)
    hb.device_access(DEV, hb.enqueue(b, "read"), write=False)
    assert kinds(hb.hazards) == [DEVICE]


def test_a_host_synchronisation_orders_device_work_enqueued_after_it():
    hb, (a, b) = checker("a", "b")
    hb.device_access(DEV, hb.enqueue(a, "zero"), write=True)
    hb.host_observes_stream(a)
    hb.device_access(DEV, hb.enqueue(b, "read"), write=False)
    assert hb.hazards == [] and hb.notes == []


def test_device_accesses_to_different_resources_never_conflict():
    hb, (a, b) = checker("a", "b")
    hb.device_access(("dev", 1), hb.enqueue(a, "w1"), write=True)
    hb.device_access(("dev", 2), hb.enqueue(b, "w2"), write=True)
    assert hb.hazards == []


def test_an_unordered_device_access_some_other_host_thread_saw_is_a_note():
    hb, (a, b) = checker("a", "b")
    worker = hb.add_host("worker")
    hb.device_access(DEV, hb.enqueue(a, "zero"), write=True)
    hb.host_observes_stream(a, host=worker)  # the worker saw it; the main thread enqueues the read
    hb.device_access(DEV, hb.enqueue(b, "read"), write=False)
    assert hb.hazards == []
    (note,) = hb.notes
    assert note.kind == DEVICE
    assert re.fullmatch(r"dev 1: zero writes it and read reads it with no event path between stream 'a' and "
                        r"stream 'b'; another host thread saw the first access complete, and a hand-off the "
                        r"checker does not follow may order them", note.message)


def test_an_unordered_device_access_no_host_thread_saw_is_a_hazard_with_several_threads():
    hb, (a, b) = checker("a", "b")
    hb.add_host("worker")
    hb.device_access(DEV, hb.enqueue(a, "zero"), write=True)
    hb.device_access(DEV, hb.enqueue(b, "read"), write=False)
    assert kinds(hb.hazards) == [DEVICE] and hb.notes == []


def test_a_device_access_enqueued_by_a_thread_that_received_a_hand_off_is_ordered():
    hb, (a, b) = checker("a", "b")
    worker = hb.add_host("worker", parent=None)
    hb.device_access(DEV, hb.enqueue(a, "zero"), write=True)
    hb.host_observes_stream(a)
    hb.host_acquires(worker, hb.host_snapshot(HOST))
    hb.device_access(DEV, hb.enqueue(b, "read", host=worker), write=False)
    assert hb.hazards == [] and hb.notes == []


def test_a_device_access_enqueued_by_a_thread_without_the_hand_off_is_a_note():
    hb, (a, b) = checker("a", "b")
    worker = hb.add_host("worker", parent=None)
    hb.device_access(DEV, hb.enqueue(a, "zero"), write=True)
    hb.host_observes_stream(a)
    hb.device_access(DEV, hb.enqueue(b, "read", host=worker), write=False)
    assert hb.hazards == [] and len(hb.notes) == 1


def test_a_late_declared_device_race_is_a_hazard_whether_or_not_other_host_threads_exist():
    # Declared late (an indexed op's rows, known once the host saw it run): what host threads have
    # seen by then says nothing of a hand-off when it was enqueued, so the union rule stays out.
    for threads in (1, 2):
        hb, (a, b) = checker("a", "b")
        if threads == 2:
            hb.add_host("idle worker")
        zero, read = hb.enqueue(a, "zero"), hb.enqueue(b, "read")
        hb.device_access(DEV, zero, write=True)
        hb.host_observes_all()  # the rows the read touched became known here
        hb.device_access(DEV, read, write=False, late=True)
        assert kinds(hb.hazards) == [DEVICE] and hb.notes == [], threads


def test_the_same_device_pair_is_reported_once():
    hb, (a, b) = checker("a", "b")
    hb.device_access(DEV, hb.enqueue(a, "zero"), write=True, ranges=[(0, 8), (16, 24)])
    hb.device_access(DEV, hb.enqueue(b, "read"), write=False, ranges=[(0, 24)])
    assert len(hb.hazards) == 1


# -- resources ------------------------------------------------------------------------------------

def test_forget_starts_a_keys_history_over():
    hb, (a, b) = checker("a", "b")
    hb.copy_reads_host(BUF, hb.enqueue(a, "copy#1"))
    hb.copy_writes_host(BUF, hb.enqueue(a, "d2h#2"))
    hb.device_access(BUF, hb.enqueue(a, "kernel"), write=True)
    hb.forget(BUF)
    hb.host_write(BUF, "host write")
    hb.host_read(BUF, "host read")
    hb.device_access(BUF, hb.enqueue(b, "other stream"), write=True)
    assert hb.pending_writes(BUF) == []
    assert hb.hazards == [] and hb.notes == []


def test_forget_leaves_other_keys_alone():
    hb, (s,) = checker("main")
    hb.copy_reads_host(BUF, hb.enqueue(s, "copy#1"))
    hb.forget(("host", 8))
    hb.host_write(BUF, "host write")
    assert kinds(hb.hazards) == [HOST_WRITE]


def test_forget_keeps_the_resources_name():
    hb = HappensBefore()
    hb.name_resource(BUF, "staging")
    hb.forget(BUF)
    assert hb.name(BUF) == "staging"


@pytest.mark.parametrize(("key", "name"), [
    (("block", "kv", 3), "block 3 of cache kv"),
    (("block", "", 3), "block 3"),
    (("block", None, 5), "block 5"),
    (("host", 7), "host 7"),
    (("cudamem", 4096), "cudamem 4096"),
])
def test_a_resource_without_a_name_is_named_after_its_key(key, name):
    assert HappensBefore().name(key) == name


def test_a_named_resource_keeps_its_name():
    hb = HappensBefore()
    hb.name_resource(("block", "kv", 3), "the third block")
    assert hb.name(("block", "kv", 3)) == "the third block"


# -- an op whose host accesses are known only as it runs (late_host_access) ---------------------------

def _late_case(host_access, *, before_enqueue: bool = False, observed: bool = False, op_writes: bool = False):
    """An op queued on a stream, a host access of BUF's bytes [0, 8) (before or after the enqueue,
    with or without the host having seen the op complete), then the op's accesses declared as it runs."""
    hb, (s,) = checker("side")
    hb.expect_late_host_accesses()  # as a session does before queueing such an op (here: before all)
    if before_enqueue:
        host_access(hb)
    op = hb.enqueue(s, "kernel#1")
    if observed:
        hb.host_observes_stream(s)
    if not before_enqueue:
        host_access(hb)
    hb.late_host_access(BUF, op, write=op_writes, ranges=[(0, 8)])
    return hb


def _write(hb, ranges=((0, 8),)):
    hb.host_write(BUF, "pin_memory", ranges=list(ranges))


def _read(hb):
    hb.host_read(BUF, "host read", ranges=[(0, 8)])


def test_a_host_write_after_the_enqueue_of_an_op_that_reads_the_bytes_as_it_runs_is_a_hazard():
    hb = _late_case(_write)
    (hazard,) = hb.hazards
    assert (hazard.kind, hazard.first, hazard.second) == (HOST_WRITE, "kernel#1", "pin_memory")
    assert "may not have read it yet" in hazard.message


def test_a_host_write_before_the_enqueue_or_after_the_host_saw_the_op_complete_is_none():
    assert _late_case(_write, before_enqueue=True).hazards == []
    assert _late_case(_write, observed=True).hazards == []


def test_a_host_write_of_other_bytes_or_a_read_beside_a_reading_op_is_none():
    assert _late_case(lambda hb: _write(hb, [(8, 16)])).hazards == []
    assert _late_case(_read).hazards == []


def test_a_host_read_of_bytes_an_op_writes_as_it_runs_is_a_hazard():
    (hazard,) = _late_case(_read, op_writes=True).hazards
    assert hazard.kind == HOST_READ and "may not have written it yet" in hazard.message


def test_host_accesses_are_kept_only_once_a_late_declaring_op_is_expected():
    hb, (s,) = checker("side")
    op = hb.enqueue(s, "kernel#1")
    _write(hb)  # no op had said it declares late: nothing kept, nothing to check it against
    hb.late_host_access(BUF, op, write=False, ranges=[(0, 8)])
    assert hb.hazards == []


def test_a_host_write_behind_many_host_accesses_is_still_checked_when_the_op_declares():
    # scratch/tri_log.py in small: fill_ of row 0 while a kernel that reads it is queued, then 64
    # bookkeeping reads of other rows; a log of 64 accesses per buffer had dropped the fill_.
    hb, (s,) = checker("side")
    hb.expect_late_host_accesses()
    op = hb.enqueue(s, "kernel#1")
    _write(hb)
    for row in range(1, 1 + 2 * HOST_LOG_SWEEP_AT):
        hb.host_read(BUF, f"read row {row}", ranges=[(8 * row, 8 * row + 8)])
    hb.late_host_access(BUF, op, write=False, ranges=[(0, 8)])
    assert [(h.first, h.second) for h in hb.hazards] == [("kernel#1", "pin_memory")]


def test_host_accesses_stay_while_an_op_queued_before_them_is_not_seen_complete():
    hb, (side, main) = checker("side", "main")
    hb.expect_late_host_accesses()
    op = hb.enqueue(side, "kernel#1")
    _write(hb)
    for i in range(2 * HOST_LOG_SWEEP_AT):  # the host waits for main, never for side
        hb.enqueue(main, f"step#{i}")
        hb.host_observes_stream(main)
        hb.host_read(("host", 100 + i), "bookkeeping")
    hb.late_host_access(BUF, op, write=False, ranges=[(0, 8)])
    assert [(h.first, h.second) for h in hb.hazards] == [("kernel#1", "pin_memory")]


def test_a_long_synchronised_loop_keeps_pending_copies_and_host_accesses_bounded():
    hb, (s,) = checker("copy stream")
    weights = ("host", 9)  # copied every step, never written by the host
    hb.expect_late_host_accesses()
    for i in range(20 * HOST_LOG_SWEEP_AT):
        hb.copy_reads_host(weights, hb.enqueue(s, f"upload#{i}"), [(8 * (i % 512), 8 * (i % 512) + 8)])
        copy = hb.enqueue(s, f"copy#{i}")
        hb.copy_reads_host(BUF, copy, [(0, 8)])
        hb.host_read(("host", 1000 + i), "read a fresh buffer")  # kept: the copy is still queued
        if i % 16 == 15:
            hb.host_observes_stream(s)
            hb.host_write(BUF, "refill", ranges=[(0, 8)])
    assert hb.hazards == [] and hb.notes == []
    assert len(hb._host_readers[weights]) <= 2 * PENDING_PRUNE_AT
    assert len(hb._host_readers[BUF]) <= 16
    assert sum(len(log) for log in hb._host_log.values()) <= 2 * HOST_LOG_SWEEP_AT
    assert len(hb._host_log) <= 2 * HOST_LOG_SWEEP_AT


def test_copies_of_one_buffer_nobody_waits_for_keep_one_per_stream():
    hb, (s,) = checker("copy stream")
    for i in range(10 * PENDING_PRUNE_AT):
        hb.copy_reads_host(BUF, hb.enqueue(s, f"upload#{i}"))
    assert len(hb._host_readers[BUF]) <= PENDING_PRUNE_AT


def test_after_its_late_declaration_the_op_is_pending_like_any_copy():
    hb = _late_case(lambda hb: None)
    assert hb.hazards == []
    _write(hb)
    (hazard,) = hb.hazards
    assert (hazard.kind, hazard.first) == (HOST_WRITE, "kernel#1")


# -- host read vs. pending event (elapsed_time) ---------------------------------------------------------

EVENT = ("event time", 1)


def test_reading_an_events_time_before_seeing_it_complete_is_a_hazard_and_after_is_not():
    hb, (s,) = checker("side")
    hb.enqueue(s, "copy#1")
    record = hb.enqueue(s, "event record#2")
    hb.host_reads_event(EVENT, record, "elapsed_time")
    (hazard,) = hb.hazards
    assert (hazard.kind, hazard.first, hazard.second) == (EVENT_READ, "event record#2", "elapsed_time")
    assert f"| `{EVENT_READ}` |" in (Path(__file__).resolve().parents[1] / "docs" / "sanitizer.md").read_text()
    hb.host_observes(record.vc)  # end.synchronize(), or a query that answered True
    hb.host_reads_event(EVENT, record, "elapsed_time")
    assert len(hb.hazards) == 1 and hb.notes == []


def test_an_event_recorded_on_another_stream_than_the_one_the_host_saw_is_still_pending():
    hb, (a, b) = checker("a", "b")
    start = hb.enqueue(a, "event record#1")
    end = hb.enqueue(b, "event record#2")
    hb.host_observes(end.vc)  # the end seen, the start (on a stream the end never waited for) not
    hb.host_reads_event(EVENT, end, "elapsed_time")
    assert hb.hazards == []
    hb.host_reads_event(EVENT, start, "elapsed_time")
    assert kinds(hb.hazards) == [EVENT_READ]


def test_an_event_time_another_host_thread_saw_complete_is_a_note_not_a_hazard():
    hb, (s,) = checker("side")
    worker = hb.add_host("worker")
    record = hb.enqueue(s, "event record#1")
    hb.host_observes(record.vc, worker)  # the worker synchronised; the main thread learned it unseen
    hb.host_reads_event(EVENT, record, "elapsed_time")
    assert hb.hazards == [] and kinds(hb.notes) == [EVENT_READ]
