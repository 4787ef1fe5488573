"""The detection report: per-entry rows, the verdict, the terminal table and the plot.

Pure functions over the records of :func:`fuzz.bench.detect.run.run_job` (plain dicts), so tests call
them without running anything. Verdicts, per method and entry:

* a zoo entry is ``detected`` when it was found on every seed, ``MISSED`` when on none,
  ``found k/n`` otherwise; it meets the target when detected with a median time to the first
  finding within :data:`TARGET_FIRST_FINDING_S`;
* a race-free implementation is ``clean`` or ``FALSE POSITIVE`` (any finding on any seed);
* a run whose method raised is an ``error``;
* a run that ran the GPU out of memory is a ``resource error``: neither found nor missed (exit 2
  when nothing else failed; the benchmark reruns such jobs one at a time first).

The run fails (exit 1) when the ``fuzz`` method has a false positive, an error, or a zoo entry
not found on every seed; baselines are reported and never decide the exit status.

Example::

    rows = summarize(records)
    print(render_table(rows))
"""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_bytes_atomically
from fuzz.bench.detect.outcome import FUZZ, QUICK
from fuzz.bench.stats import spread

TARGET_FIRST_FINDING_S = 60.0  # median seconds to the first finding, per zoo entry (issue 5)
TARGET_DETECTION_RATE = 1.0  # every zoo entry, on every seed
TARGET_MEDIAN_EXAMPLES = 12  # median examples to the first finding, per zoo entry (16x the PCT bound of 1/200)
TARGET_CLEAN_STEPS = 1_000_000  # steps on race-free implementations without a finding (simulator)


