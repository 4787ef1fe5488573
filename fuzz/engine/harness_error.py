"""A harness failure is never a finding.

A finding claims that the user's zeroer is wrong: a hazard, a value the oracle rejects, or an
exception the zeroer itself raises on input inside its declared contract. Anything else that stops
an episode, an op the simulator or the interception cannot carry out, a clash in the runtime, an
input outside the zeroer's contract, a bug of ours, is a :class:`HarnessError`: the campaign stops
at once, writes no trace, and is reported as an error with one line that names the zeroer's call,
its ``file:line`` and the way forward, and exit status 2 (the user can act on it) or 3 (a bug of
kvzero-fuzz). Whose an exception is, is read from where it was raised (:mod:`kvdevice.origin`).

A factory that raises is a usage error (exit status 2), never a finding, whoever's code raised
it: code that cannot be built was never run (:func:`factory_error`). Only what the zeroer or
offloader raises once it exists (its warmup, calls, close, kernels) can be a finding.

Example::

    try:
        zeroer.zero_block_ids(ids)
    except Exception as error:
        raise_if_harness(error, "zero_block_ids([1, 2])", step=2)   # HarnessError, or nothing
        ...                                                         # the zeroer's: a finding
"""

from __future__ import annotations

import traceback

from racecheck.cli import one_line, register_exit_status
from racecheck.custom_ops import failed_inside
from racecheck.resources import raise_if_device_fault
from kvdevice.origin import HARNESS_BUG, USER_FIXABLE, blame

__all__ = ["HARNESS_BUG", "USER_FIXABLE", "HarnessError", "factory_error", "harness_error", "raise_if_harness"]

REPORT = ("a bug of kvzero-fuzz, not of the code under test: please report this line with the summary's harness_details "
          "(or rerun with --fuzz-debug for the traceback)")


class HarnessError(BaseException):
    """The harness could not follow or run the zeroer: neither a finding nor clean.

    A BaseException, like an interruption: Hypothesis lets it through at once instead of shrinking
    it as a failure, and ``except Exception`` in a zeroer or a library does not swallow it.
    ``status`` is 2 (the message says what the user can do) or 3 (a bug of ours); ``details`` the
    traceback, for the summary's JSON.
    """

    def __init__(self, message: str, status: int, details: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.details = details


# A command that meets one ends with its own line and status (racecheck.cli's convention); --debug
# prints the traceback it carries (the one of the error it stands for).
register_exit_status(HarnessError, lambda error, prog: (error.status, f"{prog}: {error.message}", error.details))


def harness_error(error: BaseException, during: str, *, step: int | None = None, where: str | None = None,
                  status: int | None = None) -> HarnessError:
    """The :class:`HarnessError` for ``error``, raised ``during`` (the zeroer's call, or the op).

    ``where`` is the zeroer's ``file:line (code)`` the call came from, when there is one;
    ``status`` by default 2 for a refusal that names its fix (``user_fixable``), else 3. A CUDA
    fault is neither: it raises :class:`~racecheck.resources.DeviceFault` instead, whose code
    it surfaced in says nothing about whose it is (the error is reported at a later CUDA call)."""
    raise_if_device_fault(error, during)
    if status is None:
        status = USER_FIXABLE if getattr(error, "user_fixable", False) else HARNESS_BUG
    at = f" at step {step}" if step is not None else ""
    place = f", called at {where}" if where else ""
    fix = "" if status == USER_FIXABLE else f"; {REPORT}"
    message = one_line(f"harness error{at} in {during}{place}, not a finding: {type(error).__name__}: {error}{fix}")
    details = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return HarnessError(message, status, details)


def raise_if_harness(error: BaseException, during: str, *, step: int | None = None) -> None:
    """Raise a :class:`HarnessError` from ``error`` when the harness, not the zeroer, raised it."""
    raise_if_device_fault(error, during)
    verdict = blame(error)
    # Inside a stand-in or an effect model of the tools (racecheck.custom_ops): never the code's, even
    # where the code's own line raised it (a name a stand-in module lacks).
    inside = failed_inside(error)
    if inside is not None:
        status = USER_FIXABLE if getattr(error, "user_fixable", False) else HARNESS_BUG
        raise harness_error(error, f"{during}, inside {inside}", step=step, where=verdict.where,
                            status=status) from error
    if verdict.harness:
        raise harness_error(error, during, step=step, where=verdict.where, status=verdict.status) from error


def factory_error(error: BaseException, component: str, spec: str, signature: str) -> HarnessError:
    """The usage error (status 2) for ``spec``'s factory raising ``error`` before the ``component``
    (``"zeroer"`` or ``"offloader"``) existed; ``signature`` is how the harness calls it,
    ``(cache, runtime)`` or ``(cache, host_pool, runtime)``. The line names the factory, the
    exception and the ``file:line`` of the innermost frame of code that is not a library's."""
    where = blame(error).where
    at = f" at {where}" if where else ""
    name = spec.rpartition(":")[2] if ":" in spec else "factory"
    message = one_line(
        f"the {component} factory {spec!r} raised{at}: {type(error).__name__}: {error}; it built no {component}, so "
        f"nothing was fuzzed and this is not a finding: fix the factory so that {name}{signature} returns the {component}")
    details = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return HarnessError(message, USER_FIXABLE, details)
