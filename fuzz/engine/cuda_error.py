"""A CUDA error met by the code under test's own call: a finding of its own kind, ``cuda error``.

CUDA refuses some calls for the state their arguments are in, and the state is often the race made
visible. vLLM's offloading handler times each job with ``start.elapsed_time(end)`` as it reports
it; a handler that reports a job without asking its end event gets CUDA's refusal, on a GPU as on
the simulator: it reported a transfer before the transfer finished. That error is the code's
(:mod:`kvdevice.origin` says whose an exception is: the runtime raises it on behalf of the code's own
call), and the finding names the call, the state and, where the code under test's kind knows it,
what the state means (``elapsed_time on an end event that had not completed: the job was reported
before its copy finished``). A CUDA error raised in the harness's own code stays a harness error.

Which errors: what the runtime raises for a refused call
(:class:`kvdevice.runtime.cuda_errors.CudaStateError`, which says the call and the state), and any
other CUDA error the code's own call met (``torch.AcceleratorError``, or torch's ``CUDA error: ...``
text: a capture that forbids a synchronisation, say), named by CUDA's words. A sticky fault (an illegal address) or running out
of memory is not one: those are resource errors with no verdict (:mod:`racecheck.resources`).

Standard library only: signatures and reports read the kind without torch.

Example::

    refusal = cuda_refusal(error)          # 'elapsed_time on an end event that had not completed', or None
    cuda_error_message(4, "the offloader's get_finished()", "examples/engine_offloaders.py:361", refusal,
                       "the job was reported before its copy finished", error)
"""

from __future__ import annotations

__all__ = ["CUDA_ERROR", "cuda_error_message", "cuda_refusal"]

CUDA_ERROR = "cuda error"  # the finding's kind
CUDA_TEXT = "CUDA error:"  # how torch words an error CUDA returned (C10_CUDA_CHECK)
UNNAMED_STATE = "CUDA refused the call"  # a CUDA error whose state the harness cannot name


def cuda_refusal(error: BaseException) -> str | None:
    """The call and the state CUDA refused it in (``elapsed_time on an end event that had not
    completed``), :data:`UNNAMED_STATE` for another CUDA error, or None when ``error`` is not one."""
    call, state = getattr(error, "call", None), getattr(error, "state", None)
    if getattr(error, "refused_by_cuda", False) and call and state:
        return f"{call} on {state}"
    if type(error).__name__ == "AcceleratorError" or str(error).startswith(CUDA_TEXT):
        return UNNAMED_STATE
    return None


def torch_words(error: BaseException) -> str:
    """``RuntimeError: Both events must be completed ...``: the type torch raises it as and the
    first line of its text (torch appends advice on CUDA_LAUNCH_BLOCKING on further lines)."""
    kind = getattr(error, "torch_type", None) or type(error).__name__
    lines = str(error).strip().splitlines()
    return f"{kind}: {lines[0]}" if lines else kind


def cuda_error_message(step: int, call: str, where: str | None, refusal: str, meaning: str | None,
                       error: BaseException) -> str:
    """``cuda error at step 4 in the offloader's get_finished() at file.py:363: elapsed_time on an
    end event that had not completed: the job was reported before its copy finished
    (RuntimeError: ...)``. ``where`` is the code's ``file:line (code)`` (kvdevice.origin), of which
    the line is kept."""
    at = f" at {where.split(' (', 1)[0]}" if where else ""
    said = f": {meaning}" if meaning else ""
    return f"{CUDA_ERROR} at step {step} in {call}{at}: {refusal}{said} ({torch_words(error)})"
