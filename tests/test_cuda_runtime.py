"""The cuda backend: gates hold real streams exactly where the scheduling model says, free mode
races like the GPU does, and nothing ever leaves a kernel spinning.

The first group runs on CPU (allocator and gate bookkeeping, messages, the gate kernel under the
Triton interpreter). The rest needs a GPU. No test may hang: every call that could wait on a gate
runs under :func:`within`, which opens the runtime's gates and fails the test after a deadline.
"""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest
import torch

from zeroer.errors import DeadlockError, RuntimeUsageError
from kvdevice.runtime import make_runtime
from kvdevice.runtime.cuda import (
    DELAY_CYCLES_PER_UNIT,
    ControlledCudaRuntime,
    CudaRuntime,
    CudaRuntimeBase,
    FreeCudaRuntime,
    PinnedArena,
    resolve_device,
)
from racecheck import real_cuda
from racecheck.gate import (
    GatePool,
    GateTimeoutError,
    Watchdog,
    gate_available,
    hardware_queues,
    request_eager_module_loading,
    request_hardware_queues,
    spare_stream,
)

needs_cuda = pytest.mark.skipif(not gate_available(), reason="needs CUDA (and triton)")
# At collection, before any test of this worker creates its CUDA context: a stream that shares a
# hardware queue with a gated one (an observer reading results, say) stalls behind its gate.

TIMEOUT_S = 3.0  # the runtime's own limit per gated op / guarded call in these tests
DEADLINE_S = 10.0  # within()'s limit for a runtime call; it must exceed TIMEOUT_S


