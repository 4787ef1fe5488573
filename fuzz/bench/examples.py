"""Engine-style zeroers judged end to end: every campaign, every finding replayed, race-free ones soaked.

A file of plain torch zeroers (``examples/engine_zeroers.py``: written the way vLLM writes its
``KVBlockZeroer``) says what each factory is in a module-level ``VERDICTS`` dict (``"racy"`` or
``"race-free"``). This runs, on one backend, through the code ``pytest fuzz --zeroer`` runs:

* **campaigns**: every campaign of every factory in the quick profile: every geometry it
  supports, both shards and the two-zeroer (``x2``) campaign; on cuda in the controlled mode, and
  the race-free ones in the free-running mode too (a racy one there shows only when timing allows);
* **replays**: each finding's shrunk trace, replayed ``--replays`` times where it was found (the
  controlled mode forces its schedule on a GPU), as ``python -m repro replay`` does;
* **soak** (``--soak-steps``): each race-free factory fuzzed with fresh seeds on geometry ``tiny``
  until that many steps ran (on cuda in the free-running mode: real timing).

The targets, each reported beside its number: a race-free factory has no finding, a racy one is
found in every campaign, every shrunk trace is at most :data:`MAX_TRACE_OPS` ops, and every replay
shows it; nothing is a harness or resource error. Exit status (:mod:`racecheck.cli`): 0 when every
target is met, 1 when one is missed, 2 for bad arguments (one line naming the value), 3 for a
harness error or a bug in this tool.

Run it::

    python -m fuzz.bench.examples                                    # the simulator, every core
    python -m fuzz.bench.examples --backend cuda --soak-steps 20000 --json h200.json
    python -m fuzz.bench.examples --geometry tiny --replays 2 -j 1   # a quick look
"""

from __future__ import annotations

import datetime
import os
import runpy
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_json_atomically
from fuzz.bench.pool import completed, gpu_workers, init_worker
from fuzz.bench.speed import machine
from fuzz.bench import command
from racecheck.cli import CLEAN, FINDING, ArgumentParser, UsageError, check_output, positive
from fuzz.engine.campaigns import PROFILES, Campaign, default_campaigns, run_campaign
from fuzz.engine.episode import count_shown
from racecheck.resources import ResourceExhausted
from fuzz.engine.summary import harness_status, not_judged, result_record
from fuzz.trace import load_trace
from zeroer.cache.geometries import GEOMETRIES, LARGE_GEOMETRIES

PROG = "python -m fuzz.bench.examples"
DEFAULT_FILE = "examples/engine_zeroers.py"
VERDICTS = ("racy", "race-free")
MAX_TRACE_OPS = 4
DEFAULT_REPLAYS = 20
SOAK_GEOMETRY = "tiny"


@dataclass(frozen=True)
class Job:
    """One unit of work, run in a worker process: a campaign, a replay or a soak run."""

    kind: str  # "campaign", "replay" or "soak"
    spec: str
    verdict: str
    campaign: Campaign | None = None
    trace: str | None = None  # replay: the trace file
    replays: int = 0
    seed: int | None = None  # soak: the Hypothesis seed of this run
    repro_dir: str = ""


def load_verdicts(path: str) -> dict[str, str]:
    """``{spec: verdict}`` from the ``VERDICTS`` dict of the file at ``path``."""
    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise UsageError(f"{path!r} is not a Python file; give a file of zeroer factories, e.g. {DEFAULT_FILE}")
    try:
        module = runpy.run_path(str(file))  # the file's globals
    except Exception as error:  # noqa: BLE001 - the user's file: say which and why
        raise UsageError(f"{path}: importing it failed: {error!r}") from None
    verdicts = module.get("VERDICTS")
    if not isinstance(verdicts, dict) or not verdicts:
        raise UsageError(f"{path} has no VERDICTS dict; add one naming each factory's verdict, e.g. "
                         f"VERDICTS = {{'my_factory': 'race-free'}}")
    bad = {name: verdict for name, verdict in verdicts.items() if verdict not in VERDICTS or name not in module}
    if bad:
        name, verdict = next(iter(bad.items()))
        raise UsageError(f"{path}: VERDICTS[{name!r}] = {verdict!r}; each key must be a factory of the file and each "
                         f"value one of {', '.join(VERDICTS)}")
    return {f"{file.as_posix()}:{name}": verdict for name, verdict in sorted(verdicts.items())}


