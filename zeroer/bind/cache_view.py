"""The KV cache as an intercepted zeroer sees it on the simulator: the same object, CUDA tensors.

A zeroer's factory gets the cache it must zero (``factory(cache, runtime)``). On CUDA that is the
harness's :class:`~zeroer.cache.layout.KVCache` itself. On the simulator its buffers are CPU
tensors, so the factory gets a :class:`SimCacheView` instead: the same attributes (``spec``,
``layer_tensors``, ``raws``, ``table``, ``segments``, ``device``, ``pages(seg)``,
``block_words(b)``, ``num_kernel_blocks``), with every tensor a simulated CUDA tensor over the very
same memory. ``kv.data_ptr()`` of a layer tensor is the real address of the cache's bytes, so an
address table the zeroer builds from it (as vLLM's constructor does) points into the cache the
oracle checks. Read through to the harness's cache on every access, so a reallocated cache (the
fuzzer's ``reallocate`` op) is seen by a zeroer that reads it again.

Example::

    view = SimCacheView(cache, session)
    kv = view.layer_tensors["model.layers.0.self_attn.attn"]
    kv.is_cuda, kv.data_ptr() == cache.layer_tensors["model.layers.0.self_attn.attn"].data_ptr()   # True, True
"""

from __future__ import annotations

from typing import Any

import torch

from zeroer.cache.layout import KVCache, SegmentTable
from kvdevice.intercept.sim_memory import SIM_DEVICE, Allocation
from kvdevice.intercept.sim_tensor import SimCudaTensor
from kvdevice.origin import documented


@documented
class SimCacheView:
    """See the module docstring."""

    def __init__(self, cache: KVCache, session: Any) -> None:
        self._cache = cache
        self._session = session
        self._adopted: dict[int, Allocation] = {}  # storage data_ptr -> its block
        self._tables: dict[int, SegmentTable] = {}

    # -- what stays the same ---------------------------------------------------------------------
    @property
    def spec(self) -> Any:
        return self._cache.spec

    @property
    def segments(self) -> Any:
        return self._cache.segments

    @property
    def num_kernel_blocks(self) -> int:
        return self._cache.num_kernel_blocks

    @property
    def device(self) -> torch.device:
        return SIM_DEVICE

    # -- tensors, as CUDA tensors ----------------------------------------------------------------
    def _allocation(self, tensor: torch.Tensor, name: str, cache_tensor: int | None) -> Allocation:
        key = tensor.untyped_storage().data_ptr()
        allocation = self._adopted.get(key)
        if allocation is None:
            allocation = self._adopted[key] = self._session.memory.adopt(tensor, name, cache_tensor)
        return allocation

    def _wrap(self, tensor: torch.Tensor, t: int) -> SimCudaTensor:
        layers = ", ".join(self._cache.spec.tensors[t].layers)
        allocation = self._allocation(self._cache.raws[t], f"KV cache tensor {t} ({layers})", t)
        return SimCudaTensor(tensor, allocation, self._session)

    @property
    def raws(self) -> list[SimCudaTensor]:
        return [self._wrap(raw, t) for t, raw in enumerate(self._cache.raws)]

    @property
    def layer_tensors(self) -> dict[str, SimCudaTensor]:
        owner = {layer: t for t, spec in enumerate(self._cache.spec.tensors) for layer in spec.layers}
        return {layer: self._wrap(view, owner[layer]) for layer, view in self._cache.layer_tensors.items()}

    def pages(self, seg: int) -> SimCudaTensor:
        return self._wrap(self._cache.pages(seg), self._cache.segments[seg].tensor_index)

    def block_words(self, block: int) -> list[SimCudaTensor]:
        return [self.pages(s)[block] for s in range(len(self._cache.segments))]

    @property
    def table(self) -> SegmentTable:
        """The segment address table, on the (simulated) device like the cache."""
        table = self._cache.table
        wrapped = self._tables.get(id(table))
        if wrapped is None:
            # the cache becomes device memory: the table's addresses point into it, and a kernel follows them
            for t, raw in enumerate(self._cache.raws):
                self._wrap(raw, t)
            def on_device(column: torch.Tensor, name: str) -> SimCudaTensor:
                return SimCudaTensor(column, self._allocation(column, f"segment table {name}", None), self._session)

            wrapped = SegmentTable(on_device(table.addrs, "addrs"), on_device(table.block_strides, "block strides"),
                                   on_device(table.pages, "pages"), table.n_segs, table.max_page)
            self._tables = {id(table): wrapped}  # the newest table only: a reallocated cache has a new one
        return wrapped

    def __repr__(self) -> str:
        return f"SimCacheView({self._cache.spec.name or 'cache'}: {self._cache.spec.num_blocks} blocks, device cuda:0 (simulated))"
