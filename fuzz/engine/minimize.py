"""Take a shrunk trace on to a locally minimal one: no single op or argument can be dropped.

Hypothesis shrinks the choices that generated a program; what it hands back can still hold an op
whose removal keeps the bug (a ``reallocate`` that only drained the device, a ``delay`` nobody
waits on), because removing it changes the choices after it. :func:`minimize` works on the ops
themselves: it replays the trace without each op in turn, and with each argument set back to its
default or made smaller, keeps every change after which the same kind of finding still shows, and
repeats until no change helps. On the simulator and in the controlled cuda mode a replay is exact
(the schedule is in the ops), so the result is deterministic, and it is what the trace file holds.

Example::

    violation = minimize(violation)      # e.g. 6 ops -> 3: start, allocate, allocate
"""

from __future__ import annotations

from fuzz.engine.cache_pool import CachePool
from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.harness_error import HarnessError
from fuzz.engine.machine import ZeroerViolation
from fuzz.engine.ops import FIELDS
from fuzz.engine.oracle import Finding

MAX_REPLAYS = 400  # a bound on the work: a trace of 25 ops needs a few dozen
_POOL = CachePool()


def _shows(config: EpisodeConfig, ops: list[dict], kind: str) -> list[Finding] | None:
    try:
        findings = run_ops(config, ops, caches=_POOL if config.backend == "sim" else None)
    except ValueError:  # no longer a valid program (an op on a block nothing allocated)
        return None
    except HarnessError:  # a smaller program the harness cannot run shows nothing: keep the larger one
        return None
    return findings if findings and findings[0].kind == kind else None


def _smaller(op: dict) -> list[dict]:
    """Variants of ``op`` with one argument dropped to its default or made smaller."""
    name = op["op"]
    defaults = FIELDS[name][1]
    variants = []
    for field, value in op.items():
        if field == "op":
            continue
        if field in defaults and value != defaults[field]:
            variants.append({k: v for k, v in op.items() if k != field})  # back to its default
        if isinstance(value, int) and field in ("n", "ops", "amount", "in_flight") and value > 1:
            variants.append({**op, field: 1})
    return variants


def minimize(violation: ZeroerViolation) -> ZeroerViolation:
    """A locally minimal version of ``violation``'s trace showing the same kind of finding."""
    config, ops = violation.config, list(violation.trace)
    if not violation.findings:
        return violation
    kind = violation.findings[0].kind
    best = violation.findings
    replays = 0
    changed = True
    while changed and replays < MAX_REPLAYS:
        changed = False
        for i in range(len(ops) - 1, 0, -1):  # never the start op
            if replays >= MAX_REPLAYS:
                break
            candidate = ops[:i] + ops[i + 1:]
            replays += 1
            found = _shows(config, candidate, kind)
            if found is not None:
                ops, best, changed = candidate, found, True
        for i in range(len(ops)):
            for variant in _smaller(ops[i]):
                if replays >= MAX_REPLAYS:
                    break
                candidate = ops[:i] + [variant] + ops[i + 1:]
                replays += 1
                found = _shows(config, candidate, kind)
                if found is not None:
                    ops, best, changed = candidate, found, True
                    break
    if ops == violation.trace:
        return violation
    return ZeroerViolation(best, ops, config)
