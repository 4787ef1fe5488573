"""racecheck.shadow: the last write and the reads since, per byte range of one resource.

Two accesses conflict when they touch a common byte, at least one writes, they come from
different threads and neither happens before the other. An access declared late (after accesses
that happen after it) must neither raise a false conflict nor replace the state it precedes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from racecheck.clocks import Clocks, OpStamp, ordered
from racecheck.shadow import WHOLE, RangeShadow, overlaps


def streams(*names: str) -> tuple[Clocks, list[int]]:
    clocks = Clocks()
    return clocks, [clocks.add(name) for name in names]


def met(conflicts: list[tuple[OpStamp, str, int, int]]) -> list[tuple[str, str, int, int]]:
    """Conflicts with the other access by label, for comparing."""
    return [(other.label, verb, lo, hi) for other, verb, lo, hi in conflicts]


# -- bytes ----------------------------------------------------------------------------------------

def test_the_docstring_example_holds():
    clocks, (a, b, c) = streams("a", "b", "c")
    shadow = RangeShadow()
    assert shadow.access([(0, 64)], clocks.tick(a, "stamp_a"), write=True) == []
    assert shadow.access([(64, 128)], clocks.tick(b, "stamp_b"), write=True) == []
    found = shadow.access(None, clocks.tick(c, "stamp_c"), write=False)
    assert met(found) == [("stamp_a", "writes", 0, 64), ("stamp_b", "writes", 64, 128)]


def test_writes_to_adjacent_byte_runs_do_not_conflict():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access([(0, 64)], clocks.tick(a, "left"), write=True)
    assert shadow.access([(64, 128)], clocks.tick(b, "right"), write=True) == []


def test_writes_that_share_one_byte_conflict_on_the_bytes_they_share():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access([(0, 64)], clocks.tick(a, "left"), write=True)
    assert met(shadow.access([(63, 128)], clocks.tick(b, "right"), write=True)) == [("left", "writes", 63, 64)]


def test_a_conflict_is_reported_once_per_other_access_at_the_first_bytes_met():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    first = clocks.tick(a, "rows")
    shadow.access([(0, 8), (16, 24), (32, 40)], first, write=True)
    found = shadow.access([(4, 36)], clocks.tick(b, "span"), write=False)
    assert len(found) == 1
    other, verb, lo, hi = found[0]
    assert other is first
    assert (verb, lo, hi) == ("writes", 4, 8)


def test_runs_that_miss_every_earlier_access_do_not_conflict():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access([(0, 8), (32, 40)], clocks.tick(a, "rows"), write=True)
    assert shadow.access([(8, 32), (40, 64)], clocks.tick(b, "others"), write=True) == []


def test_empty_runs_in_a_list_are_skipped():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access([(0, 8)], clocks.tick(a, "w"), write=True)
    assert shadow.access([(4, 4), (8, 2), (8, 16)], clocks.tick(b, "w2"), write=True) == []


def test_an_access_to_no_bytes_conflicts_with_nothing():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access([(0, 8)], clocks.tick(a, "w"), write=True)
    assert shadow.access([], clocks.tick(b, "empty copy"), write=True) == []


def test_none_means_the_whole_resource():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access([(WHOLE[1] - 8, WHOLE[1])], clocks.tick(a, "last bytes"), write=True)
    assert met(shadow.access(None, clocks.tick(b, "all"), write=False)) == [
        ("last bytes", "writes", WHOLE[1] - 8, WHOLE[1])]


# -- reads and writes -----------------------------------------------------------------------------

def test_reads_from_two_streams_never_conflict():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access(None, clocks.tick(a, "r1"), write=False)
    assert shadow.access(None, clocks.tick(b, "r2"), write=False) == []


def test_a_read_after_an_unordered_write_conflicts_with_the_write():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access(None, clocks.tick(a, "zero"), write=True)
    assert met(shadow.access(None, clocks.tick(b, "gather"), write=False)) == [("zero", "writes", 0, WHOLE[1])]


def test_a_write_after_an_unordered_read_conflicts_with_the_read():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access(None, clocks.tick(a, "gather"), write=False)
    assert met(shadow.access(None, clocks.tick(b, "zero"), write=True)) == [("gather", "reads", 0, WHOLE[1])]


def test_a_write_conflicts_with_every_unordered_read_since_the_last_write():
    clocks, (a, b, c, d) = streams("a", "b", "c", "d")
    shadow = RangeShadow()
    shadow.access(None, clocks.tick(a, "ra"), write=False)
    shadow.access(None, clocks.tick(b, "rb"), write=False)
    shadow.access(None, clocks.tick(c, "rc"), write=False)
    clocks.join(d, clocks.snapshot(b))  # d waited for b's read
    found = shadow.access(None, clocks.tick(d, "w"), write=True)
    assert sorted(label for label, *_ in met(found)) == ["ra", "rc"]
    assert all(verb == "reads" for _, verb, *_ in met(found))


def test_a_thread_keeps_only_its_latest_read():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access(None, clocks.tick(a, "r1"), write=False)
    shadow.access(None, clocks.tick(a, "r2"), write=False)
    assert met(shadow.access(None, clocks.tick(b, "w"), write=True)) == [("r2", "reads", 0, WHOLE[1])]


def test_accesses_from_one_stream_never_conflict():
    clocks, (a,) = streams("a")
    shadow = RangeShadow()
    for i in range(3):
        assert shadow.access([(0, 64)], clocks.tick(a, f"w{i}"), write=True) == []
        assert shadow.access([(32, 96)], clocks.tick(a, f"r{i}"), write=False) == []


def test_one_op_reading_and_writing_the_same_bytes_does_not_conflict_with_itself():
    clocks, (a,) = streams("a")
    shadow = RangeShadow()
    stamp = clocks.tick(a, "index_add_")
    assert shadow.access(None, stamp, write=False) == []
    assert shadow.access(None, stamp, write=True) == []
    assert shadow.access(None, stamp, write=False) == []


def test_an_event_wait_orders_a_write_after_a_read_on_another_stream():
    clocks, (a, b) = streams("a", "b")
    shadow = RangeShadow()
    shadow.access(None, clocks.tick(a, "w1"), write=True)
    shadow.access(None, clocks.tick(a, "r"), write=False)
    clocks.join(b, clocks.snapshot(a))
    assert shadow.access(None, clocks.tick(b, "w2"), write=True) == []


def test_a_write_ordered_after_the_last_write_forgets_the_reads_it_follows():
    clocks, (a, b, c) = streams("a", "b", "c")
    shadow = RangeShadow()
    shadow.access(None, clocks.tick(a, "w1"), write=True)
    clocks.join(b, clocks.snapshot(a))
    shadow.access(None, clocks.tick(b, "r"), write=False)
    clocks.join(a, clocks.snapshot(b))
    shadow.access(None, clocks.tick(a, "w2"), write=True)
    clocks.join(c, clocks.snapshot(a))
    assert shadow.access(None, clocks.tick(c, "w3"), write=True) == []


# -- declared late --------------------------------------------------------------------------------

def test_a_write_declared_late_that_happens_before_the_last_write_is_not_a_conflict():
    clocks, (a, b) = streams("a", "b")
    early = clocks.tick(a, "early write")
    clocks.join(b, clocks.snapshot(a))
    late = clocks.tick(b, "later write")
    shadow = RangeShadow()
    assert shadow.access(None, late, write=True) == []
    assert shadow.access(None, early, write=True) == []


def test_a_write_declared_late_does_not_replace_the_write_it_happens_before():
    clocks, (a, b, c) = streams("a", "b", "c")
    early = clocks.tick(a, "early write")
    clocks.join(b, clocks.snapshot(a))
    later = clocks.tick(b, "later write")
    clocks.join(c, clocks.snapshot(a))  # c is ordered after the early write only
    reader = clocks.tick(c, "reader")
    shadow = RangeShadow()
    shadow.access(None, later, write=True)
    shadow.access(None, early, write=True)
    assert met(shadow.access(None, reader, write=False)) == [("later write", "writes", 0, WHOLE[1])]


def test_a_read_declared_late_that_happens_before_the_last_write_is_not_a_conflict():
    clocks, (a, b) = streams("a", "b")
    read = clocks.tick(a, "gather")
    clocks.join(b, clocks.snapshot(a))
    write = clocks.tick(b, "zero")
    shadow = RangeShadow()
    shadow.access(None, write, write=True)
    assert shadow.access(None, read, write=False) == []
    assert len(shadow) == 1


def test_a_write_declared_late_still_conflicts_with_an_unordered_read_since_the_last_write():
    clocks, (a, b, c) = streams("a", "b", "c")
    early = clocks.tick(a, "early write")
    clocks.join(b, clocks.snapshot(a))
    later = clocks.tick(b, "later write")
    stray = clocks.tick(c, "stray read")  # ordered with neither write
    shadow = RangeShadow()
    shadow.access(None, later, write=True)
    assert met(shadow.access(None, stray, write=False)) == [("later write", "writes", 0, WHOLE[1])]
    assert met(shadow.access(None, early, write=True)) == [("stray read", "reads", 0, WHOLE[1])]


def test_a_late_access_that_changes_nothing_leaves_one_segment():
    clocks, (a, b) = streams("a", "b")
    early = clocks.tick(a, "early")
    clocks.join(b, clocks.snapshot(a))
    shadow = RangeShadow()
    shadow.access(None, clocks.tick(b, "later"), write=True)
    shadow.access([(16, 32)], early, write=True)
    shadow.access([(48, 64)], early, write=False)
    assert len(shadow) == 1


# -- order of declaration -------------------------------------------------------------------------

@dataclass(frozen=True)
class Access:
    name: str
    stamp: OpStamp
    ranges: list[tuple[int, int]] | None
    write: bool


def scenario_event_chain() -> list[Access]:
    """Race free: a write, two readers ordered by events, a rewrite ordered after both reads."""
    clocks, (a, b, c) = streams("a", "b", "c")
    w1 = clocks.tick(a, "w1")
    clocks.join(b, clocks.snapshot(a))
    clocks.join(c, clocks.snapshot(a))
    rb, rc = clocks.tick(b, "rb"), clocks.tick(c, "rc")
    clocks.join(a, clocks.snapshot(b))
    clocks.join(a, clocks.snapshot(c))
    w2 = clocks.tick(a, "w2")
    return [Access("w1", w1, None, True), Access("rb", rb, [(0, 32)], False),
            Access("rc", rc, [(16, 64)], False), Access("w2", w2, [(0, 64)], True)]


def scenario_one_stray_read() -> list[Access]:
    """One race: a read on a stream that waited for nothing meets the first write's bytes."""
    clocks, (a, b, c) = streams("a", "b", "c")
    w = clocks.tick(a, "w")
    clocks.join(b, clocks.snapshot(a))
    r = clocks.tick(b, "r")
    w_other = clocks.tick(c, "w_other")
    stray = clocks.tick(c, "stray")
    return [Access("w", w, [(0, 64)], True), Access("r", r, [(0, 64)], False),
            Access("w_other", w_other, [(64, 128)], True), Access("stray", stray, [(32, 96)], False)]


