"""``python -m fuzz.bench.kernel``: parse the command line, run the sections in order, report.

The sections run most-needed first, so a run cut short by ``--max-seconds`` still has what the
targets need: launch baselines, the Llama-like bandwidth sweep, host time per call, then the
launch-configuration sweep and the other caches. The JSON file is rewritten after every section,
so it exists whatever happens later.

Exit status (:mod:`racecheck.cli`): 0 when every row was measured, 1 when a row failed (its error is in
the table and the JSON), 2 for a bad command line (one line naming the value), 3 for a bug in this
tool; ``plot`` exits 2 for a file it cannot draw or without matplotlib.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from zeroer.registry import BUILTINS, DIRECT, RACE_FREE, RACY
from racecheck.atomic_file import write_json_atomically
from fuzz.bench import command
from racecheck.cli import CLEAN, FINDING, ArgumentParser, UsageError, check_output, positive
from fuzz.bench.kernel import measure, report
from fuzz.bench.kernel.caches import NAMES, bench_cache
from fuzz.bench.kernel.measure import HOST_CACHE, Context
from fuzz.bench.kernel.plots import MissingMatplotlib, make_plots
from fuzz.bench.kernel.timing import Budget

DEFAULT_BLOCKS = (1, 4, 16, 64, 256, 1024, 4096)
DEFAULT_IDS = (1, 16, 256)
QUICK_BLOCKS = (1, 4)
QUICK_IDS = (1, 4)
SECTIONS = ("launch", "bandwidth", "host", "configs")
DEFAULT_MAX_SECONDS = 240.0
GPU_COMMAND = "python -m fuzz.bench.kernel --json docs/data/h200-zeroer-bench-$(date +%Y-%m).json --png-dir docs/img"
PROG = "python -m fuzz.bench.kernel"


def benched_zeroers() -> list[str]:
    """Every registered design with a verdict: race-free (the direct forms too) or racy."""
    return sorted(n for n in BUILTINS if n in RACE_FREE or n in RACY or n in DIRECT)


def _int_list(option: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        values = []
        for part in text.split(","):
            try:
                value = int(part.strip())
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{part.strip()!r} is not an int; give positive ints separated by commas, "
                    f"e.g. {option} 1,16,256") from None
            if value < 1:
                raise argparse.ArgumentTypeError(
                    f"{value} is not a positive count; give positive ints separated by commas, "
                    f"e.g. {option} 1,16,256")
            values.append(value)
        return sorted(set(values))

    return parse


def _name_list(option: str, what: str, choices: Callable[[], Sequence[str]]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",")]
        for name in names:
            if name not in choices():
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {name!r}; choose from {', '.join(choices())}, "
                    f"e.g. {option} {','.join(choices()[:2])}")
        return list(dict.fromkeys(names))

    return parse


def parse_run_args(argv: Sequence[str]) -> argparse.Namespace:
    p = ArgumentParser(
        prog=PROG,
        description="Zeroer performance: kernel bandwidth against measured ceilings, and the host "
                    "cost per call of every design. Figures come only from a GPU; --quick is a CPU "
                    f"smoke test. On the GPU: {GPU_COMMAND}. Redraw figures from a result: "
                    "python -m fuzz.bench.kernel plot RESULT.json --png-dir DIR",
    )
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke test: simulator runtime, interpreted kernel, tiny caches, a few calls")
    p.add_argument("--blocks", type=_int_list("--blocks"), help="block counts per kernel call "
                   f"(default {','.join(map(str, DEFAULT_BLOCKS))}; --quick {','.join(map(str, QUICK_BLOCKS))})")
    p.add_argument("--ids", type=_int_list("--ids"), help="ids per zero_block_ids call in the host table "
                   f"(default {','.join(map(str, DEFAULT_IDS))}; --quick {','.join(map(str, QUICK_IDS))})")
    p.add_argument("--geometry", type=_name_list("--geometry", "geometry", lambda: NAMES),
                   default=list(NAMES), help=f"caches for the bandwidth table (default {','.join(NAMES)})")
    p.add_argument("--zeroers", type=_name_list("--zeroers", "zeroer", benched_zeroers),
                   default=None, help="designs for the host table (default: every race-free or racy one)")
    p.add_argument("--sections", type=_name_list("--sections", "section", lambda: SECTIONS),
                   default=list(SECTIONS), help=f"what to measure (default {','.join(SECTIONS)})")
    p.add_argument("--json", type=Path, help="write the result here (rewritten after every section)")
    p.add_argument("--png-dir", type=Path, help="draw the figures here (needs matplotlib)")
    p.add_argument("--max-seconds", type=positive(float, "seconds", "--max-seconds 240"), default=DEFAULT_MAX_SECONDS,
                   help=f"overall budget; rows past it are skipped and recorded (default {DEFAULT_MAX_SECONDS:g})")
    args = p.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        p.error("no CUDA GPU here (torch.cuda.is_available() is False) and the full benchmark "
                "measures a GPU; run python -m fuzz.bench.kernel --quick for the CPU smoke test")
    args.blocks = args.blocks or list(QUICK_BLOCKS if args.quick else DEFAULT_BLOCKS)
    args.ids = args.ids or list(QUICK_IDS if args.quick else DEFAULT_IDS)
    args.zeroers = args.zeroers or benched_zeroers()
    limit = bench_cache(HOST_CACHE, args.quick).num_blocks - 1
    for option, values in (("--blocks", args.blocks), ("--ids", args.ids)):
        if max(values) > limit:
            p.error(f"argument {option}: {max(values)} is more than the {limit} blocks a benchmark "
                    f"cache{' (--quick)' if args.quick else ''} can zero (block 0 is the null "
                    f"block); use at most {limit}")
    return args


def _header(result: dict[str, Any]) -> str:
    v = result["versions"]
    gpu = f"{v.get('gpu')} (sm {v.get('gpu_capability')}, driver {v.get('driver')})" if v.get("gpu") else "none"
    return (f"fuzz.bench.kernel on {result['device']}: GPU {gpu}; python {v.get('python')}, torch {v.get('torch')} "
            f"(CUDA {v.get('torch_cuda')}), triton {v.get('triton')}, commit {v.get('git_commit')}"
            f"{' (dirty)' if v.get('git_dirty') else ''}\n{result['note']}")


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> dict[str, Any]:
    """Measure what `args` asks for; return the result (also written to --json as it grows)."""
    device = torch.device("cpu") if args.quick else torch.device("cuda", torch.cuda.current_device())
    budget = Budget(args.max_seconds)
    result: dict[str, Any] = {
        "schema": report.SCHEMA,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m fuzz.bench.kernel " + shlex.join(argv),
        "device": str(device), "quick": args.quick, "figures": device.type == "cuda" and not args.quick,
        "max_seconds": args.max_seconds,
        "config": {"blocks": args.blocks, "ids": args.ids, "geometries": args.geometry,
                   "zeroers": args.zeroers, "sections": args.sections, "host_cache": HOST_CACHE},
        "versions": {}, "geometries": {}, "launch": [], "bandwidth": [], "configs": [], "host": [],
    }
    result["note"] = report.note_for(result)
    ctx = Context(device, args.quick, args.blocks, args.ids, args.geometry, args.zeroers, budget)
    try:
        result["versions"] = report.versions(device)
    except Exception as exc:  # noqa: BLE001 - versions are worth having, not worth dying for
        result["versions"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(_header(result), flush=True)

    def save() -> None:
        result["elapsed_s"] = round(budget.elapsed(), 1)
        result["budget_exhausted"] = budget.exhausted
        result["errors"] = ctx.errors
        result["targets"] = report.targets(result)
        if args.json:
            write_json_atomically(args.json, result, default=str)  # a reader never sees half a file

    def section(title: str, fill: Callable[[], None], render: Callable[[], str]) -> None:
        print(f"\n== {title} [{budget.elapsed():.1f} s]", flush=True)
        fill()
        print(render(), flush=True)
        save()

    def bandwidth(name: str) -> None:
        rows, info = measure.bandwidth_rows(ctx, name)
        result["bandwidth"] += rows
        result["geometries"][name] = info

    first = [g for g in args.geometry if g == HOST_CACHE]
    rest = [g for g in args.geometry if g != HOST_CACHE]
    try:
        if "launch" in args.sections:
            section("launch: one call, host and GPU time", lambda: result["launch"].extend(measure.launch_rows(ctx)),
                    lambda: report.launch_table(result["launch"]))
        if "bandwidth" in args.sections:
            for name in first:
                section(f"bandwidth: {name}", lambda: bandwidth(name),
                        lambda: report.bandwidth_table([r for r in result["bandwidth"] if r["geometry"] == name]))
        if "host" in args.sections:
            section(f"host time per zero_block_ids call ({HOST_CACHE} cache)",
                    lambda: result["host"].extend(measure.host_rows(ctx)),
                    lambda: report.host_table(result["host"]))
        if "configs" in args.sections:
            section(f"launch configurations ({HOST_CACHE} cache)",
                    lambda: result["configs"].extend(measure.config_rows(ctx)),
                    lambda: report.config_table(result["configs"]))
        ctx.drop(HOST_CACHE)
        if "bandwidth" in args.sections:
            for name in rest:
                section(f"bandwidth: {name}", lambda: bandwidth(name),
                        lambda: report.bandwidth_table([r for r in result["bandwidth"] if r["geometry"] == name]))
                ctx.drop(name)
    finally:
        save()
        print(f"\n== targets [{budget.elapsed():.1f} s]\n{report.targets_table(result['targets'])}")
        if ctx.errors:
            print(f"\n{len(ctx.errors)} row(s) failed; their errors are in the table notes"
                  + (f" and in {args.json}" if args.json else ""))
        if budget.exhausted:
            print(f"the --max-seconds budget of {args.max_seconds:g} s ran out; later rows are marked skipped")
    if args.png_dir:
        draw(result, args.png_dir)
    return result


def draw(result: dict[str, Any], png_dir: Path) -> bool:
    try:
        paths = make_plots(result, png_dir)
    except MissingMatplotlib as exc:
        print(exc)
        return False
    print("figures: " + ", ".join(str(p) for p in paths) if paths else "figures: nothing to draw")
    return True


def plot_main(argv: Sequence[str]) -> int:
    parser = ArgumentParser(prog=f"{PROG} plot", description="Draw the figures of a result written by --json.")
    parser.add_argument("result", type=Path, help="a JSON file written by python -m fuzz.bench.kernel --json")
    parser.add_argument("--png-dir", type=Path, required=True, help="where to write the PNG files")
    args = parser.parse_args(argv)
    try:
        result = json.loads(args.result.read_text())
    except FileNotFoundError:
        parser.error(f"{str(args.result)!r} does not exist; give a JSON file written by "
                     f"python -m fuzz.bench.kernel --json PATH")
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON, or not UTF-8
        parser.error(f"cannot read {str(args.result)!r} as JSON ({exc}); give a file written by --json")
    if not isinstance(result, dict) or result.get("schema") != report.SCHEMA:
        parser.error(f"{str(args.result)!r} is not a fuzz.bench.kernel result (no \"schema\": "
                     f"\"{report.SCHEMA}\"); give a file written by python -m fuzz.bench.kernel --json")
    check_output("--png-dir", args.png_dir, "directory")
    try:
        paths = make_plots(result, args.png_dir)
    except MissingMatplotlib as exc:
        raise UsageError(str(exc)) from None
    print("figures: " + ", ".join(str(p) for p in paths) if paths else "figures: nothing to draw")
    return CLEAN


@command(PROG)
def main(argv: list[str]) -> int:
    """Entry point; returns the exit status (1 when a row failed, 2 for bad arguments; :mod:`racecheck.cli`)."""
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    args = parse_run_args(argv)
    check_output("--json", args.json)
    check_output("--png-dir", args.png_dir, "directory")
    started = time.monotonic()
    result = run(args, argv)
    print(f"\ndone in {time.monotonic() - started:.1f} s" + (f"; result in {args.json}" if args.json else ""))
    return FINDING if result["errors"] else CLEAN
