"""The effect models of the ops the engines' KV transfer code calls (:mod:`racecheck.custom_ops`).

Each op is said once, as the list of raw copies it makes (source address, destination address,
bytes), computed from its arguments as its CUDA code computes them; the model declares each
copy's source read and destination written (and its index tensors and pointer tables read), and
the reference implementation makes the same copies, on host memory or on the CUDA device they lie
in, on the caller's current stream (:mod:`racecheck.raw_copies`). A form the op does not take (an
LMCache KV format its kernel's switch has no case for, a negative page index its kernel would turn
into an address before the buffer) is refused in one line that names it, never guessed.

Each engine's code was read at a pinned version:

* vLLM 0.33.0 (its PyPI sdist, sha256 ``f4c33c25...``), ``csrc/cache_kernels.cu`` and
  ``csrc/torch_bindings.cpp``: ``_C_cache_ops::swap_blocks`` (the 4-argument form, which takes
  ``block_size_in_bytes``), ``_C_cache_ops::swap_blocks_batch``;
* SGLang: sgl-project/sglang ``sgl-kernel/csrc/kvcacheio/transfer.cu`` @ ``74c2e5bacd0d`` (2026-04-24),
  whose 13 ``sgl_kernel::transfer_kv_*`` schemas are those sglang-kernel 0.4.10 registers (its wheel,
  sha256 ``043cbe4a...``; the version sglang 0.5.23 requires): every one SGLang's host pools call;
* LMCache ``csrc/mp_mem_kernels.cu`` (0.4.7 to 0.5.3, where the op is ``lmcache.c_ops.
  multi_layer_block_kv_transfer``; ``csrc/cuda/mp_mem_kernels.cu`` of 0.5.4 to 0.5.6 computes the same
  addresses), its ``EngineKVFormat`` from ``csrc/engine_kv_format.h`` of 0.5.6 (PyPI sdists; 0.5.3's
  sha256 ``aa2e1313...``, 0.5.6's ``d6951e60...``): every format the kernel's switch takes.

docs/sanitizer.md ("Custom ops") has the table of forms.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from racecheck.effects import EffectModel, Effects, copy_runs, reference_values, register

Copies = list[tuple[int, int, int]]  # (source address, destination address, bytes)
Values = Callable[[torch.Tensor], list[int]]


def _model(name: str, schema: str | None, copies: Callable[..., Copies], tables: Callable[..., list[Any]],
           extension: str = "", params: tuple[str, ...] = (), attributes: dict[str, Any] | None = None) -> None:
    """Register ``name``: ``copies(values, *args)`` says its copies, ``tables(*args)`` the index
    tensors and pointer tables it reads (tensors) or ``(address, bytes)`` pairs."""

    def effects(fx: Effects, *args: Any) -> None:
        for table in tables(*args):
            if isinstance(table, torch.Tensor):
                fx.read(table)
            elif table is not None:
                fx.read(*table)
        for src, dst, nbytes in copies(fx.values, *args):
            fx.read(src, nbytes)
            fx.write(dst, nbytes)

    def reference(*args: Any) -> None:
        # The copies the op's kernel makes, made on the host or the device their bytes lie in, on
        # the current stream; device-held indices as the active tool knows them (racecheck.effects).
        copy_runs(copies(reference_values, *args), args)

    register(EffectModel(name, effects, reference, schema, params, attributes or {}, extension))


def coalesced(copies: Copies) -> Copies:
    """``copies`` with each one that continues the one before it on both sides joined to it (the
    same bytes moved; fewer, longer runs for the tools to resolve)."""
    joined: Copies = []
    for src, dst, nbytes in copies:
        if joined and nbytes > 0:
            last_src, last_dst, last_n = joined[-1]
            if last_src + last_n == src and last_dst + last_n == dst:
                joined[-1] = (last_src, last_dst, last_n + nbytes)
                continue
        joined.append((src, dst, nbytes))
    return joined


# -- vLLM (vllm._C, csrc/cache_kernels.cu) -------------------------------------------------------------

def _swap_blocks(values: Values, src: torch.Tensor, dst: torch.Tensor, block_size_in_bytes: int,
                 block_mapping: torch.Tensor) -> Copies:
    # One cudaMemcpyAsync per row (s, d) of the host mapping: block_size_in_bytes from
    # src.data_ptr() + s * block_size_in_bytes to dst.data_ptr() + d * block_size_in_bytes. The
    # block's offset is the size passed, not dim 0's stride: a caller passing less than the stride
    # (the K half of each [NB, 2, ...] block, say) lands on other blocks' bytes, as on the GPU.
    flat = values(block_mapping)
    size = int(block_size_in_bytes)
    return [(src.data_ptr() + s * size, dst.data_ptr() + d * size, size) for s, d in zip(flat[0::2], flat[1::2])]


def _swap_blocks_batch(values: Values, src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor,
                       is_src_access_order_any: bool = False) -> Copies:
    # One cuMemcpyBatchAsync (a cudaMemcpyAsync loop where the driver lacks it): sizes[i] bytes from
    # src_ptrs[i] to dst_ptrs[i], host tables of int64 (uint64 on XPU).
    return list(zip(values(src_ptrs), values(dst_ptrs), values(sizes)))


_model("_C_cache_ops::swap_blocks",
       "swap_blocks(Tensor src, Tensor! dst, int block_size_in_bytes, Tensor block_mapping) -> ()",
       _swap_blocks, lambda src, dst, size, mapping: [mapping], extension="vllm._C")
_model("_C_cache_ops::swap_blocks_batch",
       "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, bool is_src_access_order_any=False) -> ()",
       _swap_blocks_batch, lambda src, dst, sizes, *_: [src, dst, sizes], extension="vllm._C")


# -- SGLang (sgl_kernel kvcacheio, sgl-kernel/csrc/kvcacheio/transfer.cu) --------------------------------
#
# The warp kernels (transfer_kernel_impl, transfer_page_head_kernel_impl) copy, for item i, page
# src_indices[i] to page dst_indices[i] of every layer they cover, K then V (K only for MLA). The
# offset functions below are the kernel's, in bytes (item_size and the layout dims are bytes).

Offset = Callable[[int, int, int], int]  # (layer, page, head) -> address


def _lf(base: int, layer_dim: int, item_size: int, head_bytes: int = 0) -> Offset:
    """``get_global_offset_lf`` (layer first); with ``head_bytes`` (``item_size / head_num``)
    ``get_global_offset_per_head_lf``, the head's bytes within the item."""
    return lambda layer, page, head: base + layer * layer_dim + page * item_size + head_bytes * head


