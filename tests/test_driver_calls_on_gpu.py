"""Driver calls on a GPU, in both tools, tested on the CPU with stand-ins (issue 53, item 3).

vLLM's SimpleCPUOffload resolves ``cuMemcpyBatchAsync`` with ``cuGetProcAddress`` and calls the
pointer through ctypes from a copy thread. On an H100 the GPU sanitizer said ``no race`` on both
racy versions (the copy was seen by no hook), and the fuzzer's free-running mode got
``CUDA_ERROR_NOT_INITIALIZED`` from the copy thread (its pointer was the harness's, with no tool
following and no context on that thread). Here the driver is :mod:`fake_driver` (a context per
thread; the entry points refuse without one) and the GPU is :class:`fake_cuda.FakeCuda`.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading

import numpy as np
import pytest
import torch

from fake_cuda import FakeCuda
from fake_driver import PRIMARY, FakeContexts, real_batch, real_memcpy
from kvdevice.intercept import driver_copies
from kvdevice.intercept.driver_context import use_api
from kvdevice.intercept.driver_copies import BATCH_TYPE, SIZE_MAX, MemcpyAttributes
from racecheck.pinned import PinnedMemory

N = 64


class Batch:
    """``cuMemcpyBatchAsync``'s arguments for (dst, src, bytes) copies, as vLLM builds them (numpy)."""

    def __init__(self, runs: list[tuple[int, int, int]], stream: int, order: int = 1) -> None:
        self.dsts = np.array([d for d, _, _ in runs], dtype=np.uint64)
        self.srcs = np.array([s for _, s, _ in runs], dtype=np.uint64)
        self.sizes = np.array([n for _, _, n in runs], dtype=np.uint64)
        self.attrs = MemcpyAttributes(srcAccessOrder=order)
        self.idx = ctypes.c_size_t(0)
        self.fail = ctypes.c_size_t(12345)
        self.stream = stream

    def call(self, fn) -> int:
        return fn(self.dsts.ctypes.data, self.srcs.ctypes.data, self.sizes.ctypes.data, len(self.sizes),
                  ctypes.addressof(self.attrs), ctypes.byref(self.idx), 1, ctypes.byref(self.fail), self.stream)


def on_a_helper_thread(fn):
    """``fn()`` on a fresh thread (no CUDA context current there), its result."""
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", fn()))
    thread.start()
    thread.join()
    return box["result"]


@pytest.fixture
def contexts(monkeypatch):
    """The fake driver: its contexts, and the real entry points the followed pointers issue."""
    fake = FakeContexts()
    monkeypatch.setitem(driver_copies._REAL, "cuMemcpyBatchAsync", real_batch(fake))
    monkeypatch.setitem(driver_copies._REAL, "cuMemcpyAsync", real_memcpy(fake))
    with use_api(fake):
        yield fake


# -- the fuzzer -----------------------------------------------------------------------------------------
def test_a_followed_pointer_called_while_no_tool_follows_it_is_the_real_call_in_the_programs_context(contexts):
    """The fuzzer's free-running mode after a controlled campaign resolved the engine's pointer:
    the copy thread's call is the program's own, and moves its bytes (issue 53's false finding)."""
    src, dst = torch.arange(N, dtype=torch.float32), torch.zeros(N)
    batch = Batch([(dst.data_ptr(), src.data_ptr(), N * 4)], stream=0x77)
    fn = BATCH_TYPE(driver_copies.address_of("cuMemcpyBatchAsync"))
    assert driver_copies.active() is None
    assert on_a_helper_thread(lambda: batch.call(fn)) == 0
    assert torch.equal(dst, src) and contexts.calls == [("cuMemcpyBatchAsync", PRIMARY)]


def _regions(*tensors: torch.Tensor) -> PinnedMemory:
    regions = PinnedMemory()
    for tensor in tensors:
        regions.add_tensor(tensor)
    return regions


class _CudaSession:
    """What :class:`DriverCopies` asks of a fuzzer session on CUDA: pinned regions, the default
    stream, and an enqueue that keeps each op's issue for the test to run where it likes (the
    controlled mode issues it from its gate's executor, another thread)."""

    backend = "cuda"
    memory = None
    block_map = None

    def __init__(self, *pinned: torch.Tensor) -> None:
        self.issued: list = []
        self.rt = type("Rt", (), {"default_stream": "main", "use_stream": lambda self, s: contextlib.nullcontext()})()
        self.host = type("Host", (), {"regions": _regions(*pinned), "note_read": lambda *a: None,
                                      "note_device_write": lambda *a: None, "used_by_copy": lambda *a: None})()

    def boundary(self, call: str) -> None:
        pass

    def cannot_follow(self, error: BaseException) -> bool:
        return False

    def enqueue(self, run, **kwargs):
        self.issued.append(run)
        return None


