"""What interception costs: an intercepted zeroer's fuzzing speed against its runtime-API twin's.

A plain torch zeroer is fuzzed through interception (:mod:`kvdevice.intercept`); a zeroer written
against the runtime is called as it is. ``examples/engine_zeroers.py:fresh_pinned_per_call`` and
``examples/runtime_zeroer.py:RuntimePerCall`` are the same design with the same Triton kernel,
written both ways, so the ratio of their steps per second on the same geometry, seed and example
count is the price of interception (goal: at least 0.5). Both run clean campaigns through
:func:`fuzz.engine.campaigns.run_campaign`, the code ``pytest fuzz`` runs; each pair is measured
in interleaved rounds and the ratio reported per geometry as the median over rounds.

Run it::

    python -m fuzz.bench.intercept --json docs/data/sim-intercept-cost-$(date +%Y-%m).json
    python -m fuzz.bench.intercept --backend cuda --mode controlled --json h200-intercept-cost-$(date +%Y-%m).json
    python -m fuzz.bench.intercept --quick        # CI: a tiny run, that it still works

Exit status (:mod:`racecheck.cli`) 0, 2 for a bad command line (one line naming the value), 3 for a bug
in this tool (a race-free design with a finding is one); the goal is reported, not judged.
"""

from __future__ import annotations

import datetime
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_json_atomically
from fuzz.bench import command
from racecheck.cli import CLEAN, ArgumentParser, check_output
from fuzz.bench.stats import median
from fuzz.engine.campaigns import PROFILES, Campaign, Profile, run_campaign
from fuzz.engine.episode import EpisodeConfig
from racecheck.environment import describe, environment
from zeroer.cache.geometries import GEOMETRIES as PRESETS

PAIRS = (("examples/engine_zeroers.py:fresh_pinned_per_call", "examples/runtime_zeroer.py:RuntimePerCall"),)
GEOMETRIES = ("tiny", "mixed_dtypes", "ratio2")
GOAL = 0.5  # intercepted steps/s over the twin's
PROG = "python -m fuzz.bench.intercept"


def measure(spec: str, geometry: str, backend: str, mode: str, examples: int, seed: int) -> dict[str, Any]:
    """Steps per second of one clean campaign of ``spec``."""
    profile = Profile("bench", max_examples=examples, steps=PROFILES["quick"].steps)
    campaign = Campaign(EpisodeConfig(zeroer=spec, geometry=geometry, backend=backend, mode=mode), 0, "clean")
    with tempfile.TemporaryDirectory() as traces:
        start = time.perf_counter()
        result = run_campaign(campaign, profile, Path(traces), seed_override=seed)
        seconds = time.perf_counter() - start
    if result.found:
        raise RuntimeError(f"{spec} on {geometry}: a race-free design had a finding: {result.violation}")
    return {"steps": result.steps, "examples": result.examples, "seconds": round(seconds, 3),
            "steps_per_s": round(result.steps / seconds, 1)}


def run(backend: str, mode: str, geometries: tuple[str, ...], rounds: int, examples: int) -> dict[str, Any]:
    rows = []
    for intercepted, twin in PAIRS:
        for geometry in geometries:
            ratios, runs = [], []
            for r in range(rounds):
                seed = 1000 + r
                order = (intercepted, twin) if r % 2 == 0 else (twin, intercepted)  # interleaved
                got = {spec: measure(spec, geometry, backend, mode, examples, seed) for spec in order}
                ratios.append(got[intercepted]["steps_per_s"] / got[twin]["steps_per_s"])
                runs.append(got)
            ratio = median(ratios)
            rows.append({
                "intercepted": intercepted, "twin": twin, "geometry": geometry, "rounds": runs,
                "ratio": round(ratio, 3), "ratios": [round(x, 3) for x in ratios], "goal": GOAL, "met": ratio >= GOAL,
            })
            print(f"{geometry:14s} intercepted {median([r[intercepted]['steps_per_s'] for r in runs]):8.1f} steps/s, "
                  f"twin {median([r[twin]['steps_per_s'] for r in runs]):8.1f} steps/s, ratio {ratio:.2f} "
                  f"({'meets' if ratio >= GOAL else 'misses'} the goal of {GOAL})")
    return {"backend": backend, "mode": mode, "examples": examples, "rows": rows,
            "environment": environment(), "date": datetime.date.today().isoformat(),
            "command": "python -m fuzz.bench.intercept " + " ".join(sys.argv[1:])}


@command(PROG)
def main(argv: list[str]) -> int:
    """The exit status (:mod:`racecheck.cli`; see the module docstring)."""
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--mode", choices=("controlled", "free"), default="controlled", help="cuda only")
    parser.add_argument("--geometries", default=",".join(GEOMETRIES), help=f"comma-separated (default {','.join(GEOMETRIES)})")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per pair and geometry (default 3)")
    parser.add_argument("--examples", type=int, default=150, help="examples per campaign (default 150)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="one round of 5 examples on tiny")
    args = parser.parse_args(argv)
    geometries = tuple(g for g in args.geometries.split(",") if g)
    if args.quick:
        geometries, args.rounds, args.examples = ("tiny",), 1, 5
    if args.rounds < 1 or args.examples < 1:
        parser.error(f"--rounds {args.rounds} and --examples {args.examples} must be positive")
    for name in geometries:
        if name not in PRESETS:
            parser.error(f"--geometries: unknown geometry {name!r}; choose from {', '.join(sorted(PRESETS))}")
    if not geometries:
        parser.error(f"--geometries {args.geometries!r} names no geometry; choose from {', '.join(sorted(PRESETS))}")
    if args.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--backend cuda needs a CUDA GPU and none is visible here; use --backend sim")
    check_output("--json", args.json)
    report = run(args.backend, args.mode, geometries, args.rounds, args.examples)
    print(f"machine: {describe(report['environment'])}")
    if args.json is not None:
        write_json_atomically(args.json, report)
        print(f"JSON written to {args.json}")
    return CLEAN


if __name__ == "__main__":
    sys.exit(main())
