"""``python -m repro regenerate``: a failing seed from a summary becomes its shrunk trace again.

A nightly summary lists, for every campaign with a finding, the campaign id and the seeds of its
Hypothesis runs (the finding came from the last one) and the profile. Rerunning that campaign
with that seed and profile on the simulator, without an example database, makes the same
examples, the same failure and the same shrunk trace: the simulator and the shrinker are both
deterministic. (A finding that came from replaying the example database rather than from
generation is the one case this cannot cover; the trace file itself is the record then.)

Examples::

    python -m repro regenerate single_buffer-tiny-sim-k-torch-shard0 --seed 1234 --profile nightly
    python -m repro regenerate --summary repro/summary.json     # every finding the summary lists
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from racecheck.cli import UsageError
from fuzz.engine.campaigns import PROFILES, Campaign, CampaignResult, default_campaigns, offload_campaigns, run_campaign


class RegenerateError(UsageError):
    """A campaign id, seed or summary that cannot be regenerated; the message says which and why (exit 2)."""


@dataclass(frozen=True)
class Regeneration:
    campaign: str
    seed: int
    profile: str
    expected_trace: str | None = None  # the trace path the summary named, if any
    offloader: str | None = None  # an offload campaign's offloader spec, as the summary names it


def find_campaign(campaign_id: str, zeroer: str | None = None, offloader: str | None = None) -> Campaign:
    """The campaign whose id is ``campaign_id``, among the default ones (or ``zeroer``'s, or ``offloader``'s)."""
    pairs = (offload_campaigns(["cuda", "sim"], offloader) if offloader else [])
    pairs += (default_campaigns(["cuda", "sim"], zeroer) if zeroer else []) + default_campaigns(["cuda", "sim"])
    candidates = [campaign for campaign, _ in pairs]
    for campaign in candidates:
        if campaign.id == campaign_id:
            return campaign
    near = [c.id for c in candidates if c.id.split("-")[0] == campaign_id.split("-")[0]][:6]
    hint = f"; campaigns of that zeroer: {', '.join(near)}" if near else "; `pytest fuzz --collect-only -q` lists them"
    extra = "" if zeroer or offloader else " (a campaign of an outside zeroer also needs --zeroer SPEC, an offloader's --offloader SPEC)"
    raise RegenerateError(f"unknown campaign {campaign_id!r}{extra}{hint}")


def from_summary(path: Path) -> list[Regeneration]:
    """Every campaign with a finding in the summary JSON at ``path``."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RegenerateError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise RegenerateError(f"{path}: cannot read it ({getattr(error, 'strerror', None) or error}); give a summary JSON") from None
    except json.JSONDecodeError as error:
        raise RegenerateError(f"{path}: invalid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None
    try:
        profile = data["totals"]["profile"]
        records = data["campaigns"]
    except (KeyError, TypeError):
        raise RegenerateError(f"{path}: missing field 'totals.profile' or 'campaigns'; is this a fuzz summary?") from None
    if not isinstance(profile, str) or profile not in PROFILES:
        raise RegenerateError(f"{path}: field 'totals.profile' is {profile!r}; choose one of {', '.join(PROFILES)}")
    if not isinstance(records, list):
        raise RegenerateError(f"{path}: field 'campaigns' must be a list of campaign records")
    runs = []
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise RegenerateError(f"{path}: field 'campaigns[{index}]' is {record!r}; a campaign record is an object")
        if not record.get("found"):
            continue
        seeds = record.get("seeds")
        if not seeds:
            raise RegenerateError(f"{path}: field 'campaigns[{index}].seeds' is empty")
        if not isinstance(seeds, list) or not isinstance(seeds[-1], int) or isinstance(seeds[-1], bool):
            raise RegenerateError(f"{path}: field 'campaigns[{index}].seeds' is {seeds!r}; it must be a list of integer seeds")
        if not isinstance(record.get("campaign"), str):
            raise RegenerateError(f"{path}: field 'campaigns[{index}].campaign' is {record.get('campaign')!r}; it must be a campaign id")
        # A campaign that stopped at a bug another had shrunk (same_as) names that campaign's trace, not its own.
        own_trace = None if record.get("same_as") else record.get("trace")
        offloader = record.get("offloader") if isinstance(record.get("offloader"), str) else None
        runs.append(Regeneration(record["campaign"], seeds[-1], profile, own_trace, offloader))
    return runs


def regenerate(run: Regeneration, repro_dir: Path, zeroer: str | None = None, offloader: str | None = None) -> CampaignResult:
    if run.profile not in PROFILES:
        raise RegenerateError(f"unknown profile {run.profile!r}; choose one of {', '.join(PROFILES)}")
    campaign = find_campaign(run.campaign, zeroer, offloader or run.offloader)
    if campaign.config.backend != "sim":
        import torch

        if not torch.cuda.is_available():
            raise RegenerateError(f"campaign {run.campaign!r} runs on cuda and no GPU is visible here; regenerate it on a GPU host")
    # No database and no budget: one Hypothesis run with exactly this seed.
    return run_campaign(campaign, PROFILES[run.profile], repro_dir, seed_override=run.seed)
