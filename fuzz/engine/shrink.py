"""Where a finding is shrunk, and for how long.

A finding is shrunk by :func:`~fuzz.engine.minimize.minimize`, which shrinks the ops themselves;
where a plan keeps it, Hypothesis first shrinks the choices that generated the failing program
(below: where the zeroer cannot run on the simulator). Every step of
either replays a program, and on cuda a replay pays for gated launches: on an H200 (controlled
mode) the racy engine-style zeroers of ``examples/engine_zeroers.py`` were found in 0.2 to 7 s
per campaign and then shrunk for 25 to 67 s (333 to 926 examples). The simulator replays the same
ops exactly, and fast. So on cuda, where the zeroer runs on the simulator too:

1. Hypothesis runs the campaign on the GPU without its shrink phase and hands back the first
   failing program, as generated;
2. that program is replayed on the simulator; if it shows the same kind of finding there, it is
   minimized there (:func:`minimize` on a simulator config: no Hypothesis, no GPU);
3. the shrunk trace is confirmed on the GPU, replayed in the campaign's mode: it must show the same
   kind of finding (controlled: one replay, which is exact; free-running: at least one of
   :data:`FREE_CONFIRM_REPLAYS`, since real timing decides there);
4. confirmed, the shrunk trace and the GPU's findings are the campaign's result. Otherwise (the
   simulator does not show it or cannot run it, say a Triton kernel the installed Triton's
   interpreter cannot run, or the shrunk trace does not show on the GPU) it falls back to
   shrinking on the GPU: :func:`minimize` on the campaign's own config, from the first failing
   program. (Hypothesis cannot take the shrinking up again: its run has ended, and an example it
   replays from a database it does not shrink again.)

A simulator campaign also runs Hypothesis without its shrink phase: :func:`minimize` takes the
first failing program down on its own, in tens of replays where Hypothesis's shrinking replayed
hundreds to reach the same length or a longer one (SGLang #27444's HiCache race on a 2-core VM:
25 replays and 1.4 s to 6 ops, against 1,700 examples and 49 s to 7, then 6 by minimize). Where
the zeroer cannot run on the simulator (``Capabilities(backends=("cuda",))``), and where
minimizing is turned off, Hypothesis shrinks as before and :func:`minimize` follows. :func:`plan_for`
decides (a :class:`ShrinkPlan`, which tests replace to run the whole flow on the CPU);
:func:`shrink_finding` carries it out after the Hypothesis run; its :class:`ShrinkRecord` says how
the trace was shrunk, in the campaign's result, its summary record and its trace file.

**The bound.** Each stage shrinks for at most :data:`SHRINK_BOUND_S` seconds of the backend it
replays on (or the caller's bound, ``--fuzz-shrink-seconds``) and keeps the smallest trace so far:
Hypothesis's shrink phase through :class:`~fuzz.engine.machine.ShrinkBoundReached`, counted from
the first finding, with :func:`minimize` after it getting what is left; a minimize of its own
through its ``deadline``. A trace cut off by the bound is the finding it is, marked ``cut_off``.

Example::

    plan = plan_for(EpisodeConfig(zeroer="ring", backend="cuda"))
    plan.shrink_on.backend           # 'sim': Hypothesis will not shrink on the GPU
    violation, record = shrink_finding(first_failing, plan, found_at=found_at)
    record.shrunk_on, record.confirmed_on, record.cut_off     # ('sim', 'cuda-controlled', False)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.harness_error import HarnessError
from fuzz.engine.minimize import Minimized, minimize
from fuzz.engine.oracle import Finding
from fuzz.engine.violation import ZeroerViolation
from zeroer.registry import kernel_options, load_zeroer

# Seconds one stage of shrinking may take, by the backend its replays run on.
SHRINK_BOUND_S: dict[str, float] = {
    # Hypothesis shrank the built-in races in 1 to 3 s here, and the engine-style ones (plain torch
    # zeroers, intercepted, their Triton kernel under the interpreter) in 1.4 to 28 s on an idle
    # 2-core VM, up to 60 s on a loaded one, HiCache's #27444 up to 120 (docs/fuzzing.md, "The
    # shrink bound"); minimize() alone, which a simulator campaign now runs, takes a few seconds:
    # the bound stops only a runaway, and a Hypothesis shrink where a plan still asks for one.
    "sim": 120.0,
    # A GPU replay pays for gated launches: Hypothesis took 25 to 67 s (333 to 926 examples, about
    # 75 ms each) to shrink the engine-style races on an H200. What still shrinks on the GPU is a
    # fallback's minimize (9 to 41 replays for those races on the simulator: a few seconds) and
    # Hypothesis for zeroers that run on cuda only; half a minute is about 400 GPU replays.
    "cuda": 30.0,
}
# A free-running replay shows a race only when timing allows; as many tries as a free-running
# finding is measured with (fuzz.engine.campaigns.FREE_REPLAYS).
FREE_CONFIRM_REPLAYS = 10

Confirm = Callable[[EpisodeConfig, list[dict]], list[Finding]]


def where(config: EpisodeConfig) -> str:
    """``sim``, ``cuda-controlled`` or ``cuda-free``: where a replay of ``config`` runs."""
    return "sim" if config.backend == "sim" else f"cuda-{config.mode}"


def exact_replay(config: EpisodeConfig) -> bool:
    """Whether a replay of ``config`` shows what its schedule says (the simulator, controlled cuda),
    not what real timing allows (free-running cuda)."""
    return config.backend == "sim" or config.mode == "controlled"


def shrink_bound(backend: str, override: float | None = None) -> float:
    """The bound of a shrinking stage whose replays run on ``backend``."""
    return override if override is not None else SHRINK_BOUND_S[backend]


def confirm_on_device(config: EpisodeConfig, ops: list[dict]) -> list[Finding]:
    """Replay ``ops`` where the campaign runs: the findings of the first replay that shows any
    (controlled or simulator: one replay, exact; free-running: up to :data:`FREE_CONFIRM_REPLAYS`)."""
    tries = 1 if exact_replay(config) else FREE_CONFIRM_REPLAYS
    return next(filter(None, (_replay(config, ops) for _ in range(tries))), [])  # replays stop at the first


@dataclass(frozen=True)
class ShrinkPlan:
    """Where a campaign's finding is shrunk.

    ``shrink_on`` is the simulator config the first failing program of a cuda campaign is minimized
    on, with Hypothesis's shrink phase left out; ``confirm`` replays the shrunk trace where the
    campaign runs. ``shrink_on`` None: the finding is shrunk on the campaign's backend, by
    Hypothesis then :func:`minimize` (``hypothesis``), or by :func:`minimize` alone from the first
    failing program (a simulator campaign); on cuda ``why_not`` says why not on the simulator.
    """

    shrink_on: EpisodeConfig | None = None
    confirm: Confirm = confirm_on_device
    why_not: str | None = None
    hypothesis: bool = True

    @property
    def hypothesis_shrinks(self) -> bool:
        return self.shrink_on is None and self.hypothesis


def simulator_config(config: EpisodeConfig) -> EpisodeConfig:
    """``config`` on the simulator. A built-in staged design found with its default (Triton) kernel
    is replayed with its torch kernel, as the simulator campaigns run it: the Triton one runs under
    its interpreter on the CPU, and the GPU confirms the result with the kernel that found it."""
    kernel = config.kernel
    if kernel is None and kernel_options(config.zeroer, "torch"):
        kernel = "torch"
    return dataclasses.replace(config, backend="sim", mode="controlled", device=None, kernel=kernel)


def plan_for(config: EpisodeConfig, *, minimize_trace: bool = True) -> ShrinkPlan:
    """Where a campaign on ``config`` shrinks its finding: on the simulator for a cuda campaign whose
    zeroer runs there (both cuda modes: a hazard depends on the program alone, so the simulator
    shows what the GPU showed, and the GPU confirms the result); a simulator campaign by
    :func:`minimize` alone; else Hypothesis, where it runs, then :func:`minimize`."""
    if not minimize_trace:
        return ShrinkPlan(why_not="minimizing was turned off" if config.backend == "cuda" else None)
    if config.backend != "cuda":
        return ShrinkPlan(hypothesis=False)  # minimize() reaches in tens of replays what Hypothesis did in hundreds
    if not load_zeroer(config.zeroer).capabilities.runs_on("sim"):
        return ShrinkPlan(why_not=f"zeroer {config.zeroer!r} does not run on the simulator")
    return ShrinkPlan(shrink_on=simulator_config(config))


@dataclass
class ShrinkRecord:
    """How a finding's trace was shrunk (``"shrink"`` in its summary record and trace file)."""

    shrunk_on: str | None  # where the replays that shrank it ran: sim, cuda-controlled, cuda-free; None: not shrunk
    by: str  # "hypothesis", "hypothesis+minimize", "minimize" or "none"
    from_ops: int  # ops of the first failing program (sim path, fallback) or of Hypothesis's shrunk one
    ops: int  # ops of the trace kept
    confirmed_on: str | None = None  # shrunk on the simulator: where the trace showed the same kind again
    fallback: str | None = None  # cuda: why it was not shrunk on the simulator
    cut_off: bool = False  # a bound stopped shrinking: the trace is the smallest so far, still the finding
    bound_s: float | None = None  # the bound of the last stage that shrank it
    seconds: float = 0.0  # from the first finding to the end of shrinking
    replays: int = 0  # programs minimize() ran

    def as_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["seconds"] = round(self.seconds, 3)
        return record


