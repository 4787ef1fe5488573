"""Every form of every engine transfer op that racecheck/engine_ops.py models, against a byte-level
reference written from the form's layout description (torch indexing of the same tensors).

For each form: tensors in that layout filled with distinct random bytes; the model's reference
implementation run on them; every byte of every tensor compared with what the layout says the op
moves (each destination byte, and nothing else changed); and the model's declared reads and
writes compared with exactly the bytes the layout says are read (the sources and the index and
pointer tables) and written (the destinations). A form the op does not take is one line naming it.
"""

from __future__ import annotations

import enum
import re
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from racecheck import custom_ops
from racecheck.engine_ops import GPUKVFormat, PageBufferShapeDesc, TransferDirection, coalesced, format_name
from racecheck.ranges import byte_runs, merge

MODELS = {model.name: model for model in custom_ops.models()}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
_ON = {"device": "cpu"}  # where the running case's tensors live (the ``device`` fixture)


@pytest.fixture
def device(request: pytest.FixtureRequest):
    _ON["device"] = request.param
    yield request.param
    _ON["device"] = "cpu"


def on_devices(test: Callable) -> Callable:
    """Run ``test`` on the CPU and (where there is one) on a GPU."""
    return pytest.mark.usefixtures("device")(pytest.mark.parametrize("device", DEVICES, indirect=True)(test))
Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (source view, destination view), as the layout says


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` whose bytes are random (distinct from every other tensor's)."""
    generator = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


class Buffers(dict):
    """The tensors of one case by name, each with its own random bytes."""

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.int16) -> torch.Tensor:
        tensor = _random(shape, dtype, seed=len(self) + 1)
        if _ON["device"] != "cpu":  # LMCache's objects are host memory, pinned; the KV cache the device's
            tensor = tensor.pin_memory() if name.startswith("obj") else tensor.to(_ON["device"])
        self[name] = tensor
        return self[name]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def check(op: str, buffers: Buffers, args: tuple, pairs: Callable[[Buffers], Pairs],
          tables: list[torch.Tensor]) -> None:
    """``op`` called with ``args`` over ``buffers`` moves exactly what ``pairs`` says (each
    destination view gets its source view's bytes, nothing else changes), and declares exactly
    those bytes written, and the sources and ``tables`` read."""
    model = MODELS[op]
    want = Buffers({name: tensor.clone() for name, tensor in buffers.items()})
    for src, dst in pairs(want):
        dst.copy_(src.clone())
    moved = pairs(buffers)
    assert moved, "a case that moves nothing checks nothing"
    if _ON["device"] != "cpu" and not op.startswith("_C_cache_ops::"):  # vLLM's read on the host
        on_device = {id(t): t.to(_ON["device"]) for t in tables}
        args = tuple(on_device.get(id(a), a) for a in args)
        tables = list(on_device.values())

    fx = model.declare(args, custom_ops.reference_values)
    assert merge(fx.writes) == merge(run for _, dst in moved for run in byte_runs(dst))
    assert merge(fx.reads) == merge([run for src, _ in moved for run in byte_runs(src)]
                                    + [run for table in tables for run in byte_runs(table)])

    model.reference(*args)
    if _ON["device"] != "cpu":
        torch.cuda.synchronize()
    for name, tensor in buffers.items():
        assert torch.equal(_bytes(tensor), _bytes(want[name])), f"{op}: {name} differs from its layout's reference"


# -- vLLM -------------------------------------------------------------------------------------------------

@on_devices
def test_swap_blocks_copies_whole_blocks_at_their_index_times_the_block_size():
    buffers = Buffers()
    src, dst = buffers.add("src", (6, 4), torch.int32), buffers.add("dst", (6, 4), torch.int32)
    mapping = torch.tensor([[1, 3], [5, 0], [2, 2]])
    check("_C_cache_ops::swap_blocks", buffers, (src, dst, 16, mapping),
          lambda b: [(b["src"][s], b["dst"][d]) for s, d in mapping.tolist()], [mapping])


@on_devices
def test_swap_blocks_steps_by_the_size_it_is_given_not_by_the_stride_of_dim_0():
    # vLLM's cache_kernels.cu: src_ptr + block * block_size_in_bytes. One K plane of a [2, NB, 16]
    # int16 tensor (a view that starts past its storage's first byte), moved in 8-byte blocks: block n
    # is bytes [8n, 8n + 8) of the plane, the second half of row n // 4 where n is odd.
    buffers = Buffers()
    buffers.add("src", (2, 6, 16)), buffers.add("dst", (2, 6, 16))
    mapping = torch.tensor([[1, 4], [7, 0], [10, 11]])

    def blocks(b: Buffers) -> Pairs:
        src, dst = b["src"][1].reshape(-1), b["dst"][1].reshape(-1)
        return [(src[4 * s:4 * s + 4], dst[4 * d:4 * d + 4]) for s, d in mapping.tolist()]

    check("_C_cache_ops::swap_blocks", buffers, (buffers["src"][1], buffers["dst"][1], 8, mapping), blocks, [mapping])


@on_devices
def test_swap_blocks_batch_copies_each_size_from_each_source_address_to_its_destination():
    buffers = Buffers()
    src, dst = buffers.add("src", (8, 8)), buffers.add("dst", (8, 8))
    moves = [(src[2], dst[0]), (src[5, :4], dst[7, 4:]), (src[6:8], dst[3:5])]
    src_ptrs = _addresses([s for s, _ in moves])
    dst_ptrs = _addresses([d for _, d in moves])
    sizes = torch.tensor([s.nbytes for s, _ in moves])
    check("_C_cache_ops::swap_blocks_batch", buffers, (src_ptrs, dst_ptrs, sizes),
          lambda b: [(b["src"][2], b["dst"][0]), (b["src"][5, :4], b["dst"][7, 4:]), (b["src"][6:8], b["dst"][3:5])],
          [src_ptrs, dst_ptrs, sizes])


# -- SGLang (sgl_kernel kvcacheio) -------------------------------------------------------------------------
# SGLang's host pools (python/sglang/srt/mem_cache/pool_host/mha.py): layer_first [L, T, H, D],
# page_first [T, L, H, D], page_first_direct [P, L, page, H, D], page_head [P, H, page, L, D] per K
# and V; the device pool a [T, H, D] buffer per layer and plane. item_size is a token's bytes.

L, T, H, D, PAGE = 2, 12, 2, 4, 4  # int16: a token of one layer is H * D * 2 = 16 bytes
ITEM = H * D * 2
SRC_I, DST_I = torch.tensor([1, 7, 2, 11]), torch.tensor([5, 0, 10, 3])
PAIRS = list(zip(SRC_I.tolist(), DST_I.tolist()))


def _layers(buffers: Buffers, prefix: str, shape: tuple[int, ...] = (T, H, D)) -> list[torch.Tensor]:
    return [buffers.add(f"{prefix}{layer}", shape) for layer in range(L)]


@on_devices
def test_transfer_kv_per_layer_copies_each_token_of_k_and_v():
    b = Buffers()
    args = (b.add("sk", (T, H, D)), b.add("dk", (T, H, D)), b.add("sv", (T, H, D)), b.add("dv", (T, H, D)),
            SRC_I, DST_I, ITEM, 2, 1)
    check("sgl_kernel::transfer_kv_per_layer", b, args,
          lambda b: [(b[f"s{x}"][s], b[f"d{x}"][d]) for s, d in PAIRS for x in "kv"], [SRC_I, DST_I])


@on_devices
def test_transfer_kv_per_layer_mla_copies_each_token_of_the_latent_buffer():
    b = Buffers()
    args = (b.add("s", (T, 1, 12)), b.add("d", (T, 1, 12)), SRC_I, DST_I, 24, 2, 1)
    check("sgl_kernel::transfer_kv_per_layer_mla", b, args,
          lambda b: [(b["s"][s], b["d"][d]) for s, d in PAIRS], [SRC_I, DST_I])


@on_devices
def test_transfer_kv_per_layer_pf_lf_reads_one_layer_of_a_page_first_host_pool():
    b = Buffers()
    args = (b.add("sk", (T, L, H, D)), b.add("dk", (T, H, D)), b.add("sv", (T, L, H, D)), b.add("dv", (T, H, D)),
            SRC_I, DST_I, 1, ITEM, L * ITEM, 2, 1)
    check("sgl_kernel::transfer_kv_per_layer_pf_lf", b, args,
          lambda b: [(b[f"s{x}"][s, 1], b[f"d{x}"][d]) for s, d in PAIRS for x in "kv"], [SRC_I, DST_I])


@on_devices
def test_transfer_kv_per_layer_mla_pf_lf_reads_one_layer_of_a_page_first_latent_pool():
    b = Buffers()
    args = (b.add("s", (T, L, 1, 12)), b.add("d", (T, 1, 12)), SRC_I, DST_I, 1, 24, L * 24, 2, 1)
    check("sgl_kernel::transfer_kv_per_layer_mla_pf_lf", b, args,
          lambda b: [(b["s"][s, 1], b["d"][d]) for s, d in PAIRS], [SRC_I, DST_I])


@on_devices
def test_transfer_kv_per_layer_ph_lf_gathers_each_head_of_one_layer_from_a_page_head_pool():
    b = Buffers()
    host = (T // PAGE, H, PAGE, L, D)
    args = (b.add("sk", host), b.add("dk", (T, H, D)), b.add("sv", host), b.add("dv", (T, H, D)),
            SRC_I, DST_I, 1, ITEM, L * ITEM, PAGE, H, 2, 1)
    check("sgl_kernel::transfer_kv_per_layer_ph_lf", b, args,
          lambda b: [(b[f"s{x}"][s // PAGE, h, s % PAGE, 1], b[f"d{x}"][d, h])
                     for s, d in PAIRS for x in "kv" for h in range(H)], [SRC_I, DST_I])


@on_devices
def test_transfer_kv_all_layer_copies_every_layer_through_tables_of_layer_addresses():
    b = Buffers()
    tables = [_addresses(_layers(b, name)) for name in ("sk", "dk", "sv", "dv")]
    check("sgl_kernel::transfer_kv_all_layer", b, (*tables, SRC_I, DST_I, ITEM, L, 2, 1),
          lambda b: [(b[f"s{x}{layer}"][s], b[f"d{x}{layer}"][d])
                     for s, d in PAIRS for layer in range(L) for x in "kv"],
          [*tables, SRC_I, DST_I])


@on_devices
def test_transfer_kv_all_layer_mla_copies_every_layer_through_tables_of_layer_addresses():
    b = Buffers()
    tables = [_addresses(_layers(b, name, (T, 1, 12))) for name in ("s", "d")]
    check("sgl_kernel::transfer_kv_all_layer_mla", b, (*tables, SRC_I, DST_I, 24, L, 2, 1),
          lambda b: [(b[f"s{layer}"][s], b[f"d{layer}"][d]) for s, d in PAIRS for layer in range(L)],
          [*tables, SRC_I, DST_I])


@on_devices
def test_transfer_kv_all_layer_lf_pf_writes_every_layer_into_a_page_first_host_pool():
    b = Buffers()
    src_k, src_v = _addresses(_layers(b, "sk")), _addresses(_layers(b, "sv"))
    args = (src_k, b.add("dk", (T, L, H, D)), src_v, b.add("dv", (T, L, H, D)), SRC_I, DST_I, ITEM, L * ITEM, L, 2, 1)
    check("sgl_kernel::transfer_kv_all_layer_lf_pf", b, args,
          lambda b: [(b[f"s{x}{layer}"][s], b[f"d{x}"][d, layer])
                     for s, d in PAIRS for layer in range(L) for x in "kv"],
          [src_k, src_v, SRC_I, DST_I])


@on_devices
def test_transfer_kv_all_layer_mla_lf_pf_writes_every_layer_into_a_page_first_latent_pool():
    b = Buffers()
    src = _addresses(_layers(b, "s", (T, 1, 12)))
    args = (src, b.add("d", (T, L, 1, 12)), SRC_I, DST_I, 24, L * 24, L, 2, 1)
    check("sgl_kernel::transfer_kv_all_layer_mla_lf_pf", b, args,
          lambda b: [(b[f"s{layer}"][s], b["d"][d, layer]) for s, d in PAIRS for layer in range(L)],
          [src, SRC_I, DST_I])


@on_devices
def test_transfer_kv_all_layer_lf_ph_scatters_each_head_of_every_layer_into_a_page_head_pool():
    b = Buffers()
    host = (T // PAGE, H, PAGE, L, D)
    src_k, src_v = _addresses(_layers(b, "sk")), _addresses(_layers(b, "sv"))
    args = (src_k, b.add("dk", host), src_v, b.add("dv", host), SRC_I, DST_I, ITEM, L * ITEM, L, PAGE, H, 2, 1)
    check("sgl_kernel::transfer_kv_all_layer_lf_ph", b, args,
          lambda b: [(b[f"s{x}{layer}"][s, h], b[f"d{x}"][d // PAGE, h, d % PAGE, layer])
                     for s, d in PAIRS for layer in range(L) for x in "kv" for h in range(H)],
          [src_k, src_v, SRC_I, DST_I])


@on_devices
def test_a_page_head_transfer_moves_whole_8_byte_words_of_a_head_as_transfer_item_warp_does():
    # heads of 12 bytes (item 24, 2 heads): the kernel's 64-bit copy loop moves the first 8 of each
    b = Buffers()
    host = (T // PAGE, H, PAGE, L, 6)
    args = (b.add("sk", host), b.add("dk", (T, H, 6)), b.add("sv", host), b.add("dv", (T, H, 6)),
            SRC_I, DST_I, 0, 24, L * 24, PAGE, H, 2, 1)
    check("sgl_kernel::transfer_kv_per_layer_ph_lf", b, args,
          lambda b: [(b[f"s{x}"][s // PAGE, h, s % PAGE, 0, :4], b[f"d{x}"][d, h, :4])
                     for s, d in PAIRS for x in "kv" for h in range(H)], [SRC_I, DST_I])


RUN_SRC, RUN_DST = torch.tensor([0, 1, 4, 5, 6, 7, 9, 10]), torch.tensor([2, 3, 8, 9, 10, 11, 0, 1])


@on_devices
def test_transfer_kv_direct_copies_the_rows_of_each_layer_buffer_run_by_run():
    b = Buffers()
    src, dst = _layers(b, "s"), _layers(b, "d")
    check("sgl_kernel::transfer_kv_direct", b, (src, dst, RUN_SRC, RUN_DST, 2),
          lambda b: [(b[f"s{layer}"][s], b[f"d{layer}"][d]) for s, d in zip(RUN_SRC.tolist(), RUN_DST.tolist())
                     for layer in range(L)], [RUN_SRC, RUN_DST])


@on_devices
def test_transfer_kv_direct_copies_rows_of_strided_views_element_by_element():
    # the destination's rows are the first half of wider rows: copy_ writes those halves only
    b = Buffers()
    src, wide = b.add("s", (T, H, D)), b.add("wide", (T, H, 2 * D))
    check("sgl_kernel::transfer_kv_direct", b, ([src], [wide[..., :D]], RUN_SRC, RUN_DST, 2),
          lambda b: [(b["s"][s], b["wide"][d, :, :D]) for s, d in zip(RUN_SRC.tolist(), RUN_DST.tolist())],
          [RUN_SRC, RUN_DST])


PAGE_SRC = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])  # host tokens: pages 2 and 0
PAGE_DST = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3])  # device tokens


@on_devices
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_transfer_kv_per_layer_direct_pf_lf_copies_a_page_of_one_layer_per_plane(mla: bool):
    # a page of the page_first_direct pool, [pages, layers, page, H, D]: page = first index // page
    b = Buffers()
    planes = "k" if mla else "kv"
    host = [b.add(f"h{x}", (T // PAGE, L, PAGE, H, D)) for x in planes]
    dev = [b.add(f"d{x}", (T, H, D)) for x in planes]
    firsts = list(zip(PAGE_SRC.tolist()[::PAGE], PAGE_DST.tolist()[::PAGE]))
    check("sgl_kernel::transfer_kv_per_layer_direct_pf_lf", b, (host, dev, PAGE_SRC, PAGE_DST, 1, PAGE),
          lambda b: [(b[f"h{x}"][s // PAGE, 1], b[f"d{x}"][d:d + PAGE]) for s, d in firsts for x in planes],
          [PAGE_SRC, PAGE_DST])


@on_devices
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_transfer_kv_all_layer_direct_lf_pf_copies_a_page_of_every_layer_per_plane(mla: bool):
    # the device's layer buffers, K layers then V layers, into the page_first_direct pool
    b = Buffers()
    planes = "k" if mla else "kv"
    dev = [b.add(f"d{x}{layer}", (T, H, D)) for x in planes for layer in range(L)]
    host = [b.add(f"h{x}", (T // PAGE, L, PAGE, H, D)) for x in planes]
    firsts = list(zip(PAGE_DST.tolist()[::PAGE], PAGE_SRC.tolist()[::PAGE]))
    check("sgl_kernel::transfer_kv_all_layer_direct_lf_pf", b, (dev, host, PAGE_DST, PAGE_SRC, PAGE),
          lambda b: [(b[f"d{x}{layer}"][s:s + PAGE], b[f"h{x}"][d // PAGE, layer])
                     for s, d in firsts for layer in range(L) for x in planes], [PAGE_DST, PAGE_SRC])


def test_every_transfer_op_sglang_calls_has_a_model_with_the_schema_sglang_kernel_registers():
    # sglang 0.5.23's host pools call these (pool_host/mha.py, mla.py, ...); the schemas as
    # sglang-kernel 0.4.10's common_ops registers them
    called = {"transfer_kv_per_layer", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
              "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_all_layer",
              "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla",
              "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf",
              "transfer_kv_all_layer_direct_lf_pf"}
    assert {name.split("::")[1] for name in MODELS if name.startswith("sgl_kernel::")} == called
    ph = MODELS["sgl_kernel::transfer_kv_per_layer_ph_lf"].schema
    assert ph == ("transfer_kv_per_layer_ph_lf(Tensor src_k, Tensor dst_k, Tensor src_v, Tensor dst_v, "
                  "Tensor src_indices, Tensor dst_indices, int layer_id, int item_size, int src_layout_dim, "
                  "int page_size, int head_num, int block_quota, int num_warps_per_block) -> ()")
    for model in MODELS.values():
        if model.is_torch_op:
            torch._C.parse_schema(f"{model.name.split('::')[0]}::{model.schema}")  # each one parses


@pytest.mark.parametrize(("op", "args", "message"), [
    ("transfer_kv_per_layer_mla", lambda b: (b.add("s", (T, 1, 12)), b.add("d", (T, 1, 12)), torch.tensor([2, -1]),
                                             torch.tensor([1, 4]), 24, 2, 1),
     r"^sgl_kernel::transfer_kv_per_layer_mla: item 1 has page index -1: the kernel does not skip negative indices, "
     r"it addresses memory before the buffer$"),
    ("transfer_kv_per_layer_mla", lambda b: (b.add("s", (T, 1, 6)), b.add("d", (T, 1, 6)), SRC_I, DST_I, 12, 2, 1),
     r"^sgl_kernel::transfer_kv_per_layer_mla refuses item_size 12: item byte size must be divisible by 8$"),
    ("transfer_kv_all_layer_mla", lambda b: (_addresses(_layers(b, "s")), _addresses(_layers(b, "d")), SRC_I, DST_I,
                                             ITEM, 3, 2, 1),
     r"^sgl_kernel::transfer_kv_all_layer_mla: a table of 2 layer addresses for num_layers 3$"),
    ("transfer_kv_direct", lambda b: (_layers(b, "s"), _layers(b, "d"), RUN_SRC[:3], RUN_DST[:3], 2),
     r"^sgl_kernel::transfer_kv_direct: 3 indices for pages of 2: the op takes whole pages$"),
    ("transfer_kv_direct", lambda b: (_layers(b, "s"), _layers(b, "d"), torch.tensor([10, 11]),
                                      torch.tensor([11, 12]), 2),
     r"^sgl_kernel::transfer_kv_direct: rows 11\.\.12 are outside a buffer of 12 rows$"),
])
def test_a_call_the_sgl_kernel_op_would_refuse_or_send_out_of_its_buffers_is_one_line_naming_it(op, args, message):
    b = Buffers()
    given = args(b)
    before = Buffers({name: tensor.clone() for name, tensor in b.items()})
    with pytest.raises(ValueError, match=message):
        MODELS[f"sgl_kernel::{op}"].reference(*given)
    with pytest.raises(ValueError, match=message):
        MODELS[f"sgl_kernel::{op}"].declare(given, custom_ops.host_values)
    assert all(torch.equal(_bytes(b[name]), _bytes(before[name])) for name in b)  # nothing moved


# -- LMCache (lmcache.c_ops.multi_layer_block_kv_transfer) --------------------------------------------------
# Each engine format's layout, as LMCache's csrc/engine_kv_format.h describes it, and the LMCache
# object [kv, NL, chunk, NH * HS]: block i of the call is token rows (i % per_object) * BS of object
# i // per_object. A format's view of block b's (kv, layer) part is token-major [BS, NH, HS].

NL, NB, BS, NH, HS = 2, 5, 2, 2, 4  # int16: a head is 8 bytes (the kernel's 4-byte unit)
BLOCKS = [3, 0, 4, 1]  # two objects of two blocks
OBJECTS, PER_OBJECT = 2, 2
CHUNK = PER_OBJECT * BS


def _form(kv: int, nh: int, hs: int, shapes: Callable[[], list[tuple[str, tuple[int, ...]]]],
          table: Callable[[Buffers], list[torch.Tensor]], view: Callable[[Buffers, int, int, int], torch.Tensor],
          dtype: torch.dtype = torch.int16) -> types.SimpleNamespace:
    """A format: its kv_size and head dims, its tensors, the table of addresses the engine passes
    (in the kernel's order), and block b's (kv, layer) part as a [BS, NH, HS] view."""
    return types.SimpleNamespace(kv=kv, nh=nh, hs=hs, shapes=shapes, table=table, view=view, dtype=dtype)


def _per_layer(shape: tuple[int, ...]) -> Callable[[], list[tuple[str, tuple[int, ...]]]]:
    return lambda: [(f"layer{layer}", shape) for layer in range(NL)]


def _kv_lists(shape: tuple[int, ...]) -> Callable[[], list[tuple[str, tuple[int, ...]]]]:
    return lambda: [(f"{x}{layer}", shape) for x in "kv" for layer in range(NL)]


def _layer_table(b: Buffers) -> list[torch.Tensor]:
    return [b[f"layer{layer}"] for layer in range(NL)]


def _kv_table(b: Buffers) -> list[torch.Tensor]:
    return [b[f"{x}{layer}"] for x in "kv" for layer in range(NL)]


def _hnd(view: torch.Tensor) -> torch.Tensor:
    """An [NH, BS, HS] block part as token-major [BS, NH, HS]."""
    return view.transpose(0, 1)


FORMATS = {
    "NB_NL_TWO_BS_NH_HS": _form(2, NH, HS, lambda: [("all", (NB, NL, 2, BS, NH, HS))], lambda b: [b["all"]],
                                lambda b, k, l, blk: b["all"][blk, l, k]),
    "NL_X_TWO_NB_BS_NH_HS": _form(2, NH, HS, _per_layer((2, NB, BS, NH, HS)), _layer_table,
                                  lambda b, k, l, blk: b[f"layer{l}"][k, blk]),
    "NL_X_NB_TWO_BS_NH_HS": _form(2, NH, HS, _per_layer((NB, 2, BS, NH, HS)), _layer_table,
                                  lambda b, k, l, blk: b[f"layer{l}"][blk, k]),
    "NL_X_NB_BS_HS": _form(1, 1, 12, _per_layer((NB, BS, 12)), _layer_table,
                           lambda b, k, l, blk: b[f"layer{l}"][blk].unsqueeze(1)),
    "TWO_X_NL_X_NBBS_NH_HS": _form(2, NH, HS, _kv_lists((NB * BS, NH, HS)), _kv_table,
                                   lambda b, k, l, blk: b[f"{'kv'[k]}{l}"][blk * BS:(blk + 1) * BS]),
    "NL_X_NBBS_ONE_HS": _form(1, 1, 12, _per_layer((NB * BS, 1, 12)), _layer_table,
                              lambda b, k, l, blk: b[f"layer{l}"][blk * BS:(blk + 1) * BS]),
    "NL_X_TWO_NB_NH_BS_HS": _form(2, NH, HS, _per_layer((2, NB, NH, BS, HS)), _layer_table,
                                  lambda b, k, l, blk: _hnd(b[f"layer{l}"][k, blk])),
    "NL_X_NB_TWO_NH_BS_HS": _form(2, NH, HS, _per_layer((NB, 2, NH, BS, HS)), _layer_table,
                                  lambda b, k, l, blk: _hnd(b[f"layer{l}"][blk, k])),
    "NB_NL_TWO_NH_BS_HS": _form(2, NH, HS, lambda: [("all", (NB, NL, 2, NH, BS, HS))], lambda b: [b["all"]],
                                lambda b, k, l, blk: _hnd(b["all"][blk, l, k])),
    "TWO_X_NL_X_NB_BS_NH_HS": _form(2, NH, HS, _kv_lists((NB, BS, NH, HS)), _kv_table,
                                    lambda b, k, l, blk: b[f"{'kv'[k]}{l}"][blk]),
    # fused K/V: [NB, NH, BS, 2, HS] is [NB, NH, BS, 2 * HS], moved with kv_size 1 and hs 2 * HS
    "NL_X_NB_NH_BS_TWO_HS": _form(1, NH, 2 * HS, _per_layer((NB, NH, BS, 2 * HS)), _layer_table,
                                  lambda b, k, l, blk: _hnd(b[f"layer{l}"][blk])),
    "NL_X_NB_BS_NH_TWO_HS": _form(1, NH, 2 * HS, _per_layer((NB, BS, NH, 2 * HS)), _layer_table,
                                  lambda b, k, l, blk: b[f"layer{l}"][blk]),
    "NL_X_NB_NH_BS_CS": _form(1, NH, 6, _per_layer((NB, NH, BS, 6)), _layer_table,
                              lambda b, k, l, blk: _hnd(b[f"layer{l}"][blk])),
    "NL_X_NB_BS_NH_CS": _form(1, NH, 6, _per_layer((NB, BS, NH, 6)), _layer_table,
                              lambda b, k, l, blk: b[f"layer{l}"][blk]),
    "NL_X_NB_BS_NH_HS": _form(1, NH, HS, _per_layer((NB, BS, NH, HS)), _layer_table,
                              lambda b, k, l, blk: b[f"layer{l}"][blk]),
}


def _lmcache_call(name: str, direction: TransferDirection, buffers: Buffers, form: types.SimpleNamespace, *,
                  engine_kv_format: Any = None, skip: int = 0, block_stride_elems: int = 0,
                  element_size: int = 2) -> tuple[tuple, list[torch.Tensor]]:
    """The call of a transfer context in format ``name`` (LMCache's own enum member unless
    ``engine_kv_format`` is given), and the tables it reads."""
    for tensor, shape in form.shapes():
        buffers.add(tensor, shape, form.dtype)
    for i in range(OBJECTS):
        buffers.add(f"obj{i}", (form.kv, NL, CHUNK, form.nh * form.hs), form.dtype)
    table, block_ids = _addresses(form.table(buffers)), torch.tensor(BLOCKS)
    desc = PageBufferShapeDesc()
    desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs = form.kv, NL, NB, BS, form.nh, form.hs
    desc.element_size, desc.block_stride_elems = element_size, block_stride_elems
    fmt = GPUKVFormat[name] if engine_kv_format is None else engine_kv_format
    objects = [buffers[f"obj{i}"].data_ptr() for i in range(OBJECTS)]
    return (table, objects, block_ids, torch.device("cuda"), direction, desc, CHUNK, fmt, skip), [table, block_ids]


def _block_pairs(form: types.SimpleNamespace, direction: TransferDirection, skip: int = 0,
                 rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Callable[[Buffers], Pairs]:
    """Each block's (kv, layer) part against its token rows of its object, as the layout says."""
    def pairs(b: Buffers) -> Pairs:
        found: Pairs = []
        for i, block in enumerate(BLOCKS):
            if i < skip:
                continue
            obj, local = divmod(i, PER_OBJECT)
            for kv in range(form.kv):
                for layer in range(NL):
                    engine = form.view(b, kv, layer, block)
                    row = b[f"obj{obj}"][kv, layer, local * BS:(local + 1) * BS].reshape(engine.shape)
                    found.append((row, engine) if direction == TransferDirection.H2D else (engine, row))
        return found
    return pairs


DIRECTIONS = [TransferDirection.H2D, TransferDirection.D2H]
OP = "lmcache.c_ops.multi_layer_block_kv_transfer"


@on_devices
@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_lmcache_kv_format_moves_each_block_to_and_from_its_token_rows_of_its_object(name, direction):
    b = Buffers()
    form = FORMATS[name]
    args, tables = _lmcache_call(name, direction, b, form)
    check(OP, b, args, _block_pairs(form, direction), tables)


@on_devices
@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: d.name)
def test_the_dsa_indexer_format_moves_each_tokens_values_and_its_scale_apart(direction):
    # NL_X_NB_BSV_BSS: a block is [BS x 8 value bytes][BS x 4 scale bytes]; a token's object row is
    # its 8 values then its scale (kv_size 1, one "head" of 12 bytes, element size 1)
    view = lambda b, k, l, blk: b[f"layer{l}"][blk]  # noqa: E731
    form = _form(1, 1, 12, _per_layer((NB, BS * 12)), _layer_table, view, dtype=torch.uint8)
    b = Buffers()
    args, tables = _lmcache_call("NL_X_NB_BSV_BSS", direction, b, form, element_size=1)

    def pairs(b: Buffers) -> Pairs:
        found: Pairs = []
        for i, block in enumerate(BLOCKS):
            obj, local = divmod(i, PER_OBJECT)
            for layer in range(NL):
                page, rows = b[f"layer{layer}"][block], b[f"obj{obj}"][0, layer, local * BS:(local + 1) * BS]
                for t in range(BS):
                    for row, engine in ((rows[t, :8], page[t * 8:(t + 1) * 8]),
                                        (rows[t, 8:], page[BS * 8 + t * 4:BS * 8 + (t + 1) * 4])):
                        found.append((row, engine) if direction == TransferDirection.H2D else (engine, row))
        return found

    check(OP, b, args, pairs, tables)


@on_devices
@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: d.name)
def test_a_padded_block_stride_steps_over_the_padding_between_blocks(direction):
    # block_stride_elems (vLLM's padded MLA rows, DeepSeek V4): blocks 12 * BS + 4 elements apart
    stride = BS * 12 + 4
    form = _form(1, 1, 12, _per_layer((NB, stride)), _layer_table,
                 lambda b, k, l, blk: b[f"layer{l}"][blk, :BS * 12].reshape(BS, 1, 12))
    b = Buffers()
    args, tables = _lmcache_call("NL_X_NB_BS_HS", direction, b, form, block_stride_elems=stride)
    check(OP, b, args, _block_pairs(form, direction), tables)


@on_devices
@pytest.mark.parametrize("head_size", [1, 4, 8], ids=["2-byte units", "4-byte units", "16-byte units"])
def test_the_kernels_copy_unit_changes_no_byte_moved(head_size: int):
    form = _form(2, NH, head_size, _per_layer((2, NB, BS, NH, head_size)), _layer_table,
                 lambda b, k, l, blk: b[f"layer{l}"][k, blk])
    b = Buffers()
    args, tables = _lmcache_call("NL_X_TWO_NB_BS_NH_HS", TransferDirection.H2D, b, form)
    check(OP, b, args, _block_pairs(form, TransferDirection.H2D), tables)


@on_devices
def test_the_blocks_before_skip_prefix_n_blocks_are_not_moved():
    form = FORMATS["TWO_X_NL_X_NB_BS_NH_HS"]
    b = Buffers()
    args, tables = _lmcache_call("TWO_X_NL_X_NB_BS_NH_HS", TransferDirection.H2D, b, form, skip=3)
    check(OP, b, args, _block_pairs(form, TransferDirection.H2D, skip=3), tables)


class ProgramsFormat(enum.IntEnum):
    """An enum with LMCache's member names and numbers of its own (as a program's may have)."""
    NL_X_TWO_NB_BS_NH_HS = 4
    TWO_X_NL_X_NB_BS_NH_HS = 17
    NL_X_TWO_X_NB_BS_HS = 9  # a vLLM-Ascend branch's 17: a format the block kernel does not take
    NL_X_SPARSE_PAGES = 1  # no LMCache's


@on_devices
def test_a_format_passed_as_an_enum_member_is_known_by_its_name_whatever_its_number():
    form = FORMATS["TWO_X_NL_X_NB_BS_NH_HS"]
    b = Buffers()
    args, tables = _lmcache_call("TWO_X_NL_X_NB_BS_NH_HS", TransferDirection.D2H, b, form,
                                 engine_kv_format=ProgramsFormat.TWO_X_NL_X_NB_BS_NH_HS)
    check(OP, b, args, _block_pairs(form, TransferDirection.D2H), tables)
    assert format_name(ProgramsFormat.NL_X_TWO_NB_BS_NH_HS) == "NL_X_TWO_NB_BS_NH_HS"


@on_devices
def test_a_bare_int_is_read_by_lmcaches_numbering():
    form = FORMATS["TWO_X_NL_X_NB_BS_NH_HS"]
    b = Buffers()
    args, tables = _lmcache_call("TWO_X_NL_X_NB_BS_NH_HS", TransferDirection.H2D, b, form, engine_kv_format=9)
    check(OP, b, args, _block_pairs(form, TransferDirection.H2D), tables)
    assert [format_name(number) for number in (4, 9, 18)] == [
        "TWO_X_NL_X_NBBS_NH_HS", "TWO_X_NL_X_NB_BS_NH_HS", "NL_X_NB_BS_NH_HS"]


def test_every_member_of_lmcaches_enum_is_modelled_or_refused_as_its_kernel_refuses_it():
    taken = set(FORMATS) | {"NL_X_NB_BSV_BSS"}
    refused = {"NL_X_TWO_NB_NH_ONE_BS_HS", "NL_X_TWO_X_NB_BS_NH_HS", "NL_X_NP_X_NB_BS_ONE_HS"}
    assert {f.name for f in GPUKVFormat} == taken | refused
    assert [f.value for f in GPUKVFormat] == list(range(19))  # csrc/engine_kv_format.h of LMCache 0.5.6


KNOWN = ("NB_NL_TWO_BS_NH_HS, NL_X_TWO_NB_BS_NH_HS, NL_X_NB_TWO_BS_NH_HS, NL_X_NB_BS_HS, TWO_X_NL_X_NBBS_NH_HS, "
         "NL_X_NBBS_ONE_HS, NL_X_TWO_NB_NH_BS_HS, NL_X_NB_TWO_NH_BS_HS, NB_NL_TWO_NH_BS_HS, TWO_X_NL_X_NB_BS_NH_HS, "
         "NL_X_NB_NH_BS_TWO_HS, NL_X_NB_BS_NH_TWO_HS, NL_X_NB_NH_BS_CS, NL_X_NB_BS_NH_CS, NL_X_NB_BSV_BSS, "
         "NL_X_NB_BS_NH_HS")


@pytest.mark.parametrize(("given", "said"), [
    (99, "kvzero has no model of LMCache's KV format 99 (known: {known})"),
    (ProgramsFormat.NL_X_SPARSE_PAGES,
     "kvzero has no model of LMCache's KV format NL_X_SPARSE_PAGES (1) (known: {known})"),
    (GPUKVFormat.NL_X_TWO_X_NB_BS_NH_HS, "LMCache's multi_layer_block_kv_transfer takes no KV format "
                                         "NL_X_TWO_X_NB_BS_NH_HS (16): its kernel's switch has no case for it "
                                         "(it takes {known})"),
    (15, "LMCache's multi_layer_block_kv_transfer takes no KV format NL_X_TWO_NB_NH_ONE_BS_HS (15): its kernel's "
         "switch has no case for it (it takes {known})"),
    (17, "LMCache's multi_layer_block_kv_transfer takes no KV format NL_X_NP_X_NB_BS_ONE_HS (17): its kernel's "
         "switch has no case for it (it takes {known})"),
    (ProgramsFormat.NL_X_TWO_X_NB_BS_HS, "LMCache's multi_layer_block_kv_transfer takes no KV format "
                                         "NL_X_TWO_X_NB_BS_HS (9): its kernel's switch has no case for it "
                                         "(it takes {known})"),
], ids=["unknown-int", "unknown-name", "tuples-16", "15", "17", "ascend-17"])
def test_a_format_the_op_does_not_take_is_one_line_naming_it_and_moves_nothing(given, said):
    form = FORMATS["TWO_X_NL_X_NB_BS_NH_HS"]
    b = Buffers()
    args, _ = _lmcache_call("TWO_X_NL_X_NB_BS_NH_HS", TransferDirection.H2D, b, form, engine_kv_format=given)
    before = Buffers({name: tensor.clone() for name, tensor in b.items()})
    message = said.format(known=KNOWN)
    with pytest.raises(ValueError) as raised:
        MODELS[OP].reference(*args)
    assert str(raised.value) == message and "\n" not in message
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        MODELS[OP].declare(args, custom_ops.host_values)
    assert all(torch.equal(_bytes(b[name]), _bytes(before[name])) for name in b)


@pytest.mark.parametrize(("change", "message"), [
    (lambda args: (*args[:2], args[2][:3], *args[3:]),
     r"^LMCache's multi_layer_block_kv_transfer refuses 3 block ids for 2 objects: the block ids must divide among "
     r"the objects$"),
    (lambda args: (*args[:6], CHUNK + 1, *args[7:]),
     r"^LMCache's multi_layer_block_kv_transfer refuses 2 blocks of 2 tokens per object for lmcache_chunk_size 5: "
     r"they must be equal$"),
    (lambda args: (*args[:2], torch.tensor([3, -2, 4, 1]), *args[3:]),
     r"^LMCache's multi_layer_block_kv_transfer: block id -2 \(entry 1\) is negative: the kernel addresses memory "
     r"before the buffer$"),
    (lambda args: (args[0], args[1] * 3, torch.tensor(BLOCKS * 3), *args[3:]),
     r"^LMCache's multi_layer_block_kv_transfer refuses 6 objects: it takes 1 to 4$"),
], ids=["uneven-objects", "chunk-size", "negative-block", "more-than-4-objects"])
def test_a_call_lmcaches_op_refuses_is_refused_in_one_line(change, message):
    form = FORMATS["NL_X_TWO_NB_BS_NH_HS"]
    b = Buffers()
    args, _ = _lmcache_call("NL_X_TWO_NB_BS_NH_HS", TransferDirection.H2D, b, form)
    with pytest.raises(ValueError, match=message):
        MODELS[OP].reference(*change(args))


def test_copies_that_continue_each_other_on_both_sides_are_joined_and_no_others():
    assert coalesced([(0, 100, 8), (8, 108, 8), (16, 200, 8), (24, 208, 4), (40, 212, 4)]) == [
        (0, 100, 16), (16, 200, 12), (40, 212, 4)]


# -- LMCache's transfer context in format 9, judged by both tools ----------------------------------------

def _format9_pair():
    from sanitizer.bench.engine_shapes import BY_NAME, Pair, Side

    program, example = "tests/lmcache_kv_format9.py", "examples/lmcache_transfer_context.py"
    shown = BY_NAME["lmcache-4830"]
    return Pair("lmcache-4830-format9", "LMCache #4830, the transfer context in KV format 9", shown.kind,
                Side(f"{program}:temporaries_freed_on_return", (program,), marks=(example,)),
                Side(f"{program}:temporaries_synced_before_return", (program, "--fixed")), shown.shape)


@pytest.mark.parametrize("racy", [True, False], ids=["racy", "fixed"])
def test_the_sanitizer_judges_lmcaches_transfer_context_in_format_9_as_in_format_4(racy: bool):
    from sanitizer.bench.engine_shapes import judge_side

    pair = _format9_pair()
    row = judge_side(pair, racy=racy, tool="sanitizer")
    if racy:
        assert (row["verdict"], row.get("lines")) == ("found", "found"), row
        assert pair.kind in row["kinds"], row
    else:
        assert (row["verdict"], row["unfollowed"]) == ("clean", []), row


@pytest.mark.parametrize("racy", [True, False], ids=["racy", "fixed"])
def test_the_fuzzer_judges_lmcaches_transfer_context_in_format_9_with_no_harness_error(racy: bool, monkeypatch):
    from sanitizer.bench.engine_shapes import MAX_TRACE_OPS, judge_side

    monkeypatch.setenv("CI", "true")  # Hypothesis's ci profile: derandomized, as tests/test_engine_shapes.py runs it
    row = judge_side(_format9_pair(), racy=racy, tool="fuzz")
    assert row["harness_errors"] == row["resource_errors"] == 0, row
    if racy:
        assert row["verdict"] == "found" and row["trace_ops"] <= MAX_TRACE_OPS, row
    else:
        assert (row["verdict"], row["found"], row["campaigns"]) == ("clean", 0, 2), row
