"""The simulator's semantics: lazy FIFO streams, copies that read at execution, events, waits,
the caching host allocator's reuse rule, and deadlock reports."""

from __future__ import annotations

import random

import pytest
import torch

from zeroer.errors import DeadlockError, RuntimeUsageError
from kvdevice.runtime import EagerSchedule, RandomSchedule, SimRuntime, make_runtime


def staged(rt: SimRuntime, value: int):
    host, dev = rt.host_buffer(1), rt.device_buffer(1)
    rt.write_host(host, [value])
    return host, dev


def test_a_copy_reads_its_host_source_when_the_stream_executes_it():
    rt = SimRuntime()
    host, dev = staged(rt, 1)
    rt.copy_h2d(dev, host)
    rt.write_host(host, [2])
    rt.advance(rt.default_stream, 1)
    assert dev.tensor.tolist() == [2]


def test_nothing_runs_until_the_schedule_or_a_sync_says_so():
    rt = SimRuntime()
    ran = []
    rt.launch(lambda: ran.append(1))
    assert ran == [] and rt.pending(rt.default_stream) == 1
    rt.synchronize()
    assert ran == [1] and rt.pending(rt.default_stream) == 0


def test_advance_runs_at_most_k_ops_in_fifo_order():
    rt = SimRuntime()
    ran = []
    for i in range(3):
        rt.launch(lambda i=i: ran.append(i))
    assert rt.advance(rt.default_stream, 2) == 2
    assert ran == [0, 1]
    assert rt.advance(rt.default_stream, 5) == 1
    assert ran == [0, 1, 2]


def test_wait_event_holds_a_stream_until_the_event_ran():
    rt = SimRuntime()
    side = rt.new_stream("side")
    ran = []
    rt.launch(lambda: ran.append("main"))
    event = rt.record_event()
    rt.wait_event(event, stream=side)
    rt.launch(lambda: ran.append("side"), stream=side)
    assert rt.advance(side, 5) == 0  # blocked at the wait
    assert not rt.query_event(event)
    rt.advance(rt.default_stream, 2)
    assert rt.query_event(event)
    assert rt.advance(side, 5) == 2
    assert ran == ["main", "side"]


def test_advance_through_runs_the_least_work_a_wait_needs_first_and_stops_at_a_hold():
    # fuzz.engine.offload's advance_own: an offloader's stream waits on the caller's; run part-way,
    # the caller's stream gets only as far as that wait needs, then the offloader's takes its steps.
    rt = SimRuntime()
    side = rt.new_stream("side")
    ran = []
    rt.launch(lambda: ran.append("main 1"))
    event = rt.record_event()
    rt.launch(lambda: ran.append("main 2"))
    rt.wait_event(event, stream=side)
    rt.launch(lambda: ran.append("side 1"), stream=side)
    rt.launch(lambda: ran.append("side 2"), stream=side)
    assert rt.advance_through(side, 2) == 2  # the wait and the first launch
    assert ran == ["main 1", "side 1"] and rt.pending(rt.default_stream) == 1
    hold = rt.hold(rt.default_stream)
    after = rt.record_event()
    rt.wait_event(after, stream=side)
    assert rt.advance_through(side, 5) == 1  # side 2, then the wait behind the held stream
    # the work before the hold ran; the wait behind it stays queued
    assert ran == ["main 1", "side 1", "side 2", "main 2"] and rt.pending(side) == 1
    rt.release(hold)
    assert rt.advance_through(side, 5) == 1 and rt.pending(side) == 0


def test_an_event_never_recorded_counts_as_complete_as_in_cuda():
    rt = SimRuntime()
    event = rt.new_event()
    assert rt.query_event(event)
    rt.wait_event(event)  # a no-op wait
    assert rt.advance(rt.default_stream, 1) == 1


def test_host_sync_runs_only_the_work_it_needs():
    rt = SimRuntime()
    side = rt.new_stream("side")
    ran = []
    rt.launch(lambda: ran.append("a1"))
    event = rt.record_event()
    rt.launch(lambda: ran.append("a2"))
    rt.wait_event(event, stream=side)
    rt.launch(lambda: ran.append("b1"), stream=side)
    done = rt.record_event(stream=side)
    rt.synchronize_event(done)
    assert ran == ["a1", "b1"]  # a2 was not needed
    assert rt.pending(rt.default_stream) == 1


def test_a_delay_holds_a_stream_for_that_many_steps():
    rt = SimRuntime()
    ran = []
    rt.delay(rt.default_stream, 3)
    rt.launch(lambda: ran.append(1))
    assert rt.advance(rt.default_stream, 3) == 3 and ran == []
    assert rt.advance(rt.default_stream, 1) == 1 and ran == [1]


def test_the_caching_host_allocator_keeps_a_block_until_its_copy_completed():
    rt = SimRuntime()
    host, dev = staged(rt, 7)
    rt.copy_h2d(dev, host)
    rt.free_host(host)
    again = rt.host_buffer(1)
    assert again.block != host.block  # copy still pending: not reused
    rt.synchronize()
    rt.free_host(again)
    third = rt.host_buffer(1)
    assert third.block in (host.block, again.block)
    assert dev.tensor.tolist() == [7]
    assert rt.hazards == []


