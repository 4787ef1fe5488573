"""KV-cache geometry: typed views, the segment table, guards, and the spec's error messages."""

from __future__ import annotations

import re

import pytest
import torch

from zeroer.errors import CacheSpecError, RuntimeUsageError
from zeroer.cache.geometries import GEOMETRIES, geometry, geometry_names
from zeroer.cache.layout import (DTYPES, POISON_WORD, CacheSpec, TensorSpec, build_cache)

FP8 = "float8_e4m3fn" if hasattr(torch, "float8_e4m3fn") else "int8"


def _one_tensor_spec(**tensor_kwargs) -> CacheSpec:
    kwargs = dict(layers=("l0",), dtype="float32", block_shape=(4, 2, 4))
    kwargs.update(tensor_kwargs)
    return CacheSpec(num_blocks=4, tensors=(TensorSpec(**kwargs),), block_size=4,
                     kernel_block_size=4)


# -- typed views -------------------------------------------------------------------------------


def test_kv_outer_view_is_two_parts_of_kernel_blocks_whose_part_stride_skips_the_guard():
    cache = build_cache(geometry("tiny"))
    view = cache.layer_tensors["model.layers.0.self_attn.attn"]
    assert view.shape == (2, 8, 4, 2, 4)
    assert view.dtype == torch.float32
    # 32 words per page; K part = 8 * 32 words, then a 16-word guard before V.
    assert view.stride() == (8 * 32 + 16, 32, 8, 4, 1)
    view[1, 0, 0, 0, 0] = 1.0
    v_start = 16 + 8 * 32 + 16
    assert cache.raws[0][v_start].item() == 0x3F800000  # 1.0f, first word of the V part
    assert cache.guard_violations() == []


def test_block_outer_view_is_kernel_blocks_of_pages():
    cache = build_cache(geometry("block_outer_fp8"))
    view = cache.layer_tensors["model.layers.1.self_attn.attn"]
    assert view.shape == (16, 16, 2, 64)
    assert view.dtype == DTYPES[FP8]
    assert view.stride() == (16 * 2 * 64, 2 * 64, 64, 1)
    assert view.data_ptr() == cache.raws[1].data_ptr() + 16 * 4  # past the leading guard


@pytest.mark.parametrize("name", geometry_names())
def test_every_layer_view_has_its_spec_dtype_and_starts_poisoned_to_nan(name):
    spec = geometry(name)
    cache = build_cache(spec)
    for tensor in spec.tensors:
        for layer in tensor.layers:
            view = cache.layer_tensors[layer]
            assert view.dtype == DTYPES[tensor.dtype]
            assert view.shape[-len(tensor.block_shape):] == tensor.block_shape
            if view.dtype.is_floating_point:
                # The reason vLLM zeroes at all: stale bits that decode to NaN (#35219).
                assert torch.isnan(view.float()).all()
    assert cache.guard_violations() == []


def test_fill_zero_builds_a_cache_of_zero_pages_and_intact_guards():
    cache = build_cache(geometry("packed"), fill="zero")
    for s in range(len(cache.segments)):
        assert (cache.pages(s) == 0).all()
    assert cache.guard_violations() == []


# -- segments ----------------------------------------------------------------------------------


def test_shared_layers_map_to_one_view_and_get_their_segments_once():
    cache = build_cache(geometry("shared_layers"))
    shared = cache.layer_tensors["model.layers.0.self_attn.attn"]
    assert cache.layer_tensors["model.layers.1.linear_attn"] is shared
    # 2 tensors x (K, V), not 3 layers x (K, V).
    assert [(s.tensor_index, s.part) for s in cache.segments] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_logical_block_covers_ratio_contiguous_kernel_blocks():
    cache = build_cache(geometry("ratio2"))
    row = cache.spec.tensors[0].row_words  # 16 x 2 x 16 bf16 = 256 words
    assert [(s.page, s.block_stride, s.split) for s in cache.segments] == [(512, 512, 0)] * 2
    view = cache.layer_tensors["model.layers.0.self_attn.attn"]
    b = 3
    view[0, b * 2 + 1, 0, 0, :2] = 0.0  # first word of kernel block 7's K page
    k_pages = cache.pages(0)
    assert k_pages[b, row].item() == 0
    touched = (k_pages != POISON_WORD).nonzero().tolist()
    assert touched == [[b, row]]


