"""The simulator's caching device allocator hands freed memory out again as CUDA's does, and both
tools see the reuse (kvdevice/intercept/sim_memory.py).

CUDA's caching allocator (c10/cuda/CUDACachingAllocator.cpp) rounds a request up to a multiple of
512 bytes and gives it the smallest free block of its stream and pool that holds it, at once: a
tensor another stream still reads, dropped without ``record_stream``, has its block handed to the
next fitting allocation on its own stream, whatever that allocation's size. SGLang #34076 is that
race: ``output_tokens_buf[mix_running_indices]`` queued on the forward stream, the indices dropped,
their block rewritten by the scheduler stream's next tensor.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from fuzz.engine.episode import Episode, EpisodeConfig, run_ops
from sanitizer.bench.programs import REUSE
from sanitizer.sim.session import simulate
from kvdevice.intercept.session import InterceptSession
from kvdevice.intercept.sim_memory import SMALL_SIZE, SimDeviceMemory, round_size
from kvdevice.runtime import make_runtime

ROOT = Path(__file__).resolve().parent.parent


def memory_on_two_streams() -> tuple[Any, SimDeviceMemory, Any, Any]:
    rt = make_runtime("sim")
    session = InterceptSession(rt, "probe")
    return rt, session.memory, rt.default_stream, rt.new_stream("side")


# -- the allocator -----------------------------------------------------------------------------------
def test_a_request_is_rounded_up_to_a_multiple_of_512_bytes_as_cudas_round_size_does():
    assert [round_size(n) for n in (1, 64, 511, 512, 513, 160, SMALL_SIZE + 1)] == \
        [512, 512, 512, 512, 1024, 512, SMALL_SIZE + 512]


def test_a_freed_block_comes_back_at_once_for_the_next_fitting_request_on_its_stream_whatever_its_size():
    rt, memory, main, side = memory_on_two_streams()  # rt held: the memory holds it weakly
    indices = memory.alloc(64, main, "eight indices")
    block, address = indices.block, indices.block.start
    del indices
    assert memory.alloc(160, side, "another stream").block is not block  # never handed to another stream
    slots = memory.alloc(160, main, "twenty slots")
    assert slots.block is block and slots.block.start == address and slots.block.generation == 2


def test_a_request_takes_the_smallest_free_block_that_holds_it_and_of_equal_ones_the_oldest():
    rt, memory, main, _ = memory_on_two_streams()  # rt held: the memory holds it weakly
    big, older, newer, middle = (memory.alloc(n, main, str(n)) for n in (4096, 600, 700, 1500))
    blocks = [a.block for a in (big, older, newer, middle)]
    del big, older, newer, middle
    taken = [memory.alloc(n, main, str(n)) for n in (513, 1000, 1100, 100, 100)]
    # 600 and 700 both round to 1024 (the oldest first), 1100 to 1536; 100 gets the whole 4096-byte
    # block, where CUDA would split it; then nothing is free.
    assert [a.block for a in taken[:4]] == [blocks[1], blocks[2], blocks[3], blocks[0]]
    assert taken[4].block not in blocks


def test_the_small_and_the_large_pool_never_serve_each_other():
    rt, memory, main, _ = memory_on_two_streams()  # rt held: the memory holds it weakly
    large, small = memory.alloc(SMALL_SIZE * 2, main, "large"), memory.alloc(512, main, "small")
    large_block, small_block = large.block, small.block
    del large, small
    assert memory.alloc(512, main, "a small request").block is small_block
    assert memory.alloc(SMALL_SIZE, main, "a small request of 1 MiB").block is not large_block
    assert memory.alloc(SMALL_SIZE + 1, main, "a large request").block is large_block


def test_an_empty_tensor_takes_no_block_another_request_could_have_had():
    rt, memory, main, _ = memory_on_two_streams()  # rt held: the memory holds it weakly
    freed = memory.alloc(64, main, "a")
    block = freed.block
    del freed
    empty = memory.alloc(0, main, "empty")
    assert empty.block is not block
    assert memory.alloc(64, main, "b").block is block


def test_a_block_record_stream_tied_elsewhere_waits_and_the_best_fit_goes_on_to_the_next_block():
    rt, memory, main, side = memory_on_two_streams()
    recorded, plain = memory.alloc(64, main, "recorded"), memory.alloc(2048, main, "plain")
    recorded_block, plain_block = recorded.block, plain.block
    memory.record_stream(recorded, side)
    rt.launch(lambda: None, stream=side)  # side has queued work when the block is freed
    del recorded, plain
    assert memory.alloc(64, main, "waits").block is plain_block
    rt.synchronize()
    assert memory.alloc(64, main, "after side ran").block is recorded_block


def test_the_same_program_is_handed_the_same_blocks_every_run():
    def blocks_of_one_run() -> list[int]:
        rt, memory, main, side = memory_on_two_streams()  # rt held: the memory holds it weakly
        kept, ids = [], []
        for size in (64, 700, 3000, 64, 160, 1 << 21, 900, 64):
            allocation = memory.alloc(size, main if size != 3000 else side, str(size))
            ids.append(allocation.block.id)
            if size in (700, 1 << 21):
                kept.append(allocation)
            del allocation
        return ids

    assert blocks_of_one_run() == blocks_of_one_run()


# -- the sanitizer ------------------------------------------------------------------------------------
def _gather_then_drop(record: bool, extend_slots: int) -> Callable[[], None]:
    """SGLang #34076's shape: indices made on the current stream, gathered through on another, dropped."""

    def main() -> None:
        schedule = torch.cuda.current_stream()
        forward = torch.cuda.Stream()
        tokens = torch.arange(64, dtype=torch.int64, device="cuda") * 10 + 7
        seen = torch.zeros(8, dtype=torch.int64, device="cuda")
        indices = torch.tensor([1, 4, 7, 10, 13, 16, 19, 22]).to("cuda", non_blocking=True)
        forward.wait_stream(schedule)
        with torch.cuda.stream(forward):
            seen.copy_(tokens[indices])  # gather: queued
        if record:
            indices.record_stream(forward)
        del indices
        out_cache_loc = torch.empty(extend_slots, dtype=torch.int64, device="cuda")
        out_cache_loc.fill_(63)  # reuse: later
        torch.cuda.synchronize()

    return main


