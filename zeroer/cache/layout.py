"""KV-cache geometry: specs, guarded raw buffers, typed layer views and the segment table.

The model. A KV cache is one raw int32 buffer per `TensorSpec`. Each buffer holds one or two
*parts* (K and V for FlashAttention-style `(2, num_kernel_blocks, *block_shape)` tensors, a single
part for FlashInfer/MLA-style `(num_kernel_blocks, *block_shape)` ones), and every part is
surrounded by guard words, in int32 words:

    block-outer:  [guard][part 0: nkb * row][guard]
    K/V-outer:    [guard][K: nkb * row][guard][V: nkb * row][guard]

where `nkb = num_blocks * ratio` kernel blocks and `row` is one kernel-block page plus its
`row_padding`. The scheduler hands out *logical* blocks; logical block `b` covers the `ratio`
contiguous kernel blocks `b*ratio .. b*ratio + ratio - 1` (vLLM "virtual block splitting").

The zero kernel knows none of this: it reads an address table of *segments*, each
`(addr, block_stride, page)` in bytes / int32 words, and zeroes
`[addr + b*block_stride*4, + page*4)` for every requested block `b`. The table is built the way
vLLM's `KVBlockZeroer` builds it: layers in order, tensors de-duplicated by `data_ptr`, one
segment per part, and one per virtual split when padding breaks the contiguity (vLLM #50276).

Guard words and row padding hold `GUARD_WORD`; a correct zeroer never touches them, so
`guard_violations()` is an exact check that nothing outside a page was written. Pages start
poisoned with `POISON_WORD` (0xFFFFFFFF), which decodes to NaN in every float KV dtype, as the
stale fp32 Mamba state that made vLLM zero blocks at all does (#35219).

Example:

    >>> spec = CacheSpec(num_blocks=4, tensors=(TensorSpec(("l0",), "float32", (4, 2, 4)),),
    ...                  block_size=4, kernel_block_size=4)
    >>> cache = build_cache(spec)
    >>> cache.layer_tensors["l0"].shape, len(cache.segments), cache.segments[0].page
    (torch.Size([2, 4, 4, 2, 4]), 2, 32)
    >>> cache.layer_tensors["l0"][1, 3, 0, 0, 0] = 1.0   # V page of block 3
    >>> int(cache.pages(1)[3, 0])
    1065353216
    >>> cache.guard_violations()
    []
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeroer.errors import CacheSpecError, RuntimeUsageError

WORD_BYTES = 4  # the zero kernel writes int32 words, whatever the KV dtype
GUARD_WORD = 0x5A5A5A5A  # sentinel in guards and row padding: must survive every zeroing
POISON_WORD = -1  # 0xFFFFFFFF: NaN in fp32, bf16, fp16, fp8 e4m3fn and e5m2 (#35219)
MAX_REPORTED_WORDS = 5  # per tensor, in guard_violations()

# Only the fp8 dtypes this torch build knows about, so error messages list what really works.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class TensorSpec:
    """One KV tensor (one raw buffer) and the layers bound to it.

    More than one layer name means the tensor is shared (vLLM `KVCacheTensor.shared_by`): it is
    zeroed once, through whichever layer comes first, and never skipped.
    """

    layers: tuple[str, ...]
    dtype: str
    block_shape: tuple[int, ...]  # elements of one kernel-block page, e.g. tokens x heads x head_size
    kv_outer: bool = True  # (2, nkb, *block_shape) if True, else (nkb, *block_shape)
    row_padding: int = 0  # elements after each page that belong to no page (packed views, #50276)

    def __post_init__(self) -> None:
        if isinstance(self.layers, str):
            raise CacheSpecError(
                f"layers={self.layers!r} is a string; pass a tuple of layer names, "
                f"e.g. ({self.layers!r},)"
            )
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "block_shape", tuple(self.block_shape))
        if not self.layers:
            raise CacheSpecError("layers=(): a tensor needs at least one layer name bound to it")
        if len(set(self.layers)) != len(self.layers):
            raise CacheSpecError(
                f"layers={self.layers!r} names a layer twice; list each layer once"
            )
        if self.dtype not in DTYPES:
            raise CacheSpecError(
                f"dtype={self.dtype!r} is not a KV dtype this torch supports; "
                f"use one of {', '.join(DTYPES)}"
            )
        if not self.block_shape or not all(_is_int(d) and d > 0 for d in self.block_shape):
            raise CacheSpecError(
                f"block_shape={self.block_shape!r}: every dimension of a page must be a "
                f"positive int, e.g. (16, 8, 128) = tokens x heads x head_size"
            )
        if not _is_int(self.row_padding) or self.row_padding < 0:
            raise CacheSpecError(
                f"row_padding={self.row_padding!r}: padding is a count of elements, "
                f"use 0 or a positive int"
            )
        size = self.element_size
        elems = math.prod(self.block_shape)
        if elems * size % WORD_BYTES:
            raise CacheSpecError(
                f"page of {elems} {self.dtype} elements = {elems * size} bytes is not a whole "
                f"number of int32 words; the zero kernel writes 4-byte words: pad block_shape "
                f"so the page is a multiple of 4 bytes"
            )
        if self.row_padding * size % WORD_BYTES:
            raise CacheSpecError(
                f"row_padding of {self.row_padding} {self.dtype} elements = "
                f"{self.row_padding * size} bytes is not a whole number of int32 words; "
                f"use a multiple of {WORD_BYTES // size} elements"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def parts(self) -> int:
        """2 (K and V) for K/V-outer tensors, 1 for block-outer ones."""
        return 2 if self.kv_outer else 1

    @property
    def page_words(self) -> int:
        """int32 words of one kernel-block page (what gets zeroed)."""
        return math.prod(self.block_shape) * self.element_size // WORD_BYTES

    @property
    def row_words(self) -> int:
        """int32 words from one kernel block to the next: the page plus its padding."""
        return (math.prod(self.block_shape) + self.row_padding) * self.element_size // WORD_BYTES


@dataclass(frozen=True)
class CacheSpec:
    """A whole KV cache: how many logical blocks, which tensors, how blocks split."""

    num_blocks: int  # logical (scheduler) blocks, including the null block 0
    tensors: tuple[TensorSpec, ...]
    block_size: int = 16  # tokens per logical block
    kernel_block_size: int = 16  # tokens per kernel block
    guard_words: int = 16  # int32 words of guard before and after every part
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        if not _is_int(self.num_blocks) or self.num_blocks < 2:
            raise CacheSpecError(
                f"num_blocks={self.num_blocks!r}: a cache needs at least 2 blocks "
                f"(the null block 0 and one usable block)"
            )
        if not self.tensors:
            raise CacheSpecError(
                "tensors=(): a cache needs at least one TensorSpec to hold its pages"
            )
        for name, value in (("block_size", self.block_size),
                            ("kernel_block_size", self.kernel_block_size)):
            if not _is_int(value) or value < 1:
                raise CacheSpecError(f"{name}={value!r}: a block holds a positive number of tokens")
        if self.block_size % self.kernel_block_size:
            raise CacheSpecError(
                f"block_size={self.block_size} is not a multiple of "
                f"kernel_block_size={self.kernel_block_size}; a logical block must split into "
                f"whole kernel blocks: pick a kernel_block_size that divides block_size"
            )
        if not _is_int(self.guard_words) or self.guard_words < 1:
            raise CacheSpecError(
                f"guard_words={self.guard_words!r}: use at least 1 so a write just past a page "
                f"lands in a guard and is seen"
            )
        owner: dict[str, int] = {}
        for i, tensor in enumerate(self.tensors):
            for layer in tensor.layers:
                if layer in owner:
                    raise CacheSpecError(
                        f"layer {layer!r} is bound to tensors {owner[layer]} and {i}; a layer has "
                        f"one KV tensor: to share a tensor, list both layers in one "
                        f"TensorSpec.layers"
                    )
                owner[layer] = i

    @property
    def ratio(self) -> int:
        """Kernel blocks per logical block (vLLM virtual block splitting)."""
        return self.block_size // self.kernel_block_size

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * self.ratio

    @property
    def device_bytes(self) -> int:
        """Bytes of the cache's raw buffers on its device: pages, row padding and guards."""
        g = self.guard_words
        words = sum(g + t.parts * (self.num_kernel_blocks * t.row_words + g) for t in self.tensors)
        return words * WORD_BYTES


