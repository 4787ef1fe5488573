"""The engines' transfer code in its real shapes, racy and fixed, judged by the fuzzer, our sanitizer and PyTorch's.

Each pair is one upstream race and its fix, written again in the shape of the engine's own code
(the same calls, made the same way: numpy address tables read by a Triton kernel, a driver copy
resolved through ``cuda.bindings`` and called with ctypes from a copy thread, SGLang's HiCache
controller and host pool, LMCache's pinned temporaries). Every side of a pair is judged three ways,
each in a fresh process, as a user runs the tool:

* ``fuzz``: ``pytest fuzz --offloader FILE:factory --backend sim --geometry tiny --host-memory
  pinned``: both shards of its one campaign; a racy side is found when the run finds it (the
  table says in how many of its campaigns) with a shrunk trace of at most :data:`MAX_TRACE_OPS`
  ops that shows again in :data:`REPLAYS` of :data:`REPLAYS` replays (``python -m repro replay
  --repeat``); a fixed side is clean when no campaign finds anything; a harness or resource error
  is neither;
* ``sanitizer``: ``python -m sanitizer --backend sim --json F -- python LOOP``, the plain engine
  loop (or unit test) of the same code: a racy side is found when a race of the upstream kind is
  reported (``kind``), and ``lines`` says whether it sits on the two lines the program marks
  (:func:`sanitizer.bench.verdict.judge_lines`); a fixed side must report nothing;
* ``torch``: the loop (or the unit tests) under ``TORCH_CUDA_SANITIZER=1``, on a GPU only (here:
  ``needs a GPU``); a program that calls an engine's extension that is not installed there says
  so and is ``needs the extension`` (the tools stand in for the extension; PyTorch's cannot).

Run it (about 4 minutes on 2 cores)::

    python -m sanitizer.bench.engine_shapes --json docs/data/sim-engine-shapes-2026-12.json
    python -m sanitizer.bench.engine_shapes --only vllm-handler-stores-46278 --tools sanitizer
    python -m sanitizer.bench.engine_shapes --backend cuda -j 4 --json h100-engine-shapes-2026-12.json  # a GPU

With ``--backend cuda`` our tools run on the GPU as a user runs them there: ``fuzz`` with
``--backend cuda --cuda-mode controlled``, ``sanitizer`` with ``--backend cuda`` (observing) and
``sanitizer-force`` with ``--force`` as well (the plugin's ``--kvz-sanitize-backend cuda`` and
``--kvz-sanitize-force`` for a unit-test side).

Exit status (:mod:`racecheck.cli`): 0 when every racy side is found by every tool run (the sanitizer by
kind) and every fixed side is clean, with no harness error; 1 otherwise; 2 for a bad command line.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_json_atomically
from racecheck.cli import CLEAN, FINDING, INTERRUPTED, ArgumentParser, UsageError, check_output, run_main
from racecheck.environment import environment
from racecheck.interrupts import install, interrupted
from sanitizer.bench.programs import DEVICE_ACCESS, HOST_WRITE, marked_lines
from sanitizer.bench.verdict import judge_lines

PROG = "python -m sanitizer.bench.engine_shapes"
ROOT = Path(__file__).resolve().parents[2]
MAX_TRACE_OPS = 6
REPLAYS = 20  # a racy side's shrunk trace must show again in every one of these replays
GEOMETRY = "tiny"
TIMEOUT_S = 300
TOOLS = ("fuzz", "sanitizer", "torch")
# On a GPU (``--backend cuda``) our two tools run on CUDA: the fuzzer's controlled mode (its
# schedules forced by gates, so a race shows on every seed), the sanitizer observing and forcing.
CUDA_TOOLS = ("fuzz", "sanitizer", "sanitizer-force", "torch")
BACKENDS = ("sim", "cuda")
CSAN_MARK = "CSAN detected a possible data race"
NEEDS_THE_EXTENSION = "needs the extension"
# What a program calling an engine's extension says when run bare without it (the tools stand in for it).
NEEDS_EXTENSION = re.compile(r"No module named '(lmcache|sgl_kernel|vllm)\b|needs vLLM's _C extension|needs sgl_kernel")


@dataclass(frozen=True)
class Side:
    """One side of a pair: the factory the fuzzer drives, the loop the sanitizers run, their environment."""

    factory: str  # FILE.py:factory, relative to the checkout
    loop: tuple[str, ...]  # what follows ``python``, or with ``pytest`` a file of tests
    env: dict[str, str] = field(default_factory=dict)
    pytest: bool = False  # the loop is a pytest file, run under ``--kvz-sanitize --kvz-sanitize-backend sim``
    marks: tuple[str, ...] = ()  # the file(s) marking a racy side's two lines, each ``FILE`` or ``FILE:factory``


@dataclass(frozen=True)
class Pair:
    name: str
    upstream: str  # the race and its fix
    kind: str  # what the sanitizer must report for the racy side
    racy: Side
    fixed: Side
    shape: str  # whose code shape the sides follow
    gaps: str = ""  # forms the pair lacks in the engine's real shape


_SWAP = "tests/triton_swap_offload.py"
_LMC = "examples/lmcache_transfer_context.py"
_DMA = "examples/simple_cpu_offload_dma.py"
_STYLE = "tests/engine_style/factories.py"
_UNIT_CPU_GPU = "tests/engine_style/test_cpu_gpu.py"
_UNIT_HICACHE = "tests/engine_style/test_hicache_controller.py"
_UNIT_DMA = "tests/engine_style/test_simple_cpu_offload.py"
_UNIT_SWAP = "tests/engine_style/test_triton_swap_offload.py"
_UNIT_LMC = "tests/engine_style/test_lmcache_transfer_context.py"
_PLANTED, _UNPLANTED = {"ENGINE_STYLE_PLANTED_RACE": "1"}, {"ENGINE_STYLE_PLANTED_RACE": "0"}
_PLANTED_36738, _KERNEL_IO = {"ENGINE_STYLE_PLANTED_RACE": "36738"}, {"HICACHE_IO_BACKEND": "kernel"}
_PLANTED_27444 = {"ENGINE_STYLE_PLANTED_RACE": "27444"}
_SWAP_BLOCKS = {"VLLM_OFFLOAD_COPY": "swap_blocks"}

PAIRS: tuple[Pair, ...] = (
    Pair("vllm-simple-offload-46278", "vLLM #46278 (stores) in SimpleCPUOffload", DEVICE_ACCESS,
         Side(f"{_DMA}:dma_store_without_compute_event", (_DMA, "--racy"), marks=(f"{_DMA}:dma",)),
         Side(f"{_DMA}:dma_store_after_compute_event", (_DMA,)),
         "cuMemcpyBatchAsync via cuGetProcAddress + ctypes, copy thread on a SimpleQueue",
         "no unit-test form"),
    Pair("vllm-simple-offload-46278-unit", "vLLM #46278 (stores) in SimpleCPUOffload, its copy path's unit tests",
         DEVICE_ACCESS,
         Side(f"{_DMA}:dma_store_without_compute_event", (_UNIT_DMA,), _PLANTED, pytest=True,
              marks=(f"{_DMA}:dma", _UNIT_DMA)),
         Side(f"{_DMA}:dma_store_after_compute_event", (_UNIT_DMA,), _UNPLANTED, pytest=True),
         "DmaCopyBackend.launch_copy and its copy thread, tested as vLLM tests its offload workers",
         "the factory is the loop row's"),
    Pair("vllm-handler-stores-46278", "vLLM #46278 (stores) in the CPU offloading handler", DEVICE_ACCESS,
         Side(f"{_SWAP}:racy_store", (_SWAP, "racy_store"), marks=(f"{_SWAP}:racy_store",)),
         Side(f"{_SWAP}:make", (_SWAP, "make")),
         "int64 address tables from data_ptr() read by a Triton swap kernel, stream and timing-event pools",
         "unit-test form: the next row (the engine-style handler, copy_ per block)"),
    Pair("vllm-handler-stores-46278-triton-unit", "vLLM #46278 (stores), the Triton-kernel handler's unit tests",
         DEVICE_ACCESS,
         Side(f"{_SWAP}:racy_store", (_UNIT_SWAP,), _PLANTED, pytest=True, marks=(f"{_SWAP}:racy_store", _UNIT_SWAP)),
         Side(f"{_SWAP}:make", (_UNIT_SWAP,), _UNPLANTED, pytest=True),
         "the row above's handler tested as vLLM tests its offloading handler (pytest, parametrized)",
         "the factories are the row above's"),
    Pair("vllm-handler-stores-46278-unit", "vLLM #46278 (stores), the handler of the engine-style unit tests",
         DEVICE_ACCESS,
         Side(f"{_STYLE}:cpu_gpu_handler", (_UNIT_CPU_GPU,), _PLANTED, pytest=True,
              marks=(_UNIT_CPU_GPU, "tests/engine_style/cpu_gpu_offload.py")),
         Side(f"{_STYLE}:cpu_gpu_handler", (_UNIT_CPU_GPU,), _UNPLANTED, pytest=True),
         "transfer_async / get_finished / wait over spec classes, copy_ per block; vLLM's unit tests",
         "no engine loop: the sanitizer runs the handler's unit tests (pytest --kvz-sanitize)"),
    Pair("vllm-handler-stores-46278-swap-blocks", "vLLM #46278 (stores), the engine-style handler copying with swap_blocks",
         DEVICE_ACCESS,
         Side(f"{_STYLE}:cpu_gpu_handler", (_UNIT_CPU_GPU,), {**_PLANTED, **_SWAP_BLOCKS}, pytest=True,
              marks=(_UNIT_CPU_GPU, "tests/engine_style/cpu_gpu_offload.py:swap_blocks")),
         Side(f"{_STYLE}:cpu_gpu_handler", (_UNIT_CPU_GPU,), {**_UNPLANTED, **_SWAP_BLOCKS}, pytest=True),
         "transfer_async as the row above, the blocks moved by vLLM's C++ op torch.ops._C_cache_ops.swap_blocks "
         "with a numpy (src, dst) mapping",
         "no engine loop: the sanitizer runs the handler's unit tests (pytest --kvz-sanitize)"),
    Pair("vllm-handler-loads-47282", "vLLM #47282 (loads) in the CPU offloading handler", DEVICE_ACCESS,
         Side(f"{_SWAP}:racy_load", (_SWAP, "racy_load"), marks=(f"{_SWAP}:racy_load",)),
         Side(f"{_SWAP}:make", (_SWAP, "make")),
         "as the stores row", "no unit-test form"),
    Pair("sglang-hicache-36738", "SGLang #36738 (load not after the forward stream)", DEVICE_ACCESS,
         Side(f"{_STYLE}:hicache_controller_kernel", (_UNIT_HICACHE, "-v"), {**_PLANTED_36738, **_KERNEL_IO},
              marks=(f"{_UNIT_HICACHE}:36738", "tests/engine_style/hicache_controller.py:36738")),
         Side(f"{_STYLE}:hicache_controller_kernel", (_UNIT_HICACHE, "-v"), {**_UNPLANTED, **_KERNEL_IO}),
         "HiCacheController load/start_loading with SGLang's kernel io backend: sgl_kernel transfer_kv_per_layer "
         "over device index tensors, transfer_kv_all_layer through uint64 tables of layer addresses",
         "no engine loop: the sanitizer runs the controller's unit tests"),
    Pair("sglang-hicache-27444", "SGLang #27444 (host lock released once the load is queued, host pages recycled mid-load)",
         HOST_WRITE,
         Side(f"{_STYLE}:hicache_controller_kernel", (_UNIT_HICACHE,), {**_PLANTED_27444, **_KERNEL_IO},
              marks=("tests/engine_style/hicache_controller.py:27444",)),
         Side(f"{_STYLE}:hicache_controller_kernel", (_UNIT_HICACHE,), {**_UNPLANTED, **_KERNEL_IO}),
         "HiCacheController load/start_loading/loading_check with the kernel io backend (sgl_kernel "
         "transfer_kv_per_layer), the host pool's lock and eviction (the fuzzer asks it through evict)",
         "no engine loop: the sanitizer runs the controller's unit tests"),
    Pair("lmcache-4830", "LMCache #4830 (pinned temporaries freed under the transfer kernel)", HOST_WRITE,
         Side(f"{_LMC}:temporaries_freed_on_return", (_LMC,), marks=(_LMC,)),
         Side(f"{_LMC}:temporaries_synced_before_return", (_LMC, "--fixed")),
         "lmcache.c_ops.multi_layer_block_kv_transfer (pybind) through a device table of K/V plane addresses; "
         "chunk.pin_memory() temporaries read through their raw addresses",
         "no unit-test form"),
    Pair("lmcache-4830-unit", "LMCache #4830, the transfer context's unit tests", HOST_WRITE,
         Side(f"{_LMC}:temporaries_freed_on_return", (_UNIT_LMC,), _PLANTED, pytest=True, marks=(_LMC,)),
         Side(f"{_LMC}:temporaries_synced_before_return", (_UNIT_LMC,), _UNPLANTED, pytest=True),
         "gather / scatter_cpu_to_paged_kv tested as LMCache tests its GPU connectors (pytest, parametrized)",
         "the factories are the loop row's"),
)
BY_NAME = {pair.name: pair for pair in PAIRS}


def _env(side: Side) -> dict[str, str]:
    env = dict(os.environ)
    env.update(side.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(command: list[str], env: dict[str, str]) -> tuple[int | None, str, float]:
    """``command``'s exit status (None: timed out), output and seconds. A run that was interrupted
    (Ctrl-C or SIGTERM reached it, or this process) judges nothing: ``KeyboardInterrupt``."""
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        status, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        status, text = None, f"timed out after {TIMEOUT_S} s"
    if interrupted() or status in (-signal.SIGINT, -signal.SIGTERM, INTERRUPTED):
        raise KeyboardInterrupt
    return status, text, round(time.perf_counter() - started, 1)


def fuzz(side: Side, racy: bool, scratch: Path, backend: str = "sim") -> dict[str, Any]:
    """Both shards of the factory's one campaign (``GEOMETRY``, pinned host pool) on ``backend``
    (on cuda in the controlled mode)."""
    summary = scratch / "summary.json"
    mode = ["--cuda-mode", "controlled"] if backend == "cuda" else []
    status, text, seconds = _run([sys.executable, "-m", "pytest", "fuzz", "--offloader", side.factory,
                                  "--backend", backend, *mode, "--geometry", GEOMETRY, "--host-memory", "pinned",
                                  "--fuzz-summary", str(summary), "--repro-dir", str(scratch / "traces"),
                                  "-p", "no:randomly", "-p", "no:cacheprovider", "-q"], _env(side))
    row: dict[str, Any] = {"exit": status, "seconds": seconds}
    if not summary.exists():
        return {**row, "verdict": "error", "error": (text.strip().splitlines() or ["no summary"])[-1]}
    data = json.loads(summary.read_text())
    campaigns = data["campaigns"]
    shrunk = [c for c in campaigns if c["found"] and c.get("shrink")]
    row.update({
        "campaigns": len(campaigns), "found": sum(c["found"] for c in campaigns),
        "harness_errors": data["totals"]["harness_errors"], "resource_errors": data["totals"]["resource_errors"],
        "not_run": data["totals"]["not_run"], "steps": data["totals"]["steps"],
        "trace_ops": max((c["trace_ops"] for c in campaigns if c["found"] and c["trace_ops"] is not None), default=None),
        "replays": sum(c["shrink"].get("replays") or 0 for c in shrunk),
        "first_finding_s": min((c["first_finding_s"] for c in campaigns if c["first_finding_s"] is not None), default=None),
        "findings": sorted({f for c in campaigns for f in c["findings"][:1]}),
    })
    broken = row["harness_errors"] or row["resource_errors"] or row["not_run"] or not campaigns
    traces = sorted({c["trace"] for c in campaigns if c["found"] and c.get("trace")})
    if racy and traces and not broken:
        row["reproduced"] = [_replayed(side, trace) for trace in traces]
    if broken:
        row["verdict"] = "error"
    elif racy:
        steady = bool(traces) and all(shown == f"{REPLAYS}/{REPLAYS}" for shown in row.get("reproduced", []))
        row["verdict"] = ("missed" if not row["found"] else
                          "long trace" if row["trace_ops"] is None or row["trace_ops"] > MAX_TRACE_OPS else
                          "found" if steady else "unsteady replay")
    else:
        row["verdict"] = "clean" if row["found"] == 0 else "false alarm"
    return row


def _replayed(side: Side, trace: str) -> str:
    """``"k/n"``: in how many of :data:`REPLAYS` replays of ``trace`` (``python -m repro replay``)
    the finding showed, in the side's environment; ``"0/n"`` where the replay itself failed."""
    status, text, _ = _run([sys.executable, "-m", "repro", "replay", trace, "--repeat", str(REPLAYS)], _env(side))
    shown = re.search(r"reproduced (\d+) of (\d+)", text)
    return f"{shown.group(1)}/{shown.group(2)}" if shown and status in (0, 1) else f"0/{REPLAYS}"


