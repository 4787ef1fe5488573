"""racecheck.pinned: pinned regions by address, byte snapshots of pending reads, and the watch that
turns host writes no call shows (numpy views) and host reads under pending copies into hazards.

CPU tensors stand in for pinned memory: the regions are only addresses, and snapshots read bytes
with ctypes."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch

from racecheck.hb import DEVICE, HOST_READ, HOST_WRITE, HappensBefore
from racecheck.pinned import PendingReads, PinnedMemory, PinnedWatch, Region, Snapshot, read_runs
from racecheck.threads import HostThreads


def stamp(label: str = "copy#1"):
    hb = HappensBefore()
    return hb.enqueue(hb.add_stream("s"), label)


def watched() -> tuple[HappensBefore, PinnedWatch, int]:
    hb = HappensBefore()
    watch = PinnedWatch(hb, HostThreads(hb).current)
    return hb, watch, hb.add_stream("copy")


# -- PinnedMemory ---------------------------------------------------------------------------------

def test_a_region_is_found_by_any_address_inside_it():
    memory = PinnedMemory()
    region = memory.add(100, 200, "staging", origin="cudaHostRegister")
    assert (region.id, region.start, region.end) == (1, 100, 200)
    assert (region.name, region.origin, region.registered) == ("staging", "cudaHostRegister", False)
    assert region.key == ("pinned", 1)
    assert memory.find(100) is region
    assert memory.find(199) is region
    assert memory.find(200) is None
    assert memory.find(99) is None


def test_regions_are_found_among_several():
    memory = PinnedMemory()
    high = memory.add(300, 400)
    low = memory.add(100, 200)
    assert memory.regions() == [low, high]
    assert len(memory) == 2
    assert memory.find(150) is low
    assert memory.find(250) is None
    assert memory.find(350) is high
    assert [r.id for r in (high, low)] == [1, 2]


def test_an_overlapping_region_replaces_the_old_one():
    memory = PinnedMemory()
    old = memory.add(100, 200)
    keep = memory.add(300, 400)
    new = memory.add(150, 250)
    assert memory.regions() == [new, keep]
    assert memory.find(120) is None
    assert memory.find(160) is new
    assert old not in memory.regions()


def test_an_adjacent_region_replaces_nothing():
    memory = PinnedMemory()
    left = memory.add(100, 200)
    right = memory.add(200, 300)
    assert memory.regions() == [left, right]
    assert memory.find(199) is left and memory.find(200) is right


def test_a_region_over_several_old_ones_replaces_them_all():
    memory = PinnedMemory()
    memory.add(100, 200)
    memory.add(200, 300)
    big = memory.add(0, 1000)
    assert memory.regions() == [big]


def test_a_removed_region_is_not_found_and_removing_twice_is_harmless():
    memory = PinnedMemory()
    region = memory.add(100, 200)
    memory.remove(region)
    memory.remove(region)
    assert memory.find(150) is None
    assert len(memory) == 0


def test_region_ids_come_from_the_given_iterator():
    memory = PinnedMemory(iter([10, 20]))
    assert [memory.add(0, 8).id, memory.add(8, 16).id] == [10, 20]


def test_a_tensors_region_is_its_whole_storage():
    buf = torch.zeros(16, dtype=torch.int32)
    memory = PinnedMemory()
    region = memory.add_tensor(buf[4:8], "staging")
    assert (region.start, region.end) == (buf.data_ptr(), buf.data_ptr() + 64)


def test_of_finds_the_region_of_a_view():
    buf = torch.zeros(16, dtype=torch.int32)
    memory = PinnedMemory()
    region = memory.add_tensor(buf)
    assert memory.of(buf[5:9]) is region
    assert memory.of(buf[::3]) is region
    assert memory.of(buf[16:]) is region  # empty: found by its storage
    assert memory.of(torch.zeros(4)) is None


def test_of_ignores_tensors_that_are_not_on_the_cpu():
    memory = PinnedMemory()
    memory.add(0, 1 << 62)
    assert memory.of(torch.empty(4, device="meta")) is None


def test_a_regions_runs_are_the_views_bytes_inside_it():
    buf = torch.zeros(16, dtype=torch.int32)
    base = buf.data_ptr()
    region = Region(1, base + 8, base + 24, "part")
    assert region.runs(buf[:4]) == [(base + 8, base + 16)]
    assert region.runs(buf[::4]) == [(base + 16, base + 20)]


# -- Snapshot -------------------------------------------------------------------------------------

def test_a_snapshot_changes_when_the_host_writes_a_contiguous_view_through_numpy():
    buf = torch.arange(8, dtype=torch.int64)
    region = PinnedMemory().add_tensor(buf)
    snapshot = Snapshot.of(region, buf[:4], stamp())
    assert snapshot.runs == [(buf.data_ptr(), buf.data_ptr() + 32)]
    assert (snapshot.dtype, snapshot.shape) == (torch.int64, (4,))
    buf.numpy()[5] = 50  # outside the view
    assert not snapshot.changed()
    buf.numpy()[1] = 10
    assert snapshot.changed()


def test_a_snapshot_of_a_strided_view_sees_only_its_own_elements():
    buf = torch.arange(8, dtype=torch.int32)
    region = PinnedMemory().add_tensor(buf)
    snapshot = Snapshot.of(region, buf[::2], stamp())
    assert len(snapshot.runs) == 4
    buf.numpy()[3] = -1  # between two elements of the view
    assert not snapshot.changed()
    buf.numpy()[6] = -1
    assert snapshot.changed()


def test_a_snapshot_through_a_numpy_view_of_a_numpy_view():
    buf = torch.zeros(4, 4, dtype=torch.float32)
    region = PinnedMemory().add_tensor(buf)
    snapshot = Snapshot.of(region, buf[:, 1], stamp())
    array = buf.numpy()[:, 1:3]
    array[2, 1] = 1.0  # column 2: not the view's
    assert not snapshot.changed()
    array[2, 0] = 1.0
    assert snapshot.changed()


def test_values_are_the_staged_elements_as_same_width_integers():
    buf = torch.tensor([[1.0, float("nan")], [3.0, 4.0]], dtype=torch.float32)
    region = PinnedMemory().add_tensor(buf)
    snapshot = Snapshot.of(region, buf, stamp())
    values = snapshot.values()
    assert values.dtype == np.int32 and values.shape == (2, 2)
    assert np.array_equal(values, buf.numpy().view(np.int32))
    assert np.array_equal(snapshot.now(), values)  # NaN compares equal as bits


def test_now_shows_the_elements_as_they_are_and_values_as_they_were():
    buf = torch.arange(6, dtype=torch.int64)
    region = PinnedMemory().add_tensor(buf)
    snapshot = Snapshot.of(region, buf[1::2], stamp())
    buf.numpy()[3] = 30
    assert snapshot.values().tolist() == [1, 3, 5]
    assert snapshot.now().tolist() == [1, 30, 5]
    assert snapshot.values(read_runs(snapshot.runs)).tolist() == [1, 30, 5]


def test_values_of_complex_or_odd_bytes_are_raw_bytes():
    buf = torch.zeros(2, dtype=torch.complex64)
    snapshot = Snapshot.of(PinnedMemory().add_tensor(buf), buf, stamp())
    assert snapshot.values().dtype == np.uint8 and snapshot.values().size == 16


def test_values_of_a_scalar_view_are_one_element():
    buf = torch.arange(4, dtype=torch.int16)
    snapshot = Snapshot.of(PinnedMemory().add_tensor(buf), buf[2], stamp())
    assert snapshot.shape == ()
    assert snapshot.values().tolist() == 2


def test_a_snapshot_keeps_what_the_caller_gives_it():
    buf = torch.zeros(4)
    keep = object()
    snapshot = Snapshot.of(PinnedMemory().add_tensor(buf), buf, stamp(), keep=keep)
    assert snapshot.keep is keep
    assert snapshot.extra == {}


# -- PendingReads ---------------------------------------------------------------------------------

def never(_stamp) -> bool:
    return False


def test_a_changed_snapshot_is_reported_once():
    buf = torch.zeros(8, dtype=torch.int64)
    region = PinnedMemory().add_tensor(buf)
    reads = PendingReads()
    snapshot = Snapshot.of(region, buf[:2], stamp())
    reads.add(snapshot)
    assert reads and len(reads) == 1
    assert reads.changed(never) == []
    buf.numpy()[0] = 7
    assert reads.changed(never) == [snapshot]
    assert reads.changed(never) == []
    assert not reads


def test_unchanged_snapshots_stay_pending():
    buf = torch.zeros(8, dtype=torch.int64)
    region = PinnedMemory().add_tensor(buf)
    reads = PendingReads()
    first, second = Snapshot.of(region, buf[:2], stamp()), Snapshot.of(region, buf[4:], stamp())
    reads.add(first)
    reads.add(second)
    buf.numpy()[0] = 7
    assert reads.changed(never) == [first]
    assert list(reads) == [second]


def test_snapshots_of_reads_seen_complete_are_dropped_unreported():
    buf = torch.zeros(8, dtype=torch.int64)
    region = PinnedMemory().add_tensor(buf)
    reads = PendingReads()
    done, pending = stamp("done"), stamp("pending")
    reads.add(Snapshot.of(region, buf, done))
    kept = Snapshot.of(region, buf[:4], pending)
    reads.add(kept)
    assert reads.changed(lambda s: s is done) == []
    assert list(reads) == [kept]
    buf.numpy()[:] = 1
    assert reads.changed(lambda s: s is done) == [kept]


def test_snapshots_of_memory_gone_are_dropped_unless_changed():
    buf = torch.zeros(8, dtype=torch.int64)
    region = PinnedMemory().add_tensor(buf)
    reads = PendingReads()
    quiet, written = Snapshot.of(region, buf[:4], stamp()), Snapshot.of(region, buf[4:], stamp())
    reads.add(quiet)
    reads.add(written)
    buf.numpy()[6] = 1
    assert reads.changed(never, gone=lambda s: True) == [written]
    assert len(reads) == 0


def test_drop_forgets_the_snapshots_a_device_to_host_copy_will_overwrite():
    buf, other = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    memory = PinnedMemory()
    region, other_region = memory.add_tensor(buf), memory.add_tensor(other)
    reads = PendingReads()
    head, tail = Snapshot.of(region, buf[:4], stamp()), Snapshot.of(region, buf[4:], stamp())
    elsewhere = Snapshot.of(other_region, other[:4], stamp())
    for snapshot in (head, tail, elsewhere):
        reads.add(snapshot)
    reads.drop(region, region.runs(buf[2:3]))
    assert list(reads) == [tail, elsewhere]


def test_forget_drops_every_snapshot_of_a_region():
    buf, other = torch.zeros(8), torch.zeros(8)
    memory = PinnedMemory()
    region, other_region = memory.add_tensor(buf), memory.add_tensor(other)
    reads = PendingReads()
    reads.add(Snapshot.of(region, buf[:2], stamp()))
    reads.add(Snapshot.of(region, buf[4:], stamp()))
    kept = Snapshot.of(other_region, other, stamp())
    reads.add(kept)
    reads.forget(region)
    assert list(reads) == [kept]


def test_the_oldest_snapshots_are_dropped_beyond_the_limit():
    buf = torch.zeros(8)
    region = PinnedMemory().add_tensor(buf)
    reads = PendingReads(limit=2)
    snapshots = [Snapshot.of(region, buf, stamp(f"copy#{i}")) for i in range(6)]
    for snapshot in snapshots[:3]:
        reads.add(snapshot)
    assert reads.changed(never) == [] and list(reads) == snapshots[1:3]  # the limit, kept at a check
    for snapshot in snapshots[3:]:
        reads.add(snapshot)
    assert list(reads) == snapshots[2:]  # between checks, twice the limit at most


def test_reads_seen_complete_go_before_a_live_read_is_dropped_for_the_limit():
    # review of the grouping: a large group's reads seen complete must not push a live read out
    buf, staging = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    memory = PinnedMemory()
    region, staging_region = memory.add_tensor(buf), memory.add_tensor(staging)
    reads = PendingReads(limit=20)
    live = Snapshot.of(staging_region, staging, stamp("live"))
    reads.add(live)
    done = set()
    for i in range(12):  # one buffer copied again and again, each copy seen complete later (another stream's order)
        snapshot = Snapshot.of(region, buf, stamp(f"copy#{i}"))
        reads.add(snapshot)
        assert reads.changed(lambda s: s in done) == []
    done.update(s.stamp for s in reads if s is not live)
    others = [torch.full((8,), i, dtype=torch.int64) for i in range(15)]  # kept alive: their bytes stay
    for i, other in enumerate(others):
        reads.add(Snapshot.of(memory.add_tensor(other), other, stamp(f"other#{i}")))
    staging.numpy()[0] = 1
    assert reads.changed(lambda s: s in done) == [live]


def test_reads_of_the_same_unchanged_bytes_are_compared_once_per_check(monkeypatch):
    # a staging buffer copied a thousand times before the host syncs: one comparison per check, not a thousand
    buf = torch.zeros(8, dtype=torch.int64)
    region = PinnedMemory().add_tensor(buf)
    reads = PendingReads()
    snapshots = [Snapshot.of(region, buf[:4], stamp(f"copy#{i}")) for i in range(1000)]
    for snapshot in snapshots:
        reads.add(snapshot)
    compared = []
    monkeypatch.setattr(Snapshot, "changed", lambda self: compared.append(self) or read_runs(self.runs) != self.raw)
    assert reads.changed(never) == []
    assert len(compared) == 1 and len(reads) == 1000
    asked = []
    for _ in range(10):  # pruned whole again only once the group has doubled: its oldest read asked about, no more
        assert reads.changed(lambda s: asked.append(s) or False) == []
    assert asked == [snapshots[0].stamp] * 10 and len(compared) == 11
    buf.numpy()[1] = 5
    assert reads.changed(lambda s: s is snapshots[3].stamp) == snapshots[:3] + snapshots[4:]
    assert len(reads) == 0


def test_a_large_group_drops_reads_seen_complete_once_it_has_doubled():
    buf = torch.zeros(8, dtype=torch.int64)
    region = PinnedMemory().add_tensor(buf)
    reads = PendingReads()
    done = set()
    snapshots = [Snapshot.of(region, buf, stamp(f"copy#{i}")) for i in range(10)]
    for snapshot in snapshots:
        reads.add(snapshot)
        done.add(snapshot.stamp)  # each read seen complete before the next is queued
        reads.changed(lambda s: s in done)
    assert len(reads) <= 4  # pruned as it grows: never more than twice what survived the last prune


# -- PinnedWatch ----------------------------------------------------------------------------------

def test_a_numpy_write_under_a_pending_read_is_a_host_write_hazard():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf, "staging")
    snapshot = watch.note_read(region, buf[:4], hb.enqueue(s, "copy#1"))
    assert snapshot is not None
    buf.numpy()[2] = 7
    assert watch.check("numpy write") == [snapshot]
    (hazard,) = hb.hazards
    assert (hazard.kind, hazard.resource) == (HOST_WRITE, "staging")
    assert (hazard.first, hazard.second) == ("copy#1", "numpy write")
    assert watch.check("numpy write") == []
    assert len(hb.hazards) == 1


def test_a_numpy_write_outside_the_pending_read_is_not_a_hazard():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    watch.note_read(region, buf[:4], hb.enqueue(s, "copy#1"))
    buf.numpy()[4:] = 7
    assert watch.check("numpy write") == []
    assert hb.hazards == []


def test_a_numpy_write_after_the_host_observed_the_read_is_not_a_hazard():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    watch.note_read(region, buf, hb.enqueue(s, "copy#1"))
    hb.host_observes_stream(s)
    buf.numpy()[:] = 7
    assert watch.check("numpy write") == []
    assert hb.hazards == [] and len(watch.pending) == 0


def test_a_registered_buffer_is_named_for_reports():
    hb, watch, _ = watched()
    named = watch.register(torch.zeros(4), "staging")
    unnamed = watch.register(torch.zeros(4))
    assert hb.name(named.key) == "staging"
    assert hb.name(unnamed.key) == f"pinned host buffer p{unnamed.id}"
    watch.rename(unnamed, "ring slot 0")
    assert unnamed.name == "ring slot 0" and hb.name(unnamed.key) == "ring slot 0"


def test_register_keeps_the_tensor_unless_told_not_to():
    _, watch, _ = watched()
    buf = torch.zeros(4)
    assert watch.register(buf).base is buf
    assert watch.register(torch.zeros(4), keep=False).base is None


def test_a_host_read_under_a_pending_device_to_host_copy_is_a_host_read_hazard():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf, "output")
    runs = watch.note_device_write(region, buf[:4], hb.enqueue(s, "d2h#1"))
    assert runs == [(buf.data_ptr(), buf.data_ptr() + 32)]
    assert watch.pending_write(region, buf[2:3])
    assert not watch.pending_write(region, buf[4:])
    watch.host_read(region, buf[4:], "read the tail")
    assert hb.hazards == []
    watch.host_read(region, buf[1:2], "read the head")
    (hazard,) = hb.hazards
    assert (hazard.kind, hazard.resource) == (HOST_READ, "output")
    assert (hazard.first, hazard.second) == ("d2h#1", "read the head")


def test_a_host_read_of_the_whole_region_meets_any_pending_device_to_host_copy():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    watch.note_device_write(region, buf[6:], hb.enqueue(s, "d2h#1"))
    assert watch.pending_write(region)
    watch.host_read(region, None, "tolist")
    assert [h.kind for h in hb.hazards] == [HOST_READ]


def test_a_host_read_after_observing_the_device_to_host_copy_is_not_a_hazard():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    watch.note_device_write(region, buf, hb.enqueue(s, "d2h#1"))
    hb.host_observes_stream(s)
    assert not watch.pending_write(region)
    watch.host_read(region, None, "tolist")
    assert hb.hazards == []


def test_a_seen_host_write_under_a_pending_read_is_a_hazard():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    watch.note_read(region, buf[:4], hb.enqueue(s, "copy#1"))
    watch.host_write(region, buf[4:], "fill_ the tail")
    assert hb.hazards == []
    watch.host_write(region, None, "fill_ all")
    assert [(h.kind, h.second) for h in hb.hazards] == [(HOST_WRITE, "fill_ all")]


def test_host_access_runs_reports_reads_and_writes_of_raw_runs():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    base = buf.data_ptr()
    watch.note_read(region, buf[:2], hb.enqueue(s, "h2d#1"))
    watch.note_device_write(region, buf[4:6], hb.enqueue(s, "d2h#2"))
    watch.host_access_runs(region, [(base + 32, base + 40)], "memmove out", write=False)
    watch.host_access_runs(region, [(base, base + 8)], "memmove in", write=True)
    assert [(h.kind, h.first) for h in hb.hazards] == [(HOST_READ, "d2h#2"), (HOST_WRITE, "h2d#1")]


def test_a_read_queued_under_a_pending_device_to_host_copy_is_not_snapshotted():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    watch.note_device_write(region, buf, hb.enqueue(s, "d2h#1"))
    assert watch.note_read(region, buf[:4], hb.enqueue(s, "h2d#2")) is None
    assert len(watch.pending) == 0
    buf.numpy()[0] = 5  # what the d2h copy would do: no snapshot could tell it from a host write
    assert watch.check("numpy write") == []


def test_a_device_to_host_copy_drops_the_snapshots_it_overwrites():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    watch.note_read(region, buf[:4], hb.enqueue(s, "h2d#1"))
    kept = watch.note_read(region, buf[4:], hb.enqueue(s, "h2d#2"))
    watch.note_device_write(region, buf[:2], hb.enqueue(s, "d2h#3"))
    assert list(watch.pending) == [kept]


def test_a_buffer_that_received_a_device_to_host_copy_is_checked_again_once_the_host_saw_it():
    # The stale-state regression: a buffer's history used to switch its snapshots off for good.
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf, "bounce")
    watch.note_device_write(region, buf, hb.enqueue(s, "d2h#1"))
    hb.host_observes_stream(s)
    snapshot = watch.note_read(region, buf[:4], hb.enqueue(s, "h2d#2"))
    assert snapshot is not None
    buf.numpy()[1] = 9
    assert watch.check("numpy write") == [snapshot]
    assert [(h.kind, h.first) for h in hb.hazards] == [(HOST_WRITE, "h2d#2")]


def test_a_buffer_is_checked_again_after_every_round_trip():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    for i in range(3):
        watch.note_device_write(region, buf, hb.enqueue(s, f"d2h#{i}"))
        hb.host_observes_stream(s)
        assert watch.note_read(region, buf, hb.enqueue(s, f"h2d#{i}")) is not None
        buf.numpy()[i] = 100 + i
        assert len(watch.check(f"numpy write {i}")) == 1
        hb.host_observes_stream(s)
    assert [h.first for h in hb.hazards] == ["h2d#0", "h2d#1", "h2d#2"]


def test_a_bounce_buffer_read_on_another_stream_without_a_wait_is_a_device_hazard():
    hb, watch, s = watched()
    other = hb.add_stream("load")
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf, "bounce")
    watch.note_device_write(region, buf, hb.enqueue(s, "d2h#1"))
    watch.note_read(region, buf, hb.enqueue(other, "h2d#2"))
    assert [(h.kind, h.first, h.second) for h in hb.hazards] == [(DEVICE, "d2h#1", "h2d#2")]


def test_a_bounce_buffer_read_after_an_event_wait_is_not_a_device_hazard():
    hb, watch, s = watched()
    other = hb.add_stream("load")
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf, "bounce")
    watch.note_device_write(region, buf, hb.enqueue(s, "d2h#1"))
    hb.stream_waits(other, hb.snapshot(s))
    watch.note_read(region, buf, hb.enqueue(other, "h2d#2"))
    assert hb.hazards == []


def test_a_thread_met_late_writing_under_a_read_the_main_thread_saw_gets_a_note():
    hb = HappensBefore()
    threads = HostThreads(hb)
    watch = PinnedWatch(hb, threads.current)
    s = hb.add_stream("copy")
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    watch.note_read(region, buf, hb.enqueue(s, "copy#1"))
    hb.host_observes_stream(s)  # the main thread saw the copy run

    def worker() -> None:
        buf.numpy()[0] = 1
        watch.check("worker write")

    thread = threading.Thread(target=worker, name="writer")
    thread.start()
    thread.join()
    assert hb.hazards == []
    (note,) = hb.notes
    assert note.second == "worker write"
    assert re.search(r"; another host thread saw the copy complete first", note.message)


def test_register_range_makes_registered_memory():
    hb, watch, _ = watched()
    buf = torch.zeros(16, dtype=torch.int32)
    region = watch.register_range(buf.data_ptr(), 64)
    assert region.registered
    assert (region.start, region.end) == (buf.data_ptr(), buf.data_ptr() + 64)
    assert hb.name(region.key) == f"registered host memory p{region.id}"
    assert watch.lookup(buf[3:5]) is region
    assert watch.register_range(buf.data_ptr(), 64, "host kv pool").name == "host kv pool"


def test_unregister_range_forgets_the_region_and_its_snapshots():
    hb, watch, s = watched()
    buf = torch.zeros(16, dtype=torch.int32)
    region = watch.register_range(buf.data_ptr(), 64)
    watch.note_read(region, buf[:4], hb.enqueue(s, "copy#1"))
    assert len(watch.pending) == 1
    assert watch.unregister_range(buf.data_ptr())
    assert len(watch.pending) == 0
    assert watch.lookup(buf) is None
    assert not watch.unregister_range(buf.data_ptr())
    buf.numpy()[0] = 3
    assert watch.check("numpy write") == []


def test_unregister_range_leaves_allocations_alone():
    _, watch, _ = watched()
    buf = torch.zeros(16, dtype=torch.int32)
    region = watch.register(buf)
    assert not watch.unregister_range(buf.data_ptr())
    assert not watch.unregister_range(buf.data_ptr() + 8)
    assert not watch.unregister_range(1)
    assert watch.lookup(buf) is region


def test_lookup_finds_views_and_tensors_over_numpy_views_of_the_region():
    _, watch, _ = watched()
    buf = torch.zeros(4, 4, dtype=torch.float32)
    region = watch.register(buf)
    assert watch.lookup(buf[2]) is region
    assert watch.lookup(buf[:, 3]) is region
    assert watch.lookup(buf.t()) is region
    assert watch.lookup(torch.from_numpy(buf.numpy()[1:3, 2])) is region
    assert watch.lookup(torch.zeros(4)) is None
    assert watch.lookup(buf.numpy()) is None  # not a tensor
    assert watch.lookup(None) is None


def test_lookup_with_no_regions_finds_nothing():
    _, watch, _ = watched()
    assert watch.lookup(torch.zeros(4)) is None


def test_registering_over_a_region_replaces_it_with_a_fresh_history():
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    old = watch.register(buf)
    watch.note_read(old, buf, hb.enqueue(s, "copy#1"))
    new = watch.register(buf)
    assert new is not old and new.key != old.key
    assert watch.lookup(buf) is new
    watch.host_write(new, None, "fill_")
    assert hb.hazards == []


@pytest.mark.parametrize("empty", [slice(0, 0), slice(3, 3)], ids=["start", "middle"])
def test_an_empty_view_reads_no_bytes(empty):
    hb, watch, s = watched()
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    snapshot = watch.note_read(region, buf[empty], hb.enqueue(s, "copy#1"))
    assert snapshot is not None and snapshot.runs == []
    buf.numpy()[:] = 1
    assert watch.check("numpy write") == []


def test_an_empty_device_to_host_copy_races_with_nothing():
    hb, watch, s = watched()
    other = hb.add_stream("load")
    buf = torch.zeros(8, dtype=torch.int64)
    region = watch.register(buf)
    assert watch.note_device_write(region, buf[:0], hb.enqueue(s, "empty d2h")) == []
    watch.note_read(region, buf, hb.enqueue(other, "h2d"))
    assert hb.hazards == []
