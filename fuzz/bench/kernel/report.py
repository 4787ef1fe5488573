"""What the benchmark reports: versions, the targets with PASS/FAIL, the tables.

Everything here is a pure function of the result dict (except :func:`versions`, which asks the
machine), so the tables and verdicts can be checked without a GPU and redrawn from a JSON file.

The targets (issue 6), each a ratio of two figures measured in the same run:

* ``kernel_vs_zero``: the Triton kernel reaches at least 90% of the measured ``zero_()``
  bandwidth for every count of 256 or more scattered blocks on the Llama-like cache (adjacent
  blocks are measured too, and shown, not judged);
* ``race_free_vs_per_call``: the cheapest race-free design other than per_call costs at most 1/3
  of per_call's host time per call, both as they would ship (``torch_per_call``, vLLM's code,
  against the direct designs and the unchecked runtime), for every id count, GPU idle and busy
  (the worst case is the value);
* ``one_block_vs_empty``: zeroing one block of the Llama-like cache takes at most twice the GPU
  time of an empty kernel launch.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
import triton

SCHEMA = "zeroer-bench/1"
TARGET_CACHE = "llama"


def versions(device: torch.device) -> dict[str, Any]:
    """Python, torch, triton, and on CUDA the GPU, its driver and the CUDA runtime."""
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "torch_cuda": torch.version.cuda,
        "git_commit": _command(["git", "rev-parse", "--short", "HEAD"]),
        "git_dirty": bool(_command(["git", "status", "--porcelain", "--untracked-files=no"])),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update({
            "gpu": torch.cuda.get_device_name(device),
            "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "gpu_sms": getattr(props, "multi_processor_count", None),
            "driver": (_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
                       or "").split("\n")[0] or None,
        })
    return out


def _command(argv: list[str]) -> str | None:
    """The command's stripped output, or None when it is missing or fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


# -- targets ---------------------------------------------------------------------------------