def within(seconds: float, fn: Callable[[], Any], rt: CudaRuntimeBase | None = None) -> Any:
    """Call ``fn`` in a thread; if it has not returned after ``seconds``, open every gate of ``rt``
    (so the GPU and the thread can finish) and fail the test instead of hanging the suite."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if rt is not None:
            rt.gates.open_all()
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {seconds} s: something waits on a closed gate")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- CPU: pure logic and messages ----------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_the_cuda_runtime_without_a_gpu_says_to_use_the_simulator():
    with pytest.raises(RuntimeUsageError, match=r"^backend 'cuda' needs a CUDA GPU and torch\.cuda\.is_available\(\) is False here; use backend 'sim' \(or 'auto'\)$"):
        make_runtime("cuda", mode="free")
    with pytest.raises(RuntimeUsageError, match=r"^backend 'cuda' needs a CUDA GPU .*use backend 'sim'"):
        CudaRuntime(mode="controlled")


def test_an_unknown_mode_is_named_with_the_choices():
    with pytest.raises(RuntimeUsageError, match=r"^unknown cuda mode 'eager'; choose one of controlled, free$"):
        CudaRuntime(mode="eager")


def test_resolve_device_accepts_indices_names_and_devices():
    assert resolve_device(None, count=2, current=1) == torch.device("cuda", 1)
    assert resolve_device(0, count=2, current=1) == torch.device("cuda", 0)
    assert resolve_device("cuda", count=2, current=1) == torch.device("cuda", 1)
    assert resolve_device("cuda:1", count=2, current=0) == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda", 0), count=2, current=1) == torch.device("cuda", 0)


def test_resolve_device_names_the_bad_value_and_the_valid_range():
    with pytest.raises(RuntimeUsageError, match=r"^cuda device 3 does not exist: this machine has 2 \(valid: 0\.\.1\)"):
        resolve_device("cuda:3", count=2, current=0)
    with pytest.raises(RuntimeUsageError, match=r"^cuda device -1 does not exist: this machine has 2 \(valid: 0\.\.1\)"):
        resolve_device(-1, count=2, current=0)
    with pytest.raises(RuntimeUsageError, match=r"^device 'cpu' is not a cuda device; pass a cuda index \(valid: 0\.\.1\)"):
        resolve_device("cpu", count=2, current=0)
    with pytest.raises(RuntimeUsageError, match=r"^device 'gpu0' is not a device; pass a cuda index \(valid: 0\.\.0\)"):
        resolve_device("gpu0", count=1, current=0)
    with pytest.raises(RuntimeUsageError, match=r"^device True is not a device"):
        resolve_device(True, count=1, current=0)
    with pytest.raises(RuntimeUsageError, match=r"^backend 'cuda' needs a CUDA GPU and none is visible here; use backend 'sim'"):
        resolve_device(0, count=0, current=0)


def test_hardware_queues_reads_cuda_device_max_connections(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16")
    assert hardware_queues() == 16
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "lots")
    assert hardware_queues() == 8  # CUDA's default


def test_hardware_queues_are_requested_only_while_cuda_has_not_started_and_nobody_chose(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16")  # restored (or removed again) at teardown
    assert request_hardware_queues() == "already set" and hardware_queues() == 16
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    monkeypatch.setattr(real_cuda, "is_initialized", lambda: True)
    assert request_hardware_queues() == "too late" and hardware_queues() == 8
    monkeypatch.setattr(real_cuda, "is_initialized", lambda: False)
    assert request_hardware_queues() == "set" and hardware_queues() == 32
    assert request_hardware_queues() == "already set"


def test_eager_module_loading_is_requested_only_while_cuda_has_not_started_and_nobody_chose(monkeypatch):
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")  # the user's choice is kept
    assert request_eager_module_loading() == "already set" and os.environ["CUDA_MODULE_LOADING"] == "LAZY"
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    monkeypatch.setattr(real_cuda, "is_initialized", lambda: True)
    assert request_eager_module_loading() == "too late" and "CUDA_MODULE_LOADING" not in os.environ
    monkeypatch.setattr(real_cuda, "is_initialized", lambda: False)
    assert request_eager_module_loading() == "set" and os.environ["CUDA_MODULE_LOADING"] == "EAGER"


def test_importing_the_cuda_backend_leaves_the_environment_alone():
    code = (
        "import os, kvdevice.runtime.cuda, racecheck.gate; "
        "print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_the_arena_reuses_a_freed_slot_of_the_same_size_class_at_once_newest_first():
    ids = itertools.count(1)
    arena = PinnedArena(lambda: next(ids), arena_bytes=256, pin_memory=False)
    a, ta = arena.alloc(4, torch.int64)  # 32 bytes
    b, tb = arena.alloc(3, torch.int64)  # 24 bytes -> the 32-byte class too
    c, _ = arena.alloc(1, torch.int32)  # 4 bytes
    assert (a, b, c) == (1, 2, 3) and ta.numel() == 4 and tb.numel() == 3
    arena.free(a)
    arena.free(b)
    again, view = arena.alloc(3, torch.int64)
    assert again == b and arena.reused == 1  # newest first, like the simulator's unprotected blocks
    view[:] = torch.tensor([7, 8, 9])
    assert tb.tolist() == [7, 8, 9]  # the same memory: nothing protects a pending copy of it
    assert arena.alloc(4, torch.int64)[0] == a
    assert arena.alloc(4, torch.int64)[0] == 4  # free list empty: a new slot


def test_arena_slots_are_aligned_and_a_full_arena_grows_into_a_new_one():
    ids = itertools.count(1)
    arena = PinnedArena(lambda: next(ids), arena_bytes=256, pin_memory=False)
    views = [arena.alloc(1, torch.int8)[1] for _ in range(5)]  # 1-byte slots, 64-byte aligned
    assert len(arena.arenas) == 2  # four fit in 256 bytes
    assert all(v.data_ptr() % 64 == 0 for v in views)
    big_slot, big = arena.alloc(100, torch.int64)  # 800 bytes -> a 1024-byte class, own arena
    assert big.numel() == 100 and arena.arenas[-1].numel() == 1024
    arena.release()
    assert arena.arenas == []


def test_a_gate_pool_resets_opens_and_recycles_flags():
    pool = GatePool(4, pin_memory=False)
    gates = [pool.acquire() for _ in range(4)]
    assert [g.slot for g in gates] == [0, 1, 2, 3] and pool.in_use == 4
    assert all(pool.value(g) == 0 for g in gates)
    pool.open(gates[1])
    assert [pool.value(g) for g in gates] == [0, 1, 0, 0]
    assert gates[1].address == gates[0].address + 4
    pool.recycle(gates[1])
    again = pool.acquire()
    assert again == gates[1] and pool.value(again) == 0  # reset before it is launched again
    extra = pool.acquire()  # all four in use: a second chunk
    assert extra.chunk == 1 and len(pool.chunks()) == 2
    pool.open_all()
    assert all(pool.value(g) == 1 for g in [*gates, extra])


def test_a_retired_gate_comes_back_only_after_its_event_completed():
    class FakeEvent:
        done = False

        def query(self) -> bool:
            return self.done

    pool = GatePool(1, pin_memory=False)
    gate = pool.acquire()
    event = FakeEvent()
    pool.retire(gate, event)
    assert pool.acquire().chunk == 1  # its kernel may still read the flag: not reused
    event.done = True
    assert pool.acquire() == gate


def test_launching_a_gate_of_an_unpinned_pool_says_to_use_pinned_flags():
    pool = GatePool(1, pin_memory=False)
    with pytest.raises(RuntimeUsageError, match=r"^(this GatePool was built with pin_memory=False|gates need triton)"):
        pool.launch(pool.acquire(), None)


def test_the_watchdog_opens_every_gate_when_the_host_is_stuck_and_keeps_reporting_it():
    pool = GatePool(2, pin_memory=False)
    gate = pool.acquire()
    dog = Watchdog(pool, timeout_s=0.2)
    try:
        with dog.guard("a quick call"):
            pass
        with pytest.raises(GateTimeoutError, match=r"^the host was stuck for over 0\.2 s in launch of k#1 while gates were closed"):
            with dog.guard("launch of k#1"):
                deadline = time.monotonic() + 5
                while pool.value(gate) == 0 and time.monotonic() < deadline:  # stuck behind the gate
                    time.sleep(0.01)
        assert pool.value(gate) == 1
        with pytest.raises(GateTimeoutError, match=r"in launch of k#1 while"):  # the schedule stays lost
            with dog.guard("a quick call"):
                pass
    finally:
        dog.stop()


def test_the_gate_pool_makes_gates_on_demand_and_reuses_a_recycled_one_first():
    pool = GatePool(2, pin_memory=False)
    a, b = pool.acquire(), pool.acquire()
    assert (a.chunk, a.slot, b.chunk, b.slot) == (0, 0, 0, 1)
    c = pool.acquire()  # the first chunk is used up: a second one is allocated
    assert (c.chunk, c.slot) == (1, 0) and len(pool.chunks()) == 2
    pool.recycle(b)
    assert pool.acquire() == b and pool.value(b) == 0  # closed again
    assert pool.in_use == 3


def test_a_stopped_watchdog_no_longer_opens_gates():
    pool = GatePool(1, pin_memory=False)
    gate = pool.acquire()
    dog = Watchdog(pool, timeout_s=0.05)
    with dog.guard("a quick call"):
        pass
    dog.stop()
    dog._deadline = time.monotonic() - 1  # as if a guard were stuck: nobody watches any more
    time.sleep(0.2)
    assert pool.value(gate) == 0 and dog.fired is None


def test_a_nested_guard_keeps_the_outer_deadline():
    pool = GatePool(1, pin_memory=False)
    gate = pool.acquire()
    dog = Watchdog(pool, timeout_s=0.2)
    try:
        with pytest.raises(GateTimeoutError, match=r"^the host was stuck for over 0\.2 s in launch of outer#1 "):
            with dog.guard("launch of outer#1"):
                with dog.guard("launch of inner#2"):  # a launch fn that enqueues again
                    pass
                deadline = time.monotonic() + 5
                while pool.value(gate) == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
    finally:
        dog.stop()


# Older Triton interpreters patch triton.language for good, which could break later GPU compiles in
# the same process; on a GPU the tests below run the real kernel anyway.
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the compiled gate kernel")
def test_the_gate_kernel_spins_until_the_host_writes_its_flag():
    """The kernel's logic, run by the Triton interpreter on CPU memory."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    from racecheck import gate as gate_module

    kernel = interpreter.InterpretedFunction(gate_module._gate_kernel.fn)
    pool = GatePool(2, pin_memory=False)
    opened = pool.acquire()
    pool.open(opened)
    within(DEADLINE_S, lambda: kernel[(1,)](opened.address, num_warps=1))
    closed = pool.acquire()
    timer = threading.Timer(0.2, pool.open, (closed,))
    start = time.monotonic()
    timer.start()
    within(DEADLINE_S, lambda: kernel[(1,)](closed.address, num_warps=1))
    assert time.monotonic() - start >= 0.19


