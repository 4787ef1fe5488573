"""Copies made through the CUDA driver and runtime (cuda-bindings, ctypes), followed by both tools.

vLLM's SimpleCPUOffload resolves ``cuMemcpyBatchAsync`` with ``cuGetProcAddress`` and calls the
pointer through ctypes with numpy address arrays; ``examples/simple_cpu_offload_dma.py`` is that
shape, racy (the store not waiting for the compute stream, vLLM #46278) and fixed. On the
simulator both tools must see those copies as ops: the race found, the fix clean, an address they
do not know named, never passed over.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.minimize import run_ops
from sanitizer.sim.session import simulate
from kvdevice.intercept.errors import InterceptError
from test_sim_conformance import in_a_zeroer

pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed (CI installs it)")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "simple_cpu_offload_dma.py"
STORE = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}]
N = 64


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(EXAMPLE.read_text().splitlines(), 1) if marker in text)


def _example():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import simple_cpu_offload_dma
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return simple_cpu_offload_dma


# -- the fuzzer ---------------------------------------------------------------------------------------
def test_the_fuzzer_finds_the_dma_store_that_does_not_wait_for_the_compute_stream():
    found = run_ops(EpisodeConfig(offloader=f"{EXAMPLE}:dma_store_without_compute_event"), STORE)
    assert found, "the store's cuMemcpyBatchAsync was not seen reading the block"
    assert "cuMemcpyBatchAsync" in str(found[0]) and "reads it with no event path" in str(found[0])


def test_the_fuzzer_finds_nothing_in_the_dma_store_that_waits():
    assert run_ops(EpisodeConfig(offloader=f"{EXAMPLE}:dma_store_after_compute_event"), STORE) == []


@pytest.mark.parametrize("factory, status", [("dma_store_without_compute_event", 1),
                                             ("dma_store_after_compute_event", 0)])
def test_pytest_fuzz_on_one_geometry_gives_each_factory_its_verdict(factory, status, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "fuzz", "-q", "-p", "no:cacheprovider", "--offloader", f"{EXAMPLE}:{factory}",
         "--backend", "sim", "--geometry", "tiny", "--repro-dir", str(tmp_path), "--fuzz-shrink-seconds", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == status, done.stdout[-3000:] + done.stderr[-2000:]


# -- the sanitizer ----------------------------------------------------------------------------------------
def test_the_sanitizer_reports_the_racy_engine_loop_at_both_lines():
    example = _example()
    races, error, notes, unfollowed = simulate(lambda: example.engine_loop(racy=True), "loop")
    assert error is None and unfollowed == [] and notes == []
    assert races and {race.kind for race in races} == {"unordered-device-access"}
    lines = {(race.queued.site.line, race.later.site.line) for race in races}
    assert lines == {(_line("race[dma]: queued"), _line("race[dma]: later"))}


def test_the_sanitizer_finds_nothing_in_the_fixed_engine_loop_and_its_values_are_right():
    example = _example()
    box = {}
    races, error, notes, unfollowed = simulate(lambda: box.setdefault("stored", example.engine_loop(racy=False)))
    assert (races, error, notes, unfollowed) == ([], None, [], [])
    assert box["stored"] == [1.0, 2.0, 3.0, 4.0]


def _beside_a_read(write: bool, call: str):
    """The default stream reads ``kv`` while a side stream's raw copy reads it (into pinned memory)
    or writes it (from pinned memory), with no event between them."""
    from cuda.bindings import driver, runtime

    kv = torch.ones(N, device="cuda")
    host = torch.zeros(N, pin_memory=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    kv.sum()  # a read on the default stream
    dst, src = (kv.data_ptr(), host.data_ptr()) if write else (host.data_ptr(), kv.data_ptr())
    n = N * 4
    if call == "driver":
        err, = driver.cuMemcpyAsync(dst, src, n, side.cuda_stream)
    elif call == "runtime":
        err, = runtime.cudaMemcpyAsync(dst, src, n, runtime.cudaMemcpyKind.cudaMemcpyDefault, side.cuda_stream)
    else:
        err = ctypes.CDLL("libcudart.so.12").cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src),
                                                             ctypes.c_size_t(n), 4, ctypes.c_void_p(side.cuda_stream))
    assert int(err) == 0
    side.synchronize()


@pytest.mark.parametrize("call", ["driver", "runtime", "ctypes"])
@pytest.mark.parametrize("write", [False, True], ids=["reading-copy", "writing-copy"])
def test_a_reading_copy_beside_a_read_is_no_race_and_a_writing_one_is(write, call):
    races, error, notes, unfollowed = simulate(lambda: _beside_a_read(write, call))
    assert error is None and unfollowed == []
    assert [race.kind for race in races] == (["unordered-device-access"] if write else [])


def test_the_fuzzers_interception_reports_a_writing_copy_beside_a_read_and_not_a_reading_one():
    for write, expected in ((False, []), (True, ["unordered-device-access"])):
        _, rt = in_a_zeroer(lambda cache: _beside_a_read(write, "driver"))
        assert [h.kind for h in rt.hazards] == expected


# -- what cannot be followed ----------------------------------------------------------------------------
def _wild_copy():
    from cuda.bindings import driver

    kv = torch.ones(N, device="cuda")
    pageable = torch.zeros(N)
    err, = driver.cuMemcpyAsync(pageable.data_ptr(), kv.data_ptr(), N * 4, 0)
    return err


def test_a_copy_to_memory_the_fuzzer_does_not_know_is_a_harness_error_naming_the_call():
    with pytest.raises(InterceptError, match=r"^cuda\.bindings\.driver\.cuMemcpyAsync: destination 0x[0-9a-f]+ "
                                             r"\(256 bytes\): it is .*not inside one allocation the harness knows"):
        in_a_zeroer(lambda cache: _wild_copy())


def test_a_copy_to_memory_the_sanitizer_does_not_know_is_one_line_and_the_program_gets_cudas_error():
    box = {}
    races, error, notes, unfollowed = simulate(lambda: box.setdefault("err", _wild_copy()))
    assert races == [] and error is None and len(unfollowed) == 1
    assert unfollowed[0].startswith("kvz-sanitize could not follow a call at ")
    assert "cuda.bindings.driver.cuMemcpyAsync: destination" in unfollowed[0]
    assert int(box["err"]) != 0


def test_a_driver_entry_point_with_no_model_is_refused_by_name():
    from cuda.bindings import driver

    with pytest.raises(InterceptError, match=r"^cuda\.bindings\.driver\.cuGetProcAddress\(b'cuLaunchKernel'\): "):
        in_a_zeroer(lambda cache: driver.cuGetProcAddress(b"cuLaunchKernel", 12080, 0))
