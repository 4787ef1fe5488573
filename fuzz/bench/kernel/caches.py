"""The KV caches the benchmark zeroes: realistic shapes, defined here and used nowhere else.

Each full-size cache has BENCH_BLOCKS = 4,097 logical blocks, so every block count up to 4,096
can be zeroed without touching the null block 0. The quick versions keep each shape's kind
(many small segments, few big ones, pages of two sizes) at sizes Triton's CPU interpreter zeroes
in milliseconds.

| name | model it follows | segments | bytes per block |
| --- | --- | --- | --- |
| `llama` | Llama-3-8B: 32 layers, K/V outermost, 16 tokens x 8 KV heads x 128, bf16 | 64 x 32 KiB | 2 MiB |
| `hybrid` | a hybrid model: 4 attention layers, each tensor shared with 6 Mamba layers, 128-token pages | 8 x 256 KiB | 2 MiB |
| `mla` | DeepSeek-V3.2: 61 layers of fp8 MLA latent pages (64 x 656 B) and indexer pages (64 x 132 B) | 122, 41 KiB / 8.25 KiB | 2.93 MiB |

Example::

    spec = bench_cache("llama", quick=False)
    spec.num_blocks, bytes_per_block(spec)      # (4097, 2097152)
"""

from __future__ import annotations

import torch

from zeroer.cache.layout import CacheSpec, TensorSpec

BENCH_BLOCKS = 4097  # 4,096 zeroable blocks plus the null block 0
QUICK_BLOCKS = 17
_FP8 = "float8_e4m3fn" if hasattr(torch, "float8_e4m3fn") else "int8"  # same 1-byte layout


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _llama(layers: int, heads: int, blocks: int) -> CacheSpec:
    # FlashAttention layout (2, num_blocks, 16, 8, 128) per layer: 64 segments of 32 KiB.
    return CacheSpec(name="llama", num_blocks=blocks, block_size=16, kernel_block_size=16,
                     tensors=tuple(TensorSpec((_attn(i),), "bfloat16", (16, heads, 128))
                                   for i in range(layers)))


def _hybrid(attention: int, mamba_per_tensor: int, tokens: int, blocks: int) -> CacheSpec:
    # vLLM's hybrid allocator binds each attention layer's tensor to several Mamba layers
    # (KVCacheTensor.shared_by) and raises the attention block size until a page holds a Mamba
    # state: few segments, large pages. A shared tensor is zeroed once.
    tensors = []
    for a in range(attention):
        first = a * (mamba_per_tensor + 1)
        mamba = tuple(f"model.layers.{first + 1 + m}.mixer" for m in range(mamba_per_tensor))
        tensors.append(TensorSpec((_attn(first), *mamba), "bfloat16", (tokens, 8, 128)))
    return CacheSpec(name="hybrid", num_blocks=blocks, block_size=tokens, kernel_block_size=tokens,
                     tensors=tuple(tensors))


def _mla(layers: int, blocks: int) -> CacheSpec:
    # fp8_ds_mla latent pages of 64 x 656 bytes (10,496 words) and DSA indexer pages of
    # 64 x 132 bytes (2,112 words) in every layer: pages of two sizes (vLLM #49704).
    tensors = []
    for i in range(layers):
        tensors.append(TensorSpec((_attn(i),), _FP8, (64, 656), kv_outer=False))
        tensors.append(TensorSpec((f"model.layers.{i}.self_attn.indexer",), "int8", (64, 132),
                                  kv_outer=False))
    return CacheSpec(name="mla", num_blocks=blocks, block_size=64, kernel_block_size=64,
                     tensors=tuple(tensors))


DESCRIPTIONS = {
    "llama": "Llama-3-8B-like: 32 layers, K/V outermost, 16 tokens x 8 heads x 128 bf16 (64 segments of 32 KiB)",
    "hybrid": "hybrid-like: 4 attention layers, each tensor shared with 6 Mamba layers, 128-token pages (8 segments of 256 KiB)",
    "mla": "MLA-like (DeepSeek-V3.2): 61 layers of latent 64 x 656 B and indexer 64 x 132 B pages (122 segments)",
}
NAMES = tuple(DESCRIPTIONS)  # in the order they are measured


def bench_cache(name: str, quick: bool) -> CacheSpec:
    """The spec for benchmark cache ``name`` (one of NAMES; the CLI checks the name)."""
    if quick:
        return {"llama": lambda: _llama(2, 2, QUICK_BLOCKS),
                "hybrid": lambda: _hybrid(1, 2, 16, QUICK_BLOCKS),
                "mla": lambda: _mla(1, QUICK_BLOCKS)}[name]()
    return {"llama": lambda: _llama(32, 8, BENCH_BLOCKS),
            "hybrid": lambda: _hybrid(4, 6, 128, BENCH_BLOCKS),
            "mla": lambda: _mla(61, BENCH_BLOCKS)}[name]()


def bytes_per_block(spec: CacheSpec) -> int:
    """Bytes the kernel zeroes per logical block: every page of every distinct tensor."""
    return sum(t.parts * t.page_words for t in spec.tensors) * spec.ratio * 4


def describe(spec: CacheSpec, quick: bool) -> dict:
    pages = sorted({t.page_words * spec.ratio for t in spec.tensors})
    return {
        "description": DESCRIPTIONS[spec.name] + (" [--quick: scaled down]" if quick else ""),
        "num_blocks": spec.num_blocks,
        "tensors": len(spec.tensors),
        "layer_names": sum(len(t.layers) for t in spec.tensors),
        "segments": sum(t.parts for t in spec.tensors),
        "page_words": pages,
        "bytes_per_block": bytes_per_block(spec),
    }