# -- GPU -------------------------------------------------------------------------------------------
@pytest.fixture
def runtimes():
    """Builds runtimes and closes them all at teardown, gates open, whatever the test did."""
    made: list[CudaRuntimeBase] = []

    def make(mode: str = "controlled", **options: Any) -> CudaRuntimeBase:
        rt = CudaRuntime(mode=mode, timeout_s=options.pop("timeout_s", TIMEOUT_S), **options)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.gates.open_all()
        try:
            within(DEADLINE_S, rt.close, rt)
        except (DeadlockError, GateTimeoutError, RuntimeUsageError):
            pass


def warm_up(device: torch.device) -> torch.cuda.Stream:
    """Load, on a spare stream, every kernel the tests launch behind gates (a first launch while
    a gate spins would wait for the GPU to drain); return that stream for reading results."""
    observer = spare_stream(device)
    scratch = torch.zeros(2, dtype=torch.int64, device=device)
    other = torch.zeros(2, dtype=torch.int64, device=device)
    with torch.cuda.stream(observer):
        scratch.fill_(-1)
        scratch.zero_()
        scratch.add_(1)
        scratch.add_(other)
        scratch.copy_(other)
    within(DEADLINE_S, observer.synchronize)
    return observer


def read(buf, observer: torch.cuda.Stream) -> list[int]:
    """``buf``'s device values, read on ``observer``: it waits for nothing behind a gate."""

    def go() -> list[int]:
        with torch.cuda.stream(observer):
            return buf.tensor.cpu().tolist()

    return within(DEADLINE_S, go)


