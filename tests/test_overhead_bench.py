"""``python -m sanitizer.bench.overhead``: the suites plainly, under this sanitizer and under PyTorch's.
The suites need a GPU; the judge of their timings (the ratios, the goals of issue 54, a tool's failed
round) runs here on timings made up to sit on either side of each goal."""

from __future__ import annotations

import pytest
import torch

from sanitizer.bench.overhead import GOALS, TEST_GOALS, judge, line, main, rotated


def rounds(kvz: tuple[float, float], torch_: tuple[float, float] | None = (9.0, 11.0),
           count: int = 3) -> list[dict]:
    """``count`` rounds of a plain run of 10 s (8 s of tests) and each tool at ``(wall, tests)`` x plain."""
    made = []
    for _ in range(count):
        r = {"plain": {"wall": 10.0, "tests": 8.0}, "kvz": {"wall": 10.0 * kvz[0], "tests": 8.0 * kvz[1]}}
        r["torch"] = {"failed": "suite launch_bound exited 1: CUDASanitizerErrors"} if torch_ is None else \
            {"wall": 10.0 * torch_[0], "tests": 8.0 * torch_[1]}
        made.append(r)
    return made


def test_a_sanitizer_within_both_goals_meets_them_and_pytorchs_ratios_stand_beside():
    result = judge("launch_bound", rounds((1.15, 1.45)))
    assert result["met"] and (result["kvz_wall_ratio"], result["kvz_tests_ratio"]) == (1.15, 1.45)
    assert (result["torch_wall_ratio"], result["torch_tests_ratio"]) == (9.0, 11.0)
    assert (result["goal"], result["tests_goal"]) == (GOALS["launch_bound"], TEST_GOALS["launch_bound"]) == (1.2, 1.5)


@pytest.mark.parametrize("suite, kvz", [("launch_bound", (1.25, 1.4)), ("launch_bound", (1.1, 1.6)),
                                        ("gpu_bound", (1.0, 1.15))])
def test_a_ratio_over_its_goal_misses(suite, kvz):
    assert not judge(suite, rounds(kvz))["met"]


def test_the_ratio_is_the_median_of_the_rounds():
    made = rounds((1.1, 1.1), count=2) + rounds((3.0, 3.0))
    assert judge("gpu_bound", made)["kvz_wall_ratio"] == 3.0  # 3 of 5 rounds at 3x: the median, not the mean
    assert judge("gpu_bound", made[:4])["kvz_wall_ratio"] == pytest.approx(2.05)


def test_pytorchs_failed_suite_has_no_ratio_and_does_not_decide_the_goal():
    result = judge("launch_bound", rounds((1.1, 1.2), torch_=None))
    assert result["met"] and result["torch_wall_ratio"] is None and result["torch_tests_ratio"] is None
    assert "PyTorch's sanitizer wall failed, tests alone failed" in line("launch_bound", result, 3)


def test_a_round_this_sanitizer_failed_never_meets_the_goal():
    made = rounds((1.0, 1.0))
    made[1]["kvz"] = {"failed": "suite launch_bound --kvz-sanitize exited 1: a race"}
    result = judge("launch_bound", made)
    assert not result["met"] and result["kvz_wall_ratio"] is None
    assert line("launch_bound", result, 3).startswith("launch_bound: kvz wall failed (goal 1.2x)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_without_a_gpu_it_says_so_in_one_line(capsys):
    assert main(["--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a GPU" in err[0]


def test_a_bad_round_count_is_a_usage_error(capsys):
    assert main(["--rounds", "0"]) == 2
    assert "--rounds 0: give at least 1" in capsys.readouterr().err


def test_a_ratio_just_over_its_goal_misses_though_it_rounds_to_it():
    result = judge("launch_bound", rounds((1.204, 1.0)))
    assert result["kvz_wall_ratio"] == 1.2 and not result["met"]


def test_a_plain_run_with_no_test_time_gives_no_ratio_rather_than_dividing_by_zero():
    made = rounds((1.0, 1.0))
    made[0]["plain"]["tests"] = 0.0
    result = judge("gpu_bound", made)
    assert result["kvz_tests_ratio"] is None and not result["met"]


def test_each_round_starts_one_run_later():
    assert [rotated(["plain", "kvz", "torch"], i) for i in range(4)] == [
        ["plain", "kvz", "torch"], ["kvz", "torch", "plain"], ["torch", "plain", "kvz"], ["plain", "kvz", "torch"]]
