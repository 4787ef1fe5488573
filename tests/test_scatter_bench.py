"""``python -m fuzz.bench.kernel.scatter``: the CPU smoke run measures every id set and writer and
checks the segment-fastest grid's pages; bad input is a usage error that names the fix.

The figures come from a GPU run (docs/performance.md, "What limits it"); no test asserts a timing.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from fuzz.bench.kernel.scatter import QUICK_FOOTPRINTS, blocks_for_gib, main


def test_the_quick_run_measures_every_writer_and_cache_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "scatter.json"
    assert main(["--quick", "--blocks", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "zeroer-scatter/1" and report["quick"] and report["device"] == "cpu"
    assert {"python", "torch", "triton"} <= set(report["versions"])
    variants = [r["variant"] for r in report["rows"] if r["cache_blocks"] == 17]
    assert variants == ["zero_() (contiguous)", "adjacent 1..n", "adjacent 1..n, random order", "every 2nd block",
                        "every 4th block", "scattered", "scattered, sorted", "scattered, torch index_fill_",
                        "scattered, segment-fastest grid"]
    assert all(r["writer_us"] > 0 and r["zero_us"] > 0 for r in report["rows"] if "ratio" in r)
    assert [r["pages_zeroed"] for r in report["rows"] if "pages_zeroed" in r] == [True]
    footprints = [(r["cache_blocks"], r["variant"]) for r in report["rows"] if r["cache_blocks"] != 17]
    assert footprints == [(blocks, "scattered") for blocks in QUICK_FOOTPRINTS]
    assert "| scattered, segment-fastest grid |" in capsys.readouterr().out


def test_a_cache_of_n_gib_holds_n_gib_of_llama_blocks_beside_the_null_block():
    assert [blocks_for_gib(g) for g in (1, 8, 64)] == [513, 4097, 32769]


def test_help_runs_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--blocks", "17"], r"argument --blocks: 17 is more than the 16 blocks the benchmark cache \(--quick\) "
                                    r"can zero \(block 0 is the null block\); use at most 16$"),
    (["--quick", "--blocks", "0"], r"argument --blocks: 0 is not a positive count; give positive ints separated by "
                                   r"commas, e\.g\. --blocks 1,16,256$"),
    (["--quick", "--cache-gib", "x"], r"argument --cache-gib: 'x' is not an int; give positive ints separated by "
                                      r"commas, e\.g\. --cache-gib 1,16,256$"),
])
def test_bad_arguments_are_usage_errors_that_name_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err.strip())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a host without a GPU")
def test_without_a_gpu_the_full_run_points_to_quick(capsys):
    with pytest.raises(SystemExit):
        main([])
    assert capsys.readouterr().err.strip().endswith(
        "no CUDA GPU here (torch.cuda.is_available() is False) and this measures a GPU; "
        "run python -m fuzz.bench.kernel.scatter --quick for the CPU smoke test")