def fill(buf, value: int, observer: torch.cuda.Stream) -> None:
    with torch.cuda.stream(observer):
        buf.tensor.fill_(value)
    within(DEADLINE_S, observer.synchronize)


def device_idle_within(seconds: float) -> None:
    within(seconds, torch.cuda.synchronize)


@needs_cuda
def test_cuda_runtime_builds_the_class_of_its_mode(runtimes):
    controlled, free = runtimes("controlled"), runtimes("free")
    assert isinstance(controlled, ControlledCudaRuntime) and controlled.scheduled and controlled.mode == "controlled"
    assert isinstance(free, FreeCudaRuntime) and not free.scheduled and free.mode == "free"
    assert controlled.hardware_queue_request in ("set", "already set", "too late")
    built = make_runtime("cuda", mode="free")
    try:
        assert isinstance(built, FreeCudaRuntime)
    finally:
        within(DEADLINE_S, built.close, built)


@needs_cuda
def test_controlled_copy_reads_its_pinned_source_only_when_advanced(runtimes):
    rt = runtimes()
    observer = warm_up(rt.device)
    host, dev = rt.host_buffer(1), rt.device_buffer(1)
    fill(dev, -1, observer)
    rt.write_host(host, [1])
    rt.copy_h2d(dev, host)
    time.sleep(0.05)  # an ungated copy would long have run
    assert read(dev, observer) == [-1]
    rt.write_host(host, [2])
    assert [h.kind for h in rt.hazards] == ["host-write-vs-pending-copy"]
    assert rt.pending(rt.default_stream) == 1
    assert within(DEADLINE_S, lambda: rt.advance(rt.default_stream, 1), rt) == 1
    assert read(dev, observer) == [2]  # it read the source when advanced, not when enqueued
    within(DEADLINE_S, rt.synchronize, rt)
    assert dev.tensor.cpu().tolist() == [2]