def _verdict(value: float | None, limit: float, at_least: bool, judged: bool) -> str:
    if value is None:
        return "N/A"
    if not judged:
        return "SKIP"
    return "PASS" if (value >= limit if at_least else value <= limit) else "FAIL"


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The three targets with value, limit and verdict (SKIP unless a GPU run, N/A if unmeasured)."""
    judged = bool(result.get("figures"))
    out = []

    target_rows = [r for r in result.get("bandwidth", []) if r.get("geometry") == TARGET_CACHE
                   and r.get("kernel_vs_zero") is not None]
    # Judged on scattered ids ("random"; files from before the orders were added have none).
    ratios = [r["kernel_vs_zero"] for r in target_rows
              if r.get("order", "random") == "random" and r.get("blocks", 0) >= 256]
    value = min(ratios) if ratios else None
    out.append({"name": "kernel_vs_zero", "limit": 0.9, "value": value,
                "status": _verdict(value, 0.9, True, judged),
                "description": f"Triton kernel / zero_() bandwidth, >= 256 scattered blocks, {TARGET_CACHE} (worst)",
                "detail": {f"{r['blocks']} {r.get('order', 'random')}": r["kernel_vs_zero"] for r in target_rows}})

    out.append(_host_target(result, judged))
    one = next((r for r in result.get("bandwidth", []) if r.get("geometry") == TARGET_CACHE
                and r.get("order", "random") == "random" and r.get("blocks") == 1 and r.get("kernel_us")), None)
    empty = next((r for r in result.get("launch", []) if r.get("what") == "empty kernel"
                  and r.get("path") == "cached" and r.get("gpu_us")), None)
    value = round(one["kernel_us"] / empty["gpu_us"], 3) if one and empty else None
    out.append({"name": "one_block_vs_empty", "limit": 2.0, "value": value,
                "status": _verdict(value, 2.0, False, judged),
                "description": f"GPU time of a one-block zero ({TARGET_CACHE}) / an empty kernel launch",
                "detail": {"one_block_us": one and one["kernel_us"], "empty_us": empty and empty["gpu_us"]}})
    return out


def _host_target(result: dict[str, Any], judged: bool) -> dict[str, Any]:
    """Best race-free design / per_call, host time per call, each as it would ship.

    The baseline is vLLM's own per_call code (``torch_per_call``, straight through torch); the
    rivals are every other race-free design, direct or on the unchecked runtime. Files or CPU
    runs without direct rows fall back to per_call and the designs on the unchecked runtime.
    The ratio of the designs through our runtime is kept in the detail for comparison.
    """
    host = [r for r in result.get("host", []) if r.get("median_us") and r.get("runtime") in ("direct", "unchecked")]
    baseline = "torch_per_call" if any(r["design"] == "torch_per_call" for r in host) else "per_call"
    per_call_names = ("per_call", "torch_per_call")
    detail: dict[str, Any] = {"baseline": baseline}
    worst = None
    for r in host:
        if r["design"] != baseline:
            continue
        rivals = [x for x in host if x["verdict"] == "race-free" and x["design"] not in per_call_names
                  and x["ids"] == r["ids"] and x["gpu"] == r["gpu"]]
        if not rivals:
            continue
        best = min(rivals, key=lambda x: x["median_us"])
        ratio = round(best["median_us"] / r["median_us"], 3)
        detail[f"{r['ids']} ids, GPU {r['gpu']}"] = {"best": best["design"], "ratio": ratio,
                                                    "best_us": best["median_us"], "per_call_us": r["median_us"]}
        worst = ratio if worst is None else max(worst, ratio)
    through = {}
    for r in host:
        if r["design"] == "per_call" and r["runtime"] == "unchecked":
            ours = next((x for x in host if x["design"] == "event_ring" and x["runtime"] == "unchecked"
                         and x["ids"] == r["ids"] and x["gpu"] == r["gpu"]), None)
            if ours:
                through[f"{r['ids']} ids, GPU {r['gpu']}"] = round(ours["median_us"] / r["median_us"], 3)
    if through:
        detail["through the runtime: event_ring / per_call"] = through
    return {"name": "race_free_vs_per_call", "limit": round(1 / 3, 3), "value": worst,
            "status": _verdict(worst, 1 / 3, False, judged),
            "description": f"best race-free design / {baseline}, host time per call (worst case)",
            "detail": detail}


# -- tables ----------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain text table, right-aligned numbers."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _problem(row: dict) -> str:
    return row.get("error") or row.get("skipped") or ""


def launch_table(rows: list[dict]) -> str:
    return table(["what", "blocks", "path", "host us (median)", "p90", "GPU us", "note"],
                 [[r["what"], r["blocks"], r["path"], r.get("host", {}).get("median_us"),
                   r.get("host", {}).get("p90_us"), r.get("gpu_us"), _problem(r)] for r in rows])


def bandwidth_table(rows: list[dict]) -> str:
    return table(["geometry", "ids", "blocks", "MiB", "kernel us", "GB/s", "zero_ us", "GB/s", "copy us", "GB/s",
                  "kernel/zero_", "pages ok", "note"],
                 [[r["geometry"], r.get("order", "random"), r["blocks"], round(r["bytes"] / 2**20, 2), r.get("kernel_us"),
                   r.get("kernel_gbps"), r.get("zero_us"), r.get("zero_gbps"), r.get("copy_us"),
                   r.get("copy_gbps"), r.get("kernel_vs_zero"), r.get("pages_zeroed"), _problem(r)]
                  for r in rows])


def config_table(rows: list[dict]) -> str:
    return table(["geometry", "BLOCK_SIZE", "num_warps", "blocks", "kernel us", "GB/s", "note"],
                 [[r["geometry"], r["block_size"], r["num_warps"], r["blocks"], r.get("kernel_us"),
                   r.get("kernel_gbps"), _problem(r)] for r in rows])


def host_table(rows: list[dict]) -> str:
    shown = [r for r in rows if "design" in r and r.get("gpu") != "setup" or _problem(r)]
    return table(["design", "verdict", "runtime", "GPU", "ids", "us/call (median)", "p10", "p90", "hazards",
                  "busy throughout", "note"],
                 [[r.get("design", "-"), r.get("verdict"), r.get("runtime"), r.get("gpu"), r.get("ids"),
                   r.get("median_us"), r.get("p10_us"), r.get("p90_us"),
                   r.get("hazards") if r.get("runtime") == "checked" else None,
                   r.get("busy_throughout"), _problem(r)] for r in shown])


def targets_table(items: list[dict]) -> str:
    return table(["target", "value", "limit", "status", "what"],
                 [[t["name"], t["value"], t["limit"], t["status"], t["description"]] for t in items])


def note_for(result: dict[str, Any]) -> str:
    if result.get("figures"):
        return "figures from a GPU run"
    return ("--quick / CPU run: a smoke test of the benchmark, not figures; figures come only from a "
            "GPU run without --quick")


