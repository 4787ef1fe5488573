"""Where a finding is shrunk and for how long (fuzz/engine/shrink.py), on the CPU.

There is no GPU here, so the campaigns below play the GPU with the simulator: a :class:`ShrinkPlan`
whose ``shrink_on`` is the campaign's own simulator config and whose ``confirm`` counts its calls
runs the whole cuda flow (no Hypothesis shrink phase, the first failing program minimized on the
simulator, one confirmation where the campaign runs). :func:`plan_for` is checked on its own: it is
what turns that flow on for a real cuda campaign.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from racecheck import interrupts
from fuzz.engine import minimize as minimize_module
from fuzz.engine.campaigns import PROFILES, Campaign, default_campaigns, run_campaign
from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.machine import CampaignStats, ShrinkBoundReached, machine_for
from fuzz.engine.shrink import SHRINK_BOUND_S, ShrinkPlan, plan_for, shrink_bound, where
from fuzz.engine.summary import render_summary, result_record

RING = EpisodeConfig(zeroer="ring", kernel="torch")  # racy: a hazard on a reused staging slot
ENGINE_RACES = ("single_pinned_buffer", "pinned_ring", "side_stream_copy_no_record", "side_stream_copy_event_on_caller")


class FakeGpu:
    """``confirm`` of a plan: replays on the campaign's config (the simulator here) and counts."""

    def __init__(self, shows: bool = True) -> None:
        self.calls: list[tuple[EpisodeConfig, list[dict]]] = []
        self.shows = shows

    def __call__(self, config: EpisodeConfig, ops: list[dict]):
        self.calls.append((config, ops))
        return run_ops(config, ops) if self.shows else []


def replays_by_backend(monkeypatch) -> list[str]:
    """The backend of every replay minimize() runs, in order."""
    seen: list[str] = []

    def counting(config, ops, caches=None):
        seen.append(config.backend)
        return run_ops(config, ops, caches=caches)

    monkeypatch.setattr(minimize_module, "run_ops", counting)
    return seen


# -- the decision ------------------------------------------------------------------------------


def test_a_cuda_campaign_whose_zeroer_runs_on_the_simulator_shrinks_there_in_both_modes():
    for mode in ("controlled", "free"):
        plan = plan_for(EpisodeConfig(zeroer="ring", backend="cuda", mode=mode, device=0))
        assert not plan.hypothesis_shrinks
        # the staged design's torch kernel on the CPU (its Triton one would run under the interpreter)
        assert plan.shrink_on == EpisodeConfig(zeroer="ring", backend="sim", mode="controlled", kernel="torch")
    engine = "examples/engine_zeroers.py:pinned_ring"
    assert plan_for(EpisodeConfig(zeroer=engine, backend="cuda")).shrink_on == EpisodeConfig(zeroer=engine)


def test_a_simulator_campaign_is_minimized_alone_and_hypothesis_shrinks_where_the_zeroer_cannot_run_on_it():
    assert plan_for(RING) == ShrinkPlan(hypothesis=False) and not plan_for(RING).hypothesis_shrinks
    assert plan_for(RING, minimize_trace=False).hypothesis_shrinks and plan_for(RING, minimize_trace=False).why_not is None
    cuda_only = plan_for(EpisodeConfig(zeroer="torch_per_call", backend="cuda", mode="free"))
    assert cuda_only.hypothesis_shrinks
    assert cuda_only.why_not == "zeroer 'torch_per_call' does not run on the simulator"
    unminimized = plan_for(EpisodeConfig(zeroer="ring", backend="cuda"), minimize_trace=False)
    assert unminimized.hypothesis_shrinks and unminimized.why_not == "minimizing was turned off"


def test_each_backend_has_a_bound_and_the_callers_bound_replaces_it():
    assert shrink_bound("sim") == SHRINK_BOUND_S["sim"] and shrink_bound("cuda") == SHRINK_BOUND_S["cuda"]
    assert shrink_bound("cuda", 5.0) == 5.0 and shrink_bound("sim", 0.0) == 0.0
    assert where(RING) == "sim" and where(dataclasses.replace(RING, backend="cuda", mode="free")) == "cuda-free"


