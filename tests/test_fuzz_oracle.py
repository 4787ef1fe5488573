"""The oracle and the episode executor on hand-written op lists, without Hypothesis.

Each test is one short program of op records, the form the fuzzer's rules and the replayer
produce, run through :class:`fuzz.engine.episode.Episode`; the findings are then read as a person would
read them. The two deliberately buggy zeroers below are plugged in through the file-spec path
(``path/to/file.py:factory``) that an outside zeroer uses."""

from __future__ import annotations

import re

import pytest
import torch

from fuzz.engine.episode import CALLER_FAULTS, OPS, CachePool, Episode, EpisodeConfig
from fuzz.engine.oracle import STAMP_BASE, Shadow, all_rows_match, describe_word, stamp
from zeroer.cache.geometries import geometry
from zeroer.kernel import zero_blocks_reference
from zeroer.cache.layout import GUARD_WORD, POISON_WORD, KVCache, build_cache
from zeroer.protocol import Capabilities
from kvdevice.runtime import Runtime


def exactly(message: str) -> str:
    """An anchored pattern matching ``message`` and nothing more."""
    return "^" + re.escape(message) + "$"


def run(config: EpisodeConfig, ops: list[dict]) -> list:
    episode = Episode(config)
    for op in ops:
        episode.apply(op)
    return episode.finish()


# Block 1 and then block 2 are zeroed on stream 0 while the lazy simulator runs nothing, then
# block 1 is read on stream 1 (which waits for the zero, as promise (b) asks).
TWO_ZEROS_THEN_A_READ = [
    {"op": "start", "in_flight": 1},
    {"op": "allocate", "n": 1, "stream": 0},
    {"op": "allocate", "n": 1, "stream": 0},
    {"op": "read", "block": 1, "stream": 1},
]


# -- test-local buggy zeroers (built through the runtime's launch API, like the reference) ------


class _ShiftedZeroer:
    """Zeroes what it is asked to, and also the block ``shift`` away: an off-by-one."""

    def __init__(self, cache: KVCache, runtime: Runtime, shift: int) -> None:
        self.cache, self.rt, self.shift = cache, runtime, shift

    def zero_block_ids(self, block_ids: list[int]) -> None:
        ids = list(block_ids)
        extra = [b + self.shift for b in ids if 0 <= b + self.shift < self.cache.spec.num_blocks]
        cache = self.cache
        # Declares only the blocks it was asked for, as a buggy zeroer believes it writes.
        self.rt.launch(lambda: zero_blocks_reference(cache, ids + extra), name="zero_shifted", blocks_written=ids)


def make_zeroer_that_also_zeroes_the_block_before(cache: KVCache, runtime: Runtime) -> _ShiftedZeroer:
    return _ShiftedZeroer(cache, runtime, shift=-1)


def make_zeroer_that_also_zeroes_the_block_after(cache: KVCache, runtime: Runtime) -> _ShiftedZeroer:
    return _ShiftedZeroer(cache, runtime, shift=+1)


class _GuardSmashingZeroer:
    """Zeroes correctly, then also clears the first guard word of the first tensor."""

    def __init__(self, cache: KVCache, runtime: Runtime) -> None:
        self.cache, self.rt = cache, runtime

    def zero_block_ids(self, block_ids: list[int]) -> None:
        ids, cache = list(block_ids), self.cache

        def run() -> None:
            zero_blocks_reference(cache, ids)
            cache.raws[0][0] = 0

        self.rt.launch(run, name="zero_smash", blocks_written=ids)


def make_guard_smashing_zeroer(cache: KVCache, runtime: Runtime) -> _GuardSmashingZeroer:
    return _GuardSmashingZeroer(cache, runtime)


for _factory in (make_zeroer_that_also_zeroes_the_block_before, make_zeroer_that_also_zeroes_the_block_after,
                 make_guard_smashing_zeroer):
    _factory.capabilities = Capabilities(api="runtime")  # written against the runtime: not intercepted


def local(factory: str) -> str:
    return f"{__file__}:{factory}"


# -- a racy design is caught; a race-free one is not -------------------------------------------


