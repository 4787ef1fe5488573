"""How fast the fuzzer runs and how fast it finds the known races, on one backend.

Two measurements, both through :func:`fuzz.engine.campaigns.run_campaign`, the code ``pytest fuzz`` runs:

* **throughput**: steps per second of a clean campaign on geometry ``tiny`` for each race-free
  zeroer (``reference``, ``per_call``, ``event_ring``), with a generous example count so nothing
  but the fuzzer's own work is timed (a campaign that finds something would stop early);
* **time to find**: for each known race (``single_buffer``, ``ring``) and each of the seeds
  ``1..N``, the seconds and examples to the first finding, the seconds including shrinking, and
  the length of the shrunk trace (ops, ``start`` included). Reported as the median over seeds,
  with the min and max.

Staged designs use the torch kernel on the simulator (as the sim campaigns do) and their default
kernel on cuda. Each result is set beside its target (:data:`TARGETS`); missing one makes no
difference to the exit status (:mod:`racecheck.cli`), which is 0 unless the command line is bad (2, one
line naming the value) or the script itself fails (3). Traces of findings go
to a temporary directory, never to ``repro/failures``, and no example database is used.

Run it (``--quick``: tiny budgets, for CI to check that the script still runs)::

    PYTHONPATH=. python -m fuzz.bench.speed --backend sim --seeds 5 --json /tmp/bench-sim.json
    python -m fuzz.bench.speed --backend cuda --mode controlled --json bench-h200.json
    python -m fuzz.bench.speed --quick
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis
import torch

from racecheck.atomic_file import write_json_atomically
from fuzz.bench.stats import spread
from fuzz.bench import command
from racecheck.cli import ArgumentParser, check_output
from fuzz.engine.campaigns import PROFILES, Campaign, Profile, run_campaign
from fuzz.engine.episode import EpisodeConfig

THROUGHPUT_ZEROERS = ("reference", "per_call", "event_ring")
RACES = ("single_buffer", "ring")
GEOMETRY = "tiny"
STEPS = PROFILES["quick"].steps  # rules per example: the step count the default profile uses
THROUGHPUT_EXAMPLES = 300  # generous: about 3 s per zeroer on a 2-core CPU
RACE_EXAMPLES = 2000  # upper bound per seed; a known race is normally found in tens
QUICK_THROUGHPUT_EXAMPLES = 20
QUICK_RACE_EXAMPLES = 200
QUICK_STEPS = 8  # short examples shrink in about a second, so --quick stays a smoke test

# The goals the numbers are judged by, per backend. "race_total_s" is the median over seeds of
# the seconds to a finding including shrinking; "race_first_s" the median without shrinking;
# "shrunk_ops" the longest shrunk trace over all seeds; "reference_steps_per_s" the throughput
# of the reference zeroer.
TARGETS: dict[str, dict[str, float]] = {
    "sim": {"race_total_s": 10.0, "shrunk_ops": 6, "reference_steps_per_s": 2000.0},
    "cuda": {"race_first_s": 10.0},
}


@dataclass(frozen=True)
class BenchConfig:
    backend: str  # "sim" or "cuda" (already checked)
    mode: str  # cuda only: "controlled" or "free"
    seeds: list[int]
    throughput_examples: int
    race_examples: int
    steps: int = STEPS  # rules per example at most
    quick: bool = False


def _campaign(bench: BenchConfig, zeroer: str, expect: str) -> Campaign:
    # The simulator runs the staged designs with the torch kernel, as default_campaigns does:
    # the Triton interpreter would time itself, not the fuzzer.
    config = EpisodeConfig(
        zeroer=zeroer, geometry=GEOMETRY, backend=bench.backend, mode=bench.mode,
        kernel="torch" if bench.backend == "sim" and zeroer != "reference" else None,
    )
    return Campaign(config, shard=0, expect=expect)


def _profile(bench: BenchConfig, name: str, max_examples: int) -> Profile:
    # No wall-clock budget, no fresh seeds, no database: one seeded Hypothesis run per call.
    return Profile(f"bench-{name}", max_examples=max_examples, steps=bench.steps)


def measure_throughput(bench: BenchConfig, repro_dir: Path) -> list[dict[str, Any]]:
    """Steps per second of a clean campaign for each race-free zeroer: the median over the seeds.

    One campaign lasts a few seconds, and on a shared machine two identical runs measured 2,000
    and 3,100 steps/s, so a single run says little; the spread is reported with the median.
    """
    rows = []
    for zeroer in THROUGHPUT_ZEROERS:
        campaign = _campaign(bench, zeroer, "clean")
        results = [
            run_campaign(campaign, _profile(bench, "throughput", bench.throughput_examples), repro_dir, seed_override=s)
            for s in bench.seeds
        ]
        rates = [r.steps / r.seconds for r in results if r.seconds > 0]
        rate = spread(rates)
        rows.append({
            "zeroer": zeroer,
            "campaign": campaign.id,
            "examples": sum(r.examples for r in results),
            "steps": sum(r.steps for r in results),
            "seconds": round(sum(r.seconds for r in results), 3),
            "steps_per_s": None if rate["median"] is None else round(rate["median"], 1),
            "steps_per_s_min": None if rate["min"] is None else round(rate["min"], 1),
            "steps_per_s_max": None if rate["max"] is None else round(rate["max"], 1),
            "found": any(r.found for r in results),  # a race-free zeroer should never find anything
        })
    return rows


def measure_races(bench: BenchConfig, repro_dir: Path) -> list[dict[str, Any]]:
    """Time to the first finding, with and without shrinking, for each known race and seed."""
    rows = []
    for zeroer in RACES:
        campaign = _campaign(bench, zeroer, "finds")
        runs = []
        for seed in bench.seeds:
            result = run_campaign(campaign, _profile(bench, "race", bench.race_examples), repro_dir, seed_override=seed)
            runs.append({
                "seed": seed,
                "found": result.found,
                "first_finding_s": None if result.first_finding_s is None else round(result.first_finding_s, 3),
                "first_finding_examples": result.first_finding_examples,
                "total_s": round(result.seconds, 3),
                "examples": result.examples,
                "shrunk_ops": None if result.violation is None else len(result.violation.trace),
            })
        found = [r for r in runs if r["found"]]
        rows.append({
            "zeroer": zeroer,
            "campaign": campaign.id,
            "found": f"{len(found)}/{len(runs)}",
            "first_finding_s": spread([r["first_finding_s"] for r in found]),
            "first_finding_examples": spread([r["first_finding_examples"] for r in found]),
            "total_s": spread([r["total_s"] for r in found]),
            "shrunk_ops": spread([r["shrunk_ops"] for r in found]),
            "runs": runs,
        })
    return rows


def judge(backend: str, throughput: list[dict], races: list[dict]) -> list[dict[str, Any]]:
    """Each target of ``backend`` with the measured value and whether it was met."""
    targets = TARGETS[backend]
    verdicts = []

    def add(what: str, goal: str, value: float | None, met: bool) -> None:
        verdicts.append({"target": what, "goal": goal, "measured": value, "met": met})

    for race in races:
        complete = race["found"].split("/")[0] == race["found"].split("/")[1]
        for target, field, what in (("race_total_s", "total_s", "a shrunk finding"),
                                    ("race_first_s", "first_finding_s", "the first finding")):
            if target in targets:
                value = race[field]["median"]
                add(f"{race['zeroer']}: median s to {what}", f"median <= {targets[target]:g} s, found on every seed",
                    value, complete and value is not None and value <= targets[target])
        if "shrunk_ops" in targets:
            value = race["shrunk_ops"]["max"]
            add(f"{race['zeroer']}: longest shrunk trace (ops)", f"<= {targets['shrunk_ops']:g}",
                value, value is not None and value <= targets["shrunk_ops"])
    if "reference_steps_per_s" in targets:
        value = next(r["steps_per_s"] for r in throughput if r["zeroer"] == "reference")
        add("reference: steps/s", f">= {targets['reference_steps_per_s']:g}",
            value, value is not None and value >= targets["reference_steps_per_s"])
    return verdicts


def machine(backend: str) -> dict[str, Any]:
    """Where the numbers were taken: versions, CPU, core count and the GPU on cuda."""
    import triton  # a dependency; imported here, as these campaigns on the simulator never load it

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "hypothesis": hypothesis.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or _cpu_model() or platform.machine(),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    if backend == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_model() -> str | None:
    # platform.processor() is empty on most Linux builds; /proc/cpuinfo names the CPU.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _mmm(s: dict[str, Any]) -> str:
    return f"{_fmt(s['median'])} ({_fmt(s['min'])}-{_fmt(s['max'])})"


def render_markdown(report: dict[str, Any]) -> str:
    """The report as markdown tables (what ``python -m fuzz.bench.speed`` prints)."""
    lines = [
        f"Backend `{report['backend']}`, seeds {report['seeds']}, {report['date']}",
        "",
        "Throughput: steps/s median (min-max) over seeds; examples, steps and seconds summed.",
        "",
        "| zeroer | campaign | examples | steps | seconds | steps/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in report["throughput"]:
        flag = " (FOUND SOMETHING)" if r["found"] else ""
        lines.append(f"| {r['zeroer']}{flag} | {r['campaign']} | {r['examples']} | {r['steps']} | {_fmt(r['seconds'])} | {_fmt(r['steps_per_s'])} ({_fmt(r['steps_per_s_min'])}-{_fmt(r['steps_per_s_max'])}) |")
    lines += [
        "",
        "Known races: median (min-max) over seeds.",
        "",
        "| race | found | s to first finding | examples to first finding | s incl. shrinking | shrunk ops |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["races"]:
        lines.append(
            f"| {r['zeroer']} | {r['found']} | {_mmm(r['first_finding_s'])} | {_mmm(r['first_finding_examples'])} "
            f"| {_mmm(r['total_s'])} | {_mmm(r['shrunk_ops'])} |"
        )
    lines += [""]
    if report["quick"]:
        lines += ["--quick: budgets too small to judge the targets; the verdicts below only show the script ran.", ""]
    lines += ["| target | goal | measured | met |", "|---|---|---:|---|"]
    for v in report["targets"]:
        lines.append(f"| {v['target']} | {v['goal']} | {_fmt(v['measured'])} | {'yes' if v['met'] else '**no**'} |")
    return "\n".join(lines)


def run_bench(bench: BenchConfig, argv: list[str]) -> dict[str, Any]:
    """Warm up, measure throughput and races, judge them; return the JSON-ready report."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuzz-bench-") as tmp:
        repro_dir = Path(tmp)
        # One short run first, so imports, allocator set-up and (on cuda) context creation are
        # not charged to the first measurement.
        run_campaign(_campaign(bench, "reference", "clean"), _profile(bench, "warmup", 5), repro_dir, seed_override=0)
        throughput = measure_throughput(bench, repro_dir)
        races = measure_races(bench, repro_dir)
    return {
        "backend": bench.backend,
        "mode": bench.mode if bench.backend == "cuda" else None,
        "geometry": GEOMETRY,
        "steps_per_example": bench.steps,
        "seeds": bench.seeds,
        "quick": bench.quick,
        "throughput_examples": bench.throughput_examples,
        "race_examples": bench.race_examples,
        "command": shlex.join([Path(sys.executable).name, "-m", "fuzz.bench.speed", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(bench.backend),
        "throughput": throughput,
        "races": races,
        "targets": judge(bench.backend, throughput, races),
        "bench_seconds": round(time.perf_counter() - started, 1),
    }


PROG = "python -m fuzz.bench.speed"


@command(PROG)
def main(argv: list[str]) -> int:
    """The exit status (:mod:`racecheck.cli`; see the module docstring)."""
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="sim", help="sim (CPU simulator, default) or cuda")
    parser.add_argument("--mode", choices=("controlled", "free"), default="controlled", help="cuda: gates or real timing")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 1..N per known race (default 5; 1 with --quick)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON to this file")
    parser.add_argument("--quick", action="store_true", help="tiny budgets: checks that the script runs, measures little")
    args = parser.parse_args(argv)
    if args.backend not in ("sim", "cuda"):
        parser.error(f"--backend {args.backend!r} is not a backend; choose sim or cuda")
    if args.backend == "cuda" and not torch.cuda.is_available():
        parser.error("--backend cuda needs a CUDA GPU and none is visible here; use --backend sim")
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 5)
    if seeds < 1:
        parser.error(f"--seeds {seeds} must be at least 1; give the number of seeds per race, e.g. 5")
    check_output("--json", args.json)
    bench = BenchConfig(
        backend=args.backend,
        mode=args.mode,
        seeds=list(range(1, seeds + 1)),
        throughput_examples=QUICK_THROUGHPUT_EXAMPLES if args.quick else THROUGHPUT_EXAMPLES,
        race_examples=QUICK_RACE_EXAMPLES if args.quick else RACE_EXAMPLES,
        steps=QUICK_STEPS if args.quick else STEPS,
        quick=args.quick,
    )
    report = run_bench(bench, argv)
    print(render_markdown(report))
    if args.json is not None:
        write_json_atomically(args.json, report)  # a reader never sees half a report
        print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
