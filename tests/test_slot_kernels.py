"""A Triton kernel handed the whole KV cache with the slots to write (vLLM's Triton
``reshape_and_cache``: ``slot = tl.load(slot_mapping + token)``, then a store at that slot) touches
those slots, not the cache. On a GPU the observer traces it on the slot mapping's values as the
program staged them and declares the bytes its stores and loads reach in each argument, so an
offload copy of other blocks on another stream, unordered with it, is no race; a read of a slot it
writes is one. Without the trace the whole cache was written, and that copy was reported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from fake_cuda import FakeCuda, RealCuda, kinds, observing

ROOT = Path(__file__).resolve().parents[1]
SLOTS, WORDS = 8, 16  # slots in the cache, float32 words per slot
WRITTEN = [1, 2]  # the slots the kernel writes


@triton.jit
def reshape_and_cache(key_ptr, cache_ptr, slot_mapping_ptr, key_stride, slot_stride, WORDS: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padded token: nothing to cache
        return
    offs = tl.arange(0, WORDS)
    tl.store(cache_ptr + slot * slot_stride + offs, tl.load(key_ptr + token * key_stride + offs))


@pytest.fixture(params=["fake", "cuda"])
def cuda(request):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a GPU")
        return RealCuda()
    return FakeCuda()


def _launch(cuda, obs, key, cache, slots) -> None:
    """The launch as the program makes it: on a GPU the observer's JITFunction.run wrapper sees it; on
    the stand-in the test calls what that wrapper calls, then the "GPU" runs it (the interpreter's own
    copies are no op of the program's)."""
    grid = (key.shape[0],)
    args = (key, cache, slots, key.stride(0), cache.stride(0))
    if isinstance(cuda, RealCuda):
        reshape_and_cache[grid](*args, WORDS=WORDS)
        return
    from kvdevice.triton_cpu import launch_on_cpu
    from sanitizer.gpu.launches import on_launch

    with obs.lock:
        on_launch(obs, reshape_and_cache, args, {"WORDS": WORDS}, grid)
    with obs.own_work():
        launch_on_cpu(reshape_and_cache, grid, *args, WORDS=WORDS)


def _program(cuda, beside: str, slot: int, *, staged: bool = True) -> tuple[list, list[str]]:
    """The kernel writes ``WRITTEN`` on the current stream; a side stream, not waiting for it, then
    reads (``beside="read"``) or writes (``"write"``) ``slot``, or copies it out to pinned memory."""
    with observing(cuda) as obs:
        cache = cuda.device(torch.zeros((SLOTS, WORDS), dtype=torch.float32))
        key = cuda.device(torch.ones((len(WRITTEN), WORDS), dtype=torch.float32))
        slots = cuda.device(torch.zeros(len(WRITTEN), dtype=torch.int64))
        if staged:
            slots.copy_(torch.tensor(WRITTEN))  # staged from the host: its values are known
        else:
            # Made on the device by an op the host cannot evaluate: unknown (on a GPU the zeros copied
            # from the host were known, and the kernel was traced on them: an H100 run of this test)
            slots.random_(1, 3)
        side = cuda.new_stream()
        cuda.wait(cuda.record(), side)  # the side stream starts after the cache and the slots are made
        _launch(cuda, obs, key, cache, slots)
        with cuda.stream(side):
            if beside == "read":
                cache[slot].sum()
            elif beside == "write":
                cache[slot].fill_(3.0)
            else:
                out = cuda.pinned(torch.empty(WORDS, dtype=torch.float32))
                out.copy_(cache[slot], non_blocking=True)
        cuda.synchronize()
        races = obs.stop()
        return races, [u.message() for u in obs.take_unfollowed()]


@pytest.mark.parametrize("beside", ["read", "write", "copy out"])
def test_another_stream_touching_slots_the_kernel_does_not_write_is_no_race(cuda, beside):
    races, unfollowed = _program(cuda, beside, slot=5)
    assert (kinds(races), unfollowed) == ([], [])


@pytest.mark.parametrize("beside", ["read", "write", "copy out"])
def test_another_stream_touching_a_slot_the_kernel_writes_is_a_race(cuda, beside):
    races, unfollowed = _program(cuda, beside, slot=WRITTEN[1])
    assert (kinds(races), unfollowed) == (["unordered-device-access"], [])
    assert "Triton kernel reshape_and_cache" in str(races[0])


def test_a_slot_mapping_whose_values_are_not_known_is_one_line_and_the_cache_counts_whole(cuda):
    races, unfollowed = _program(cuda, "read", slot=5, staged=False)
    assert kinds(races) == ["unordered-device-access"]  # the whole cache: the conservative reading
    assert len(unfollowed) == 1 and "slot_mapping_ptr" in unfollowed[0]


def test_the_trace_declares_the_bytes_each_argument_reaches_at_its_real_address():
    from kvdevice.intercept.kernel_accesses import trace_through_tables

    cache = torch.zeros((SLOTS, WORDS), dtype=torch.float32)[2:]  # a view: its allocation starts two slots earlier
    key = torch.ones((3, WORDS), dtype=torch.float32)
    arguments = {"key_ptr": key, "cache_ptr": cache, "slot_mapping_ptr": torch.zeros(3, dtype=torch.int64),
                 "key_stride": WORDS, "slot_stride": WORDS, "WORDS": WORDS}
    traced = trace_through_tables(reshape_and_cache.fn, (3,), arguments, {"slot_mapping_ptr": [4, -1, 0]})
    row, base = WORDS * 4, cache.data_ptr()
    assert traced.arguments["cache_ptr"].runs(write=True) == [(base, base + row), (base + 4 * row, base + 5 * row)]
    assert traced.arguments["cache_ptr"].runs(write=False) == []
    k = key.data_ptr()  # the padded token's key is never loaded
    assert traced.arguments["key_ptr"].runs(write=False) == [(k, k + row), (k + 2 * row, k + 3 * row)]
    assert traced.through.runs(write=True) == traced.through.runs(write=False) == []


@triton.jit
def count_into_slots(key_ptr, cache_ptr, slot_mapping_ptr, counts_ptr, WORDS: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    offs = tl.arange(0, WORDS)
    tl.atomic_add(cache_ptr + slot * WORDS + offs, tl.load(key_ptr + token * WORDS + offs))
    tl.atomic_add(counts_ptr + slot, 1)


def test_a_kernel_that_runs_an_atomic_counts_its_arguments_whole():
    """An atomic reaches memory past the interpreter's loads and stores, and what it returns may steer
    the kernel: no argument's bytes are taken from such a trace (the launch declares them whole)."""
    from kvdevice.intercept.kernel_accesses import trace_through_tables

    arguments = {"key_ptr": torch.ones((2, WORDS)), "cache_ptr": torch.zeros((SLOTS, WORDS)),
                 "slot_mapping_ptr": torch.zeros(2, dtype=torch.int64), "counts_ptr": torch.zeros(SLOTS, dtype=torch.int32),
                 "WORDS": WORDS}
    traced = trace_through_tables(count_into_slots.fn, (2,), arguments, {"slot_mapping_ptr": WRITTEN})
    assert traced.arguments == {}


@triton.jit
def _slot_of(slot_mapping_ptr, token):
    return tl.load(slot_mapping_ptr + token)


@triton.jit
def slot_from_a_helper(key_ptr, cache_ptr, block_table_ptr, slot_mapping_ptr, WORDS: tl.constexpr):
    """The slot comes from a @triton.jit helper's load, which the reading of this source does not see."""
    token = tl.program_id(0)
    block = tl.load(block_table_ptr + token)
    offs = tl.arange(0, WORDS)
    tl.store(cache_ptr + (block + _slot_of(slot_mapping_ptr, token)) * WORDS + offs,
             tl.load(key_ptr + token * WORDS + offs))


@triton.jit
def valid_by_position(key_ptr, cache_ptr, slot_mapping_ptr, valid_ptr, WORDS: tl.constexpr):
    """The store's mask, loaded from an argument, is given by position."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    offs = tl.arange(0, WORDS)
    ok = tl.load(valid_ptr + token + offs * 0) != 0
    tl.store(cache_ptr + slot * WORDS + offs, tl.load(key_ptr + token * WORDS + offs), ok)


def test_the_reading_of_the_source_knows_when_it_saw_all_the_kernel_does():
    from racecheck.triton_stores import kernel_flow

    assert kernel_flow(reshape_and_cache.fn).closed and kernel_flow(count_into_slots.fn).closed
    assert not kernel_flow(slot_from_a_helper.fn).closed  # a helper's loads are not read
    assert kernel_flow(valid_by_position.fn).tables == {"slot_mapping_ptr", "valid_ptr"}  # a mask by position


@pytest.mark.parametrize(("kernel", "tables", "row"), [
    (slot_from_a_helper, ([1, 2], [3, 3]), 4),  # writes rows 1 + 3 and 2 + 3
    (valid_by_position, ([1, 2], [1, 1]), 1),  # writes rows 1 and 2, both valid
])
def test_a_kernel_whose_other_arguments_may_steer_it_counts_them_whole_and_its_race_is_found(kernel, tables, row):
    """Traced with the helper's slot or the mask unread (the reading of the source missed them), the
    kernel would seem to write other rows, and the race on the row it writes would be lost."""
    from kvdevice.triton_cpu import launch_on_cpu
    from sanitizer.gpu.launches import on_launch

    cuda = FakeCuda()
    with observing(cuda) as obs:
        cache = cuda.device(torch.zeros((SLOTS, WORDS), dtype=torch.float32))
        key = cuda.device(torch.ones((2, WORDS), dtype=torch.float32))
        staged = []
        for values in tables:
            table = cuda.device(torch.zeros(2, dtype=torch.int64))
            table.copy_(torch.tensor(values))
            staged.append(table)
        side = cuda.new_stream()
        cuda.wait(cuda.record(), side)
        args = (key, cache, *staged)
        with obs.lock:
            on_launch(obs, kernel, args, {"WORDS": WORDS}, (2,))
        with obs.own_work():
            launch_on_cpu(kernel, (2,), *args, WORDS=WORDS)
        with cuda.stream(side):
            cache[row].sum()
        races = obs.stop()
    assert (kinds(races), obs.take_unfollowed()) == (["unordered-device-access"], [])
    assert cache[row].eq(1).all()  # the row the side stream read is one the kernel wrote


def test_a_kernel_the_interpreter_cannot_trace_is_one_line_never_an_error_in_the_program(monkeypatch):
    import sanitizer.gpu.launches as launches

    def refuse(*args, **kwargs):
        try:
            raise NotImplementedError("Block pointers have been removed in favor of the tensor descriptor API")
        except NotImplementedError as cause:
            raise RuntimeError("InterpreterError") from cause

    monkeypatch.setattr(launches, "trace_tables", refuse)
    races, unfollowed = _program(FakeCuda(), "read", slot=5)
    assert kinds(races) == ["unordered-device-access"]  # the cache counted whole
    assert len(unfollowed) == 1
    assert ("Triton kernel reshape_and_cache (Triton's interpreter could not trace it on its tables' values: "
            "NotImplementedError: Block pointers have been removed") in unfollowed[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads ru_maxrss in KiB, as Linux gives it")
def test_tracing_a_kernel_handed_a_large_cache_costs_no_host_memory_of_its_size():
    """The stand-in of an argument that is no table is reserved address space, never touched: a
    KV cache of many GiB is traced without as much host memory (it was a full zeroed copy)."""
    script = f"""
import resource, sys, torch
sys.path.insert(0, {str(ROOT / 'tests')!r})
from test_slot_kernels import reshape_and_cache, WORDS
from kvdevice.intercept.kernel_accesses import trace_through_tables
cache = torch.empty((1 << 30) // WORDS, WORDS, dtype=torch.float32)  # 4 GiB, never touched
key = torch.ones((2, WORDS), dtype=torch.float32)
slots = torch.zeros(2, dtype=torch.int64)
arguments = dict(key_ptr=key, cache_ptr=cache, slot_mapping_ptr=slots, key_stride=WORDS, slot_stride=WORDS, WORDS=WORDS)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
traced = trace_through_tables(reshape_and_cache.fn, (2,), arguments, dict(slot_mapping_ptr=[7, 1 << 20]))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(len(traced.arguments["cache_ptr"].runs(write=True)), grown // 1024)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    runs, grown_mib = map(int, done.stdout.split())
    assert runs == 2
    assert grown_mib < 512, f"the trace grew the process by {grown_mib} MiB"


@pytest.mark.parametrize(("slot", "kind"), [(5, None), (WRITTEN[1], "unordered-device-access")])
def test_on_the_simulator_the_same_program_gets_the_same_verdict(slot, kind):
    from sanitizer.sim.session import simulate

    def main() -> None:
        cache = torch.zeros((SLOTS, WORDS), dtype=torch.float32, device="cuda")
        key = torch.ones((len(WRITTEN), WORDS), dtype=torch.float32, device="cuda")
        slots = torch.tensor(WRITTEN).to("cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        reshape_and_cache[(len(WRITTEN),)](key, cache, slots, key.stride(0), cache.stride(0), WORDS=WORDS)
        with torch.cuda.stream(side):
            cache[slot].sum()
        torch.cuda.synchronize()

    races, error, _, _ = simulate(main)
    assert error is None
    assert kinds(races) == ([kind] if kind else [])