def scenario_rows_on_two_streams() -> list[Access]:
    """Rows of one tensor: two streams write their own rows and one shared row; a gather ordered
    after one of them reads every row."""
    clocks, (a, b, c) = streams("a", "b", "c")
    wa = clocks.tick(a, "wa")
    wb = clocks.tick(b, "wb")
    clocks.join(c, clocks.snapshot(a))
    gather = clocks.tick(c, "gather")
    return [Access("wa", wa, [(0, 16), (32, 48)], True), Access("wb", wb, [(16, 32), (48, 64)], True),
            Access("gather", gather, [(0, 64)], False)]


SCENARIOS = {"event chain": (scenario_event_chain, set()),
             "one stray read": (scenario_one_stray_read, {frozenset({"w", "stray"})}),
             "rows on two streams": (scenario_rows_on_two_streams, {frozenset({"wb", "gather"})})}


def before(x: Access, y: Access) -> bool:
    return x.stamp is not y.stamp and ordered(x.stamp, y.stamp.vc)


def linear_extension(order: tuple[Access, ...]) -> bool:
    return not any(before(later, earlier) for i, earlier in enumerate(order) for later in order[i + 1:])


def declare(order: tuple[Access, ...]) -> set[frozenset[str]]:
    shadow = RangeShadow()
    names = {id(x.stamp): x.name for x in order}
    found = set()
    for access in order:
        for other, _, _, _ in shadow.access(access.ranges, access.stamp, write=access.write):
            found.add(frozenset({names[id(other)], access.name}))
    return found


