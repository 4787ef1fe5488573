"""Where the sanitizer's per-op time goes: one launch-bound loop, plain and observed, in one process.

The loop is the step of ``sanitizer/bench/suites/launch_bound.py`` (``step``: a pinned staging copy,
an index_add, a few pointwise ops, a reduction on a side stream, two stream waits): every op passes
the dispatch mode, the trace callbacks and the checker. Rounds alternate plain and observed runs
of the same steps; the result is microseconds per aten op (the ops of one step counted once by a
dispatch mode that only counts) for each, their ratio, and with ``--profile`` the functions the
observed run spends its time in (cProfile, by own time), written beside the JSON.

Run it (needs a GPU; about 20 s)::

    python -m sanitizer.bench.op_cost --steps 2000 --rounds 3 --json op-cost.json --profile op-cost-profile.txt
"""

from __future__ import annotations

import cProfile
import datetime
import io
import pstats
import time
from statistics import median
from typing import Any

from racecheck.atomic_file import write_json_atomically, write_text_atomically
from racecheck.cli import CLEAN, ArgumentParser, UsageError, check_output, run_main
from racecheck.environment import environment


def run_steps(steps: int) -> float:
    """Seconds for ``steps`` steps, the device drained at the end."""
    import torch

    from sanitizer.bench.suites.launch_bound import step

    state = torch.zeros(64, device="cuda")
    ids = torch.empty(16, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for index in range(steps):
        step(state, ids, side, index)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def ops_per_step() -> int:
    """The aten ops one step runs (counted by a dispatch mode that only counts)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            Count.seen += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run_steps(1)
    return Count.seen


def observed(steps: int, profile: cProfile.Profile | None = None) -> float:
    from sanitizer.gpu.observer import Observer

    obs = Observer()
    obs.start()
    try:
        if profile is not None:
            profile.enable()
        seconds = run_steps(steps)
    finally:
        if profile is not None:
            profile.disable()
        races = obs.stop()
    if races:  # the loop is race-free: a race here is the sanitizer's error, not a measurement
        raise RuntimeError(f"the benchmark's race-free loop was reported: {races[0].format()}")
    return seconds


def _main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m sanitizer.bench.op_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--profile", help="write the observed run's profile (top functions by own time) here")
    args = p.parse_args(argv)
    out = check_output("--json", args.json)
    profile_out = check_output("--profile", args.profile)
    if args.steps < 1 or args.rounds < 1:
        raise UsageError(f"--steps {args.steps} --rounds {args.rounds}: give at least 1 of each")
    import torch

    if not torch.cuda.is_available():
        raise UsageError("the op-cost benchmark needs a GPU (its loop runs on cuda)")
    ops = ops_per_step() * args.steps
    run_steps(50), observed(50)  # warm up: kernels, the allocator's pools, the observer's imports
    plain, sanitized = [], []
    for _ in range(args.rounds):
        plain.append(run_steps(args.steps) / ops * 1e6)
        sanitized.append(observed(args.steps) / ops * 1e6)
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "environment": environment(), "steps": args.steps,
        "ops": ops, "rounds": args.rounds, "plain_us_per_op": plain, "sanitized_us_per_op": sanitized,
        "ratio": median(sanitized) / median(plain),
    }
    print(f"plain {median(plain):.1f} us/op, sanitized {median(sanitized):.1f} us/op, "
          f"ratio {result['ratio']:.2f}x (median of {args.rounds}, {ops} ops a run)")
    if profile_out is not None:
        profile = cProfile.Profile()
        observed(args.steps, profile)
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
