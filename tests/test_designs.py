"""The zeroer designs on fixed interleavings of the simulator.

The racy designs lose blocks exactly as measured on an H200 (docs/results.md); the
race-free ones are correct on the same interleavings; the happens-before checker flags the racy
ones even on a schedule where their values come out right, and stays quiet on the others."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from zeroer.cache.geometries import geometry
from zeroer.cache.layout import build_cache
from zeroer.registry import RACE_FREE, RACY, make_zeroer
from kvdevice.runtime import EagerSchedule, SimRuntime, make_runtime

ALL = sorted(RACE_FREE + RACY)
STAGED = sorted(set(ALL) - {"reference"})
# The controlled cuda mode enforces the simulator's lazy schedule with gates, so every fixed
# interleaving below must give the same blocks on a GPU.
BACKENDS = ["sim"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


_OPENED: list = []  # the runtimes and zeroers the running test built, closed when it ends


@pytest.fixture(autouse=True)
def closes_what_it_opened():
    """Every runtime a test builds (through setup() or opened()) is closed when the test ends, also
    when it fails: on cuda an open runtime keeps its gates and its watchdog, and a sanitizer started
    later in the process would step aside for it (racecheck.schedules). Zeroers first (graph_ring's
    graphs go before their runtime)."""
    yield
    with contextlib.ExitStack() as closing:  # last made first; each closed whatever an earlier close raised
        for made in _OPENED:
            if hasattr(made, "close"):
                closing.callback(made.close)
        _OPENED.clear()


def opened(made):
    """``made`` (a runtime or a zeroer), closed when the running test ends."""
    _OPENED.append(made)
    return made


def zeroed(cache, block: int) -> bool:
    return all(bool((words.cpu() == 0).all()) for words in cache.block_words(block))


def setup(name: str, geometry_name: str = "tiny", schedule=None, backend: str = "sim", **options):
    rt = opened(SimRuntime(schedule=schedule) if backend == "sim" else make_runtime("cuda", mode="controlled"))
    cache = build_cache(geometry(geometry_name), device=rt.device)
    if name != "reference":
        options.setdefault("kernel", "torch")
    zeroer = opened(make_zeroer(name, cache, rt, **options))
    # Warm up as an engine does (zeroes the null block 0): on controlled cuda a kernel's first
    # launch loads its module, which would wait behind a closed gate.
    with getattr(rt, "ungated", contextlib.nullcontext)():
        zeroer.warmup()
    rt.synchronize()
    return rt, cache, zeroer


def run_calls(name: str, calls: list[list[int]], backend: str = "sim", **options):
    """Issue ``calls`` with the device stalled (lazy schedule), then let it catch up."""
    rt, cache, zeroer = setup(name, backend=backend, **options)
    for ids in calls:
        zeroer.zero_block_ids(ids)
    rt.synchronize()
    zeroed_blocks = {b for b in range(1, cache.spec.num_blocks) if zeroed(cache, b)}
    return zeroed_blocks, rt, cache


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_single_buffer_loses_the_first_call_when_the_stream_is_behind(kernel, backend):
    got, rt, _ = run_calls("single_buffer", [[1], [2]], backend=backend, kernel=kernel)
    assert got == {2}  # measured on an H200: {2}, 3 of 3 runs
    assert any(h.kind == "host-write-vs-pending-copy" for h in rt.hazards)


def test_single_buffer_with_a_shorter_later_list_corrupts_only_a_prefix(backend):
    got, _, _ = run_calls("single_buffer", [[1, 2, 3], [4]], backend=backend)
    assert got == {2, 3, 4}  # block 1 leaked, as measured


def test_a_ring_of_depth_two_holds_two_outstanding_calls(backend):
    got, rt, _ = run_calls("ring", [[1], [2]], backend=backend, max_concurrency=2)
    assert got == {1, 2}
    assert rt.hazards == []


def test_a_ring_of_depth_two_loses_a_block_with_three_outstanding_calls(backend):
    got, rt, _ = run_calls("ring", [[1], [2], [3]], backend=backend, max_concurrency=2)
    assert got == {2, 3}
    assert any(h.kind == "host-write-vs-pending-copy" for h in rt.hazards)


@pytest.mark.parametrize("name", sorted(RACE_FREE))
@pytest.mark.parametrize("calls", [[[1], [2]], [[1, 2, 3], [4]], [[1], [2], [3], [4], [5], [6]], [[5, 5, 1], [1]]])
def test_race_free_designs_zero_every_block_on_the_racy_interleavings(name, calls, backend):
    got, rt, cache = run_calls(name, calls, backend=backend)
    assert got == {b for ids in calls for b in ids}
    assert rt.hazards == []
    assert cache.guard_violations() == []


@pytest.mark.parametrize("name", STAGED)
@pytest.mark.parametrize("geometry_name", ["mla_indexer", "packed", "shared_layers"])
def test_every_design_zeroes_exactly_the_pages_with_the_triton_kernel(name, geometry_name, backend):
    rt, cache, zeroer = setup(name, geometry_name, backend=backend, kernel="triton")
    zeroer.zero_block_ids([1, 3])
    rt.synchronize()
    assert zeroed(cache, 1) and zeroed(cache, 3)
    assert not zeroed(cache, 2)
    assert cache.guard_violations() == []


@pytest.mark.parametrize("name", RACY)
def test_the_checker_flags_racy_designs_even_when_the_values_come_out_right(name):
    rt, cache, zeroer = setup(name, schedule=EagerSchedule())
    for b in (1, 2, 3):
        zeroer.zero_block_ids([b])
    rt.synchronize()
    assert all(zeroed(cache, b) for b in (1, 2, 3))  # the device kept up: values are right
    assert any(h.kind == "host-write-vs-pending-copy" for h in rt.hazards)


@pytest.mark.parametrize("name", sorted(RACE_FREE))
def test_the_checker_is_quiet_on_race_free_designs_on_the_same_schedule(name):
    rt, cache, zeroer = setup(name, schedule=EagerSchedule())
    for b in (1, 2, 3):
        zeroer.zero_block_ids([b])
    rt.synchronize()
    assert all(zeroed(cache, b) for b in (1, 2, 3))
    assert rt.hazards == []


def test_single_buffer_used_from_two_streams_is_flagged_on_its_device_ids():
    rt, cache, zeroer = setup("single_buffer")
    side = rt.new_stream("side")
    zeroer.zero_block_ids([1])
    rt.advance(rt.default_stream, 2)  # copy and kernel ran, but the host never looked
    with rt.use_stream(side):
        zeroer.zero_block_ids([2])
    kinds = sorted({h.kind for h in rt.hazards})
    assert kinds == ["host-write-vs-pending-copy", "unordered-device-access"]
    device = [h for h in rt.hazards if h.kind == "unordered-device-access"]
    assert device[0].resource.endswith("(single_buffer ids)")


def test_single_buffer_after_a_host_sync_is_ordered_on_any_stream():
    rt, cache, zeroer = setup("single_buffer")
    side = rt.new_stream("side")
    zeroer.zero_block_ids([1])
    rt.synchronize()
    with rt.use_stream(side):
        zeroer.zero_block_ids([2])
    rt.synchronize()
    assert rt.hazards == [] and zeroed(cache, 1) and zeroed(cache, 2)


@pytest.mark.parametrize("name", sorted(RACE_FREE))
def test_race_free_designs_stay_correct_when_the_current_stream_changes(name, backend):
    rt, cache, zeroer = setup(name, backend=backend)
    side = rt.new_stream("side")
    for i, b in enumerate((1, 2, 3, 4)):
        with rt.use_stream(side if i % 2 else rt.default_stream):
            zeroer.zero_block_ids([b])
        rt.advance(side, 1)
    rt.synchronize()
    assert all(zeroed(cache, b) for b in (1, 2, 3, 4))
    assert rt.hazards == []


def test_event_ring_grows_when_every_slot_is_busy_and_reuses_idle_slots():
    rt, cache, zeroer = setup("event_ring", slots=2)
    for b in range(1, 6):
        zeroer.zero_block_ids([b])
    assert zeroer.slot_count == 5 and zeroer.grown == 3
    rt.synchronize()
    zeroer.zero_block_ids([6])
    assert zeroer.slot_count == 5
    rt.synchronize()
    assert all(zeroed(cache, b) for b in range(1, 7))


def test_event_ring_waits_for_a_slot_at_its_size_limit():
    rt, cache, zeroer = setup("event_ring", slots=1, max_slots=2)
    for b in (1, 2, 3):
        zeroer.zero_block_ids([b])
    assert zeroer.slot_count == 2 and zeroer.waited == 1
    rt.synchronize()
    assert all(zeroed(cache, b) for b in (1, 2, 3))
    assert rt.hazards == []


@pytest.mark.parametrize("name", ALL)
def test_growing_past_the_id_capacity_keeps_every_block(name):
    options = {"slot_cap": 2} if name == "event_ring" else {"id_cap": 2} if name in RACY else {}
    rt, cache, zeroer = setup(name, **options)
    zeroer.zero_block_ids([1])
    rt.synchronize()
    zeroer.zero_block_ids([2, 3, 4, 5, 6])
    rt.synchronize()
    assert {b for b in range(1, 8) if zeroed(cache, b)} == {1, 2, 3, 4, 5, 6}
    assert rt.hazards == []


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_an_out_of_range_id_raises_before_anything_is_enqueued(name, backend):
    rt, cache, zeroer = setup(name, backend=backend)
    with pytest.raises(ValueError, match=r"^block id 8 is out of range for a cache of 8 blocks \(valid: 0\.\.7\)$"):
        zeroer.zero_block_ids([1, 8])
    with pytest.raises(ValueError, match=r"^block id -1 is out of range for a cache of 8 blocks \(valid: 0\.\.7\)$"):
        zeroer.zero_block_ids([-1])
    assert rt.pending(rt.default_stream) == 0
    rt.synchronize()
    assert not zeroed(cache, 1)


@pytest.mark.parametrize("name", ALL)
def test_non_integer_ids_raise_type_error(name):
    _, _, zeroer = setup(name)
    with pytest.raises(TypeError, match=r"^block id at position 1 is 2\.0 \(float\); block ids must be ints$"):
        zeroer.zero_block_ids([1, 2.0])
    with pytest.raises(TypeError, match=r"^block id at position 0 is True \(bool\); block ids must be ints$"):
        zeroer.zero_block_ids([True])
    with pytest.raises(TypeError, match=r"^block ids must be integers, got a tensor of dtype torch.float32$"):
        zeroer.zero_block_ids(torch.tensor([1.0]))
    with pytest.raises(TypeError, match=r"^block ids must be a list of ints, got int 3$"):
        zeroer.zero_block_ids(3)


@pytest.mark.parametrize("name", ALL)
def test_an_empty_list_or_none_launches_nothing_and_duplicates_are_fine(name, backend):
    rt, cache, zeroer = setup(name, backend=backend)
    zeroer.zero_block_ids([])
    zeroer.zero_block_ids(None)
    assert rt.pending(rt.default_stream) == 0
    zeroer.zero_block_ids(np.array([2, 2, 3]))
    zeroer.zero_block_ids(torch.tensor([3, 2]))
    rt.synchronize()
    assert zeroed(cache, 2) and zeroed(cache, 3) and not zeroed(cache, 1)


def test_the_caller_may_reuse_its_list_after_the_call():
    for name in ALL:
        rt, cache, zeroer = setup(name)
        ids = [1]
        zeroer.zero_block_ids(ids)
        ids[0] = 2
        rt.synchronize()
        assert zeroed(cache, 1) and not zeroed(cache, 2), name


def test_design_options_are_checked():
    rt = opened(SimRuntime())
    cache = build_cache(geometry("tiny"))
    with pytest.raises(ValueError, match=r"^max_concurrency=0 must be a positive int"):
        make_zeroer("ring", cache, rt, max_concurrency=0)
    with pytest.raises(ValueError, match=r"^unknown kernel 'cuda'; choose one of torch, triton$"):
        make_zeroer("per_call", cache, rt, kernel="cuda")
    with pytest.raises(ValueError, match=r"^max_slots=1 is below slots=2; raise max_slots$"):
        make_zeroer("event_ring", cache, rt, slots=2, max_slots=1)


# -- on a real GPU, free-running: real timing, shaped only by delays (docs/results.md) --
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["single_buffer", "per_call", "event_ring"])
def test_a_delayed_stream_shows_the_single_buffer_race_on_a_gpu_and_not_the_fixes(name):
    rt = opened(make_runtime("cuda", mode="free"))
    cache = build_cache(geometry("tiny"), device=rt.device)
    zeroer = make_zeroer(name, cache, rt)
    zeroer.zero_block_ids([0])  # compile outside the timed window
    rt.synchronize()
    rt.delay(rt.default_stream, 500)  # ~50 ms of torch.cuda._sleep before the calls run
    zeroer.zero_block_ids([1])
    zeroer.zero_block_ids([2])
    rt.synchronize()
    got = {b for b in (1, 2) if zeroed(cache, b)}
    if name == "single_buffer":
        assert got == {2}  # block 1 never zeroed: the #48085 race, on real streams
        assert any(h.kind == "host-write-vs-pending-copy" for h in rt.hazards)
    else:
        assert got == {1, 2} and rt.hazards == []
    rt.close()
