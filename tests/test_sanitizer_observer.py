"""The GPU observer's race logic on a CPU, through a stand-in for CUDA (tests/fake_cuda.py).

The observer (sanitizer/gpu/) decides from enqueue order, events and the host's observations, never
from timing, so a stand-in that calls some CPU tensors device memory and reports streams and events
as torch's trace callbacks do runs its logic as a GPU would: host writes and reads of pinned memory
under pending copies (seen through torch ops, ``.tolist()``, numpy views, or found by snapshots),
threads and their hand-offs, the rows of indexed ops, a buffer's history, stepping aside for a
runtime with a schedule of its own. The same logic on a real GPU: tests/test_sanitizer_gpu.py.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest
import torch

from fake_cuda import FakeCuda, RealCuda, kinds, observing
from racecheck import schedules
from sanitizer.gpu.observer import Observer
from kvdevice.origin import blame

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(params=["fake", "cuda"])
def cuda(request):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a GPU")
        return RealCuda()
    return FakeCuda()


@pytest.fixture
def fake():
    return FakeCuda()


@pytest.fixture
def obs(cuda):
    with observing(cuda) as observer:
        yield observer


def lines(races, kind: str) -> set[tuple[int, int]]:
    return {(r.queued.site.line, r.later.site.line) for r in races if r.kind == kind and r.later.site}


def here() -> int:
    import inspect

    return inspect.currentframe().f_back.f_lineno


# -- host writes under pending host-to-device copies ------------------------------------------------------

def test_a_write_through_a_numpy_view_under_a_queued_copy_is_reported_at_its_own_line(obs, cuda):
    staging = cuda.pinned(torch.zeros(8, dtype=torch.int64))
    view = staging.numpy()  # taken once, as vLLM's CpuGpuBuffer.np is
    ids = cuda.device(torch.zeros(8, dtype=torch.int64))
    view[:4] = [1, 2, 3, 4]
    ids.copy_(staging, non_blocking=True); copied = here()
    view[:4] = [5, 6, 7, 8]; written = here()
    races = obs.stop()
    assert kinds(races) == ["host-write-vs-pending-copy"]
    assert lines(races, "host-write-vs-pending-copy") == {(copied, written)}


def test_a_write_through_fill_is_reported_at_its_own_line(obs, cuda):
    staging = cuda.pinned(torch.zeros(8, dtype=torch.int64))
    ids = cuda.device(torch.zeros(8, dtype=torch.int64))
    ids.copy_(staging, non_blocking=True); copied = here()
    staging.fill_(3); filled = here()
    ids.copy_(staging, non_blocking=True)
    assert lines(obs.stop(), "host-write-vs-pending-copy") == {(copied, filled)}


def test_a_write_no_call_shows_is_found_between_two_lines(obs, cuda):
    import ctypes

    staging = cuda.pinned(torch.zeros(8, dtype=torch.int64))
    ids = cuda.device(torch.zeros(8, dtype=torch.int64))
    ids.copy_(staging, non_blocking=True); copied = here()
    ctypes.memmove(staging.data_ptr(), (ctypes.c_int64 * 1)(9), 8)
    cuda.synchronize(); seen = here()
    (race,) = obs.stop()
    assert race.kind == "host-write-vs-pending-copy" and race.queued.site.line == copied
    assert race.later.until is not None and race.later.until.line == seen


def test_a_host_that_waited_for_the_copys_event_may_rewrite(obs, cuda):
    staging = cuda.pinned(torch.zeros(8, dtype=torch.int64))
    ids = cuda.device(torch.zeros(8, dtype=torch.int64))
    for step in range(3):
        staging.numpy()[:] = step
        ids.copy_(staging, non_blocking=True)
        cuda.synchronize_event(cuda.record())
    assert obs.stop() == []


def test_a_write_to_other_bytes_of_the_buffer_is_not_a_race(obs, cuda):
    staging = cuda.pinned(torch.zeros(8, dtype=torch.int64))
    ids = cuda.device(torch.zeros(4, dtype=torch.int64))
    ids.copy_(staging[:4], non_blocking=True)
    staging[4:].fill_(1)  # the copy reads only the first half
    staging.numpy()[6] = 2
    assert obs.stop() == []


@pytest.mark.parametrize("how", ["index_put", "index_fill", "torch_mask", "masked_fill", "masked_scatter", "numpy_fancy",
                                 "numpy_put", "numpy_mask", "numpy_copyto_where", "numpy_ufunc_where"])
def test_an_indexed_host_write_touches_only_the_rows_it_names(obs, cuda, how):
    # vLLM fills a pinned block table row by row while the copy of earlier rows is queued.
    table = cuda.pinned(torch.zeros(8, 2, dtype=torch.int32))
    view = table.numpy()
    rows = cuda.device(torch.zeros(4, 2, dtype=torch.int32))
    rows.copy_(table[:4], non_blocking=True); copied = here()

    def write(names: list[int]) -> int:
        if how == "index_put":
            table[torch.tensor(names)] = 7; return here()
        if how == "index_fill":
            table.index_fill_(0, torch.tensor(names), 7); return here()
        if how == "torch_mask":
            chosen = torch.zeros(8, dtype=torch.bool)
            chosen[names] = True
            table[chosen] = 7; return here()
        if how == "numpy_fancy":
            view[names] = 7; return here()
        if how == "numpy_put":
            np.put(view, [2 * n for n in names], 7); return here()
        if how in ("masked_fill", "masked_scatter"):  # torch's CPU kernels write the mask's elements only
            chosen = torch.zeros(8, 2, dtype=torch.bool)
            chosen[names] = True
            if how == "masked_fill":
                table.masked_fill_(chosen, 7); return here()
            table.masked_scatter_(chosen, torch.full((16,), 7, dtype=torch.int32)); return here()
        mask = np.zeros(view.shape, dtype=bool)
        mask[names] = True
        if how == "numpy_copyto_where":
            np.copyto(view, 7, where=mask); return here()
        if how == "numpy_ufunc_where":
            np.add(view, 7, out=view, where=mask); return here()
        np.putmask(view, mask, 7); return here()

    write([5, 6])  # rows the copy does not read
    assert obs.races == [], obs.races[0].format()  # (both writes are at one line of write: say it here)
    written = write([6, 1])
    races = obs.stop()
    assert kinds(races) == ["host-write-vs-pending-copy"], races
    assert lines(races, "host-write-vs-pending-copy") == {(copied, written)}


def test_an_indexed_host_read_reads_only_the_rows_it_names(obs, cuda):
    counts = cuda.device(torch.arange(4, dtype=torch.int32))
    host = cuda.pinned(torch.zeros(8, dtype=torch.int32))
    view = host.numpy()
    host[:4].copy_(counts, non_blocking=True); copied = here()
    assert host[torch.tensor([5, 6])].tolist() == [0, 0]
    assert host[torch.arange(8) >= 6].tolist() == [0, 0]
    assert view[[4, 7]].tolist() == [0, 0]
    assert np.take(view, [4, 7]).tolist() == view.take([5, -1], mode="wrap").tolist() == [0, 0]
    view[[2, 5]].sum(); read = here()
    races = obs.stop()
    assert lines(races, "host-read-vs-pending-copy") == {(copied, read)}


def test_a_numpy_views_shape_and_dtype_are_not_reads_of_its_memory(obs, cuda):
    counts = cuda.device(torch.arange(4, dtype=torch.int32))
    host = cuda.pinned(torch.zeros(4, dtype=torch.int32))
    view = host.numpy()
    host.copy_(counts, non_blocking=True)
    assert view.shape == (4,) and len(view) == 4 and view.dtype == np.int32 and view.nbytes == 16
    assert view.reshape(2, 2).shape == (2, 2) and view[1:].size == 3 and np.shape(view) == (4,)
    cuda.synchronize_event(cuda.record())
    assert view.tolist() == [0, 1, 2, 3]
    assert obs.stop() == []


# -- host reads under pending device-to-host copies (vLLM #36013) --------------------------------------------

@pytest.mark.parametrize("read", ["tolist", "item", "numpy_view", "torch_op", "int"])
def test_a_host_read_before_the_copy_was_seen_complete_is_a_race(obs, cuda, read):
    counts = cuda.device(torch.arange(4, dtype=torch.int32))
    host = cuda.pinned(torch.zeros(4, dtype=torch.int32))
    view = host.numpy()
    host.copy_(counts, non_blocking=True); copied = here()
    if read == "tolist":
        host.tolist(); at = here()
    elif read == "item":
        host[1].item(); at = here()
    elif read == "numpy_view":
        int(view[2]); at = here()
    elif read == "torch_op":
        host.sum(); at = here()
    else:
        int(host[0]); at = here()
    races = obs.stop()
    assert kinds(races) == ["host-read-vs-pending-copy"], races
    assert lines(races, "host-read-vs-pending-copy") == {(copied, at)}


def test_a_host_read_after_the_copys_event_was_synchronized_is_clean(obs, cuda):
    counts = cuda.device(torch.arange(4, dtype=torch.int32))
    host = cuda.pinned(torch.zeros(4, dtype=torch.int32))
    view = host.numpy()
    for _ in range(3):
        host.copy_(counts, non_blocking=True)
        done = cuda.record()
        cuda.synchronize_event(done)
        assert view.tolist() == [0, 1, 2, 3]
    assert obs.stop() == []


def test_a_buffer_that_received_a_device_to_host_copy_is_checked_again_once_the_host_saw_it(obs, cuda):
    # The stale-state regression: a pinned bounce buffer used for a store (D2H) and then for loads (H2D).
    kv = cuda.device(torch.zeros(4, dtype=torch.float32))
    bounce = cuda.pinned(torch.zeros(4, dtype=torch.float32))
    bounce.copy_(kv, non_blocking=True)
    cuda.synchronize_event(cuda.record())
    for block in range(2):
        bounce.numpy()[:] = block; written = here()
        kv.copy_(bounce, non_blocking=True); loaded = here()
    races = obs.stop()
    assert kinds(races) == ["host-write-vs-pending-copy"]
    assert (loaded, written) in lines(races, "host-write-vs-pending-copy")


# -- threads -------------------------------------------------------------------------------------------

def _copy_in_thread(obs, cuda, host, counts, then):
    """A helper thread queues the D2H copy on its own stream and records an event (vLLM's async
    output thread); ``then(event)`` runs in that thread after it."""
    def run() -> None:
        side = cuda.new_stream()
        with cuda.stream(side):
            host.copy_(counts, non_blocking=True)
            then(cuda.record())

    worker = threading.Thread(target=run)
    worker.start()
    return worker


def test_a_main_thread_read_before_the_helper_threads_event_is_a_race(obs, cuda):
    counts = cuda.device(torch.arange(4, dtype=torch.int64))
    host = cuda.pinned(torch.zeros(4, dtype=torch.int64))
    handed = queue.Queue()
    worker = _copy_in_thread(obs, cuda, host, counts, handed.put)
    event = handed.get()
    host.tolist()
    cuda.synchronize_event(event)
    worker.join()
    assert kinds(obs.stop()) == ["host-read-vs-pending-copy"]


def test_a_write_before_an_event_record_is_placed_at_the_record_not_at_another_threads_later_sync(obs, cuda):
    # The record's callback compares the pending reads' bytes: the write is the main thread's, between
    # the copy and the record. (A record that skipped the comparison let the helper's synchronize()
    # find it, and the race named the helper's line as both ends.)
    import ctypes

    staging = cuda.pinned(torch.zeros(8, dtype=torch.int64))
    ids = cuda.device(torch.zeros(8, dtype=torch.int64))
    ids.copy_(staging, non_blocking=True); copied = here()
    ctypes.memmove(staging.data_ptr(), (ctypes.c_int64 * 1)(9), 8)
    cuda.record(); recorded = here()
    worker = threading.Thread(target=cuda.synchronize)
    worker.start()
    worker.join()
    (race,) = obs.stop()
    assert race.kind == "host-write-vs-pending-copy" and race.queued.site.line == copied
    assert race.later.until is not None and race.later.until.line == recorded


def test_a_helper_thread_that_synchronized_before_the_queue_hand_off_orders_the_main_threads_read(obs, cuda):
    counts = cuda.device(torch.arange(4, dtype=torch.int64))
    host = cuda.pinned(torch.zeros(4, dtype=torch.int64))
    handed = queue.Queue()
    worker = _copy_in_thread(obs, cuda, host, counts, lambda event: (cuda.synchronize_event(event), handed.put(1)))
    handed.get()
    host.tolist()
    worker.join()
    assert obs.stop() == [] and obs.take_notes() == []


def test_a_hand_off_the_sanitizer_cannot_see_is_a_note_not_a_race(obs, cuda):
    counts = cuda.device(torch.arange(4, dtype=torch.int64))
    host = cuda.pinned(torch.zeros(4, dtype=torch.int64))
    lock, ready = threading.Lock(), []
    lock.acquire()

    def done(event) -> None:
        cuda.synchronize_event(event)
        ready.append(True)
        lock.release()  # a lock: a hand-off the checker does not follow

    worker = _copy_in_thread(obs, cuda, host, counts, done)
    lock.acquire()
    host.tolist()
    races = obs.stop()
    worker.join()
    assert races == []
    notes = obs.take_notes()
    assert len(notes) == 1 and notes[0].startswith("kvz-sanitize assumed an order it cannot see: the host read")


def test_ops_of_a_thread_started_after_the_observer_are_seen(obs, cuda):
    staging = cuda.pinned(torch.zeros(4, dtype=torch.int64))
    ids = cuda.device(torch.zeros(4, dtype=torch.int64))

    def run() -> None:
        ids.copy_(staging, non_blocking=True)
        staging.numpy()[0] = 1

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert kinds(obs.stop()) == ["host-write-vs-pending-copy"]


# -- device accesses, rows and reuse --------------------------------------------------------------------

def test_two_streams_touching_other_rows_of_one_tensor_do_not_race(obs, cuda):
    kv = cuda.device(torch.zeros(8, 4))
    side = cuda.new_stream()
    kv[1].fill_(1.0)
    with cuda.stream(side):
        kv[5].fill_(2.0)
    assert obs.stop() == []


def test_an_index_select_reads_only_the_rows_its_staged_ids_name(obs, cuda):
    # vLLM's offload worker: ids staged through pinned memory, index_select on the transfer stream
    # after wait_stream(compute), while compute writes other blocks.
    kv = cuda.device(torch.zeros(8, 4))
    ids_host = cuda.pinned(torch.tensor([0, 2], dtype=torch.int64))
    ids = cuda.device(torch.zeros(2, dtype=torch.int64))
    transfer = cuda.new_stream()
    kv[0].fill_(1.0)
    kv[2].fill_(1.0)
    ids.copy_(ids_host, non_blocking=True)
    started = cuda.record()
    with cuda.stream(transfer):
        cuda.wait(started)
        stored = kv.index_select(0, ids)
    kv[5].fill_(3.0)  # compute writes another block meanwhile
    kv[6].fill_(3.0)
    del stored
    assert obs.stop() == []


def test_a_replayed_graph_gathers_the_rows_its_index_holds_at_that_replay(obs, cuda):
    # A decode graph gathers through a static index buffer the host restages before each replay.
    kv = cuda.device(torch.zeros(8, 4))
    ids = cuda.device(torch.zeros(2, dtype=torch.int64))
    out = cuda.device(torch.zeros(2, 4))
    side = cuda.new_stream()
    graph = cuda.new_graph()
    with cuda.capture(graph):
        out.copy_(kv.index_select(0, ids))
    cuda.synchronize()
    ids.copy_(cuda.pinned(torch.tensor([0, 1])), non_blocking=True)
    cuda.replay(graph)
    with cuda.stream(side):
        kv[2].fill_(1.0)  # unordered with the replay, which gathers rows 0 and 1 this time
    cuda.synchronize()
    ids.copy_(cuda.pinned(torch.tensor([2, 3])), non_blocking=True)
    cuda.replay(graph); replayed = here()
    with cuda.stream(side):
        kv[2].fill_(1.0); written = here()  # and now row 2: a race
    cuda.synchronize()
    races = obs.stop()
    assert kinds(races) == ["unordered-device-access"], races
    assert lines(races, "unordered-device-access") == {(replayed, written)}


def test_an_index_select_over_rows_compute_writes_is_a_race(obs, cuda):
    kv = cuda.device(torch.zeros(8, 4))
    ids_host = cuda.pinned(torch.tensor([0, 5], dtype=torch.int64))
    ids = cuda.device(torch.zeros(2, dtype=torch.int64))
    transfer = cuda.new_stream()
    ids.copy_(ids_host, non_blocking=True)
    started = cuda.record()
    with cuda.stream(transfer):
        cuda.wait(started)
        kv.index_select(0, ids); gathered = here()
    kv[5].fill_(3.0); written = here()
    races = obs.stop()
    assert lines(races, "unordered-device-access") == {(gathered, written)}


# -- stepping aside ---------------------------------------------------------------------------------------

def test_the_observer_steps_aside_while_a_runtime_with_its_own_schedule_runs(obs, cuda):
    class Runtime:
        pass

    runtime = Runtime()
    staging = cuda.pinned(torch.zeros(4, dtype=torch.int64))
    ids = cuda.device(torch.zeros(4, dtype=torch.int64))
    schedules.started(runtime, "a gated runtime")
    try:
        ids.copy_(staging, non_blocking=True)
        staging.numpy()[0] = 1  # its own work: not the program's to check
    finally:  # ended whatever the work raised: a runtime left running would set every later observer aside
        schedules.ended(runtime)
    notes = [u.message() for u in obs.take_unfollowed()]
    assert len(notes) == 1 and "a gated runtime" in notes[0]
    ids.copy_(staging, non_blocking=True)
    staging.numpy()[0] = 2  # checking resumed
    assert kinds(obs.stop()) == ["host-write-vs-pending-copy"]


def test_an_observer_inside_another_is_the_one_that_checks(cuda):
    outer = Observer(device=cuda.adapter())
    cuda.obs = outer
    outer.start()
    inner = Observer(device=cuda.adapter())
    try:
        inner.start()
        cuda.obs = inner
        staging = cuda.pinned(torch.zeros(4, dtype=torch.int64))
        ids = cuda.device(torch.zeros(4, dtype=torch.int64))
        ids.copy_(staging, non_blocking=True)
        staging.numpy()[0] = 1
        assert kinds(inner.stop()) == ["host-write-vs-pending-copy"]
    finally:
        cuda.obs = outer
        races = outer.stop()
    assert races == []


# -- the observer where it meets the rest of kvzero -----------------------------------------------------------

def test_the_simulators_tensors_pass_the_observer_by(fake):
    obs = Observer(device=fake)
    obs.start()
    try:
        _run_an_episode_under(obs)
    finally:
        obs.stop()


def _run_an_episode_under(obs):
    from fuzz.engine.episode import Episode, EpisodeConfig

    # A plain torch zeroer: its device tensors are the simulator's SimCudaTensors, which call
    # themselves CUDA (CPU memory inside); none of its work is the observer's to stamp.
    episode = Episode(EpisodeConfig(zeroer=str(ROOT / "examples" / "engine_zeroers.py") + ":fresh_pinned_per_call"))
    try:
        for op in ({"op": "start", "in_flight": 1}, {"op": "allocate", "n": 2}, {"op": "allocate", "n": 2},
                   {"op": "sync_device"}):
            episode.apply(op)
    finally:  # its zeroer and runtime closed whatever an op raised
        episode.abandon()
    assert not obs.hb._shadows, list(obs.hb._shadows)  # no device memory access was taken for the program's
    assert obs.take_races() == [] and obs.hb.hazards == []


@pytest.mark.parametrize("pinned", [False, True])
def test_what_torch_raises_under_the_observer_is_still_the_callers(obs, cuda, pinned):
    # with pinned memory about, a host op goes through the watch's host_op (an H100 run of this
    # suite under --kvz-sanitize blamed the program's own error there on the harness)
    if pinned:
        cuda.pinned(torch.zeros(4))
    try:
        torch.empty(3).view(4)
    except RuntimeError as error:
        verdict = blame(error)
    else:  # pragma: no cover - torch refuses this view
        raise AssertionError("torch accepted view(4) of 3 elements")
    assert not verdict.harness, verdict
    assert verdict.where is not None and "test_sanitizer_observer.py" in verdict.where


def test_stopping_puts_every_patched_function_back(fake):
    before = (torch.Tensor.numpy, torch.Tensor.tolist, torch.cuda.Event.query, torch.cuda.empty_cache)
    observer = Observer(device=fake)
    observer.start()
    assert torch.Tensor.numpy is not before[0]
    torch.cuda.empty_cache()  # the patched call hands on to torch's (a no-op without CUDA)
    observer.stop()
    assert (torch.Tensor.numpy, torch.Tensor.tolist, torch.cuda.Event.query, torch.cuda.empty_cache) == before


def test_a_numpy_view_of_pinned_memory_is_an_ndarray_with_the_same_values(obs, cuda):
    host = cuda.pinned(torch.arange(6, dtype=torch.float32))
    view = host.numpy()
    assert isinstance(view, np.ndarray) and view.tolist() == [0, 1, 2, 3, 4, 5]
    view += 1
    assert host.tolist() == [1, 2, 3, 4, 5, 6] and isinstance(view, np.ndarray)
    assert type(np.asarray(view)) is np.ndarray


def test_torch_compile_never_traces_the_sanitizers_own_frames(fake):
    import torch._dynamo.utils as dynamo_utils

    observer = Observer(device=fake)
    fake.obs = observer
    observer.start()
    try:
        @torch.compile(backend="eager")
        def step(x):
            return (x * 2).sin() + 1

        x = fake.device(torch.ones(8))
        dynamo_utils.counters.clear()
        assert step(x).shape == (8,) and step(x).shape == (8,)
        traced = [name for name in dynamo_utils.counters["frames"] if "sanitizer" in str(name)]
        assert dynamo_utils.counters["frames"].get("total", 0) <= 2, dynamo_utils.counters["frames"]
        assert not traced
    finally:
        observer.stop()


def test_a_thread_knows_what_its_starter_knew_at_start_not_what_it_learned_after(obs, cuda):
    counts = cuda.device(torch.arange(4, dtype=torch.int64))
    host = cuda.pinned(torch.zeros(4, dtype=torch.int64))
    host.copy_(counts, non_blocking=True)
    gate = threading.Lock()
    gate.acquire()

    def read() -> None:
        with gate:  # runs after the starter synchronised, but learns that through a lock only
            host.tolist()

    worker = threading.Thread(target=read)
    worker.start()
    cuda.synchronize()
    gate.release()
    worker.join()
    assert obs.stop() == []
    notes = obs.take_notes()
    assert len(notes) == 1 and "host read" in notes[0]  # said, not silently taken as ordered


def test_a_copy_through_cuda_bindings_it_cannot_place_is_one_line_per_site_and_the_run_partial_never_silent(
        fake, monkeypatch):
    # vLLM's SimpleCPUOffload copies with cuMemcpyBatchAsync through cuda-bindings: on a GPU the
    # observer follows the copies it can place (tests/test_driver_calls_on_gpu.py) and says where
    # the call is made for those it cannot, and for the entry points it does not follow.
    import sys
    import types

    from kvdevice.intercept import driver_copies

    calls = []
    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
    driver.CUdriverProcAddressQueryResult = types.SimpleNamespace(CU_GET_PROC_ADDRESS_SUCCESS=0)
    driver.cuMemcpyAsync = lambda *args: calls.append(args) or (0,)
    driver.cuGetProcAddress = lambda *args: (0, 1234, 0)
    driver.cuDeviceGetCount = lambda: (0, 1)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
    monkeypatch.setitem(driver_copies._REAL, "cuMemcpyBatchAsync", driver_copies.BATCH_TYPE(lambda *a: 0))
    observer = Observer(device=fake)
    observer.start()
    try:
        for _ in range(2):
            driver.cuMemcpyAsync(0x10, 0x20, 16, 0)  # the same line twice: one line
        followed = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
        driver.cuGetProcAddress(b"cuLaunchKernel", 12080, 0)
        driver.cuDeviceGetCount()
    finally:
        observer.stop()
    lines = [u.message() for u in observer.take_unfollowed()]
    assert calls == [(0x10, 0x20, 16, 0)] * 2  # handed on unchanged
    assert followed == (0, driver_copies.address_of("cuMemcpyBatchAsync"), 0)  # the followed pointer
    assert len(lines) == 2 and all(line.startswith("kvz-sanitize cannot follow cuda.bindings.driver.") for line in lines)
    assert "cuMemcpyAsync: destination 0x10 (16 bytes): it is not inside one allocation" in lines[0]
    assert "test_sanitizer_observer.py:" in lines[0]
    assert "cuGetProcAddress('cuLaunchKernel') (the calls through the pointer it returns move bytes no hook sees)" \
        in lines[1]
    assert driver.cuMemcpyAsync.__name__ == "<lambda>"  # put back


def test_the_collectors_threshold_is_raised_while_any_observer_runs_and_put_back_after_the_last():
    import gc

    from sanitizer.gpu.observer import GC_THRESHOLD, _collector_relaxed

    before = gc.get_threshold()
    try:
        _collector_relaxed(True)  # the first observer starts
        _collector_relaxed(True)  # a second one, inside it
        assert gc.get_threshold()[0] == max(before[0], GC_THRESHOLD)
        _collector_relaxed(True)  # the first stops while the second still runs (out of order)
        assert gc.get_threshold()[0] == max(before[0], GC_THRESHOLD)
        _collector_relaxed(False)  # the last one stops
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*before)


def test_the_stand_ins_allocation_lookup_finds_the_storage_holding_a_range_as_allocations_come_and_go():
    # holding() bisects sorted starts (sanitizer.gpu.standin); a freed storage leaves them
    cuda = FakeCuda()
    tensors = [cuda.device(torch.zeros(n, dtype=torch.uint8)) for n in (64, 4096, 16, 256)]
    for t in tensors:
        base = t.untyped_storage().data_ptr()
        end = base + t.numel()
        assert cuda.holding(base, end).ranges == [(base, end)] and cuda.holding(base, end).memory == base
        assert cuda.holding(base + t.numel() // 2, base + t.numel() // 2 + 1).memory == base
        assert cuda.holding(end - 1, end + 1).ranges == [(end - 1, end)]  # the rest is another memory's or none's
    gone = tensors.pop(1).untyped_storage().data_ptr()
    assert cuda.holding(gone, gone + 1) is None


class _Bystander:
    """A thread the program never ran on (a test runner's, a library's), started before the watch,
    that hands something off whenever the test lets it, as pytest-xdist's receiver thread does."""

    def __init__(self) -> None:
        self.go, self.done = threading.Lock(), threading.Lock()  # raw locks: no hook sees them
        self.go.acquire(); self.done.acquire()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        event = threading.Event()
        while True:
            self.go.acquire()
            if self.stopping:
                return
            event.set()  # a hand-off, in a thread no op of the program ran on
            self.done.release()

    def hand_off(self) -> None:
        self.go.release(); self.done.acquire()

    def stop(self) -> None:
        self.stopping = True
        self.go.release()
        self.thread.join()