@needs_cuda
def test_controlled_advance_by_one_runs_exactly_one_op(runtimes):
    rt = runtimes()
    observer = warm_up(rt.device)
    counter = rt.device_buffer(1)
    fill(counter, 0, observer)
    for _ in range(3):
        rt.launch(lambda: counter.tensor.add_(1), writes=[counter])
    time.sleep(0.02)
    assert read(counter, observer) == [0]
    assert within(DEADLINE_S, lambda: rt.advance(rt.default_stream, 1), rt) == 1
    assert read(counter, observer) == [1]
    assert rt.pending(rt.default_stream) == 2
    assert within(DEADLINE_S, lambda: rt.advance(rt.default_stream, 5), rt) == 2
    assert read(counter, observer) == [3]


@needs_cuda
def test_controlled_event_queries_follow_the_model_and_the_device_agrees(runtimes):
    rt = runtimes()
    observer = warm_up(rt.device)
    counter = rt.device_buffer(1)
    fill(counter, 0, observer)
    rt.launch(lambda: counter.tensor.add_(1), writes=[counter])
    event = rt.record_event()
    assert not rt.query_event(event) and not event.handle.query()
    within(DEADLINE_S, lambda: rt.advance(rt.default_stream, 1), rt)  # the kernel, not the record
    assert not rt.query_event(event) and not event.handle.query()
    within(DEADLINE_S, lambda: rt.advance(rt.default_stream, 1), rt)
    assert rt.query_event(event) and event.handle.query()


@needs_cuda
def test_controlled_wait_blocks_a_stream_until_the_awaited_stream_advanced(runtimes):
    rt = runtimes()
    observer = warm_up(rt.device)
    a, b = rt.default_stream, rt.new_stream("b")
    source, target = rt.device_buffer(1), rt.device_buffer(1)
    fill(source, 0, observer)
    fill(target, 0, observer)
    rt.launch(lambda: source.tensor.add_(1), stream=a, writes=[source])
    ready = rt.record_event(stream=a)
    rt.wait_event(ready, stream=b)
    rt.launch(lambda: target.tensor.add_(source.tensor), stream=b, reads=[source], writes=[target])
    assert within(DEADLINE_S, lambda: rt.advance(b, 1), rt) == 0
    assert rt.pending(b) == 2
    assert within(DEADLINE_S, lambda: rt.advance(a, 2), rt) == 2
    assert within(DEADLINE_S, lambda: rt.advance(b, 2), rt) == 2
    assert read(target, observer) == [1]
    assert rt.hazards == []


@needs_cuda
def test_controlled_stream_sync_runs_only_what_it_needs(runtimes):
    rt = runtimes()
    observer = warm_up(rt.device)
    a, b = rt.default_stream, rt.new_stream("b")
    source, target, later = rt.device_buffer(1), rt.device_buffer(1), rt.device_buffer(1)
    for buf in (source, target, later):
        fill(buf, 0, observer)
    rt.launch(lambda: source.tensor.add_(1), stream=a, writes=[source])
    ready = rt.record_event(stream=a)
    rt.launch(lambda: later.tensor.add_(1), stream=a, writes=[later])
    rt.wait_event(ready, stream=b)
    rt.launch(lambda: target.tensor.add_(source.tensor), stream=b, reads=[source], writes=[target])
    within(DEADLINE_S, lambda: rt.synchronize_stream(b), rt)
    assert (rt.pending(a), rt.pending(b)) == (1, 0)
    assert read(target, observer) == [1] and read(later, observer) == [0]


@needs_cuda
def test_controlled_sync_behind_an_unreleased_hold_raises_at_once_and_release_lets_it_run(runtimes):
    rt = runtimes()
    observer = warm_up(rt.device)
    counter = rt.device_buffer(1)
    fill(counter, 0, observer)
    hold = rt.hold()
    rt.launch(lambda: counter.tensor.add_(1), writes=[counter])
    start = time.monotonic()
    with pytest.raises(DeadlockError, match=r"^deadlock: the host waits for op 2 of stream 'main', which can never run"):
        within(DEADLINE_S, rt.synchronize_stream, rt)
    assert time.monotonic() - start < 1.0
    assert within(DEADLINE_S, lambda: rt.advance(rt.default_stream, 1), rt) == 0  # held
    rt.release(hold)
    within(DEADLINE_S, rt.synchronize, rt)
    assert read(counter, observer) == [1]