def a_race(x: Access, y: Access) -> bool:
    return (x.stamp.thread != y.stamp.thread and (x.write or y.write) and overlaps(x.ranges, y.ranges)
            and not before(x, y) and not before(y, x))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_linear_extension_finds_the_same_conflicts(name):
    make, expected = SCENARIOS[name]
    accesses = make()
    orders = [order for order in itertools.permutations(accesses) if linear_extension(order)]
    assert len(orders) > 1
    for order in orders:
        assert declare(order) == expected, [a.name for a in order]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_order_of_declaration_reports_a_conflict_between_ordered_accesses(name):
    make, _ = SCENARIOS[name]
    accesses = make()
    by_name = {a.name: a for a in accesses}
    for order in itertools.permutations(accesses):
        for pair in declare(order):
            x, y = (by_name[n] for n in sorted(pair))
            assert a_race(x, y), ([a.name for a in order], sorted(pair))


def test_the_scenarios_expected_conflicts_are_exactly_their_races():
    for name, (make, expected) in sorted(SCENARIOS.items()):
        accesses = make()
        races = {frozenset({x.name, y.name}) for x, y in itertools.combinations(accesses, 2) if a_race(x, y)}
        assert races == expected, name


def two_unordered_writes_then_a_reader() -> list[Access]:
    clocks, (a, b, c) = streams("a", "b", "c")
    w1, w2 = clocks.tick(a, "w1"), clocks.tick(b, "w2")
    clocks.join(c, clocks.snapshot(a))
    return [Access("w1", w1, None, True), Access("w2", w2, None, True), Access("r", clocks.tick(c, "r"), None, False)]