def campaign_jobs(verdicts: dict[str, str], backend: str, geometries: tuple[str, ...] | None,
                  repro_dir: str, modes: tuple[str, ...] = ("controlled", "free")) -> list[Job]:
    """Every campaign ``pytest fuzz --zeroer SPEC`` runs for each factory (skipped ones left out;
    on cuda, in ``modes``)."""
    jobs = []
    for spec, verdict in verdicts.items():
        expect = "finds" if verdict == "racy" else "clean"
        for campaign, skipped in default_campaigns([backend], spec, geometries):
            if backend == "cuda" and campaign.config.mode not in modes:
                continue
            if skipped is not None or (campaign.config.mode == "free" and verdict == "racy"):
                continue  # a race in the free-running mode shows only when timing allows
            jobs.append(Job("campaign", spec, verdict, replace(campaign, expect=expect), repro_dir=repro_dir))
    return jobs


def run_job(job: Job) -> dict[str, Any]:
    """Run ``job`` and return a plain record (it crosses process boundaries)."""
    started = time.perf_counter()
    base: dict[str, Any] = {"kind": job.kind, "spec": job.spec, "verdict": job.verdict}
    if job.kind == "replay":
        trace = load_trace(Path(job.trace))
        lost = None
        try:
            shown = count_shown(trace.config, trace.ops, job.replays)
        except ResourceExhausted as error:  # out of memory, or a GPU fault: no count either way
            shown, lost = 0, str(error)
        record = {**base, "trace": job.trace, "ops": len(trace.ops), "replays": job.replays, "shown": shown,
                  "mode": trace.config.mode if trace.config.backend == "cuda" else "sim", "resource_error": lost}
    else:
        campaign = job.campaign
        seed = job.seed if job.kind == "soak" else None
        result = run_campaign(campaign, PROFILES["quick"], Path(job.repro_dir), seed_override=seed)
        record = {**base, **result_record(result), "seed": seed}
    record["wall_s"] = round(time.perf_counter() - started, 3)
    return record


def run_jobs(jobs: Iterable[Job], workers: int, follow_up: Callable[[dict], list[Job]], device: int | None,
             deadline: float | None = None) -> Iterator[dict]:
    """Yield each job's record as it completes, in ``workers`` spawned processes (1: in this
    one); ``follow_up(record)`` returns jobs to queue after it (replays of a finding, more soak).
    Past ``deadline`` (``time.monotonic()``) no job starts: each one left is yielded as a
    ``not run`` record."""
    queue = list(jobs)
    if workers <= 1:
        init_worker(device)
    # On cuda each job gets a process of its own: a GPU fault (racecheck.resources.DeviceFault)
    # leaves a process's CUDA context unusable, and must not take the jobs after it down too.
    for record in completed(run_job, lambda: queue.pop(0) if queue else None, workers,
                            initargs=(device,), may_start=lambda: deadline is None or time.monotonic() < deadline,
                            process_per_job=device is not None):
        queue.extend(follow_up(record))
        yield record
    for job in queue:
        yield {"kind": "not run", "job": job.kind, "spec": job.spec, "verdict": job.verdict,
               "campaign": job.campaign.id if job.campaign is not None else None, "trace": job.trace}