def test_packed_rows_get_one_segment_per_split_and_keep_their_padding_out_of_pages():
    cache = build_cache(geometry("packed"))
    seg = cache.segments
    assert [(s.tensor_index, s.part, s.split) for s in seg] == [
        (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(s.page < s.block_stride for s in seg)
    row0 = cache.spec.tensors[0].row_words  # 128-word page + 8 words of padding
    assert (seg[0].page, seg[0].block_stride, seg[1].addr - seg[0].addr) == (128, 272, row0 * 4)
    cache.poison(range(cache.spec.num_blocks))
    assert cache.guard_violations() == []
    cache.raws[0][16 + 128] = 0  # first padding word after kernel block 0
    assert cache.guard_violations() == [
        "tensor 0 (layers model.layers.0.self_attn.attn): word 144 (row padding word 0 after "
        "kernel block 0 of the data part) is 0x00000000, expected 0x5a5a5a5a"]


def test_mla_indexer_has_non_uniform_pages_of_10496_and_2112_words():
    cache = build_cache(geometry("mla_indexer"))
    assert [s.page for s in cache.segments] == [10496, 2112]
    assert cache.table.max_page == 10496
    assert cache.table.pages.tolist() == [10496, 2112]


def test_segment_table_mirrors_the_segments_as_int64_device_tensors():
    cache = build_cache(geometry("mixed_dtypes"))
    table = cache.table
    assert table.n_segs == len(cache.segments) == 6
    assert table.addrs.dtype == table.block_strides.dtype == table.pages.dtype == torch.int64
    assert table.addrs.tolist() == [s.addr for s in cache.segments]
    assert table.block_strides.tolist() == [s.block_stride for s in cache.segments]


def test_block_words_gives_one_view_per_segment_of_the_pages_fill_pages_writes():
    cache = build_cache(geometry("mixed_dtypes"))
    cache.fill_pages([2], 0xDEADBEEF)
    words = cache.block_words(2)
    assert [w.numel() for w in words] == [s.page for s in cache.segments]
    assert all((w == 0xDEADBEEF - 2**32).all() for w in words)
    assert all((w == POISON_WORD).all() for w in cache.block_words(3))
    assert cache.guard_violations() == []


# -- guards ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "word, where",
    [(0, "guard before the K part"),
     (16 + 256, "guard after the K part"),
     (16 + 256 + 16 + 256, "guard after the V part"),  # one word past the last page
     (16 + 256 + 16 + 256 + 15, "guard after the V part")],
)
def test_a_write_into_a_guard_is_reported_with_where_it_landed(word, where):
    cache = build_cache(geometry("tiny"))
    cache.raws[0][word] = 0
    assert cache.guard_violations() == [
        f"tensor 0 (layers model.layers.0.self_attn.attn): word {word} ({where}) is "
        f"0x00000000, expected 0x5a5a5a5a"]


def test_guard_report_lists_a_few_words_per_tensor_then_counts_the_rest():
    cache = build_cache(geometry("block_outer_fp8"))
    cache.raws[1][:16] = 7
    report = cache.guard_violations()
    assert len(report) == 6
    assert report[0].startswith("tensor 1 (layers model.layers.1.self_attn.attn): word 0 "
                                "(guard before the data part) is 0x00000007")
    assert report[-1] == ("tensor 1 (layers model.layers.1.self_attn.attn): and 11 more guard "
                          "words touched")


# -- bad input ---------------------------------------------------------------------------------


BAD_SPECS = [
    (lambda: CacheSpec(num_blocks=0, tensors=_one_tensor_spec().tensors),
     "num_blocks=0: a cache needs at least 2 blocks (the null block 0 and one usable block)"),
    (lambda: _one_tensor_spec(dtype="int8", block_shape=(3,)),
     "page of 3 int8 elements = 3 bytes is not a whole number of int32 words; the zero kernel "
     "writes 4-byte words: pad block_shape so the page is a multiple of 4 bytes"),
    (lambda: _one_tensor_spec(dtype="float16", row_padding=1),
     "row_padding of 1 float16 elements = 2 bytes is not a whole number of int32 words; "
     "use a multiple of 2 elements"),
    (lambda: _one_tensor_spec(row_padding=-4),
     "row_padding=-4: padding is a count of elements, use 0 or a positive int"),
    (lambda: CacheSpec(num_blocks=4, tensors=_one_tensor_spec().tensors, block_size=16,
                       kernel_block_size=6),
     "block_size=16 is not a multiple of kernel_block_size=6; a logical block must split into "
     "whole kernel blocks: pick a kernel_block_size that divides block_size"),
    (lambda: CacheSpec(num_blocks=4, tensors=_one_tensor_spec().tensors, kernel_block_size=0),
     "kernel_block_size=0: a block holds a positive number of tokens"),
    (lambda: _one_tensor_spec(dtype="float64"),
     f"dtype='float64' is not a KV dtype this torch supports; use one of {', '.join(DTYPES)}"),
    (lambda: CacheSpec(num_blocks=4, tensors=()),
     "tensors=(): a cache needs at least one TensorSpec to hold its pages"),
    (lambda: CacheSpec(num_blocks=4, tensors=(TensorSpec(("a", "b"), "float32", (4,)),
                                               TensorSpec(("c", "a"), "float32", (4,)))),
     "layer 'a' is bound to tensors 0 and 1; a layer has one KV tensor: to share a tensor, list "
     "both layers in one TensorSpec.layers"),
    (lambda: _one_tensor_spec(layers=("x", "x")),
     "layers=('x', 'x') names a layer twice; list each layer once"),
    (lambda: _one_tensor_spec(layers="x"),
     "layers='x' is a string; pass a tuple of layer names, e.g. ('x',)"),
    (lambda: _one_tensor_spec(layers=()),
     "layers=(): a tensor needs at least one layer name bound to it"),
    (lambda: _one_tensor_spec(block_shape=(4, 0, 4)),
     "block_shape=(4, 0, 4): every dimension of a page must be a positive int, e.g. "
     "(16, 8, 128) = tokens x heads x head_size"),
    (lambda: CacheSpec(num_blocks=4, tensors=_one_tensor_spec().tensors, guard_words=0),
     "guard_words=0: use at least 1 so a write just past a page lands in a guard and is seen"),
    (lambda: build_cache(geometry("tiny"), fill="nan"),
     "fill='nan': pages start as 'poison' (NaN bits) or 'zero'"),
    (lambda: geometry("huge"),
     f"geometry 'huge' does not exist; use one of {', '.join(sorted(GEOMETRIES))}"),
]


@pytest.mark.parametrize("make, message", BAD_SPECS, ids=[m[:40] for _, m in BAD_SPECS])
def test_a_bad_spec_is_refused_with_a_message_naming_the_value_and_the_fix(make, message):
    with pytest.raises(CacheSpecError, match=rf"^{re.escape(message)}$"):
        make()


def test_block_ids_outside_the_cache_are_refused_by_name():
    cache = build_cache(geometry("tiny"))
    with pytest.raises(RuntimeUsageError,
                       match=r"^block id 8 is out of range for a cache of 8 blocks "
                             r"\(valid: 0\.\.7\)$"):
        cache.poison([1, 8])
    with pytest.raises(RuntimeUsageError,
                       match=r"^value=4294967296 is not an int32 word; use an int in "
                             r"-2\*\*31 \.\. 2\*\*32 - 1$"):
        cache.fill_pages([1], 2**32)


# -- presets -----------------------------------------------------------------------------------


def test_geometry_names_are_sorted_and_tiny_is_the_smallest_preset():
    names = geometry_names()
    assert names == sorted(GEOMETRIES) and set(names) >= {
        "tiny", "kv_outer_bf16", "block_outer_fp8", "shared_layers", "ratio2", "mla_indexer",
        "packed", "mixed_dtypes"}
    sizes = {n: sum(r.numel() for r in build_cache(geometry(n)).raws) for n in names}
    assert min(sizes, key=sizes.get) == "tiny"
    assert all(geometry(n).name == n for n in names)


def test_fill_pages_takes_lists_tuples_and_tensors_alike_and_names_a_bad_id():
    by_list, by_tensor = build_cache(geometry("tiny")), build_cache(geometry("tiny"))
    by_list.fill_pages([1, 3], 7)
    by_list.fill_pages((5,), 7)
    by_tensor.fill_pages(torch.tensor([1, 3, 5]), 7)
    assert all(torch.equal(a, b) for a, b in zip(by_list.raws, by_tensor.raws))
    with pytest.raises(RuntimeUsageError, match=r"^block id 8 is out of range for a cache of 8 blocks \(valid: 0..7\)$"):
        by_list.fill_pages([1, 8], 7)
    with pytest.raises(RuntimeUsageError, match=r"^block id -1 is out of range"):
        by_list.fill_pages((-1,), 7)


def test_element_size_matches_torch_for_every_dtype():
    for name in DTYPES:
        spec = TensorSpec(("layer",), name, (16, 1, 8))
        assert spec.element_size == torch.empty((), dtype=spec.torch_dtype).element_size()
