"""What CUDA, through torch, raises for a call it refuses in the state its arguments are in.

A call such as ``start.elapsed_time(end)`` is refused for the state its events are in, not for
what it is: an end event that has not completed, an event never recorded, an event made without
timing. The runtime raises these where torch raises them, with torch's type and words, so that the
code under test sees on the simulator what it sees on a GPU (and its ``except RuntimeError`` catches
them alike). Each error also says the call and the state in the harness's words (``call``,
``state``): a finding names them (``elapsed_time on an end event that had not completed``), since
the code under test put its own call in that state (kvdevice.origin reads
:attr:`CudaStateError.refused_by_cuda`).

torch 2.8 and later (pytorch/pytorch#151404) check ``elapsed_time``'s events before CUDA sees them:
an event made without timing or never recorded is a ``ValueError``, one not completed a
``RuntimeError`` (``Both events must be completed before calculating elapsed time.``). That is what
the runtime raises, whatever the torch: torch 2.13's ``c10/cuda/CUDAEvent.h`` has the checks, and
tests/test_sim_conformance.py compares a GPU's own events with them where there is one. Before them the last reached ``cudaEventElapsedTime``, whose ``cudaErrorNotReady`` torch raised as
``CUDA error: device not ready``.

Example::

    try:
        rt.elapsed_time(start, end)     # end still queued
    except RuntimeError as error:
        error.call, error.state         # 'elapsed_time', 'an end event that had not completed'
"""

from __future__ import annotations

__all__ = ["NOT_COMPLETED", "NOT_RECORDED", "NO_TIMING", "CudaStateError", "CudaStateRuntimeError", "CudaStateValueError",
           "events_in_state"]

# What was wrong, for code that acts on it (``CudaStateError.reason``); ``state`` says it in words.
NO_TIMING = "no timing"  # an event made without enable_timing=True
NOT_RECORDED = "not recorded"  # an event never recorded
NOT_COMPLETED = "not completed"  # an event whose recorded work had not run


class CudaStateError(Exception):
    """A call CUDA (torch) refuses for the state its arguments are in; raised as torch raises it.

    ``call`` is the call as the code spells it (``elapsed_time``), ``state`` what was wrong, in the
    words a finding uses (``an end event that had not completed``), ``reason`` the same as one of
    :data:`NO_TIMING`, :data:`NOT_RECORDED`, :data:`NOT_COMPLETED` (None: another)."""

    # kvdevice.origin: raised by the runtime on behalf of whoever called it (the code under test's
    # own call into torch.cuda is the code's error, the harness's own call is the harness's).
    refused_by_cuda = True

    def __init__(self, message: str, *, call: str, state: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.call = call
        self.state = state
        self.reason = reason

    @property
    def torch_type(self) -> str:
        """The type torch raises it as (``RuntimeError``, ``ValueError``)."""
        return next(base.__name__ for base in type(self).__mro__ if base.__module__ == "builtins")


class CudaStateValueError(CudaStateError, ValueError):
    """Refused by torch's argument checks (``TORCH_CHECK_VALUE``)."""


class CudaStateRuntimeError(CudaStateError, RuntimeError):
    """Refused by torch's state checks (``TORCH_CHECK``), or CUDA's own error."""


def events_in_state(start_wrong: bool, end_wrong: bool, one: str, both: str) -> str:
    """elapsed_time's wrong events and their state: ``an end event that had not completed``,
    ``a start event ...``, or ``start and end events ...`` (``one``/``both``: the state's words
    after a singular or a plural)."""
    if start_wrong and end_wrong:
        return f"start and end events {both}"
    return f"{'a start' if start_wrong else 'an end'} event {one}"