def test_single_buffer_leaves_the_first_block_poisoned_when_the_stream_is_behind():
    findings = run(EpisodeConfig(zeroer="single_buffer", kernel="torch"), TWO_ZEROS_THEN_A_READ)
    values = [f for f in findings if f.kind == "non-zero after zeroing"]
    assert values, findings
    read = values[0]
    assert read.block == 1
    assert not read.caller_fault
    assert read.message.startswith(
        "non-zero after zeroing: block 1, segment 0, word 0 (32 of 32 words differ) at step 4 read_block on stream 1: "
        "expected 0 (zeroed), observed 0xffffffff (NaN poison: stale bytes never zeroed). History: "
    )
    assert "zero_block_ids([1]) on stream 0" in read.message


def test_single_buffer_also_shows_the_host_write_hazard_behind_the_lost_block():
    findings = run(EpisodeConfig(zeroer="single_buffer", kernel="torch"), TWO_ZEROS_THEN_A_READ)
    hazards = [f for f in findings if f.kind == "hazard"]
    assert len(hazards) == 1
    assert hazards[0].block is None
    assert re.match(r"^hazard at step \d+: host write to pinned host buffer \d+ by single_buffer\.zero_block_ids#3\(\[2\]\)", hazards[0].message)
    assert hazards[0].message.endswith("(the vLLM #48085 hazard)")


def test_the_end_of_episode_check_sees_the_lost_block_without_any_read():
    findings = run(EpisodeConfig(zeroer="single_buffer", kernel="torch"), TWO_ZEROS_THEN_A_READ[:3])
    at_end = [f for f in findings if f.kind == "non-zero after zeroing"]
    assert [f.block for f in at_end] == [1]
    assert "at the end of the episode" in at_end[0].message


def test_per_call_on_the_same_program_has_no_finding():
    assert run(EpisodeConfig(zeroer="per_call", kernel="torch"), TWO_ZEROS_THEN_A_READ) == []


def test_the_reference_zeroer_on_the_same_program_has_no_finding():
    assert run(EpisodeConfig(zeroer="reference"), TWO_ZEROS_THEN_A_READ) == []


def test_allocate_returns_block_ids_in_free_queue_order():
    episode = Episode(EpisodeConfig(zeroer="reference"))
    episode.apply({"op": "start"})
    assert episode.apply({"op": "allocate", "n": 2}) == [1, 2]
    assert episode.apply({"op": "allocate", "n": 1}) == [3]
    episode.apply({"op": "free", "block": 1})
    assert list(episode.free) == [4, 5, 6, 7, 1]  # freed blocks queue at the back, as in vLLM
    assert episode.finish() == []


def test_the_trace_records_every_op_in_order():
    episode = Episode(EpisodeConfig(zeroer="reference"))
    for op in TWO_ZEROS_THEN_A_READ:
        episode.apply(op)
    assert episode.trace == TWO_ZEROS_THEN_A_READ
    episode.finish()


# -- caller faults -------------------------------------------------------------------------------


def test_a_write_that_skips_the_zero_wait_is_the_callers_fault():
    config = EpisodeConfig(zeroer="reference", caller_fault="no-zero-wait")
    findings = run(config, [
        {"op": "start"},
        {"op": "allocate", "n": 1, "stream": 0},
        {"op": "write", "block": 1, "stream": 1},
    ])
    assert findings
    assert all(f.caller_fault for f in findings)
    assert all(str(f).startswith("[caller fault] ") for f in findings)
    assert any(f.kind == "hazard" and "block 1:" in f.message and "no event path" in f.message for f in findings)


def test_a_correct_caller_with_the_same_ops_is_clean():
    findings = run(EpisodeConfig(zeroer="reference"), [
        {"op": "start"},
        {"op": "allocate", "n": 1, "stream": 0},
        {"op": "write", "block": 1, "stream": 1},
    ])
    assert findings == []


def test_a_reuse_that_skips_the_free_fence_is_the_callers_fault():
    config = EpisodeConfig(zeroer="reference", caller_fault="no-free-fence")
    findings = run(config, [
        {"op": "start"},
        {"op": "allocate", "n": 7, "stream": 0},
        {"op": "write", "block": 1, "stream": 1},
        {"op": "free", "block": 1},
        {"op": "allocate", "n": 1, "stream": 2},
    ])
    assert findings
    assert all(f.caller_fault for f in findings)


# -- clobbers and stray writes -------------------------------------------------------------------