def sanitizer(side: Side, racy: bool, kind: str, scratch: Path, backend: str = "sim",
              force: bool = False) -> dict[str, Any]:
    """Our sanitizer on the side's loop, on ``backend`` (observing, or with ``force`` holding queued
    copies): the kind, and the marked lines where there are some."""
    report = scratch / "races.json"
    if side.pytest:
        command = [sys.executable, "-m", "pytest", side.loop[0], "--kvz-sanitize", "--kvz-sanitize-backend", backend,
                   *(["--kvz-sanitize-force"] if force else []), "-p", "no:randomly", "-p", "no:cacheprovider", "-q"]
    else:
        command = [sys.executable, "-m", "sanitizer", "--backend", backend, *(["--force"] if force else []),
                   "--json", str(report), "--", sys.executable, *side.loop]
    status, text, seconds = _run(command, _env(side))
    row: dict[str, Any] = {"exit": status, "seconds": seconds}
    if side.pytest:
        if not re.search(r"kvz-sanitize \((simulator|observe mode|force mode)\)", text):
            return {**row, "verdict": "error", "error": (text.strip().splitlines() or ["no summary"])[-1]}
        races, data = plugin_races(text), {}
    elif report.exists():
        data = json.loads(report.read_text())
        races = data["races"]
    else:
        return {**row, "verdict": "error", "error": (text.strip().splitlines() or ["no report"])[-1]}
    # A run that did not end as a judged one (the program failed on its own, the tool's own error, a
    # unit test that failed with no race reported) says nothing either way: never clean, never
    # missed (on the H100, runs that crashed inside the tool were read as "clean" and "missed").
    if status not in (0, 1) or (status == 1 and not races):
        why = data.get("program_error") or (text.strip().splitlines() or [f"exit {status}"])[-1]
        return {**row, "verdict": "error", "error": str(why)[:300]}
    row["kinds"] = sorted({r["kind"] for r in races})
    row["sites"] = sorted({f"{_site(r['queued'])} / {_site(r['later'])}" for r in races})[:4]
    row["unfollowed"] = data.get("unfollowed") or []
    row["program_error"] = data.get("program_error")
    if not racy:
        row["verdict"] = "false alarm" if races else "clean"
        return row
    row["verdict"] = "found" if kind in row["kinds"] else "wrong kind" if races else "missed"
    if side.marks and races:
        row["lines"] = judge_lines(kind, _marks(side.marks), races)
    return row


