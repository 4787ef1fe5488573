"""Plain torch offloaders under interception: every call routed to the runtime, the host pool watched.

An offloader (:mod:`zeroer.offload.protocol`) is bound as a plain torch zeroer is
(:func:`zeroer.bind.bind`): one :class:`~kvdevice.intercept.session.InterceptSession` whose
scope every call runs in (its constructor, ``warmup``, each ``store``, ``load``, ``evict`` and
``get_finished``, ``close``). Two things differ:

* the host pool the harness hands over is pinned memory of the session (registered at bind, named
  as the pool), so the offloader's non-blocking copies into and out of it are queued copies whose
  bytes and order are checked, and the harness's own host accesses to a slot are judged against them;
* the session maps the KV-cache bytes each op touches to logical blocks
  (:class:`~zeroer.cache.block_map.CacheBlockMap`), the keys the caller's own block accesses are
  declared under, so an offloader's copy of block 3 and the caller's write of block 3 meet in the
  happens-before checker.

Example::

    loaded = load_offloader("examples/engine_offloaders.py:store_after_compute_event")   # zeroer.registry
    offloader = bind_offloader(loaded, cache, pool, runtime)
    with runtime.use_stream(stream):
        offloader.store(2, [3], [1])              # queued on the simulated streams
    offloader.get_finished()                      # [] until the copy has run
"""

from __future__ import annotations

from typing import Any

import torch

from zeroer.cache.block_map import CacheBlockMap
from zeroer.cache.layout import KVCache
from kvdevice.intercept.host_memory import CachingHostMemory
from kvdevice.intercept.session import InterceptSession
from zeroer.offload.host_pool import HostPool
from zeroer.offload.protocol import BoundOffloader
from kvdevice.runtime import Runtime


class InterceptedOffloader(BoundOffloader):
    """A plain torch offloader whose every call runs inside its session."""

    def __init__(self, offloader: object, spec: str, capabilities: Any, session: Any, pool: HostPool) -> None:
        super().__init__(offloader, spec, capabilities)
        self.session = session
        self.pool = pool
        store, load = self.store, self.load

        def store_in_session(job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
            with session.running("store", block_ids):
                store(job_id, block_ids, slot_ids)

        def load_in_session(job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
            with session.running("load", block_ids):
                load(job_id, slot_ids, block_ids)

        self.store = store_in_session
        self.load = load_in_session

    def get_finished(self) -> list[tuple[int, bool]]:
        with self.session.running("get_finished"):
            return super().get_finished()

    def wait(self, job_ids: set[int]) -> None:
        with self.session.running("wait"):
            super().wait(job_ids)

    def evict(self, slot_ids: list[int]) -> bool:
        with self.session.running("evict"):
            return super().evict(slot_ids)

    def warmup(self) -> None:
        with self.session.running("warmup"):
            super().warmup()

    def close(self) -> None:
        try:
            with self.session.running("close"):
                super().close()
        finally:
            self.session.close_helpers()  # a helper thread still waiting ends with its offloader

    # -- the caller's host accesses to the pool -------------------------------------------------------
    def host_access(self, view: torch.Tensor, label: str, *, write: bool) -> None:
        """The caller reads or writes ``view`` of the pool on the host now (checked against the
        offloader's pending copies of those bytes)."""
        host = self.session.host
        host.check(f"the host, before {label}")
        region = host.lookup(view)
        if region is not None:
            (host.host_write if write else host.host_read)(region, view, label)


class OffloaderSession(InterceptSession):
    """An offloader's session: named as the offloader (``the offloader``, stream ``offloader-1``).
    On the simulator its pinned memory comes from the model of torch's caching host allocator: a
    block handed out again is a host write of it, checked against the copies and kernels still
    pending on its last tenant (LMCache #4830: a ``pin_memory()`` temporary dropped on return)."""

    role = "offloader"

    def __init__(self, runtime: Runtime, spec: Any) -> None:
        if runtime.backend == "sim":
            self.host_memory_class = CachingHostMemory
        super().__init__(runtime, spec)
        self.host.on_reuse = self._pinned_reused

    def _pinned_reused(self, tensor: torch.Tensor, origin: str) -> None:
        region = self.host.lookup(tensor)
        if region is not None:
            self.host.host_write(region, tensor, f"pinned memory handed out again by torch's caching host "
                                                 f"allocator ({origin}) in {self.call}")


def bind_offloader(loaded: Any, cache: KVCache, pool: HostPool, runtime: Runtime) -> InterceptedOffloader:
    """Build ``loaded``'s offloader for ``cache`` and ``pool`` on ``runtime`` under interception."""
    from zeroer.bind import _RuntimeRefused, cache_as_seen
    from kvdevice.intercept.unroutable import check_no_gpu_packages

    if runtime.scheduled:
        check_no_gpu_packages(loaded.spec, runtime.backend, "offloader")
    session = OffloaderSession(runtime, loaded.spec)
    session.block_map = CacheBlockMap(cache)
    for raw in pool.cache.raws:
        session.host.register(raw, origin=f"the harness's host KV pool, {pool.origin()}")
    seen = cache_as_seen(cache, session)
    with session.running("__init__"):
        offloader = loaded.factory(seen, pool.cache, _RuntimeRefused(loaded.spec, "offloader"))
    return InterceptedOffloader(offloader, loaded.spec, loaded.capabilities, session, pool)
