"""Named KV-cache geometries the tests and the fuzzer run on.

Each preset is small enough to zero quickly under Triton's CPU interpreter (a few thousand int32
words per page at most, few blocks) yet keeps the shape of a real case: K/V-outer and
block-outer tensors, shared tensors, virtual block splitting, packed rows, MLA pages of unequal
size, mixed dtypes. `tiny` is the smallest because the fuzzer uses it most.

Example:

    >>> spec = geometry("ratio2")
    >>> spec.ratio, spec.num_blocks
    (2, 8)
    >>> geometry_names()[:3]
    ['block_outer_fp8', 'kv_outer_bf16', 'mixed_dtypes']
"""

from __future__ import annotations

import torch

from zeroer.errors import CacheSpecError
from zeroer.cache.layout import CacheSpec, TensorSpec

# fp8 where this torch has it; int8 has the same element size and page layout otherwise.
_FP8_E4M3 = "float8_e4m3fn" if hasattr(torch, "float8_e4m3fn") else "int8"
_FP8_E5M2 = "float8_e5m2" if hasattr(torch, "float8_e5m2") else "int8"


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


GEOMETRIES: dict[str, CacheSpec] = {
    spec.name: spec
    for spec in (
        # 4 tokens x 2 heads x 4 = 32 fp32 words per page, K and V: 2 segments.
        CacheSpec(name="tiny", num_blocks=8, block_size=4, kernel_block_size=4,
                  tensors=(TensorSpec((_attn(0),), "float32", (4, 2, 4)),)),
        CacheSpec(name="kv_outer_bf16", num_blocks=16, block_size=16, kernel_block_size=16,
                  tensors=(TensorSpec((_attn(0),), "bfloat16", (16, 2, 32)),
                           TensorSpec((_attn(1),), "bfloat16", (16, 2, 32)))),
        CacheSpec(name="block_outer_fp8", num_blocks=16, block_size=16, kernel_block_size=16,
                  tensors=(TensorSpec((_attn(0),), _FP8_E4M3, (16, 2, 64), kv_outer=False),
                           TensorSpec((_attn(1),), _FP8_E4M3, (16, 2, 64), kv_outer=False))),
        # Hybrid model: an attention layer and a linear-attention layer bound to one buffer
        # (KVCacheTensor.shared_by); it must get its segments once (de-duplicated by data_ptr).
        CacheSpec(name="shared_layers", num_blocks=12, block_size=16, kernel_block_size=16,
                  tensors=(TensorSpec((_attn(0), "model.layers.1.linear_attn"), "float16",
                                      (16, 2, 16)),
                           TensorSpec((_attn(2),), "float16", (16, 2, 16)))),
        # Virtual block splitting: 2 kernel blocks per logical block, contiguous, so merged.
        CacheSpec(name="ratio2", num_blocks=8, block_size=32, kernel_block_size=16,
                  tensors=(TensorSpec((_attn(0),), "bfloat16", (16, 2, 16)),)),
        # DeepSeek-V3.2: fp8_ds_mla latent pages of 64 x 656 bytes = 10,496 words and DSA
        # indexer pages of 64 x 132 bytes = 2,112 words (non-uniform pages, vLLM #49704).
        CacheSpec(name="mla_indexer", num_blocks=4, block_size=64, kernel_block_size=64,
                  tensors=(TensorSpec((_attn(0),), "int8", (64, 656), kv_outer=False),
                           TensorSpec(("model.layers.0.self_attn.indexer",), "int8", (64, 132),
                                      kv_outer=False))),
        # Packed rows (DSV4-style): the block stride exceeds the page, so each virtual split is
        # its own segment and the padding after each page must survive (vLLM #50276).
        CacheSpec(name="packed", num_blocks=8, block_size=32, kernel_block_size=16,
                  tensors=(TensorSpec((_attn(0),), "bfloat16", (16, 1, 16), kv_outer=False,
                                      row_padding=16),
                           TensorSpec((_attn(1),), "float32", (16, 1, 8), row_padding=4))),
        # Mixed precision (has_mixed_precision_kv_cache): a freed page of one dtype reused as
        # another decodes to NaN unless zeroed (vLLM #47574).
        CacheSpec(name="mixed_dtypes", num_blocks=8, block_size=16, kernel_block_size=16,
                  tensors=(TensorSpec((_attn(0),), "float32", (16, 1, 8)),
                           TensorSpec((_attn(1),), "float16", (16, 1, 16)),
                           TensorSpec((_attn(2),), "int8", (16, 1, 32), kv_outer=False),
                           TensorSpec((_attn(3),), _FP8_E5M2, (16, 1, 32), kv_outer=False))),
    )
}

# Presets too big for the CPU (tests and the simulator leave them out of `geometry_names()`),
# reachable by name. `int32_wrap`: one int8 segment of ten 512 MiB pages (5 GiB plus guards),
# so blocks 8 and 9 sit past 4 GiB, where a 32-bit byte offset wraps (zoo.int32_offset_4gib).
LARGE_GEOMETRIES: dict[str, CacheSpec] = {
    spec.name: spec
    for spec in (
        CacheSpec(name="int32_wrap", num_blocks=10, block_size=64, kernel_block_size=64,
                  tensors=(TensorSpec((_attn(0),), "int8", (64, 8, 1 << 20), kv_outer=False),)),
    )
}


def geometry_names() -> list[str]:
    """The preset names, sorted (so parametrized tests collect identically on every worker).

    Large presets (`LARGE_GEOMETRIES`, GPU only) are not listed; `geometry` still finds them.
    """
    return sorted(GEOMETRIES)


def geometry(name: str) -> CacheSpec:
    """The preset called `name`."""
    if name in LARGE_GEOMETRIES:
        return LARGE_GEOMETRIES[name]
    if name not in GEOMETRIES:
        raise CacheSpecError(
            f"geometry {name!r} does not exist; use one of {', '.join(geometry_names())}"
        )
    return GEOMETRIES[name]
