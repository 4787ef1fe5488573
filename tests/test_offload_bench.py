"""``python -m fuzz.bench.offload``: its command line, and how it judges and renders what it measured."""

from __future__ import annotations

import pytest

from fuzz.bench import BenchUsageError
from fuzz.bench.offload import judge, jobs_for, parse_args, render, summarize

KNOWN = {"racy_one": "racy", "clean_one": "race-free"}


def _record(entry: str, method: str, backend: str, mode: str = "controlled", **outcome) -> dict:
    base = {"entry": entry, "method": method, "backend": backend, "mode": mode, "found": False, "seconds": None,
            "trace_len": None, "reproduced": None, "replays": None, "steps": 100, "error": None}
    return {**base, **outcome}


def test_a_racy_example_found_everywhere_in_few_ops_and_a_clean_one_clean_passes() -> None:
    records = [_record("racy_one", "fuzz", "sim", found=True, seconds=0.5, trace_len=6, reproduced=20, replays=20),
               _record("racy_one", "fuzz", "cuda", "controlled", found=True, seconds=2.0, trace_len=4, reproduced=19, replays=20),
               _record("racy_one", "stress", "cuda", "free"),
               _record("clean_one", "fuzz", "cuda", "free", steps=20000)]
    rows = summarize(records, KNOWN)
    assert [r["method"] for r in rows] == ["fuzz-sim", "fuzz-controlled", "stress", "fuzz-free"]
    assert judge(rows) == []
    table = render(rows)
    assert "| `racy_one` | racy | fuzz-controlled | 1/1 | 2.0 | 4 | 19/20 | 100 |" in table


@pytest.mark.parametrize(("records", "why"), [
    ([_record("racy_one", "fuzz", "sim")], "found on 0 of 1 seeds"),
    ([_record("racy_one", "fuzz", "sim", found=True, trace_len=9, reproduced=20, replays=20)], "a trace of 9 ops"),
    ([_record("racy_one", "fuzz", "cuda", found=True, trace_len=5, reproduced=12, replays=20)], "forced replays"),
    ([_record("racy_one", "fuzz", "sim", found=True, trace_len=4, reproduced=3, replays=20)],
     "fuzz-sim: replays 3/20 (at least 20/20)"),
    ([_record("racy_one", "fuzz", "cuda", "free", found=True, trace_len=4, reproduced=19, replays=20)],
     "fuzz-free: replays 19/20 (at least 20/20)"),
    ([_record("racy_one", "fuzz", "sim", found=True, trace_len=4, reproduced=3, replays=3)],
     "fuzz-sim: replays 3/3 (at least 20/20)"),
    ([_record("racy_one", "fuzz", "sim", found=True, trace_len=4)],
     "fuzz-sim: 1 finding(s) without replay data (at least 20/20 replays needed)"),
    ([_record("racy_one", "fuzz", "cuda", found=True, trace_len=4, reproduced=20)],
     "fuzz-controlled: 1 finding(s) without replay data (at least 19/20 replays needed)"),
    ([_record("racy_one", "fuzz", "sim", found=True, reproduced=20, replays=20)],
     "fuzz-sim: 1 finding(s) without a trace length (at most 6 ops needed)"),
    ([_record("clean_one", "stress", "sim", found=True, trace_len=30)], "a race-free example was reported racy"),
    ([_record("clean_one", "fuzz", "sim", error="RuntimeError: boom")], "RuntimeError: boom"),
])
def test_each_way_to_fail_is_named(records: list[dict], why: str) -> None:
    failures = judge(summarize(records, KNOWN))
    assert len(failures) == 1 and why in failures[0]


def test_bad_command_lines_name_the_value() -> None:
    with pytest.raises(BenchUsageError, match="--backend cuda needs a CUDA GPU"):
        parse_args(["--backend", "cuda"], cuda_available=False)
    with pytest.raises(BenchUsageError, match="'fuzz-controlled' needs --backend cuda"):
        parse_args(["--methods", "fuzz-controlled"], cuda_available=False)
    with pytest.raises(BenchUsageError, match="--budget '0' must be a positive number"):
        parse_args(["--budget", "0"], cuda_available=False)
    with pytest.raises(BenchUsageError, match="--seeds 'x' must be a positive integer"):
        parse_args(["--seeds", "x"], cuda_available=False)


def test_the_default_jobs_cover_every_example_on_the_simulator_and_the_soak_only_race_free_ones() -> None:
    args = parse_args(["--seeds", "2"], cuda_available=False)
    jobs = jobs_for(args)
    assert {j.entry for j in jobs} == set(KNOWN_EXAMPLES) and len(jobs) == len(KNOWN_EXAMPLES) * 2 * 2
    assert all(j.config.backend == "sim" and j.config.offloader.startswith("examples/engine_offloaders.py:") for j in jobs)
    soak = jobs_for(parse_args(["--steps-clean", "100"], cuda_available=False))
    assert soak and all(j.kind == "race-free" for j in soak)


KNOWN_EXAMPLES = ("store_without_compute_event", "store_after_compute_event", "load_unfenced", "load_waits_forward",
                  "load_acked_on_issue", "load_acked_on_event", "staging_freed_on_return", "staging_freed_after_event",
                  "copy_thread_without_compute_event", "copy_thread_after_compute_event", "report_without_end_query",
                  "report_after_end_query", "host_lock_released_on_issue", "host_lock_held_until_loaded",
                  "report_on_start_query")