def test_zeroing_a_live_neighbour_is_reported_as_clobbered_naming_the_owner_stamp():
    config = EpisodeConfig(zeroer=local("make_zeroer_that_also_zeroes_the_block_before"))
    findings = run(config, [
        {"op": "start"},
        {"op": "allocate", "n": 1, "stream": 0},  # block 1, owner 1
        {"op": "write", "block": 1, "stream": 0},  # stamp of owner 1, write 1
        {"op": "allocate", "n": 1, "stream": 0},  # block 2; the bug zeroes block 1 as well
        {"op": "read", "block": 1, "stream": 0},
    ])
    clobbered = [f for f in findings if f.kind == "clobbered"]
    assert [f.block for f in clobbered] == [1, 1]  # the read, then the end-of-episode check
    assert clobbered[0].message.startswith(
        "clobbered: block 1, segment 0, word 0 (32 of 32 words differ) at step 5 read_block on stream 0: "
        f"expected {stamp(1, 1):#010x} (stamp of owner 1, write 1), observed 0 (zeroed). History: "
    )
    assert not any(f.caller_fault for f in findings)


def test_zeroing_a_free_neighbour_is_reported_as_a_stray_write():
    config = EpisodeConfig(zeroer=local("make_zeroer_that_also_zeroes_the_block_after"))
    findings = run(config, [{"op": "start"}, {"op": "allocate", "n": 1, "stream": 0}])  # zeroes 1 and 2
    strays = [f for f in findings if f.kind == "stray write"]
    assert [f.block for f in strays] == [2]
    assert strays[0].message.startswith(
        "stray write: block 2, segment 0, word 0 (32 of 32 words differ) at the end of the episode: "
        "expected 0xffffffff (NaN poison: stale bytes never zeroed), observed 0 (zeroed)."
    )


def test_a_changed_guard_word_is_reported_as_a_stray_write():
    findings = run(EpisodeConfig(zeroer=local("make_guard_smashing_zeroer")), [{"op": "start"}, {"op": "allocate", "n": 1}])
    assert len(findings) == 1
    assert findings[0].kind == "stray write"
    assert findings[0].block is None
    assert re.match(
        exactly(
            "stray write: tensor 0 (layers model.layers.0.self_attn.attn): word 0 (guard before the K part) "
            f"is 0x00000000, expected {GUARD_WORD:#010x}"
        ),
        findings[0].message,
    )


# -- bad ops and configs -------------------------------------------------------------------------


def test_an_unknown_op_is_a_value_error_listing_the_ops():
    episode = Episode(EpisodeConfig(zeroer="reference"))
    with pytest.raises(ValueError, match=exactly(f"unknown op 'jump'; ops: {', '.join(OPS)}")):
        episode.apply({"op": "jump"})


def test_an_op_with_a_wrong_or_missing_field_names_the_field_and_lists_the_fields():
    episode = Episode(EpisodeConfig(zeroer="reference"))
    with pytest.raises(ValueError, match=exactly("op 'allocate' has unknown field 'm'; its fields are: n, stream, cache, ids_as, then")):
        episode.apply({"op": "allocate", "m": 1})
    with pytest.raises(ValueError, match=exactly("op 'read' is missing field 'block'; its fields are: block, stream, cache")):
        episode.apply({"op": "read"})
    assert episode.trace == []  # a rejected op is not recorded


def test_an_op_record_without_a_name_is_a_value_error():
    episode = Episode(EpisodeConfig(zeroer="reference"))
    with pytest.raises(ValueError, match=r"^unknown op None; ops: advance, advance_own, allocate, "):
        episode.apply({"n": 1})


