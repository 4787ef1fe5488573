"""One placement of raw address runs into memory (racecheck.placement), and one reading of a
Triton kernel's source for what it stores and what it loads through tables (racecheck.triton_stores)."""

from __future__ import annotations

import pytest
import torch

from racecheck.pinned import PinnedMemory
from racecheck.placement import Extents, Placed, by_memory, place
from racecheck.triton_stores import kernel_flow
from kvdevice.intercept.sim_memory import SimDeviceMemory
from kvdevice.runtime import SimRuntime


@pytest.fixture
def device() -> SimDeviceMemory:
    return SimDeviceMemory(SimRuntime())


def test_a_run_of_simulated_device_memory_is_placed_in_its_block_the_kv_caches_apart(device):
    block = device.alloc(64, device.rt.default_stream, "x").block
    placed, unplaced = place([(block.start + 8, block.start + 24)], [device])
    assert unplaced == []
    assert [(p.memory, p.key, p.kind, p.ranges) for p in placed] == [
        (block, ("simdev", block.id), "device", [(block.start + 8, block.start + 24)])]
    cache = device.adopt(torch.zeros(64, dtype=torch.uint8), "kv cache", cache_tensor=0).block
    assert [p.kind for p in place([(cache.start, cache.start + 4)], [device])[0]] == ["cache"]


def test_pinned_and_registered_host_memory_are_placed_in_their_regions():
    regions = PinnedMemory()
    pinned = regions.add_tensor(torch.zeros(16, dtype=torch.uint8), "pinned")
    registered = regions.add(0x10000, 0x10100, "cudaHostRegister", registered=True)
    placed, unplaced = place([(pinned.start + 4, pinned.start + 8), (0x10010, 0x10020)], [regions])
    assert unplaced == []
    assert sorted((p.start, p.memory.id, p.kind, p.ranges) for p in placed) == sorted([
        (0x10010, registered.id, "pinned", [(0x10010, 0x10020)]),
        (pinned.start + 4, pinned.id, "pinned", [(pinned.start + 4, pinned.start + 8)])])
    assert [p.key for p in placed] == [p.memory.key for p in placed]


def test_memories_are_asked_in_order_and_the_first_that_holds_a_whole_run_takes_it():
    # An op's host argument is the host's at the call, before any other memory that holds it.
    host = Extents([(0x1000, 0x1100, None, None, "host")])
    device = Extents([(0x1000, 0x2000, 0x1000, ("cudamem", 0x1000), "device")])
    placed, _ = place([(0x1010, 0x1020)], [host, device])
    assert [p.kind for p in placed] == ["host"]
    # A run only part of which the first memory holds goes to one that holds it whole.
    placed, _ = place([(0x10f0, 0x1200)], [host, device])
    assert [(p.kind, p.ranges) for p in placed] == [("device", [(0x10f0, 0x1200)])]


def test_a_run_crossing_two_allocations_is_unplaced_unless_split():
    two = Extents([(0x1000, 0x1100, "a", ("cudamem", 0x1000), "device"),
                   (0x1100, 0x1200, "b", ("cudamem", 0x1100), "device")])
    placed, unplaced = place([(0x10f0, 0x1110)], [two])
    assert placed == [] and unplaced == [(0x10f0, 0x1110)]
    placed, unplaced = place([(0x10f0, 0x1110)], [two], split=True)
    assert unplaced == []
    assert [(p.memory, p.ranges) for p in placed] == [("a", [(0x10f0, 0x1100)]), ("b", [(0x1100, 0x1110)])]


def test_a_run_in_no_memory_comes_back_unplaced_never_dropped(device):
    regions = PinnedMemory()
    start = device.alloc(64, device.rt.default_stream, "x").block.start
    placed, unplaced = place([(0x10, 0x20), (start, start + 4), (0x30, 0x38)], [device, regions])
    assert unplaced == [(0x10, 0x20), (0x30, 0x38)]
    assert [p.ranges for p in placed] == [[(start, start + 4)]]


def test_runs_of_one_memory_are_one_placed_per_memory_by_memory():
    memory = Extents([(0x1000, 0x2000, 0x1000, ("cudamem", 0x1000), "device"),
                      (0x3000, 0x4000, None, None, "host")])
    placed, _ = place([(0x1000, 0x1010), (0x3000, 0x3004), (0x1020, 0x1030), (0x1010, 0x1018)], [memory])
    assert len(placed) == 3  # merged runs: [0x1000, 0x1018), [0x1020, 0x1030), [0x3000, 0x3004)
    grouped = by_memory(placed, ("device",))
    assert [(p.key, p.ranges) for p in grouped] == [(("cudamem", 0x1000), [(0x1000, 0x1018), (0x1020, 0x1030)])]


def test_the_record_is_what_the_runtime_declares():
    block = type("Block", (), {"key": ("simdev", 3)})()
    assert Placed.whole(block).key == ("simdev", 3) and Placed.whole(block).ranges is None
    assert Placed.whole(("cudamem", 7)).key == ("cudamem", 7)
    placed = Placed(block, block.key, "device", [(8, 16)])
    assert Placed.whole(placed) is placed and (placed.start, placed.end) == (8, 16)


def test_the_storages_of_tensors_are_memories_of_the_kind_given():
    a, b = torch.zeros(8), torch.zeros(4)
    extents = Extents.of_storages([a, b, 3], lambda t: "device" if t is a else None)
    assert extents.holding(a.data_ptr() + 4, a.data_ptr() + 8).key == ("cudamem", a.data_ptr())
    assert extents.holding(b.data_ptr(), b.data_ptr() + 4) is None


# -- one reading of a kernel's source --------------------------------------------------------------------

def swap(src_addrs, dst_addrs, sizes, scratch, n: tl.constexpr):  # noqa: F821
    for i in range(n):
        src = tl.load(src_addrs + i)  # noqa: F821 (read, never run)
        dst = tl.load(dst_addrs + i)  # noqa: F821
        tl.store(dst, tl.load(src), mask=tl.arange(0, 4) < tl.load(sizes + i))  # noqa: F821
    tl.store(scratch, 0)  # noqa: F821


def through_a_table_of_tables(tables, out):
    inner = tl.load(tables)  # noqa: F821
    address = tl.load(inner)  # noqa: F821
    tl.store(out, tl.load(address))  # noqa: F821


def stores_through_a_local_a_loop_later_carries(a, b, n):
    for i in range(n):
        tl.store(a, 1)  # noqa: F821
        a = b


def test_one_reading_says_what_a_kernel_stores_and_which_tables_it_loads_through():
    assert kernel_flow(swap)[:3] == (frozenset({"scratch"}), frozenset({"src_addrs", "dst_addrs", "sizes"}), False)
    assert kernel_flow(through_a_table_of_tables)[:3] == (frozenset({"out"}), frozenset({"tables"}), True)
    # the stores' reading follows assignments in order, as before the two were one pass
    assert kernel_flow(stores_through_a_local_a_loop_later_carries).stored == frozenset({"a"})


def test_a_kernel_whose_source_cannot_be_read_writes_everything_and_has_no_tables():
    made = eval("lambda x, y: None")
    assert kernel_flow(made) == (frozenset({"x", "y"}), frozenset(), False, False)  # nor did the reading see it all