def _marks(files: tuple[str, ...]) -> dict[str, tuple[Path, int]]:
    """``{"queued": (file, line), "later": (file, line)}`` from the files marking a race (one, or a
    unit test marking its queued line and the code under test its later one)."""
    found: dict[str, tuple[Path, int]] = {}
    for spec in files:
        path, _, factory = spec.partition(":")
        for which, line in _marked(ROOT / path, factory or None).items():
            found[which] = (ROOT / path, line)
    return found


def _marked(path: Path, factory: str | None) -> dict[str, int]:
    try:
        return marked_lines(path, factory)
    except ValueError:  # a file marking one of the two lines only
        text = path.read_text().splitlines()
        label = f"race[{factory}]" if factory else "race"
        return {which: number for number, line in enumerate(text, start=1) for which in ("queued", "later")
                if re.search(rf"#.*\b{re.escape(label)}: {which}\b", line)}


_REPORT = re.compile(r"^kvz-sanitize: .*\[([a-z-]+)\]\n(?:  (?!queued:).*\n)*"
                     r"  queued: .*, at (\S+):(\d+) \(.*\n  then: .*, at (\S+):(\d+) \(", re.M)


def plugin_races(text: str) -> list[dict[str, Any]]:
    """The races of ``pytest --kvz-sanitize``'s report (each test's section), in ``Race.to_json``'s shape."""
    return [{"kind": kind, "queued": {"site": {"file": qf, "line": int(ql)}}, "later": {"site": {"file": lf, "line": int(ll)}}}
            for kind, qf, ql, lf, ll in _REPORT.findall(text)]


