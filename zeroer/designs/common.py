"""What every zeroer shares: vLLM's call, input checking, and the launch of the zero kernel.

A zeroer exposes vLLM's ``zero_block_ids(block_ids: list[int]) -> None``: stream-ordered on the
runtime's current stream, returning without waiting for the device (the contract in
docs/contract.md). The designs differ only in how they stage the ids on
the device; :class:`StagedZeroer` holds everything else.

Checking happens before anything is enqueued, so bad input writes nothing (contract 5)::

    z.zero_block_ids([70])    # ValueError: block id 70 is out of range for a cache of 64 blocks (valid: 0..63)
    z.zero_block_ids([])      # no-op, no launch
"""

from __future__ import annotations

import functools
import itertools
import numbers
from collections.abc import Iterable

import torch

from zeroer.kernel import zero_blocks
from zeroer.cache.layout import KVCache
from zeroer.protocol import Capabilities, IDS_CONTAINERS
from kvdevice.runtime import DeviceBuffer, Runtime

KERNELS = ("torch", "triton")
_PLAIN_INTS = {int}  # bool is a subclass of int, but type(True) is bool: bools take the slow path


def is_plain_int_list(block_ids: object) -> bool:
    """Whether ``block_ids`` is what vLLM passes: a non-empty list of plain ints (no bools).

    Checked at C speed (``set(map(type, ...))``), for the fast paths of the id check.
    """
    return type(block_ids) is list and set(map(type, block_ids)) == _PLAIN_INTS


def validate_block_ids(block_ids: Iterable[int] | None, num_blocks: int) -> list[int]:
    """Return ``block_ids`` as a list of ints, or raise before anything is enqueued.

    ``None`` and ``[]`` mean nothing to zero (vLLM passes ``None`` when no block is new).
    Duplicates are kept: zeroing a block twice is harmless.
    """
    if block_ids is None:
        return []
    if is_plain_int_list(block_ids):
        # What vLLM passes: a list of plain ints. Checked with C-speed builtins, since this runs
        # on every scheduling step (256 ids: a few microseconds, not a Python loop's tens); any
        # other input, or an id out of range, takes the loop below for its exact message.
        if 0 <= min(block_ids) and max(block_ids) < num_blocks:
            return list(block_ids)  # a copy: the caller may reuse its list once we return
    if isinstance(block_ids, torch.Tensor):
        if block_ids.is_floating_point() or block_ids.is_complex() or block_ids.dtype == torch.bool:
            raise TypeError(f"block ids must be integers, got a tensor of dtype {block_ids.dtype}")
        block_ids = block_ids.reshape(-1).tolist()
    elif hasattr(block_ids, "tolist") and hasattr(block_ids, "dtype"):  # numpy arrays
        block_ids = block_ids.reshape(-1).tolist()
    if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Iterable):
        raise TypeError(
            f"block ids must be a list of ints, got {type(block_ids).__name__} {block_ids!r}"
        )
    ids: list[int] = []
    for position, block in enumerate(block_ids):
        if isinstance(block, bool) or not isinstance(block, numbers.Integral):
            raise TypeError(
                f"block id at position {position} is {block!r} ({type(block).__name__}); "
                f"block ids must be ints"
            )
        value = int(block)
        if not 0 <= value < num_blocks:
            raise ValueError(
                f"block id {value} is out of range for a cache of {num_blocks} blocks "
                f"(valid: 0..{num_blocks - 1})"
            )
        ids.append(value)
    return ids


def zero_blocks_torch(cache: KVCache, ids: torch.Tensor) -> None:
    """The zero kernel's job done with torch indexing through the same segment views.

    Like the Triton kernel it reads ``ids`` from device memory when it runs, so races on the id
    buffer show the same way; it is only faster on the simulator (no interpreter).
    """
    index = ids.to(torch.int64)
    for seg in range(len(cache.segments)):
        # index_fill_, not ``pages[index] = 0``: index_put_ blocks the host on CUDA, which would
        # wait forever behind a closed gate of the controlled runtime (seen on an H200).
        cache.pages(seg).index_fill_(0, index, 0)


class StagedZeroer:
    """Base of the designs that stage ids in pinned memory and copy them to the device.

    :meth:`zero_block_ids` checks the ids and annotates the call; subclasses implement
    :meth:`_zero` with their staging strategy and call :meth:`_launch_zero` to enqueue the kernel
    behind their copy.
    """

    name = "staged"
    #: written against the runtime; reads cache.table on every call
    capabilities = Capabilities(api="runtime", ids_as=IDS_CONTAINERS, follows_reallocation=True)

    def __init__(self, cache: KVCache, runtime: Runtime, *, kernel: str = "triton") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        if cache.device.type != runtime.device.type:
            raise ValueError(
                f"the cache lives on {cache.device} but the runtime runs on {runtime.device}; "
                f"build the cache with build_cache(spec, device=runtime.device)"
            )
        self.cache = cache
        self.rt = runtime
        self.kernel = kernel
        self.num_blocks = cache.spec.num_blocks
        self._calls = itertools.count(1)

    def _validate(self, block_ids: Iterable[int] | None) -> list[int]:
        return validate_block_ids(block_ids, self.num_blocks)

    def _origin(self, ids: list[int]) -> str:
        shown = ids if len(ids) <= 8 else ids[:8] + ["..."]
        return f"{self.name}.zero_block_ids#{next(self._calls)}({shown})"

    def _launch_zero(self, dev: DeviceBuffer, n: int, ids: list[int]) -> None:
        """Enqueue the zero kernel that reads ``dev[:n]`` when it runs."""
        view = dev.tensor[:n]
        if self.kernel == "triton":
            run = functools.partial(zero_blocks, self.cache.table, view)
        else:
            run = functools.partial(zero_blocks_torch, self.cache, view)
        self.rt.launch(run, name="zero_kernel", reads=[dev], blocks_written=ids)

    def warmup(self) -> None:
        """Zero the null block 0, as vLLM's warm-up does (the kernel is compiled on the way)."""
        self.zero_block_ids([0])

    def zero_block_ids(self, block_ids: list[int]) -> None:
        ids = self._validate(block_ids)
        if not ids:
            return
        with self.rt.annotate(self._origin(ids)):
            self._zero(ids)

    def _zero(self, ids: list[int]) -> None:  # pragma: no cover - abstract
        """Stage the checked, non-empty ``ids`` and enqueue the zero kernel behind their copy."""
        raise NotImplementedError


__all__ = [
    "KERNELS",
    "StagedZeroer",
    "is_plain_int_list",
    "validate_block_ids",
    "zero_blocks_torch",
]