# -- the flow, with the simulator playing the GPU ----------------------------------------------


def test_the_gpu_does_not_shrink_when_the_simulator_shows_the_finding(tmp_path, monkeypatch):
    gpu = FakeGpu()
    minimize_replays = replays_by_backend(monkeypatch)
    result = run_campaign(Campaign(RING, expect="finds"), PROFILES["quick"], tmp_path,
                          shrink_plan=ShrinkPlan(shrink_on=RING, confirm=gpu))
    assert result.found
    # No shrink phase on the "GPU": after the first failing example only Hypothesis's final replay of it.
    assert result.examples == result.first_finding_examples + 1
    assert result.shrunk_by_hypothesis is None
    shrink = result.shrink
    assert minimize_replays and set(minimize_replays) == {"sim"} and len(minimize_replays) == shrink["replays"]
    assert len(gpu.calls) == 1 and gpu.calls[0] == (RING, result.violation.trace)  # confirmed once, the result
    assert shrink["shrunk_on"] == "sim" and shrink["by"] == "minimize" and shrink["confirmed_on"] == "sim"
    assert shrink["fallback"] is None and shrink["cut_off"] is False
    assert shrink["from_ops"] > shrink["ops"] == len(result.violation.trace) <= 4
    saved = json.loads(result.trace_path.read_text())
    assert saved["shrink"] == shrink and len(saved["ops"]) == shrink["ops"]
    assert result_record(result)["shrink"] == shrink


def test_where_the_plan_says_so_hypothesis_shrinks_on_the_campaigns_backend(tmp_path):
    # The plan of a zeroer that runs on cuda only: what the GPU used to pay for every time.
    result = run_campaign(Campaign(RING, expect="finds"), PROFILES["quick"], tmp_path, shrink_plan=ShrinkPlan())
    assert result.examples > result.first_finding_examples + 1
    assert result.shrink["by"].startswith("hypothesis") and result.shrink["confirmed_on"] is None


def test_a_simulator_campaign_minimizes_its_first_failing_program_without_hypothesis_shrinking(tmp_path, monkeypatch):
    minimize_replays = replays_by_backend(monkeypatch)
    result = run_campaign(Campaign(RING, expect="finds"), PROFILES["quick"], tmp_path)
    assert result.found and result.violation.findings[0].kind == "hazard"
    assert result.examples == result.first_finding_examples + 1  # only Hypothesis's final replay of it
    assert result.shrunk_by_hypothesis is None
    shrink = result.shrink
    assert (shrink["shrunk_on"], shrink["by"], shrink["confirmed_on"], shrink["cut_off"]) == ("sim", "minimize", None, False)
    assert set(minimize_replays) == {"sim"} and len(minimize_replays) == shrink["replays"] > 0
    assert shrink["from_ops"] > shrink["ops"] == len(result.violation.trace) <= 4


def test_a_finding_the_simulator_does_not_show_is_shrunk_where_it_was_found(tmp_path, monkeypatch):
    gpu = FakeGpu()
    minimize_replays = replays_by_backend(monkeypatch)
    clean = dataclasses.replace(RING, zeroer="reference")  # a "simulator" on which the race does not show
    result = run_campaign(Campaign(RING, expect="finds"), PROFILES["quick"], tmp_path,
                          shrink_plan=ShrinkPlan(shrink_on=clean, confirm=gpu))
    assert result.found and result.violation.config == RING and result.violation.findings[0].kind == "hazard"
    assert gpu.calls == []  # nothing to confirm
    shrink = result.shrink
    assert shrink["fallback"] == (f"the first failing program ({shrink['from_ops']} ops) showed no finding on the "
                                  f"simulator, not 'hazard'")
    assert shrink["by"] == "minimize" and shrink["shrunk_on"] == where(RING) and shrink["confirmed_on"] is None
    assert len(minimize_replays) == shrink["replays"] > 0  # minimize ran on the campaign's own config
    assert len(result.violation.trace) <= 4
    text, _ = render_summary([result_record(result)], "quick")
    assert f"shrunk on sim: {shrink['fallback']}" in text


