"""The sanitizer benchmark: every program under PyTorch's sanitizer and under ours, judged strictly.

The programs: the engine-like programs of :mod:`sanitizer.bench.programs`, the corpus of the
engines' own races (:mod:`sanitizer.bench.corpus`), and the fuzz campaigns' vLLM-style zeroers
driven by :mod:`zeroer.engine_loop` (rows ``zeroer:NAME``). Each runs in a fresh process,
once per tool:

* ``torch``: ``TORCH_CUDA_SANITIZER=1 python PROGRAM`` (``torch.cuda._sanitizer``, CSAN); found
  when it prints "CSAN detected a possible data race" (it names no program lines we could check);
* ``observe``: ``python -m sanitizer --json F -- python PROGRAM``; judged from F
  (:mod:`sanitizer.bench.verdict`: the planted kind and both marked lines, never "any race");
* ``force``: the same with ``--force``; also whether the program's own check failed (the race
  made visible as wrong values: its ``AssertionError``, as the JSON records it);
* ``truth`` (corpus only): ``python PROGRAM --sleep`` with no tool at all: forced delays make a
  racy program's race show as wrong values (``shows``), and its fixed twin must still be right
  (``right``) under the same delays: the GPU's ground truth for the row.

A racy program is *found*, or *missed* / *wrong kind* / *wrong lines*; a race-free twin *clean* or
a *false alarm*. The table lists every program, the summary counts them per tool and gives each
tool's share of the racy programs found. On a machine without a GPU, ``--backend sim`` runs the
``observe`` column on the simulator only (CSAN and the sleeps need CUDA).

Run it (one command, on an H200 a minute or two)::

    python -m sanitizer.bench.compare --json h200-sanitizer-compare-$(date +%Y-%m).json -j 10
    python -m sanitizer.bench.compare --backend sim

Exit status (:mod:`racecheck.cli`): 0 when our sanitizer found every planted race with no false alarm in
every mode it ran, 1 otherwise, 2 for a bad command line, 3 for a bug in this tool.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_json_atomically
from racecheck.cli import CLEAN, FINDING, ArgumentParser, UsageError, check_output, run_main
from racecheck.environment import environment
from sanitizer.bench.corpus import CORPUS
from sanitizer.bench.programs import PROGRAMS, ZEROERS, Program, script
from sanitizer.bench.verdict import CLEAN as JUDGED_CLEAN
from sanitizer.bench.verdict import FALSE_ALARM, FOUND, MISSED, judge

CSAN_MARK = "CSAN detected a possible data race"
TIMEOUT_S = 180
EVERY = (*PROGRAMS, *CORPUS, *ZEROERS)
TITLES = {"truth": "GPU truth (--sleep)", "torch": "TORCH_CUDA_SANITIZER=1", "observe": "kvz observe",
          "force": "kvz force"}


def _command(tool: str, program: Program, steps: int, report: Path, backend: str) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if tool == "truth":
        return [sys.executable, *script(program, steps, sleep=True)], env
    args = script(program, steps)
    if tool == "torch":
        env["TORCH_CUDA_SANITIZER"] = "1"
        return [sys.executable, *args], env
    flags = ["--force"] if tool == "force" else []
    return [sys.executable, "-m", "sanitizer", "--backend", backend, *flags, "--json", str(report), "--",
            "python", *args], env


def run_one(tool: str, program: Program, steps: int, backend: str, scratch: Path) -> dict[str, Any]:
    """One program under one tool, in a fresh process: what it found and how long it took."""
    report = scratch / f"{program.name.replace(':', '_')}-{tool}.json"
    command, env = _command(tool, program, steps, report, backend)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        status, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        status, out, err = None, str(expired.stdout or ""), f"timed out after {TIMEOUT_S} s"
    row: dict[str, Any] = {"program": program.name, "tool": tool, "racy": program.racy, "hazard": program.hazard,
                           "exit": status, "seconds": round(time.perf_counter() - started, 2)}
    if tool == "truth":
        wrong = status not in (0, None) and "AssertionError" in err
        row["values_wrong"] = wrong
        if status not in (0, 1) and not wrong:
            row["error"] = (err.strip().splitlines() or [f"exit {status}"])[-1]
        row["verdict"] = ("shows" if wrong else "hidden") if program.racy else ("wrong values" if wrong else "right")
        return row
    if tool == "torch":
        found = CSAN_MARK in err or CSAN_MARK in out
        row["verdict"] = (FOUND if found else MISSED) if program.racy else (FALSE_ALARM if found else JUDGED_CLEAN)
        return row
    data = json.loads(report.read_text()) if report.exists() else None
    if data is None:
        row["error"] = (err.strip().splitlines() or ["no report"])[-1]
        row["verdict"] = "error"
        return row
    races = data["races"]
    row["verdict"] = judge(program, races)
    row["kinds"] = sorted({r["kind"] for r in races})
    row["sites"] = sorted({f"{_short(r['queued'])} / {_short(r['later'])}" for r in races})[:6]
    row["values_wrong"] = str(data.get("program_error") or "").startswith("AssertionError")
    row["forced_values"] = sorted({r["values"] for r in races if r.get("values")})[:3]
    row["notes"] = data.get("notes", [])
    row["forced_timeouts"] = data.get("forced_timeouts", 0)
    if data.get("unfollowed"):
        row["unfollowed"] = data["unfollowed"]
    return row


def _short(access: dict[str, Any]) -> str:
    site = access.get("site")
    return f"{Path(site['file']).name}:{site['line']}" if site else "?"


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    summary: dict[str, dict[str, int]] = {}
    for row in rows:
        counts = summary.setdefault(row["tool"], {})
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    return summary


def table(rows: list[dict[str, Any]], tools: tuple[str, ...], programs: list[Program]) -> str:
    by = {(r["program"], r["tool"]): r for r in rows}
    header = "| program | upstream | planted race | " + " | ".join(TITLES[t] for t in tools) + " |"
    lines = [header, "|" + " --- |" * (3 + len(tools))]
    for program in programs:
        cells = []
        for tool in tools:
            row = by.get((program.name, tool))
            if row is None or (tool == "truth" and not program.sleeps):
                cells.append("" if tool == "truth" else "not run")
                continue
            cell = row["verdict"]
            if tool == "force" and row.get("values_wrong"):
                cell += " (values wrong)"
            cells.append(cell)
        planted = program.hazard if program.racy else "none (twin)"
        lines.append(f"| `{program.name}` | {program.upstream} | {planted} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shares(rows: list[dict[str, Any]], tools: tuple[str, ...]) -> list[str]:
    """Each tool's racy programs found and race-free ones flagged, over the programs it ran."""
    lines = []
    for tool in tools:
        if tool == "truth":
            continue
        mine = [r for r in rows if r["tool"] == tool]
        racy = [r for r in mine if r["racy"]]
        found = sum(r["verdict"] == FOUND for r in racy)
        alarms = sum(r["verdict"] == FALSE_ALARM for r in mine if not r["racy"])
        lines.append(f"{tool}: {found} of {len(racy)} racy programs found, {alarms} false alarms on "
                     f"{len(mine) - len(racy)} race-free twins")
    return lines