class Soak:
    """Fresh-seed runs of each race-free factory, ``per_spec`` at a time, until ``steps`` ran
    (or one found something)."""

    def __init__(self, verdicts: dict[str, str], backend: str, steps: int, repro_dir: str) -> None:
        self.steps = steps
        self.repro_dir = repro_dir
        mode = "free" if backend == "cuda" else "controlled"
        self.campaigns: dict[str, Campaign] = {}
        for spec, verdict in verdicts.items():
            if verdict != "race-free" or steps <= 0:
                continue
            for campaign, skipped in default_campaigns([backend], spec, (SOAK_GEOMETRY,)):
                if skipped is None and campaign.config.mode == mode and campaign.config.zeroers == 1 and campaign.shard == 0:
                    self.campaigns[spec] = replace(campaign, expect="clean")
        self.done = {spec: 0 for spec in self.campaigns}
        self.stopped: set[str] = set()
        self._seeds = iter(range(1, 1 << 30))

    def _job(self, spec: str) -> list[Job]:
        if spec in self.stopped or self.done[spec] >= self.steps:
            return []
        return [Job("soak", spec, "race-free", self.campaigns[spec], seed=next(self._seeds), repro_dir=self.repro_dir)]

    def start(self, per_spec: int) -> list[Job]:
        return [job for spec in self.campaigns for _ in range(per_spec) for job in self._job(spec)]

    def ran(self, record: dict) -> list[Job]:
        spec = record["spec"]
        self.done[spec] += record["steps"]
        if record["found"] or record.get("harness_error") or record.get("resource_error"):
            self.stopped.add(spec)
        return self._job(spec)


def summarize(verdicts: dict[str, str], records: list[dict], replays: int, soak_steps: int) -> list[dict]:
    """Per factory: its numbers and whether each target is met."""
    rows = []
    for spec, verdict in verdicts.items():
        campaigns = [r for r in records if r["spec"] == spec and r["kind"] == "campaign"]
        not_run = [r for r in records if r["spec"] == spec and r["kind"] == "not run"]
        shown = [r for r in records if r["spec"] == spec and r["kind"] == "replay"]
        soaked = [r for r in records if r["spec"] == spec and r["kind"] == "soak"]
        errors = [r for r in campaigns + soaked + shown if r.get("harness_error") or r.get("resource_error")]
        found = [r for r in campaigns if r["found"]]
        ops = [r["trace_ops"] for r in found if r.get("trace_ops") is not None]
        row = {
            "spec": spec, "verdict": verdict, "campaigns": len(campaigns), "found": len(found),
            "errors": [r.get("harness_error") or r.get("resource_error") for r in errors],
            "max_trace_ops": max(ops, default=None),
            "replayed": sum(r["shown"] for r in shown), "replays": sum(r["replays"] for r in shown),
            "soak_steps": sum(r["steps"] for r in soaked), "soak_findings": sum(1 for r in soaked if r["found"]),
            "seconds": round(sum(r["seconds"] for r in campaigns), 1),
            "not_run": len(not_run),
        }
        if verdict == "racy":
            row["met"] = bool(campaigns) and len(found) == len(campaigns) and not errors and max(ops, default=99) <= MAX_TRACE_OPS \
                and row["replayed"] == row["replays"] == replays * len(found)
        else:
            row["met"] = bool(campaigns) and not found and not errors and not row["soak_findings"] \
                and row["soak_steps"] >= soak_steps
        row["met"] = row["met"] and not not_run  # cut off by --max-seconds: not shown
        rows.append(row)
    return rows


