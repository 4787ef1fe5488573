"""The device-generic ``torch.Event`` and ``torch.Stream`` under the GPU observer, on the CUDA stand-in.

vLLM's offloading handler times each transfer with ``torch.Event(enable_timing=True)`` from a pool
and reports it finished once ``end_event.query()`` answers True; its unit test then reads the
pinned buffer, and the next test's ``torch.rand`` takes the freed device memory. torch traces no
query, and both types are C types that refuse ``setattr``: on an H100 the sanitizer called that
race-free test racy 61 times (``host-read-vs-pending-copy``, ``reuse-without-record-stream``). A True
answer is the host seeing the work complete, for every instance of the types, whoever made it and
whenever; an event the observer never saw recorded stands for no work it knows. The stand-in's
``torch.Event`` (tests/fake_cuda.py, ``generic_types``) records through the observer's trace
handlers, since a CPU build of torch cannot record one; ``query`` is torch's C method, as the
observer wrapped it. The same programs on a GPU with ``torch.Event`` itself.
"""

from __future__ import annotations

import pytest
import torch

from fake_cuda import FakeCuda, RealCuda, kinds, observing
from sanitizer.gpu import c_methods
from sanitizer.gpu.observer import Observer


@pytest.fixture(params=["fake", "cuda"])
def cuda(request):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a GPU")
        return RealCuda()
    return FakeCuda()


@pytest.fixture
def obs(cuda):
    with cuda.generic_types(), observing(cuda) as observer:
        yield observer


def poll(done) -> None:
    """The handler's ``get_finished``: ask until the transfer's event (or stream) answers True."""
    while not done.query():
        pass


@pytest.mark.parametrize("polled", [True, False], ids=["polled", "not-polled"])
def test_a_host_read_after_polling_a_generic_event_to_completion_is_clean(obs, cuda, polled):
    kv = cuda.device(torch.arange(8, dtype=torch.float32))
    cpu = cuda.pinned(torch.zeros(8))
    side = cuda.new_stream()
    cuda.wait(cuda.record(), side)  # the store starts after the forward (vLLM #46278)
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record(side)
    with cuda.stream(side):
        cpu.copy_(kv, non_blocking=True)
    end.record(side)
    if polled:
        poll(end)
    cpu.sum()  # the unit test's check of the stored block
    races = obs.stop()
    assert kinds(races) == ([] if polled else ["host-read-vs-pending-copy"]), races


@pytest.mark.parametrize("polled", [True, False], ids=["polled", "not-polled"])
def test_elapsed_time_reads_the_events_times_and_its_answer_is_the_host_seeing_them(obs, cuda, polled):
    # CUDA answers elapsed_time only once both events have completed (cudaErrorNotReady before; its
    # manual says to poll with cudaEventQuery): timing a transfer whose end the host has not seen
    # complete is the race, whether or not this GPU had finished. An answer is the host seeing both,
    # so the host read of the stored block after it is clean either way.
    kv = cuda.device(torch.arange(8, dtype=torch.float32))
    cpu = cuda.pinned(torch.zeros(8))
    side = cuda.new_stream()
    cuda.wait(cuda.record(), side)
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record(side)
    with cuda.stream(side):
        cpu.copy_(kv, non_blocking=True)
    end.record(side)
    if polled:
        poll(end)
    try:
        assert start.elapsed_time(end) >= 0
    except RuntimeError:  # not ready yet (a GPU, not polled)
        assert not polled
        end.synchronize()
    cpu.sum()
    races = obs.stop()
    assert kinds(races) == ([] if polled else ["host-read-vs-pending-event"]), races
    if not polled:
        assert races[0].queued.site.line < races[0].later.site.line  # the end's record, then the read


@pytest.mark.parametrize("polled", [True, False], ids=["polled", "not-polled"])
def test_a_host_read_after_polling_a_generic_stream_to_completion_is_clean(obs, cuda, polled):
    kv = cuda.device(torch.arange(8, dtype=torch.float32))
    cpu = cuda.pinned(torch.zeros(8))
    side = torch.Stream()
    ready = torch.Event()  # the generic event the generic stream's wait_event takes
    ready.record()
    side.wait_event(ready)
    with cuda.stream(side):
        cpu.copy_(kv, non_blocking=True)
    if polled:
        poll(side)
    cpu.sum()
    races = obs.stop()
    assert kinds(races) == ([] if polled else ["host-read-vs-pending-copy"]), races


