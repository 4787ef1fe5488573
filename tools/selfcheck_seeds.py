"""How robust are the self-checks? Run each must-find campaign on geometry ``tiny`` over seeds
1..10 with the ``ci`` profile and print how often it found its race and the most examples it
needed (docs/fuzzing.md, "Profiles").

    PYTHONPATH=. python tools/selfcheck_seeds.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from fuzz.engine.campaigns import PROFILES, default_campaigns, run_campaign

SEEDS = range(1, 11)

if __name__ == "__main__":
    repro_dir = Path(tempfile.mkdtemp())
    for campaign in default_campaigns(["sim"]):
        if campaign.expect != "finds" or "tiny" not in campaign.id or "triton" in campaign.id:
            continue
        results = [run_campaign(campaign, PROFILES["ci"], repro_dir, seed_override=s) for s in SEEDS]
        most = max((r.first_finding_examples or 0) for r in results)
        print(f"{campaign.id}: found {sum(r.found for r in results)}/{len(results)}, "
              f"at most {most} examples to the first finding, slowest run {max(r.seconds for r in results):.1f} s")