def _pf(base: int, page_dim: int, item_size: int) -> Offset:
    """``get_global_offset_pf`` (page first: [pages, layers, item])."""
    return lambda layer, page, head: base + page * page_dim + layer * item_size


def _tbl(addresses: list[int], item_size: int, head_bytes: int = 0) -> Offset:
    """``get_global_offset_lf_tbl``, a layer's base from a device table of layer addresses; with
    ``head_bytes``, ``get_global_offset_per_head_lf_tbl``."""
    return lambda layer, page, head: addresses[layer] + page * item_size + head_bytes * head


def _ph(base: int, page_dim: int, item_size: int, page_size: int, head_num: int) -> Offset:
    """``get_global_offset_ph`` (page head: [pages, heads, page_size, layers, head_dim]), its terms
    evaluated left to right as C++ does."""
    def at(layer: int, page: int, head: int) -> int:
        return (base + page // page_size * page_size * page_dim + page_dim // head_num * head * page_size
                + page % page_size * page_dim // head_num + layer * item_size // head_num)
    return at


def _pairs(values: Values, src_indices: torch.Tensor, dst_indices: torch.Tensor) -> list[tuple[int, int]]:
    return list(zip(values(src_indices), values(dst_indices)))


def _checked(op: str, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``pairs`` (the source and destination page of each item), the op's kernel reading them as
    they are: a negative one addresses memory before the buffer, refused here rather than copied."""
    for i, (s, d) in enumerate(pairs):
        if s < 0 or d < 0:
            raise ValueError(f"sgl_kernel::{op}: item {i} has page index {min(s, d)}: the kernel does not skip "
                             f"negative indices, it addresses memory before the buffer")
    return pairs


def _warp(values: Values, op: str, planes: list[tuple[Offset, Offset]], src_indices: torch.Tensor,
          dst_indices: torch.Tensor, layers: range, item_size: int, heads: int = 1) -> Copies:
    """``transfer_kernel_impl``: item by item, layer by layer, each plane (K, V) its item; with
    ``heads``, ``transfer_page_head_kernel_impl``: head by head, ``item_size / heads`` bytes each.
    ``transfer_item_warp`` moves whole 8-byte words: a head of 12 bytes moves 8."""
    if item_size % 8:
        raise ValueError(f"sgl_kernel::{op} refuses item_size {item_size}: item byte size must be divisible by 8")
    nbytes = item_size // heads // 8 * 8
    return coalesced([(src_at(layer, s, head), dst_at(layer, d, head), nbytes)
                      for s, d in _checked(op, _pairs(values, src_indices, dst_indices))
                      for layer in layers for head in range(heads) for src_at, dst_at in planes])


def _table(values: Values, op: str, table: torch.Tensor, num_layers: int) -> list[int]:
    """A device table of layer addresses, as the all-layer launchers check it against ``num_layers``."""
    addresses = values(table)
    if len(addresses) != num_layers:
        raise ValueError(f"sgl_kernel::{op}: a table of {len(addresses)} layer addresses for num_layers {num_layers}")
    return addresses


def _per_layer(values, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, *_):
    planes = [(_lf(src_k.data_ptr(), 0, item_size), _lf(dst_k.data_ptr(), 0, item_size)),
              (_lf(src_v.data_ptr(), 0, item_size), _lf(dst_v.data_ptr(), 0, item_size))]
    return _warp(values, "transfer_kv_per_layer", planes, src_indices, dst_indices, range(1), item_size)


def _per_layer_mla(values, src, dst, src_indices, dst_indices, item_size, *_):
    planes = [(_lf(src.data_ptr(), 0, item_size), _lf(dst.data_ptr(), 0, item_size))]
    return _warp(values, "transfer_kv_per_layer_mla", planes, src_indices, dst_indices, range(1), item_size)


def _per_layer_pf_lf(values, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                     src_layout_dim, *_):
    # The destination is one layer's buffer (its layer_dim 0); the page-first source is offset by the layer.
    planes = [(_pf(src_k.data_ptr(), src_layout_dim, item_size), _lf(dst_k.data_ptr(), 0, item_size)),
              (_pf(src_v.data_ptr(), src_layout_dim, item_size), _lf(dst_v.data_ptr(), 0, item_size))]
    return _warp(values, "transfer_kv_per_layer_pf_lf", planes, src_indices, dst_indices,
                 range(layer_id, layer_id + 1), item_size)


def _per_layer_mla_pf_lf(values, src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, *_):
    planes = [(_pf(src.data_ptr(), src_layout_dim, item_size), _lf(dst.data_ptr(), 0, item_size))]
    return _warp(values, "transfer_kv_per_layer_mla_pf_lf", planes, src_indices, dst_indices,
                 range(layer_id, layer_id + 1), item_size)


def _per_layer_ph_lf(values, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                     src_layout_dim, page_size, head_num, *_):
    head_bytes = item_size // head_num
    planes = [(_ph(src.data_ptr(), src_layout_dim, item_size, page_size, head_num),
               _lf(dst.data_ptr(), 0, item_size, head_bytes)) for src, dst in ((src_k, dst_k), (src_v, dst_v))]
    return _warp(values, "transfer_kv_per_layer_ph_lf", planes, src_indices, dst_indices,
                 range(layer_id, layer_id + 1), item_size, heads=head_num)


def _all_layer(values, src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices,
               item_size, num_layers, *_):
    op = "transfer_kv_all_layer"
    planes = [(_tbl(_table(values, op, src, num_layers), item_size), _tbl(values(dst), item_size))
              for src, dst in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers))]
    return _warp(values, op, planes, src_indices, dst_indices, range(num_layers), item_size)


def _all_layer_mla(values, src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, *_):
    op = "transfer_kv_all_layer_mla"
    planes = [(_tbl(_table(values, op, src_layers, num_layers), item_size), _tbl(values(dst_layers), item_size))]
    return _warp(values, op, planes, src_indices, dst_indices, range(num_layers), item_size)


def _all_layer_lf_pf(values, src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                     dst_layout_dim, num_layers, *_):
    op = "transfer_kv_all_layer_lf_pf"
    planes = [(_tbl(_table(values, op, src, num_layers), item_size), _pf(dst.data_ptr(), dst_layout_dim, item_size))
              for src, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v))]
    return _warp(values, op, planes, src_indices, dst_indices, range(num_layers), item_size)


def _all_layer_mla_lf_pf(values, src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim,
                         num_layers, *_):
    op = "transfer_kv_all_layer_mla_lf_pf"
    planes = [(_tbl(_table(values, op, src_layers, num_layers), item_size),
               _pf(dst.data_ptr(), dst_layout_dim, item_size))]
    return _warp(values, op, planes, src_indices, dst_indices, range(num_layers), item_size)


def _all_layer_lf_ph(values, src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                     dst_layout_dim, num_layers, page_size, head_num, *_):
    op, head_bytes = "transfer_kv_all_layer_lf_ph", item_size // head_num
    planes = [(_tbl(_table(values, op, src, num_layers), item_size, head_bytes),
               _ph(dst.data_ptr(), dst_layout_dim, item_size, page_size, head_num))
              for src, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v))]
    return _warp(values, op, planes, src_indices, dst_indices, range(num_layers), item_size, heads=head_num)


# The copy-engine ("direct") ops read their indices on the host (``indices.cpu()``) and copy whole
# rows of dim 0: ``transfer_page_direct`` is ``dst.slice(0, d, d + n).copy_(src.slice(0, s, s + n))``.

View = tuple[int, tuple[int, ...], tuple[int, ...], int]  # (address, sizes, strides in elements, item bytes)


def _rows(tensor: torch.Tensor, start: int, count: int, op: str) -> View:
    """Rows ``start .. start + count - 1`` of ``tensor``, from its strides (no torch op: a tool may
    be dispatching)."""
    if start < 0 or start + count > tensor.shape[0]:
        raise ValueError(f"sgl_kernel::{op}: rows {start}..{start + count - 1} are outside a buffer of "
                         f"{tensor.shape[0]} rows")
    size = tensor.element_size()
    return (tensor.data_ptr() + start * tensor.stride(0) * size, (count, *tensor.shape[1:]), tuple(tensor.stride()),
            size)


def _view_copies(src: View, dst: View, op: str) -> Copies:
    """``dst.copy_(src)`` of two views of one shape and item size, as byte copies (element by
    element where a view is not dense, then joined)."""
    (src_at, sizes, src_strides, size), (dst_at, dst_sizes, dst_strides, dst_size) = src, dst
    if sizes != dst_sizes or size != dst_size:
        raise ValueError(f"sgl_kernel::{op}: {sizes} elements of {size} bytes copied into {dst_sizes} of "
                         f"{dst_size}: kvzero models byte-for-byte copies only")
    count = 1
    for n in sizes:
        count *= n
    if _dense(sizes, src_strides) and _dense(sizes, dst_strides):
        return [(src_at, dst_at, count * size)] if count else []
    return coalesced([(src_at + _offset(index, src_strides) * size, dst_at + _offset(index, dst_strides) * size, size)
                      for index in itertools.product(*(range(n) for n in sizes))])


def _dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    expected = 1
    for n, stride in reversed(list(zip(sizes, strides))):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True


def _offset(index: Sequence[int], strides: Sequence[int]) -> int:
    return sum(i * s for i, s in zip(index, strides))


def _whole_pages(op: str, pairs: list[tuple[int, int]], page_size: int) -> None:
    if page_size <= 0 or len(pairs) % page_size:
        raise ValueError(f"sgl_kernel::{op}: {len(pairs)} indices for pages of {page_size}: the op takes whole pages")


def _direct(values, src_layers, dst_layers, src_indices, dst_indices, page_size):
    # transfer_kv_direct: indices that step by one on both sides make one run, copied once per layer.
    op = "transfer_kv_direct"
    pairs = _checked(op, _pairs(values, src_indices, dst_indices))
    _whole_pages(op, pairs, page_size)
    copies: Copies = []
    start = 0
    for i in range(len(pairs)):
        if i + 1 < len(pairs) and pairs[i + 1][0] - pairs[i][0] == 1 and pairs[i + 1][1] - pairs[i][1] == 1:
            continue
        (s, d), count = pairs[start], i + 1 - start
        for src, dst in zip(src_layers, dst_layers):
            copies += _view_copies(_rows(src, s, count, op), _rows(dst, d, count, op), op)
        start = i + 1
    return copies


def _page_first_direct(values, op: str, src_ptrs, dst_ptrs, src_indices, dst_indices, start_layer: int,
                       page_size: int, lf_to_pf: bool) -> Copies:
    """``transfer_kv_page_first_direct_impl`` as its batch (cudaMemcpyBatchAsync, CUDA 12.8+) copies:
    a page per layer and plane, from the first index of each page, addressed from the strides of the
    first buffer of each side (the page-first side: [pages, layers, page_size, ...] per plane). Its
    fallback (ROCm, older drivers) copies the same bytes where a host page row has the device row's
    stride, as SGLang's page-first-direct pools lay them out."""
    pairs = _pairs(values, src_indices, dst_indices)
    _whole_pages(op, pairs, page_size)
    paged, layered = (dst_ptrs, src_ptrs) if lf_to_pf else (src_ptrs, dst_ptrs)
    mla = len(paged) == 1
    num_layers = len(layered) if mla else len(layered) // 2
    size = paged[0].element_size()
    page_stride, layer_stride = paged[0].stride(0) * size, paged[0].stride(1) * size
    row = layered[0].stride(0) * size
    copies: Copies = []
    for s, d in _checked(op, pairs[::page_size]):
        page, token = (d // page_size, s) if lf_to_pf else (s // page_size, d)
        for j in range(num_layers):
            for plane in range(1 if mla else 2):
                flat = layered[j + plane * num_layers].data_ptr() + token * row
                boxed = paged[plane].data_ptr() + page * page_stride + (start_layer + j) * layer_stride
                copies.append((flat, boxed, page_size * row) if lf_to_pf else (boxed, flat, page_size * row))
    return copies


def _per_layer_direct_pf_lf(values, src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    return _page_first_direct(values, "transfer_kv_per_layer_direct_pf_lf", src_ptrs, dst_ptrs, src_indices,
                              dst_indices, layer_id, page_size, lf_to_pf=False)


def _all_layer_direct_lf_pf(values, src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    return _page_first_direct(values, "transfer_kv_all_layer_direct_lf_pf", src_ptrs, dst_ptrs, src_indices,
                              dst_indices, 0, page_size, lf_to_pf=True)


_TAIL = "int block_quota, int num_warps_per_block) -> ()"
_KV = "Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, Tensor src_indices, Tensor dst_indices, "
_SGL = {  # name: (schema, copies, which arguments are index tensors or pointer tables)
    "transfer_kv_per_layer": (f"({_KV}int item_size, {_TAIL}", _per_layer, (4, 5)),
    "transfer_kv_per_layer_pf_lf": (f"({_KV}int layer_id, int item_size, int src_layout_dim, {_TAIL}",
                                    _per_layer_pf_lf, (4, 5)),
    "transfer_kv_per_layer_ph_lf": (f"({_KV}int layer_id, int item_size, int src_layout_dim, int page_size, "
                                    f"int head_num, {_TAIL}", _per_layer_ph_lf, (4, 5)),
    "transfer_kv_per_layer_mla": (f"(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, int item_size, "
                                  f"{_TAIL}", _per_layer_mla, (2, 3)),
    "transfer_kv_per_layer_mla_pf_lf": ("(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, "
                                        f"int layer_id, int item_size, int src_layout_dim, {_TAIL}",
                                        _per_layer_mla_pf_lf, (2, 3)),
    "transfer_kv_all_layer": ("(Tensor src_k_layers, Tensor dst_k_layers, Tensor src_v_layers, Tensor dst_v_layers, "
                              f"Tensor src_indices, Tensor dst_indices, int item_size, int num_layers, {_TAIL}",
                              _all_layer, (0, 1, 2, 3, 4, 5)),
    "transfer_kv_all_layer_lf_pf": ("(Tensor src_k_layers, Tensor dst_k, Tensor src_v_layers, Tensor dst_v, "
                                    "Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, "
                                    f"int num_layers, {_TAIL}", _all_layer_lf_pf, (0, 2, 4, 5)),
    "transfer_kv_all_layer_lf_ph": ("(Tensor src_k_layers, Tensor dst_k, Tensor src_v_layers, Tensor dst_v, "
                                    "Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, "
                                    f"int num_layers, int page_size, int head_num, {_TAIL}", _all_layer_lf_ph,
                                    (0, 2, 4, 5)),
    "transfer_kv_all_layer_mla": ("(Tensor src_layers, Tensor dst_layers, Tensor src_indices, Tensor dst_indices, "
                                  f"int item_size, int num_layers, {_TAIL}", _all_layer_mla, (0, 1, 2, 3)),
    "transfer_kv_all_layer_mla_lf_pf": ("(Tensor src_layers, Tensor dst, Tensor src_indices, Tensor dst_indices, "
                                        f"int item_size, int dst_layout_dim, int num_layers, {_TAIL}",
                                        _all_layer_mla_lf_pf, (0, 2, 3)),
    "transfer_kv_direct": ("(Tensor[] src_layers, Tensor[] dst_layers, Tensor src_indices, Tensor dst_indices, "
                           "int page_size) -> ()", _direct, (2, 3)),
    "transfer_kv_per_layer_direct_pf_lf": ("(Tensor[] src_ptrs, Tensor[] dst_ptrs, Tensor src_indices, "
                                           "Tensor dst_indices, int layer_id, int page_size) -> ()",
                                           _per_layer_direct_pf_lf, (2, 3)),
    "transfer_kv_all_layer_direct_lf_pf": ("(Tensor[] src_ptrs, Tensor[] dst_ptrs, Tensor src_indices, "
                                           "Tensor dst_indices, int page_size) -> ()", _all_layer_direct_lf_pf, (2, 3)),
}
for _name, (_schema, _copies, _read) in _SGL.items():
    _model(f"sgl_kernel::{_name}", _name + _schema, _copies,
           (lambda read: lambda *args: [args[i] for i in read])(_read), extension="sgl_kernel")


# -- LMCache (lmcache.c_ops, a pybind module; csrc/mp_mem_kernels.cu) ------------------------------------

class TransferDirection(enum.IntEnum):
    """LMCache's ``TransferDirection`` (the stand-in module's, where the extension is absent)."""
    H2D = 0
    D2H = 1


class GPUKVFormat(enum.IntEnum):
    """LMCache's ``EngineKVFormat`` (``GPUKVFormat`` before 0.5.0, an alias since), numbered as
    ``csrc/engine_kv_format.h`` of LMCache 0.5.6 numbers it: values only ever appended, so 0 to 16
    are the same in every release; 17 is ``NL_X_TWO_X_NB_BS_HS`` on a vLLM-Ascend branch of LMCache
    (neither 17 is taken by the block transfer kernel). ``_X_`` is a list, ``_`` a dimension."""
    NB_NL_TWO_BS_NH_HS = 0  # vLLM cross-layer: one tensor [NB, NL, 2, BS, NH, HS]
    NL_X_TWO_NB_BS_NH_HS = 1  # vLLM flash attention: NL tensors [2, NB, BS, NH, HS]
    NL_X_NB_TWO_BS_NH_HS = 2  # vLLM FlashInfer: NL tensors [NB, 2, BS, NH, HS]
    NL_X_NB_BS_HS = 3  # vLLM MLA: NL tensors [NB, BS, HS] (kv_size 1)
    TWO_X_NL_X_NBBS_NH_HS = 4  # SGLang MHA: 2*NL tensors [NB*BS, NH, HS], K layers then V layers
    NL_X_NBBS_ONE_HS = 5  # SGLang MLA: NL tensors [NB*BS, 1, HS]
    NL_X_TWO_NB_NH_BS_HS = 6  # vLLM flash attention, HND: NL tensors [2, NB, NH, BS, HS]
    NL_X_NB_TWO_NH_BS_HS = 7  # vLLM FlashInfer, HND: NL tensors [NB, 2, NH, BS, HS]
    NB_NL_TWO_NH_BS_HS = 8  # TRT-LLM cross-layer, HND: one tensor [NB, NL, 2, NH, BS, HS]
    TWO_X_NL_X_NB_BS_NH_HS = 9  # SGLang MHA (MP daemon): 2*NL tensors [NB, BS, NH, HS], K layers then V layers
    NL_X_NB_NH_BS_TWO_HS = 10  # fused K/V, HND: NL tensors [NB, NH, BS, 2*HS] (kv_size 1, hs 2*head_size)
    NL_X_NB_BS_NH_TWO_HS = 11  # fused K/V, NHD: NL tensors [NB, BS, NH, 2*HS] (kv_size 1)
    NL_X_NB_NH_BS_CS = 12  # unified K/V content, HND: NL tensors [NB, NH, BS, CS] (kv_size 1, hs CS)
    NL_X_NB_BS_NH_CS = 13  # unified K/V content, NHD: NL tensors [NB, BS, NH, CS] (kv_size 1)
    NL_X_NB_BSV_BSS = 14  # vLLM DSA indexer: NL tensors [NB, BS*vals | BS*scales] (kv_size 1)
    NL_X_TWO_NB_NH_ONE_BS_HS = 15  # not taken by the block transfer kernel
    NL_X_TWO_X_NB_BS_NH_HS = 16  # vLLM (K, V) tuples per layer: not taken by the block transfer kernel
    NL_X_NP_X_NB_BS_ONE_HS = 17  # vLLM-Ascend plane tuples: not taken by the block transfer kernel
    NL_X_NB_BS_NH_HS = 18  # SGLang unified MP components: NL entries [NB, BS, NH, HS] (0.5.6)


EngineKVFormat = GPUKVFormat


class PageBufferShapeDesc:
    """LMCache's ``PageBufferShapeDesc``: the paged buffer's dims and element size, and the engine's
    padded per-block stride in elements (``block_stride_elems``, 0 for the tight ``bs * nh * hs``)."""

    def __init__(self) -> None:
        self.kv_size = 2
        self.nl = self.nb = self.bs = self.nh = self.hs = 0
        self.element_size = 2
        self.block_stride_elems = 0


# How calculate_engine_global_offset steps to block b's (k_or_v, layer) part, by the kernel's
# if-constexpr chain, and which table entry it starts from (paged_buffer_ptrs[...]).
_CROSS_LAYER = {"NB_NL_TWO_BS_NH_HS", "NB_NL_TWO_NH_BS_HS"}  # ptrs[0]: [NB, NL, kv, block]
_TWO_MAJOR = {"NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS"}  # ptrs[layer]: [kv, NB, block]
_BLOCK_MAJOR = {"NL_X_NB_TWO_BS_NH_HS", "NL_X_NB_TWO_NH_BS_HS"}  # ptrs[layer]: [NB, kv, block]
_KV_LIST = {"TWO_X_NL_X_NBBS_NH_HS", "TWO_X_NL_X_NB_BS_NH_HS"}  # ptrs[kv * NL + layer]: [NB, block]
_PER_LAYER = {"NL_X_NB_BS_HS", "NL_X_NBBS_ONE_HS", "NL_X_NB_NH_BS_TWO_HS", "NL_X_NB_BS_NH_TWO_HS",  # ptrs[layer]:
              "NL_X_NB_NH_BS_CS", "NL_X_NB_BS_NH_CS", "NL_X_NB_BS_NH_HS", "NL_X_NB_BSV_BSS"}  # [NB, block]
# heads before tokens within a block (calculate_engine_local_offset's HND branch)
_HND = {"NB_NL_TWO_NH_BS_HS", "NL_X_TWO_NB_NH_BS_HS", "NL_X_NB_TWO_NH_BS_HS", "NL_X_NB_NH_BS_TWO_HS",
        "NL_X_NB_NH_BS_CS"}
_BLOCKED_SCALE = "NL_X_NB_BSV_BSS"  # a block is [BS x values][BS x 4-byte scales]
TAKEN = frozenset(_CROSS_LAYER | _TWO_MAJOR | _BLOCK_MAJOR | _KV_LIST | _PER_LAYER)
# enum members of some LMCache whose kernel's switch has no case (TORCH_CHECK "Unsupported EngineKVFormat")
REFUSED = frozenset({"NL_X_TWO_NB_NH_ONE_BS_HS", "NL_X_TWO_X_NB_BS_NH_HS", "NL_X_NP_X_NB_BS_ONE_HS",
                     "NL_X_TWO_X_NB_BS_HS"})


def format_name(engine_kv_format: Any) -> str:
    """The name of the KV format a call passes: an enum member by its own name (LMCache's enum, or
    any enum whose member names are LMCache's, whatever its numbering), a bare int by
    :class:`GPUKVFormat`'s numbering."""
    name = getattr(engine_kv_format, "name", None)
    if isinstance(name, str):
        if name in TAKEN:
            return name
        raise _unknown(f"{name} ({int(engine_kv_format)})", name)
    try:
        name = GPUKVFormat(int(engine_kv_format)).name
    except ValueError:
        raise _unknown(repr(engine_kv_format), None) from None
    if name not in TAKEN:
        raise _unknown(f"{name} ({int(engine_kv_format)})", name)
    return name


def _unknown(said: str, name: str | None) -> ValueError:
    known = ", ".join(f.name for f in GPUKVFormat if f.name in TAKEN)
    if name in REFUSED:
        return ValueError(f"LMCache's multi_layer_block_kv_transfer takes no KV format {said}: its kernel's switch "
                          f"has no case for it (it takes {known})")
    return ValueError(f"kvzero has no model of LMCache's KV format {said} (known: {known})")


def _unit(name: str, head_bytes: int) -> int:
    """sizeof(ScalarType): the kernel's copy unit, by which every offset is divided (rounding down)."""
    if head_bytes % 2:
        raise ValueError(f"LMCache's multi_layer_block_kv_transfer refuses head_size * element_size = {head_bytes}: "
                         f"it must be divisible by 2")
    if name == _BLOCKED_SCALE:
        if head_bytes % 4:
            raise ValueError(f"LMCache's multi_layer_block_kv_transfer refuses NL_X_NB_BSV_BSS rows of "
                             f"{head_bytes} bytes: they must be divisible by 4")
        return 4
    return 16 if head_bytes % 16 == 0 else 4 if head_bytes % 4 == 0 else 2


def _engine_block(name: str, kv: int, block: int, layer: int, d: Any, per_block: int) -> tuple[int, int]:
    """(table entry, unit offset of block ``block``'s (kv, layer) part): calculate_engine_global_offset."""
    if name in _CROSS_LAYER:
        return 0, kv * per_block + layer * d.kv_size * per_block + block * d.kv_size * per_block * d.nl
    if name in _TWO_MAJOR:
        return layer, block * per_block + kv * d.nb * per_block
    if name in _BLOCK_MAJOR:
        return layer, block * d.kv_size * per_block + kv * per_block
    if name in _KV_LIST:
        return kv * d.nl + layer, block * per_block
    return layer, block * per_block


def _ints(values: Values, given: Any) -> list[int]:
    """A tensor's integers, or a list's: ints as they are, tensors by their addresses, a nested list
    (LMCache's Python path passes ``[[K layers], [V layers]]``) flattened in order."""
    if isinstance(given, torch.Tensor):
        return values(given)
    found: list[int] = []
    for item in given:
        if isinstance(item, (list, tuple)):
            found += _ints(values, item)
        else:
            found.append(item.data_ptr() if isinstance(item, torch.Tensor) else int(item))
    return found


def _block_copies(name: str, engine: int, lmc: int, d: Any, unit: int) -> list[tuple[int, int, int]]:
    """(engine address, LMCache address, bytes) of one block's (kv, layer) part, token by token and
    head by head as multi_layer_block_transfer_single_block copies them."""
    per_head, per_token = d.hs * d.element_size // unit, d.nh * d.hs * d.element_size // unit
    if name == _BLOCKED_SCALE:  # [BS x vals][BS x scales] against token rows [vals | scale], 4-byte units
        vals = per_token - 1
        return [pair for t in range(d.bs) for pair in (
            (engine + t * vals * unit, lmc + t * per_token * unit, vals * unit),
            (engine + (d.bs * vals + t) * unit, lmc + (t * per_token + vals) * unit, unit))]
    hnd = name in _HND
    return [(engine + (h * d.bs * per_head + t * per_head if hnd else h * per_head + t * per_token) * unit,
             lmc + (h * per_head + t * per_token) * unit, per_head * unit)
            for t in range(d.bs) for h in range(d.nh)]


def _lmcache_copies(values: Values, paged_buffer_ptrs_tensor: Any, lmcache_objects_ptrs: list[Any],
                    block_ids: Any, device: Any, direction: Any, shape_desc: Any, lmcache_chunk_size: int,
                    engine_kv_format: Any, skip_prefix_n_blocks: int | None = 0) -> Copies:
    # multi_layer_block_transfer_kernel: grid (kv_size, blocks, NL); block flat i of object
    # i // blocks_per_object, token rows (i % blocks_per_object) * BS of the object [kv, NL, chunk, NH*HS].
    d, name = shape_desc, format_name(engine_kv_format)
    table, blocks = _ints(values, paged_buffer_ptrs_tensor), _ints(values, block_ids)
    objects = _ints(values, lmcache_objects_ptrs)
    per_object = _per_object(len(blocks), len(objects), d.bs, lmcache_chunk_size)
    unit = _unit(name, d.hs * d.element_size)
    padded = getattr(d, "block_stride_elems", 0)  # LMCache before 0.4.7 has no such field
    elems = padded if padded > 0 else d.bs * d.nh * d.hs
    per_block, per_token = elems * d.element_size // unit, d.nh * d.hs * d.element_size // unit
    to_engine = int(direction) == int(TransferDirection.H2D)
    copies: Copies = []
    for i, block in enumerate(blocks):
        if i < (skip_prefix_n_blocks or 0):
            continue
        if block < 0:
            raise ValueError(f"LMCache's multi_layer_block_kv_transfer: block id {block} (entry {i}) is negative: "
                             f"the kernel addresses memory before the buffer")
        obj, local = divmod(i, per_object)
        for kv in range(d.kv_size):
            for layer in range(d.nl):
                entry, offset = _engine_block(name, kv, block, layer, d, per_block)
                lmc = (local * d.bs + layer * lmcache_chunk_size + kv * d.nl * lmcache_chunk_size) * per_token
                for engine, row, nbytes in _block_copies(name, table[entry] + offset * unit,
                                                         objects[obj] + lmc * unit, d, unit):
                    copies.append((row, engine, nbytes) if to_engine else (engine, row, nbytes))
    return coalesced(copies)


def _per_object(blocks: int, objects: int, block_size: int, chunk: int) -> int:
    """Blocks per LMCache object, as multi_layer_block_kv_transfer_templated checks them (its kernel
    takes up to 4 objects: LMCache's callers send more in groups of 4)."""
    if not 1 <= objects <= 4:
        raise ValueError(f"LMCache's multi_layer_block_kv_transfer refuses {objects} objects: it takes 1 to 4")
    if blocks % objects:
        raise ValueError(f"LMCache's multi_layer_block_kv_transfer refuses {blocks} block ids for {objects} objects: "
                         f"the block ids must divide among the objects")
    if blocks // objects * block_size != chunk:
        raise ValueError(f"LMCache's multi_layer_block_kv_transfer refuses {blocks // objects} blocks of "
                         f"{block_size} tokens per object for lmcache_chunk_size {chunk}: they must be equal")
    return blocks // objects


_LMCACHE_PARAMS = ("paged_buffer_ptrs_tensor", "lmcache_objects_ptrs", "block_ids", "device", "direction",
                   "shape_desc", "lmcache_chunk_size", "engine_kv_format|gpu_kv_format", "skip_prefix_n_blocks")


_model("lmcache.c_ops.multi_layer_block_kv_transfer", None, _lmcache_copies,
       lambda table, objects, block_ids, *_: [t for t in (table, block_ids) if isinstance(t, torch.Tensor)],
       params=_LMCACHE_PARAMS,
       attributes={"TransferDirection": TransferDirection, "GPUKVFormat": GPUKVFormat, "EngineKVFormat": GPUKVFormat,
                   "PageBufferShapeDesc": PageBufferShapeDesc})
