"""What engines and their tests call runs on the sanitizer's simulator as it runs on CUDA.

Each test is a small program in the shape of an engine's own code (vLLM's CPU offload handler and
its unit test, LMCache's transfer path), run in-process with :func:`sanitizer.sim.session.simulate`:
``torch.cuda.cudart()``'s results, ``set_`` onto a storage, ``.cpu()`` under ``torch.inference_mode()``,
and pinned memory recycled by a model of torch's caching host allocator.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from sanitizer.bench.programs import marked_lines
from sanitizer.sim.session import simulate


def simulated(main: Callable[[], Any]) -> tuple[list, Any]:
    """The races of ``main`` on the simulator and what it returned; what it raised is raised."""
    box: list[Any] = []
    races, error, _notes, _ = simulate(lambda: box.append(main()))
    if error is not None:
        raise error
    return races, box[0] if box else None


# -- torch.cuda.cudart() ---------------------------------------------------------------------------
def test_cuda_host_register_answers_cudas_error_enum_read_as_value_int_or_check_error():
    # vLLM's offload handler reads ``.value`` of cudaHostRegister's result; torch binds cudaError_t
    # as a pybind11 enum that also converts to int and compares with 0.
    def main():
        pool = torch.zeros(64, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        result = cudart.cudaHostRegister(pool.data_ptr(), pool.numel(), 0)
        torch.cuda.check_error(result)
        undone = cudart.cudaHostUnregister(pool.data_ptr())
        return (result.value, int(result), result == 0, result == cudart.cudaError.success, repr(result),
                undone.value)

    races, answers = simulated(main)
    assert races == []
    assert answers == (0, 0, True, True, "<cudaError.success: 0>", 0)


# -- set_ onto a storage ---------------------------------------------------------------------------
def test_set_onto_a_device_storage_views_the_same_memory_in_another_shape():
    # vLLM's register_kv_caches: ``torch.empty(0, device=...).set_(storage, offset, size, stride)``.
    @torch.inference_mode()
    def main():
        flat = torch.arange(24.0, device="cuda")
        blocks = torch.empty(0, device="cuda").set_(flat.untyped_storage(), 4, (2, 5), (5, 1))
        whole = torch.tensor([], device="cuda")
        whole.set_(flat.untyped_storage())
        window = torch.empty(0, device="cuda")
        window.set_(flat[2:6])
        blocks.fill_(-1.0)
        return blocks.device, blocks.shape, whole.shape, window.cpu().tolist(), flat.cpu()[2:15].tolist()

    races, (device, shape, whole, window, flat) = simulated(main)
    assert races == []
    assert (str(device), tuple(shape), tuple(whole)) == ("cuda:0", (2, 5), (24,))
    assert window == [2.0, 3.0, -1.0, -1.0]
    assert flat == [2.0, 3.0] + [-1.0] * 10 + [14.0]


def test_a_write_through_a_set_view_is_checked_as_a_write_of_the_storage():
    def main():
        flat = torch.zeros(16, device="cuda")
        view = torch.empty(0, device="cuda").set_(flat.untyped_storage(), 0, (4, 4), (4, 1))
        torch.cuda.synchronize()  # the zeros are written
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            view[1].fill_(1.0)  # unordered with the default stream's read below
        return flat[4:8].sum()

    races, _ = simulated(main)
    assert [race.kind for race in races] == ["unordered-device-access"]


def test_set_onto_a_pinned_storage_reads_and_writes_nothing_under_a_pending_copy():
    def main():
        landing = torch.zeros(8, pin_memory=True)
        landing.copy_(torch.arange(8.0, device="cuda"), non_blocking=True)  # pending: writes landing
        rows = torch.empty(0).set_(landing.untyped_storage(), 0, (2, 4), (4, 1))
        same = torch.empty(0)
        same.set_(landing)
        landing.set_(landing.untyped_storage(), 0, (8,), (1,))
        torch.cuda.synchronize()
        return rows.is_pinned(), rows.data_ptr() == landing.data_ptr(), same.tolist()

    races, (pinned, aliased, values) = simulated(main)
    assert races == []
    assert (pinned, aliased, values) == (True, True, [float(i) for i in range(8)])


# -- .cpu() and .cuda() ----------------------------------------------------------------------------
@pytest.mark.parametrize("move", ["cpu()", "to('cpu')", "to(device='cpu')", "to(torch.device('cpu'))"])
def test_a_device_tensor_moved_to_the_host_under_inference_mode_is_a_cpu_tensor(move):
    # vLLM's offload test is decorated with @torch.inference_mode() and compares ``dst.cpu()`` with
    # ``torch.testing.assert_close``; there the composite ``aten.to`` reaches the simulator whole.
    @torch.inference_mode()
    def main():
        x = torch.arange(6.0, device="cuda").view(2, 3)
        host = eval(f"x[1].{move}")
        back = host.cuda()
        again = host.to("cuda")
        torch.testing.assert_close(host, torch.tensor([3.0, 4.0, 5.0]))
        return str(host.device), str(back.device), str(again.device), back.cpu().tolist()

    races, answers = simulated(main)
    assert races == []
    assert answers == ("cpu", "cuda:0", "cuda:0", [3.0, 4.0, 5.0])


# -- torch's caching host allocator ----------------------------------------------------------------
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lmcache_4830_pinned_temporaries.py"


def test_a_dropped_pinned_temporary_is_handed_to_the_next_pinned_allocation_of_its_size():
    def main():
        first = torch.arange(6.0).pin_memory()
        address = first.data_ptr()
        del first
        second = torch.empty(8, pin_memory=True)  # 24 and 32 bytes: one 32-byte block
        return second.data_ptr() == address, second.is_pinned()

    races, answers = simulated(main)
    assert races == []
    assert answers == (True, True)


def test_a_block_a_non_blocking_copy_used_waits_for_the_copys_stream_before_reuse():
    # Copy.cu records an event on the block for every non-blocking copy: torch's own protection.
    def main():
        device = torch.empty(8, device="cuda")
        staging = torch.arange(8.0, pin_memory=True)
        address = staging.data_ptr()
        device.copy_(staging, non_blocking=True)
        del staging
        while_pending = torch.zeros(8, pin_memory=True).data_ptr()
        torch.cuda.synchronize()
        after_sync = torch.zeros(8, pin_memory=True).data_ptr()
        return while_pending != address, after_sync == address, device.cpu().tolist()

    races, (fresh, reused, values) = simulated(main)
    assert races == []
    assert (fresh, reused, values) == (True, True, [float(i) for i in range(8)])


def test_lmcache_4830_temporaries_read_by_a_kernel_and_dropped_on_return_are_a_race_at_both_lines():
    module = _example()
    races, error, _, _ = simulate(lambda: module.main(steps=3))
    assert isinstance(error, AssertionError)  # the next pin_memory() overwrote what the kernel read
    lines = marked_lines(EXAMPLE)
    found = {(race.kind, race.queued.site.line, race.later.site.line) for race in races}
    assert found == {("host-write-vs-pending-copy", lines["queued"], lines["later"])}
    assert races[0].later.what.startswith("pinned memory handed out again by torch's caching host allocator")
    assert races[0].later.reused and "(LMCache #4830)" in races[0].format()  # the advice for a dropped buffer


@pytest.mark.parametrize("twin", ["fixed", "copy"])
def test_lmcache_4830_twins_synchronizing_or_copying_with_copy_are_clean(twin):
    module = _example()
    races, error, _, _ = simulate(lambda: module.main(steps=3, **{twin: True}))
    assert (races, error) == ([], None)


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("lmcache_4830_pinned_temporaries", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- a host that polls ------------------------------------------------------------------------------
def _poll(done: Callable[[], bool], limit: int = 50) -> int:
    """How many queries ``done`` answered False before True, as a loop with a sleep polls on a GPU."""
    for polls in range(limit):
        if done():
            return polls
    raise AssertionError(f"still not done after {limit} polls")


@pytest.mark.parametrize("query", ["torch.Event", "torch.cuda.Event", "stream"])
def test_a_polled_event_or_stream_completes_as_on_a_gpu_and_orders_the_host_after_it(query):
    # vLLM's offloading handler's get_finished polls its end event until it is done; the simulator
    # runs queued work only at a synchronisation, so a query must be one, or the loop never ends.
    def main():
        stream = torch.cuda.Stream()
        device = torch.arange(8.0, device="cuda")
        host = torch.empty(8, pin_memory=True)
        make = torch.Event if query == "torch.Event" else torch.cuda.Event
        start, end = make(enable_timing=True), make(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            start.record(stream)
            host.copy_(device, non_blocking=True)
            end.record(stream)
        polls = _poll(stream.query if query == "stream" else end.query)
        return polls, start.elapsed_time(end) >= 0, host.tolist()  # the host saw the copy land

    races, (polls, timed, values) = simulated(main)
    assert races == []
    assert (polls, timed, values) == (1, True, [float(i) for i in range(8)])


def test_a_host_read_after_a_query_that_answered_false_is_still_a_race():
    def main():
        stream = torch.cuda.Stream()
        device = torch.arange(8.0, device="cuda")
        host = torch.zeros(8, pin_memory=True)
        end = torch.cuda.Event()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(device, non_blocking=True)
            end.record(stream)
        not_yet = end.query()
        return not_yet, host.tolist()  # read before the copy was seen to land

    races, (not_yet, values) = simulated(main)
    assert not_yet is False and values == [0.0] * 8
    assert [race.kind for race in races] == ["host-read-vs-pending-copy"]


@pytest.mark.parametrize("waited", ["synchronize", "query", "none"])
def test_a_transfer_timed_before_its_end_event_was_seen_complete_is_a_race_named_by_the_end_record(waited):
    # An offload handler's get_finished that reports a job and times it with elapsed_time before its
    # end event answered True: CUDA answers cudaErrorNotReady or the time, by timing. The simulator
    # runs the copy only at a synchronisation, so the call raises here, after the race is reported.
    def main():
        stream = torch.cuda.Stream()
        device = torch.arange(8.0, device="cuda")
        host = torch.empty(8, pin_memory=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            start.record(stream)
            host.copy_(device, non_blocking=True)
            end.record(stream)  # the end's record
        if waited == "synchronize":
            end.synchronize()
        elif waited == "query":
            _poll(end.query)
        return start.elapsed_time(end)  # the read

    races, error, _, _ = simulate(main)
    if waited == "none":
        assert [race.kind for race in races] == ["host-read-vs-pending-event"]
        assert "Both events must be completed" in str(error)
        (race,) = races
        lines = inspect.getsource(main).splitlines()
        first = main.__code__.co_firstlineno
        assert lines[race.queued.site.line - first].strip().startswith("end.record(stream)")
        assert lines[race.later.site.line - first].strip().startswith("return start.elapsed_time(end)")
    else:
        assert races == [] and error is None


def test_a_start_event_on_a_stream_the_end_does_not_cover_is_the_one_the_race_names():
    # The host saw the end complete, but the start was recorded on a stream the end's never waited
    # for: its time is still pending. The race says which of the two events it is.
    def main():
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(a):
            start.record()  # the start's record
        with torch.cuda.stream(b):
            end.record()
        end.synchronize()
        return start.elapsed_time(end)

    races, _, _, _ = simulate(main)
    (race,) = races
    lines = inspect.getsource(main).splitlines()
    assert race.kind == "host-read-vs-pending-event"
    assert lines[race.queued.site.line - main.__code__.co_firstlineno].strip().startswith("start.record()")
    assert "the start event's time" in race.format() and "the end event's time" not in race.format()


def test_a_race_on_device_memory_names_the_line_that_allocated_it():
    def main():
        side = torch.cuda.Stream()
        kv = torch.ones(64, device="cuda")  # the allocation
        with torch.cuda.stream(side):
            kv.mul_(2)  # no wait for the default stream's write

    races, error, _, _ = simulate(main)
    assert error is None and [race.kind for race in races] == ["unordered-device-access"]
    lines = inspect.getsource(main).splitlines()
    allocated = races[0].allocated_at
    assert allocated is not None, races[0].format()
    assert lines[allocated.line - main.__code__.co_firstlineno].strip().startswith("kv = torch.ones")
    assert "allocated outside the sanitizer's view" not in races[0].format()


def test_a_reuse_names_the_allocation_that_reused_the_block_not_a_later_one():
    """Races are collected after the program went on: the block may have been handed out again by
    then, and the report named its latest allocation's line, not the one of the reuse."""
    def main():
        side, current = torch.cuda.Stream(), torch.cuda.current_stream()
        acc = torch.zeros(128, device="cuda")
        side.wait_stream(current)
        for step in range(3):
            with torch.cuda.stream(side):
                staged = torch.full((128,), float(step), device="cuda")  # the reuse
            current.wait_stream(side)
            acc.add_(staged)
            del staged  # no record_stream(current)
        with torch.cuda.stream(side):
            torch.empty(128, device="cuda").fill_(9.0)  # a later allocation of the block
        torch.cuda.synchronize()

    races, error, _, _ = simulate(main)
    assert error is None
    lines = inspect.getsource(main).splitlines()
    first = next(r for r in races if r.kind == "reuse-without-record-stream")
    assert "torch.full" in first.resource, first.format()
    assert first.allocated_at is not None, first.format()
    assert "torch.full(" in lines[first.allocated_at.line - main.__code__.co_firstlineno], first.format()


