"""How well the fuzzer finds real bug classes: every zoo entry, and no false positive.

``python -m fuzz.bench.detect`` runs each detection method (the fuzzer, and the baselines of
``fuzz/bench/detect/baselines/__init__.py`` where asked) against every zoo entry (``zeroer/zoo``, on the geometry its
bug shows on) and every race-free implementation (``per_call``, ``event_ring``, ``reference``,
rotated over the zoo's geometries), once per seed 1..N, each for at most ``--budget`` seconds.
Per entry it reports whether it was found, the seconds and examples to the first finding
(median and range over seeds), the seconds including shrinking, the length of the shrunk trace
and the path of its repro trace; then the detection rate against its target (every zoo entry on
every seed, median within 60 s) and the false positives.

Exit status: 0 when the ``fuzz`` method found every zoo entry on every seed and nothing on the
race-free implementations; 1 otherwise (a missed entry, a false positive, a method that raised);
2 for a bad command line. Baselines are reported, never judged.

``--steps-clean N`` is the false-positive soak instead: the race-free implementations, on every
geometry the zoo uses, fuzzed with fresh seeds until N steps in total (target 1,000,000 on the
simulator); any finding fails it. ``plot REPORT.json --png FILE`` draws a saved report.

Run it::

    PYTHONPATH=. python -m fuzz.bench.detect --seeds 5 -j 2 --json detect-sim.json --png detect-sim.png
    PYTHONPATH=. python -m fuzz.bench.detect --steps-clean 1000000 -j 2 --json soak-sim.json
    python -m fuzz.bench.detect --backend cuda --mode controlled --json detect-h200.json    # all methods
    python -m fuzz.bench.detect plot detect-sim.json --png detect-sim.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, Iterator

from zeroer.cache.geometries import GEOMETRIES
from zeroer.registry import RACE_FREE, ZOO, default_geometry, load_zeroer

from fuzz.atomic_file import write_json_atomically
from fuzz.engine.campaigns import SIM_GEOMETRIES
from fuzz.bench.detect.report import TARGET_CLEAN_STEPS, judge, plot, render_soak, render_summary, render_table, summarize
from fuzz.bench.detect.baselines import METHODS
from fuzz.bench.detect.run import FUZZ, Job, run_jobs
from fuzz.engine.episode import EpisodeConfig

REPORT_VERSION = 1
DEFAULT_BUDGET_S = 60.0
DEFAULT_SEEDS = 5
DEFAULT_REPRO_DIR = Path("repro/failures/detect")  # ignored by git, beside pytest fuzz's traces
SOAK_SEED_BASE = 1000  # soak seeds 1001, 1002...: distinct from the detection run's 1..N
# Race-free implementations run on every small geometry a zoo entry uses, and the campaigns'.
CLEAN_GEOMETRIES = tuple(sorted({*SIM_GEOMETRIES, *(g for z in ZOO if (g := default_geometry(z)) in GEOMETRIES)}))


class DetectUsageError(ValueError):
    """A bad command line; the message names the value and the fix."""


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


def _positive_int(flag: str, value: str, example: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise DetectUsageError(f"{flag} {value!r} must be a positive int, e.g. {example}")
    return number


def _names(flag: str, value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise DetectUsageError(f"{flag} {value!r} names nothing; give comma-separated names, e.g. zoo.single_buffer,per_call")
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fuzz.bench.detect", description=__doc__.split("\n\n")[0],
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
    add("-j", "--jobs", default="1", help="worker processes (default 1)")
    return parser


def parse_args(argv: list[str], cuda_available: bool) -> DetectArgs:
    """Check the command line; every bad value is a :class:`DetectUsageError`."""
    options = {k.replace("_", "-"): v for k, v in vars(_parser().parse_args(argv)).items()}
    backend = options["backend"]
    if backend not in ("sim", "cuda"):
        raise DetectUsageError(f"--backend {backend!r} is not a backend; choose sim or cuda")
    if backend == "cuda" and not cuda_available:
        raise DetectUsageError("--backend cuda needs a CUDA GPU and none is visible here; use --backend sim")
    mode = options["mode"]
    if mode not in ("controlled", "free"):
        raise DetectUsageError(f"--mode {mode!r} is not a cuda mode; choose controlled (gates) or free (real timing)")
    budget_text = options["budget"]
    try:
        budget = float(budget_text)
    except ValueError:
        raise DetectUsageError(f"--budget {budget_text!r} is not a number of seconds; give a positive number, e.g. 60") from None
    if not budget > 0:
        raise DetectUsageError(f"--budget {budget_text} must be positive; give seconds per entry and seed, e.g. 60")
    seeds = _positive_int("--seeds", options["seeds"], "5")
    jobs = _positive_int("-j", options["jobs"], "2")
    steps_clean = None if options["steps-clean"] is None else _positive_int("--steps-clean", options["steps-clean"], "1000000")

    known = sorted(ZOO + RACE_FREE)
    entries, skipped = [], []
    wanted = _names("--entries", options["entries"]) if options["entries"] is not None else (list(RACE_FREE) if steps_clean else known)
    for name in wanted:
        if name not in known:
            raise DetectUsageError(f"--entries: unknown entry {name!r}; choose from: {', '.join(known)}")
        if steps_clean and name in ZOO:
            raise DetectUsageError(f"--entries: {name!r} is a zoo entry; --steps-clean soaks race-free implementations only ({', '.join(RACE_FREE)})")
        backends = load_zeroer(name).capabilities.backends
        if name in ZOO and backend not in backends:
            reason = f"runs on {', '.join(backends)} only (geometry {default_geometry(name)!r})"
            if options["entries"] is not None:
                raise DetectUsageError(f"--entries: {name!r} {reason}; use --backend cuda")
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
                raise DetectUsageError(f"--methods: unknown method {name!r}; available here: {', '.join(choices)}")
        if steps_clean and methods != [FUZZ]:
            raise DetectUsageError("--steps-clean soaks with the fuzz method only; drop --methods or use --methods fuzz")
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
    print(f"[{i}/{total}] {record['method']} {record['entry']} on {record['geometry']} seed {record['seed']}: {what}", file=sys.stderr, flush=True)


def _header(args: DetectArgs, argv: list[str]) -> dict[str, Any]:
    from fuzz.bench.speed import machine

    return {
        "version": REPORT_VERSION,
        "command": shlex.join([Path(sys.executable).name, "-m", "fuzz.bench.detect", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(args.backend),
        "backend": args.backend,
        "mode": args.mode if args.backend == "cuda" else None,
        "jobs": args.jobs,
    }


def run_detection(args: DetectArgs, argv: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    jobs = detection_jobs(args)
    records = []
    for i, record in enumerate(run_jobs(jobs, args.jobs), 1):
        _progress(i, len(jobs), record)
        records.append(record)
    rows = summarize(records)
    summary = judge(rows, list(args.skipped))
    return {
        **_header(args, argv), "kind": "detection", "budget_s": args.budget_s, "seeds": list(range(1, args.seeds + 1)),
        "methods": list(args.methods), "entries": rows, "summary": summary, "exit_status": summary["exit_status"],
        "seconds": round(time.perf_counter() - started, 1),
    }


def run_soak(args: DetectArgs, argv: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    target = args.steps_clean
    records = []
    for i, record in enumerate(run_jobs(soak_jobs(args), args.jobs, stop=lambda done: sum(r["steps"] for r in done) >= target), 1):
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
    if len(argv) != 3 or argv[1] != "--png":
        print("error: usage: python -m fuzz.bench.detect plot REPORT.json --png FILE", file=sys.stderr)
        return 2
    source, png = Path(argv[0]), Path(argv[2])
    try:
        report = json.loads(source.read_text())
    except (OSError, json.JSONDecodeError) as error:
        print(f"error: cannot read the report {source}: {error}", file=sys.stderr)
        return 2
    if report.get("kind") != "detection":
        print(f"error: {source} is a {report.get('kind')!r} report; only detection reports have times to plot", file=sys.stderr)
        return 2
    why = _try_plot(report, png)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    print(f"plot written to {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    import torch

    try:
        args = parse_args(argv, torch.cuda.is_available())
    except DetectUsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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