@pytest.mark.parametrize(
    ("op", "message"),
    [
        ({"op": "allocate", "n": 0}, "allocate n=0: 7 blocks are free in cache 0"),
        ({"op": "allocate", "n": 8}, "allocate n=8: 7 blocks are free in cache 0"),
        ({"op": "allocate", "n": 1, "cache": 1}, "cache 1 does not exist; this episode has 1 (valid: 0..0)"),
        ({"op": "allocate", "n": 1, "ids_as": "set"}, "op 'allocate' field 'ids_as' is 'set'; choose one of list, tuple, array, tensor"),
        ({"op": "allocate", "n": "1"}, "op 'allocate' field 'n' is '1'; it must be an integer"),
        ({"op": "allocate", "n": 1, "stream": 3}, "stream 3 does not exist; this episode has 3 (valid: 0..2)"),
        ({"op": "advance", "stream": -1}, "stream -1 does not exist; this episode has 3 (valid: 0..2)"),
        ({"op": "write", "block": 4}, "write block 4: it is free, not live"),
        ({"op": "read", "block": 5, "stream": 1}, "read block 5: it is free, not live"),
        ({"op": "free", "block": 0}, "free block 0: it is null, not live"),
    ],
)
def test_bad_op_arguments_are_value_errors_that_name_the_value(op, message):
    episode = Episode(EpisodeConfig(zeroer="reference"))
    episode.apply({"op": "start"})
    with pytest.raises(ValueError, match=exactly(message)):
        episode.apply(op)


@pytest.mark.parametrize("in_flight", [0, 9])
def test_start_rejects_an_in_flight_depth_outside_one_to_eight(in_flight):
    episode = Episode(EpisodeConfig(zeroer="reference"))
    with pytest.raises(ValueError, match=exactly(f"in_flight={in_flight} must be between 1 and 8 steps")):
        episode.apply({"op": "start", "in_flight": in_flight})


def test_an_unknown_caller_fault_is_a_value_error_listing_the_faults():
    with pytest.raises(ValueError, match=exactly(f"caller_fault='late'; choose None or one of {', '.join(CALLER_FAULTS)}")):
        EpisodeConfig(caller_fault="late")


@pytest.mark.parametrize("streams", [0, 9])
def test_a_stream_count_outside_one_to_eight_is_a_value_error(streams):
    with pytest.raises(ValueError, match=exactly(f"streams={streams} must be between 1 and 8")):
        EpisodeConfig(streams=streams)


# -- stamps and words ----------------------------------------------------------------------------


def test_a_stamp_encodes_owner_and_write():
    assert stamp(1, 1) == STAMP_BASE + 0x101
    assert stamp(3, 2) == 0x10000302
    assert stamp(1, 256) == stamp(1, 0)  # the write count wraps at 256


def test_stamps_never_collide_with_zero_poison_or_guard():
    words = {stamp(owner, generation) for owner in (0, 1, 2, (1 << 20) - 1, 1 << 20) for generation in (0, 1, 255)}
    assert not words & {0, POISON_WORD, POISON_WORD & 0xFFFFFFFF, GUARD_WORD}
    assert all(0 < w < 2**31 for w in words)  # fits an int32 word as a positive value


@pytest.mark.parametrize(
    ("word", "text"),
    [
        (0, "0 (zeroed)"),
        (POISON_WORD, "0xffffffff (NaN poison: stale bytes never zeroed)"),
        (GUARD_WORD, "0x5a5a5a5a (guard sentinel)"),
        (stamp(3, 2), "0x10000302 (stamp of owner 3, write 2)"),
        (7, "0x00000007 (unknown)"),
        (-2, "0xfffffffe (unknown)"),
    ],
)
def test_describe_word_reads_a_word_as_a_person_would(word, text):
    assert describe_word(word) == text


def test_describe_word_accepts_a_tensor_element():
    assert describe_word(torch.tensor(-1, dtype=torch.int32)) == "0xffffffff (NaN poison: stale bytes never zeroed)"


# -- the shadow directly ---------------------------------------------------------------------------


def test_the_shadow_follows_a_block_from_free_to_live_to_written_to_free():
    shadow = Shadow(num_blocks=4)
    assert [b.state for b in shadow.blocks] == ["null", "free", "free", "free"]
    shadow.zeroed(2, owner=5, note="zeroed")
    assert (shadow.blocks[2].state, shadow.blocks[2].expect) == ("live", 0)
    assert shadow.written(2, "written") == stamp(5, 1)
    assert shadow.written(2, "written again") == stamp(5, 2)
    shadow.freed(2, "freed")
    assert (shadow.blocks[2].state, shadow.blocks[2].expect) == ("free", POISON_WORD)
    assert shadow.blocks[2].history == ["zeroed", "written", "written again", "freed"]