def _main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m sanitizer.bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("cuda", "sim"), default="cuda")
    p.add_argument("--steps", type=int, default=16, help="steps each program runs (default 16)")
    p.add_argument("-j", "--jobs", type=int, default=4, help="programs run at once (default 4)")
    p.add_argument("--json", help="write the rows, summary and environment here")
    p.add_argument("--only", help="comma-separated program names (default: all)")
    p.add_argument("--tools", help="comma-separated tools to run (default: all the backend has)")
    args = p.parse_args(argv)
    out = check_output("--json", args.json)
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps} must be a positive number of steps")
    if args.jobs < 1:
        raise UsageError(f"-j {args.jobs} must be a positive number of programs run at once")
    tools = ("truth", "torch", "observe", "force") if args.backend == "cuda" else ("observe",)
    if args.tools:
        wanted = tuple(args.tools.split(","))
        unknown = [t for t in wanted if t not in tools]
        if unknown:
            raise UsageError(f"--tools {unknown[0]!r} is not a tool of backend {args.backend}; tools: {', '.join(tools)}")
        tools = wanted
    named = args.only.split(",") if args.only else []
    unknown = [n for n in named if n not in {p.name for p in EVERY}]
    if unknown:
        raise UsageError(f"--only {unknown[0]!r} is not a program of the benchmark; "
                         f"programs: {', '.join(p.name for p in EVERY)}")
    chosen = [p for p in EVERY if not named or p.name in named]
    started = time.perf_counter()

    def save(rows: list[dict[str, Any]], complete: bool) -> None:
        if out is not None:
            write_json_atomically(out, {
                "command": "python -m sanitizer.bench.compare " + " ".join(argv), "complete": complete,
                "date": datetime.date.today().isoformat(), "environment": environment(),
                "seconds": round(time.perf_counter() - started, 1), "rows": rows, "summary": summarize(rows),
            })

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvz-sanitize-bench-") as scratch, \
            ThreadPoolExecutor(max_workers=args.jobs) as pool:
        jobs = [pool.submit(run_one, tool, program, args.steps, args.backend, Path(scratch))
                for program in chosen for tool in tools if tool != "truth" or program.sleeps]
        for job in jobs:
            rows.append(job.result())
            save(rows, complete=False)  # a run cut short still leaves the rows it finished, marked so
    save(rows, complete=True)
    summary = summarize(rows)
    print(table(rows, tools, chosen))
    print()
    for tool, counts in summary.items():
        print(f"{tool}: " + ", ".join(f"{n} {what}" for what, n in sorted(counts.items())))
    for line in shares(rows, tools):
        print(line)
    for row in rows:
        if "error" in row:
            print(f"{row['program']} under {row['tool']}: {row['error']}")
    ours = [r for r in rows if r["tool"] in ("observe", "force")]
    right = all(r["verdict"] == (FOUND if r["racy"] else JUDGED_CLEAN) for r in ours)
    return CLEAN if right else FINDING


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, "python -m sanitizer.bench.compare")


if __name__ == "__main__":
    sys.exit(main())