def table(rows: list[dict], backend: str) -> str:
    lines = [f"| example ({backend}) | verdict | campaigns | with a finding | longest trace | replays shown | soak steps | errors | target |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        replays = f"{row['replayed']} of {row['replays']}" if row["replays"] else ""
        lines.append(f"| `{row['spec'].rsplit(':', 1)[1]}` | {row['verdict']} | {row['campaigns']} | {row['found']} | "
                     f"{row['max_trace_ops'] if row['max_trace_ops'] is not None else ''} | {replays} | "
                     f"{row['soak_steps'] or ''} | {len(row['errors'])} | "
                     + ("met |" if row["met"] else f"not all run ({row['not_run']} jobs left) |" if row["not_run"] else "MISSED |"))
    return "\n".join(lines)


def _workers(requested: int | None, backend: str, jobs: list[Job]) -> int:
    if backend != "cuda":
        return requested or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return gpu_workers(PROG, requested or 8, [job.campaign.config for job in jobs if job.campaign is not None])


def _geometries(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    known = sorted({*GEOMETRIES, *LARGE_GEOMETRIES})
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    for name in names or ("",):
        if name not in known:
            raise UsageError(f"--geometry {value!r}: {name!r} is not a geometry; choose from {', '.join(known)}")
    return names


@command(PROG)
def main(argv: list[str]) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("file", nargs="?", default=DEFAULT_FILE, help=f"a file of factories with a VERDICTS dict (default {DEFAULT_FILE})")
    p.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    p.add_argument("--geometry", default=None, help="NAME[,NAME...]: only these geometries (default: every one a factory supports)")
    p.add_argument("--replays", type=positive(int, "replays", "20"), default=DEFAULT_REPLAYS, help="replays of each finding")
    p.add_argument("--soak-steps", type=int, default=0, help="steps of fresh-seed fuzzing per race-free factory (cuda: free-running)")
    p.add_argument("--cuda-mode", choices=("both", "controlled", "free"), default="both", help="cuda: the campaigns' modes (soaks need free)")
    p.add_argument("--max-seconds", type=positive(float, "seconds", "420"), default=None, help="start no job after this many seconds; what is left is reported as not run")
    p.add_argument("-j", "--jobs", type=positive(int, "worker processes", "4"), default=None, help="worker processes (default: every core; cuda: what the free GPU memory holds, at most 8)")
    p.add_argument("--repro-dir", type=Path, default=None, help="where traces of findings go (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None, help="write every record and the table's rows here")
    args = p.parse_args(argv)
    check_output("--json", args.json)
    check_output("--repro-dir", args.repro_dir, "directory")
    if args.soak_steps < 0:
        raise UsageError(f"--soak-steps {args.soak_steps} must be 0 or more")
    if args.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--backend cuda needs a CUDA GPU and none is visible here; use --backend sim")
    geometries = _geometries(args.geometry)
    verdicts = load_verdicts(args.file)
    repro_dir = str(args.repro_dir or Path(tempfile.mkdtemp(prefix="kvzero-examples-")))
    modes = ("controlled", "free") if args.cuda_mode == "both" else (args.cuda_mode,)
    jobs = campaign_jobs(verdicts, args.backend, geometries, repro_dir, modes)
    soaks = args.soak_steps if args.backend != "cuda" or "free" in modes else 0
    soak = Soak(verdicts, args.backend, soaks, repro_dir)
    workers = _workers(args.jobs, args.backend, jobs)
    started = time.monotonic()
    deadline = None if args.max_seconds is None else started + args.max_seconds

    def follow_up(record: dict) -> list[Job]:
        if record["kind"] == "soak":
            return soak.ran(record)
        if record["kind"] == "campaign" and record["found"] and record.get("trace"):
            return [Job("replay", record["spec"], record["verdict"], trace=record["trace"], replays=args.replays)]
        return []

    records = []
    per_spec = max(1, workers // max(1, len(soak.campaigns)))  # soak runs side by side, once the campaigns are queued
    for record in run_jobs(jobs + soak.start(per_spec), workers, follow_up, 0 if args.backend == "cuda" else None,
                           deadline):
        records.append(record)
        if record["kind"] == "campaign":
            what = ("HARNESS ERROR" if record.get("harness_error") else "RESOURCE ERROR" if record.get("resource_error")
                    else f"found, {record['trace_ops']} ops" if record["found"] else "clean")
            print(f"{record['campaign']}: {what} ({record['examples']} examples, {record['seconds']} s)", flush=True)
        elif record["kind"] == "replay":
            print(f"replay {Path(record['trace']).name}: shown {record['shown']} of {record['replays']}", flush=True)
    rows = summarize(verdicts, records, args.replays, soaks)
    print(table(rows, args.backend))
    wall = round(time.monotonic() - started, 1)
    print(f"{len(records)} jobs in {wall} s on {workers} worker(s); traces in {repro_dir}")
    if args.json:
        write_json_atomically(args.json, {
            "command": " ".join(shlex.quote(a) for a in [PROG, *argv]),
            "date": datetime.date.today().isoformat(), "machine": machine(args.backend), "workers": workers,
            "wall_s": wall, "rows": rows, "records": records,
        })
    judged = [r for r in records if r["kind"] == "campaign" and not not_judged(r)]
    if any(r["found"] != (r["verdict"] == "racy") for r in judged):
        return FINDING  # a verdict the factory's VERDICTS entry contradicts, whatever else happened
    harness = harness_status([r for r in records if r["kind"] in ("campaign", "soak")])
    if harness:
        return harness
    return CLEAN if all(row["met"] for row in rows) else FINDING


if __name__ == "__main__":
    sys.exit(main())
