"""``python -m sanitizer.bench.op_cost``: the sanitizer's own cost per op, on the CUDA stand-in here
(docs/sanitizer.md has the measured figures), its split by stage, and its usage errors."""

from __future__ import annotations

import ctypes
import json

import pytest
import torch

from sanitizer.bench import op_stages
from sanitizer.bench.op_cost import StandIn, main, observed, standin_step
from sanitizer.gpu.observer import Observer
from sanitizer.gpu.standin import FakeCuda


def test_the_benchmark_runs_on_the_stand_in_and_reports_its_own_cost_by_stage(tmp_path, capsys):
    out = tmp_path / "op-cost.json"
    assert main(["--steps", "30", "--rounds", "2", "--standin", "--json", str(out),
                 "--profile", str(tmp_path / "profile.txt")]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "stand-in" and result["ops"] == 30 * 10  # 10 aten ops a step, none of the set-up's
    own = [s - p for s, p in zip(result["sanitized_us_per_op"], result["plain_us_per_op"])]
    assert result["own_us_per_op"] == pytest.approx(own)
    own_cpu = [s - p for s, p in zip(result["sanitized_cpu_us_per_op"], result["plain_cpu_us_per_op"])]
    assert result["own_cpu_us_per_op"] == pytest.approx(own_cpu) and min(result["plain_cpu_us_per_op"]) > 0
    stages = result["stages_us_per_op"]
    assert list(stages) == list(op_stages.ORDER)
    assert sum(stages.values()) == pytest.approx(result["own_us_per_op_median"], rel=0.01, abs=0.1)
    bare = result["bare_mode_us_per_op"]
    assert len(bare) == 2 and result["bare_mode_us_per_op_median"] == pytest.approx(sorted(bare)[0] / 2 + sorted(bare)[1] / 2)
    assert 20 < result["own_calls_per_op"] < 2000  # the observer's calls per op, beyond the plain loop's
    printed = capsys.readouterr().out
    assert f"calls per op beyond the plain loop's (cProfile; the machine's load does not change it): {result['own_calls_per_op']:.1f}" in printed
    assert "own cost by stage" in printed and "a dispatch mode that only hands each op on:" in printed
    assert "standin_step" in (tmp_path / "profile.txt").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps 0 --rounds 3: give at least 1 of each"),
    (["--rounds", "0"], "--steps 2000 --rounds 0: give at least 1 of each"),
])
def test_usage_errors_exit_2_in_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_stand_in_loop_takes_the_pinned_copy_path_a_host_write_under_it_is_a_race():
    target = StandIn()
    cuda = target.cuda
    with target.session():
        assert observed(target, 5)[0] > 0  # the loop itself is race-free
        obs = Observer(device=cuda)
        cuda.obs = obs
        obs.start()
        try:
            state = torch.ops.aten.zeros.default([64], device="cuda")
            ids = torch.ops.aten.empty.memory_format([16], dtype=torch.int64, device="cuda")
            standin_step(cuda, state, ids, cuda.new_stream(), 0)
            (region,) = obs.pinned.regions.regions()  # the step's pin_memory(), seen as a pinned allocation
            ctypes.memmove(region.start, (ctypes.c_int64 * 1)(99), 8)  # its staging rewritten under the queued copy
        finally:
            races = obs.stop()
    assert [race.kind for race in races] == ["host-write-vs-pending-copy"]


def test_pinned_copies_never_share_an_address_with_pageable_memory_and_are_reused_once_freed():
    cuda = FakeCuda()
    first = cuda.pin_copy(torch.arange(16))
    address = first.data_ptr()
    del first
    pageable = [torch.arange(16) for _ in range(64)]  # the allocator's recently freed blocks, taken
    assert address not in {t.data_ptr() for t in pageable}
    again = cuda.pin_copy(torch.arange(16) * 2)
    assert again.data_ptr() == address and cuda.is_pinned(again) and again.tolist() == list(range(0, 32, 2))


def test_a_builtins_time_counts_in_its_callers_stages():
    walk = ("/x/sanitizer/host_ops.py", 1, "tensors_of")
    clocks = ("/x/racecheck/clocks.py", 1, "tick")
    builtin = ("~", 0, "<built-in method builtins.isinstance>")
    table = {  # pstats' table: function -> (calls, primitive calls, own s, total s, {caller: the same for it})
        walk: (1, 1, 1.0, 4.0, {}),
        clocks: (1, 1, 2.0, 3.0, {}),
        builtin: (4, 4, 4.0, 4.0, {walk: (3, 3, 3.0, 3.0), clocks: (1, 1, 1.0, 1.0)}),
    }
    seconds = op_stages.seconds_by_stage(table)
    assert seconds == {"argument walk": 4.0, "happens-before": 3.0}


def test_a_float_factory_on_the_device_is_not_evaluated_on_the_host_an_integer_one_is():
    from racecheck.device_values import DeviceValues

    values = DeviceValues(is_device=lambda tensor: False)
    ones, arange = torch.ops.aten.ones.default, torch.ops.aten.arange.default
    assert values.prepare(ones, ([16],), {"device": "cuda"}, []) is None  # the default dtype: floats
    assert values.prepare(ones, ([16],), {"device": "cuda", "dtype": torch.int64}, []) is not None
    assert values.prepare(arange, (16,), {"device": "cuda"}, []) is not None  # integers from its arguments
