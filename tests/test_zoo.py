"""The zoo of broken zeroers: each one misbehaves on its own short program, and the race-free
designs do not on the same program.

Every zoo entry carries a hand-written ``scenario`` (op records, run through the fuzzer's
executor :class:`fuzz.engine.episode.Episode` on the lazy simulator), and the findings below are what a
person reading the entry's docstring would expect: the value oracle sees the bug, not only the
happens-before checker."""

from __future__ import annotations

import re

import pytest
import torch

from fuzz.engine.campaigns import default_campaigns
from fuzz.engine.episode import Episode, EpisodeConfig
from zeroer.cache.geometries import geometry, geometry_names
from zeroer.kernel import zero_blocks_reference
from zeroer.cache.layout import build_cache
from zeroer.protocol import Capabilities
from zeroer.registry import BUILTINS, RACE_FREE, ZOO, default_geometry, load_zeroer
from kvdevice.runtime import SimRuntime
from zeroer.zoo import ENTRIES, Int32Offset, KernelModelZeroer
from zeroer.zoo.arithmetic import calibrated_offset_bits

SIM_ZOO = sorted(name for name in ZOO if load_zeroer(name).capabilities.runs_on("sim"))

# What each entry's scenario must show in the values (hazards aside), written from its docstring.
VALUE_FINDINGS = {
    "zoo.captured_stream": {"clobbered"},  # the load on stream 1 wiped by the zero on stream 0
    "zoo.deferred_zero": {"clobbered", "non-zero after zeroing"},  # the write wiped; block 2 never zeroed
    "zoo.int32_offset": {"clobbered", "non-zero after zeroing"},  # 4, 5 wrap onto 0, 1: block 1's data wiped
    "zoo.last_chunk_skipped": {"non-zero after zeroing"},
    "zoo.packed_overrun": {"stray write"},  # padding and the next block's page
    "zoo.ratio_ignored": {"non-zero after zeroing"},
    "zoo.ring_overrun": {"non-zero after zeroing"},
    "zoo.shared_device_ids": {"non-zero after zeroing"},
    "zoo.shared_k_only": {"non-zero after zeroing"},
    "zoo.side_stream": {"clobbered"},
    "zoo.single_buffer": {"non-zero after zeroing"},
    "zoo.stale_table": {"non-zero after zeroing"},
    "zoo.unprotected_staging": {"non-zero after zeroing"},
}


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


def run_scenario(zeroer: str, geometry_name: str, ops) -> list:
    kernel = "torch" if zeroer in ("per_call", "event_ring") else None
    episode = Episode(EpisodeConfig(zeroer=zeroer, geometry=geometry_name, kernel=kernel))
    for op in ops:
        episode.apply(dict(op))
    return episode.finish()


# -- the entries are registered and documented --------------------------------------------------


def test_the_zoo_has_at_least_twelve_entries_on_the_simulator_and_each_has_a_finding_to_show():
    assert len(SIM_ZOO) >= 12
    assert sorted(VALUE_FINDINGS) == SIM_ZOO


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_entry_is_registered_under_its_name_with_a_geometry_and_an_upstream_analog(name):
    entry = ENTRIES[name]
    assert name.startswith("zoo.") and entry.name == name and BUILTINS[name].factory is entry
    assert name not in RACE_FREE
    assert default_geometry(name) == entry.geometry and geometry(entry.geometry).name == entry.geometry
    assert set(entry.capabilities.backends) <= {"sim", "cuda"} and entry.capabilities.backends
    assert entry.upstream and entry.scenario and entry.scenario[0]["op"] == "start"
    assert re.search(r"#\d{4,5}|hazard \d+|fact \d+", entry.__doc__ or entry.__mro__[1].__doc__), "no upstream analog named"


def test_default_geometry_is_none_for_designs_outside_the_zoo():
    assert default_geometry("per_call") is None and default_geometry("pkg.mod:factory") is None


# -- each entry misbehaves on its scenario; the race-free designs do not --------------------------


@pytest.mark.parametrize("name", SIM_ZOO)
def test_each_zoo_entry_misbehaves_on_its_scenario(name):
    entry = ENTRIES[name]
    findings = run_scenario(name, entry.geometry, entry.scenario)
    values = {f.kind for f in findings if f.kind != "hazard"}
    assert values == VALUE_FINDINGS[name], [str(f) for f in findings]
    assert not any(f.caller_fault for f in findings)


@pytest.mark.parametrize("design", sorted(RACE_FREE))
@pytest.mark.parametrize("name", SIM_ZOO)
def test_the_race_free_designs_are_clean_on_every_zoo_scenario(name, design):
    entry = ENTRIES[name]
    assert run_scenario(design, entry.geometry, entry.scenario) == []


# -- the kernel model -------------------------------------------------------------------------


@pytest.mark.parametrize("name", geometry_names())
def test_the_kernel_model_without_a_bug_zeroes_exactly_what_the_reference_does(name):
    rt = SimRuntime()
    modelled, reference = build_cache(geometry(name)), build_cache(geometry(name))
    ids = [0, 1, geometry(name).num_blocks - 1]
    KernelModelZeroer(modelled, rt).zero_block_ids(ids)
    rt.synchronize()
    zero_blocks_reference(reference, ids)
    assert all(torch.equal(a, b) for a, b in zip(modelled.raws, reference.raws))
    assert modelled.guard_violations() == []


