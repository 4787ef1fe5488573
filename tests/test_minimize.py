"""The op-level minimizer (fuzz/engine/minimize.py) and the symbolic block ids it works on
(fuzz/engine/handles.py): dropping an allocation drops what used its blocks, and a deadline keeps
the smallest trace so far."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from fuzz.engine import minimize as minimize_module
from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.handles import compact, concrete, merge, symbolic
from fuzz.engine.minimize import minimize
from fuzz.engine.violation import ZeroerViolation

SINGLE = EpisodeConfig(zeroer="single_buffer", kernel="torch")
# A first failing program as Hypothesis generates it: the race needs two zero calls queued behind
# an idle device, and everything else is noise. Block ids shift when allocations go.
NOISY = [
    {"op": "start", "in_flight": 3},
    {"op": "allocate", "n": 3, "stream": 1},  # blocks 1, 2, 3
    {"op": "write", "block": 2, "stream": 2},
    {"op": "free", "block": 3},
    {"op": "delay", "stream": 0, "amount": 4},
    {"op": "allocate", "n": 2, "stream": 2},  # blocks 4, 5: rewrites the staging buffer under the first copy
    {"op": "read", "block": 5, "stream": 0},
    {"op": "free", "block": 2},
]


def violation_of(config: EpisodeConfig, ops: list[dict]) -> ZeroerViolation:
    findings = run_ops(config, ops)
    assert findings, "the program must show a finding"
    return ZeroerViolation(findings, ops, config)


def test_dropping_an_allocation_drops_the_ops_on_its_blocks_and_renumbers_the_rest():
    ops = [{"op": "start"}, {"op": "allocate", "n": 2}, {"op": "allocate", "n": 1}, {"op": "write", "block": 3},
           {"op": "read", "block": 1}, {"op": "free", "block": 2}, {"op": "allocate", "n": 1}]
    refs = symbolic(ops, num_blocks=8)
    assert concrete(refs, num_blocks=8) == ops  # a round trip changes nothing
    assert concrete(refs[:1] + refs[2:], num_blocks=8) == [
        {"op": "start"}, {"op": "allocate", "n": 1}, {"op": "write", "block": 1}, {"op": "allocate", "n": 1}]


def test_a_freed_block_comes_back_last_and_an_allocation_shrinks_to_the_blocks_used():
    ops = [{"op": "start"}, {"op": "allocate", "n": 3}, {"op": "free", "block": 3}, {"op": "allocate", "n": 5},
           {"op": "write", "block": 3}]
    refs = symbolic(ops, num_blocks=8)
    assert concrete(refs, num_blocks=8) == ops  # blocks 4..7, then 3 again from the back of the queue
    assert concrete(compact(refs, 1), num_blocks=8) == [  # the write names the fifth block of the second call
        {"op": "start"}, {"op": "allocate", "n": 1}, {"op": "free", "block": 1}, {"op": "allocate", "n": 5},
        {"op": "write", "block": 6}]
    assert compact(refs, 0) is None  # not an allocation
    assert concrete(refs[:3] + [refs[3]] * 2, num_blocks=8) is None  # asks for more blocks than are free


def test_two_allocations_in_a_row_merge_into_one_call_with_the_same_blocks():
    ops = [{"op": "start"}, {"op": "allocate", "n": 1, "stream": 2}, {"op": "allocate", "n": 3},
           {"op": "free", "block": 1}, {"op": "write", "block": 4}, {"op": "allocate", "n": 4, "stream": 1}]
    refs = symbolic(ops, num_blocks=8)
    assert concrete(merge(refs, 1), num_blocks=8) == [
        {"op": "start"}, {"op": "allocate", "n": 4, "stream": 2}, {"op": "free", "block": 1},
        {"op": "write", "block": 4}, {"op": "allocate", "n": 4, "stream": 1}]
    assert merge(refs, 2) is None and merge(refs, 5) is None  # not followed by an allocation


def test_a_block_moved_to_another_cache_takes_its_ops_with_it():
    ops = [{"op": "start"}, {"op": "allocate", "n": 1, "cache": 1}, {"op": "write", "block": 1, "cache": 1}]
    refs = symbolic(ops, num_blocks=8)
    moved = [refs[0], refs[1].__class__({"op": "allocate", "n": 1}, allocation=1), refs[2]]
    assert concrete(moved, num_blocks=8) == [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "write", "block": 1}]


def test_a_noisy_first_failing_program_minimizes_to_the_two_calls_of_the_race():
    minimized = minimize(violation_of(SINGLE, NOISY))
    assert minimized.violation.trace == [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "allocate", "n": 1}]
    assert minimized.violation.findings[0].kind == "hazard" and not minimized.cut_off


def test_allocations_whose_blocks_later_ops_free_go_with_those_ops():
    # Found on mla_indexer (4 blocks): a device buffer of the zeroer's, dropped without
    # record_stream, reused by the next call's copy on another stream. Each free names a block of an
    # allocation, so dropping one op at a time (ids fixed) could not get below these 6 ops. The ids
    # of a call of 3 and of a call of 1 share a 512-byte block, as on CUDA, so the first two calls
    # show it already.
    config = EpisodeConfig(zeroer="examples/engine_zeroers.py:side_stream_copy_no_record", geometry="mla_indexer")
    ops = [{"op": "start"}, {"op": "allocate", "n": 3}, {"op": "free", "block": 3}, {"op": "allocate", "n": 1},
           {"op": "free", "block": 3}, {"op": "allocate", "n": 1, "stream": 0}]
    minimized = minimize(violation_of(config, ops))
    assert minimized.violation.trace == [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "allocate", "n": 1}]
    assert minimized.violation.findings[0].kind == "hazard"


def test_two_calls_merge_when_one_call_with_their_blocks_shows_the_same():
    # The no-free-fence caller fault: a freed block reused on another stream without waiting for
    # its poison. Hypothesis's shrinker found it with one call of 4 and a free; dropping ops alone
    # stopped at a call of 1 and a call of 3.
    config = EpisodeConfig(caller_fault="no-free-fence")
    ops = [{"op": "start"}, {"op": "allocate", "n": 1, "stream": 0}, {"op": "allocate", "n": 3},
           {"op": "free", "block": 1}, {"op": "allocate", "n": 4, "stream": 1}]
    minimized = minimize(violation_of(config, ops))
    assert minimized.violation.trace == [{"op": "start"}, {"op": "allocate", "n": 4, "stream": 0},
                                         {"op": "free", "block": 1}, {"op": "allocate", "n": 4, "stream": 1}]


def test_minimize_past_its_deadline_keeps_the_smallest_trace_so_far_and_says_it_was_cut_off(monkeypatch):
    violation = violation_of(SINGLE, NOISY)
    assert minimize(violation, deadline=0.0).violation is violation  # time.monotonic() is past 0 already
    clock = itertools.count()  # each replay reads the clock once: allow five
    monkeypatch.setattr(minimize_module, "time", SimpleNamespace(monotonic=lambda: float(next(clock))))
    minimized = minimize(violation, deadline=5.0)
    assert minimized.cut_off and minimized.replays == 5
    kept = minimized.violation
    assert len(kept.trace) < len(NOISY) and run_ops(SINGLE, kept.trace)[0].kind == "hazard"
    assert kept.findings == run_ops(SINGLE, kept.trace)


def test_a_device_sync_right_before_a_poll_becomes_one_polling_sync():
    # examples/engine_offloaders.py's load_unfenced: the store must be reported before its slot is
    # loaded; Hypothesis may get there with sync_device then poll, which is poll(sync=1).
    config = EpisodeConfig(offloader="examples/engine_offloaders.py:load_unfenced", geometry="tiny")
    ops = [{"op": "start"}, {"op": "allocate", "n": 2}, {"op": "store", "block": 2}, {"op": "sync_device"},
           {"op": "poll"}, {"op": "free", "block": 1}, {"op": "load", "slot": 1}]
    minimized = minimize(violation_of(config, ops))
    assert {"op": "sync_device"} not in minimized.violation.trace
    assert [op for op in minimized.violation.trace if op["op"] == "poll"] == [{"op": "poll", "sync": 1}]
    assert len(minimized.violation.trace) == 6


def test_an_offloaders_wait_becomes_the_poll_it_ends_with_where_the_poll_alone_shows_it():
    # examples/engine_offloaders.py's report_without_end_query: a job reported before its copy ran
    # shows at the first poll; a wait (wait for the store, then poll) shows it too, but the wait's own
    # part is not needed. Before the wait could turn into a poll, such a program kept its wait.
    config = EpisodeConfig(offloader="examples/engine_offloaders.py:report_without_end_query", geometry="tiny")
    ops = [{"op": "start"}, {"op": "allocate", "n": 2}, {"op": "store", "block": 1}, {"op": "store", "block": 2},
           {"op": "wait", "slot": 1}]
    minimized = minimize(violation_of(config, ops))
    assert [op["op"] for op in minimized.violation.trace] == ["start", "allocate", "store", "poll"]
    # and a wait the race needs stays: the race-free twin shows nothing either way
    assert run_ops(EpisodeConfig(offloader="examples/engine_offloaders.py:report_after_end_query", geometry="tiny"),
                   ops) == []


def test_an_op_on_a_stores_slot_moves_to_an_earlier_stores_slot_so_that_the_later_store_can_go(monkeypatch):
    # SGLang #36738's race in tests/engine_style's HiCache controller came out of its first failing
    # program as store, store, wait(slot 1), free, load(slot 2): each store named by an op on its
    # slot, so neither could go. A stand-in judge: any program with a store, a wait, a free and a load.
    def shows(config, ops, kind):
        needed = {"store", "wait", "free", "load"} <= {op["op"] for op in ops}
        return [SimpleNamespace(kind=kind)] if needed else None

    monkeypatch.setattr(minimize_module, "_shows", shows)
    config = EpisodeConfig(offloader="examples/engine_offloaders.py:load_waits_forward", geometry="tiny")
    ops = [{"op": "start"}, {"op": "allocate", "n": 2}, {"op": "store", "block": 1}, {"op": "store", "block": 2},
           {"op": "wait", "slot": 1}, {"op": "free", "block": 1}, {"op": "load", "slot": 2}]
    minimized = minimize(ZeroerViolation([SimpleNamespace(kind="hazard")], ops, config))
    assert minimized.violation.trace == [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1},
                                         {"op": "wait", "slot": 1}, {"op": "free", "block": 1}, {"op": "load", "slot": 1}]