def test_the_fuzzers_real_call_on_another_thread_gets_the_context_of_the_programs_call(contexts):
    src, dst = torch.arange(N, dtype=torch.float32), torch.zeros(N)
    session = _CudaSession(src, dst)
    batch = Batch([(dst.data_ptr(), src.data_ptr(), N * 4)], stream=0)
    contexts.set_device()  # the program's thread: torch made the primary context current
    with driver_copies.DriverCopies(session):
        assert batch.call(BATCH_TYPE(driver_copies.address_of("cuMemcpyBatchAsync"))) == 0
    assert len(session.issued) == 1 and not dst.any()  # queued, not issued
    on_a_helper_thread(session.issued[0])  # the gate's executor: no context of its own
    assert torch.equal(dst, src) and contexts.calls == [("cuMemcpyBatchAsync", PRIMARY)]


# -- the simulator (both tools' CUDA semantics, where the bytes are simulated) ----------------------------
pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed (CI installs it)")


def _racy_copy_through_libcuda(write: bool) -> None:
    """A pointer from ``cuGetProcAddress_v2`` of ``ctypes.CDLL("libcuda.so.1")``, called from a
    helper thread on a side stream, reading or writing ``kv`` beside a read of the default stream."""
    kv = torch.ones(N, device="cuda")
    host = torch.zeros(N, pin_memory=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    kv.sum()
    lib = ctypes.CDLL("libcuda.so.1")
    ptr, status = ctypes.c_void_p(0), ctypes.c_int(-1)
    assert lib.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(ptr), 12080, 0, ctypes.byref(status)) == 0
    assert status.value == 0
    dst, src = (kv.data_ptr(), host.data_ptr()) if write else (host.data_ptr(), kv.data_ptr())
    batch = Batch([(dst, src, N * 4)], side.cuda_stream)
    assert on_a_helper_thread(lambda: batch.call(BATCH_TYPE(ptr.value))) == 0
    side.synchronize()


@pytest.mark.parametrize("write", [False, True], ids=["reading-copy", "writing-copy"])
def test_the_simulated_sanitizer_follows_a_libcuda_pointer_called_from_a_helper_thread(write):
    from sanitizer.sim.session import simulate

    races, error, notes, unfollowed = simulate(lambda: _racy_copy_through_libcuda(write))
    assert error is None and unfollowed == []
    assert [race.kind for race in races] == (["unordered-device-access"] if write else [])


def test_a_batch_copy_that_cannot_be_followed_names_its_copy_in_fail_idx():
    from sanitizer.sim.session import simulate

    box = {}

    def program():
        from cuda.bindings import driver

        kv = torch.ones(N, device="cuda")
        host = torch.zeros(N, pin_memory=True)
        pageable = torch.zeros(N)
        _, ptr, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
        batch = Batch([(host.data_ptr(), kv.data_ptr(), 128), (pageable.data_ptr(), kv.data_ptr(), 128)], 0)
        box["err"] = batch.call(BATCH_TYPE(ptr))
        box["fail"] = batch.fail.value
        bad = Batch([(host.data_ptr(), kv.data_ptr(), 128)], 0, order=9)  # no such srcAccessOrder
        box["bad"] = (bad.call(BATCH_TYPE(ptr)), bad.fail.value)

    races, error, notes, unfollowed = simulate(program)
    assert error is None and races == [] and len(unfollowed) == 1
    assert box["err"] != 0 and box["fail"] == 1  # the second copy's destination is pageable
    assert box["bad"] == (driver_copies.CUDA_ERROR_INVALID_VALUE, SIZE_MAX)


# -- the GPU sanitizer, on the CUDA stand-in ------------------------------------------------------------------
def _observe(body):
    from sanitizer.gpu.observer import Observer

    cuda = FakeCuda()
    obs = Observer(device=cuda)
    cuda.obs = obs
    obs.start()
    try:
        body(cuda)
    finally:
        races = obs.stop()
    return races, [u.message() for u in obs.take_unfollowed()]


def _dma_beside_a_read(cuda, write: bool, box: dict) -> None:
    """The default stream reads ``kv``; a helper thread copies into or out of it with a pointer from
    cuda-bindings' ``cuGetProcAddress`` on a side stream, with no event between them."""
    from cuda.bindings import driver

    kv = cuda.device(torch.ones(N))
    host = cuda.pinned(torch.full((N,), 7.0))
    side = cuda.new_stream()
    kv.sum()  # a read on the default stream
    err, ptr, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
    assert int(err) == 0
    dst, src = (kv.data_ptr(), host.data_ptr()) if write else (host.data_ptr(), kv.data_ptr())
    batch = Batch([(dst, src, N * 4)], side)
    box["err"] = on_a_helper_thread(lambda: batch.call(BATCH_TYPE(ptr)))
    cuda.synchronize_stream(side)
    box["moved"] = (kv if write else host).tolist() == [7.0 if write else 1.0] * N


