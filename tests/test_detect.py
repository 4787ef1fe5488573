"""``python -m fuzz.bench.detect``: the command line, the verdict, the report, and a small real run.

The real runs are bounded: three cheap zoo entries and one race-free implementation with one seed
and a short budget, and a clean soak of a few hundred steps (docs/detection.md has the full
measurement)."""

from __future__ import annotations

import json
import re

import pytest

from fuzz.bench import BenchUsageError
from fuzz.bench.detect.cli import CLEAN_GEOMETRIES, entry_config, main, parse_args
from fuzz.bench.detect.report import TARGET_FIRST_FINDING_S, judge, render_table, summarize
from fuzz.bench.detect.run import Job, run_job
from fuzz.engine.episode import EpisodeConfig
from zeroer.registry import RACE_FREE, ZOO


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


def record(entry: str, seed: int, found: bool, *, kind: str = "zoo", seconds: float | None = 0.5, error: str | None = None) -> dict:
    return {
        "method": "fuzz", "entry": entry, "kind": kind, "seed": seed, "geometry": "tiny", "found": found,
        "seconds": seconds if found else None, "examples": 4 if found else 200, "steps": 60, "trace_len": 3 if found else None,
        "repro": f"/tmp/{entry}.json" if found else None, "message": "hazard at step 3: ..." if found else "no finding",
        "error": error, "wall_s": 2.0,
    }


# -- the command line -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--entries", "zoo.nope"], f"--entries: unknown entry 'zoo.nope'; choose from: {', '.join(sorted(ZOO + RACE_FREE))}"),
        (["--budget", "0"], "--budget 0 must be positive; give seconds per entry and seed, e.g. 60"),
        (["--budget", "-5"], "--budget -5 must be positive; give seconds per entry and seed, e.g. 60"),
        (["--budget", "soon"], "--budget 'soon' is not a number of seconds; give a positive number, e.g. 60"),
        (["--seeds", "0"], "--seeds '0' must be a positive integer, e.g. 5"),
        (["-j", "two"], "-j 'two' must be a positive integer, e.g. 2, or auto"),
        (["--steps-clean", "-1"], "--steps-clean '-1' must be a positive integer, e.g. 1000000"),
        (["--backend", "tpu"], "--backend 'tpu' is not a backend; choose sim or cuda"),
        (["--backend", "cuda"], "--backend cuda needs a CUDA GPU and none is visible here; use --backend sim"),
        (["--mode", "fast"], "--mode 'fast' is not a cuda mode; choose controlled (gates) or free (real timing)"),
        (["--entries", ","], "--entries ',' names nothing; give comma-separated names, e.g. zoo.single_buffer,per_call"),
        (["--entries", "zoo.int32_offset_4gib"],
         "--entries: 'zoo.int32_offset_4gib' runs on cuda only (geometry 'int32_wrap'); use --backend cuda"),
        (["--steps-clean", "100", "--entries", "zoo.side_stream"],
         "--entries: 'zoo.side_stream' is a zoo entry; --steps-clean soaks race-free implementations only "
         "(event_ring, per_call, reference)"),
    ],
)
def test_bad_command_lines_are_usage_errors_that_name_the_value(argv, message):
    with pytest.raises(BenchUsageError, match=exactly(message)):
        parse_args(argv, cuda_available=False)


def test_an_unknown_method_lists_the_available_ones():
    with pytest.raises(BenchUsageError, match=r"^--methods: unknown method 'magic'; available here: fuzz"):
        parse_args(["--methods", "magic"], cuda_available=False)


def test_main_prints_a_usage_error_and_exits_2(capsys):
    assert main(["--budget", "0"]) == 2
    assert capsys.readouterr().err == "error: --budget 0 must be positive; give seconds per entry and seed, e.g. 60\n"


