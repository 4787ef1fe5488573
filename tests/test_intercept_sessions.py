"""Several intercepted zeroers on one runtime (the x2 campaigns): nothing of one clashes with the other's.

Each zeroer runs in an InterceptSession of its own; their streams, pinned buffers and device blocks
live in one runtime, so their names and happens-before keys are the runtime's, numbered in the
order they are made (kvdevice/intercept/shared.py).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign
from fuzz.engine.episode import Episode, EpisodeConfig
from zeroer.cache.geometries import geometry
from zeroer.cache.layout import build_cache
from zeroer.protocol import check_factory
from zeroer.registry import LoadedZeroer
from kvdevice.runtime import make_runtime

SPEC = "tests/test_intercept_sessions.py:side_stream_zeroer"


# -- a race-free engine zeroer, written as vLLM writes one -----------------------------------------
@triton.jit
def _zero_kv_blocks_kernel(
    seg_addrs_ptr,  # uint64[n_segs]: byte address of block 0's page in each segment
    seg_strides_ptr,  # int64[n_segs]: int32 words from one block to the next
    seg_pages_ptr,  # int64[n_segs]: int32 words to zero per block
    block_ids_ptr,  # int64[n]: the blocks to zero
    BLOCK_SIZE: tl.constexpr,  # int32 words per program
):
    block_id = tl.load(block_ids_ptr + tl.program_id(0))
    seg = tl.program_id(1)
    base = tl.load(seg_addrs_ptr + seg).to(tl.pointer_type(tl.int32))
    cols = tl.program_id(2) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    row = base + block_id * tl.load(seg_strides_ptr + seg)
    tl.store(row + cols, tl.zeros([BLOCK_SIZE], dtype=tl.int32), mask=cols < tl.load(seg_pages_ptr + seg))


class SideStreamZeroer:
    """Zeroes on a side stream of its own, joined both ways to the caller's; ids staged in a fresh
    pinned tensor per call (vLLM #48399). Race-free."""

    def __init__(self, cache) -> None:
        self.device = cache.device
        table = cache.table
        addrs = table.addrs.tolist()  # read back on the host, as a constructor does
        pages = table.pages.tolist()
        self.seg_addrs = torch.tensor(addrs, dtype=torch.uint64, device=self.device)
        self.seg_strides = table.block_strides
        self.seg_pages = torch.tensor(pages, dtype=torch.int64, device=self.device)
        self.block_size = min(triton.next_power_of_2(max(pages)), 1024)
        self.chunks = triton.cdiv(max(pages), self.block_size)
        self.stream = torch.cuda.Stream()

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        caller = torch.cuda.current_stream()
        ids = torch.tensor(block_ids, dtype=torch.int64, pin_memory=True)
        self.stream.wait_stream(caller)  # the blocks' last users come first
        with torch.cuda.stream(self.stream):
            idx = ids.to(self.device, non_blocking=True)
            grid = (len(block_ids), len(self.seg_addrs), self.chunks)
            _zero_kv_blocks_kernel[grid](self.seg_addrs, self.seg_strides, self.seg_pages, idx,
                                         BLOCK_SIZE=self.block_size)
        caller.wait_stream(self.stream)  # the caller's next use of the blocks sees them zeroed


def side_stream_zeroer(cache, runtime):
    return SideStreamZeroer(cache)


# -- the tests ---------------------------------------------------------------------------------------
def _bound_twice(factory):
    rt = make_runtime("sim")
    loaded = LoadedZeroer("z.py:f", factory, check_factory(factory, "z.py:f"))
    caches = [build_cache(geometry("tiny"), device=rt.device) for _ in range(2)]
    return rt, [loaded.build(cache, rt) for cache in caches]


def test_two_zeroers_on_one_runtime_each_make_a_stream_in_their_constructor():
    class MakesStreams:
        def __init__(self, cache, runtime) -> None:
            self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]

        def zero_block_ids(self, block_ids: list[int]) -> None:
            pass

    rt, (first, second) = _bound_twice(MakesStreams)
    names = [[s.runtime_stream.name for s in z.zeroer.streams] for z in (first, second)]
    assert names == [["zeroer-1", "zeroer-2"], ["zeroer[1]-1", "zeroer[1]-2"]]


def test_two_zeroers_name_their_pinned_buffers_and_device_blocks_apart():
    class Stages:
        def __init__(self, cache, runtime) -> None:
            self.pinned = torch.zeros(4, dtype=torch.int64, pin_memory=True)
            self.ids = torch.zeros(4, dtype=torch.int64, device=cache.device)

        def zero_block_ids(self, block_ids: list[int]) -> None:
            pass

    rt, (first, second) = _bound_twice(Stages)
    a, b = first.session, second.session
    assert a.memory is b.memory  # one caching allocator per device
    [pa], [pb] = a.host.buffers(), b.host.buffers()
    assert (pa.key, pb.key) == (("pinned", 1), ("pinned", 2))
    assert pa.name == "pinned host buffer p1 of zeroer 0 (torch.zeros(pin_memory=True))"
    assert pb.name == "pinned host buffer p2 of zeroer 1 (torch.zeros(pin_memory=True))"
    assert first.zeroer.ids._alloc.block.key != second.zeroer.ids._alloc.block.key
    assert (a.name, b.name) == ("z.py:f[0]", "z.py:f[1]")


def test_a_lone_zeroer_keeps_the_names_of_one():
    rt = make_runtime("sim")

    class Stages:
        def __init__(self, cache, runtime) -> None:
            self.pinned = torch.zeros(4, dtype=torch.int64, pin_memory=True)

        def zero_block_ids(self, block_ids: list[int]) -> None:
            pass

    bound = LoadedZeroer("z.py:f", Stages, check_factory(Stages, "z.py:f")).build(
        build_cache(geometry("tiny"), device=rt.device), rt)
    [buffer] = bound.session.host.buffers()
    assert buffer.name == "pinned host buffer p1 of the zeroer (torch.zeros(pin_memory=True))"
    assert bound.session.name == "z.py:f"


def test_an_episode_of_two_engine_zeroers_labels_each_calls_with_its_zeroer():
    episode = Episode(EpisodeConfig(zeroer=SPEC, zeroers=2))
    episode.apply({"op": "start", "in_flight": 1})
    episode.apply({"op": "allocate", "n": 2, "stream": 0, "cache": 0})
    episode.apply({"op": "allocate", "n": 1, "stream": 1, "cache": 1})
    sessions = [group.zeroer.session for group in episode.groups]
    assert [s.call for s in sessions] == ["the harness", "the harness"]
    assert [s.name for s in sessions] == [f"{SPEC}[0]", f"{SPEC}[1]"]
    assert not episode.new_hazard_findings()
    episode.close()


def test_a_race_free_engine_zeroer_twice_per_runtime_is_judged_clean(tmp_path):
    result = run_campaign(Campaign(EpisodeConfig(zeroer=SPEC, zeroers=2), 0, "clean"), PROFILES["quick"], tmp_path)
    assert not result.found and not result.harness_error, result.violation or result.harness_error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")
def test_a_race_free_engine_zeroer_twice_per_runtime_is_judged_clean_on_cuda_controlled(tmp_path):
    config = EpisodeConfig(zeroer=SPEC, zeroers=2, backend="cuda", mode="controlled")
    result = run_campaign(Campaign(config, 0, "clean"), PROFILES["quick"], tmp_path)
    assert not result.found and not result.harness_error, result.violation or result.harness_error
