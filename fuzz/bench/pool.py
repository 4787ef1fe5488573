"""Jobs in worker processes, for the benchmarks that run many: each record as it completes.

Workers are spawned, not forked: a forked torch can hang in its thread pools. The caller owns
the queue: ``next_job`` is asked again after each record it reads, so it may queue follow-up
jobs (a finding's replays, more soak) as records arrive, and whatever ``next_job`` still holds
when ``may_start`` turns false was never started.

Example::

    jobs = iter(my_jobs)
    for record in completed(run_job, lambda: next(jobs, None), workers=4, initializer=init):
        print(record)
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any


def completed(run: Callable[[Any], dict], next_job: Callable[[], Any], workers: int, *,
              initializer: Callable[..., None], initargs: tuple = (), may_start: Callable[[], bool] = lambda: True,
              process_per_job: bool = False) -> Iterator[dict]:
    """Yield ``run(job)`` for each job ``next_job()`` gives (None: none now), as it completes, in
    ``workers`` spawned processes set up by ``initializer(*initargs)`` (1: in this process, as it
    is). No job starts once ``may_start()`` is false; those already running finish and are
    yielded. ``process_per_job``: a fresh process for every job."""
    if workers <= 1:
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
