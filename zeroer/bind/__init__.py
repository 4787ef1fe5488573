"""Plain torch zeroers under full control: their torch, Triton and ``torch.cuda`` calls, intercepted.

vLLM's ``KVBlockZeroer`` is plain torch and Triton: pinned tensors written through a numpy view,
non-blocking copies, a Triton ``kernel[grid](...)`` launch writing through raw addresses, torch.cuda
streams and events. A zeroer whose factory declares nothing (``Capabilities(api="torch")``, the
default) is bound here: while its constructor, ``warmup``, ``zero_block_ids`` and ``close`` run,
all of that is routed to the harness's runtime (:mod:`kvdevice.intercept.session` says how), so it
gets what a runtime-API zeroer gets: the simulator on CPU, forced schedules in the controlled
cuda mode, the happens-before checker, shrinking and replay.

Which mechanism covers which call is :mod:`kvdevice.intercept`'s (docs/fuzz-your-zeroer.md has the
table); what is the zeroer's here is its binding: its calls run in its session, its factory gets
the KV cache as its code sees it (:mod:`.cache_view`) and no runtime.

Several zeroers may share one runtime (one per KV cache, the ``x2`` campaigns): each has its own
session, and what names their streams, buffers and blocks is the runtime's
(:mod:`kvdevice.intercept.shared`).

Example::

    loaded = load_zeroer("examples/torch_zeroers.py:single_pinned_buffer")   # zeroer.registry
    zeroer = loaded.build(cache, runtime)        # calls bind(): an InterceptedZeroer
    with runtime.use_stream(stream):
        zeroer.zero_block_ids([3, 4])            # queued on the simulated stream
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence
from unittest import mock

import torch

from zeroer.cache.layout import KVCache
from kvdevice.intercept.errors import InterceptError, unroutable
from kvdevice.origin import documented
from zeroer.protocol import BoundZeroer
from kvdevice.runtime import Runtime

documented(KVCache)  # what a factory gets on CUDA: an attribute it lacks is the user's to fix

WARMUP_SIZES = range(1, 9)  # the controlled mode compiles every id count the fuzzer draws, ungated


class _RuntimeRefused:
    """What a plain torch zeroer's or an offloader's factory gets as ``runtime``: it must not need one."""

    def __init__(self, spec: str, role: str = "zeroer") -> None:
        self._spec, self._role = spec, role

    def __getattr__(self, name: str) -> Any:
        if self._role != "zeroer":  # an offloader is plain torch and Triton only (docs/offload-contract.md)
            raise InterceptError(f"{self._role} {self._spec!r} uses runtime.{name}, but an {self._role} is plain torch "
                                 f"and Triton, run under interception: its factory's runtime argument is a placeholder; "
                                 f"queue the work with torch streams, copies and kernels")
        raise InterceptError(
            f"zeroer {self._spec!r} is loaded as a plain torch zeroer (its factory declares no "
            f"Capabilities(api='runtime')), but it uses runtime.{name}; a zeroer written against "
            f"kvdevice.runtime declares capabilities = Capabilities(api='runtime') on its factory"
        )

    def __repr__(self) -> str:
        return f"<no runtime: this {self._role} is intercepted>"


class InterceptedZeroer(BoundZeroer):
    """A plain torch zeroer whose every call runs inside its :class:`InterceptSession`."""

    __slots__ = ("session", "_calls_left")

    def __init__(self, zeroer: object, spec: str, capabilities: Any, session: Any) -> None:
        super().__init__(zeroer, spec, capabilities)
        self.session = session
        call = self.zero_block_ids

        def zero_block_ids(block_ids: Sequence[int] | None) -> None:
            with session.running("zero_block_ids", _ids_of(block_ids)):
                call(block_ids)

        self.zero_block_ids = zero_block_ids

    def warmup(self, num_blocks: int) -> None:
        with self.session.running("warmup"):
            super().warmup(num_blocks)
        if self.session.backend == "cuda" and self.session.rt.scheduled:
            # Every kernel variant the fuzzer's calls can need, compiled now, while nothing is gated:
            # a first launch loads a module, which waits for the GPU to drain (kvdevice.runtime.cuda).
            for n in WARMUP_SIZES:
                self.zero_block_ids([0] * n)  # duplicates are harmless (contract 5): block 0 only

    def close(self) -> None:
        try:
            with self.session.running("close"):
                super().close()
        finally:
            self.session.close_helpers()  # a helper thread still waiting ends with its zeroer


def _ids_of(block_ids: Any) -> list[int]:
    """The ids of a call as plain ints, for labels only (the zeroer checks its own input)."""
    if block_ids is None:
        return []
    try:
        if isinstance(block_ids, torch.Tensor):
            return [int(i) for i in block_ids.reshape(-1).tolist()] if block_ids.device.type == "cpu" else []
        return [int(i) for i in block_ids]
    except (TypeError, ValueError):
        return []


def bind(loaded: Any, cache: KVCache, runtime: Runtime, **options: Any) -> InterceptedZeroer:
    """Build ``loaded``'s zeroer for ``cache`` on ``runtime`` under interception."""
    from kvdevice.intercept.session import InterceptSession
    from kvdevice.intercept.unroutable import check_no_gpu_packages

    if runtime.scheduled:
        check_no_gpu_packages(loaded.spec, runtime.backend)
    session = InterceptSession(runtime, loaded.spec)
    seen = cache_as_seen(cache, session)
    with session.running("__init__"):
        zeroer = loaded.factory(seen, _RuntimeRefused(loaded.spec), **options)
    return InterceptedZeroer(zeroer, loaded.spec, loaded.capabilities, session)


def cache_as_seen(cache: KVCache, session: Any) -> Any:
    """The KV cache as the session's code is handed it: a view of simulated CUDA tensors over the
    same memory on the simulator, the cache itself on CUDA (whose storages the session then knows)."""
    if session.backend == "sim":
        from zeroer.bind.cache_view import SimCacheView

        return SimCacheView(cache, session)
    session.cuda_ops.note_cache([raw.untyped_storage().data_ptr() for raw in cache.raws])
    return cache


def import_scope() -> contextlib.AbstractContextManager:
    """Import a zeroer's module as its code will run: on a machine without a GPU,
    ``torch.cuda.is_available()`` says True (vLLM decides ``PIN_MEMORY`` with it at import)."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return mock.patch.object(torch.cuda, "is_available", lambda: True)


__all__ = ["InterceptError", "InterceptedZeroer", "bind", "import_scope", "unroutable"]