def device_index(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``ids`` (int64, CPU) on ``device`` without a host synchronisation.

    A plain ``.to(cuda)`` of pageable memory synchronises the current stream; inside a gated
    stream of the controlled cuda runtime that would wait forever, so on CUDA the ids are staged
    in fresh pinned memory (protected by the caching host allocator) and copied asynchronously.
    """
    if device.type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Segment:
    """One row of the address table: a strided run of pages the kernel zeroes."""

    addr: int  # absolute byte address of block 0's page in this segment
    block_stride: int  # int32 words between consecutive logical blocks
    page: int  # int32 words to zero per logical block (page <= block_stride)
    tensor_index: int  # which TensorSpec
    part: int  # which K/V part (0 for block-outer)
    split: int  # which kernel block of the logical block (0 when merged)


@dataclass(frozen=True)
class SegmentTable:
    """The device tensors the zero kernel reads (int64, on the cache's device)."""

    addrs: torch.Tensor
    block_strides: torch.Tensor
    pages: torch.Tensor
    n_segs: int
    max_page: int

    @classmethod
    def from_rows(cls, addrs: Sequence[int], block_strides: Sequence[int],
                  pages: Sequence[int], device: torch.device | str) -> SegmentTable:
        """Build a table from plain ints; tests use it to aim the kernel at hand-made buffers."""
        if not (len(addrs) == len(block_strides) == len(pages)) or not addrs:
            raise CacheSpecError(
                f"segment table rows disagree or are empty: {len(addrs)} addrs, "
                f"{len(block_strides)} block_strides, {len(pages)} pages; give one of each per segment"
            )
        for s, (stride, page) in enumerate(zip(block_strides, pages)):
            if not 0 < page <= stride:
                raise CacheSpecError(
                    f"segment {s}: page={page} words with block_stride={stride}; a page must be "
                    f"positive and fit in its stride, or zeroing one block clears the next"
                )

        def col(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int64, device=device)

        return cls(col(addrs), col(block_strides), col(pages), len(addrs), max(pages))


class KVCache:
    """A cache built from a `CacheSpec`: raw buffers, typed layer views, segments, guard check.

    Build one with `build_cache`. Block 0 is the null block; here it is an ordinary page.
    """

    def __init__(self, spec: CacheSpec, device: torch.device | str = "cpu",
                 fill: str = "poison", pin_memory: bool = False) -> None:
        if fill not in ("poison", "zero"):
            raise CacheSpecError(f"fill={fill!r}: pages start as 'poison' (NaN bits) or 'zero'")
        self.spec = spec
        self.num_kernel_blocks = spec.num_kernel_blocks
        self.raws: list[torch.Tensor] = []
        self._guard_masks: list[torch.Tensor] = []
        self.layer_tensors: dict[str, torch.Tensor] = {}
        for t, tensor in enumerate(spec.tensors):
            # A part past the last one starts where the buffer ends: its words are the buffer's size.
            raw = torch.full((self._part_start(tensor, tensor.parts),), GUARD_WORD, dtype=torch.int32,
                             device=device, pin_memory=pin_memory)
            self.raws.append(raw)
            self._guard_masks.append(torch.ones_like(raw, dtype=torch.bool))
            self._rows_of(self._guard_masks[t], t)[:, :, : tensor.page_words] = False
            self.word_rows(t)[:, :, : tensor.page_words] = POISON_WORD if fill == "poison" else 0
            view = self._typed_view(t)
            for layer in tensor.layers:
                self.layer_tensors[layer] = view  # shared layers: the very same view object
        self.device = self.raws[0].device
        self.segments = self._build_segments()
        self.table = SegmentTable.from_rows(
            [s.addr for s in self.segments], [s.block_stride for s in self.segments],
            [s.page for s in self.segments], self.device)

    # -- geometry ------------------------------------------------------------------------------

    def _part_start(self, tensor: TensorSpec, part: int) -> int:
        """Word offset of kernel block 0 of `part` in the raw buffer."""
        g = self.spec.guard_words
        return g + part * (self.num_kernel_blocks * tensor.row_words + g)

    def _rows_of(self, buf: torch.Tensor, t: int) -> torch.Tensor:
        tensor = self.spec.tensors[t]
        row = tensor.row_words
        return buf.as_strided(
            (tensor.parts, self.num_kernel_blocks, row),
            (self.num_kernel_blocks * row + self.spec.guard_words, row, 1),
            self._part_start(tensor, 0),
        )

    def word_rows(self, t: int) -> torch.Tensor:
        """int32 view (parts, num_kernel_blocks, row_words) of tensor t, padding included.

        Derived from the spec alone, never from the segment table, so the reference zeroer
        built on it is an independent check of the table and the kernel.
        """
        return self._rows_of(self.raws[t], t)

    def _typed_view(self, t: int) -> torch.Tensor:
        tensor = self.spec.tensors[t]
        per_word = WORD_BYTES // tensor.element_size
        inner = torch.empty(tensor.block_shape, device="meta").stride()  # a page is contiguous
        shape = (self.num_kernel_blocks, *tensor.block_shape)
        stride = (tensor.row_words * per_word, *inner)
        if tensor.kv_outer:
            # The K/V stride skips the guard between the parts.
            part_el = (self.num_kernel_blocks * tensor.row_words + self.spec.guard_words) * per_word
            shape, stride = (2, *shape), (part_el, *stride)
        typed = self.raws[t].view(torch.uint8).view(tensor.torch_dtype)
        return typed.as_strided(shape, stride, self._part_start(tensor, 0) * per_word)

    def _build_segments(self) -> list[Segment]:
        # Like vLLM's constructor: layers in spec order, tensors de-duplicated by data_ptr so a
        # shared tensor is zeroed once (KVCacheTensor.shared_by).
        segments: list[Segment] = []
        seen: set[int] = set()
        ratio = self.spec.ratio
        for t, tensor in enumerate(self.spec.tensors):
            for layer in tensor.layers:
                view = self.layer_tensors[layer]
                if view.data_ptr() in seen:
                    continue
                seen.add(view.data_ptr())
                row, page = tensor.row_words, tensor.page_words
                for part in range(tensor.parts):
                    base = self.raws[t].data_ptr() + self._part_start(tensor, part) * WORD_BYTES
                    if page == row:
                        # Contiguous splits: one segment spanning the whole logical block.
                        segments.append(Segment(base, ratio * row, ratio * row, t, part, 0))
                        continue
                    # Padding between splits: one segment per virtual split, each zeroing only
                    # its page, never the padding after it (vLLM #50276).
                    for j in range(ratio):
                        segments.append(Segment(base + j * row * WORD_BYTES, ratio * row, page,
                                                t, part, j))
        return segments

    # -- pages ---------------------------------------------------------------------------------

    def pages(self, seg: int) -> torch.Tensor:
        """int32 view (num_blocks, page) of segment `seg`: row b holds logical block b's words."""
        if not 0 <= seg < len(self.segments):
            raise RuntimeUsageError(
                f"segment {seg} does not exist; this cache has {len(self.segments)} "
                f"(valid: 0..{len(self.segments) - 1})"
            )
        s = self.segments[seg]
        raw = self.raws[s.tensor_index]
        offset = (s.addr - raw.data_ptr()) // WORD_BYTES
        return raw.as_strided((self.spec.num_blocks, s.page), (s.block_stride, 1), offset)

    def block_words(self, block: int) -> list[torch.Tensor]:
        """One int32 1-D view per segment of the words logical block `block` owns."""
        if not _is_int(block) or not 0 <= block < self.spec.num_blocks:
            self.check_blocks([block])  # raises the usual message (or a TypeError for non-ints)
        return [self.pages(s)[block] for s in range(len(self.segments))]

    def check_blocks(self, blocks: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``blocks`` as an int64 CPU tensor; an id out of range raises, naming it."""
        if type(blocks) in (list, tuple) and all(_is_int(b) and 0 <= b < self.spec.num_blocks for b in blocks):
            # What the fuzzer passes on every write, free and poison: checked in Python, one
            # tensor made (five tensor ops and a mask index otherwise, per call).
            return torch.tensor(blocks, dtype=torch.int64)
        ids = torch.as_tensor(blocks, dtype=torch.int64).reshape(-1).cpu()
        bad = ids[(ids < 0) | (ids >= self.spec.num_blocks)]
        if bad.numel():
            raise RuntimeUsageError(
                f"block id {int(bad[0])} is out of range for a cache of {self.spec.num_blocks} "
                f"blocks (valid: 0..{self.spec.num_blocks - 1})"
            )
        return ids

    def fill_pages(self, blocks: Sequence[int] | torch.Tensor, value: int) -> None:
        """Write int32 word `value` (signed, or unsigned as 0x...) over every page of `blocks`."""
        if not _is_int(value) or not -(2**31) <= value < 2**32:
            raise RuntimeUsageError(
                f"value={value!r} is not an int32 word; use an int in -2**31 .. 2**32 - 1"
            )
        word = value - 2**32 if value >= 2**31 else value
        ids = device_index(self.check_blocks(blocks), self.device)
        for s in range(len(self.segments)):
            self.pages(s).index_fill_(0, ids, word)  # no host sync, unlike index_put_ on CUDA

    def poison(self, blocks: Sequence[int] | torch.Tensor) -> None:
        """Fill the pages of `blocks` with NaN bits, as a recycled Mamba page would hold."""
        self.fill_pages(blocks, POISON_WORD)

    # -- guards --------------------------------------------------------------------------------

    def _where(self, t: int, word: int) -> str:
        tensor = self.spec.tensors[t]
        names = ("K", "V") if tensor.kv_outer else ("data",)
        part_words = self.num_kernel_blocks * tensor.row_words
        for part, name in enumerate(names):
            start = self._part_start(tensor, part)
            if word < start and part == 0:
                return f"guard before the {name} part"
            if word < start:
                return f"guard after the {names[part - 1]} part"
            if word < start + part_words:
                row, col = divmod(word - start, tensor.row_words)
                return (f"row padding word {col - tensor.page_words} after kernel block {row} "
                        f"of the {name} part")
        return f"guard after the {names[-1]} part"

    def guard_violations(self) -> list[str]:
        """Describe every word outside every page that no longer holds GUARD_WORD.

        Empty when clean. One vectorised compare per tensor; at most MAX_REPORTED_WORDS words
        are described per tensor, then a count of the rest.
        """
        found: list[str] = []
        for t, (raw, mask) in enumerate(zip(self.raws, self._guard_masks)):
            bad = mask & (raw != GUARD_WORD)
            if not bool(bad.any()):
                continue
            words = bad.nonzero().flatten().cpu()
            label = f"tensor {t} (layers {', '.join(self.spec.tensors[t].layers)})"
            values = raw[words[:MAX_REPORTED_WORDS].to(raw.device)].cpu().tolist()
            for word, value in zip(words[:MAX_REPORTED_WORDS].tolist(), values):
                found.append(
                    f"{label}: word {word} ({self._where(t, word)}) is "
                    f"0x{value & 0xFFFFFFFF:08x}, expected 0x{GUARD_WORD:08x}"
                )
            if words.numel() > MAX_REPORTED_WORDS:
                found.append(f"{label}: and {words.numel() - MAX_REPORTED_WORDS} more "
                             f"guard words touched")
        return found


def build_cache(spec: CacheSpec, device: torch.device | str = "cpu",
                fill: str = "poison") -> KVCache:
    """Allocate a guarded cache for `spec` on `device`, pages poisoned (or zeroed if fill='zero')."""
    return KVCache(spec, device, fill)