def _site(access: dict[str, Any]) -> str:
    site = access.get("site")
    return f"{Path(site['file']).name}:{site['line']}" if site else "?"


def torch_sanitizer(side: Side, racy: bool) -> dict[str, Any]:
    """PyTorch's CUDA sanitizer on the loop: a report is a finding (it names no lines to check)."""
    import torch

    if not torch.cuda.is_available():
        return {"verdict": "needs a GPU"}
    if not side.loop:
        return {"verdict": "not run"}
    command = ([sys.executable, "-m", "pytest", side.loop[0], "-p", "no:randomly", "-p", "no:cacheprovider", "-q", "-rs"]
               if side.pytest else [sys.executable, *side.loop])
    status, text, seconds = _run(command, {**_env(side), "TORCH_CUDA_SANITIZER": "1"})
    seen = CSAN_MARK in text
    row: dict[str, Any] = {"exit": status, "seconds": seconds}
    if not seen and NEEDS_EXTENSION.search(text):  # run bare, the program needs the engine's extension
        return {**row, "verdict": NEEDS_THE_EXTENSION}
    crashed = status not in (0, 1) or (not side.pytest and "Traceback (most recent call last)" in text)
    if not seen and crashed:  # a loop that raised did not run to its end: no verdict either way
        return {**row, "verdict": "error", "error": (text.strip().splitlines() or ["no output"])[-1]}
    return {**row, "verdict": ("found" if seen else "missed") if racy else ("false alarm" if seen else "clean")}


