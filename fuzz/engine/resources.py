"""GPU memory is a resource, never a verdict (issue 17).

Twenty workers of campaigns on a 5 GiB cache (``int32_wrap``) ran a 139 GiB H200 out of memory;
each ``torch.cuda.OutOfMemoryError`` then read as "the zeroer raised" or as a broken harness. Here
an out-of-memory error, wherever it is raised (the harness building a cache, the zeroer
allocating, a queued copy), becomes :class:`ResourceExhausted`: the campaign stops at once, with
no trace written and nothing judged, and is reported as a resource error (exit status 2: run
fewer workers), never as a finding and never as clean.

Example::

    try:
        ...
    except Exception as error:
        raise_if_out_of_memory(error)
        raise
"""

from __future__ import annotations


class ResourceExhausted(BaseException):
    """The GPU ran out of memory. A BaseException, like an interruption: Hypothesis lets it
    through at once instead of shrinking it as a failure, and ``except Exception`` in a
    zeroer or a library does not swallow it."""


_OOM_TEXT = ("out of memory", "CUDA_ERROR_OUT_OF_MEMORY", "cudaErrorMemoryAllocation")


def is_out_of_memory(error: BaseException) -> bool:
    """Is ``error`` (or an error it was raised from) the GPU running out of memory (or already
    the :class:`ResourceExhausted` that says so)?"""
    import torch  # here, not at import: commands that only catch ResourceExhausted need no torch (fuzz.cli)

    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, (ResourceExhausted, torch.cuda.OutOfMemoryError)):
            return True
        if isinstance(error, RuntimeError) and any(text in str(error) for text in _OOM_TEXT):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def raise_if_out_of_memory(error: BaseException, where: str = "") -> None:
    """Raise :class:`ResourceExhausted` from ``error`` when it is an out-of-memory error."""
    if is_out_of_memory(error):
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ResourceExhausted(
            f"the GPU ran out of memory{' ' + where if where else ''} ({first_line}); this is a resource "
            f"error, not a finding: run fewer workers (pytest -n, python -m fuzz.bench.detect -j) or free GPU memory"
        ) from error
