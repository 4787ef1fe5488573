"""The host pool an offloader stores KV blocks into: pinned, or registered with ``cudaHostRegister``.

An engine's CPU KV cache mirrors its device cache slot for block: vLLM's CPU offload handler
allocates pinned tensors shaped like the device KV tensors with ``num_cpu_blocks`` rows, SGLang's
``HostKVCache`` registers one large host buffer with ``cudaHostRegister``. The harness owns the
pool (as it owns the device cache), so the oracle can read what a store left in a slot and the
happens-before checker sees the slots as pinned memory. The pool is a guarded
:class:`~zeroer.cache.layout.KVCache` of the device cache's geometry with one *slot* per block:
``pool.layer_tensors`` holds one host tensor per layer, shaped like the device layer's, and a
slot's pages are poisoned until a store fills them.

``memory`` chooses how the pool is made host-visible to the device:

* ``"pinned"``: page-locked at allocation (``pin_memory()``, vLLM's CPU offload);
* ``"registered"``: ordinary memory registered afterwards with ``cudaHostRegister`` (SGLang's
  host pool), unregistered by :meth:`HostPool.release`.

On a machine without CUDA the pool is plain host memory either way; the simulator treats it as
pinned (the offloader's session registers it, :mod:`zeroer.bind.offload`).

Example::

    pool = build_host_pool(geometry("tiny"), memory="registered")
    pool.cache.layer_tensors["model.layers.0.self_attn.attn"].shape     # (2, 8, 4, 2, 4), on the host
    pool.release()
"""

from __future__ import annotations

import dataclasses

import torch

from zeroer.cache.layout import CacheSpec, KVCache
from zeroer.errors import CacheSpecError

HOST_MEMORY = ("pinned", "registered")


class HostPool:
    """A host KV pool: ``cache`` (a :class:`KVCache` on the host, one slot per block) and how its
    memory was made visible to the device (``memory``)."""

    def __init__(self, cache: KVCache, memory: str, registered: list[int]) -> None:
        self.cache = cache
        self.memory = memory
        self._registered = registered  # addresses this pool registered with CUDA, to unregister

    @property
    def num_slots(self) -> int:
        return self.cache.spec.num_blocks

    def origin(self) -> str:
        """How the pool's memory was made, as a report names it."""
        return "cudaHostRegister" if self.memory == "registered" else "torch.empty(pin_memory=True)"

    def release(self) -> None:
        """Unregister registered memory (the pool's buffers must not outlive their registration)."""
        if self._registered:
            cudart = torch.cuda.cudart()
            for address in self._registered:
                cudart.cudaHostUnregister(address)
            self._registered = []


def build_host_pool(spec: CacheSpec, memory: str = "pinned", num_slots: int | None = None) -> HostPool:
    """A host pool for a device cache of ``spec``: ``num_slots`` slots (the cache's block count by default)."""
    if memory not in HOST_MEMORY:
        raise CacheSpecError(f"host pool memory={memory!r}; choose one of {', '.join(HOST_MEMORY)}")
    slots = spec.num_blocks if num_slots is None else num_slots
    pool_spec = dataclasses.replace(spec, num_blocks=slots, name=f"{spec.name or 'cache'} host pool")
    on_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    cache = KVCache(pool_spec, device="cpu", pin_memory=on_cuda and memory == "pinned")
    registered: list[int] = []
    if on_cuda and memory == "registered":
        cudart = torch.cuda.cudart()
        for raw in cache.raws:
            nbytes = raw.numel() * raw.element_size()
            status = cudart.cudaHostRegister(raw.data_ptr(), nbytes, 0)
            if int(getattr(status, "value", status)) != 0:
                for address in registered:
                    cudart.cudaHostUnregister(address)
                raise RuntimeError(f"cudaHostRegister of the host pool ({nbytes} bytes) failed: status {status}")
            registered.append(raw.data_ptr())
    return HostPool(cache, memory, registered)