def shrink_finding(violation: ZeroerViolation, plan: ShrinkPlan, *, found_at: float, bound_s: float | None = None,
                   hypothesis_cut_off: bool = False, minimize_trace: bool = True,
                   reproduced: bool = True) -> tuple[ZeroerViolation, ShrinkRecord]:
    """Shrink ``violation`` (what the Hypothesis run handed back) as ``plan`` says.

    ``found_at``: ``time.monotonic()`` of the first finding, where Hypothesis's bound started;
    ``bound_s``: the caller's bound for every stage (None: :data:`SHRINK_BOUND_S`);
    ``hypothesis_cut_off``: the bound stopped Hypothesis's shrink phase (``violation`` is then the
    smallest program so far); ``reproduced``: False when Hypothesis's replay of it did not show it.
    """
    config = violation.config
    if plan.shrink_on is not None and violation.findings:
        bound = shrink_bound(plan.shrink_on.backend, bound_s)
        shrunk, why = _shrink_on_simulator(violation, plan, time.monotonic() + bound)
        if shrunk is not None:
            return shrunk.violation, ShrinkRecord(
                "sim", "minimize", len(violation.trace), len(shrunk.violation.trace), confirmed_on=where(config),
                cut_off=shrunk.cut_off, bound_s=bound, seconds=time.monotonic() - found_at, replays=shrunk.replays)
        bound = shrink_bound(config.backend, bound_s)
        fallback = minimize(violation, deadline=time.monotonic() + bound)
        return fallback.violation, ShrinkRecord(
            where(config), "minimize", len(violation.trace), len(fallback.violation.trace), fallback=why,
            cut_off=fallback.cut_off, bound_s=bound, seconds=time.monotonic() - found_at, replays=fallback.replays)
    bound = shrink_bound(config.backend, bound_s)
    minimized = Minimized(violation, 0)
    if minimize_trace and reproduced and exact_replay(config):
        minimized = minimize(violation, deadline=found_at + bound)  # what Hypothesis left of the bound
    stages = (["hypothesis"] if plan.hypothesis_shrinks else []) + (["minimize"] if minimized.replays else [])
    by = "+".join(stages) or "none"
    return minimized.violation, ShrinkRecord(
        where(config) if by != "none" else None, by, len(violation.trace),
        len(minimized.violation.trace), fallback=plan.why_not, cut_off=hypothesis_cut_off or minimized.cut_off,
        bound_s=bound, seconds=time.monotonic() - found_at, replays=minimized.replays)


