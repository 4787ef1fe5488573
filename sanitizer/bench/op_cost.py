"""Where the sanitizer's per-op time goes: one launch-bound loop, plain and observed, in one process.

The loop is the step of ``sanitizer/bench/suites/launch_bound.py`` (``step``: a pinned staging copy,
an index_add, a few pointwise ops, a reduction on a side stream, two stream waits): every op passes
the dispatch mode, the trace callbacks and the checker. Rounds alternate plain and observed runs
of the same steps; the result is microseconds per aten op (the ops of one step counted once by a
dispatch mode that only counts) for each, their difference (the sanitizer's own cost per op) and
ratio, in wall-clock time and in the process's CPU time (``*_cpu_us_per_op``: on a machine whose
cores other jobs share, the wall clock counts their time too, and the CPU time does not), and the split of that cost by stage (:mod:`sanitizer.bench.op_stages`, from one profiled run
of each kind after the rounds). ``bare_mode_us_per_op`` is what a dispatch mode that only hands each
op on adds to the same loop (wall clock, per round): the floor of any checker built as the sanitizer
is, on a Python dispatch mode. ``--profile`` writes the observed run's functions by own time.

Without a GPU (or with ``--standin``) the loop runs on the CUDA stand-in
(:mod:`sanitizer.gpu.standin`, the one the observer's tests use): ``standin_step`` is ``step`` op
for op, its device tensors CPU tensors the stand-in calls device memory and its streams the
stand-in's, so the observer takes every path it takes on a GPU (the pinned allocation, the queued
copy, the device ops, the event record and wait). The ops run on the CPU, so the plain figure is
the CPU's, not a GPU launch's; what the difference measures is the sanitizer's own Python, which
is the same code on both.

Run it (about 20 s on a GPU, a minute on the stand-in)::

    python -m sanitizer.bench.op_cost --steps 2000 --rounds 3 --json op-cost.json --profile op-cost-profile.txt
"""

from __future__ import annotations

import contextlib
import cProfile
import datetime
import io
import pstats
import time
from collections.abc import Iterator
from statistics import median
from typing import Any

from racecheck.atomic_file import write_json_atomically, write_text_atomically
from racecheck.cli import CLEAN, ArgumentParser, UsageError, check_output, run_main
from racecheck.environment import environment
from sanitizer.bench import op_stages

Timing = tuple[float, float]  # (wall-clock seconds, the process's CPU seconds)


class Gpu:
    """The loop on CUDA: ``launch_bound.step`` itself."""

    name = "cuda"
    files = ("sanitizer/bench/suites/launch_bound.py", "sanitizer/bench/op_cost.py")  # the loop's own code

    def device(self) -> Any:
        return None  # the observer's own: sanitizer.gpu.device.CudaDevice

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        yield

    def attach(self, obs: Any) -> None:
        """``obs`` observes the next run (torch's trace callbacks reach it without help)."""

    def steps(self, steps: int) -> Timing:
        return run_steps(steps)


class StandIn:
    """The loop on the CUDA stand-in (module docstring)."""

    name = "stand-in"
    files = ("sanitizer/bench/op_cost.py",)

    def __init__(self) -> None:
        from sanitizer.gpu.standin import FakeCuda

        self.cuda = FakeCuda()

    def device(self) -> Any:
        return self.cuda

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """``device="cuda"`` and ``pin_memory()`` answered by the stand-in, under the observer's mode."""
        with self.cuda.placing():
            yield

    def attach(self, obs: Any) -> None:
        self.cuda.obs = obs  # its streams' and events' calls go to the observer's trace handlers

    def steps(self, steps: int) -> Timing:
        import torch

        cuda = self.cuda
        state = torch.ops.aten.zeros.default([64], device=_CUDA)
        ids = torch.ops.aten.empty.memory_format([16], dtype=torch.int64, device=_CUDA)
        side = cuda.new_stream()
        cuda.synchronize()
        started = _now()
        for index in range(steps):
            standin_step(cuda, state, ids, side, index)
        cuda.synchronize()
        return _since(started)


