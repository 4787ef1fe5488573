"""Campaigns: which zeroer, on which geometry and backend, with which seed, for how long.

A campaign is an :class:`~fuzz.engine.episode.EpisodeConfig` plus a seed shard and an expectation
(``clean`` for a race-free design, ``finds`` for a self-check on a racy one). The list is built
from sorted axes so that every pytest-xdist worker collects the same items in the same order.

:func:`run_campaign` runs Hypothesis over the campaign's state machine within a profile's
budget and returns a :class:`CampaignResult` with the counts and, if the oracle fired, the shrunk
finding and the path of its trace file.

Example::

    result = run_campaign(Campaign(EpisodeConfig(zeroer="ring"), shard=0, expect="finds"), PROFILES["quick"], Path("repro/failures"))
    result.violation.findings[0]
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.errors import Flaky
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import run_state_machine_as_test

from zeroer.designs import StagedZeroer
from zeroer.registry import BUILTINS, builtin_names, default_geometry, load_zeroer

from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.journal import Journal
from fuzz.engine.machine import ZeroerMachine, ZeroerViolation, machine_for
from fuzz.trace import write_trace

SIM_GEOMETRIES = ("mixed_dtypes", "ratio2", "tiny")
CUDA_GEOMETRIES = ("mixed_dtypes", "tiny")
SHARDS = 2
# Self-checks ("finds") stop at their first finding, so a larger budget costs time only when the
# fuzzer is about to miss; races that need a freed block to come back round the FIFO free queue
# (the no-free-fence caller fault) took up to 315 examples over seeds 1..10 once the reallocate
# rule joined the others (python -m fuzz.bench.selfcheck), so 20x keeps a margin over a ci run's 40.
FINDS_BUDGET_FACTOR = 20


@dataclass(frozen=True)
class Profile:
    """How hard each campaign tries."""

    name: str
    max_examples: int
    steps: int  # stateful_step_count: rules per example at most
    budget_s: float | None = None  # wall clock per campaign; None = one Hypothesis run
    fresh_seeds: bool = False  # nightly: a new seed per run instead of the shard's fixed one
    database: bool = False  # keep an example database between runs


PROFILES: dict[str, Profile] = {
    # seconds per campaign on a laptop core
    "quick": Profile("quick", max_examples=60, steps=25),
    # fits CPU CI (2 cores) with the rest of the suite well under 20 minutes
    "ci": Profile("ci", max_examples=40, steps=25),
    # wall-clock budget from --fuzz-minutes, fresh seeds, persistent database
    "nightly": Profile("nightly", max_examples=300, steps=40, budget_s=60.0, fresh_seeds=True, database=True),
}


@dataclass(frozen=True)
class Campaign:
    config: EpisodeConfig
    shard: int = 0
    expect: str = "clean"  # "clean" | "finds"

    @property
    def id(self) -> str:
        c = self.config
        backend = c.backend if c.backend == "sim" else f"cuda-{c.mode}"
        parts = [c.zeroer.replace("/", "_"), c.geometry, backend]
        if c.kernel:
            parts.append(f"k-{c.kernel}")
        if c.caller_fault:
            parts.append(f"fault-{c.caller_fault}")
        parts.append(f"shard{self.shard}")
        return "-".join(parts)

    @property
    def seed(self) -> int:
        # Stable across processes (no hash randomisation) and distinct per campaign: a digest of
        # the whole id (the last bytes alone are shared by every "...-k-torch-shard0").
        return int.from_bytes(hashlib.sha256(self.id.encode()).digest()[:4], "little") % (2**31)


@dataclass
class CampaignResult:
    campaign: Campaign
    examples: int = 0
    steps: int = 0
    runs: int = 0
    seconds: float = 0.0
    first_finding_s: float | None = None
    first_finding_examples: int | None = None
    violation: ZeroerViolation | None = None
    trace_path: Path | None = None
    seeds: list[int] = field(default_factory=list)
    reproduced: bool = True  # False: the finding did not show again when Hypothesis replayed it

    @property
    def found(self) -> bool:
        return self.violation is not None


def default_campaigns(backends: list[str], zeroer: str | None = None) -> list[Campaign]:
    """The campaigns ``pytest fuzz`` runs, sorted; ``zeroer`` restricts to one (all must be clean)."""
    campaigns: list[Campaign] = []
    for backend in sorted(backends):
        modes = ("controlled", "free") if backend == "cuda" else ("controlled",)
        geometries = CUDA_GEOMETRIES if backend == "cuda" else SIM_GEOMETRIES
        names = [zeroer] if zeroer else builtin_names(zoo=False)
        for mode in modes:
            for name in names:
                # Each where it declares it runs (torch_per_call: cuda, free-running mode only).
                if not load_zeroer(name).capabilities.runs_on(backend, mode):
                    continue
                expect = "finds" if (zeroer is None and BUILTINS[name].verdict == "racy") else "clean"
                # On the simulator the staged designs use the torch kernel (no interpreter, fast);
                # the Triton kernel itself is fuzzed in the k-triton campaigns below.
                builtin = BUILTINS.get(name)
                staged = (builtin is not None and not builtin.is_zoo and isinstance(builtin.factory, type)
                          and issubclass(builtin.factory, StagedZeroer))
                kernel = "torch" if backend == "sim" and staged else None
                # A zoo entry runs on the geometry its bug shows on (docs/zoo.md).
                for geometry in (default_geometry(name),) if default_geometry(name) else geometries:
                    for shard in range(SHARDS):
                        config = EpisodeConfig(zeroer=name, geometry=geometry, backend=backend, mode=mode, kernel=kernel)
                        campaigns.append(Campaign(config, shard, expect))
                if backend == "sim" and kernel == "torch":
                    config = EpisodeConfig(zeroer=name, geometry="tiny", backend="sim", kernel="triton")
                    campaigns.append(Campaign(config, 0, expect))
        if zeroer is None:
            for fault in ("no-free-fence", "no-zero-wait"):
                config = EpisodeConfig(zeroer="reference", geometry="tiny", backend=backend, caller_fault=fault)
                campaigns.append(Campaign(config, 0, "finds"))
            # One self-check per zoo entry on the simulator: the fuzzer must still find each bug
            # class; `python -m fuzz.bench.detect` measures how fast (docs/detection.md).
            for name in builtin_names(zoo=True) if backend == "sim" else ():
                if load_zeroer(name).capabilities.runs_on(backend):
                    config = EpisodeConfig(zeroer=name, geometry=default_geometry(name), backend=backend)
                    campaigns.append(Campaign(config, 0, "finds"))
    return sorted(campaigns, key=lambda c: c.id)


def _settings(profile: Profile, database_dir: Path | None, max_examples: int | None = None) -> settings:
    database = DirectoryBasedExampleDatabase(str(database_dir)) if (profile.database and database_dir) else None
    # Every field that Hypothesis's own "ci" profile (auto-loaded when CI is set) would change is
    # chosen here on purpose: seeds come from the campaign, the database from the profile.
    return settings(
        max_examples=max_examples or profile.max_examples,
        stateful_step_count=profile.steps,
        deadline=None,
        database=database,
        derandomize=False,
        report_multiple_bugs=False,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
    )


def run_campaign(
    campaign: Campaign,
    profile: Profile,
    repro_dir: Path,
    *,
    budget_s: float | None = None,
    database_dir: Path | None = None,
    seed_override: int | None = None,
    journal: Journal | None = None,
) -> CampaignResult:
    """Run one campaign; save the shrunk trace of a finding under ``repro_dir``.

    ``seed_override`` runs Hypothesis once with that seed (``--hypothesis-seed``, ``python -m
    repro regenerate``); ``journal`` saves each op before it runs (:mod:`fuzz.engine.journal`).
    """
    result = CampaignResult(campaign)
    start = time.perf_counter()
    budget = budget_s if budget_s is not None else profile.budget_s
    # Every full garbage collection re-scans the ~300k objects torch and the imports left
    # behind, which cost 13-20% of a simulator campaign (cProfile). Frozen, they are skipped;
    # what the campaign itself allocates is collected as usual, and unfreeze() hands the rest
    # back afterwards.
    gc.freeze()
    try:
        _run_until_done(campaign, profile, result, start, budget, database_dir, seed_override, journal)
    finally:
        gc.unfreeze()
    result.seconds = time.perf_counter() - start
    if journal is not None:
        journal.discard()  # the run ended without a crash
    if result.violation is not None:
        result.trace_path = write_trace(
            repro_dir, result.violation.config, result.violation.trace, result.violation.findings,
            seed=result.seeds[-1], campaign=campaign.id,
        )
    return result


def _run_until_done(campaign: Campaign, profile: Profile, result: CampaignResult, start: float,
                    budget: float | None, database_dir: Path | None, seed_override: int | None,
                    journal: Journal | None) -> None:
    """Run Hypothesis until a finding, the budget, or (without a budget) one run."""
    run_index = 0
    while True:
        machine = machine_for(campaign.config, journal=journal)
        _count_into(machine, result, start)
        if seed_override is not None:
            run_seed = seed_override
        elif profile.fresh_seeds:
            run_seed = int.from_bytes(os.urandom(4), "little")
        else:
            run_seed = campaign.seed + 1_000_003 * run_index
        result.seeds.append(run_seed)
        if journal is not None:
            journal.seed = run_seed
        try:
            factor = FINDS_BUDGET_FACTOR if campaign.expect == "finds" else 1
            run_state_machine_as_test(
                seed(run_seed)(machine),
                settings=_settings(profile, database_dir, max_examples=profile.max_examples * factor),
            )
        except ZeroerViolation as error:
            result.violation = machine.last_failure or error
        except Flaky as error:
            # Found once, gone when Hypothesis replayed it: a timing-dependent finding (the
            # free-running cuda mode). Still a finding, kept with the program that showed it,
            # rather than an error that loses the trace.
            original = _first_violation(error)
            if original is None:
                raise
            result.violation, result.reproduced = original, False
        result.runs += 1
        run_index += 1
        if result.found or budget is None or time.perf_counter() - start >= budget or seed_override is not None:
            break


def _first_violation(error: BaseException) -> ZeroerViolation | None:
    """The ZeroerViolation inside a Hypothesis Flaky error (an exception group), if any."""
    for inner in getattr(error, "exceptions", ()):
        found = inner if isinstance(inner, ZeroerViolation) else _first_violation(inner)
        if found is not None:
            return found
    return None


def _count_into(machine: type[ZeroerMachine], result: CampaignResult, start: float) -> None:
    """Count examples, steps and the first finding of ``machine`` into ``result``."""
    init, apply, raise_if = machine.__init__, machine._apply, machine._raise_if

    def counted_init(self: ZeroerMachine) -> None:
        result.examples += 1
        init(self)

    def counted_apply(self: ZeroerMachine, **op):
        result.steps += 1
        return apply(self, **op)

    def noted_raise_if(self: ZeroerMachine, findings) -> None:
        if findings and result.first_finding_s is None:
            result.first_finding_s = time.perf_counter() - start
            result.first_finding_examples = result.examples
        raise_if(self, findings)

    machine.__init__ = counted_init  # type: ignore[method-assign]
    machine._apply = counted_apply  # type: ignore[method-assign]
    machine._raise_if = noted_raise_if  # type: ignore[method-assign]