def test_by_default_the_simulator_runs_the_fuzzer_on_every_zoo_entry_it_can_and_the_race_free_designs():
    args = parse_args([], cuda_available=False)
    assert args.methods == ("fuzz",) and args.budget_s == 60.0 and args.seeds == 5
    assert set(args.entries) == (set(ZOO) - {"zoo.int32_offset_4gib"}) | set(RACE_FREE)
    assert [s["entry"] for s in args.skipped] == ["zoo.int32_offset_4gib"]
    soak = parse_args(["--steps-clean", "1000"], cuda_available=False)
    assert soak.entries == tuple(sorted(RACE_FREE)) and soak.steps_clean == 1000


def test_zoo_entries_run_on_their_geometry_and_race_free_ones_rotate_over_the_zoo_geometries():
    args = parse_args([], cuda_available=False)
    assert entry_config(args, "zoo.packed_overrun", 1) == EpisodeConfig(zeroer="zoo.packed_overrun", geometry="packed")
    rotated = [entry_config(args, "per_call", seed).geometry for seed in range(1, len(CLEAN_GEOMETRIES) + 1)]
    assert rotated == list(CLEAN_GEOMETRIES) and {"mla_indexer", "packed", "shared_layers", "tiny"} <= set(rotated)
    assert entry_config(args, "per_call", 1).kernel == "torch" and entry_config(args, "reference", 1).kernel is None


# -- the verdict (pure) -----------------------------------------------------------------------------


def test_every_zoo_entry_found_on_every_seed_and_nothing_on_race_free_passes():
    rows = summarize([record("zoo.a", 1, True), record("zoo.a", 2, True, seconds=1.5), record("per_call", 1, False, kind="race-free")])
    summary = judge(rows, [])
    assert [r["verdict"] for r in rows] == ["clean", "detected"]
    assert rows[1]["first_finding_s"] == {"median": 1.0, "min": 0.5, "max": 1.5}
    assert summary["by_method"]["fuzz"]["detection_rate"] == 1.0 and summary["targets"]["met"]
    assert summary["exit_status"] == 0


@pytest.mark.parametrize(
    ("records", "verdict"),
    [
        ([record("per_call", 1, True, kind="race-free")], "FALSE POSITIVE"),
        ([record("zoo.a", 1, True), record("zoo.a", 2, False)], "found 1/2"),
        ([record("zoo.a", 1, False)], "MISSED"),
        ([record("zoo.a", 1, False, error="RuntimeError: boom")], "error"),
    ],
)
def test_a_false_positive_a_partly_missed_entry_or_an_error_fails_the_run(records, verdict):
    rows = summarize(records)
    assert [r["verdict"] for r in rows] == [verdict]
    assert judge(rows, [])["exit_status"] == 1


def test_a_baseline_that_misses_or_misfires_is_reported_but_does_not_fail_the_run():
    records = [dict(record("zoo.a", 1, False), method="stress"), dict(record("per_call", 1, True, kind="race-free"), method="stress")]
    summary = judge(summarize(records), [])
    assert summary["by_method"]["stress"]["false_positives"] == ["per_call"] and summary["exit_status"] == 0


def test_the_table_shows_medians_with_their_range_and_the_repro_path():
    table = render_table(summarize([record("zoo.a", 1, True), record("zoo.a", 2, True, seconds=1.5)]))
    assert table.splitlines()[2] == "| fuzz | zoo.a | tiny | 2/2 | 1 (0.5-1.5) | 4 (4-4) | 2 (2-2) | 3 (3-3) | - | - | detected | /tmp/zoo.a.json |"


def test_replays_and_quick_profile_campaigns_are_counted_per_entry():
    found = [dict(record("zoo.a", 1, True), replays=20, reproduced=20), dict(record("zoo.a", 2, True), replays=20, reproduced=19)]
    quick = [dict(record("zoo.a", 0, True), profile="quick", campaign="zoo.a-tiny-sim-shard0"),
             dict(record("zoo.a", 0, False), profile="quick", campaign="zoo.a-tiny-sim-x2-shard0")]
    rows = summarize(found + quick)
    assert len(rows) == 1 and rows[0]["repro_rate"] == {"replays": 40, "reproduced": 39, "rate": 0.975}
    assert rows[0]["quick"]["campaigns"] == 2 and rows[0]["quick"]["missed"] == ["zoo.a-tiny-sim-x2-shard0"]
    assert "| 39/40 | 1/2 | detected |" in render_table(rows)
    by_method = judge(rows, [])["by_method"]["fuzz"]
    assert (by_method["quick_every_campaign"], by_method["quick_measured"], by_method["within_target_examples"]) == (0, 1, 1)