def standin_step(cuda: Any, state: Any, ids: Any, side: int, index: int) -> None:
    """``launch_bound.step`` on the stand-in, line for line: a CPU build of torch refuses
    ``device="cuda"`` and ``pin_memory()`` in the Python call, so those two go to the aten ops they
    dispatch to, and the stream calls to the stand-in's (``wait_stream`` is a record and a wait)."""
    import torch

    aten = torch.ops.aten
    staged = aten._pin_memory.default(torch.tensor(list(range(index % 7, index % 7 + 16)), dtype=torch.int64))
    ids.copy_(staged, non_blocking=True)
    state.index_add_(0, ids, aten.ones.default([16], device=_CUDA))
    state.mul_(0.5).add_(1.0)
    cuda.wait(cuda.record(), side)
    with cuda.stream(side):
        total = state.sum()
    cuda.wait(cuda.record(side))
    state.sub_(total * 0)


_CUDA = "cuda"  # the stand-in's aten calls ask for it by name, as torch.device("cuda") would


def _now() -> Timing:
    return time.perf_counter(), time.process_time()


def _since(started: Timing) -> Timing:
    return time.perf_counter() - started[0], time.process_time() - started[1]


def run_steps(steps: int) -> Timing:
    """Seconds (wall clock, CPU) for ``steps`` steps, the device drained at the end."""
    import torch

    from sanitizer.bench.suites.launch_bound import step

    state = torch.zeros(64, device="cuda")
    ids = torch.empty(16, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    started = _now()
    for index in range(steps):
        step(state, ids, side, index)
    torch.cuda.synchronize()
    return _since(started)


def ops_per_step(target: Gpu | StandIn) -> int:
    """The aten ops one step runs (counted by a dispatch mode that only counts: two steps less one, so
    that the loop's set-up, its state and index tensors, is not counted as a step's). A lazy-dynamo mode,
    as the sanitizer's are: a plain one would import ``torch._dynamo``, and the sanitizer's modes
    would pay dynamo's per-op guard in the rounds after it (racecheck.lazy_dynamo)."""
    from racecheck.lazy_dynamo import LazyDynamoMode

    class Count(LazyDynamoMode):
        seen = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            Count.seen += 1
            return func(*args, **(kwargs or {}))

    with Count():
        target.steps(1)
        one = Count.seen
        target.steps(2)
    return Count.seen - 2 * one


def plain(target: Gpu | StandIn, steps: int, profile: cProfile.Profile | None = None) -> Timing:
    with _profiling(profile):
        return target.steps(steps)


def bare_mode(target: Gpu | StandIn, steps: int) -> Timing:
    """The loop under a dispatch mode that only hands each op on: what any checker built on a Python
    dispatch mode pays per op before it does anything (the floor of the sanitizer's design)."""
    from racecheck.lazy_dynamo import LazyDynamoMode

    class HandOn(LazyDynamoMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    with HandOn():
        return target.steps(steps)


def observed(target: Gpu | StandIn, steps: int, profile: cProfile.Profile | None = None) -> Timing:
    from sanitizer.gpu.observer import Observer

    obs = Observer(device=target.device())
    target.attach(obs)
    obs.start()
    try:
        with _profiling(profile):
            seconds = target.steps(steps)
    finally:
        races = obs.stop()
        target.attach(None)
    if races:  # the loop is race-free: a race here is the sanitizer's error, not a measurement
        raise RuntimeError(f"the benchmark's race-free loop was reported: {races[0].format()}")
    return seconds


@contextlib.contextmanager
def _profiling(profile: cProfile.Profile | None) -> Iterator[None]:
    if profile is not None:
        profile.enable()
    try:
        yield
    finally:
        if profile is not None:
            profile.disable()


def stages(target: Gpu | StandIn, steps: int, ops: int,
           own_us: float) -> tuple[dict[str, float], float, cProfile.Profile]:
    """The sanitizer's own cost per op by stage (op_stages.split of one profiled run of each kind),
    scaled to ``own_us``, the unprofiled measurement (cProfile inflates Python calls, not shares);
    the calls (Python functions and built-ins) the observed run makes per op beyond the plain one's,
    a count that other jobs on the machine do not change; and the observed run's profile."""
    baseline, profile = cProfile.Profile(), cProfile.Profile()
    plain(target, steps, baseline)
    observed(target, steps, profile)
    observed_stats, plain_stats = pstats.Stats(profile), pstats.Stats(baseline)
    added = op_stages.split(observed_stats, plain_stats, target.files)
    total = sum(added.values())
    scale = own_us / total if total > 0 else 0.0
    calls = (observed_stats.total_calls - plain_stats.total_calls) / ops  # type: ignore[attr-defined]
    return {stage: round(seconds * scale, 2) for stage, seconds in added.items()}, round(calls, 1), profile


def _main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m sanitizer.bench.op_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--standin", action="store_true",
                   help="run on the CUDA stand-in even where there is a GPU (without one it always does)")
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--profile", help="write the observed run's profile (top functions by own time) here")
    args = p.parse_args(argv)
    out = check_output("--json", args.json)
    profile_out = check_output("--profile", args.profile)
    if args.steps < 1 or args.rounds < 1:
        raise UsageError(f"--steps {args.steps} --rounds {args.rounds}: give at least 1 of each")
    import torch

    target: Gpu | StandIn = StandIn() if args.standin or not torch.cuda.is_available() else Gpu()
    with target.session():
        ops = ops_per_step(target) * args.steps
        plain(target, 50), observed(target, 50)  # warm up: kernels, the allocator's pools, the observer's imports
        plain_us, sanitized_us, plain_cpu, sanitized_cpu, bare_us = [], [], [], [], []
        for _ in range(args.rounds):
            for wall, cpu, timing in ((plain_us, plain_cpu, plain(target, args.steps)),
                                      (sanitized_us, sanitized_cpu, observed(target, args.steps))):
                wall.append(timing[0] / ops * 1e6)
                cpu.append(timing[1] / ops * 1e6)
            bare_us.append(bare_mode(target, args.steps)[0] / ops * 1e6 - plain_us[-1])
        own = [s - p for s, p in zip(sanitized_us, plain_us)]
        own_cpu = [s - p for s, p in zip(sanitized_cpu, plain_cpu)]
        split, calls, profile = stages(target, args.steps, ops, median(own))
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "environment": environment(), "device": target.name,
        "steps": args.steps, "ops": ops, "rounds": args.rounds, "plain_us_per_op": plain_us,
        "sanitized_us_per_op": sanitized_us, "own_us_per_op": own, "own_us_per_op_median": median(own),
        "ratio": median(sanitized_us) / median(plain_us), "stages_us_per_op": split,
        "plain_cpu_us_per_op": plain_cpu, "sanitized_cpu_us_per_op": sanitized_cpu, "own_cpu_us_per_op": own_cpu,
        "own_cpu_us_per_op_median": median(own_cpu),
        "bare_mode_us_per_op": bare_us, "bare_mode_us_per_op_median": median(bare_us),
        "own_calls_per_op": calls,
    }
    print(f"on {target.name}: plain {median(plain_us):.1f} us/op, sanitized {median(sanitized_us):.1f} us/op, "
          f"own {median(own):.1f} us/op, ratio {result['ratio']:.2f}x (median of {args.rounds}, {ops} ops a run)")
    print(f"CPU time: plain {median(plain_cpu):.1f} us/op, sanitized {median(sanitized_cpu):.1f} us/op, "
          f"own {median(own_cpu):.1f} us/op")
    print(f"a dispatch mode that only hands each op on: {median(bare_us):.1f} us/op (the floor of a Python mode)")
    print(f"calls per op beyond the plain loop's (cProfile; the machine's load does not change it): {calls:.1f}")
    print("own cost by stage (us/op): " + ", ".join(f"{stage} {us:.1f}" for stage, us in split.items()))
    if profile_out is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
        write_text_atomically(profile_out, text.getvalue())
    if out is not None:
        write_json_atomically(out, result)
    return CLEAN


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, "python -m sanitizer.bench.op_cost")


if __name__ == "__main__":
    raise SystemExit(main())
