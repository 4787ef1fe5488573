"""The fuzz campaigns: race-free zeroers must come out clean, and the fuzzer must find the known
races (self-checks: they pass when the race is found and fail when it is missed)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fuzz.engine.campaigns import Campaign, CampaignResult, run_campaign
from fuzz.engine.database import example_database
from fuzz.engine.harness_error import HarnessError, harness_error
from racecheck.resources import ResourceExhausted, raise_if_out_of_memory
from fuzz.engine.summary import result_record
from fuzz.timeline import write_timeline


def test_campaign(campaign: Campaign, fuzz_options_fixture, fuzz_cuda_device, fuzz_budget, fuzz_journal,
                  fuzz_known_bugs, record_property) -> None:
    options = fuzz_options_fixture
    if campaign.config.backend == "cuda":
        campaign = replace(campaign, config=replace(campaign.config, device=fuzz_cuda_device))
    result = _set_up(campaign) or run_campaign(
        campaign,
        options.profile,
        options.repro_dir,
        budget_s=fuzz_budget,
        database=example_database(options.database) if options.profile.database else None,
        seed_override=options.seed,
        journal=fuzz_journal,
        shrink_bound_s=options.shrink_seconds,
        known_bugs=fuzz_known_bugs,
    )
    record = result_record(result)
    if result.trace_path is not None:
        record["timeline"] = _timeline(result.trace_path)
    record_property("fuzz", json.dumps(record))
    if result.resource_error:  # neither a finding nor clean (racecheck.resources)
        pytest.fail(f"resource error, not judged: {result.resource_error}", pytrace=False)
    if result.harness_error:  # neither a finding nor clean (fuzz.engine.harness_error)
        debug = f"\n{result.harness_details}" if options.debug and result.harness_details else ""
        pytest.fail(result.harness_error + debug, pytrace=False)
    replay = f"python -m repro replay {result.trace_path}" if result.trace_path else ""
    if campaign.expect == "clean":
        if result.same_as is not None:  # one line: the campaign that shrank this bug has the full report
            pytest.fail(result.same_as.message(), pytrace=False)
        if result.found:
            flaky = "" if result.reproduced else (
                "\n(it did not show again when Hypothesis replayed the program: timing-dependent; the trace "
                "is the program that showed it)")
            pytest.fail(f"{result.violation}{flaky}\ntrace: {result.trace_path}\n{replay}", pytrace=False)
        return
    if not result.found:
        pytest.fail(
            f"the fuzzer missed the known race of {campaign.config.zeroer!r} in {result.examples} examples "
            f"({result.steps} steps, seed {result.seeds[0]}): the self-check failed",
            pytrace=False,
        )
    caller_fault = campaign.config.caller_fault is not None
    assert all(f.caller_fault == caller_fault for f in result.violation.findings)


def _set_up(campaign: Campaign) -> CampaignResult | None:
    """Select the campaign's GPU. A failure here is no verdict: the GPU out of memory (another job
    on the card) is a resource error, anything else a harness error; None when all is well."""
    if campaign.config.device is None:
        return None
    import torch

    try:
        torch.cuda.set_device(campaign.config.device)
    except Exception as error:
        try:
            raise_if_out_of_memory(error, "selecting the campaign's GPU")
        except ResourceExhausted as exhausted:
            return CampaignResult(campaign, resource_error=str(exhausted))
        failed = harness_error(error, f"selecting GPU {campaign.config.device} for the campaign")
        return CampaignResult(campaign, harness_error=failed.message, harness_status=failed.status,
                              harness_details=failed.details)
    return None


def _timeline(trace: Path) -> str | None:
    """The finding's timeline (Perfetto JSON beside the trace, and its HTML page), or None where
    it cannot be drawn (a trace of a zeroer that runs on cuda only: timelines replay on the
    simulator). Never at the cost of the finding: its trace is already written."""
    try:
        json_path, _ = write_timeline(trace)
    except (Exception, HarnessError):  # noqa: BLE001 - a picture is a convenience
        return None
    return str(json_path)
