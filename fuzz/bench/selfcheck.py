"""How robust the fuzzer's self-checks are: each one over many seeds instead of its one.

A self-check is a campaign that must find a known bug (``expect="finds"``: the racy designs, the
two caller faults, the bug zoo). ``pytest fuzz`` runs each with the one seed its shard fixes, so
it says nothing about a seed that would have missed. This runs every selected self-check on the
simulator once per seed ``1..N``, through the same :func:`~fuzz.engine.campaigns.run_campaign`
and profile that ``pytest fuzz`` uses, and reports per campaign on how many seeds it found its
bug, the most examples it needed to the first finding, and its slowest run. Self-checks get
``FINDS_BUDGET_FACTOR`` times their profile's examples (20 x 40 = 800 under ``ci``); the most
examples needed says how much of that margin is used (docs/fuzzing.md, "Profiles").

The campaigns that run the Triton kernel under its interpreter (``k-triton``) are left out:
they check the kernel, not the fuzzer's reach, and take minutes per seed. Traces of findings go
to a temporary directory, and no example database is used.

Run it (CPU only; the ``ci`` profile and seeds 1..10 by default)::

    python -m fuzz.bench.selfcheck --geometry tiny             # the self-checks on tiny
    python -m fuzz.bench.selfcheck -k ring_overrun,no-free-fence --seeds 20 --json out.json

The exit status (:mod:`racecheck.cli`) is 1 when a self-check missed on any seed, 2 for bad arguments
(one line naming the value), 3 for a bug in this tool, 0 otherwise.
"""

from __future__ import annotations

import datetime
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_json_atomically
from fuzz.bench import command
from racecheck.cli import CLEAN, FINDING, ArgumentParser, check_output, positive
from fuzz.bench.speed import machine
from fuzz.engine.campaigns import FINDS_BUDGET_FACTOR, PROFILES, Campaign, default_campaigns, run_campaign

DEFAULT_SEEDS = 10
DEFAULT_PROFILE = "ci"
PROG = "python -m fuzz.bench.selfcheck"
SWEEP_PROFILES = ("quick", "ci")  # one seeded Hypothesis run each; nightly's budget and fresh seeds do not apply


def self_checks() -> list[Campaign]:
    """Every self-check ``pytest fuzz`` runs on the simulator, one per configuration, sorted.

    The shards of one configuration differ only in their seed, which the sweep replaces, so only
    shard 0 is kept; the ``k-triton`` campaigns are left out (see the module docstring).
    """
    seen = set()
    chosen = []
    for campaign, _ in default_campaigns(["sim"]):
        if campaign.expect != "finds" or campaign.config.kernel == "triton" or campaign.config in seen:
            continue
        seen.add(campaign.config)
        chosen.append(campaign)
    return chosen


def name_of(campaign: Campaign) -> str:
    """The campaign id without its shard: the sweep's seeds replace the shard's."""
    return campaign.id.rsplit("-shard", 1)[0]


def select(campaigns: list[Campaign], geometry: str | None, patterns: list[str]) -> list[Campaign]:
    """The campaigns on ``geometry`` (any if None) whose name contains one of ``patterns`` (any if empty)."""
    return [c for c in campaigns
            if (geometry is None or c.config.geometry == geometry)
            and (not patterns or any(p in name_of(c) for p in patterns))]


def sweep(campaign: Campaign, profile: str, seeds: list[int], repro_dir: Path) -> dict[str, Any]:
    """Run ``campaign`` once per seed; the row the report shows for it."""
    results = [run_campaign(campaign, PROFILES[profile], repro_dir, seed_override=s) for s in seeds]
    examples = [r.first_finding_examples for r in results if r.found]
    return {
        "campaign": name_of(campaign),
        "found": sum(r.found for r in results),
        "seeds": len(seeds),
        "missed_seeds": [s for s, r in zip(seeds, results) if not r.found],
        "most_examples_to_first_finding": max(examples) if examples else None,
        "examples_budget": PROFILES[profile].max_examples * FINDS_BUDGET_FACTOR,
        "slowest_run_s": round(max(r.seconds for r in results), 2),
    }


def render(rows: list[dict[str, Any]]) -> str:
    """The report as a markdown table."""
    lines = ["| self-check | found | most examples to the first finding | examples allowed | slowest run (s) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for row in rows:
        found = f"{row['found']}/{row['seeds']}" + ("" if not row["missed_seeds"] else
                                                       f" (**missed** seeds {', '.join(map(str, row['missed_seeds']))})")
        most = "-" if row["most_examples_to_first_finding"] is None else row["most_examples_to_first_finding"]
        lines.append(f"| {row['campaign']} | {found} | {most} | {row['examples_budget']} | {row['slowest_run_s']:g} |")
    return "\n".join(lines)


@command(PROG)
def main(argv: list[str]) -> int:
    """The exit status (:mod:`racecheck.cli`; see the module docstring)."""
    p = ArgumentParser(
        prog=PROG,
        description="Run every self-check campaign of the simulator (a campaign that must find a known "
                    "bug) over seeds 1..N, and report how often each found its bug and the most "
                    "examples it needed. CPU only.")
    p.add_argument("--seeds", type=positive(int, "seeds", "--seeds 10"), default=DEFAULT_SEEDS,
                   help=f"seeds 1..N per campaign (default {DEFAULT_SEEDS})")
    p.add_argument("--profile", choices=SWEEP_PROFILES, default=DEFAULT_PROFILE,
                   help=f"the pytest fuzz profile each run uses (default {DEFAULT_PROFILE})")
    p.add_argument("--geometry", default=None, help="only the self-checks on this geometry, e.g. tiny (default: every one)")
    p.add_argument("-k", "--campaigns", default="",
                   help="only self-checks whose id contains one of these comma-separated texts, e.g. -k ring,no-free-fence")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON to this file")
    args = p.parse_args(argv)
    patterns = [t.strip() for t in args.campaigns.split(",") if t.strip()]
    available = self_checks()
    chosen = select(available, args.geometry, patterns)
    if not chosen:
        asked = " and ".join(filter(None, [f"--geometry {args.geometry}" if args.geometry else "",
                                            f"-k {args.campaigns}" if patterns else ""]))
        p.error(f"no self-check matches {asked}; the self-checks are: {', '.join(name_of(c) for c in available)}")
    check_output("--json", args.json)
    seeds = list(range(1, args.seeds + 1))
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fuzz-selfcheck-") as tmp:
        for campaign in chosen:
            rows.append(sweep(campaign, args.profile, seeds, Path(tmp)))
            row = rows[-1]
            print(f"[{len(rows)}/{len(chosen)}] {row['campaign']}: found {row['found']}/{row['seeds']}, "
                  f"at most {row['most_examples_to_first_finding']} examples", file=sys.stderr, flush=True)
    print(render(rows))
    missed = [r["campaign"] for r in rows if r["missed_seeds"]]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} self-checks found their bug on every seed "
          f"(seeds 1..{args.seeds}, profile {args.profile}, {time.perf_counter() - started:.0f} s)"
          + (f"; missed: {', '.join(missed)}" if missed else ""))
    if args.json is not None:
        write_json_atomically(args.json, {
            "command": shlex.join(["python", "-m", "fuzz.bench.selfcheck", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine("sim"),
            "profile": args.profile,
            "seeds": seeds,
            "rows": rows,
            "seconds": round(time.perf_counter() - started, 1),
        })
        print(f"JSON written to {args.json}")
    return FINDING if missed else CLEAN


if __name__ == "__main__":
    sys.exit(main())
