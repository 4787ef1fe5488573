"""The effect models of the ops the engines' KV transfer code calls (:mod:`racecheck.custom_ops`).

Each op is said once, as the list of raw copies it makes (source address, destination address,
bytes), computed from its arguments as its CUDA kernel computes them; the model declares each
copy's source read and destination written (and its index tensors and pointer tables read), and
the reference implementation makes the same copies on CPU memory. Taken from the engines' sources:

* vLLM ``csrc/torch_bindings.cpp`` / ``cache_kernels.cu``: ``_C_cache_ops::swap_blocks`` (block
  ``s`` of ``src`` to block ``d`` of ``dst`` for each row ``(s, d)`` of a host ``block_mapping``,
  ``block_size_in_bytes`` at the stride of dim 0), ``_C_cache_ops::swap_blocks_batch`` (host tables
  of source and destination addresses and sizes: one ``cuMemcpyBatchAsync``);
* SGLang ``sgl-kernel/csrc/kvcacheio/transfer.cu``: ``sgl_kernel::transfer_kv_per_layer`` (and
  ``_mla``, ``_pf_lf``), ``transfer_kv_all_layer`` (and ``_mla``, ``_lf_pf``): item ``src_indices[i]``
  to item ``dst_indices[i]`` (``item_size`` bytes; a negative index is skipped), per layer through
  device ``uint64`` tables of layer base addresses in the all-layer forms;
* LMCache ``csrc/cuda/mp_mem_kernels.cu``: ``lmcache.c_ops.multi_layer_block_kv_transfer`` (a
  pybind function): each engine block ``block_ids[i]`` of every layer, K and V, to or from token
  rows ``i % blocks_per_object`` of LMCache object ``i // blocks_per_object`` (layout ``[2, L, T, NH*HS]``),
  the engine's layers reached through a table of their addresses.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from racecheck.effects import EffectModel, Effects, copy_runs, host_values, register

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
        copy_runs(copies(host_values, *args))

    register(EffectModel(name, effects, reference, schema, params, attributes or {}, extension))


# -- vLLM ------------------------------------------------------------------------------------------

def _swap_blocks(values: Values, src: torch.Tensor, dst: torch.Tensor, block_size_in_bytes: int,
                 block_mapping: torch.Tensor) -> Copies:
    flat = values(block_mapping)
    src_stride = src.stride(0) * src.element_size()
    dst_stride = dst.stride(0) * dst.element_size()
    return [(src.data_ptr() + s * src_stride, dst.data_ptr() + d * dst_stride, int(block_size_in_bytes))
            for s, d in zip(flat[0::2], flat[1::2])]


def _swap_blocks_batch(values: Values, src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor,
                       is_src_access_order_any: bool = False) -> Copies:
    return list(zip(values(src_ptrs), values(dst_ptrs), values(sizes)))


_model("_C_cache_ops::swap_blocks",
       "swap_blocks(Tensor src, Tensor! dst, int block_size_in_bytes, Tensor block_mapping) -> ()",
       _swap_blocks, lambda src, dst, size, mapping: [mapping], extension="vllm._C")
_model("_C_cache_ops::swap_blocks_batch",
       "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, bool is_src_access_order_any=False) -> ()",
       _swap_blocks_batch, lambda src, dst, sizes, *_: [src, dst, sizes], extension="vllm._C")


# -- SGLang (sgl_kernel kvcacheio) ------------------------------------------------------------------

def _items(values: Values, src_indices: torch.Tensor, dst_indices: torch.Tensor) -> list[tuple[int, int]]:
    return [(s, d) for s, d in zip(values(src_indices), values(dst_indices)) if s >= 0 and d >= 0]


def _lf(base: int, layer_dim: int, item_size: int) -> Callable[[int, int], int]:
    return lambda layer, page: base + layer * layer_dim + page * item_size


def _pf(base: int, page_dim: int, item_size: int) -> Callable[[int, int], int]:
    return lambda layer, page: base + page * page_dim + layer * item_size


def _tbl(addresses: list[int], item_size: int) -> Callable[[int, int], int]:
    return lambda layer, page: addresses[layer] + page * item_size


def _transfer(values: Values, pairs: list[tuple[Callable, Callable]], src_indices: torch.Tensor,
              dst_indices: torch.Tensor, layers: range, item_size: int) -> Copies:
    copies: Copies = []
    for s, d in _items(values, src_indices, dst_indices):
        for layer in layers:
            for src_at, dst_at in pairs:
                copies.append((src_at(layer, s), dst_at(layer, d), int(item_size)))
    return copies


def _per_layer(values, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, *_):
    pairs = [(_lf(src_k.data_ptr(), 0, item_size), _lf(dst_k.data_ptr(), 0, item_size)),
             (_lf(src_v.data_ptr(), 0, item_size), _lf(dst_v.data_ptr(), 0, item_size))]
    return _transfer(values, pairs, src_indices, dst_indices, range(1), item_size)


def _per_layer_mla(values, src, dst, src_indices, dst_indices, item_size, *_):
    pairs = [(_lf(src.data_ptr(), 0, item_size), _lf(dst.data_ptr(), 0, item_size))]
    return _transfer(values, pairs, src_indices, dst_indices, range(1), item_size)


def _per_layer_pf_lf(values, src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                     src_layout_dim, *_):
    pairs = [(_pf(src_k.data_ptr(), src_layout_dim, item_size), _lf(dst_k.data_ptr(), 0, item_size)),
             (_pf(src_v.data_ptr(), src_layout_dim, item_size), _lf(dst_v.data_ptr(), 0, item_size))]
    # the destination is one layer's buffer (its layer_dim 0); the page-first source is offset by the layer
    return _transfer(values, pairs, src_indices, dst_indices, range(layer_id, layer_id + 1), item_size)


def _all_layer(values, src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices,
               item_size, num_layers, *_):
    pairs = [(_tbl(values(src_k_layers), item_size), _tbl(values(dst_k_layers), item_size)),
             (_tbl(values(src_v_layers), item_size), _tbl(values(dst_v_layers), item_size))]
    return _transfer(values, pairs, src_indices, dst_indices, range(num_layers), item_size)


def _all_layer_mla(values, src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers, *_):
    pairs = [(_tbl(values(src_layers), item_size), _tbl(values(dst_layers), item_size))]
    return _transfer(values, pairs, src_indices, dst_indices, range(num_layers), item_size)


def _all_layer_lf_pf(values, src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                     dst_layout_dim, num_layers, *_):
    pairs = [(_tbl(values(src_k_layers), item_size), _pf(dst_k.data_ptr(), dst_layout_dim, item_size)),
             (_tbl(values(src_v_layers), item_size), _pf(dst_v.data_ptr(), dst_layout_dim, item_size))]
    return _transfer(values, pairs, src_indices, dst_indices, range(num_layers), item_size)


_TAIL = "int block_quota, int num_warps_per_block) -> ()"
_KV = "Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, Tensor src_indices, Tensor dst_indices, "
_SGL = {
    "transfer_kv_per_layer": (f"({_KV}int item_size, {_TAIL}", _per_layer, (4, 5)),
    "transfer_kv_per_layer_mla": (f"(Tensor src, Tensor dst, Tensor src_indices, Tensor dst_indices, int item_size, {_TAIL}",
                                  _per_layer_mla, (2, 3)),
    "transfer_kv_per_layer_pf_lf": (f"({_KV}int layer_id, int item_size, int src_layout_dim, {_TAIL}",
                                    _per_layer_pf_lf, (4, 5)),
    "transfer_kv_all_layer": ("(Tensor src_k_layers, Tensor dst_k_layers, Tensor src_v_layers, Tensor dst_v_layers, "
                              f"Tensor src_indices, Tensor dst_indices, int item_size, int num_layers, {_TAIL}",
                              _all_layer, (0, 1, 2, 3, 4, 5)),
    "transfer_kv_all_layer_mla": ("(Tensor src_layers, Tensor dst_layers, Tensor src_indices, Tensor dst_indices, "
                                  f"int item_size, int num_layers, {_TAIL}", _all_layer_mla, (0, 1, 2, 3)),
    "transfer_kv_all_layer_lf_pf": ("(Tensor src_k_layers, Tensor dst_k, Tensor src_v_layers, Tensor dst_v, "
                                    "Tensor src_indices, Tensor dst_indices, int item_size, int dst_layout_dim, "
                                    f"int num_layers, {_TAIL}", _all_layer_lf_pf, (0, 2, 4, 5)),
}
for _name, (_schema, _copies, _read) in _SGL.items():
    _model(f"sgl_kernel::{_name}", _name + _schema, _copies,
           (lambda read: lambda *args: [args[i] for i in read])(_read), extension="sgl_kernel")


# -- LMCache (lmcache.c_ops, a pybind module) -------------------------------------------------------

class TransferDirection(enum.IntEnum):
    """LMCache's ``TransferDirection`` (the stand-in module's, where the extension is absent)."""
    H2D = 0
    D2H = 1


class GPUKVFormat(enum.IntEnum):
    """LMCache's ``GPUKVFormat`` / ``EngineKVFormat``: the engine's paged KV layout."""
    NB_NL_TWO_BS_NH_HS = 0  # cross-layer: one tensor [NB, NL, 2, BS, NH, HS]
    NL_X_TWO_NB_BS_NH_HS = 1  # vLLM: NL tensors [2, NB, BS, NH, HS]
    NL_X_NB_TWO_BS_NH_HS = 2  # FlashInfer: NL tensors [NB, 2, BS, NH, HS]
    NL_X_NB_BS_HS = 3  # MLA: NL tensors [NB, BS, HS]
    TWO_X_NL_X_NBBS_NH_HS = 4  # SGLang MHA: 2*NL tensors [NB*BS, NH, HS], K layers then V layers
    NL_X_NBBS_ONE_HS = 5  # SGLang MLA: NL tensors [NB*BS, 1, HS]


class PageBufferShapeDesc:
    """LMCache's ``PageBufferShapeDesc``: the paged buffer's dims and element size."""

    def __init__(self) -> None:
        self.kv_size = 2
        self.nl = self.nb = self.bs = self.nh = self.hs = 0
        self.element_size = 2
        self.block_stride_elems = 0


def _engine_offset(fmt: int, kv: int, block: int, layer: int, d: Any) -> tuple[int, int]:
    """(which table entry, element offset of the block's (BS, NH, HS) part there)."""
    per_block = d.bs * d.nh * d.hs
    if fmt == GPUKVFormat.NB_NL_TWO_BS_NH_HS:
        return 0, kv * per_block + layer * d.kv_size * per_block + block * d.kv_size * per_block * d.nl
    if fmt == GPUKVFormat.NL_X_TWO_NB_BS_NH_HS:
        return layer, block * per_block + kv * d.nb * per_block
    if fmt == GPUKVFormat.NL_X_NB_TWO_BS_NH_HS:
        return layer, block * d.kv_size * per_block + kv * per_block
    if fmt == GPUKVFormat.TWO_X_NL_X_NBBS_NH_HS:
        return kv * d.nl + layer, block * per_block
    if fmt in (GPUKVFormat.NL_X_NB_BS_HS, GPUKVFormat.NL_X_NBBS_ONE_HS):
        return layer, block * per_block
    raise ValueError(f"kvzero has no model of LMCache's KV format {fmt!r} (known: {[f.name for f in GPUKVFormat]})")


def _ints(values: Values, given: Any) -> list[int]:
    """A tensor's integers, or a list's: ints as they are, tensors by their addresses."""
    if isinstance(given, torch.Tensor):
        return values(given)
    return [item.data_ptr() if isinstance(item, torch.Tensor) else int(item) for item in given]


def _lmcache_copies(values: Values, paged_buffer_ptrs_tensor: torch.Tensor, lmcache_objects_ptrs: list[int],
                    block_ids: torch.Tensor, device: Any, direction: Any, shape_desc: Any, lmcache_chunk_size: int,
                    engine_kv_format: Any, skip_prefix_n_blocks: int | None = 0) -> Copies:
    skip_prefix_n_blocks = skip_prefix_n_blocks or 0
    d, fmt = shape_desc, int(engine_kv_format)
    # The binding takes tensors and a list of addresses; LMCache's Python callers also pass a list of
    # layer tensors, a list of block ids and a list of object tensors.
    table = _ints(values, paged_buffer_ptrs_tensor)
    blocks = _ints(values, block_ids)
    objects = [p.data_ptr() if isinstance(p, torch.Tensor) else int(p) for p in lmcache_objects_ptrs]
    per_object = len(blocks) // len(objects)
    per_token = d.nh * d.hs
    nbytes = d.bs * per_token * d.element_size
    to_engine = int(direction) == int(TransferDirection.H2D)
    copies: Copies = []
    for i, block in enumerate(blocks):
        if i < skip_prefix_n_blocks:
            continue
        obj, local = divmod(i, per_object)
        for kv in range(d.kv_size):
            for layer in range(d.nl):
                entry, offset = _engine_offset(fmt, kv, block, layer, d)
                engine = table[entry] + offset * d.element_size
                lmc = objects[obj] + (local * d.bs + layer * lmcache_chunk_size
                                      + kv * d.nl * lmcache_chunk_size) * per_token * d.element_size
                copies.append((lmc, engine, nbytes) if to_engine else (engine, lmc, nbytes))
    return copies


_LMCACHE_PARAMS = ("paged_buffer_ptrs_tensor", "lmcache_objects_ptrs", "block_ids", "device", "direction",
                   "shape_desc", "lmcache_chunk_size", "engine_kv_format|gpu_kv_format", "skip_prefix_n_blocks")


_model("lmcache.c_ops.multi_layer_block_kv_transfer", None, _lmcache_copies,
       lambda table, objects, block_ids, *_: [t for t in (table, block_ids) if isinstance(t, torch.Tensor)],
       params=_LMCACHE_PARAMS,
       attributes={"TransferDirection": TransferDirection, "GPUKVFormat": GPUKVFormat, "EngineKVFormat": GPUKVFormat,
                   "PageBufferShapeDesc": PageBufferShapeDesc})
