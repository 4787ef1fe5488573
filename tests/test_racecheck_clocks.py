"""racecheck.clocks: vector clocks for host threads and streams, and who has learned what.

Enqueueing orders a stream's work after what the enqueueing host thread knows; events carry a
stream's clock to the streams that wait on them; a host thread learns only by observing a
completion or through a hand-off from another host thread; ``union`` is what some host thread saw."""

from __future__ import annotations

from racecheck.clocks import HOST, Clocks, OpStamp, ordered


def test_a_new_clock_space_has_only_the_host_thread_knowing_nothing():
    clocks = Clocks()
    assert clocks.names[HOST] == "host" and clocks.names == ["host"]
    assert clocks.hosts == [HOST]
    assert clocks.vc(HOST) == [0]
    assert clocks.union == [0]
    assert not clocks.several_hosts


def test_adding_a_stream_widens_every_clock_and_is_not_a_host_thread():
    clocks = Clocks()
    side = clocks.add("side")
    assert side == 1
    assert clocks.names == ["host", "side"]
    assert clocks.hosts == [HOST]
    assert clocks.vc(HOST) == [0, 0]
    assert clocks.vc(side) == [0, 0]
    assert clocks.union == [0, 0]
    assert not clocks.several_hosts


def test_adding_a_host_thread_registers_it_as_a_host():
    clocks = Clocks()
    clocks.add("side")
    worker = clocks.add("worker", host=True)
    assert clocks.hosts == [HOST, worker]
    assert clocks.several_hosts
    assert clocks.vc(worker) == [0, 0, 0]


def test_a_tick_stamps_the_ops_position_on_its_stream():
    clocks = Clocks()
    side = clocks.add("side")
    first = clocks.tick(side, "copy#1")
    second = clocks.tick(side, "copy#2")
    assert first == OpStamp(thread=side, clock=1, vc=(0, 1), label="copy#1", seq=1)
    assert second == OpStamp(thread=side, clock=2, vc=(0, 2), label="copy#2", seq=2)
    assert ordered(first, second.vc)
    assert not ordered(second, first.vc)


def test_enqueueing_does_not_teach_the_host_anything():
    clocks = Clocks()
    side = clocks.add("side")
    stamp = clocks.tick(side, "copy#1")
    assert clocks.vc(HOST) == [0, 0]
    assert not ordered(stamp, clocks.vc(HOST))


def test_the_docstring_example_holds():
    clocks = Clocks()
    side = clocks.add("side")
    stamp = clocks.tick(side, "copy#1")
    assert not ordered(stamp, clocks.vc(HOST))
    clocks.host_join(HOST, clocks.snapshot(side))
    assert ordered(stamp, clocks.vc(HOST))


def test_enqueueing_orders_the_op_after_everything_the_enqueueing_host_has_observed():
    clocks = Clocks()
    a, b = clocks.add("a"), clocks.add("b")
    on_a = clocks.tick(a, "kernel on a")
    before = clocks.tick(b, "kernel on b before the host saw a")
    clocks.host_join(HOST, clocks.snapshot(a))
    after = clocks.tick(b, "kernel on b after the host saw a")
    assert not ordered(on_a, before.vc)
    assert ordered(on_a, after.vc)


def test_enqueueing_from_a_host_thread_orders_only_after_what_that_thread_knows():
    clocks = Clocks()
    a, b = clocks.add("a"), clocks.add("b")
    worker = clocks.add("worker", host=True)
    on_a = clocks.tick(a, "kernel on a")
    clocks.host_join(HOST, clocks.snapshot(a))  # the main thread saw it, the worker did not
    from_worker = clocks.tick(b, "kernel on b", host=worker)
    from_main = clocks.tick(b, "kernel on b", host=HOST)
    assert not ordered(on_a, from_worker.vc)
    assert ordered(on_a, from_main.vc)


def test_an_event_carries_the_clock_its_stream_had_when_it_was_recorded():
    clocks = Clocks()
    a, b = clocks.add("a"), clocks.add("b")
    early = clocks.tick(a, "early")
    event = clocks.snapshot(a)
    late = clocks.tick(a, "late")
    clocks.join(b, event)
    waiter = clocks.tick(b, "after the wait")
    assert ordered(early, waiter.vc)
    assert not ordered(late, waiter.vc)


def test_waiting_on_an_event_never_recorded_orders_nothing():
    clocks = Clocks()
    a, b = clocks.add("a"), clocks.add("b")
    on_a = clocks.tick(a, "on a")
    clocks.join(b, None)
    clocks.host_join(HOST, None)
    assert clocks.vc(b) == [0, 0, 0]
    assert not ordered(on_a, clocks.tick(b, "on b").vc)
    assert clocks.vc(HOST) == [0, 0, 0]


def test_a_stream_waiting_on_an_event_teaches_no_host_thread():
    clocks = Clocks()
    a, b = clocks.add("a"), clocks.add("b")
    on_a = clocks.tick(a, "on a")
    clocks.join(b, clocks.snapshot(a))
    assert not ordered(on_a, clocks.vc(HOST))
    assert clocks.union == [0, 0, 0]


