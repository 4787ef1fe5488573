"""The sanitizer benchmark: every engine-like program under PyTorch's sanitizer and under ours.

Each program of :mod:`sanitizer.bench.programs`, and each of the fuzz campaigns' vLLM-style
zeroers driven by :mod:`sanitizer.bench.engine_loop` (rows ``zeroer:NAME``), runs in a fresh
process, once per tool:

* ``torch``: ``TORCH_CUDA_SANITIZER=1 python PROGRAM`` (``torch.cuda._sanitizer``, CSAN); found when
  it prints "CSAN detected a possible data race";
* ``observe``: ``python -m sanitizer --json F -- python PROGRAM``; found when F lists a race;
* ``force``: the same with ``--force``; also whether the program's own check of its results failed
  (the race made visible as wrong values).

A racy program is *found* or *missed*, a race-free twin *clean* or a *false alarm*; the table
lists every program, the summary counts them per tool. On a machine without a GPU,
``--backend sim`` runs the ``observe`` column on the simulator only (CSAN needs CUDA).

Run it (one command, on an H200 about a minute)::

    python -m sanitizer.bench.compare --json h200-sanitizer-compare-$(date +%Y-%m).json -j 8
    python -m sanitizer.bench.compare --backend sim

Exit status (:mod:`fuzz.cli`): 0 when our sanitizer found every planted race with no false alarm,
1 otherwise, 2 for a bad command line, 3 for a bug in this tool.
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

from fuzz.atomic_file import write_json_atomically
from sanitizer.bench.programs import PROGRAMS, ZEROERS, Program, script
from fuzz.cli import CLEAN, FINDING, ArgumentParser, UsageError, check_output, run_main
from fuzz.environment import environment

CSAN_MARK = "CSAN detected a possible data race"
TIMEOUT_S = 180


def _tools(backend: str) -> tuple[str, ...]:
    return ("torch", "observe", "force") if backend == "cuda" else ("observe",)


def _command(tool: str, program: Program, steps: int, report: Path, backend: str) -> tuple[list[str], dict]:
    env = dict(os.environ)
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
    seconds = time.perf_counter() - started
    row: dict[str, Any] = {"program": program.name, "tool": tool, "racy": program.racy, "exit": status,
                           "seconds": round(seconds, 2), "values_wrong": "AssertionError" in err}
    if tool == "torch":
        row["found"] = CSAN_MARK in err or CSAN_MARK in out
        row["kinds"] = []
    else:
        data = json.loads(report.read_text()) if report.exists() else None
        row["found"] = bool(data and data["races"])
        row["kinds"] = sorted({r["kind"] for r in data["races"]}) if data else []
        row["sites"] = sorted({f"{r['queued']['site']['file']}:{r['queued']['site']['line']} / "
                               f"{r['later']['site']['file']}:{r['later']['site']['line']}"
                               for r in data["races"] if r["queued"]["site"] and r["later"]["site"]}) if data else []
        row["forced_values"] = sorted({r["values"] for r in data["races"] if r.get("values")})[:3] if data else []
        if data is None:
            row["error"] = (err.strip().splitlines() or ["no report"])[-1]
    if status not in (0, 1) and tool != "torch" and not row["found"]:
        row.setdefault("error", (err.strip().splitlines() or [f"exit {status}"])[-1])
    return row


def verdict(row: dict[str, Any]) -> str:
    if "error" in row and not row["found"]:
        return "error"
    if row["racy"]:
        return "found" if row["found"] else "missed"
    return "false alarm" if row["found"] else "clean"


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    summary: dict[str, dict[str, int]] = {}
    for row in rows:
        counts = summary.setdefault(row["tool"], {"found": 0, "missed": 0, "clean": 0, "false alarm": 0, "error": 0})
        counts[verdict(row)] += 1
    return summary


def table(rows: list[dict[str, Any]], tools: tuple[str, ...], programs: list[Program]) -> str:
    by = {(r["program"], r["tool"]): r for r in rows}
    header = "| program | planted race | " + " | ".join(
        {"torch": "TORCH_CUDA_SANITIZER=1", "observe": "kvz observe", "force": "kvz force"}[t] for t in tools) + " |"
    lines = [header, "|" + " --- |" * (2 + len(tools))]
    for program in programs:
        cells = []
        for tool in tools:
            row = by.get((program.name, tool))
            if row is None:
                cells.append("not run")
                continue
            cell = verdict(row)
            if tool == "force" and row["values_wrong"]:
                cell += " (values wrong)"
            cells.append(cell)
        planted = program.hazard if program.racy else "none (twin)"
        lines.append(f"| `{program.name}` | {planted} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m sanitizer.bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("cuda", "sim"), default="cuda")
    p.add_argument("--steps", type=int, default=32, help="steps each program runs (default 32)")
    p.add_argument("-j", "--jobs", type=int, default=4, help="programs run at once (default 4)")
    p.add_argument("--json", help="write the rows, summary and environment here")
    p.add_argument("--only", help="comma-separated program names (default: all)")
    return p


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    out = check_output("--json", args.json)
    tools = _tools(args.backend)
    every = (*PROGRAMS, *ZEROERS)
    named = args.only.split(",") if args.only else []
    unknown = [n for n in named if n not in {p.name for p in every}]
    if unknown:
        raise UsageError(f"--only {unknown[0]!r} is not a program of the benchmark; "
                         f"programs: {', '.join(p.name for p in every)}")
    chosen = [p for p in every if not named or p.name in named]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvz-sanitize-bench-") as scratch, \
            ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        jobs = [pool.submit(run_one, tool, program, args.steps, args.backend, Path(scratch))
                for program in chosen for tool in tools]
        rows = [job.result() for job in jobs]
    summary = summarize(rows)
    print(table(rows, tools, chosen))
    print()
    for tool, counts in summary.items():
        print(f"{tool}: " + ", ".join(f"{n} {what}" for what, n in counts.items() if n))
    for row in rows:
        if "error" in row:
            print(f"{row['program']} under {row['tool']}: {row['error']}")
    if out is not None:
        write_json_atomically(out, {
            "command": "python -m sanitizer.bench.compare " + " ".join(argv),
            "date": datetime.date.today().isoformat(), "environment": environment(),
            "seconds": round(time.perf_counter() - started, 1), "rows": rows, "summary": summary,
        })
    ours = summary.get("observe", {})
    return CLEAN if ours.get("missed", 0) == 0 and ours.get("false alarm", 0) == 0 and ours.get("error", 0) == 0 else FINDING


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, "python -m sanitizer.bench.compare")


if __name__ == "__main__":
    sys.exit(main())
