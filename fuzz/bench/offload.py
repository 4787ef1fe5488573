"""The detection table for offloaders: the engine-pattern examples, by each method, racy and race-free.

``python -m fuzz.bench.offload`` runs every factory of examples/engine_offloaders.py (or
``--entries``) under each method, once per seed, each for at most ``--budget`` seconds, and writes
one row per example and method: how many seeds found a race, the seconds to the first finding
(median), the length of the shrunk trace, how often that trace showed again in 20 replays, and the
steps run. The methods:

* ``fuzz-sim``: ``pytest fuzz --offloader`` on the CPU simulator;
* ``fuzz-controlled``, ``fuzz-free``: the same on a GPU, with the schedule forced by gates (a found
  trace's 20 replays are forced too), or on real timing;
* ``stress``: a random loop over the same ops, judged by values only (what a user would write
  first; fuzz/bench/detect/baselines/stress.py), on the GPU where there is one, free-running;
* ``torch-sanitizer``: that loop under PyTorch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``);
  a detection is its report.

A race-free example found by any method is a false alarm. ``--steps-clean N`` soaks the race-free
examples instead: each is fuzzed with fresh seeds (``fuzz-free`` on a GPU, ``fuzz-sim`` here) until
it has run N steps; any finding fails it.

Exit status: 0 when every racy example was found by every fuzz method run, on every seed, with a
trace of at most 6 ops that showed again in 20 of 20 replays (at least 19 of 20 forced replays in
the controlled mode), and no race-free one was; 1 otherwise, a finding without its trace length or
its replays included; 2 for a bad command line.

Run it::

    python -m fuzz.bench.offload --json offload-sim.json                                  # CPU: fuzz-sim and stress
    python -m fuzz.bench.offload --backend cuda -j 8 --json offload-h200.json             # every method
    python -m fuzz.bench.offload --backend cuda --steps-clean 20000 -j 4 --json soak.json # race-free, free-running
"""

from __future__ import annotations

import datetime
import math
import runpy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_json_atomically
from fuzz.bench.detect.run import FUZZ, REPLAYS, Job, run_jobs
from fuzz.bench.stats import median
from fuzz.bench import BenchUsageError, command, positive_int
from racecheck.cli import ArgumentParser, check_output
from fuzz.engine.episode import EpisodeConfig
from racecheck.environment import environment

PROG = "python -m fuzz.bench.offload"
DEFAULT_FILE = "examples/engine_offloaders.py"  # relative to the working directory: run from the checkout
# method -> (the detect method it runs, backend, cuda mode)
METHODS: dict[str, tuple[str, str, str]] = {
    "fuzz-sim": (FUZZ, "sim", "controlled"),
    "fuzz-controlled": (FUZZ, "cuda", "controlled"),
    "fuzz-free": (FUZZ, "cuda", "free"),
    "stress": ("stress", "cuda", "free"),
    "torch-sanitizer": ("sanitizer", "cuda", "free"),
}
FUZZ_METHODS = ("fuzz-sim", "fuzz-controlled", "fuzz-free")
MAX_TRACE = 6  # ops, start included: what a found race must shrink to
MIN_FORCED = 19  # of 20 forced replays in the controlled mode; every other fuzz method, all 20
DEFAULT_REPRO_DIR = Path("repro/failures/offload")


@dataclass(frozen=True)
class Args:
    file: str
    backend: str
    methods: tuple[str, ...]
    entries: tuple[str, ...]
    seeds: int
    budget_s: float
    steps_clean: int | None
    geometry: str
    host_memory: str
    jobs: int
    json: Path | None
    repro_dir: Path


def verdicts(file: str = DEFAULT_FILE) -> dict[str, str]:
    """The ``VERDICTS`` of a file of offloaders (factory name -> "racy" or "race-free")."""
    path = Path(file)
    if not path.is_file():
        raise BenchUsageError(f"--file {file!r} does not exist; run from the kvzero-fuzz checkout, or name a file "
                              f"of offloader factories with a VERDICTS dict")
    found = runpy.run_path(str(path)).get("VERDICTS")
    if not isinstance(found, dict) or not found or not set(found.values()) <= {"racy", "race-free"}:
        raise BenchUsageError(f"--file {file!r} has no VERDICTS dict of factory name -> 'racy' or 'race-free'")
    return dict(found)


