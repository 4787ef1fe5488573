"""Campaigns: which zeroer, on which geometry and backend, with which seed, for how long.

A campaign is an :class:`~fuzz.engine.episode.EpisodeConfig` plus a seed shard and an expectation
(``clean`` for a race-free design, ``finds`` for a self-check on a racy one). The list is built
from sorted axes so that every pytest-xdist worker collects the same items in the same order.

A campaign's identity derives from what the user named, never from where the checkout lies: the
zeroer spec as given, with a file path made relative to the working directory (or reduced to the
file's name when it lies outside), then geometry, backend, variant and shard. Its seed and its
example-database key derive from that id, so two checkouts of the project at different paths fuzz
the same way, and no two campaigns share a key.

:func:`run_campaign` runs the campaign's state machine once, as a plain Hypothesis test
(``run_state_machine_as_test``), within its profile's example count or time budget, and returns
a :class:`CampaignResult` with the counts and, if the oracle fired, the shrunk finding and the
path of its trace file. Under ``pytest fuzz`` it is also given the run's registry of shrunk bugs
(:mod:`fuzz.engine.known_bugs`): a finding another campaign of the run has already shrunk ends the
campaign at that failing example, unshrunk, as ``same_as`` that campaign, which holds the trace.

Example::

    result = run_campaign(Campaign(EpisodeConfig(zeroer="ring"), shard=0, expect="finds"), PROFILES["quick"], Path("repro/failures"))
    result.violation.findings[0]
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.database import ExampleDatabase
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test
from hypothesis.statistics import collector

from fuzz.engine.component import examples_factor
from fuzz.engine.episode import EpisodeConfig, count_shown, run_ops
from fuzz.engine.harness_error import HarnessError
from fuzz.engine.journal import Journal
from fuzz.engine.known_bugs import KnownBug, KnownBugs, SameBug
from fuzz.engine.machine import BudgetSpent, CampaignStats, ShrinkBoundReached, machine_for
from racecheck.resources import ResourceExhausted
from fuzz.engine.shrink import ShrinkPlan, exact_replay, plan_for, shrink_bound, shrink_finding, where
from fuzz.engine.trace import write_trace
from fuzz.engine.violation import ZeroerViolation
from racecheck.interrupts import interrupted
from racecheck.environment import environment
from zeroer.cache.geometries import geometry_names
from zeroer.offload import HOST_MEMORY
from zeroer.registry import BUILTINS, builtin_names, default_geometry, kernel_options, load_offloader, load_zeroer

SIM_GEOMETRIES = ("mixed_dtypes", "ratio2", "tiny")
CUDA_GEOMETRIES = ("mixed_dtypes", "tiny")
SHARDS = 2
MULTI_ZEROERS = 2  # the "multi" family: two caches, one zeroer each, on one runtime
# Self-checks ("finds") stop at their first finding, so a larger budget costs time only when the
# fuzzer is about to miss (python -m fuzz.bench.selfcheck measures how many examples each needs).
FINDS_BUDGET_FACTOR = 20
UNBOUNDED_EXAMPLES = 10**9  # a budgeted run stops on its clock, not on a count
FREE_REPLAYS = 10  # a free-running finding is replayed this many times on the spot


@dataclass(frozen=True)
class Profile:
    """How hard each campaign tries."""

    name: str
    max_examples: int
    steps: int  # stateful_step_count: rules per example at most
    budget_s: float | None = None  # wall clock per campaign; None = max_examples
    fresh_seeds: bool = False  # nightly: a new seed per run instead of the campaign's fixed one
    database: bool = False  # keep an example database between runs


PROFILES: dict[str, Profile] = {
    # seconds per campaign on a laptop core
    "quick": Profile("quick", max_examples=60, steps=25),
    # fits CPU CI (2 cores) with the rest of the suite well under 20 minutes
    "ci": Profile("ci", max_examples=40, steps=25),
    # wall-clock budget from --fuzz-minutes, fresh seeds, persistent database
    "nightly": Profile("nightly", max_examples=300, steps=40, budget_s=60.0, fresh_seeds=True, database=True),
}


def spec_label(spec: str, cwd: Path | None = None) -> str:
    """The zeroer spec as the user named it, without the checkout's location.

    >>> spec_label("event_ring")
    'event_ring'
    >>> spec_label("/elsewhere/mine.py:make", cwd=Path("/repo"))
    'mine.py:make'
    """
    target, colon, attr = spec.rpartition(":")
    if not colon or not target.endswith(".py"):
        return spec
    path = Path(target)
    if path.is_absolute():
        try:
            path = path.relative_to((cwd or Path.cwd()).resolve())
        except ValueError:
            path = Path(path.name)
    return f"{path.as_posix()}:{attr}"


@dataclass(frozen=True)
class Campaign:
    config: EpisodeConfig
    shard: int = 0
    expect: str = "clean"  # "clean" | "finds"

    @property
    def id(self) -> str:
        c = self.config
        optional = ((c.offloader is not None and c.host_memory != "pinned", f"host-{c.host_memory}"),
                    (not c.warmup_sync, "strict"), (c.kernel, f"k-{c.kernel}"),
                    (c.caller_fault, f"fault-{c.caller_fault}"), (c.zeroers > 1, f"x{c.zeroers}"))
        return "-".join([spec_label(c.offloader or c.zeroer).replace("/", "_"), c.geometry, where(c),
                         *(part for wanted, part in optional if wanted), f"shard{self.shard}"])

    @property
    def seed(self) -> int:
        # Stable across processes (no hash randomisation) and distinct per campaign: a digest of
        # the whole id (the last bytes alone are shared by every "...-k-torch-shard0").
        return int.from_bytes(hashlib.sha256(self.id.encode()).digest()[:4], "little") % (2**31)

    @property
    def database_key(self) -> bytes:
        """This campaign's key in an example database: unique per campaign, stable across
        machines (its id), and not shared with another tool's keys."""
        return b"kvzero-fuzz campaign " + self.id.encode()


