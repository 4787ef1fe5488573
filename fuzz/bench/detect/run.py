"""Running detection methods: the fuzzer as a method, the baselines, jobs and worker processes.

A *job* is one method on one zeroer with one seed; :func:`run_job` runs it and returns a plain
dict (it crosses process boundaries). The fuzzer's method, :class:`FuzzMethod`, runs the same
:func:`~fuzz.engine.campaigns.run_campaign` as ``pytest fuzz``: Hypothesis runs of ``max_examples``
examples each, repeated with the next seed of the campaign until a finding or the budget, so the
seeds are fresh per seed index and entry yet deterministic (a campaign's seed is a digest of its
id, ``<zeroer>-<geometry>-<backend>-shard<seed>``).

:func:`run_jobs` runs jobs in this process, or in ``jobs`` spawned worker processes (spawn, not
fork: a forked torch can hang in its thread pools); results come back in job order.

Example::

    method = FuzzMethod(Path("/tmp/traces"))
    outcome = method(EpisodeConfig(zeroer="zoo.single_buffer"), 30.0, 1)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz.bench.detect.baselines import METHODS
from fuzz.bench.detect.outcome import FUZZ, QUICK, DetectionOutcome
from fuzz.bench.pool import completed
from fuzz.engine.campaigns import PROFILES, Campaign, Profile, run_campaign
from fuzz.engine.episode import EpisodeConfig, count_shown
from fuzz.engine.harness_error import HarnessError
from racecheck.resources import ResourceExhausted, is_out_of_memory

RUN_EXAMPLES = 200  # examples per Hypothesis run: the budget is checked between runs
STEPS = 25  # rules per example, as the quick and ci profiles
REPLAYS = 20  # a finding's shrunk trace is replayed this many times: its repro rate


@dataclass(frozen=True)
class FuzzMethod:
    """The fuzzer as a detection method; traces of findings go to ``repro_dir``."""

    repro_dir: Path

    def __call__(self, config: EpisodeConfig, budget_s: float | None, seed: int) -> DetectionOutcome:
        """Fuzz until a finding or ``budget_s`` seconds (None: one run of :data:`RUN_EXAMPLES`)."""
        profile = Profile("detect", max_examples=RUN_EXAMPLES, steps=STEPS, budget_s=budget_s)
        result = run_campaign(Campaign(config, shard=seed, expect="clean"), profile, self.repro_dir, budget_s=budget_s)
        return _outcome(result, replay=True)


def _outcome(result: Any, *, replay: bool) -> DetectionOutcome:
    """A campaign's result as a detection outcome; ``replay``: measure its repro rate too."""
    if result.resource_error:  # the GPU ran out of memory: no verdict (racecheck.resources)
        return DetectionOutcome(False, None, None, result.steps, None, None, "resource error",
                                error=result.resource_error, resource_error=True)
    if result.harness_error:  # the harness could not run the zeroer: no verdict, an error (fuzz.engine.harness_error)
        return DetectionOutcome(False, None, None, result.steps, None, None, "harness error", error=result.harness_error)
    violation = result.violation
    return DetectionOutcome(
        found=result.found,
        seconds=None if result.first_finding_s is None else round(result.first_finding_s, 3),
        examples=result.first_finding_examples if result.found else result.examples,
        steps=result.steps,
        trace_len=None if violation is None else len(violation.trace),
        repro=None if result.trace_path is None else str(result.trace_path),
        message=str(violation.findings[0]).splitlines()[0] if violation and violation.findings else "no finding",
        **(_repro_rate(violation) if replay else {}),
    )


def _repro_rate(violation: Any) -> dict[str, int]:
    """Replay a finding's shrunk trace :data:`REPLAYS` times, as ``python -m repro replay`` would."""
    if violation is None or not violation.trace:
        return {}
    return {"replays": REPLAYS, "reproduced": count_shown(violation.config, violation.trace, REPLAYS)}


@dataclass(frozen=True)
class Job:
    """One method on one zeroer with one seed."""

    method: str
    entry: str
    kind: str  # "zoo" or "race-free"
    seed: int
    config: EpisodeConfig
    budget_s: float | None  # None: one Hypothesis run (the clean-steps soak)
    repro_dir: str
    profile: str = "detect"  # QUICK: one quick-profile campaign (seed is its shard)


def run_job(job: Job) -> dict[str, Any]:
    """Run ``job``; a method that raises is recorded as an error, never a finding."""
    started, repro_dir = time.perf_counter(), Path(job.repro_dir)
    try:
        if job.profile == QUICK:  # one campaign exactly as ``pytest fuzz --zeroer ENTRY`` runs it in the quick profile
            result = run_campaign(Campaign(job.config, shard=job.seed, expect="finds"), PROFILES[QUICK], repro_dir)
            outcome = _outcome(result, replay=False)
        elif job.budget_s is None or job.method == FUZZ:  # no budget: the clean-steps soak's one fixed-size run
            outcome = FuzzMethod(repro_dir)(job.config, job.budget_s, job.seed)
        elif job.method not in METHODS:
            raise KeyError(f"method {job.method!r} is not available; choose {FUZZ} or one of {', '.join(sorted(METHODS))}")
        else:
            outcome = METHODS[job.method](job.config, job.budget_s, job.seed, repro_dir=repro_dir)
    except HarnessError as error:  # the harness could not build or run the entry (a factory that raises): no verdict
        outcome = DetectionOutcome(False, None, None, 0, None, None, "harness error", error=error.message)
    except (Exception, ResourceExhausted) as error:  # report and go on: one broken entry must not hide the others
        out_of_memory = is_out_of_memory(error)
        outcome = DetectionOutcome(False, None, None, 0, None, None, "resource error" if out_of_memory else "the method raised",
                                   error=f"{type(error).__name__}: {error}", resource_error=out_of_memory)
    record = {
        "method": job.method,
        "entry": job.entry,
        "kind": job.kind,
        "seed": job.seed,
        "geometry": job.config.geometry,
        "backend": job.config.backend,
        "mode": job.config.mode,
        "profile": job.profile,
        "campaign": Campaign(job.config, job.seed, "finds").id if job.profile == QUICK else None,
        **dataclasses.asdict(outcome),
        "wall_s": round(time.perf_counter() - started, 3),
    }
    return record


def run_jobs(jobs: Iterable[Job], workers: int, *, stop: Callable[[list[dict]], bool] | None = None) -> Iterator[dict]:
    """Yield each job's record as it completes, in ``workers`` processes (1: in this one).

    ``stop(records_so_far)`` is asked after each record; once it is true no further job starts
    (jobs already running finish and are yielded).
    """
    done: list[dict] = []
    pending = iter(jobs)
    for record in completed(run_job, lambda: next(pending, None), workers,
                            may_start=lambda: stop is None or not stop(done)):
        done.append(record)
        yield record
