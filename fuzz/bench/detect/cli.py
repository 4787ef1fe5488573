"""How well the fuzzer finds real bug classes: every zoo entry, and no false positive.

``python -m fuzz.bench.detect`` runs each detection method (the fuzzer, and the baselines of
``fuzz/bench/detect/baselines/__init__.py`` where asked) against every zoo entry (``zeroer/zoo``, on the geometry its
bug shows on) and every race-free implementation (``per_call``, ``event_ring``, ``reference``,
rotated over the zoo's geometries), once per seed 1..N, each for at most ``--budget`` seconds.
Per entry it reports whether it was found, the seconds and examples to the first finding
(median and range over seeds), the seconds including shrinking, the length of the shrunk trace
and the path of its repro trace; then the detection rate against its target (every zoo entry on
every seed, median within 60 s) and the false positives.

Exit status (:mod:`racecheck.cli`): 0 when the ``fuzz`` method found every zoo entry on every seed and
nothing on the race-free implementations; 1 otherwise (a missed entry, a false positive, a method
that raised); 2 for a bad command line (one line naming the value); 3 for a bug in this tool.
Baselines are reported, never judged.

``--steps-clean N`` is the false-positive soak instead: the race-free implementations, on every
geometry the zoo uses, fuzzed with fresh seeds until N steps in total (target 1,000,000 on the
simulator); any finding fails it. ``plot REPORT.json --png FILE`` draws a saved report.

Run it::

    PYTHONPATH=. python -m fuzz.bench.detect --seeds 5 -j 2 --json sim-detect-$(date +%Y-%m).json --png sim-detect-$(date +%Y-%m).png
    PYTHONPATH=. python -m fuzz.bench.detect --steps-clean 1000000 -j 2 --json sim-clean-soak-$(date +%Y-%m).json
    python -m fuzz.bench.detect --backend cuda --mode controlled --json h200-detect-$(date +%Y-%m).json    # all methods
    python -m fuzz.bench.detect plot docs/data/sim-detect-2026-12.json --png sim-detect.png
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import itertools
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, Iterator

from zeroer.cache.geometries import GEOMETRIES
from zeroer.registry import RACE_FREE, ZOO, default_geometry, load_zeroer

from racecheck.atomic_file import write_json_atomically
from fuzz.bench import BenchUsageError, command, positive_int
from racecheck.cli import ArgumentParser, check_output
from fuzz.engine.campaigns import SIM_GEOMETRIES, default_campaigns
from fuzz.bench.detect.report import TARGET_CLEAN_STEPS, judge, plot, render_soak, render_summary, render_table, summarize
from fuzz.bench.detect.baselines import METHODS
from fuzz.bench.detect.run import FUZZ, QUICK, Job, run_jobs
from fuzz.bench.pool import gpu_workers
from fuzz.engine.episode import EpisodeConfig

PROG = "python -m fuzz.bench.detect"
REPORT_VERSION = 1
DEFAULT_BUDGET_S = 60.0
DEFAULT_SEEDS = 5
DEFAULT_REPRO_DIR = Path("repro/failures/detect")  # ignored by git, beside pytest fuzz's traces
SOAK_SEED_BASE = 1000  # soak seeds 1001, 1002...: distinct from the detection run's 1..N
# Race-free implementations run on every small geometry a zoo entry uses, and the campaigns'.
CLEAN_GEOMETRIES = tuple(sorted({*SIM_GEOMETRIES, *(g for z in ZOO if (g := default_geometry(z)) in GEOMETRIES)}))


@dataclass(frozen=True)
class DetectArgs:
    backend: str
    mode: str
    budget_s: float
    seeds: int
    entries: tuple[str, ...]
    skipped: tuple[dict, ...]  # zoo entries left out: {"entry", "reason"}
    methods: tuple[str, ...]
    json: Path | None
    png: Path | None
    repro_dir: Path
    steps_clean: int | None
    jobs: int


AUTO_JOBS = 0  # -j auto: sized by the machine (DetectArgs.jobs)


def workers_for(args: DetectArgs, jobs: list[Job]) -> int:
    """How many worker processes run ``jobs``: ``-j`` as given on the simulator (auto: one per
    CPU core); on cuda at most what the free GPU memory holds (fuzz.engine.gpu_workers), said on
    stderr."""
    requested = args.jobs or os.cpu_count() or 1
    if args.backend != "cuda" or not jobs:
        return requested
    return gpu_workers(PROG, requested, [job.config for job in jobs])


def _names(flag: str, value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise BenchUsageError(f"{flag} {value!r} names nothing; give comma-separated names, e.g. zoo.single_buffer,per_call")
    return names


def parse_args(argv: list[str], cuda_available: bool) -> DetectArgs:
    """Check the command line; every bad value is a :class:`BenchUsageError`."""
    parser = ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        epilog="python -m fuzz.bench.detect plot REPORT.json --png FILE draws a saved report.")
    add = parser.add_argument
    add("--backend", default="sim", help="sim (CPU simulator, default) or cuda")
    add("--mode", default="controlled", help="cuda: controlled (gates) or free (real timing)")
    add("--budget", default=str(DEFAULT_BUDGET_S), help=f"seconds per method, entry and seed (default {DEFAULT_BUDGET_S:g})")
    add("--seeds", default=str(DEFAULT_SEEDS), help=f"seeds 1..N per entry (default {DEFAULT_SEEDS})")
    add("--entries", default=None, help="comma-separated zoo entries and race-free implementations (default: all)")
    add("--methods", default=None, help="comma-separated: fuzz and the baselines (default: fuzz on sim, all on cuda)")
    add("--json", default=None, help="write the report as JSON to this file")
    add("--png", default=None, help="plot the time to detection per entry to this PNG (needs matplotlib)")
    add("--repro-dir", default=str(DEFAULT_REPRO_DIR), help=f"where traces of findings go (default {DEFAULT_REPRO_DIR})")
    add("--steps-clean", default=None, help="soak the race-free implementations for N steps instead (e.g. 1000000)")
    add("-j", "--jobs", default=None,
        help="worker processes, or auto (default: 1 on sim; auto on cuda: as many as the free GPU memory holds, "
             "at most one per CPU core); on cuda never more than the free GPU memory holds")
    options = {k.replace("_", "-"): v for k, v in vars(parser.parse_args(argv)).items()}
    backend = options["backend"]
    if backend not in ("sim", "cuda"):
        raise BenchUsageError(f"--backend {backend!r} is not a backend; choose sim or cuda")
    if backend == "cuda" and not cuda_available:
        raise BenchUsageError("--backend cuda needs a CUDA GPU and none is visible here; use --backend sim")
    mode = options["mode"]
    if mode not in ("controlled", "free"):
        raise BenchUsageError(f"--mode {mode!r} is not a cuda mode; choose controlled (gates) or free (real timing)")
    budget_text = options["budget"]
    try:
        budget = float(budget_text)
    except ValueError:
        raise BenchUsageError(f"--budget {budget_text!r} is not a number of seconds; give a positive number, e.g. 60") from None
    if not (budget > 0 and math.isfinite(budget)):
        raise BenchUsageError(f"--budget {budget_text} must be positive; give seconds per entry and seed, e.g. 60")
    seeds = positive_int("--seeds", options["seeds"], "5")
    jobs_text = options["jobs"] if options["jobs"] is not None else ("auto" if backend == "cuda" else "1")
    jobs = AUTO_JOBS if jobs_text == "auto" else positive_int("-j", jobs_text, "2, or auto")
    steps_clean = (None if options["steps-clean"] is None
                   else positive_int("--steps-clean", options["steps-clean"], "1000000"))

    known = sorted(ZOO + RACE_FREE)
    entries, skipped = [], []
    wanted = _names("--entries", options["entries"]) if options["entries"] is not None else (list(RACE_FREE) if steps_clean else known)
    for name in wanted:
        if name not in known:
            raise BenchUsageError(f"--entries: unknown entry {name!r}; choose from: {', '.join(known)}")
        if steps_clean and name in ZOO:
            raise BenchUsageError(f"--entries: {name!r} is a zoo entry; --steps-clean soaks race-free implementations only ({', '.join(RACE_FREE)})")
        backends = load_zeroer(name).capabilities.backends
        if name in ZOO and backend not in backends:
            reason = f"runs on {', '.join(backends)} only (geometry {default_geometry(name)!r})"
            if options["entries"] is not None:
                raise BenchUsageError(f"--entries: {name!r} {reason}; use --backend cuda")
            skipped.append({"entry": name, "reason": reason})
            continue
        if name not in entries:
            entries.append(name)

    choices = [FUZZ, *sorted(METHODS)]
    if options["methods"] is None:
        methods = [FUZZ] if backend == "sim" or steps_clean else choices
    else:
        methods = _names("--methods", options["methods"])
        for name in methods:
            if name not in choices:
                raise BenchUsageError(f"--methods: unknown method {name!r}; available here: {', '.join(choices)}")
        if steps_clean and methods != [FUZZ]:
            raise BenchUsageError("--steps-clean soaks with the fuzz method only; drop --methods or use --methods fuzz")
    return DetectArgs(
        backend=backend, mode=mode, budget_s=budget, seeds=seeds, entries=tuple(sorted(entries)), skipped=tuple(skipped),
        methods=tuple(methods), json=Path(options["json"]) if options["json"] else None,
        png=Path(options["png"]) if options["png"] else None,
        repro_dir=Path(options["repro-dir"]),
        steps_clean=steps_clean, jobs=jobs,
    )


def entry_config(args: DetectArgs, entry: str, seed: int, geometry: str | None = None, device: int | None = None) -> EpisodeConfig:
    """The episode config of ``entry`` for ``seed``: a zoo entry on its geometry; a race-free
    implementation on ``geometry`` or the zoo geometries in turn, staged designs with the torch
    kernel on the simulator (as ``pytest fuzz`` does)."""
    if entry in ZOO:
        return EpisodeConfig(zeroer=entry, geometry=default_geometry(entry), backend=args.backend, mode=args.mode, device=device)
    geometry = geometry or CLEAN_GEOMETRIES[(seed - 1) % len(CLEAN_GEOMETRIES)]
    kernel = "torch" if args.backend == "sim" and entry != "reference" else None
    return EpisodeConfig(zeroer=entry, geometry=geometry, backend=args.backend, mode=args.mode, kernel=kernel, device=device)


def _device(args: DetectArgs, index: int) -> int | None:
    if args.backend != "cuda" or args.jobs == 1:
        return None
    import torch

    return index % torch.cuda.device_count()  # spread workers over the GPUs


def detection_jobs(args: DetectArgs) -> list[Job]:
    jobs = []
    for method in args.methods:
        for entry in args.entries:
            kind = "zoo" if entry in ZOO else "race-free"
            for seed in range(1, args.seeds + 1):
                config = entry_config(args, entry, seed, device=_device(args, len(jobs)))
                jobs.append(Job(method, entry, kind, seed, config, args.budget_s, str(args.repro_dir)))
    if FUZZ in args.methods:
        jobs += quick_jobs(args, first_index=len(jobs))
    return jobs


def quick_jobs(args: DetectArgs, first_index: int = 0) -> list[Job]:
    """Each zoo entry's campaigns as ``pytest fuzz --zeroer ENTRY --geometry G`` runs them in the
    quick profile (G: the geometry its bug shows on; both shards and the two-zeroer family): the
    quick-profile hit rate per campaign."""
    jobs = []
    for entry in args.entries:
        if entry not in ZOO:
            continue
        for campaign, skipped in default_campaigns([args.backend], entry, (default_geometry(entry),)):
            if skipped is not None or (args.backend == "cuda" and campaign.config.mode != args.mode):
                continue
            config = dataclasses.replace(campaign.config, device=_device(args, first_index + len(jobs)))
            jobs.append(Job(FUZZ, entry, "zoo", campaign.shard, config, None, str(args.repro_dir), profile=QUICK))
    return jobs


def soak_jobs(args: DetectArgs) -> Iterator[Job]:
    """Endless round-robin over race-free implementations x geometries, one fresh seed a round."""
    pairs = [(entry, geometry) for entry in args.entries for geometry in CLEAN_GEOMETRIES]
    index = 0
    for round_ in count(1):
        for entry, geometry in pairs:
            config = entry_config(args, entry, SOAK_SEED_BASE + round_, geometry, device=_device(args, index))
            index += 1
            yield Job(FUZZ, entry, "race-free", SOAK_SEED_BASE + round_, config, None, str(args.repro_dir))


def _progress(i: int, total: int | str, record: dict) -> None:
    if record.get("error"):
        what = f"ERROR {record['error']}"
    elif record["found"]:
        what = f"found after {record['seconds']} s, {record['examples']} examples, {record['trace_len']} ops -> {record['repro']}"
    else:
        what = f"no finding ({record['steps']} steps)"
    if record.get("profile") == QUICK:
        job = f"quick-profile campaign {record['campaign']}"
    else:
        job = f"{record['method']} {record['entry']} on {record['geometry']} seed {record['seed']}"
    print(f"[{i}/{total}] {job}: {what}", file=sys.stderr, flush=True)


def _header(args: DetectArgs, argv: list[str]) -> dict[str, Any]:
    from fuzz.bench.speed import machine

    return {
        "version": REPORT_VERSION,
        "command": shlex.join([Path(sys.executable).name, "-m", "fuzz.bench.detect", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(args.backend),
        "backend": args.backend,
        "mode": args.mode if args.backend == "cuda" else None,
        "jobs": args.jobs or "auto",
    }


def run_detection(args: DetectArgs, argv: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    jobs = detection_jobs(args)
    workers = workers_for(args, jobs)
    records = []
    for i, record in enumerate(run_jobs(jobs, workers), 1):
        _progress(i, len(jobs), record)
        records.append(record)
    records = _rerun_out_of_memory(jobs, records, workers)
    rows = summarize(records)  # the quick-profile campaigns join the fuzz rows of their entries
    summary = judge(rows, list(args.skipped))
    return {
        **_header(args, argv), "kind": "detection", "budget_s": args.budget_s, "seeds": list(range(1, args.seeds + 1)),
        "workers": workers, "methods": list(args.methods), "entries": rows, "summary": summary, "exit_status": summary["exit_status"],
        "seconds": round(time.perf_counter() - started, 1),
    }


def _rerun_out_of_memory(jobs: list[Job], records: list[dict], workers: int) -> list[dict]:
    """Jobs that ran the GPU out of memory beside other workers run again, one at a time; what
    still runs out of memory stays a resource error (racecheck.resources)."""
    key = lambda r: (r["method"], r["entry"], r["seed"], r.get("profile"), r["geometry"])  # noqa: E731
    failed = {key(r) for r in records if r.get("resource_error")}
    if not failed or workers <= 1:
        return records
    again = [job for job in jobs if (job.method, job.entry, job.seed, job.profile, job.config.geometry) in failed]
    print(f"{len(again)} job(s) ran the GPU out of memory beside other workers; running them again one at a time",
          file=sys.stderr, flush=True)
    rerun = {}
    for i, record in enumerate(run_jobs(again, 1), 1):
        _progress(i, len(again), record)
        rerun[key(record)] = record
    return [rerun.get(key(r), r) for r in records]


def run_soak(args: DetectArgs, argv: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    target = args.steps_clean
    records = []
    workers = workers_for(args, list(itertools.islice(soak_jobs(args), 64)))
    for i, record in enumerate(run_jobs(soak_jobs(args), workers, stop=lambda done: sum(r["steps"] for r in done) >= target), 1):
        _progress(i, "?", record)
        records.append(record)
    by_config: dict[tuple[str, str], dict] = {}
    for r in records:
        c = by_config.setdefault((r["entry"], r["geometry"]), {"entry": r["entry"], "geometry": r["geometry"], "runs": 0, "examples": 0, "steps": 0})
        c["runs"] += 1
        c["examples"] += r["examples"] or 0
        c["steps"] += r["steps"]
    findings = [{k: r[k] for k in ("entry", "geometry", "seed", "message", "repro", "error")} for r in records if r["found"] or r["error"]]
    seconds = time.perf_counter() - started
    steps = sum(r["steps"] for r in records)
    return {
        **_header(args, argv), "kind": "clean-soak", "target_steps": target, "steps": steps,
        "examples": sum(r["examples"] or 0 for r in records), "runs": len(records), "seconds": round(seconds, 1),
        "steps_per_s": round(steps / seconds, 1) if seconds > 0 else None,
        "by_config": sorted(by_config.values(), key=lambda c: (c["entry"], c["geometry"])),
        "findings": findings, "met": steps >= target and not findings and target >= TARGET_CLEAN_STEPS,
        "exit_status": 1 if findings else 0,
    }


def _try_plot(report: dict, png: Path) -> str | None:
    """Draw ``report`` to ``png``; the reason when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot written, the JSON has the numbers"
    plot(report, png)
    return None