@dataclass
class CampaignResult:
    campaign: Campaign
    examples: int = 0
    steps: int = 0
    runs: int = 0
    seconds: float = 0.0
    first_finding_s: float | None = None
    first_finding_examples: int | None = None
    deepest_queue: int = 0
    violation: ZeroerViolation | None = None
    trace_path: Path | None = None
    seeds: list[int] = field(default_factory=list)
    reproduced: bool = True  # False: the finding did not show again when Hypothesis replayed it
    shrunk_by_hypothesis: int | None = None  # ops Hypothesis's shrinking left, before minimize(); None: it did not shrink
    shrink: dict | None = None  # how it was shrunk: where, confirmed where, cut off by the bound (ShrinkRecord)
    reproduction: dict | None = None  # free-running findings: replays on the spot (measure_reproduction)
    found_in_phase: str | None = None  # "reuse": replayed from the example database; "generate": new
    resource_error: str | None = None  # the GPU ran out of memory: neither a finding nor clean
    harness_error: str | None = None  # the harness could not follow or run the zeroer: not a verdict
    harness_status: int | None = None  # 2: the user can act on it; 3: a bug of kvzero-fuzz
    harness_details: str | None = None  # its traceback
    # Another campaign of the run had shrunk this bug: this one stopped at its first failing example
    # (``violation``, unshrunk), and that campaign's trace holds the bug (fuzz.engine.known_bugs).
    same_as: KnownBug | None = None

    @property
    def found(self) -> bool:
        return self.violation is not None


def campaign_geometries(spec: str, backend: str, requested: tuple[str, ...] | None) -> list[tuple[str, str | None]]:
    """(geometry, why it is skipped or None) for ``spec`` on ``backend``.

    ``requested`` is ``--geometry`` (None: the default). A built-in runs on its usual presets (a
    zoo entry on the one its bug shows on); an outside zeroer on every preset it declares it
    supports (``Capabilities.geometries``), non-uniform pages and packed rows included.
    """
    capabilities = load_zeroer(spec).capabilities
    if requested is not None:
        names = list(requested)
    elif default_geometry(spec):
        names = [default_geometry(spec)]
    elif spec in BUILTINS:
        names = list(CUDA_GEOMETRIES if backend == "cuda" else SIM_GEOMETRIES)
    else:
        names = geometry_names()
    supported = ", ".join(capabilities.geometries or ())
    return [(name, None if capabilities.supports_geometry(name) else
             f"{spec} declares Capabilities(geometries=({supported})), not {name}") for name in names]