def _shrink_on_simulator(violation: ZeroerViolation, plan: ShrinkPlan,
                         deadline: float) -> tuple[Minimized | None, str | None]:
    """Steps 2 and 3: the first failing program minimized on the simulator and confirmed where the
    campaign runs, with the campaign's findings; or None and why not."""
    kind = violation.findings[0].kind
    try:
        on_sim = run_ops(plan.shrink_on, violation.trace)
    except ValueError:  # not a valid program there
        on_sim = []
    except HarnessError as error:  # e.g. Triton's interpreter cannot run the zeroer's kernel: the GPU can
        return None, (f"the simulator could not run the first failing program ({len(violation.trace)} ops): "
                      f"{error.message}")
    if not on_sim or on_sim[0].kind != kind:
        shown = f"a {on_sim[0].kind!r} finding" if on_sim else "no finding"
        return None, (f"the first failing program ({len(violation.trace)} ops) showed {shown} on the simulator, "
                      f"not {kind!r}")
    shrunk = minimize(ZeroerViolation(on_sim, violation.trace, plan.shrink_on), deadline=deadline)
    ops = shrunk.violation.trace
    confirmed = plan.confirm(violation.config, ops)
    if not confirmed or confirmed[0].kind != kind:
        shown = f"a {confirmed[0].kind!r} finding" if confirmed else "no finding"
        return None, (f"the trace shrunk on the simulator ({len(ops)} ops) showed {shown} on "
                      f"{where(violation.config)}, not {kind!r}")
    return Minimized(ZeroerViolation(confirmed, ops, violation.config), shrunk.replays, shrunk.cut_off), None


def _replay(config: EpisodeConfig, ops: list[dict]) -> list[Finding]:
    """The findings of one replay; none where the program is not valid there or the harness cannot
    run it (that is for the fallback to deal with, not a finding of its own)."""
    try:
        return run_ops(config, ops)
    except (ValueError, HarnessError):
        return []
