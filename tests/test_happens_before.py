"""The happens-before checker: host writes against pending copies, and unordered device accesses.

Its verdict depends only on the program (enqueue order, events, syncs the host observed), never on
when the simulated or real device ran the work."""

from __future__ import annotations

from kvdevice.runtime import EagerSchedule, SimRuntime
from racecheck.hb import HappensBefore


def copy_then_rewrite(rt: SimRuntime, between=lambda rt, event: None) -> list:
    host, dev = rt.host_buffer(1), rt.device_buffer(1)
    rt.write_host(host, [1])
    rt.copy_h2d(dev, host)
    event = rt.record_event()
    between(rt, event)
    rt.write_host(host, [2])
    return rt.hazards


def test_a_host_write_to_a_buffer_a_queued_copy_reads_is_flagged():
    hazards = copy_then_rewrite(SimRuntime())
    assert [h.kind for h in hazards] == ["host-write-vs-pending-copy"]
    assert "copy#" in hazards[0].message and "vLLM #48085" in hazards[0].message


def test_the_flag_does_not_depend_on_timing_the_copy_already_ran():
    # The eager schedule runs the copy before the rewrite: values are right, the race is not.
    rt = SimRuntime(schedule=EagerSchedule())
    assert [h.kind for h in copy_then_rewrite(rt)] == ["host-write-vs-pending-copy"]


def test_a_host_that_synchronised_on_the_copy_may_rewrite():
    assert copy_then_rewrite(SimRuntime(), lambda rt, e: rt.synchronize_event(e)) == []


def test_a_successful_event_query_orders_the_rewrite():
    def query_after_running(rt, event):
        rt.advance(rt.default_stream, 5)
        assert rt.query_event(event)

    assert copy_then_rewrite(SimRuntime(), query_after_running) == []


def test_a_failed_event_query_orders_nothing():
    assert len(copy_then_rewrite(SimRuntime(), lambda rt, e: rt.query_event(e))) == 1


def test_device_accesses_from_two_streams_without_an_event_are_flagged():
    rt = SimRuntime()
    side = rt.new_stream("side")
    rt.launch(lambda: None, name="zero", blocks_written=[3])
    rt.launch(lambda: None, name="write", stream=side, blocks_written=[3])
    (hazard,) = rt.hazards
    assert hazard.kind == "unordered-device-access"
    assert hazard.message.startswith("block 3: zero#")
    assert "no event path between stream 'main' and stream 'side'" in hazard.message


def test_an_event_wait_orders_device_accesses():
    rt = SimRuntime()
    side = rt.new_stream("side")
    rt.launch(lambda: None, name="zero", blocks_written=[3])
    rt.wait_event(rt.record_event(), stream=side)
    rt.launch(lambda: None, name="write", stream=side, blocks_written=[3])
    rt.launch(lambda: None, name="read", stream=side, blocks_read=[3])
    assert rt.hazards == []


def test_a_wait_on_an_event_recorded_too_early_does_not_order_later_work():
    rt = SimRuntime()
    side = rt.new_stream("side")
    early = rt.record_event()
    rt.launch(lambda: None, name="zero", blocks_written=[3])
    rt.wait_event(early, stream=side)
    rt.launch(lambda: None, name="read", stream=side, blocks_read=[3])
    assert [h.kind for h in rt.hazards] == ["unordered-device-access"]


def test_reads_from_two_streams_do_not_conflict_but_a_later_write_does():
    rt = SimRuntime()
    side = rt.new_stream("side")
    rt.launch(lambda: None, name="read_a", blocks_read=[1])
    rt.launch(lambda: None, name="read_b", stream=side, blocks_read=[1])
    assert rt.hazards == []
    rt.launch(lambda: None, name="write_b", stream=side, blocks_written=[1])
    (hazard,) = rt.hazards
    assert "read_a#" in hazard.first and "write_b#" in hazard.second


def test_order_through_the_host_a_sync_then_enqueue_is_ordered():
    rt = SimRuntime()
    side = rt.new_stream("side")
    rt.launch(lambda: None, name="zero", blocks_written=[3])
    rt.synchronize_stream(rt.default_stream)
    rt.launch(lambda: None, name="write", stream=side, blocks_written=[3])
    assert rt.hazards == []


def test_the_checker_alone_vector_clocks_are_transitive():
    hb = HappensBefore()
    a, b, c = hb.add_stream("a"), hb.add_stream("b"), hb.add_stream("c")
    first = hb.enqueue(a, "op_a")
    hb.device_access(("block", 1), first, write=True)
    hb.enqueue(a, "record_a")
    snap_a = hb.snapshot(a)
    hb.enqueue(b, "wait_b")
    hb.stream_waits(b, snap_a)
    hb.enqueue(b, "record_b")
    snap_b = hb.snapshot(b)
    hb.enqueue(c, "wait_c")
    hb.stream_waits(c, snap_b)
    last = hb.enqueue(c, "op_c")
    hb.device_access(("block", 1), last, write=True)
    assert hb.hazards == []