def offload_campaigns(backends: list[str], offloader: str, geometries: tuple[str, ...] | None = None,
                      host_memory: tuple[str, ...] = HOST_MEMORY) -> list[tuple[Campaign, str | None]]:
    """The campaigns of ``pytest fuzz --offloader SPEC``, sorted, each with why it is skipped (None: it
    runs): every geometry it supports (or ``--geometry``), with each host pool it takes (pinned,
    registered with ``cudaHostRegister``), on each backend and cuda mode it runs in; all must be clean."""
    capabilities = load_offloader(offloader).capabilities
    campaigns: list[tuple[Campaign, str | None]] = []
    for backend in sorted(backends):
        for mode in ("controlled", "free") if backend == "cuda" else ("controlled",):
            if not capabilities.runs_on(backend, mode):
                continue
            for name in geometries if geometries is not None else geometry_names():
                skipped = None if capabilities.supports_geometry(name) else (
                    f"{offloader} declares OffloaderCapabilities(geometries=({', '.join(capabilities.geometries or ())})), not {name}")
                for memory in host_memory:
                    why = skipped or (None if memory in capabilities.host_memory else
                                      f"{offloader} declares OffloaderCapabilities(host_memory=({', '.join(capabilities.host_memory)})), "
                                      f"not {memory}")
                    for shard in range(SHARDS):
                        config = EpisodeConfig(offloader=offloader, geometry=name, backend=backend, mode=mode, host_memory=memory)
                        campaigns.append((Campaign(config, shard, "clean"), why))
    return sorted(campaigns, key=lambda pair: pair[0].id)


def default_campaigns(backends: list[str], zeroer: str | None = None,
                      geometries: tuple[str, ...] | None = None, *, warmup_sync: bool = True) -> list[tuple[Campaign, str | None]]:
    """The campaigns ``pytest fuzz`` runs, sorted, each with why it is skipped (None: it runs).

    ``zeroer`` restricts to one (all must be clean); ``geometries`` is ``--geometry``; ``warmup_sync``
    False: the stricter caller, which does not synchronise after a zeroer's warm-up (``--strict-caller``).
    """
    if not warmup_sync:
        return [(Campaign(dataclasses.replace(c.config, warmup_sync=False), c.shard, c.expect), skipped)
                for c, skipped in default_campaigns(backends, zeroer, geometries)]
    campaigns: list[tuple[Campaign, str | None]] = []
    for backend in sorted(backends):
        modes = ("controlled", "free") if backend == "cuda" else ("controlled",)
        names = [zeroer] if zeroer else builtin_names(zoo=False)
        for mode in modes:
            for name in names:
                # Each where it declares it runs (torch_per_call: cuda, free-running mode only).
                if not load_zeroer(name).capabilities.runs_on(backend, mode):
                    continue
                expect = "finds" if (zeroer is None and BUILTINS[name].verdict == "racy") else "clean"
                # On the simulator the staged designs use the torch kernel (no interpreter, fast);
                # the Triton kernel itself is fuzzed in the k-triton campaigns below.
                staged = not getattr(BUILTINS.get(name), "is_zoo", True) and kernel_options(name, "torch")
                kernel = "torch" if backend == "sim" and staged else None
                chosen = campaign_geometries(name, backend, geometries)
                for geometry, skipped in chosen:
                    for shard in range(SHARDS):
                        config = EpisodeConfig(zeroer=name, geometry=geometry, backend=backend, mode=mode, kernel=kernel)
                        campaigns.append((Campaign(config, shard, expect), skipped))
                runnable = [g for g, skipped in chosen if skipped is None]
                if runnable:
                    # The multi family: two caches, one zeroer each from the same factory, sharing
                    # the runtime and its streams (an engine's KV-cache groups). A zeroer that
                    # keeps state in its class or module races with itself here.
                    first = "tiny" if "tiny" in runnable else runnable[0]
                    config = EpisodeConfig(zeroer=name, geometry=first, backend=backend, mode=mode, kernel=kernel,
                                           zeroers=MULTI_ZEROERS)
                    campaigns.append((Campaign(config, 0, expect), None))
                if backend == "sim" and kernel == "torch" and geometries is None:
                    config = EpisodeConfig(zeroer=name, geometry="tiny", backend="sim", kernel="triton")
                    campaigns.append((Campaign(config, 0, expect), None))
        if zeroer is None:
            for fault in ("no-free-fence", "no-zero-wait"):
                config = EpisodeConfig(zeroer="reference", geometry="tiny", backend=backend, caller_fault=fault)
                campaigns.append((Campaign(config, 0, "finds"), None))
            # One self-check per zoo entry on the simulator: the fuzzer must still find each bug
            # class; `python -m fuzz.bench.detect` measures how fast (docs/detection.md).
            for name in builtin_names(zoo=True) if backend == "sim" else ():
                if load_zeroer(name).capabilities.runs_on(backend):
                    config = EpisodeConfig(zeroer=name, geometry=default_geometry(name), backend=backend)
                    campaigns.append((Campaign(config, 0, "finds"), None))
    return sorted(campaigns, key=lambda pair: pair[0].id)


