"""The state machine's rules, driven by hand (no Hypothesis run): each rule is one op, and a
happens-before hazard stops the program at the op that caused it."""

from __future__ import annotations

import pytest

from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.machine import machine_for
from fuzz.engine.violation import ZeroerViolation


def test_a_hazard_is_raised_by_the_op_that_caused_it_not_at_the_end():
    machine = machine_for(EpisodeConfig(zeroer="single_buffer", kernel="torch"), "single_buffer")()
    machine.start(in_flight=1, disabled=frozenset())
    machine.allocate_blocks(n=1, stream=0)
    first_line = r"^1 finding\(s\) for zeroer 'single_buffer' on tiny \(sim\)\n  - hazard at step 3: host write "
    with pytest.raises(ZeroerViolation, match=first_line):
        machine.allocate_blocks(n=1, stream=0)  # rewrites the staging buffer the first copy still reads
    assert [op["op"] for op in machine.episode.trace] == ["start", "allocate", "allocate"]
    assert machine.episode.finished  # closed at once; teardown has nothing left to check


def test_a_clean_program_runs_every_rule_and_checks_the_values_at_teardown():
    machine = machine_for(EpisodeConfig(zeroer="reference"), "reference")()
    machine.start(in_flight=2, disabled=frozenset())
    (block,) = machine.allocate_blocks(n=1, stream=0).values
    machine.write_block(block=block, stream=1)
    machine.read_block(block=block, stream=2)
    machine.advance_stream(stream=1, ops=4)
    machine.delay_stream(stream=2, amount=3)
    machine.end_step()
    machine.synchronize_stream(stream=0)
    machine.reallocate_cache(cache=0)
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

    from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign

    result = run_campaign(Campaign(EpisodeConfig(zeroer="single_buffer", kernel="torch"), expect="finds"),
                          PROFILES["quick"], tmp_path)
    assert result.found and gc.get_freeze_count() == 0



def test_a_finding_hypothesis_calls_flaky_is_kept_with_its_program(tmp_path, monkeypatch):
    # A timing-dependent race on the free-running GPU may show once and not when Hypothesis
    # replays it; Hypothesis then raises FlakyFailure around the original error. That is still a
    # finding, kept with the program that showed it, not an error that loses the trace.
    import fuzz.engine.campaigns as campaigns
    from fuzz.engine.summary import render_summary, result_record
    from hypothesis.errors import FlakyFailure

    config = EpisodeConfig(zeroer="reference")
    original = ZeroerViolation([], [{"op": "start", "in_flight": 1}], config)

    def flaky_run(machine, settings):
        raise FlakyFailure("did not fail on replay", [original])

    monkeypatch.setattr(campaigns, "run_state_machine_as_test", flaky_run)
    result = campaigns.run_campaign(campaigns.Campaign(config, expect="clean"), campaigns.PROFILES["quick"],
                                    tmp_path)
    assert result.found and not result.reproduced and result.violation is original
    assert result.trace_path is not None and result.trace_path.exists()
    text, data = render_summary([result_record(result)], "quick")
    assert "VIOLATION (did not show again on replay: timing-dependent)" in text
    assert data["campaigns"][0]["reproduced"] is False

    # A Flaky error with no finding inside is Hypothesis's own problem: it is not swallowed.
    def other_flaky(machine, settings):
        raise FlakyFailure("something else", [ValueError("not ours")])

    monkeypatch.setattr(campaigns, "run_state_machine_as_test", other_flaky)
    with pytest.raises(FlakyFailure):
        campaigns.run_campaign(campaigns.Campaign(config, expect="clean"), campaigns.PROFILES["quick"], tmp_path)


def test_a_free_running_gpu_campaign_polls_after_waiting_for_the_device_so_it_draws_the_same_way():
    """Free-running on a GPU, which jobs a poll hears of is the GPU's timing; the next rules drawn
    follow from it (Hypothesis's FlakyStrategyDefinition on the H100), so the caller syncs first."""
    from types import SimpleNamespace

    from fuzz.engine.episode import EpisodeConfig
    from fuzz.engine.offload_rules import OffloadPart

    # own: the offloader's streams run part-way first (those with work queued: the first and the
    # third here), only where the poll does not wait for the device anyway
    own = [{"op": "advance_own", "stream": 0, "ops": 2}, {"op": "advance_own", "stream": 2, "ops": 2}]
    for backend, mode, drawn, ran, expect in [("cuda", "free", False, 2, [{"op": "poll", "sync": 1}]),
                                              ("cuda", "controlled", False, 0, [{"op": "poll"}]),
                                              ("sim", "controlled", False, 0, [{"op": "poll"}]),
                                              ("sim", "controlled", False, 2, [*own, {"op": "poll"}]),
                                              ("cuda", "controlled", False, 2, [*own, {"op": "poll"}]),
                                              ("cuda", "controlled", True, 2, [{"op": "poll", "sync": 1}])]:
        applied = []
        component = SimpleNamespace(own_work_by_stream=lambda: [True, False, True])
        stub = SimpleNamespace(episode=SimpleNamespace(config=EpisodeConfig(backend=backend, mode=mode),
                                                       component=component),
                               _apply=lambda **op: applied.append(op), _enabled=lambda rule: True)
        stub._free_running = lambda: OffloadPart._free_running(stub)
        OffloadPart.poll_finished(stub, drawn, ran)
        assert applied == expect, (backend, mode, ran)