def test_every_linear_extension_agrees_that_there_is_a_race():
    accesses = two_unordered_writes_then_a_reader()
    for order in itertools.permutations(accesses):
        if linear_extension(order):
            assert frozenset({"w1", "w2"}) in declare(order)


@pytest.mark.xfail(strict=True, reason="one last write is kept per segment (FastTrack): after the unordered "
                   "writes w1, w2 declared as w2, w1, the reader r (ordered after w1 only) meets w1 and never "
                   "sees its race with w2; declared as w1, w2 it does")
def test_every_linear_extension_finds_the_same_conflicts_after_a_write_write_race():
    accesses = two_unordered_writes_then_a_reader()
    found = {tuple(a.name for a in order): declare(order)
             for order in itertools.permutations(accesses) if linear_extension(order)}
    assert len(set(map(frozenset, found.values()))) == 1, found


@pytest.mark.xfail(strict=True, reason="the module says the verdict does not depend on the order of "
                   "declaration, but a write w1 declared before a read r that happens before it drops the "
                   "earlier write w0 (which r races with), so r declared last finds nothing")
def test_a_race_is_found_whatever_the_order_of_declaration():
    clocks, (a, b) = streams("a", "b")
    w0 = clocks.tick(a, "w0")
    r = clocks.tick(b, "r")  # unordered with w0: the race
    clocks.join(b, clocks.snapshot(a))
    w1 = clocks.tick(b, "w1")  # after both
    shadow = RangeShadow()
    shadow.access(None, w0, write=True)
    shadow.access(None, w1, write=True)
    assert met(shadow.access(None, r, write=False)) != []


