"""The stricter caller (``pytest fuzz --strict-caller``): no device synchronisation after a zeroer's
warm-up, for engines whose start-up does not synchronise there (docs/contract.md)."""

from __future__ import annotations

from pathlib import Path

from fuzz.engine.campaigns import PROFILES, Campaign, default_campaigns, run_campaign
from fuzz.engine.episode import EpisodeConfig, run_ops

WARMUP_RACE = "tests/warmup_zeroers.py:WarmupWithoutEvent"
FIRST_CALL = [{"op": "start"}, {"op": "allocate", "n": 1}]


def test_a_race_between_warmup_and_the_first_call_shows_only_behind_the_stricter_caller() -> None:
    assert run_ops(EpisodeConfig(zeroer=WARMUP_RACE), FIRST_CALL) == []
    found = run_ops(EpisodeConfig(zeroer=WARMUP_RACE, warmup_sync=False), FIRST_CALL)
    assert found and found[0].kind == "hazard" and "zero_block_ids" in found[0].message


def test_the_fuzzer_behind_the_stricter_caller_finds_it(tmp_path: Path) -> None:
    config = EpisodeConfig(zeroer=WARMUP_RACE, warmup_sync=False)
    result = run_campaign(Campaign(config, shard=0, expect="finds"), PROFILES["quick"], tmp_path)
    assert result.found and len(result.violation.trace) <= 3
    clean = run_campaign(Campaign(EpisodeConfig(zeroer=WARMUP_RACE), shard=0, expect="clean"), PROFILES["quick"], tmp_path)
    assert not clean.found


def test_strict_campaigns_are_the_usual_ones_behind_the_stricter_caller() -> None:
    usual = default_campaigns(["sim"], WARMUP_RACE)
    strict = default_campaigns(["sim"], WARMUP_RACE, warmup_sync=False)
    assert [c.id.replace("-sim-", "-sim-strict-") for c, _ in usual] == [c.id for c, _ in strict]
    assert all(not c.config.warmup_sync for c, _ in strict)
