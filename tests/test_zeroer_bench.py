"""``python -m fuzz.bench.kernel``: the quick run writes every table and the targets, bad input is a
usage error that names the value and the fix, the targets are judged from the numbers, a failing
or late row never loses the report, and the unchecked fast path the benchmark times zeroes the
same blocks as the checked runtime the fuzzer runs.

The figures themselves come from a GPU run (docs/performance.md); no test asserts a timing.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import fuzz.bench.kernel.measure as measure
from fuzz.bench.kernel.caches import NAMES
from fuzz.bench.kernel.cli import benched_zeroers, main
from fuzz.bench.kernel.report import SCHEMA, targets
from zeroer.errors import RuntimeUsageError
from zeroer.cache.geometries import geometry
from zeroer.cache.layout import build_cache
from zeroer.registry import DIRECT, RACE_FREE, RACY, make_zeroer
from kvdevice.runtime import SimRuntime
from kvdevice.runtime.cuda import CudaRuntime

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DESIGNS = sorted(RACE_FREE + RACY)


# -- the quick run ---------------------------------------------------------------------------------

def test_the_quick_benchmark_writes_every_table_and_the_targets(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == SCHEMA and report["quick"] and not report["figures"]
    assert report["errors"] == [] and not report["budget_exhausted"]
    assert {"python", "torch", "triton"} <= set(report["versions"])
    assert list(report["geometries"]) == list(NAMES)
    assert all(g["guard_violations"] == [] for g in report["geometries"].values())

    assert {(r["geometry"], r["blocks"]) for r in report["bandwidth"]} == {(g, n) for g in NAMES for n in (1, 4)}
    for row in report["bandwidth"]:
        assert row["pages_zeroed"] is True and row["kernel_us"] > 0 and row["zero_us"] > 0 and row["copy_us"] > 0
    assert {(r["what"], r["path"]) for r in report["launch"]} == {
        ("empty kernel", "jit"), ("empty kernel", "cached"), ("zero_blocks (llama)", "jit"),
        ("zero_blocks (llama)", "cached")}
    assert {(r["block_size"], r["num_warps"]) for r in report["configs"]} == set(measure.QUICK_CONFIGS)

    assert {(r["geometry"], r["order"]) for r in report["bandwidth"]} == {
        (g, "random") for g in NAMES} | {("llama", "ascending")}
    cells = {(r["design"], r["runtime"], r["gpu"], r["ids"]) for r in report["host"]}
    # The direct designs need CUDA: on the CPU each has one row saying so, and no error.
    assert cells == {(d, rt, gpu, n) for d in benched_zeroers() if d not in DIRECT
                     for rt in ("unchecked", "checked") for gpu in ("idle", "busy") for n in (1, 4)} | {
        (d, "direct", "setup", None) for d in DIRECT}
    for row in report["host"]:
        if row["design"] in DIRECT:
            assert row["skipped"] == "runs on CUDA only (zeroer/designs)"
            continue
        assert row["median_us"] > 0 and row["samples"] > 0
        if row["gpu"] == "busy":
            assert row["busy_throughout"] is True
        # With the device behind, the checker flags the racy designs and only them; unchecked
        # runtimes record nothing.
        racy_and_seen = row["verdict"] == "racy" and row["gpu"] == "busy" and row["runtime"] == "checked"
        assert (row["hazards"] > 0) == racy_and_seen, row

    assert [t["name"] for t in report["targets"]] == ["kernel_vs_zero", "race_free_vs_per_call",
                                                      "one_block_vs_empty"]
    assert all(t["status"] in ("SKIP", "N/A") for t in report["targets"])
    printed = capsys.readouterr().out
    assert "not figures; figures come only from a GPU run without --quick" in printed
    assert "== targets" in printed and "us/call (median)" in printed


def test_a_run_past_its_budget_skips_its_rows_and_still_writes_its_json(tmp_path):
    out = tmp_path / "late.json"
    assert main(["--quick", "--max-seconds", "0.000001", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["budget_exhausted"] and report["errors"] == []
    rows = report["launch"] + report["bandwidth"] + report["host"] + report["configs"]
    assert rows and all(r["skipped"] == "over the --max-seconds budget" for r in rows)


def test_a_failing_row_is_recorded_and_the_others_are_measured(tmp_path, monkeypatch):
    real = measure.pick_ids

    def planted(n: int, num_blocks: int, order: str = "random") -> list[int]:
        if n == 4:
            raise RuntimeError("planted failure")
        return real(n, num_blocks, order)

    monkeypatch.setattr(measure, "pick_ids", planted)
    out = tmp_path / "failed.json"
    argv = ["--quick", "--sections", "bandwidth,host", "--geometry", "llama", "--json", str(out)]
    assert main(argv) == 1
    report = json.loads(out.read_text())
    for order in measure.ORDERS:
        by_blocks = {r["blocks"]: r for r in report["bandwidth"] if r["order"] == order}
        assert by_blocks[4]["error"] == "RuntimeError: planted failure"
        assert by_blocks[1]["pages_zeroed"] is True and "error" not in by_blocks[1]
    for row in [r for r in report["host"] if r["design"] not in DIRECT]:
        assert ("error" in row) == (row["ids"] == 4) and (row["ids"] == 4 or row["median_us"] > 0)
    assert {e["section"] for e in report["errors"]} == {"bandwidth", "host"}
    runtime_designs = [d for d in benched_zeroers() if d not in DIRECT]
    assert len(report["errors"]) == 2 + 2 * 2 * len(runtime_designs)  # orders; runtimes x GPU states


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--quick", "--blocks", "0"], "argument --blocks: 0 is not a positive count; give positive ints "
                                   "separated by commas, e.g. --blocks 1,16,256"),
    (["--quick", "--ids", "1,x"], "argument --ids: 'x' is not an int; give positive ints separated by "
                                  "commas, e.g. --ids 1,16,256"),
    (["--quick", "--geometry", "gpt2"], "argument --geometry: unknown geometry 'gpt2'; choose from "
                                        "llama, hybrid, mla, e.g. --geometry llama,hybrid"),
    (["--quick", "--sections", "gpu"], "argument --sections: unknown section 'gpu'; choose from "
                                       "launch, bandwidth, host, configs, e.g. --sections launch,bandwidth"),
    (["--quick", "--ids", "17"], "argument --ids: 17 is more than the 16 blocks a benchmark cache "
                                 "(--quick) can zero (block 0 is the null block); use at most 16"),
    (["--quick", "--max-seconds", "0"], "argument --max-seconds: '0' is not a positive number of "
                                        "seconds, e.g. --max-seconds 240"),
])
def test_bad_arguments_are_usage_errors_that_name_the_value_and_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert re.search(rf"^python -m fuzz\.bench\.kernel: error: {re.escape(message)}$",
                     capsys.readouterr().err, re.MULTILINE)


def test_an_unknown_zeroer_lists_the_benchmarked_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--zeroers", "nope"])
    listed = ", ".join(benched_zeroers())
    assert f"error: argument --zeroers: unknown zeroer 'nope'; choose from {listed}, e.g." in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_the_full_benchmark_without_a_gpu_points_to_the_quick_run(capsys):
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "error: no CUDA GPU here (torch.cuda.is_available() is False) and the full benchmark measures "
        "a GPU; run python -m fuzz.bench.kernel --quick for the CPU smoke test")


def test_plot_refuses_a_missing_or_foreign_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plot", str(tmp_path / "missing.json"), "--png-dir", str(tmp_path)])
    assert exited.value.code == 2
    assert f"error: {str(tmp_path / 'missing.json')!r} does not exist; give a JSON file written by " \
           f"python -m fuzz.bench.kernel --json PATH" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(SystemExit):
        main(["plot", str(other), "--png-dir", str(tmp_path)])
    assert "is not a fuzz.bench.kernel result" in capsys.readouterr().err


# -- targets and figures from the numbers ----------------------------------------------------------

def _result(**changes: float) -> dict:
    """A GPU result reduced to the rows the targets read."""
    kernel_us = changes.get("one_block_us", 5.0)
    result = {
        "schema": SCHEMA, "figures": True, "versions": {"gpu": "a GPU", "torch": "x", "triton": "y"},
        "bandwidth": [
            {"geometry": "llama", "blocks": 1, "bytes": 2**21, "kernel_us": kernel_us, "kernel_gbps": 400.0,
             "zero_gbps": 1000.0, "copy_gbps": 700.0, "kernel_vs_zero": 0.4},
            {"geometry": "llama", "blocks": 256, "bytes": 2**29, "kernel_us": 120.0, "kernel_gbps": 4400.0,
             "zero_gbps": 4600.0, "copy_gbps": 2500.0, "kernel_vs_zero": changes.get("at_256", 0.957)},
            {"geometry": "llama", "blocks": 4096, "bytes": 2**33, "kernel_us": 1900.0, "kernel_gbps": 4500.0,
             "zero_gbps": 4700.0, "copy_gbps": 2600.0, "kernel_vs_zero": 0.957},
            {"geometry": "mla", "blocks": 256, "bytes": 2**29, "kernel_us": 300.0, "kernel_gbps": 1000.0,
             "zero_gbps": 4600.0, "copy_gbps": 2500.0, "kernel_vs_zero": 0.2},  # not a target
        ],
        "launch": [{"what": "empty kernel", "path": "cached", "blocks": 0, "gpu_us": 3.0,
                    "host": {"median_us": 4.0}}],
        "host": [],
    }
    for gpu in ("idle", "busy"):
        for design, verdict, us in (("per_call", "race-free", 30.0), ("event_ring", "race-free", 9.0),
                                    ("single_buffer", "racy", 1.0)):
            us = changes.get(f"{design}_{gpu}", us)
            result["host"].append({"design": design, "verdict": verdict, "runtime": "unchecked",
                                   "gpu": gpu, "ids": 1, "median_us": us})
            result["host"].append({"design": design, "verdict": verdict, "runtime": "checked",
                                   "gpu": gpu, "ids": 1, "median_us": us * 3})
    return result


def _statuses(result: dict) -> dict[str, tuple]:
    return {t["name"]: (t["value"], t["status"]) for t in targets(result)}


def test_the_targets_are_judged_on_ratios_measured_in_the_same_run():
    assert _statuses(_result()) == {"kernel_vs_zero": (0.957, "PASS"),
                                    "race_free_vs_per_call": (0.3, "PASS"),  # racy designs do not count
                                    "one_block_vs_empty": (1.667, "PASS")}
    assert _statuses(_result(at_256=0.89, event_ring_busy=12.0, one_block_us=6.5)) == {
        "kernel_vs_zero": (0.89, "FAIL"), "race_free_vs_per_call": (0.4, "FAIL"),
        "one_block_vs_empty": (2.167, "FAIL")}
    cpu = dict(_result(), figures=False)
    assert {status for _, status in _statuses(cpu).values()} == {"SKIP"}
    missing = dict(_result(), bandwidth=[], launch=[], host=[])
    assert {status for _, status in _statuses(missing).values()} == {"N/A"}


def test_the_host_target_compares_designs_as_they_ship_and_the_kernel_target_scattered_ids():
    result = _result()
    # Adjacent ids are shown, not judged: a slow row there must not fail the kernel target.
    result["bandwidth"].append({"geometry": "llama", "order": "ascending", "blocks": 256, "bytes": 2**29,
                                "kernel_us": 100.0, "kernel_gbps": 100.0, "zero_gbps": 4600.0,
                                "kernel_vs_zero": 0.5})
    for gpu, base, ours in (("idle", 40.0, 8.0), ("busy", 50.0, 15.0)):
        result["host"] += [
            {"design": "torch_per_call", "verdict": "race-free", "runtime": "direct", "gpu": gpu, "ids": 1,
             "median_us": base},
            {"design": "graph_ring", "verdict": "race-free", "runtime": "direct", "gpu": gpu, "ids": 1,
             "median_us": ours}]
    host = next(t for t in targets(result) if t["name"] == "race_free_vs_per_call")
    # The baseline is vLLM's own code; event_ring on the unchecked runtime (9 us) is a rival too,
    # the best one with the GPU busy here.
    assert (host["value"], host["status"]) == (0.2, "PASS")
    assert host["detail"]["1 ids, GPU busy"]["best"] == "event_ring"
    assert host["detail"]["baseline"] == "torch_per_call"
    assert host["detail"]["1 ids, GPU idle"] == {"best": "graph_ring", "ratio": 0.2, "best_us": 8.0,
                                                "per_call_us": 40.0}
    assert host["detail"]["through the runtime: event_ring / per_call"] == {"1 ids, GPU idle": 0.3,
                                                                            "1 ids, GPU busy": 0.3}
    kernel = next(t for t in targets(result) if t["name"] == "kernel_vs_zero")
    assert (kernel["value"], kernel["status"]) == (0.957, "PASS")
    assert kernel["detail"]["256 ascending"] == 0.5


def test_the_figures_are_drawn_from_the_json_file(tmp_path):
    pytest.importorskip("matplotlib")
    result = _result()
    result["host"] = [dict(r, ids=n) for r in result["host"] for n in (1, 16)]
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    assert main(["plot", str(path), "--png-dir", str(tmp_path / "img")]) == 0
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == ["zeroer-bandwidth.png",
                                                                    "zeroer-host-per-call.png"]


# -- the unchecked fast path -----------------------------------------------------------------------

CALLS = [[1, 3], [5], [2, 6]]


def _zeroed_after(rt, name: str, between=None, delay: int = 0) -> tuple[set[int], list[str], object]:
    """Blocks zeroed by CALLS (the runtime synchronised after each one with `between`, or the
    stream held back by `delay` units first), the guard check, and the runtime."""
    cache = build_cache(geometry("tiny"), device=rt.device)
    if cache.device.type == "cuda":
        torch.cuda.synchronize()  # the cache was filled on torch's stream, not the runtime's
    zeroer = make_zeroer(name, cache, rt)
    zeroer.warmup()
    rt.synchronize()
    if delay:
        rt.delay(rt.current_stream(), delay)
    for ids in CALLS:
        zeroer.zero_block_ids(ids)
        if between is not None:
            between()
    rt.synchronize()
    zeroed = {b for b in range(1, cache.spec.num_blocks)
              if all(bool((w.cpu() == 0).all()) for w in cache.block_words(b))}
    return zeroed, cache.guard_violations(), rt


@pytest.mark.parametrize("name", DESIGNS)
def test_the_unchecked_simulator_zeroes_the_same_blocks_and_records_nothing(name):
    checked, checked_guards, checked_rt = _zeroed_after(SimRuntime(), name)
    fast, fast_guards, fast_rt = _zeroed_after(measure.UncheckedSimRuntime(), name)
    assert fast == checked and fast_guards == checked_guards == []
    assert fast_rt.hazards == [] and bool(checked_rt.hazards) == (name in RACY)
    # On a device that keeps up, every design zeroes every block, checked or not.
    for rt in (SimRuntime(), measure.UncheckedSimRuntime()):
        assert _zeroed_after(rt, name, between=rt.synchronize)[0] == {1, 2, 3, 5, 6}


def test_checked_false_is_only_for_the_free_running_mode():
    with pytest.raises(RuntimeUsageError, match=r"^checked=False needs mode='free': the controlled mode's "
                       r"schedule is built on the bookkeeping that checked=False skips; use "
                       r"CudaRuntime\(mode='free', checked=False\)$"):
        CudaRuntime(mode="controlled", checked=False)
    with pytest.raises(RuntimeUsageError, match=r"^checked='no': pass True \(the default\) or False$"):
        CudaRuntime(mode="free", checked="no")


@needs_cuda
@pytest.mark.parametrize("name", DESIGNS)
def test_the_unchecked_cuda_runtime_zeroes_the_same_blocks_as_the_checked_one(name):
    seen = {}
    for checked in (True, False):
        rt = CudaRuntime(mode="free", checked=checked)
        try:
            with rt.use_stream(rt.default_stream):  # the fast path's no-switch case
                seen[checked, "idle"] = _zeroed_after(rt, name, between=rt.synchronize)[:2]
            if name in RACE_FREE:  # outside use_stream, the GPU behind: the switching case
                seen[checked, "busy"] = _zeroed_after(rt, name, delay=50)[:2]
            assert rt.hazards == []
        finally:
            rt.close()
    for key, (zeroed, guards) in seen.items():
        assert zeroed == {1, 2, 3, 5, 6} and guards == [], key