@st.composite
def programs(draw) -> list[Access]:
    """Up to six accesses on three streams, each maybe after a wait on another stream's event, each
    to a run of a 32-byte resource (or all of it)."""
    clocks, threads = streams("a", "b", "c")
    accesses = []
    for i in range(draw(st.integers(1, 6))):
        stream = draw(st.sampled_from(threads))
        waits_on = draw(st.sampled_from([None, *threads]))
        if waits_on is not None and waits_on != stream:
            clocks.join(stream, clocks.snapshot(waits_on))
        if draw(st.booleans()):
            clocks.host_join(0, clocks.snapshot(draw(st.sampled_from(threads))))  # a host sync
        start = draw(st.integers(0, 31))
        ranges = draw(st.sampled_from([None, [(start, draw(st.integers(start + 1, 32)))]]))
        accesses.append(Access(f"op{i}", clocks.tick(stream, f"op{i}"), ranges, draw(st.booleans())))
    return accesses


@settings(derandomize=True, database=None, deadline=None, max_examples=300)
@given(st.data())
def test_any_order_reports_only_races_and_a_linear_one_finds_one_when_there_is_one(data):
    accesses = data.draw(programs(), label="program")
    order = tuple(data.draw(st.permutations(accesses), label="order"))
    found = declare(order)
    by_name = {a.name: a for a in accesses}
    for pair in found:
        x, y = (by_name[n] for n in sorted(pair))
        assert a_race(x, y), sorted(pair)
    races = any(a_race(x, y) for x, y in itertools.combinations(accesses, 2))
    assert bool(declare(tuple(accesses))) == races  # enqueue order is a linear extension
    if linear_extension(order):
        assert bool(found) == races


# -- segments -------------------------------------------------------------------------------------

def test_a_resource_written_whole_stays_one_segment():
    clocks, (a, b, c) = streams("a", "b", "c")
    shadow = RangeShadow()
    assert len(shadow) == 1
    for i in range(4):
        for stream in (a, b, c):
            shadow.access(None, clocks.tick(stream, f"w{i}"), write=True)
            shadow.access(None, clocks.tick(stream, f"r{i}"), write=False)
            assert len(shadow) == 1


def test_a_partial_access_splits_the_resource_at_its_edges():
    clocks, (a,) = streams("a")
    shadow = RangeShadow()
    shadow.access([(16, 32)], clocks.tick(a, "row"), write=True)
    assert len(shadow) == 3
    assert shadow.starts == [0, 16, 32]


def test_one_access_over_several_segments_with_one_state_merges_them():
    clocks, (a,) = streams("a")
    shadow = RangeShadow()
    stamp = clocks.tick(a, "rows")
    shadow.access([(0, 16), (16, 32), (32, 48)], stamp, write=True)
    assert shadow.starts == [0, 48]


def test_a_partial_access_at_the_start_splits_once():
    clocks, (a,) = streams("a")
    shadow = RangeShadow()
    shadow.access([(0, 16)], clocks.tick(a, "first row"), write=True)
    assert shadow.starts == [0, 16]


# -- overlaps --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("a", "b", "expected"), [
    (None, None, True),
    (None, [(0, 1)], True),
    ([(0, 1)], None, True),
    ([(0, 8)], [(8, 16)], False),
    ([(0, 8)], [(7, 16)], True),
    ([(0, 8), (16, 24)], [(8, 16)], False),
    ([(0, 8), (16, 24)], [(8, 17)], True),
    ([(4, 6)], [(0, 100)], True),
    ([], [(0, 8)], False),
    ([(0, 8)], [], False),
])
def test_overlaps_says_whether_two_sets_of_runs_share_a_byte(a, b, expected):
    assert overlaps(a, b) is expected


def test_no_bytes_meet_the_whole_resource():
    assert overlaps(None, []) is False


def test_overlapping_runs_in_one_access_keep_each_segments_own_history():
    for _ in range(20):  # the mix-up needs CPython to hand a freed state's address to a new one
        clocks, (a, b, c) = streams("a", "b", "c")
        shadow = RangeShadow()
        shadow.access([(0, 10)], clocks.tick(a, "wa"), write=True)
        shadow.access([(10, 20)], clocks.tick(b, "wb"), write=True)
        shadow.access([(0, 10), (10, 20), (10, 20)], clocks.tick(c, "r"), write=False)
        found = shadow.access([(10, 20)], clocks.tick(b, "wb2"), write=True)
        assert met(found) == [("r", "reads", 10, 20)]
