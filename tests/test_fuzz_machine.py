"""The state machine's rules, driven by hand (no Hypothesis run): each rule is one op, and a
happens-before hazard stops the program at the op that caused it."""

from __future__ import annotations

import pytest

from fuzz.episode import EpisodeConfig
from fuzz.machine import ZeroerViolation, machine_for


def test_a_hazard_is_raised_by_the_op_that_caused_it_not_at_the_end():
    machine = machine_for(EpisodeConfig(zeroer="single_buffer", kernel="torch"))()
    machine.start(in_flight=1)
    machine.allocate_blocks(n=1, stream=0)
    first_line = r"^1 finding\(s\) for zeroer 'single_buffer' on tiny \(sim\)\n  - hazard at step 3: host write "
    with pytest.raises(ZeroerViolation, match=first_line):
        machine.allocate_blocks(n=1, stream=0)  # rewrites the staging buffer the first copy still reads
    assert [op["op"] for op in machine.episode.trace] == ["start", "allocate", "allocate"]
    assert machine.episode.finished  # closed at once; teardown has nothing left to check
    assert type(machine).last_failure.trace == machine.episode.trace


def test_a_clean_program_runs_every_rule_and_checks_the_values_at_teardown():
    machine = machine_for(EpisodeConfig(zeroer="reference"))()
    machine.start(in_flight=2)
    (block,) = machine.allocate_blocks(n=1, stream=0).values
    machine.write_block(block=block, stream=1)
    machine.read_block(block=block, stream=2)
    machine.advance_stream(stream=1, ops=4)
    machine.delay_stream(stream=2, amount=3)
    machine.end_step()
    machine.synchronize_stream(stream=0)
    machine.reallocate_cache()
    machine.free_block(block=block)
    machine.synchronize_device()
    machine.teardown()
    assert [op["op"] for op in machine.episode.trace] == [
        "start", "allocate", "write", "read", "advance", "delay", "end_step", "sync_stream", "reallocate", "free",
        "sync_device",
    ]
    assert machine.episode.finished and machine.episode.findings == []


def test_a_campaign_hands_the_objects_it_froze_back_to_the_garbage_collector(tmp_path):
    import gc

    from fuzz.campaigns import PROFILES, Campaign, run_campaign

    result = run_campaign(Campaign(EpisodeConfig(zeroer="single_buffer", kernel="torch"), expect="finds"),
                          PROFILES["quick"], tmp_path)
    assert result.found and gc.get_freeze_count() == 0
