"""Benchmark jobs in spawned worker processes (a forked torch can hang in its thread pools),
each record yielded as it completes; on cuda, as many workers as the free GPU memory holds
(:func:`gpu_workers`). Example::

    jobs = iter(my_jobs)
    for record in completed(run_job, lambda: next(jobs, None), workers=4, initializer=init):
        print(record)
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any


def init_worker(device: int | None = None) -> None:
    """A worker process's set-up: one torch thread (the simulator's tensors are tiny), on GPU ``device`` if given.

    On a GPU the controlled runtime's gated streams need their own hardware queues and every kernel
    module loaded up front (racecheck.gate), which the driver reads when the context is made: asked
    for before ``set_device`` makes it. Without that, an offloader with a ninth stream was a
    harness error in every controlled campaign of the bench (H100, 2026-12-06)."""
    import torch

    from racecheck.gate import request_gate_settings

    request_gate_settings()
    torch.set_num_threads(1)
    if device is not None:
        torch.cuda.set_device(device)


def completed(run: Callable[[Any], dict], next_job: Callable[[], Any], workers: int, *,
              initializer: Callable[..., None] = init_worker, initargs: tuple = (),
              may_start: Callable[[], bool] = lambda: True, process_per_job: bool = False) -> Iterator[dict]:
    """Yield ``run(job)`` for each job ``next_job()`` gives (None: none now; asked again after each
    record, so the caller may queue more) in ``workers`` processes set up by ``initializer(*initargs)``
    (1: in this one, as it is). No job starts once ``may_start()`` is false; running ones finish."""
    if workers <= 1:
        from racecheck.gate import request_gate_settings

        request_gate_settings()  # this process runs the jobs: asked for while it still can
        while may_start() and (job := next_job()) is not None:
            yield run(job)
        return
    fresh = {"max_tasks_per_child": 1} if process_per_job else {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=initializer, initargs=initargs, **fresh) as pool:
        running: set[Future] = set()
        while True:
            while len(running) < workers and may_start() and (job := next_job()) is not None:
                running.add(pool.submit(run, job))
            if not running:
                return
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                running.discard(future)
                yield future.result()


def gpu_workers(prog: str, requested: int, configs: list) -> int:
    """How many of ``requested`` GPU workers the free GPU memory holds for jobs of ``configs``
    (fuzz.engine.gpu_workers), said on stderr; 1 when that memory cannot be read."""
    from fuzz.engine.gpu_workers import plan_for

    try:
        plan = plan_for(requested, configs)
    except (OSError, RuntimeError, ValueError) as error:
        print(f"{prog}: could not size the workers by the free GPU memory ({error}); running 1", file=sys.stderr, flush=True)
        return 1
    print(f"{prog}: {plan.describe()}", file=sys.stderr, flush=True)
    return plan.chosen