def summarize(records: list[dict]) -> list[dict[str, Any]]:
    """One row per (method, entry), in method then entry order, from per-seed records; the
    quick-profile campaign records (``profile == "quick"``) become the ``quick`` figure of their
    entry's fuzz row."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    quick: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        (quick[record["entry"]] if record.get("profile") == QUICK else groups[(record["method"], record["entry"])]).append(record)
    rows = []
    for (method, entry), runs in sorted(groups.items()):
        runs = sorted(runs, key=lambda r: r["seed"])
        kind = runs[0]["kind"]
        found = [r for r in runs if r["found"]]
        errors = [r for r in runs if r.get("error") and not r.get("resource_error")]
        resource = [r for r in runs if r.get("resource_error")]
        first = spread([r["seconds"] for r in found])
        if errors:
            verdict = "error"
        elif resource:  # the GPU ran out of memory on some seed: neither found nor missed there
            verdict = "resource error"
        elif kind == "zoo":
            verdict = "detected" if len(found) == len(runs) else ("MISSED" if not found else f"found {len(found)}/{len(runs)}")
        else:
            verdict = "FALSE POSITIVE" if found else "clean"
        met = (verdict == "detected" and first["median"] is not None and first["median"] <= TARGET_FIRST_FINDING_S) if kind == "zoo" else verdict == "clean"
        geometries = sorted({r["geometry"] for r in runs})
        rows.append({
            "method": method,
            "entry": entry,
            "kind": kind,
            "geometry": geometries[0] if len(geometries) == 1 else ",".join(geometries),
            "seeds": [r["seed"] for r in runs],
            "found": f"{len(found)}/{len(runs)}",
            "verdict": verdict,
            "target_met": met,
            "first_finding_s": first,
            "first_finding_examples": spread([r["examples"] for r in found]),
            "wall_s": spread([r["wall_s"] for r in found] if found else [r["wall_s"] for r in runs]),
            "trace_len": spread([r["trace_len"] for r in found]),
            "steps": sum(r["steps"] for r in runs),
            "repro": next((r["repro"] for r in found if r["repro"]), None),
            "repro_rate": _repro_rate(found),
            "quick": _quick(quick.get(entry, [])) if method == FUZZ and kind == "zoo" else None,
            "message": found[0]["message"] if found else (errors[0]["error"] if errors else "no finding"),
            "runs": runs,
        })
    return rows


def _repro_rate(found: list[dict]) -> dict[str, Any] | None:
    """Replays of the shrunk traces that showed a finding, over all seeds (None: not measured)."""
    measured = [r for r in found if r.get("replays")]
    if not measured:
        return None
    replays, shown = sum(r["replays"] for r in measured), sum(r["reproduced"] for r in measured)
    return {"replays": replays, "reproduced": shown, "rate": round(shown / replays, 3)}


def _quick(runs: list[dict]) -> dict[str, Any] | None:
    """The quick-profile campaigns of one zoo entry: how many found it, and in how many examples."""
    if not runs:
        return None
    found = [r for r in runs if r["found"] and not r.get("error")]
    return {
        "campaigns": len(runs),
        "found": len(found),
        "missed": sorted(r["campaign"] for r in runs if r not in found),
        "examples": spread([r["examples"] for r in found]),
    }


def judge(rows: list[dict], skipped: list[dict]) -> dict[str, Any]:
    """Detection rate against its target, false positives, and the exit status (fuzz only)."""
    summary: dict[str, Any] = {"skipped": skipped, "by_method": {}}
    for method in sorted({r["method"] for r in rows}):
        mine = [r for r in rows if r["method"] == method]
        zoo = [r for r in mine if r["kind"] == "zoo"]
        clean = [r for r in mine if r["kind"] != "zoo"]
        detected = [r for r in zoo if r["verdict"] == "detected"]
        summary["by_method"][method] = {
            "zoo_entries": len(zoo),
            "detected": len(detected),
            "detection_rate": round(len(detected) / len(zoo), 3) if zoo else None,
            "within_target_s": sum(1 for r in zoo if r["target_met"]),
            "within_target_examples": sum(1 for r in zoo if _examples_met(r)),
            "quick_every_campaign": sum(1 for r in zoo if r.get("quick") and r["quick"]["found"] == r["quick"]["campaigns"]),
            "quick_measured": sum(1 for r in zoo if r.get("quick")),
            "missed": [r["entry"] for r in zoo if r["verdict"] not in ("detected", "resource error")],
            "race_free": len(clean),
            "false_positives": [r["entry"] for r in clean if r["verdict"] == "FALSE POSITIVE"],
            "errors": [r["entry"] for r in mine if r["verdict"] == "error"],
            "resource_errors": [r["entry"] for r in mine if r["verdict"] == "resource error"],
        }
    fuzz = summary["by_method"].get(FUZZ)
    failed = bool(fuzz and (fuzz["missed"] or fuzz["false_positives"] or fuzz["errors"]))
    summary["targets"] = {
        "detection_rate": TARGET_DETECTION_RATE,
        "first_finding_s": TARGET_FIRST_FINDING_S,
        "met": bool(fuzz) and not failed and fuzz["within_target_s"] == fuzz["zoo_entries"],
    }
    # A resource error (the GPU out of memory, racecheck.resources) decides nothing either way:
    # status 2, run with fewer workers, unless something else already failed.
    resources = bool(fuzz and fuzz["resource_errors"])
    summary["exit_status"] = 1 if failed else (2 if resources else 0)
    return summary


def _examples_met(row: dict) -> bool:
    median = row["first_finding_examples"]["median"]
    return row["verdict"] == "detected" and median is not None and median <= TARGET_MEDIAN_EXAMPLES


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if value < 10 else f"{value:.0f}"
    return str(value)


def _mmm(s: dict) -> str:
    if s["median"] is None:
        return "-"
    return f"{_fmt(s['median'])} ({_fmt(s['min'])}-{_fmt(s['max'])})"


def render_table(rows: list[dict]) -> str:
    """Markdown table, one line per method and entry: medians (min-max) over seeds."""
    lines = [
        "| method | entry | geometry | found | s to first finding | examples to first finding | s incl. shrinking "
        "| shrunk ops | replays reproduced | quick-profile campaigns found | verdict | repro |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        rate, quick = r.get("repro_rate"), r.get("quick")
        replays = f"{rate['reproduced']}/{rate['replays']}" if rate else "-"
        campaigns = f"{quick['found']}/{quick['campaigns']}" if quick else "-"
        lines.append(
            f"| {r['method']} | {r['entry']} | {r['geometry']} | {r['found']} | {_mmm(r['first_finding_s'])} "
            f"| {_mmm(r['first_finding_examples'])} | {_mmm(r['wall_s']) if r['kind'] == 'zoo' else '-'} "
            f"| {_mmm(r['trace_len'])} | {replays} | {campaigns} | {r['verdict']} | {r['repro'] or '-'} |"
        )
    return "\n".join(lines)


def render_summary(summary: dict) -> str:
    lines = []
    for method, s in summary["by_method"].items():
        if s["zoo_entries"]:
            rate = f"{s['detected']}/{s['zoo_entries']} zoo entries detected on every seed ({100 * s['detection_rate']:.0f}%, target {100 * TARGET_DETECTION_RATE:.0f}%)"
            rate += f", {s['within_target_s']} within the {TARGET_FIRST_FINDING_S:g} s median target"
            rate += f", {s['within_target_examples']} within the {TARGET_MEDIAN_EXAMPLES} examples median target"
            if s.get("quick_measured"):
                rate += f", {s['quick_every_campaign']}/{s['quick_measured']} found by every quick-profile campaign"
        else:
            rate = "no zoo entries run"
        fp = f"false positives on {s['race_free']} race-free: {', '.join(s['false_positives']) or 'none'}"
        lines.append(f"{method}: {rate}; {fp}" + (f"; errors: {', '.join(s['errors'])}" if s["errors"] else "")
                     + (f"; resource errors (GPU out of memory, not judged): {', '.join(s['resource_errors'])}"
                        if s.get("resource_errors") else ""))
        if s["missed"]:
            lines.append(f"  not detected on every seed: {', '.join(s['missed'])}")
    for skip in summary["skipped"]:
        lines.append(f"skipped {skip['entry']}: {skip['reason']}")
    return "\n".join(lines)


def render_soak(soak: dict) -> str:
    lines = [
        f"clean soak: {soak['steps']} steps ({soak['examples']} examples, {soak['runs']} runs) in {soak['seconds']:.0f} s "
        f"on {len(soak['by_config'])} configurations; target {soak['target_steps']} steps; findings: {len(soak['findings'])}",
        "",
        "| entry | geometry | runs | examples | steps |",
        "|---|---|---:|---:|---:|",
    ]
    for c in soak["by_config"]:
        lines.append(f"| {c['entry']} | {c['geometry']} | {c['runs']} | {c['examples']} | {c['steps']} |")
    for f in soak["findings"]:
        lines.append(f"FALSE POSITIVE {f['entry']} on {f['geometry']} (seed {f['seed']}): {f['message']} -> {f['repro']}")
    return "\n".join(lines)


def plot(report: dict, png: Path) -> None:
    """Time to the first finding per zoo entry and method (log scale), written to ``png``.

    Bars are medians over seeds with min-max whiskers, dots the median seconds including
    shrinking; an entry missed on a seed is marked at the budget. Needs matplotlib (``pip install matplotlib``), imported here only.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["entries"] if r["kind"] == "zoo"]
    entries = sorted({r["entry"] for r in rows})
    methods = sorted({r["method"] for r in rows})
    budget = report.get("budget_s") or TARGET_FIRST_FINDING_S
    height = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(entries) * max(1, len(methods)) ** 0.5))
    for m, method in enumerate(methods):
        by_entry = {r["entry"]: r for r in rows if r["method"] == method}
        ys, xs, lo, hi, missed, shrunk = [], [], [], [], [], []
        for e, entry in enumerate(entries):
            row = by_entry.get(entry)
            if row is None:
                continue
            y = e + (m - (len(methods) - 1) / 2) * height
            first = row["first_finding_s"]
            if first["median"] is None:
                missed.append(y)
                continue
            median = max(first["median"], 1e-3)
            ys.append(y)
            xs.append(median)
            # Clamped: a median over the seeds that found it can sit outside min-max after the
            # 1 ms floor (an H200 report crashed matplotlib with a negative error bar).
            lo.append(max(0.0, median - max(first["min"], 1e-3)))
            hi.append(max(0.0, max(first["max"], 1e-3) - median))
            shrunk.append(max(row["wall_s"]["median"] or median, 1e-3))
            if row["found"].split("/")[0] != row["found"].split("/")[1]:
                missed.append(y)
        bars = ax.barh(ys, xs, height=height, xerr=[lo, hi], label=method, capsize=2)
        ax.plot(shrunk, ys, "o", markersize=4, color="black", label="incl. shrinking (median)" if m == 0 else None)
        if missed:
            ax.plot([budget] * len(missed), missed, "x", color=bars.patches[0].get_facecolor() if bars.patches else "k", markersize=8)
    ax.axvline(TARGET_FIRST_FINDING_S, color="grey", linestyle="--", linewidth=1, label=f"target {TARGET_FIRST_FINDING_S:g} s")
    ax.set_xscale("log")
    ax.set_yticks(range(len(entries)))
    ax.set_yticklabels(entries)
    ax.invert_yaxis()
    ax.set_xlabel("seconds to the first finding (median over seeds, min-max; x: missed on a seed)")
    backend = report["backend"] + (f" ({report['mode']})" if report.get("mode") else "")
    ax.set_title(f"Time to detection, {backend}, {len(report['seeds'])} seeds, budget {budget:g} s")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=png.suffix[1:] or None, dpi=120)  # the format the name asks for, as savefig(png) would
    plt.close(fig)
    write_bytes_atomically(png, image.getvalue())
