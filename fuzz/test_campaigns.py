"""The fuzz campaigns: race-free zeroers must come out clean, and the fuzzer must find the known
races (self-checks: they pass when the race is found and fail when it is missed)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fuzz.engine.campaigns import Campaign, run_campaign
from fuzz.engine.summary import result_record


def test_campaign(campaign: Campaign, fuzz, cuda_device, campaign_budget, journal, record_property) -> None:
    if campaign.config.backend == "cuda":
        campaign = replace(campaign, config=replace(campaign.config, device=cuda_device))
    result = run_campaign(
        campaign,
        fuzz.profile,
        fuzz.repro_dir,
        budget_s=campaign_budget,
        database_dir=fuzz.database_dir / campaign.id,
        seed_override=fuzz.seed,
        journal=journal,
    )
    record_property("fuzz", json.dumps(result_record(result)))
    replay = f"python -m repro replay {result.trace_path}" if result.trace_path else ""
    if campaign.expect == "clean":
        if result.found:
            flaky = "" if result.reproduced else (
                "\n(it did not show again when Hypothesis replayed the program: timing-dependent; the trace "
                "is the program that showed it)")
            pytest.fail(f"{result.violation}{flaky}\ntrace: {result.trace_path}\n{replay}", pytrace=False)
        return
    if not result.found:
        pytest.fail(
            f"the fuzzer missed the known race of {campaign.config.zeroer!r} in {result.examples} examples "
            f"({result.steps} steps, seeds {result.seeds}): the self-check failed",
            pytrace=False,
        )
    caller_fault = campaign.config.caller_fault is not None
    assert all(f.caller_fault == caller_fault for f in result.violation.findings)
