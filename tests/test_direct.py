"""The direct designs (zeroer/direct): graph_ring (ours) and torch_per_call (vLLM #48399).

On the CPU: their bad-input messages, where they are registered to run, and the id check they
share with every design. On a GPU: they zero exactly the requested blocks, in every path the
graph ring has (padding, growth, waiting, a reallocated cache, the unstaged fallback).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fuzz.campaigns import default_campaigns
from zeroer.direct import GraphRingZeroer, TorchPerCallZeroer
from zeroer.geometries import geometry
from zeroer.impls import validate_block_ids
from zeroer.kernel import zero_blocks_reference
from zeroer.layout import build_cache
from zeroer.registry import DIRECT, REGISTRY, backends_of, cuda_modes_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- CPU -------------------------------------------------------------------------------------------

def test_the_direct_designs_name_the_device_they_need():
    cache = build_cache(geometry("tiny"))
    with pytest.raises(ValueError, match=r"^graph_ring captures CUDA graphs, but the cache lives on cpu; build it "
                                         r"with build_cache\(spec, device='cuda'\), or use event_ring \(the same "
                                         r"protocol\) on the simulator$"):
        GraphRingZeroer(cache)
    with pytest.raises(ValueError, match=r"^torch_per_call runs on CUDA, but the cache lives on cpu; build it "
                                         r"with build_cache\(spec, device='cuda'\), or use per_call \(the same "
                                         r"design\) on the simulator$"):
        TorchPerCallZeroer(cache, None)


@pytest.mark.parametrize("options, message", [
    ({"slots": 0}, "slots=0 must be a positive int"),
    ({"max_slots": True}, "max_slots=True must be a positive int"),
    ({"slots": 4, "max_slots": 2}, "max_slots=2 is below slots=4; raise max_slots"),
    ({"max_graph_ids": 1000}, "max_graph_ids=1000 must be a power of two (graphs are captured for 1, 2, 4, "
                              "... ids), e.g. 1024"),
])
def test_graph_ring_options_are_checked_before_anything_is_built(options, message):
    with pytest.raises(ValueError) as error:
        GraphRingZeroer(build_cache(geometry("tiny")), **options)
    assert str(error.value) == message


def test_the_direct_designs_are_fuzzed_on_cuda_in_the_free_mode_only():
    assert DIRECT == ("graph_ring", "torch_per_call")
    for name in DIRECT:
        assert backends_of(REGISTRY[name]) == ("cuda",) and cuda_modes_of(REGISTRY[name]) == ("free",)
    cuda = {(c.config.zeroer, c.config.mode, c.expect) for c in default_campaigns(["cuda"])}
    assert {("graph_ring", "free", "clean"), ("torch_per_call", "free", "clean")} <= cuda
    assert not {(z, m) for z, m, _ in cuda if z in DIRECT and m != "free"}
    assert not [c for c in default_campaigns(["sim"]) if c.config.zeroer in DIRECT]
    assert backends_of(REGISTRY["event_ring"]) == ("sim", "cuda")
    assert cuda_modes_of(REGISTRY["event_ring"]) == ("controlled", "free")


def test_the_fast_id_check_returns_what_the_full_one_returns():
    rng = random.Random(7)
    for n in (1, 2, 16, 256):
        ids = [rng.randrange(64) for _ in range(n)]
        got = validate_block_ids(ids, 64)
        assert got == ids and got is not ids  # a copy: the caller may reuse its list
    # Inputs the fast path hands to the full check, which converts or names them.
    assert validate_block_ids([np.int64(3), 4], 64) == [3, 4]
    assert validate_block_ids((1, 2), 64) == [1, 2]
    with pytest.raises(TypeError, match=r"^block id at position 1 is True \(bool\); block ids must be ints$"):
        validate_block_ids([1, True], 64)
    with pytest.raises(ValueError, match=r"^block id 64 is out of range for a cache of 64 blocks \(valid: 0..63\)$"):
        validate_block_ids([1, 64], 64)
    with pytest.raises(ValueError, match=r"^block id -1 is out of range"):
        validate_block_ids([-1, 5], 64)


# -- GPU -------------------------------------------------------------------------------------------

def _cuda_pair(name: str = "kv_outer_bf16"):
    by_design, by_reference = (build_cache(geometry(name), device="cuda") for _ in range(2))
    everything = list(range(by_design.spec.num_blocks))
    by_design.poison(everything)
    by_reference.poison(everything)
    return by_design, by_reference


def _assert_same(by_design, by_reference) -> None:
    torch.cuda.synchronize()
    for t, (a, b) in enumerate(zip(by_design.raws, by_reference.raws)):
        assert torch.equal(a, b), f"tensor {t} differs from the reference"
    assert by_design.guard_violations() == []


@needs_cuda
@pytest.mark.parametrize("name", DIRECT)
def test_a_direct_design_zeroes_exactly_the_requested_blocks(name):
    by_design, by_reference = _cuda_pair()
    z = REGISTRY[name](by_design, None)
    last = by_design.spec.num_blocks - 1
    calls = [[1], [2, 3, 4], [5, 5, 6], [last], list(range(7, 7 + 9)), [], None]  # 3 and 9 ids: padded graphs
    for ids in calls:
        z.zero_block_ids(ids)
        zero_blocks_reference(by_reference, ids or [])
    _assert_same(by_design, by_reference)


@needs_cuda
def test_graph_ring_grows_behind_a_busy_gpu_and_never_rewrites_a_queued_slot():
    by_design, by_reference = _cuda_pair()
    z = GraphRingZeroer(by_design, slots=2, max_slots=64)
    torch.cuda._sleep(400_000_000)  # the device is far behind the host for every call below
    for b in range(1, 13):
        z.zero_block_ids([b])  # with a reused slot, an earlier call would zero a later id
        zero_blocks_reference(by_reference, [b])
    assert z.slot_count == 12 and z.grown == 10 and z.waited == 0
    _assert_same(by_design, by_reference)


@needs_cuda
def test_graph_ring_waits_for_the_oldest_slot_at_max_slots():
    by_design, by_reference = _cuda_pair()
    z = GraphRingZeroer(by_design, slots=1, max_slots=2)
    torch.cuda._sleep(200_000_000)
    for b in (1, 2, 3, 4):
        z.zero_block_ids([b])
        zero_blocks_reference(by_reference, [b])
    assert z.slot_count == 2 and z.waited >= 1
    _assert_same(by_design, by_reference)


@needs_cuda
def test_graph_ring_stages_a_call_past_its_largest_graph_in_a_fresh_pinned_tensor():
    by_design, by_reference = _cuda_pair()
    z = GraphRingZeroer(by_design, max_graph_ids=4)
    z.zero_block_ids([1, 2, 3, 4, 5])
    zero_blocks_reference(by_reference, [1, 2, 3, 4, 5])
    assert z.unstaged_calls == 1
    _assert_same(by_design, by_reference)


@needs_cuda
def test_graph_ring_recaptures_its_graphs_when_the_cache_moves():
    by_design, by_reference = _cuda_pair()
    z = GraphRingZeroer(by_design, slots=1)
    z.zero_block_ids([1])
    zero_blocks_reference(by_reference, [1])
    torch.cuda.synchronize()
    # What the fuzzer's reallocate op does: fresh buffers, swapped into the same KVCache object.
    fresh = build_cache(by_design.spec, device="cuda")
    for new, old in zip(fresh.raws, by_design.raws):
        new.copy_(old)
    stale = by_design.raws
    vars(by_design).update(vars(fresh))
    before = [t.clone() for t in stale]
    z.zero_block_ids([2])
    zero_blocks_reference(by_reference, [2])
    _assert_same(by_design, by_reference)
    assert all(torch.equal(a, b) for a, b in zip(stale, before)), "a graph wrote the old cache"
    assert z.captures == 2


@needs_cuda
def test_closing_a_graph_ring_waits_for_its_queued_work():
    by_design, _ = _cuda_pair()
    z = GraphRingZeroer(by_design)
    torch.cuda._sleep(200_000_000)
    z.zero_block_ids([1])
    z.close()
    assert all(bool(p.eq(0).all()) for p in (by_design.pages(s)[1] for s in range(len(by_design.segments))))


@needs_cuda
@pytest.mark.parametrize("bad, message", [
    ([1, 2, 16], r"^block id 16 is out of range for a cache of 16 blocks \(valid: 0..15\)$"),
    ([1] * 70 + [-3], r"^block id -3 is out of range"),  # more than SMALL ids: NumPy's bounds
    ([1, 10**30], r"^block id 1000000000000000000000000000000 is out of range"),  # past int64
    ([1, True], r"^block id at position 1 is True \(bool\); block ids must be ints$"),
])
def test_graph_ring_rejects_bad_ids_before_queueing_anything(bad, message):
    by_design, by_reference = _cuda_pair()
    assert by_design.spec.num_blocks == 16
    z = GraphRingZeroer(by_design)
    with pytest.raises((ValueError, TypeError), match=message):
        z.zero_block_ids(bad)
    z.zero_block_ids([5])  # the ring still works, and the bad call zeroed nothing
    zero_blocks_reference(by_reference, [5])
    _assert_same(by_design, by_reference)