def test_a_shrunk_trace_the_gpu_does_not_confirm_is_shrunk_again_where_it_was_found(tmp_path):
    gpu = FakeGpu(shows=False)
    result = run_campaign(Campaign(RING, expect="finds"), PROFILES["quick"], tmp_path,
                          shrink_plan=ShrinkPlan(shrink_on=RING, confirm=gpu))
    assert len(gpu.calls) == 1
    shrink = result.shrink
    assert shrink["fallback"] == (f"the trace shrunk on the simulator ({len(gpu.calls[0][1])} ops) showed no "
                                  f"finding on sim, not 'hazard'")
    assert shrink["by"] == "minimize" and shrink["confirmed_on"] is None
    assert result.found and result.violation.findings[0].kind == "hazard"  # still the finding it is


@pytest.mark.parametrize("name", ENGINE_RACES)
def test_the_engine_style_races_shrink_to_at_most_four_ops_on_the_simulator(name, tmp_path):
    spec = f"examples/engine_zeroers.py:{name}"
    for campaign, skipped in default_campaigns(["sim"], spec, ("mla_indexer", "tiny")):
        assert skipped is None
        gpu = FakeGpu()
        result = run_campaign(dataclasses.replace(campaign, expect="finds"), PROFILES["quick"], tmp_path,
                              shrink_plan=ShrinkPlan(shrink_on=campaign.config, confirm=gpu))
        assert result.found and result.shrink["shrunk_on"] == "sim" and len(gpu.calls) == 1, campaign.id
        assert len(result.violation.trace) <= 4, (campaign.id, result.violation.trace)


# -- the bound ---------------------------------------------------------------------------------


def test_a_shrink_cut_off_by_the_bound_is_the_finding_it_is_and_says_so(tmp_path):
    result = run_campaign(Campaign(RING, expect="finds"), PROFILES["quick"], tmp_path, shrink_bound_s=0.0,
                          shrink_plan=ShrinkPlan())  # Hypothesis's shrink phase, stopped by the bound
    assert result.found and result.violation.findings[0].kind == "hazard"
    assert result.examples == result.first_finding_examples  # stopped before Hypothesis's first shrink example
    shrink = result.shrink
    assert shrink["cut_off"] is True and shrink["bound_s"] == 0.0 and shrink["by"] == "hypothesis"
    assert json.loads(result.trace_path.read_text())["shrink"]["cut_off"] is True
    text, data = render_summary([result_record(result)], "quick")
    assert "found (expected)" in text and "shrinking cut off by its 0.0 s bound: the smallest trace so far" in text
    assert data["totals"]["findings"] == 1 and data["totals"]["unexpected"] == 0


def test_the_machine_stops_hypothesis_once_the_bound_has_passed_and_ctrl_c_stays_an_interruption():
    stats = CampaignStats(started=0.0, first_finding_s=1.0, shrink_bound_s=2.0)
    assert stats.shrink_overdue()  # time.monotonic() is far past 3.0
    assert not CampaignStats(started=0.0, shrink_bound_s=2.0).shrink_overdue()  # nothing found: no shrinking
    assert not dataclasses.replace(stats, shrink_bound_s=None).shrink_overdue()
    machine = machine_for(RING, "ring", stats=stats)
    with pytest.raises(ShrinkBoundReached):
        machine()
    interrupts.mark_interrupted()
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            machine()
        assert type(stopped.value) is KeyboardInterrupt
    finally:
        interrupts.reset()


def test_ctrl_c_at_the_bound_is_reported_as_the_interruption_with_the_program_saved(tmp_path, monkeypatch):
    def overdue_and_interrupted(self) -> bool:  # Ctrl-C lands just as the bound is reached
        if self.first_finding_s is None:
            return False
        interrupts.mark_interrupted()
        return True

    monkeypatch.setattr(CampaignStats, "shrink_overdue", overdue_and_interrupted)
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            run_campaign(Campaign(RING, expect="finds"), PROFILES["quick"], tmp_path, shrink_plan=ShrinkPlan())
    finally:
        interrupts.reset()
    assert type(stopped.value) is KeyboardInterrupt
    assert "interrupted after a finding" in "\n".join(stopped.value.__notes__)
    assert list(tmp_path.glob("ring-tiny-*.json"))