def judge_side(pair: Pair, racy: bool, tool: str, backend: str = "sim") -> dict[str, Any]:
    side = pair.racy if racy else pair.fixed
    with tempfile.TemporaryDirectory(prefix="kvz-engine-shapes-") as scratch:
        if tool == "fuzz":
            row = fuzz(side, racy, Path(scratch), backend)
        elif tool in ("sanitizer", "sanitizer-force"):
            row = sanitizer(side, racy, pair.kind, Path(scratch), backend, force=tool == "sanitizer-force")
        else:
            row = torch_sanitizer(side, racy)
    if (row.get("exit") or 0) < 0:  # killed by a signal (a crash): whatever it left says nothing either way
        row = {**row, "verdict": "error", "error": f"killed by signal {-row['exit']}"}
    return {"pair": pair.name, "side": "racy" if racy else "fixed", "tool": tool, **row}


def met(row: dict[str, Any]) -> bool:
    """Whether a row meets its target (``needs a GPU`` and ``not run`` are gaps, not misses)."""
    if row["verdict"] in ("needs a GPU", "not run", NEEDS_THE_EXTENSION):
        return True
    return row["verdict"] == ("found" if row["side"] == "racy" else "clean")


def table(rows: list[dict[str, Any]], pairs: list[Pair], tools: tuple[str, ...]) -> str:
    by = {(r["pair"], r["side"], r["tool"]): r for r in rows}
    lines = ["| pair | upstream | " + " | ".join(f"{t} racy / fixed" for t in tools) + " |",
             "|" + " --- |" * (2 + len(tools))]
    for pair in pairs:
        cells = []
        for tool in tools:
            racy, fixed = by.get((pair.name, "racy", tool)), by.get((pair.name, "fixed", tool))
            cells.append(f"{_cell(racy)} / {_cell(fixed)}")
        lines.append(f"| `{pair.name}` | {pair.upstream} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    text = row["verdict"]
    if row["tool"] == "fuzz" and row.get("trace_ops") is not None:
        shown = f", replays {' '.join(row['reproduced'])}" if row.get("reproduced") else ""
        text += f" ({row['found']}/{row['campaigns']}, {row['trace_ops']} ops{shown})"
    if row.get("lines"):
        text += f", lines: {row['lines']}"
    return text


def parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated pair names (default: all)")
    p.add_argument("--tools", default=None,
                   help=f"comma-separated, of {', '.join(CUDA_TOOLS)} (default: {','.join(TOOLS)}; on cuda {','.join(CUDA_TOOLS)})")
    p.add_argument("--backend", default="sim", help="where our tools run: sim (default) or cuda (a GPU; the fuzzer "
                                                   "in the controlled mode, the sanitizer observing and forcing)")
    p.add_argument("-j", "--jobs", type=int, default=2, help="runs at once (default 2)")
    p.add_argument("--json", help="write the rows, the command, the commit and the environment here")
    return p


def _commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or None


def _uncommitted(pairs: list[Pair]) -> list[str]:
    """The files of ``pairs`` that differ from the commit (the run judged the working tree)."""
    files = sorted({s.split(":")[0] for p in pairs for side in (p.racy, p.fixed)
                    for s in (side.factory, *side.loop[:1], *side.marks) if s.endswith(".py") or ".py:" in s})
    done = subprocess.run(["git", "status", "--porcelain", "--", *files], cwd=ROOT, capture_output=True, text=True)
    return [line[3:] for line in done.stdout.splitlines()]


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    out = check_output("--json", args.json)
    names = args.only.split(",") if args.only else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise UsageError(f"--only {unknown[0]!r} is not a pair; pairs: {', '.join(BY_NAME)}")
    if args.backend not in BACKENDS:
        raise UsageError(f"--backend {args.backend!r} is not one of {', '.join(BACKENDS)}")
    known = CUDA_TOOLS if args.backend == "cuda" else TOOLS
    tools = tuple(args.tools.split(",")) if args.tools else known
    if any(t not in known for t in tools):
        raise UsageError(f"--tools {args.tools!r}: each must be one of {', '.join(known)}"
                         + (" (sanitizer-force needs --backend cuda)" if "sanitizer-force" in tools else ""))
    if args.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--backend cuda needs a GPU (torch.cuda.is_available() is False here); use --backend sim")
    if args.jobs < 1:
        raise UsageError(f"-j {args.jobs} must be a positive number of runs at once")
    pairs = [BY_NAME[n] for n in names]
    started = time.perf_counter()
    install()  # Ctrl-C and SIGTERM: no new run starts, and nothing is written (racecheck.interrupts)
    pool = ThreadPoolExecutor(max_workers=args.jobs)
    try:
        futures = [pool.submit(judge_side, pair, racy, tool, args.backend) for pair in pairs for racy in (True, False) for tool in tools]
        rows = [future.result() for future in futures]
    except BaseException:  # Ctrl-C: no further run starts (the running ones got the signal too), nothing written
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    print(table(rows, pairs, tools))
    if out is not None:
        write_json_atomically(out, {
            "command": " ".join([PROG, *argv]), "commit": _commit(), "uncommitted": _uncommitted(pairs), "date": datetime.date.today().isoformat(),
            "environment": environment(), "seconds": round(time.perf_counter() - started, 1),
            "pairs": [{"name": p.name, "upstream": p.upstream, "kind": p.kind, "shape": p.shape, "gaps": p.gaps,
                       "racy": {"factory": p.racy.factory, "loop": list(p.racy.loop), "env": p.racy.env},
                       "fixed": {"factory": p.fixed.factory, "loop": list(p.fixed.loop), "env": p.fixed.env}}
                      for p in pairs],
            "rows": rows,
        })
    for row in rows:
        if not met(row):
            print(f"{row['pair']} {row['side']} under {row['tool']}: {row['verdict']} {row.get('error', '')}".rstrip())
    return CLEAN if all(met(r) for r in rows) else FINDING


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