SYNCHRONISING_READS = {
    "item": lambda y: y.sum().item() if y.dim() else y.item(),
    "tolist": lambda y: y.tolist(),
    "cpu": lambda y: y.cpu(),
    "float": lambda y: float(y.sum()) if y.dim() else float(y),
    "nonzero": lambda y: torch.nonzero(y),
    "blocking-copy-over-it": lambda y: y.copy_(torch.zeros_like(y, device="cpu")),
}


@pytest.mark.parametrize("waits", [False, True], ids=["no-wait", "waits"])
@pytest.mark.parametrize("read", sorted(SYNCHRONISING_READS))
def test_a_synchronising_op_on_memory_another_stream_wrote_is_checked(read, waits):
    """``.item()``, ``.tolist()``, a blocking copy...: the host waits for the current stream only, so
    what a side stream wrote without an event between them is a race. The checker found these and the
    report dropped them (the synchronising op had no access on its label): no race, exit 0, the value
    read wrong."""
    def main():
        side = torch.cuda.Stream()
        x = torch.ones(16, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2  # written on the side stream
        if waits:
            torch.cuda.current_stream().wait_stream(side)
        SYNCHRONISING_READS[read](y)

    races, error, _, _ = simulate(main)
    assert error is None
    assert [race.kind for race in races] == ([] if waits else ["unordered-device-access"]), races
    if races:
        assert races[0].later.site is not None and races[0].later.site.function == "<lambda>", races[0].format()


def test_a_host_mirror_made_like_a_device_tensor_is_host_memory_and_reads_nothing():
    """``torch.empty_like(gpu_t, device="cpu", pin_memory=True)`` (a host mirror, as engines make
    them): the simulator made a device tensor, unpinned, and read the source's bytes, a race with
    the side stream that wrote them."""
    def main():
        side = torch.cuda.Stream()
        x = torch.ones(16, device="cuda").view(4, 4).t()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x * 2  # written on the side stream, never waited for
        mirror = torch.empty_like(y, device="cpu", pin_memory=True)
        zeros = torch.zeros_like(y, device=torch.device("cpu"), dtype=torch.float64)
        return mirror, zeros, y

    seen = []
    races, error, _, _ = simulate(lambda: seen.append(main()))
    assert error is None and races == [], races
    mirror, zeros, y = seen[0]
    assert mirror.device.type == "cpu" and mirror.stride() == y.stride()
    assert zeros.device.type == "cpu" and zeros.dtype == torch.float64 and not zeros.any()


# -- work the program leaves queued ----------------------------------------------------------------
@pytest.mark.parametrize("write", ["index_put", "index_copy"])
def test_an_indexed_write_left_queued_at_the_end_is_checked_against_the_other_streams(write):
    # A side stream told to wait for the main stream before the main stream's KV write was queued:
    # its index_select of the same rows is unordered with that write. The program waits only for
    # the side stream, so on the simulator the write never ran, and an indexed op says its rows only
    # when it runs: the end runs what is queued (on a GPU it runs after the last line anyway).
    def main(ordered: bool):
        main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
        kv = torch.zeros(32, 16, device="cuda")
        ids = [3, 9, 17]
        if ordered:
            kv[ids] = 1.0
            side.wait_stream(main_stream)
        else:
            side.wait_stream(main_stream)
            if write == "index_put":
                kv[ids] = 1.0
            else:
                kv.index_copy_(0, torch.tensor(ids, device="cuda"), torch.ones(3, 16, device="cuda"))
        with torch.cuda.stream(side):
            staged = kv.index_select(0, torch.tensor(ids, device="cuda"))
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        return staged

    races, error, notes, _ = simulate(lambda: main(ordered=False))
    assert error is None and [race.kind for race in races] == ["unordered-device-access"], [r.format() for r in races]
    races, error, notes, _ = simulate(lambda: main(ordered=True))
    assert error is None and races == [] and notes == []


def test_a_queued_op_of_the_program_that_fails_after_its_end_is_said_never_raised_as_ours():
    # On a GPU an out-of-range index in a kernel nobody waited for is an asynchronous CUDA error of
    # the program's; running it at the end must not turn it into an internal error of the sanitizer.
    def main():
        kv = torch.zeros(4, device="cuda")
        kv[torch.tensor([10], device="cuda")] = 1.0

    races, error, notes, _ = simulate(main)
    assert error is None and races == []
    assert len(notes) == 1 and "left queued failed" in notes[0] and "IndexError" in notes[0], notes
