"""Where the sanitizer's per-op time goes, by stage: a cProfile of the observed loop, its functions'
own time summed by the stage their module (or function) belongs to.

A built-in's time (``dict.get``, ``isinstance``, a torch C method) is its callers': it is split among
the Python functions that called it, by what each call cost, and counted in their stages. So a
``torch`` op the program calls from its loop counts as ``program``, and the work of an op a dispatch
mode hands on counts as ``dispatch`` (the innermost mode calls the kernel). :func:`split` subtracts
the plain run's profile (the same loop, unobserved) stage by stage, so the op's own work drops out
and ``dispatch`` is what the mode layer adds: the handler's glue and torch's re-dispatch.

The stages are those of issue 54: dispatch, the argument walk (which tensors an op touches), the
schema (what an op reads and writes, by overload), memory lookup (device, pinned, registered:
which memory a tensor is in), happens-before (stamps, clocks, shadows, stream and event hooks),
thread hooks (host threads, boundaries, host accesses), and besides them where the op was called
(``sites``), the values of small integer tensors (``values``) and pinned copies' snapshots
(``pinned``). cProfile costs about as much per Python call as a small function's body, so the
shares, not the absolute times, are what to read from it; the benchmark scales them to its
unprofiled measurement.

Example::

    profile = cProfile.Profile(); profile.enable(); loop(); profile.disable()
    split(pstats.Stats(profile), baseline=pstats.Stats(plain_profile))   # -> {"dispatch": 0.8, ...} (seconds)
"""

from __future__ import annotations

import pstats
from typing import Any

# (stage, path fragments, function names or None for all); first match wins. Paths use "/".
STAGES: tuple[tuple[str, tuple[str, ...], frozenset[str] | None], ...] = (
    ("argument walk", ("sanitizer/host_ops.py", "torch/utils/_pytree.py"), None),
    ("argument walk", ("sanitizer/gpu/dispatch.py",), frozenset({"fresh_outputs"})),
    ("schema", ("racecheck/ops.py", "racecheck/effects.py", "racecheck/engine_ops.py",
                "racecheck/custom_ops.py", "racecheck/dtypes.py"), None),
    ("memory lookup", ("sanitizer/gpu/device.py", "racecheck/ranges.py"), None),
    ("memory lookup", ("sanitizer/gpu/standin.py",),
     frozenset({"is_device", "is_pinned", "adopt", "device_index", "holding", "current_stream"})),
    ("memory lookup", ("sanitizer/gpu/observer.py",),
     frozenset({"device_access", "device_access_at", "region_of", "memory_allocated", "_gone"})),
    ("happens-before", ("racecheck/hb.py", "racecheck/clocks.py", "racecheck/shadow.py", "sanitizer/races.py",
                        "sanitizer/gpu/trace.py", "sanitizer/gpu/graphs.py"), None),
    ("happens-before", ("sanitizer/gpu/standin.py",), frozenset({"_call", "record", "wait", "synchronize"})),
    ("happens-before", ("sanitizer/gpu/observer.py",), frozenset({"enqueue", "label", "stream_thread",
                                                                  "observes_stream"})),
    ("thread hooks", ("racecheck/thread_hooks.py", "racecheck/threads.py", "racecheck/turns.py",
                      "racecheck/interrupts.py", "sanitizer/watch.py", "sanitizer/numpy_views.py"), None),
    ("sites", ("sanitizer/sites.py", "kvdevice/origin.py"), None),
    ("values", ("racecheck/device_values.py", "sanitizer/gpu/indices.py", "racecheck/triton_stores.py"), None),
    ("pinned", ("racecheck/pinned.py", "sanitizer/gpu/copies.py", "racecheck/gate.py", "sanitizer/gpu/forcing.py"),
     None),
    ("dispatch", ("sanitizer/gpu/dispatch.py", "sanitizer/dynamo_guard.py", "racecheck/lazy_dynamo.py",
                  "torch/_ops.py", "torch/utils/_python_dispatch.py", "torch/_library/", "torch/_dynamo/",
                  "torch/_compile.py", "sanitizer/gpu/standin.py", "sanitizer/gpu/observer.py"), None),
)
PROGRAM = "program"  # the loop's own code and what it calls directly (its torch ops included)
OTHER = "other"  # the sanitizer's or torch's code no stage names (for the reader to place)
ORDER = ("dispatch", "argument walk", "schema", "memory lookup", "happens-before", "thread hooks", "sites",
         "values", "pinned", OTHER)


def stage_of(filename: str, function: str, program: tuple[str, ...] = ()) -> str:
    """The stage of a Python function (``program``: path fragments of the measured loop's own files)."""
    path = filename.replace("\\", "/")
    if any(fragment in path for fragment in program):
        return PROGRAM
    for stage, fragments, names in STAGES:
        if any(fragment in path for fragment in fragments) and (names is None or function in names):
            return stage
    if "/torch/" in path or "/sanitizer/" in path or "/racecheck/" in path or "/zeroer/" in path:
        return OTHER
    return PROGRAM


def seconds_by_stage(stats: pstats.Stats | dict[Any, Any], program: tuple[str, ...] = ()) -> dict[str, float]:
    """Own time summed by stage, each built-in's time given to its callers' stages (module docstring).
    ``stats`` is a profile's table (``pstats.Stats(profile).stats``: function -> counts, own and
    total time, callers with the same figures for each), or the Stats holding it."""
    table: dict[Any, Any] = stats if isinstance(stats, dict) else stats.stats  # type: ignore[attr-defined]
    totals: dict[str, float] = {}

    def add(key: tuple[str, int, str], seconds: float) -> None:
        stage = stage_of(key[0], key[2], program)
        totals[stage] = totals.get(stage, 0.0) + seconds

    for key, (_, _, own, _, callers) in table.items():
        if key[0] != "~":
            add(key, own)
            continue
        python_callers = {caller: entry for caller, entry in callers.items() if caller[0] != "~"}
        spent = sum(entry[2] for entry in python_callers.values())
        if not python_callers or spent <= 0:
            totals[PROGRAM] = totals.get(PROGRAM, 0.0) + own
            continue
        for caller, entry in python_callers.items():
            add(caller, own * entry[2] / spent)
    return totals


def split(observed: pstats.Stats | dict[Any, Any], baseline: pstats.Stats | dict[Any, Any], program: tuple[str, ...] = ()) -> dict[str, float]:
    """What the sanitizer added, by stage: the observed run's seconds less the baseline's (the same
    loop unobserved), stage by stage. The program's own frames grow too (torch enters the sanitizer's
    mode from the op the program calls): that growth is the mode layer's, so it counts as ``dispatch``."""
    ours = seconds_by_stage(observed, program)
    plain = seconds_by_stage(baseline, program)
    added = {stage: ours.get(stage, 0.0) - plain.get(stage, 0.0) for stage in ORDER}
    added["dispatch"] += ours.get(PROGRAM, 0.0) - plain.get(PROGRAM, 0.0)
    return added
