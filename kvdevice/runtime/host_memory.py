"""Pinned host memory's size classes, shared by every allocator that models PyTorch's.

PyTorch's caching host allocator rounds every pinned allocation up to a power of two of bytes and
reuses a freed block only for a request of the same size class. The simulator's allocator
(:class:`kvdevice.runtime.sim.SimHostAllocator`), the cuda backend's unprotected pinned arenas
(:class:`kvdevice.runtime.cuda.arena.PinnedArena`) and the interception layer's simulated device
memory all use this one rule, so a block is reused for the same requests on every backend.

Example::

    assert [size_class(n) for n in (0, 1, 24, 32, 33)] == [1, 1, 32, 32, 64]
"""

from __future__ import annotations


def size_class(nbytes: int) -> int:
    """The smallest power of two of bytes that holds ``nbytes`` (1 for 0 or 1 byte)."""
    return 1 << max(nbytes - 1, 0).bit_length()