@pytest.mark.parametrize("polled", [True, False], ids=["polled", "not-polled"])
def test_memory_a_side_stream_read_is_reused_cleanly_once_its_event_was_polled(polled):
    # The allocator hands a freed block to the next request on the stream that freed it without
    # waiting for other streams: the next test's torch.rand writes it while the store may still read.
    cuda = FakeCuda()
    with cuda.generic_types():
        obs = Observer(device=cuda)
        cuda.obs = obs
        obs.start()
        try:
            block = torch.arange(8, dtype=torch.float32)
            kv = cuda.allocate(block)
            cpu = cuda.pinned(torch.zeros(8))
            side = cuda.new_stream()
            cuda.wait(cuda.record(), side)
            end = torch.Event(enable_timing=True)
            with cuda.stream(side):
                cpu.copy_(kv, non_blocking=True)
            end.record(side)
            if polled:
                poll(end)
            del kv  # freed with no record_stream: the handler's test ends
            again = cuda.allocate(block)  # the same block, handed to the next test's torch.rand
            again.uniform_()
        finally:
            races = obs.stop()
    assert kinds(races) == ([] if polled else ["reuse-without-record-stream"]), races


def test_an_event_made_and_bound_before_the_observer_started_is_followed():
    # An engine's module may run `from torch import Event`, and make its pool, before the sanitizer starts.
    cuda = FakeCuda()
    with cuda.generic_types():
        Event = torch.Event
        pooled = Event(enable_timing=True)
        obs = Observer(device=cuda)
        cuda.obs = obs
        obs.start()
        try:
            kv = cuda.device(torch.arange(8, dtype=torch.float32))
            cpu = cuda.pinned(torch.zeros(8))
            cpu.copy_(kv, non_blocking=True)
            pooled.record()
            poll(pooled)
            fresh = Event()
            fresh.record()
            poll(fresh)
            cpu.sum()
        finally:
            races = obs.stop()
    assert races == []


def test_a_true_answer_of_an_event_the_observer_never_saw_recorded_orders_nothing():
    # Recorded before the start: what it covers is not the work queued since, so the read is reported.
    cuda = FakeCuda()
    with cuda.generic_types():
        early = torch.Event()
        early.record()  # no observer yet
        obs = Observer(device=cuda)
        cuda.obs = obs
        obs.start()
        try:
            kv = cuda.device(torch.arange(8, dtype=torch.float32))
            cpu = cuda.pinned(torch.zeros(8))
            cpu.copy_(kv, non_blocking=True)
            never = torch.Event()  # never recorded: torch answers True, for no work
            poll(early)
            poll(never)
            cpu.sum()
        finally:
            races = obs.stop()
    assert kinds(races) == ["host-read-vs-pending-copy"]


def test_the_generic_types_methods_are_wrapped_while_the_observer_runs_and_torchs_own_after():
    names = ((torch._C.Event, "query"), (torch._C.Event, "elapsed_time"), (torch._C.Stream, "query"))
    before = [vars(owner)[name] for owner, name in names]
    obs = Observer(device=FakeCuda())
    obs.start()
    try:
        assert all(vars(owner)[name] is not was for (owner, name), was in zip(names, before))
        assert torch._C.Event().query() is True  # handed on to torch's: a CPU event never recorded
        assert torch._C.Stream().query() is True
    finally:
        obs.stop()
    assert [vars(owner)[name] for owner, name in names] == before
    assert torch._C.Event().query() is True and obs.notes == []


def test_a_c_types_method_is_replaced_for_every_instance_and_put_back():
    made_before = torch._C.Event()
    original = torch._C.Event.query
    undo = c_methods.replace(torch._C.Event, "query", lambda self: "wrapped")
    try:
        assert made_before.query() == "wrapped" and torch._C.Event().query() == "wrapped"
    finally:
        undo()
    assert torch._C.Event.query is original and made_before.query() is True
    with pytest.raises(TypeError, match="immutable type|cannot set"):
        torch._C.Event.query = original  # what setattr does, hence the namespace


def test_where_a_c_types_method_cannot_be_wrapped_the_run_says_so_in_a_note(monkeypatch):
    def unreachable(owner):
        raise TypeError(f"cannot reach the namespace of {owner.__qualname__}")

    monkeypatch.setattr(c_methods, "_namespace", unreachable)
    obs = Observer(device=FakeCuda())
    obs.start()
    obs.stop()
    notes = obs.take_notes()
    assert ("kvz-sanitize cannot wrap torch.Event.query on this Python (cannot reach the namespace of Event): a True "
            "answer does not count as the host seeing the work complete") in notes[0]
    assert [note.split(" on this Python")[0] for note in notes] == [
        "kvz-sanitize cannot wrap torch.Event.query", "kvz-sanitize cannot wrap torch.Stream.query",
        "kvz-sanitize cannot wrap torch.Event.elapsed_time"]
