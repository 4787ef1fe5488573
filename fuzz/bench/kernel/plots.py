"""PNG figures from a benchmark result (matplotlib is imported here only, and only when drawing).

The GPU host may lack matplotlib: the run then writes its JSON and says so, and the figures are
drawn later anywhere with ``python -m fuzz.bench.kernel plot RESULT.json --png-dir docs/img``.

* ``zeroer-bandwidth.png``: write bandwidth against blocks per call, one panel per cache, with the
  ``zero_()`` and device-to-device copy ceilings measured in the same run (scattered ids, and
  adjacent ids too where measured);
* ``zeroer-host-per-call.png``: host microseconds per ``zero_block_ids`` call against the number
  of ids, GPU idle and busy, solid for the design's own cost (the unchecked runtime, or straight
  through torch for the direct designs) and dashed for the checked runtime the fuzzer runs, with
  the empty kernel launch as a horizontal line.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_bytes_atomically

BANDWIDTH_PNG = "zeroer-bandwidth.png"
HOST_PNG = "zeroer-host-per-call.png"


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed where the figures were asked for."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingMatplotlib(
            "matplotlib is not installed here, so no PNG was drawn; the JSON has every number: "
            "draw the figures where matplotlib is (pip install matplotlib) with "
            "python -m fuzz.bench.kernel plot RESULT.json --png-dir DIR"
        ) from None
    return plt


def _title(result: dict[str, Any], what: str) -> str:
    v = result.get("versions", {})
    where = v.get("gpu") or "CPU (not a figure)"
    return f"{what}: {where}, torch {v.get('torch')}, triton {v.get('triton')}"


def make_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Draw the figures of `result` into `out_dir`; return their paths."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    bandwidth = [r for r in result.get("bandwidth", []) if r.get("kernel_gbps") is not None]
    geometries = list(dict.fromkeys(r["geometry"] for r in bandwidth))
    if geometries:
        fig, axes = plt.subplots(1, len(geometries), figsize=(5 * len(geometries), 4), squeeze=False)
        for ax, name in zip(axes[0], geometries):
            rows = sorted((r for r in bandwidth if r["geometry"] == name
                           and r.get("order", "random") == "random"), key=lambda r: r["blocks"])
            x = [r["blocks"] for r in rows]
            ax.plot(x, [r["kernel_gbps"] for r in rows], "o-", label="zero_blocks, scattered ids")
            adjacent = sorted((r for r in bandwidth if r["geometry"] == name and r.get("order") == "ascending"),
                              key=lambda r: r["blocks"])
            if adjacent:
                ax.plot([r["blocks"] for r in adjacent], [r["kernel_gbps"] for r in adjacent], "s-",
                        label="zero_blocks, adjacent ids")
            ax.plot(x, [r.get("zero_gbps") for r in rows], "--", color="black", label="zero_() ceiling")
            ax.plot(x, [r.get("copy_gbps") for r in rows], ":", color="gray", label="D2D copy (bytes written)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(n) for n in x])
            ax.set_xlabel("blocks zeroed per call")
            ax.set_ylabel("GB/s written")
            ax.set_title(name)
            ax.grid(True, alpha=0.3)
        paths.append(_save(plt, fig, axes, _title(result, "Zero kernel bandwidth"), out_dir / BANDWIDTH_PNG))

    host = [r for r in result.get("host", []) if r.get("median_us") and r.get("ids")]
    if host:
        empty = next((r for r in result.get("launch", []) if r.get("what") == "empty kernel"
                      and r.get("path") == "cached" and r.get("host")), None)
        designs = list(dict.fromkeys(r["design"] for r in host))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
        for ax, gpu in zip(axes[0], ("idle", "busy")):
            for i, design in enumerate(designs):
                for runtime, style in (("unchecked", "-"), ("direct", "-"), ("checked", "--")):
                    rows = sorted((r for r in host if r["design"] == design and r["gpu"] == gpu
                                   and r["runtime"] == runtime), key=lambda r: r["ids"])
                    if rows:
                        ax.plot([r["ids"] for r in rows], [r["median_us"] for r in rows], style, marker="o",
                                color=colors[i % len(colors)],
                                label=design if runtime != "checked" else None)
            if empty and empty["host"].get("median_us"):
                ax.axhline(empty["host"]["median_us"], color="black", lw=0.8, ls=":", label="empty kernel launch")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ticks = sorted({r["ids"] for r in host})
            ax.set_xticks(ticks, [str(n) for n in ticks])
            ax.minorticks_off()
            ax.set_xlabel("ids per call")
            ax.set_ylabel("host us per call (median)")
            ax.set_title(f"GPU {gpu} (solid: design, dashed: checked runtime)", fontsize=9)
            ax.grid(True, alpha=0.3)
        paths.append(_save(plt, fig, axes, _title(result, "zero_block_ids host cost"), out_dir / HOST_PNG))
    return paths


def _save(plt: Any, fig: Any, axes: Any, title: str, path: Path) -> Path:
    """Legend on the first panel, the title, and the PNG written (atomically); returns its path."""
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=120)
    plt.close(fig)
    return write_bytes_atomically(path, image.getvalue())