@pytest.mark.parametrize("write", [False, True], ids=["reading-copy", "writing-copy"])
def test_the_gpu_sanitizer_follows_a_pointer_from_cuGetProcAddress_called_from_a_helper_thread(write, contexts):
    box = {}
    races, unfollowed = _observe(lambda cuda: _dma_beside_a_read(cuda, write, box))
    assert unfollowed == []
    assert [race.kind for race in races] == (["unordered-device-access"] if write else [])
    assert "cuMemcpyBatchAsync" in str(races[0]) if races else True
    # the real call ran, from the helper thread, in the stream's context
    assert box == {"err": 0, "moved": True} and contexts.calls == [("cuMemcpyBatchAsync", PRIMARY)]


def test_the_gpu_sanitizer_says_a_copy_it_cannot_place_once_per_call_site_and_the_call_still_runs(contexts):
    box = {}

    def body(cuda):
        from cuda.bindings import driver

        kv = cuda.device(torch.ones(N))
        pageable = torch.zeros(N)
        _, ptr, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
        fn = BATCH_TYPE(ptr)
        box["errs"] = [Batch([(pageable.data_ptr(), kv.data_ptr(), N * 4)], 0).call(fn) for _ in range(3)]
        box["moved"] = pageable.tolist() == [1.0] * N

    races, unfollowed = _observe(body)
    assert races == [] and len(unfollowed) == 1, unfollowed
    assert unfollowed[0].startswith("kvz-sanitize cannot follow cuMemcpyBatchAsync: destination 0x")
    assert "test_driver_calls_on_gpu.py" in unfollowed[0]
    assert box == {"errs": [0, 0, 0], "moved": True}


def test_the_gpu_sanitizer_follows_the_bindings_even_when_the_program_imports_them_after_it_started(
        contexts, monkeypatch):
    """torch 2.11 (the GPU image's) does not import cuda-bindings: the engine imports it later."""
    for name in ("cuda.bindings.driver", "cuda.bindings.runtime"):
        monkeypatch.delitem(sys.modules, name)
    box = {}
    races, unfollowed = _observe(lambda cuda: _dma_beside_a_read(cuda, True, box))
    assert unfollowed == [] and [race.kind for race in races] == ["unordered-device-access"]


def test_the_gpu_sanitizer_follows_cuMemcpyAsync_of_a_libcuda_loaded_through_ctypes(contexts):
    box = {}

    def body(cuda):
        kv = cuda.device(torch.ones(N))
        host = cuda.pinned(torch.zeros(N))
        side = cuda.new_stream()
        kv.sum()
        lib = _FakeLibcuda()
        box["err"] = on_a_helper_thread(lambda: lib.cuMemcpyAsync(kv.data_ptr(), host.data_ptr(), N * 4, side))
        cuda.synchronize_stream(side)

    races, unfollowed = _observe(body)
    assert unfollowed == [] and [race.kind for race in races] == ["unordered-device-access"]
    assert box["err"] == 0 and contexts.calls == [("cuMemcpyAsync", PRIMARY)]


class _FakeLibcuda(ctypes.CDLL):
    """``ctypes.CDLL("libcuda.so.1")`` on a machine with no driver: this process's own symbols under
    libcuda's name (the sanitizer answers the followed ones before the library is asked)."""

    def __init__(self) -> None:
        super().__init__(None)
        self._name = "libcuda.so.1"


def test_the_tools_own_context_calls_never_go_through_a_patched_library_lookup():
    # On the H100 (2026-12-06) the sanitizer, which patches ctypes.CDLL's lookup to follow the
    # program's driver calls, reported this module's own cuStreamGetCtx as the program's
    # unfollowed call. Its entry points are made from the library's function type instead.
    from kvdevice.intercept.driver_context import LibcudaContexts

    made = []

    class Library:
        def __getattr__(self, name):
            raise AssertionError(f"looked up {name} through CDLL.__getattr__")

        def __getitem__(self, name):
            raise AssertionError(f"looked up {name} through CDLL.__getitem__")

        def _FuncPtr(self, spec):
            made.append(spec[0])
            return lambda *args: 0

    contexts = LibcudaContexts.__new__(LibcudaContexts)
    contexts._lib, contexts._primary, contexts._fns = Library(), {}, {}
    contexts._lock = __import__("threading").Lock()
    assert contexts.current() == 0 and contexts.of_stream(7) == 0
    contexts.primary(0)
    contexts.push(5)
    contexts.pop()
    contexts.current()
    assert made == ["cuCtxGetCurrent", "cuStreamGetCtx", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                    "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"]  # each made once