def test_unprotected_pinned_memory_is_reused_while_its_copy_is_pending():
    rt = SimRuntime()
    host = rt.host_buffer(1, protected=False)
    dev = rt.device_buffer(1)
    rt.write_host(host, [7])
    rt.copy_h2d(dev, host)
    rt.free_host(host)
    again = rt.host_buffer(1, protected=False)
    assert again.block == host.block
    rt.write_host(again, [8])
    rt.synchronize()
    assert dev.tensor.tolist() == [8]  # the from_blob / cudaHostRegister hazard
    assert [h.kind for h in rt.hazards] == ["host-write-vs-pending-copy"]


def test_a_sync_behind_an_unreleased_hold_is_reported_as_a_deadlock():
    rt = SimRuntime()
    side = rt.new_stream("side")
    rt.hold(side)
    rt.launch(lambda: None, stream=side)
    with pytest.raises(DeadlockError, match=r"^deadlock: the host waits for op 2 of stream 'side', which can never run\n  stream 'side': hold#\d+ on stream 'side' is held"):
        rt.synchronize_stream(side)


def test_a_released_hold_lets_the_stream_run():
    rt = SimRuntime()
    ran = []
    hold = rt.hold()
    rt.launch(lambda: ran.append(1))
    assert rt.advance(rt.default_stream, 5) == 0
    rt.release(hold)
    rt.synchronize()
    assert ran == [1]


def test_the_eager_schedule_leaves_the_device_never_behind():
    rt = SimRuntime(schedule=EagerSchedule())
    host, dev = staged(rt, 1)
    rt.copy_h2d(dev, host)
    rt.write_host(host, [2])
    assert dev.tensor.tolist() == [1]


def test_a_random_schedule_is_reproducible_from_its_seed():
    def run(seed: int) -> list[int]:
        rt = SimRuntime(schedule=RandomSchedule(random.Random(seed)))
        side = rt.new_stream("side")
        order: list[int] = []
        for i in range(20):
            rt.launch(lambda i=i: order.append(i), stream=side if i % 2 else None)
        rt.synchronize()
        return order

    assert run(3) == run(3)
    assert sorted(run(3)) == list(range(20))


def test_make_runtime_rejects_unknown_backends_and_modes():
    with pytest.raises(RuntimeUsageError, match=r"^unknown backend 'gpu'; choose one of auto, cuda, sim$"):
        make_runtime("gpu")
    assert make_runtime("sim").backend == "sim"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_the_cuda_backend_without_a_gpu_says_to_use_the_simulator():
    with pytest.raises(RuntimeUsageError, match=r"^backend 'cuda' needs a CUDA GPU .*use backend 'sim'"):
        make_runtime("cuda")


def test_bad_runtime_arguments_name_the_value():
    rt = SimRuntime()
    with pytest.raises(RuntimeUsageError, match=r"^stream name 'main' is already taken"):
        rt.new_stream("main")
    with pytest.raises(RuntimeUsageError, match=r"^stream 5 does not exist: this runtime has 1 streams \(valid: 0\.\.0\)"):
        rt.stream(5)
    with pytest.raises(RuntimeUsageError, match=r"^advance by -1 ops: expected a non-negative int$"):
        rt.advance(rt.default_stream, -1)
    with pytest.raises(RuntimeUsageError, match=r"^delay amount 0 must be a positive int"):
        rt.delay(rt.default_stream, 0)
    host, dev = rt.host_buffer(2), rt.device_buffer(1)
    with pytest.raises(RuntimeUsageError, match=r"^copy of 2 elements does not fit: source has 2, destination 1$"):
        rt.copy_h2d(dev, host)
    with pytest.raises(RuntimeUsageError, match=r"^writing 3 values at offset 0 overflows pinned host buffer \d+ of 2 elements$"):
        rt.write_host(host, [1, 2, 3])
    rt.free_host(host)
    with pytest.raises(RuntimeUsageError, match=r"^pinned host buffer \d+ was already freed$"):
        rt.free_host(host)
    other = SimRuntime()
    with pytest.raises(RuntimeUsageError, match=r"^Stream\('x'\) is not a stream of this sim runtime"):
        rt.launch(lambda: None, stream=other.new_stream("x"))


def test_annotations_nest_and_name_the_origin_of_every_op_enqueued_inside():
    rt = SimRuntime()
    with rt.annotate("zero_block_ids#1"):
        first = rt.launch(lambda: None, name="copy")
        with rt.annotate("inner"):
            second = rt.launch(lambda: None, name="kernel")
        third = rt.launch(lambda: None, name="kernel")
    fourth = rt.launch(lambda: None, name="kernel")
    assert first.label == "copy#1 on stream 'main' (zero_block_ids#1)"
    assert second.label == "kernel#2 on stream 'main' (inner)"
    assert third.label == "kernel#3 on stream 'main' (zero_block_ids#1)"
    assert fourth.label == "kernel#4 on stream 'main'"


def test_use_stream_makes_a_stream_current_and_restores_the_previous_one_even_on_error():
    rt = SimRuntime()
    side = rt.new_stream("side")
    with rt.use_stream(side) as current:
        assert current is side and rt.current_stream() is side
        with rt.use_stream(rt.default_stream):
            assert rt.current_stream() is rt.default_stream
        assert rt.launch(lambda: None).thread == side.thread
    with pytest.raises(ZeroDivisionError), rt.use_stream(side):
        1 / 0
    assert rt.current_stream() is rt.default_stream
    with pytest.raises(RuntimeUsageError, match=r"^Stream\('x'\) is not a stream of this sim runtime"):
        rt.use_stream(SimRuntime().new_stream("x"))
