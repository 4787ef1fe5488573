"""A stand-in for the CUDA driver's contexts and copy entry points, on a CPU.

A driver call acts in the context current on the calling thread, and a thread torch has not
touched has none: the real ``cuMemcpyBatchAsync`` then answers ``CUDA_ERROR_NOT_INITIALIZED`` (3),
as vLLM's copy thread got under the fuzzer on an H100 (issue 53). :class:`FakeContexts` keeps a
context stack per thread (:class:`kvdevice.intercept.driver_context.ContextApi`); :func:`real_batch`
and :func:`real_memcpy` are C function pointers that refuse without a current context and
otherwise move host bytes (the stand-in's "device" memory is host memory).

Example::

    contexts = FakeContexts()
    with use_api(contexts):
        batch = real_batch(contexts)        # answers 3 on a thread with no context current
"""

from __future__ import annotations

import ctypes
import threading

from kvdevice.intercept.driver_copies import (BATCH_TYPE, CUDA_ERROR_NOT_INITIALIZED, MEMCPY_TYPE, batch_runs)

PRIMARY = 0xC0DE  # the device's primary context


class FakeContexts:
    def __init__(self) -> None:
        self._local = threading.local()
        self.calls: list[tuple[str, int]] = []  # (entry point, the context it ran in)

    def _stack(self) -> list[int]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current(self) -> int:
        stack = self._stack()
        return stack[-1] if stack else 0

    def of_stream(self, stream: int) -> int:
        return PRIMARY if stream else 0

    def primary(self, device: int) -> int:
        return PRIMARY

    def push(self, ctx: int) -> None:
        self._stack().append(ctx)

    def pop(self) -> None:
        self._stack().pop()

    def set_device(self) -> None:
        """What torch's ``cudaSetDevice`` does on a thread: the primary context made current."""
        self._stack()[:] = [PRIMARY]


def real_batch(contexts: FakeContexts) -> object:
    def call(dsts, srcs, sizes, count, attrs, idxs, num_attrs, fail_idx, stream) -> int:
        if not contexts.current():
            return CUDA_ERROR_NOT_INITIALIZED
        contexts.calls.append(("cuMemcpyBatchAsync", contexts.current()))
        for dst, src, n, _ in batch_runs(dsts, srcs, sizes, count, attrs, idxs, num_attrs) or []:
            ctypes.memmove(dst, src, n)
        return 0

    return BATCH_TYPE(call)


def real_memcpy(contexts: FakeContexts) -> object:
    def call(dst, src, n, stream) -> int:
        if not contexts.current():
            return CUDA_ERROR_NOT_INITIALIZED
        contexts.calls.append(("cuMemcpyAsync", contexts.current()))
        ctypes.memmove(dst, src, n)
        return 0

    return MEMCPY_TYPE(call)
