"""Unprotected pinned memory for the cuda backend: arenas outside PyTorch's caching host allocator.

Protected host buffers are ``torch.empty(pin_memory=True)``: PyTorch's caching host allocator
records an event behind every non-blocking copy of a block and hands it out again only after it
(pytorch/pytorch#130785). Unprotected ones model pinned memory outside that allocator
(``cudaHostRegister``, ``from_blob``): :class:`PinnedArena` carves them from pinned arenas that are
never freed while the runtime lives, and reuses a freed slot at once, as the simulator does.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvdevice.runtime.host_memory import size_class

ARENA_BYTES = 1 << 22  # unprotected pinned memory is carved from 4 MiB arenas
ARENA_ALIGN = 64  # every arena slot starts on 64 bytes, enough for any dtype's view


class PinnedArena:
    """Pinned memory outside PyTorch's caching host allocator, with immediate reuse.

    Slots come in power-of-two byte sizes (the simulator's size classes, :func:`size_class`) and
    are carved from arenas that are never freed while the runtime lives; a freed slot goes on its
    size's free list and the next allocation of that size takes the newest one at once. Copies
    still reading it are not waited for: that is the ``cudaHostRegister`` / ``from_blob`` hazard,
    and the happens-before checker sees the reuse because the block id is the slot id.

    Example (``pin_memory=False`` runs anywhere)::

        ids = itertools.count(1)
        arena = PinnedArena(lambda: next(ids), pin_memory=False)
        a, _ = arena.alloc(4, torch.int64)
        arena.free(a)
        assert arena.alloc(3, torch.int64)[0] == a     # same 32-byte class, reused at once
    """

    def __init__(self, next_id: Callable[[], int], arena_bytes: int = ARENA_BYTES, *, pin_memory: bool = True) -> None:
        self._next_id = next_id
        self.arena_bytes = arena_bytes
        self.pin_memory = pin_memory
        self.arenas: list[torch.Tensor] = []
        self._top = 0  # bytes carved from the newest arena
        self._slots: dict[int, torch.Tensor] = {}  # slot id -> its bytes
        self._free: dict[int, list[int]] = {}  # size class -> free slot ids, newest last
        self.reused = 0

    def grow(self, size: int = 0) -> None:
        """Start a new arena of at least ``size`` bytes (the runtime makes the first one up front:
        a pinned allocation while gates spin might wait for the GPU)."""
        nbytes = max(self.arena_bytes, size)
        self.arenas.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory))
        self._top = 0

    def _carve(self, size: int) -> int:
        offset = -(-self._top // ARENA_ALIGN) * ARENA_ALIGN
        if not self.arenas or offset + size > self.arenas[-1].numel():
            self.grow(size)
            offset = 0
        slot = self._next_id()
        self._slots[slot] = self.arenas[-1][offset : offset + size]
        self._top = offset + size
        return slot

    def alloc(self, n: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """A slot for ``n`` elements of ``dtype``: (slot id, tensor view of exactly n elements)."""
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        size = size_class(nbytes)
        free = self._free.get(size)
        if free:
            slot = free.pop()
            self.reused += 1
        else:
            slot = self._carve(size)
        return slot, self._slots[slot][:nbytes].view(dtype)

    def free(self, slot: int) -> None:
        """Put ``slot`` on its size's free list: the next allocation of that size takes it."""
        self._free.setdefault(self._slots[slot].numel(), []).append(slot)

    def release(self) -> None:
        """Drop every arena. PyTorch keeps one alive while a copy from it is pending."""
        self.arenas, self._slots, self._free = [], {}, {}