def plot_main(argv: list[str]) -> int:
    """``python -m fuzz.bench.detect plot REPORT.json --png FILE``."""
    if argv in (["-h"], ["--help"]):
        print(f"usage: {PROG} plot REPORT.json --png FILE: draw a report written by --json")
        return 0
    if len(argv) != 3 or argv[1] != "--png":
        raise BenchUsageError(f"usage: {PROG} plot REPORT.json --png FILE (got: {' '.join(argv) or 'nothing'})")
    source, png = Path(argv[0]), Path(argv[2])
    try:
        report = json.loads(source.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BenchUsageError(f"cannot read the report {source}: {error}; give a JSON file written by --json") from None
    if not isinstance(report, dict) or report.get("kind") != "detection":
        kind = report.get("kind") if isinstance(report, dict) else type(report).__name__
        raise BenchUsageError(f"{source} is a {kind!r} report; only detection reports have times to plot")
    check_output("--png", png)
    why = _try_plot(report, png)
    if why:
        raise BenchUsageError(why)
    print(f"plot written to {png}")
    return 0


@command(PROG)
def main(argv: list[str]) -> int:
    """The exit status (:mod:`racecheck.cli`; see the module docstring)."""
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    import torch

    args = parse_args(argv, torch.cuda.is_available())
    check_output("--json", args.json)
    check_output("--png", args.png)
    check_output("--repro-dir", args.repro_dir, "directory")
    if args.steps_clean:
        report = run_soak(args, argv)
        print(render_soak(report))
    else:
        report = run_detection(args, argv)
        print(render_table(report["entries"]))
        print()
        print(render_summary(report["summary"]))
    if args.json is not None:
        write_json_atomically(args.json, report)  # a reader never sees half a report
        print(f"JSON written to {args.json}")
    if args.png is not None and not args.steps_clean:
        why = _try_plot(report, args.png)
        print(f"warning: {why}" if why else f"plot written to {args.png}", file=sys.stderr if why else sys.stdout)
    return report["exit_status"]