@needs_cuda
def test_controlled_cuda_and_the_simulator_take_the_same_decisions():
    """One program on both backends: the same advances, queries, reuse, values and hazards."""

    def program(rt) -> list:
        side = rt.new_stream("side")
        host = rt.host_buffer(2, protected=False)
        dev, out = rt.device_buffer(2), rt.device_buffer(2)
        rt.write_host(host, [1, 2])
        rt.launch(lambda: dev.tensor.zero_(), writes=[dev])
        rt.copy_h2d(dev, host)
        done = rt.record_event()
        rt.wait_event(done, stream=side)
        rt.delay(side, 2)
        rt.launch(lambda: out.tensor.copy_(dev.tensor), stream=side, reads=[dev], writes=[out])
        seen: list = [rt.advance(side, 1)]
        rt.write_host(host, [3, 4])  # the copy has not run: a hazard, and it will read [3, 4]
        seen += [rt.advance(rt.default_stream, 2), rt.query_event(done)]
        seen += [rt.advance(rt.default_stream, 1), rt.query_event(done)]
        seen += [rt.advance(side, 2), rt.pending(side)]
        rt.free_host(host)
        seen.append(rt.host_buffer(2, protected=False).block == host.block)  # reused at once
        rt.synchronize()
        seen += [out.tensor.cpu().tolist(), [h.kind for h in rt.hazards], [rt.pending(s) for s in rt.streams]]
        return seen

    sim = make_runtime("sim")
    expected = program(sim)
    assert expected == [0, 2, False, 1, True, 2, 2, True, [3, 4], ["host-write-vs-pending-copy"], [0, 0]]
    rt = CudaRuntime(mode="controlled", timeout_s=TIMEOUT_S)
    try:
        warm_up(rt.device)
        assert within(DEADLINE_S, lambda: program(rt), rt) == expected
    finally:
        rt.gates.open_all()
        within(DEADLINE_S, rt.close, rt)


@needs_cuda
def test_ungated_runs_warm_ups_at_once_and_refuses_a_busy_runtime(runtimes):
    rt = runtimes()
    observer = warm_up(rt.device)
    counter = rt.device_buffer(1)
    fill(counter, 0, observer)
    with rt.ungated():
        rt.launch(lambda: counter.tensor.add_(1), writes=[counter])
        rt.record_event()
    assert rt.pending(rt.default_stream) == 0 and read(counter, observer) == [1]
    rt.launch(lambda: counter.tensor.add_(1), writes=[counter])
    with pytest.raises(RuntimeUsageError, match=r"^ungated\(\) needs an idle runtime, but ops are queued on stream\(s\) 'main' \(1\); call synchronize\(\) first$"):
        with rt.ungated():
            pass


@needs_cuda
def test_allocating_while_gates_are_closed_does_not_stall(runtimes):
    """Diagnostic: pinned and device allocations must not wait for the (gated) GPU."""
    rt = runtimes()
    observer = warm_up(rt.device)
    counter = rt.device_buffer(1)
    fill(counter, 0, observer)
    host = rt.host_buffer(1)
    rt.copy_h2d(counter, host)  # a gate now spins on main, and the copy holds host's block
    start = time.monotonic()
    buffers = [rt.host_buffer(1 << k) for k in range(4, 14)]
    buffers += [rt.host_buffer(1 << k, protected=False) for k in range(4, 14)]
    buffers.append(rt.device_buffer(1 << 22))
    assert time.monotonic() - start < 2.0
    address = host.tensor.data_ptr()
    rt.free_host(host)
    del host
    assert rt.host_buffer(1).tensor.data_ptr() != address  # PyTorch keeps it while the copy is pending
    within(DEADLINE_S, rt.synchronize, rt)