@pytest.fixture
def bystander():
    helper = _Bystander()
    helper.thread.start()  # before the watch: it is not followed
    yield helper
    helper.stop()


@pytest.fixture
def watched(bystander, obs):
    """The observer, made after the bystander started (so that no hook follows it)."""
    return obs


def test_a_write_no_call_shows_is_placed_in_the_programs_thread_not_a_bystanders(bystander, watched, cuda):
    # CI (xdist 3.8, Python 3.11): xdist's receiver thread set an Event between the write and the
    # synchronisation, and the write was placed at that line of xdist/remote.py.
    import ctypes

    staging = cuda.pinned(torch.zeros(8, dtype=torch.int64))
    ids = cuda.device(torch.zeros(8, dtype=torch.int64))
    ids.copy_(staging, non_blocking=True); copied = here()
    ctypes.memmove(staging.data_ptr(), (ctypes.c_int64 * 1)(9), 8)
    bystander.hand_off()
    cuda.synchronize(); seen = here()
    (race,) = watched.stop()
    assert race.kind == "host-write-vs-pending-copy" and race.queued.site.line == copied
    assert race.later.until is not None and race.later.until.line == seen


def test_a_bystanders_hand_off_makes_no_write_of_its_own_after_the_program_synchronised(bystander, watched, cuda):
    # The program waited for its copy, then rewrote the buffer where no call shows: right. A thread
    # that saw none of it must not be called the writer.
    import ctypes

    staging = cuda.pinned(torch.zeros(8, dtype=torch.int64))
    other = cuda.pinned(torch.zeros(8, dtype=torch.int64))  # a copy of it stays pending throughout
    ids = cuda.device(torch.zeros(8, dtype=torch.int64))
    for step in range(3):
        ids.copy_(staging, non_blocking=True)
        done = cuda.record()
        cuda.synchronize_event(done)
        cuda.device(torch.zeros(8, dtype=torch.int64)).copy_(other, non_blocking=True)
        ctypes.memmove(staging.data_ptr(), (ctypes.c_int64 * 1)(step), 8)
        bystander.hand_off()
    cuda.synchronize()
    assert watched.stop() == []