def test_the_scaled_int32_model_wraps_the_upper_half_of_tiny_onto_the_lower_half():
    cache, rt = build_cache(geometry("tiny")), SimRuntime()
    assert calibrated_offset_bits(cache) == 9  # 2**9 bytes = 4 pages of 128 bytes
    Int32Offset(cache, rt).zero_block_ids([5])
    rt.synchronize()
    assert all(bool((w == 0).all()) for w in cache.block_words(1))  # 5 * 128 mod 512 = block 1
    assert not any(bool((w == 0).any()) for w in cache.block_words(5))


def test_the_unscaled_int32_geometry_puts_blocks_8_and_9_past_4_gib_and_is_not_a_cpu_preset():
    spec = geometry("int32_wrap")  # not built: 5 GiB
    page_bytes = spec.tensors[0].page_words * 4
    assert page_bytes == 2**29 and len(spec.tensors) == 1 and not spec.tensors[0].kv_outer
    assert [b for b in range(spec.num_blocks) if b * page_bytes >= 2**32] == [8, 9]
    assert "int32_wrap" not in geometry_names()
    assert ENTRIES["zoo.int32_offset_4gib"].capabilities.backends == ("cuda",)


def test_bad_zoo_options_are_value_errors_that_name_the_value():
    cache, rt = build_cache(geometry("tiny")), SimRuntime()
    with pytest.raises(ValueError, match=exactly("offset_bits=1 must be an int between 2 and 64 (32 models int32)")):
        Int32Offset(cache, rt, offset_bits=1)
    with pytest.raises(ValueError, match=exactly(
            "zoo.ratio_ignored models the zero kernel in torch to plant its bug; kernel='triton' is not available, "
            "use kernel='torch'")):
        BUILTINS["zoo.ratio_ignored"].factory(cache, rt, kernel="triton")


# -- the reallocate op and campaigns --------------------------------------------------------------


def test_reallocating_moves_every_page_and_keeps_its_contents():
    episode = Episode(EpisodeConfig(zeroer="reference"))
    episode.apply({"op": "start"})
    episode.apply({"op": "allocate", "n": 1, "stream": 0})
    episode.apply({"op": "write", "block": 1, "stream": 0})
    cache = episode.cache
    episode.rt.synchronize()
    before_ptrs, before = [r.data_ptr() for r in cache.raws], [r.clone() for r in cache.raws]
    episode.apply({"op": "reallocate"})
    assert episode.cache is cache and [r.data_ptr() for r in cache.raws] != before_ptrs
    assert int(cache.table.addrs[0]) == cache.segments[0].addr != before_ptrs[0]
    assert all(torch.equal(a, b) for a, b in zip(cache.raws, before))
    assert episode.finish() == []


class _Outside:
    """An outside zeroer that captured the table (as vLLM's does) and says nothing about it."""

    capabilities = Capabilities(api="runtime")

    def __init__(self, cache, runtime) -> None:
        self.cache, self.rt = cache, runtime

    def zero_block_ids(self, block_ids) -> None:
        cache, ids = self.cache, list(block_ids or [])
        self.rt.launch(lambda: zero_blocks_reference(cache, ids), blocks_written=ids)


class _OutsideThatFollows(_Outside):
    capabilities = Capabilities(api="runtime", follows_reallocation=True)


def test_an_outside_zeroer_is_reallocated_under_only_if_it_says_it_follows():
    spec = f"{__file__}:_Outside"
    episode = Episode(EpisodeConfig(zeroer=spec))
    assert not episode.loaded.capabilities.follows_reallocation
    message = f"reallocate: zeroer {spec!r} does not declare Capabilities(follows_reallocation=True)"
    with pytest.raises(ValueError, match=exactly(message)):
        episode.apply({"op": "reallocate"})
    follows = Episode(EpisodeConfig(zeroer=f"{__file__}:_OutsideThatFollows"))
    follows.apply({"op": "start", "in_flight": 1})
    follows.apply({"op": "reallocate"})
    assert not follows.finish()
    assert all(load_zeroer(name).capabilities.follows_reallocation for name in ZOO + RACE_FREE)


def test_pytest_fuzz_runs_a_zoo_entry_on_its_geometry_and_one_self_check_per_entry_by_default():
    assert [c.id for c, _ in default_campaigns(["sim"], "zoo.ratio_ignored")] == [
        "zoo.ratio_ignored-ratio2-sim-shard0", "zoo.ratio_ignored-ratio2-sim-shard1", "zoo.ratio_ignored-ratio2-sim-x2-shard0"]
    zoo = [c for c, _ in default_campaigns(["sim"]) if c.config.zeroer in ZOO]
    assert sorted(c.config.zeroer for c in zoo) == SIM_ZOO
    assert all(c.expect == "finds" and c.config.geometry == default_geometry(c.config.zeroer) for c in zoo)
    assert not [c for c, _ in default_campaigns(["cuda"]) if c.config.zeroer in ZOO]