def parse_args(argv: list[str], cuda_available: bool) -> Args:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default=DEFAULT_FILE, help=f"the offloader factories and their VERDICTS (default {DEFAULT_FILE})")
    parser.add_argument("--backend", default="sim", help="sim (fuzz-sim and stress on the simulator) or cuda (every method)")
    parser.add_argument("--methods", default=None, help=f"comma-separated, of: {', '.join(METHODS)}")
    parser.add_argument("--entries", default=None, help="comma-separated factory names of examples/engine_offloaders.py")
    parser.add_argument("--seeds", default="3", help="seeds per example and method (default 3)")
    parser.add_argument("--budget", default="60", help="seconds per example, method and seed (default 60)")
    parser.add_argument("--steps-clean", default=None, help="soak the race-free examples until N steps each instead")
    parser.add_argument("--geometry", default="tiny", help="the KV-cache preset (default tiny)")
    parser.add_argument("--host-memory", default="pinned", help="pinned or registered (default pinned)")
    parser.add_argument("-j", "--jobs", default="1", help="worker processes (default 1)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--repro-dir", default=str(DEFAULT_REPRO_DIR), help="where traces of findings go")
    options = parser.parse_args(argv)
    if options.backend not in ("sim", "cuda"):
        raise BenchUsageError(f"--backend {options.backend!r} is not a backend; choose sim or cuda")
    if options.backend == "cuda" and not cuda_available:
        raise BenchUsageError("--backend cuda needs a CUDA GPU and none is visible here; use --backend sim")
    known = verdicts(options.file)
    entries = tuple(known) if options.entries is None else tuple(n.strip() for n in options.entries.split(",") if n.strip())
    for name in entries or ("",):
        if name not in known:
            raise BenchUsageError(f"--entries: {name!r} is not an example; choose from {', '.join(known)}")
    steps_clean = None if options.steps_clean is None else positive_int("--steps-clean", options.steps_clean, "20000")
    if options.methods is None:
        methods = (("fuzz-free",) if steps_clean else tuple(METHODS)) if options.backend == "cuda" else ("fuzz-sim",) + (() if steps_clean else ("stress",))
    else:
        methods = tuple(m.strip() for m in options.methods.split(",") if m.strip())
        for name in methods or ("",):
            if name not in METHODS:
                raise BenchUsageError(f"--methods: {name!r} is not a method; choose from {', '.join(METHODS)}")
            if METHODS[name][1] == "cuda" and options.backend != "cuda" and name != "stress":
                raise BenchUsageError(f"--methods: {name!r} needs --backend cuda")
    try:
        budget = float(options.budget)
    except ValueError:
        budget = -1.0
    if not (budget > 0 and math.isfinite(budget)):
        raise BenchUsageError(f"--budget {options.budget!r} must be a positive number of seconds, e.g. 60")
    if options.host_memory not in ("pinned", "registered"):
        raise BenchUsageError(f"--host-memory {options.host_memory!r}; choose pinned or registered")
    from zeroer.cache.geometries import GEOMETRIES

    if options.geometry not in GEOMETRIES:
        raise BenchUsageError(f"--geometry {options.geometry!r}; choose one of {', '.join(sorted(GEOMETRIES))}")
    json_path = None if options.json is None else check_output("--json", Path(options.json), "file path")
    return Args(options.file, options.backend, methods, entries, positive_int("--seeds", options.seeds, "3"), budget, steps_clean,
                options.geometry, options.host_memory, positive_int("-j", options.jobs, "4"), json_path, Path(options.repro_dir))