def campaign_settings(profile: Profile, database: ExampleDatabase | None, max_examples: int, *,
                      shrink: bool = True) -> settings:
    # Every field that Hypothesis's own "ci" profile (auto-loaded when CI is set) would change is
    # chosen here on purpose: seeds come from the campaign, the database from the profile.
    # shrink=False leaves out the shrink phase: the finding is shrunk on the simulator instead
    # (fuzz.engine.shrink).
    phases = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target) + ((Phase.shrink,) if shrink else ())
    return settings(
        max_examples=max_examples,
        stateful_step_count=profile.steps,
        deadline=None,
        database=database if profile.database else None,
        derandomize=False,
        report_multiple_bugs=False,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=phases,
    )


def run_campaign(
    campaign: Campaign,
    profile: Profile,
    repro_dir: Path,
    *,
    budget_s: float | None = None,
    database: ExampleDatabase | None = None,
    seed_override: int | None = None,
    journal: Journal | None = None,
    minimize_trace: bool = True,
    shrink_bound_s: float | None = None,
    shrink_plan: ShrinkPlan | None = None,
    known_bugs: KnownBugs | None = None,
) -> CampaignResult:
    """Run one campaign, once; save the shrunk trace of a finding under ``repro_dir``.

    ``seed_override`` runs with that seed (``--hypothesis-seed``, ``python -m repro regenerate``);
    ``journal`` saves each op before it runs (:mod:`fuzz.engine.journal`); ``minimize_trace``
    takes the trace on to a locally minimal one (:mod:`fuzz.engine.minimize`). A finding is
    shrunk as ``shrink_plan`` says (default :func:`~fuzz.engine.shrink.plan_for`: on cuda, on the
    simulator where the zeroer runs there), each stage for at most ``shrink_bound_s`` seconds
    (default :data:`~fuzz.engine.shrink.SHRINK_BOUND_S` of its backend). ``known_bugs``: the run's
    bugs shrunk by other campaigns (:mod:`fuzz.engine.known_bugs`); a failing example of one of them
    ends the campaign there, unshrunk, with :attr:`CampaignResult.same_as` set and no trace of its own.
    """
    result = CampaignResult(campaign)
    budget = budget_s if budget_s is not None else profile.budget_s
    plan = shrink_plan if shrink_plan is not None else plan_for(campaign.config, minimize_trace=minimize_trace)
    started = time.monotonic()
    # Where Hypothesis does not shrink and a replay is exact, its run ends at the first example after
    # a finding (a bound of 0 s): without a shrink phase it still ran its target phase's hill
    # climbing to the end, which does not stop at a failure (1,400 examples and 140 s after
    # HiCache's #27444 showed at 5.6 s). Free-running, Hypothesis's own replay of the finding tells
    # a timing-dependent one (``reproduced``), so it goes on to that replay.
    stats = CampaignStats(started=started, deadline=None if budget is None else started + budget,
                          shrink_bound_s=shrink_bound(campaign.config.backend, shrink_bound_s)
                          if plan.hypothesis_shrinks else 0.0 if exact_replay(campaign.config) else None)
    if seed_override is not None:
        run_seed = seed_override
    elif profile.fresh_seeds:
        run_seed = int.from_bytes(os.urandom(4), "little") % (2**31)  # recorded, so it can be regenerated
    else:
        run_seed = campaign.seed
    result.seeds.append(run_seed)
    if campaign.config.backend == "cuda":
        environment()  # probe the GPU now (cached), not in a save after Ctrl-C; its context exists anyway
    if journal is not None:
        journal.seed = run_seed
    machine = machine_for(campaign.config, campaign.id, stats=stats, journal=journal,
                          database_key=campaign.database_key, known_bugs=known_bugs)
    factor = (FINDS_BUDGET_FACTOR if campaign.expect == "finds" else 1) * examples_factor(campaign.config)
    examples = UNBOUNDED_EXAMPLES if budget is not None else profile.max_examples * factor
    # Every full garbage collection re-scans the ~300k objects torch and the imports left
    # behind, which cost 13-20% of a simulator campaign (cProfile). Frozen, they are skipped;
    # what the campaign itself allocates is collected as usual, and unfreeze() hands the rest
    # back afterwards.
    gc.freeze()
    statistics: dict = {}  # Hypothesis's per-phase statistics of the run, noted before it raises a finding
    cut_off = False  # the shrink bound stopped Hypothesis's shrink phase
    run_settings = campaign_settings(profile, database, examples, shrink=plan.hypothesis_shrinks)
    try:
        with collector.with_value(statistics.update):
            run_state_machine_as_test(seed(run_seed)(machine), settings=run_settings)
    except ZeroerViolation as error:
        result.violation = error
    except BudgetSpent:
        pass  # the clock ran out with nothing found
    except SameBug as same:  # another campaign of the run has shrunk this bug: not a second time
        result.violation, result.same_as = same.violation, same.known
    except ResourceExhausted as error:  # no verdict either way (racecheck.resources)
        result.resource_error = str(error)
    except HarnessError as error:  # no verdict either way (fuzz.engine.harness_error)
        result.harness_error, result.harness_status, result.harness_details = error.message, error.status, error.details
    except Flaky as error:
        # Found once, gone when Hypothesis replayed it: a timing-dependent finding (the
        # free-running cuda mode). Still a finding, kept with the program that showed it.
        original = _first_violation(error)
        if original is None:
            raise
        result.violation, result.reproduced = original, False
    except (ShrinkBoundReached, Exception) as error:
        if interrupted():
            # Ctrl-C came too: an interruption, whatever else was due. Or the signal's
            # KeyboardInterrupt landed inside Hypothesis's own bookkeeping, which then failed on its
            # own (seen once in CI: a bare AssertionError from its stateful runner, SIGTERM 0.74 s
            # into a run of a race-free zeroer). After Ctrl-C nothing is a verdict
            # (racecheck.interrupts): an interruption, never a failed campaign.
            interruption = KeyboardInterrupt("the run was interrupted")
            _save_interrupted(interruption, stats.smallest, repro_dir, run_seed, campaign)
            raise interruption from error
        if not isinstance(error, ShrinkBoundReached):
            raise
        # the smallest program so far: still the finding, cut off where Hypothesis was shrinking it
        result.violation, cut_off = stats.smallest, plan.hypothesis_shrinks
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM, maybe while shrinking: keep what was found
        _save_interrupted(stop, stats.smallest, repro_dir, run_seed, campaign)
        raise
    finally:
        gc.unfreeze()
    result.runs = 1
    for name in ("examples", "steps", "first_finding_s", "first_finding_examples", "deepest_queue"):
        setattr(result, name, getattr(stats, name))
    if journal is not None:
        journal.discard()  # the run ended without a crash
    if result.same_as is not None:  # nothing to shrink, replay or save: the other campaign's trace holds it
        result.seconds = time.monotonic() - started
        return result
    try:
        if result.violation is not None:
            result.found_in_phase = failing_phase(statistics)
            if plan.hypothesis_shrinks:
                result.shrunk_by_hypothesis = len(result.violation.trace)
            found_at = started + (stats.first_finding_s or 0.0)
            try:
                result.violation, record = shrink_finding(
                    result.violation, plan, found_at=found_at, bound_s=shrink_bound_s, hypothesis_cut_off=cut_off,
                    minimize_trace=minimize_trace, reproduced=result.reproduced)
                result.shrink = record.as_dict()
            except ResourceExhausted as error:  # the GPU faulted on a replay: keep the program the GPU found
                result.shrink = {"shrunk_on": None, "confirmed_on": None, "gpu_lost": str(error)}
        if result.violation is not None and campaign.config.backend == "cuda" and campaign.config.mode == "free":
            try:
                result.reproduction = measure_reproduction(result.violation.config, result.violation.trace)
            except ResourceExhausted as error:
                result.reproduction = {"mode": "free", "gpu_lost": str(error)}
        result.seconds = time.monotonic() - started
        if result.violation is not None:
            result.trace_path = write_trace(
                repro_dir, result.violation.config, result.violation.trace, result.violation.findings,
                seed=run_seed, campaign=campaign.id, reproduction=result.reproduction, shrink=result.shrink,
            )
    except KeyboardInterrupt as stop:  # while minimising or replaying: save Hypothesis's shrunk program
        if result.trace_path is None:
            _save_interrupted(stop, result.violation, repro_dir, run_seed, campaign)
        raise
    if known_bugs is not None and result.trace_path is not None:
        known_bugs.register(result.violation, result.trace_path)  # only now that its trace is on disk
    return result