def _line(main: Callable[[], None], marker: str) -> int:
    lines, first = inspect.getsourcelines(main)
    return first + next(i for i, text in enumerate(lines) if marker in text)


@pytest.mark.parametrize("extend_slots", [8, 20], ids=["same size", "another size"])
def test_the_sanitizer_reports_indices_dropped_under_a_gather_on_another_stream_and_handed_to_the_next_tensor(
        extend_slots: int):
    # The queued gather keeps nothing of its index but its bytes, so the indices are freed at once;
    # 64 bytes freed and 160 asked are one 512-byte block, as on CUDA.
    main = _gather_then_drop(record=False, extend_slots=extend_slots)
    races, error, notes, unfollowed = simulate(main)
    assert error is None and not notes and not unfollowed
    [race] = races
    assert race.kind == REUSE
    assert (race.queued.site.line, race.later.site.line) == (_line(main, "# gather: queued"), _line(main, "# reuse: later"))
    assert race.queued.what == "index.Tensor" and race.later.what == "fill_.Scalar"


def test_with_record_stream_the_indices_block_waits_for_the_gather_and_nothing_is_reported():
    races, error, notes, _ = simulate(_gather_then_drop(record=True, extend_slots=20))
    assert error is None and races == [] and not notes


def test_the_pytest_plugin_on_the_simulator_fails_a_test_that_drops_indices_without_record_stream(tmp_path: Path):
    (tmp_path / "test_mixed_batch.py").write_text(textwrap.dedent("""
        import torch

        def gather_then_drop(record):
            forward = torch.cuda.Stream()
            tokens = torch.arange(64, dtype=torch.int64, device="cuda") * 10 + 7
            seen = torch.zeros(8, dtype=torch.int64, device="cuda")
            indices = torch.arange(8, device="cuda") * 3 + 1
            forward.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(forward):
                seen.copy_(tokens[indices])
            if record:
                indices.record_stream(forward)
            del indices
            torch.empty(20, dtype=torch.int64, device="cuda").fill_(63)
            torch.cuda.synchronize()
            return seen.tolist()

        def test_without_record_stream():
            gather_then_drop(False)

        def test_with_record_stream():
            assert gather_then_drop(True) == [17, 47, 77, 107, 137, 167, 197, 227]
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fuzz.plugin",
                           "-p", "sanitizer.pytest_plugin", "--rootdir", str(tmp_path), "-c", "/dev/null",
                           "--kvz-sanitize", "--kvz-sanitize-backend", "sim", str(tmp_path / "test_mixed_batch.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "1 failed, 1 passed" in out
    summary = out.split("kvz-sanitize (simulator)")[1].split("short test summary info")[0]
    assert summary.count("[reuse-without-record-stream]") == 1, summary
    assert "test_mixed_batch.py:11 (gather_then_drop)" in summary and "test_mixed_batch.py:15 (gather_then_drop)" in summary


# -- the fuzzer ---------------------------------------------------------------------------------------
def _two_calls(zeroer: str, first: int, second: int) -> list:
    """Two zero calls of ``first`` and ``second`` blocks, the device behind the host."""
    episode = Episode(EpisodeConfig(zeroer=f"tests/torch_zeroers.py:{zeroer}", geometry="tiny"))
    try:
        episode.apply({"op": "start", "in_flight": 1})
        episode.apply({"op": "allocate", "n": first, "stream": 0})
        episode.apply({"op": "allocate", "n": second, "stream": 0})
        return episode.new_hazard_findings()
    finally:
        episode.close()


def test_the_fuzzer_finds_a_side_stream_ids_block_reused_by_the_next_call_of_another_length():
    # 1 id (8 bytes) then 3 (24 bytes): one 512-byte block on CUDA, two size classes before.
    [finding] = _two_calls("device_ids_to_side_stream", 1, 3)
    assert "reused for" in finding.message and "_zero_kv_blocks_kernel" in finding.message, finding.message


def test_the_fuzzer_finds_nothing_when_the_ids_are_record_stream_d_on_the_callers_stream():
    assert _two_calls("device_ids_to_side_stream_recorded", 1, 3) == []


# Two loads of one slot: the second load's index, made on the caller's stream, takes the first's block.
TWO_LOADS = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "poll", "sync": 1},
             {"op": "load", "slot": 1}, {"op": "load", "slot": 1}]


def test_the_fuzzer_finds_an_offloaders_load_index_dropped_without_record_stream_and_handed_to_the_next_load():
    found = run_ops(EpisodeConfig(offloader="tests/reuse_offloaders.py:index_dropped_without_record_stream"), TWO_LOADS)
    assert found and found[0].kind == "hazard", found
    assert "reused for .to('cuda') of a host tensor" in found[0].message and "index_copy_" in found[0].message, \
        found[0].message


def test_the_fuzzer_finds_nothing_when_the_offloader_record_streams_its_load_index():
    assert run_ops(EpisodeConfig(offloader="tests/reuse_offloaders.py:index_record_stream"), TWO_LOADS) == []