@needs_cuda
def test_free_mode_delay_keeps_a_copy_pending_while_the_host_rewrites_its_source(runtimes, record_property):
    """The vLLM #48085 overwrite on real hardware: the hazard is certain, the value usually shows it."""
    rt = runtimes("free")
    warm_up(rt.device)
    host, dev = rt.host_buffer(1), rt.device_buffer(1)
    rt.write_host(host, [1])
    rt.delay(rt.default_stream, 500)  # 500 units ~ 50 ms of torch.cuda._sleep
    rt.copy_h2d(dev, host)
    rt.write_host(host, [2])
    assert rt.advance(rt.default_stream, 1) == 0 and rt.pending(rt.default_stream) == 0
    within(DEADLINE_S, rt.synchronize, rt)
    arrived = dev.tensor.cpu().tolist()
    record_property("arrived_after_48085_overwrite", arrived)
    print(f"free mode, {500 * DELAY_CYCLES_PER_UNIT} cycles of sleep: the copy delivered {arrived} (2 = overwritten)")
    assert arrived in ([1], [2])
    assert [h.kind for h in rt.hazards] == ["host-write-vs-pending-copy"]


@needs_cuda
def test_free_mode_sync_with_an_unreleased_hold_raises_instead_of_hanging(runtimes):
    rt = runtimes("free")
    observer = warm_up(rt.device)
    counter = rt.device_buffer(1)
    fill(counter, 0, observer)
    side = rt.new_stream("side")
    hold = rt.hold(side)
    rt.launch(lambda: counter.tensor.add_(1), stream=side, writes=[counter])
    time.sleep(0.02)
    assert read(counter, observer) == [0]
    with pytest.raises(DeadlockError, match=r"^deadlock: synchronising every stream would wait forever behind hold#\d+ on stream 'side'.*call release\(\) on every hold before synchronising$"):
        within(DEADLINE_S, rt.synchronize, rt)
    rt.release(hold)
    within(DEADLINE_S, rt.synchronize, rt)
    assert read(counter, observer) == [1]


@needs_cuda
def test_close_opens_every_gate_even_when_it_reports_a_deadlock(runtimes):
    rt = runtimes()
    observer = warm_up(rt.device)
    counter = rt.device_buffer(1)
    fill(counter, 0, observer)
    side = rt.new_stream("side")
    rt.hold(side)
    rt.launch(lambda: counter.tensor.add_(1), stream=side, writes=[counter])
    rt.launch(lambda: counter.tensor.add_(1), writes=[counter])
    with pytest.raises(DeadlockError, match=r"^deadlock: the host waits for op 2 of stream 'side'"):
        within(DEADLINE_S, rt.close, rt)  # as on the simulator, but the gates are opened anyway
    device_idle_within(1.0)
    assert read(counter, observer) == [2]
    rt.close()  # a second close is a no-op
    with pytest.raises(RuntimeUsageError, match=r"^this cuda runtime is closed; create a new one"):
        rt.advance(rt.default_stream, 1)


@needs_cuda
def test_a_runtime_dropped_without_close_opens_its_gates():
    rt = CudaRuntime(mode="controlled", timeout_s=TIMEOUT_S)
    warm_up(rt.device)
    counter = rt.device_buffer(1)
    rt.launch(lambda: counter.tensor.add_(1), writes=[counter])
    rt.hold()
    del rt
    gc.collect()
    device_idle_within(1.0)


@needs_cuda
def test_a_host_call_stuck_behind_closed_gates_becomes_a_gate_timeout(runtimes):
    rt = runtimes(timeout_s=1.0)
    warm_up(rt.device)
    start = time.monotonic()
    with pytest.raises(GateTimeoutError, match=r"^the host was stuck for over 1 s in kernel#\d+ on stream 'main'"):
        # a launch fn that synchronises its own stream waits for its own gate
        within(DEADLINE_S, lambda: rt.launch(lambda: torch.cuda.current_stream().synchronize()), rt)
    assert time.monotonic() - start < 5.0
    with pytest.raises(GateTimeoutError, match=r"^this cuda runtime opened every gate after kernel#\d+"):
        rt.advance(rt.default_stream, 1)
    within(DEADLINE_S, rt.close, rt)
    device_idle_within(1.0)