def _save_interrupted(stop: KeyboardInterrupt, violation: ZeroerViolation | None, repro_dir: Path, run_seed: int,
                      campaign: Campaign) -> None:
    """Ctrl-C cut a campaign off after it had found something: save the shortest program that
    showed it so far (maybe not fully shrunk), as the campaign would have at its end, and say so
    on the interruption. (Only the first signal interrupts, so this write is not cut off.)"""
    if violation is None:
        return
    # Not the GPU probe now (CUDA's initialisation and nvidia-smi: seconds on a busy GPU, 18 s
    # once on the H200): the user asked to stop.
    path = write_trace(repro_dir, violation.config, violation.trace, violation.findings, seed=run_seed,
                       campaign=campaign.id, probe=False)
    stop.add_note(f"{campaign.id}: interrupted after a finding; its program so far ({len(violation.trace)} ops, "
                  f"maybe not fully shrunk) is saved in {path}")


def measure_reproduction(config: EpisodeConfig, ops: list[dict]) -> dict:
    """A free-running finding is timing luck until shown otherwise: replay it :data:`FREE_REPLAYS`
    times as it was found, and once in the controlled mode where the zeroer runs there (a forced
    schedule shows a race every time, or the program does not hold one)."""
    shown = count_shown(config, ops, FREE_REPLAYS)
    measured: dict = {"mode": "free", "replays": FREE_REPLAYS, "shown": shown, "rate": round(shown / FREE_REPLAYS, 3)}
    if load_zeroer(config.zeroer).capabilities.runs_on("cuda", "controlled"):
        measured["controlled"] = bool(run_ops(dataclasses.replace(config, mode="controlled"), ops))
    return measured


def failing_phase(statistics: dict) -> str | None:
    """The first Hypothesis phase in which an example failed, from the statistics Hypothesis
    notes at the end of a run: ``reuse`` means an example from the database failed again (saved
    by an earlier run, on this host or, through a shared database, on another), ``generate`` a
    new one. None if the statistics do not say (their format is not promised to be stable)."""
    for phase in ("reuse", "generate"):
        cases = statistics.get(f"{phase}-phase", {}).get("test-cases", [])
        if any(case.get("status") == "interesting" for case in cases):
            return phase
    return None


def _first_violation(error: BaseException) -> ZeroerViolation | None:
    """The ZeroerViolation inside a Hypothesis Flaky error (an exception group), if any."""
    for inner in getattr(error, "exceptions", ()):
        found = inner if isinstance(inner, ZeroerViolation) else _first_violation(inner)
        if found is not None:
            return found
    return None