def _config(args: Args, entry: str, method: str) -> EpisodeConfig:
    _, backend, mode = METHODS[method]
    if backend == "cuda" and args.backend != "cuda":
        backend = "sim"  # the stress loop on the simulator where there is no GPU
    return EpisodeConfig(offloader=f"{args.file}:{entry}", geometry=args.geometry, backend=backend, mode=mode,
                         host_memory=args.host_memory)


def jobs_for(args: Args) -> list[Job]:
    known = verdicts(args.file)
    jobs = []
    for method in args.methods:
        for entry in args.entries:
            kind = "zoo" if known[entry] == "racy" else "race-free"
            if args.steps_clean is not None and kind == "zoo":
                continue
            for seed in range(1, args.seeds + 1):
                jobs.append(Job(METHODS[method][0], entry, kind, seed, _config(args, entry, method), args.budget_s,
                                str(args.repro_dir)))
    return jobs


def _method_of(record: dict) -> str:
    detect, backend, mode = record["method"], record["backend"], record["mode"]
    if detect != FUZZ:
        return {"stress": "stress", "sanitizer": "torch-sanitizer"}[detect]
    return "fuzz-sim" if backend == "sim" else f"fuzz-{mode}"


def summarize(records: list[dict], known: dict[str, str]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for record in records:
        key = (record["entry"], _method_of(record))
        row = rows.setdefault(key, {"entry": key[0], "verdict": known[key[0]], "method": key[1], "runs": 0, "found": 0,
                                    "seconds": [], "trace_len": [], "reproduced": [], "steps": 0, "errors": [],
                                    "no_trace_len": 0, "no_replays": 0})
        row["runs"] += 1
        row["steps"] += record["steps"] or 0
        if record.get("error"):
            row["errors"].append(record["error"])
        if record["found"]:
            row["found"] += 1
            if record["seconds"] is not None:
                row["seconds"].append(record["seconds"])
            if record["trace_len"] is not None:
                row["trace_len"].append(record["trace_len"])
            else:
                row["no_trace_len"] += 1
            if record.get("reproduced") is not None and record.get("replays") is not None:
                row["reproduced"].append(f"{record['reproduced']}/{record['replays']}")
            else:
                row["no_replays"] += 1
    for row in rows.values():
        row["median_s"] = round(median(row["seconds"]), 2) if row["seconds"] else None
    return sorted(rows.values(), key=lambda r: (r["verdict"] != "racy", r["entry"], list(METHODS).index(r["method"])))


def judge(rows: list[dict]) -> list[str]:
    """What fails the run (empty: it passed): the promise of the module docstring, row by row.

    A racy example's fuzz row passes only with every seed's finding measured: its trace length at
    most :data:`MAX_TRACE` and its :data:`REPLAYS` replays showing it every time (at least
    :data:`MIN_FORCED` forced ones in the controlled mode). A finding without its trace length or
    its replays fails the row: what was not measured was not shown.
    """
    failures = []
    for row in rows:
        where = f"{row['entry']} / {row['method']}"
        if row["errors"]:
            failures.append(f"{where}: {row['errors'][0]}")
        elif row["verdict"] == "race-free" and row["found"]:
            failures.append(f"{where}: a race-free example was reported racy")
        elif row["verdict"] == "racy" and row["method"] in FUZZ_METHODS:
            needed = MIN_FORCED if row["method"] == "fuzz-controlled" else REPLAYS
            short = [r for r in row["reproduced"] if _shown(r) < needed]
            if row["found"] < row["runs"]:
                failures.append(f"{where}: found on {row['found']} of {row['runs']} seeds")
            elif row["no_trace_len"]:
                failures.append(f"{where}: {row['no_trace_len']} finding(s) without a trace length "
                                f"(at most {MAX_TRACE} ops needed)")
            elif any(n > MAX_TRACE for n in row["trace_len"]):
                failures.append(f"{where}: a trace of {max(row['trace_len'])} ops (at most {MAX_TRACE})")
            elif row["no_replays"]:
                failures.append(f"{where}: {row['no_replays']} finding(s) without replay data "
                                f"(at least {needed}/{REPLAYS} replays needed)")
            elif short:
                forced = "forced " if row["method"] == "fuzz-controlled" else ""
                failures.append(f"{where}: {forced}replays {', '.join(short)} (at least {needed}/{REPLAYS})")
    return failures


def _shown(reproduced: str) -> int:
    """How many of :data:`REPLAYS` replays showed the finding, from ``"k/n"``; fewer replays count as none."""
    shown, replays = (int(n) for n in reproduced.split("/"))
    return shown if replays == REPLAYS else -1


def render(rows: list[dict]) -> str:
    lines = ["| example | verdict | method | found | median s to find | trace ops | replays showing it | steps |",
             "| --- | --- | --- | ---: | ---: | --- | --- | ---: |"]
    for row in rows:
        found = f"{row['found']}/{row['runs']}" + (" (error)" if row["errors"] else "")
        lines.append(f"| `{row['entry']}` | {row['verdict']} | {row['method']} | {found} | "
                     f"{row['median_s'] if row['median_s'] is not None else '-'} | "
                     f"{', '.join(map(str, sorted(set(row['trace_len'])))) or '-'} | "
                     f"{', '.join(sorted(set(row['reproduced']))) or '-'} | {row['steps']:,} |")
    return "\n".join(lines)


@command(PROG)
def main(argv: list[str]) -> int:
    import torch

    args = parse_args(argv, torch.cuda.is_available())
    if args.steps_clean is not None:
        return _soak(args, argv)
    known = verdicts(args.file)
    started = time.perf_counter()
    records = []
    for record in run_jobs(jobs_for(args), args.jobs):
        records.append(record)
        print(f"[{len(records)}] {record['entry']} {_method_of(record)} seed {record['seed']}: "
              f"{'FOUND' if record['found'] else 'clean'} {record['message'][:100]}", file=sys.stderr, flush=True)
    rows = summarize(records, known)
    failures = judge(rows)
    print(render(rows))
    for failure in failures:
        print(f"FAILED: {failure}")
    _write(args, argv, {"rows": rows, "records": records, "failures": failures,
                        "seconds": round(time.perf_counter() - started, 1)})
    return 1 if failures else 0


def _soak(args: Args, argv: list[str]) -> int:
    """Each race-free example fuzzed with fresh seeds until ``steps_clean`` steps; any finding fails."""
    known = verdicts(args.file)
    entries = [e for e in args.entries if known[e] == "race-free"]
    method = args.methods[0]
    totals = {e: 0 for e in entries}
    findings: list[dict] = []
    seed = 1000
    started = time.perf_counter()
    while any(totals[e] < args.steps_clean for e in entries) and not findings:
        seed += 1
        jobs = [Job(METHODS[method][0], e, "race-free", seed, _config(args, e, method), args.budget_s, str(args.repro_dir))
                for e in entries if totals[e] < args.steps_clean]
        for record in run_jobs(jobs, args.jobs):
            totals[record["entry"]] += record["steps"] or 0
            if record["found"] or record.get("error"):
                findings.append(record)
        print(f"soak: {', '.join(f'{e} {n:,}' for e, n in totals.items())} steps", file=sys.stderr, flush=True)
    lines = ["| example | method | steps | findings |", "| --- | --- | ---: | ---: |"]
    lines += [f"| `{e}` | {method} | {totals[e]:,} | {sum(r['entry'] == e for r in findings)} |" for e in entries]
    print("\n".join(lines))
    _write(args, argv, {"soak": totals, "method": method, "findings": findings,
                        "seconds": round(time.perf_counter() - started, 1)})
    return 1 if findings else 0


def _write(args: Args, argv: list[str], body: dict) -> None:
    if args.json is None:
        return
    report = {"command": f"{PROG} {' '.join(argv)}", "date": datetime.date.today().isoformat(),
              "environment": environment(), "geometry": args.geometry, "host_memory": args.host_memory, **body}
    write_json_atomically(args.json, report)


if __name__ == "__main__":
    sys.exit(main())