def test_the_shadow_accepts_matching_words_and_names_the_first_segment_that_differs():
    shadow = Shadow(num_blocks=4)
    good, bad = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    assert shadow.verify(1, 0, [good, good], "read#1", []) is None
    bad[3:5] = POISON_WORD
    finding = shadow.verify(1, 0, [good, bad], "read#1", [])
    assert finding.kind == "non-zero after zeroing"
    assert finding.message == (
        "non-zero after zeroing: block 1, segment 1, word 3 (2 of 8 words differ) at read#1: expected 0 (zeroed), "
        "observed 0xffffffff (NaN poison: stale bytes never zeroed). History: no recorded history"
    )


def test_the_shadow_keeps_only_the_last_four_history_notes_in_a_message():
    shadow = Shadow(num_blocks=2)
    words = torch.full((4,), 9, dtype=torch.int32)
    finding = shadow.verify(1, 0, [words], "here", [f"n{i}" for i in range(6)])
    assert finding.message.endswith("History: n2; n3; n4; n5")


def test_all_rows_match_says_whether_every_row_holds_its_expected_word():
    pages = torch.tensor([[0, 0], [-1, -1], [7, 7]], dtype=torch.int32)
    assert all_rows_match([pages, pages[:, :1]], [0, -1, 7])
    assert not all_rows_match([pages], [0, -1, 8])
    pages[1, 1] = 0
    assert not all_rows_match([pages], [0, -1, 7])


def test_the_end_check_names_only_the_block_that_differs_among_clean_ones():
    # The compare of every block at once fails; the block-by-block pass then names just that one.
    config = EpisodeConfig(zeroer=local("make_zeroer_that_also_zeroes_the_block_after"))
    findings = run(config, [{"op": "start"}, {"op": "allocate", "n": 2, "stream": 0}])
    assert [(f.kind, f.block) for f in findings] == [("stray write", 3)]


# -- the fuzzer's cache pool ----------------------------------------------------------------------


def pristine_words(config: EpisodeConfig) -> list[torch.Tensor]:
    return [raw.clone() for raw in build_cache(geometry(config.geometry)).raws]


def test_a_recycled_cache_comes_back_with_the_words_of_a_freshly_built_one():
    config, pool = EpisodeConfig(zeroer="reference"), CachePool()
    episode = Episode(config, caches=pool)
    cache = episode.cache
    ops = [
        {"op": "start"},
        {"op": "allocate", "n": 2, "stream": 0},
        {"op": "write", "block": 1, "stream": 1},
        {"op": "free", "block": 2},
    ]
    for op in ops:
        episode.apply(op)
    cache.raws[0][0] = 0  # even a smashed guard word is restored
    episode.finish()
    again = Episode(config, caches=pool)
    assert again.cache is cache
    assert all(torch.equal(a, b) for a, b in zip(cache.raws, pristine_words(config)))
    for op in ops:
        again.apply(op)
    assert again.finish() == []


def test_the_pool_hands_a_cache_out_again_only_after_its_episode_closed():
    config, pool = EpisodeConfig(zeroer="reference"), CachePool()
    first, second = Episode(config, caches=pool), Episode(config, caches=pool)
    assert first.cache is not second.cache
    first.close()
    assert Episode(config, caches=pool).cache is first.cache


def test_a_reallocated_episode_keeps_its_old_buffers_until_it_closes_then_recycles_both():
    config, pool = EpisodeConfig(zeroer="reference"), CachePool()
    episode = Episode(config, caches=pool)
    episode.apply({"op": "start"})
    old_raws = list(episode.cache.raws)
    episode.apply({"op": "reallocate"})
    other = Episode(config, caches=pool)  # must not get the old buffers: a stale zeroer may write there
    assert all(raw is not old for raw in other.cache.raws for old in old_raws)
    other.close()
    assert episode.finish() == []
    recycled = [Episode(config, caches=pool).cache for _ in range(3)]
    assert {id(raw) for c in recycled for raw in c.raws} >= {id(raw) for raw in old_raws}


def test_a_pooled_episode_reports_exactly_what_a_fresh_one_does():
    config = EpisodeConfig(zeroer="single_buffer", kernel="torch")
    pool = CachePool()
    for _ in range(2):  # the second run gets the first one's cache back
        episode = Episode(config, caches=pool)
        for op in TWO_ZEROS_THEN_A_READ:
            episode.apply(op)
        assert [f.message for f in episode.finish()] == [f.message for f in run(config, TWO_ZEROS_THEN_A_READ)]