def test_event_ordering_is_transitive_across_streams():
    clocks = Clocks()
    a, b, c = clocks.add("a"), clocks.add("b"), clocks.add("c")
    on_a = clocks.tick(a, "on a")
    clocks.join(b, clocks.snapshot(a))
    clocks.tick(b, "on b")
    clocks.join(c, clocks.snapshot(b))
    assert ordered(on_a, clocks.tick(c, "on c").vc)


def test_a_host_thread_learns_only_what_it_observes_itself():
    clocks = Clocks()
    side = clocks.add("side")
    worker = clocks.add("worker", host=True)
    stamp = clocks.tick(side, "copy#1")
    clocks.host_join(worker, clocks.snapshot(side))
    assert ordered(stamp, clocks.vc(worker))
    assert not ordered(stamp, clocks.vc(HOST))


def test_a_hand_off_carries_what_the_sender_knew_when_it_was_made():
    clocks = Clocks()
    side = clocks.add("side")
    worker = clocks.add("worker", host=True)
    first = clocks.tick(side, "copy#1")
    clocks.host_join(worker, clocks.snapshot(side))
    hand_off = clocks.snapshot(worker)
    second = clocks.tick(side, "copy#2")
    clocks.host_join(worker, clocks.snapshot(side))  # after the hand-off was made
    clocks.host_join(HOST, hand_off)
    assert ordered(first, clocks.vc(HOST))
    assert not ordered(second, clocks.vc(HOST))


def test_a_host_snapshot_is_a_copy_not_a_live_view():
    clocks = Clocks()
    side = clocks.add("side")
    before = clocks.snapshot(HOST)
    clocks.tick(side, "copy#1")
    clocks.host_join(HOST, clocks.snapshot(side))
    assert before == (0, 0)
    assert isinstance(before, tuple)
    assert clocks.snapshot(side) == (0, 1)


def test_a_forked_host_thread_knows_what_its_parent_knew():
    clocks = Clocks()
    side = clocks.add("side")
    seen = clocks.tick(side, "copy#1")
    clocks.host_join(HOST, clocks.snapshot(side))
    child = clocks.fork(HOST, "worker")
    assert child in clocks.hosts
    assert clocks.names[child] == "worker"
    assert ordered(seen, clocks.vc(child))


def test_a_forked_host_thread_does_not_learn_what_its_parent_observes_later():
    clocks = Clocks()
    side = clocks.add("side")
    child = clocks.fork(HOST, "worker")
    later = clocks.tick(side, "copy#1")
    clocks.host_join(HOST, clocks.snapshot(side))
    assert ordered(later, clocks.vc(HOST))
    assert not ordered(later, clocks.vc(child))


def test_union_is_what_some_host_thread_saw():
    clocks = Clocks()
    a, b = clocks.add("a"), clocks.add("b")
    worker = clocks.add("worker", host=True)
    on_a = clocks.tick(a, "on a")
    on_b = clocks.tick(b, "on b")
    assert not ordered(on_a, clocks.union)
    clocks.host_join(worker, clocks.snapshot(a))
    assert ordered(on_a, clocks.union)
    assert not ordered(on_b, clocks.union)
    clocks.host_join(HOST, clocks.snapshot(b))
    assert ordered(on_b, clocks.union)
    assert clocks.union == [max(column) for column in zip(*(clocks.vc(h) for h in clocks.hosts))]


def test_union_ignores_what_only_streams_learned():
    clocks = Clocks()
    a, b = clocks.add("a"), clocks.add("b")
    on_a = clocks.tick(a, "on a")
    clocks.join(b, clocks.snapshot(a))
    clocks.tick(b, "on b")
    assert not ordered(on_a, clocks.union)


def test_ordered_compares_the_earlier_ops_own_entry_only():
    stamp = OpStamp(thread=1, clock=3, vc=(0, 3, 9), label="op")
    assert ordered(stamp, (0, 3))
    assert ordered(stamp, [0, 4, 0])
    assert not ordered(stamp, (9, 2, 9))


def test_ordered_is_false_for_a_clock_older_than_the_ops_thread():
    # A clock snapshotted before the op's stream existed cannot know about it.
    stamp = OpStamp(thread=2, clock=1, vc=(0, 0, 1), label="op")
    assert not ordered(stamp, (5, 5))
    assert not ordered(stamp, ())


def test_an_old_snapshot_can_be_joined_after_new_threads_were_added():
    clocks = Clocks()
    a = clocks.add("a")
    on_a = clocks.tick(a, "on a")
    old = clocks.snapshot(a)
    b = clocks.add("b")
    clocks.join(b, old)
    clocks.host_join(HOST, old)
    assert ordered(on_a, clocks.tick(b, "on b").vc)
    assert ordered(on_a, clocks.vc(HOST))
    assert clocks.union == [0, 1, 0]