def test_a_slow_detection_is_detected_but_misses_the_time_target():
    rows = summarize([record("zoo.a", 1, True, seconds=TARGET_FIRST_FINDING_S + 1)])
    assert rows[0]["verdict"] == "detected" and not rows[0]["target_met"] and not judge(rows, [])["targets"]["met"]


def test_a_method_that_raises_is_recorded_as_an_error_never_as_a_finding(tmp_path):
    job = Job("fuzz", "nope", "zoo", 1, EpisodeConfig(zeroer="nope"), 1.0, str(tmp_path))
    result = run_job(job)
    assert not result["found"] and result["message"] == "harness error"
    assert result["error"].startswith("harness error in building the episode, not a finding: ZeroerSpecError: "
                                      "unknown zeroer 'nope'")


# -- real runs, bounded ---------------------------------------------------------------------------


def test_a_small_detection_run_finds_three_zoo_entries_and_writes_its_report(tmp_path, capsys):
    report_path = tmp_path / "detect.json"
    entries = "zoo.packed_overrun,zoo.shared_k_only,zoo.side_stream,reference"
    argv = ["--entries", entries, "--seeds", "1", "--budget", "3", "--json", str(report_path), "--repro-dir", str(tmp_path / "traces")]
    assert main(argv) == 0
    report = json.loads(report_path.read_text())
    assert report["kind"] == "detection" and report["backend"] == "sim" and report["seeds"] == [1]
    assert report["machine"]["nproc"] >= 1 and report["command"].endswith("--repro-dir " + str(tmp_path / "traces"))
    rows = {r["entry"]: r for r in report["entries"]}
    assert sorted(rows) == sorted(entries.split(","))
    for name in ("zoo.packed_overrun", "zoo.shared_k_only", "zoo.side_stream"):
        row = rows[name]
        assert row["verdict"] == "detected" and row["first_finding_s"]["median"] is not None
        assert row["trace_len"]["median"] >= 1 and (tmp_path / "traces").joinpath(row["repro"].rsplit("/", 1)[1]).is_file()
    assert rows["reference"]["verdict"] == "clean" and rows["reference"]["steps"] > 0
    assert report["summary"]["by_method"]["fuzz"]["detection_rate"] == 1.0 and report["exit_status"] == 0
    assert "3/3 zoo entries detected on every seed (100%, target 100%)" in capsys.readouterr().out


def test_the_clean_soak_counts_steps_until_its_target(tmp_path):
    report_path = tmp_path / "soak.json"
    assert main(["--steps-clean", "300", "--entries", "reference", "--json", str(report_path), "--repro-dir", str(tmp_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["kind"] == "clean-soak" and report["steps"] >= 300 and report["findings"] == []
    assert report["by_config"][0]["entry"] == "reference" and not report["met"]  # 300 < 1,000,000


def test_plot_draws_a_saved_detection_report_and_refuses_a_soak_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = summarize([record("zoo.a", 1, True), record("zoo.b", 1, False)])
    report = {"kind": "detection", "backend": "sim", "mode": None, "seeds": [1], "budget_s": 10.0, "entries": rows}
    source = tmp_path / "r.json"
    source.write_text(json.dumps(report))
    assert main(["plot", str(source), "--png", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    source.write_text(json.dumps({"kind": "clean-soak"}))
    assert main(["plot", str(source), "--png", str(tmp_path / "s.png")]) == 2
    assert capsys.readouterr().err.endswith("is a 'clean-soak' report; only detection reports have times to plot\n")
