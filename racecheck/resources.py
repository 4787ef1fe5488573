"""GPU memory is a resource, never a verdict (issue 17).

Twenty workers of campaigns on a 5 GiB cache (``int32_wrap``) ran a 139 GiB H200 out of memory;
each ``torch.cuda.OutOfMemoryError`` then read as "the zeroer raised" or as a broken harness. Here
an out-of-memory error, wherever it is raised (the harness building a cache, the zeroer
allocating, a queued copy), becomes :class:`ResourceExhausted`: the campaign stops at once, with
no trace written and nothing judged, and is reported as a resource error (exit status 2: run
fewer workers), never as a finding and never as clean.

A GPU fault is the other resource a campaign can lose (:class:`DeviceFault`). When a kernel makes
an illegal access (on the H200, a racy engine-style zeroer whose forced schedule ran its kernel
before the copy of its block ids: the kernel read uninitialised device memory as ids), CUDA keeps
the error for the rest of the process: every later CUDA call fails with it. Wherever it surfaces
(a harness's poll, the zeroer's next call, the oracle's read), it is not a verdict and not a bug of
the harness's code: the campaign stops with a resource error that says so, and every later
campaign of the same process stops at once with the same error instead of failing somewhere
unrelated (:func:`raise_if_gpu_lost`). Benchmarks run each cuda job in a process of its own.

Example::

    try:
        ...
    except Exception as error:
        raise_if_out_of_memory(error)
        raise
"""

from __future__ import annotations

from collections.abc import Callable


class ResourceExhausted(BaseException):
    """The GPU ran out of memory. A BaseException, like an interruption: Hypothesis lets it
    through at once instead of shrinking it as a failure, and ``except Exception`` in a
    zeroer or a library does not swallow it."""


class DeviceFault(ResourceExhausted):
    """The GPU faulted (an illegal address, a launch failure): CUDA keeps the error for the rest of
    the process, so nothing more can run on the GPU here. A resource error, like running out of
    memory: no verdict either way."""


_FAULT_TEXT = ("illegal memory access", "cudaErrorIllegalAddress", "CUDA_ERROR_ILLEGAL_ADDRESS",
               "unspecified launch failure", "misaligned address", "illegal instruction",
               "device-side assert triggered", "an illegal instruction")
_LOST: list[str] = []  # the first fault this process saw: its CUDA context is unusable since

_OOM_TEXT = ("out of memory", "CUDA_ERROR_OUT_OF_MEMORY", "cudaErrorMemoryAllocation")


def is_out_of_memory(error: BaseException) -> bool:
    """Is ``error`` (or an error it was raised from) the GPU running out of memory (or already
    the :class:`ResourceExhausted` that says so)?"""
    import torch  # here, not at import: commands that only catch ResourceExhausted need no torch (racecheck.cli)

    return _in_chain(error, lambda e: isinstance(e, (ResourceExhausted, torch.cuda.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and any(text in str(e) for text in _OOM_TEXT)))


def _in_chain(error: BaseException | None, test: Callable[[BaseException], bool]) -> bool:
    """Whether ``test`` holds for ``error`` or one of the first errors it was raised from."""
    seen = 0
    while error is not None and seen < 8:
        if test(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def out_of_memory_message(error: BaseException, where: str = "") -> str:
    """One line for an out-of-memory ``error``: a resource error, and what to run fewer of.

    torch's allocators raise ``torch.cuda.OutOfMemoryError`` ("Tried to allocate ..."). The bare
    "CUDA error: out of memory" comes from CUDA itself: a context, a stream, a pinned allocation.
    On an H200 with 139 GiB free it came from hardware queues, not bytes: of 40 processes started
    at once, each asking for 32 queues (``CUDA_DEVICE_MAX_CONNECTIONS=32``, as gated streams do)
    and making 8 streams, 6 ran and 34 got that error. Fewer CUDA processes at once is the fix.
    """
    import torch

    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    place = f" {where}" if where else ""
    bare = "CUDA error: out of memory" in str(error) and not isinstance(error, torch.cuda.OutOfMemoryError)
    what = ("the GPU refused a context, stream or pinned allocation" if bare else "the GPU ran out of memory")
    why = (": its memory or its hardware queues are used up (each CUDA process holds up to 32 queues), "
           "even with memory free" if bare else "")
    return (f"{what}{place} ({first_line}){why}; this is a resource error, not a finding: run fewer CUDA "
            f"processes at once (pytest -n, python -m fuzz.bench.detect -j) or free GPU memory")


def raise_if_out_of_memory(error: BaseException, where: str = "") -> None:
    """Raise :class:`ResourceExhausted` from ``error`` when it is an out-of-memory error."""
    if is_out_of_memory(error):
        raise ResourceExhausted(out_of_memory_message(error, where)) from error


def is_device_fault(error: BaseException) -> bool:
    """Is ``error`` (or an error it was raised from) a sticky CUDA fault (or the :class:`DeviceFault`
    that says so)?"""
    return _in_chain(error, lambda e: isinstance(e, DeviceFault) or any(text in str(e) for text in _FAULT_TEXT))


def raise_if_device_fault(error: BaseException, where: str = "") -> None:
    """Raise :class:`DeviceFault` from ``error`` when it is a CUDA fault; remember that this
    process's GPU is lost."""
    if isinstance(error, DeviceFault):
        raise error
    if is_device_fault(error):
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        place = f" {where}" if where else ""
        if not _LOST:
            _LOST.append(f"{first_line}{place}")
        raise DeviceFault(
            f"the GPU faulted{place} ({first_line}); CUDA keeps that error, so this process can run nothing "
            f"more on the GPU and the campaign has no verdict. A zeroer's kernel that faults under the fuzzer's "
            f"schedule has usually read ids a race left unwritten: fuzz the same zeroer on the simulator "
            f"(--backend sim), which checks every address a kernel touches"
        ) from error


def raise_if_resource(error: BaseException, where: str = "") -> None:
    """:func:`raise_if_out_of_memory`, then :func:`raise_if_device_fault`."""
    raise_if_out_of_memory(error, where)
    raise_if_device_fault(error, where)


def raise_if_gpu_lost() -> None:
    """Raise :class:`DeviceFault` when an earlier fault of this process left its GPU unusable."""
    if _LOST:
        raise DeviceFault(
            f"this process's GPU was lost to an earlier fault ({_LOST[0]}); CUDA keeps that error, so the "
            f"campaign did not run: rerun it (each pytest-xdist worker and each benchmark job has its own GPU context)"
        )
