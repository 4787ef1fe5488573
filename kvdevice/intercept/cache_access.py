"""What one op of an offloader does to the KV cache's bytes, before they are named as blocks.

Every way an offloader's op reaches the cache (an aten op on the cuda or simulated backend, a
custom op's effect model, a driver copy, a Triton kernel through its tables) ends as one
:class:`CacheAccess`; the session maps its runs to the logical blocks the caller's own accesses
use (:meth:`kvdevice.intercept.session.InterceptSession.enqueue`).
"""

from __future__ import annotations


class CacheAccess:
    """The KV-cache bytes one op of an offloader reads and writes, as byte runs; the session turns
    them into logical blocks (:class:`~zeroer.cache.block_map.CacheBlockMap`). ``rows_unknown``: it
    writes cache rows chosen by device values, taken to be the blocks of the call in progress."""

    __slots__ = ("read", "written", "rows_unknown")

    def __init__(self, read: list[tuple[int, int]], written: list[tuple[int, int]], rows_unknown: bool = False) -> None:
        self.read, self.written, self.rows_unknown = read, written, rows_unknown

    def __bool__(self) -> bool:  # what a zeroer's "the cache is written" flag means
        return bool(self.written) or self.rows_unknown


__all__ = ["CacheAccess"]
