"""racecheck.ops and racecheck.triton_stores: what an op or a Triton kernel does to memory.

``indexed_rows`` is checked on the aten calls torch really makes for each Python-level op
(recorded under a dispatch mode), so a change in how torch lowers ``x[i] = v`` shows here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from racecheck.ops import (aliased_returns, copy_kind, host_temporary, index_needs_host, indexed_rows, kind, leaves,
                           map_leaves, op_info, written_args)
from racecheck.triton_stores import kernel_flow

aten = torch.ops.aten


class Recorder(TorchDispatchMode):
    """Every aten call made under it: (op, args, kwargs)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def dispatched(op: Any, run: Callable[[], Any]) -> tuple[tuple, dict]:
    """The args and kwargs of the one call of ``op`` that ``run()`` makes."""
    with Recorder() as recorder:
        run()
    (call,) = [(args, kwargs) for func, args, kwargs in recorder.calls if func is op]
    return call


def rows_of(op: Any, run: Callable[[], Any]) -> tuple[int, int, torch.Tensor, bool] | None:
    args, kwargs = dispatched(op, run)
    return indexed_rows(op, args, kwargs)


def x() -> torch.Tensor:
    return torch.zeros(4, 3)


IDX = torch.tensor([0, 2])


# -- indexed_rows ----------------------------------------------------------------------------------

INDEXED = [  # (what the code says, the aten op torch lowers it to, the code, dim, writes)
    ("index_select along 0", aten.index_select.default, lambda: x().index_select(0, IDX), 0, False),
    ("index_select along 1", aten.index_select.default, lambda: x().index_select(1, IDX), 1, False),
    ("index_select along -1", aten.index_select.default, lambda: x().index_select(-1, IDX), -1, False),
    ("index_copy_", aten.index_copy_.default, lambda: x().index_copy_(0, IDX, torch.ones(2, 3)), 0, True),
    ("index_add_", aten.index_add_.default, lambda: x().index_add_(1, IDX, torch.ones(4, 2)), 1, True),
    ("index_fill_ with a scalar", aten.index_fill_.int_Scalar, lambda: x().index_fill_(1, IDX, 2.0), 1, True),
    ("index_fill_ with a tensor", aten.index_fill_.int_Tensor,
     lambda: x().index_fill_(0, IDX, torch.tensor(2.0)), 0, True),
    ("x[idx]", aten.index.Tensor, lambda: x()[IDX], 0, False),
    ("x[:, idx]", aten.index.Tensor, lambda: x()[:, IDX], 1, False),
    ("x[..., idx] of three dims", aten.index.Tensor, lambda: torch.zeros(2, 3, 4)[..., IDX], 2, False),
    ("x[idx] = v", aten.index_put_.default, lambda: x().__setitem__(IDX, 1.0), 0, True),
    ("x[:, idx] = v", aten.index_put_.default, lambda: x().__setitem__((slice(None), IDX), 1.0), 1, True),
    ("index_put_ accumulating", aten.index_put_.default,
     lambda: x().index_put_((IDX,), torch.ones(2, 3), accumulate=True), 0, True),
]


@pytest.mark.parametrize(("op", "run", "dim", "writes"), [pytest.param(*case[1:], id=case[0]) for case in INDEXED])
def test_indexed_rows_names_the_tensor_dim_and_index_of_an_indexed_op(op, run, dim, writes):
    args, kwargs = dispatched(op, run)
    target, found_dim, index, found_writes = indexed_rows(op, args, kwargs)
    assert target == 0
    assert (found_dim, found_writes) == (dim, writes)
    assert torch.equal(index, IDX)


def test_gather_reads_rows_of_its_input_named_by_its_index():
    index = torch.tensor([[0, 1], [1, 0]])
    assert rows_of(aten.gather.default, lambda: torch.gather(x(), 1, index)) == (0, 1, index, False)


@pytest.mark.parametrize(("op", "value"), [
    (aten.scatter_.src, torch.ones(1, 3)),
    (aten.scatter_.value, 1.0),
], ids=["src", "value"])
def test_scatter_writes_rows_of_its_target_named_by_its_index(op, value):
    index = torch.zeros(1, 3, dtype=torch.long)
    assert rows_of(op, lambda: x().scatter_(0, index, value)) == (0, 0, index, True)


def test_scatter_add_writes_rows_of_its_target():
    index = torch.zeros(1, 3, dtype=torch.long)
    assert rows_of(aten.scatter_add_.default, lambda: x().scatter_add_(0, index, torch.ones(1, 3))) == (
        0, 0, index, True)


def test_index_reduce_writes_rows_of_its_target():
    args = (x(), 0, IDX, torch.ones(2, 3), "prod")
    assert indexed_rows(aten.index_reduce_.default, args, {}) == (0, 0, IDX, True)


def test_embedding_reads_rows_of_its_weight():
    weight = torch.zeros(10, 4)
    ids = torch.tensor([3, 7, 3])
    target, dim, index, writes = rows_of(aten.embedding.default, lambda: F.embedding(ids, weight))
    assert (target, dim, writes) == (0, 0, False)
    assert index is ids


def test_the_index_tensor_is_the_one_the_op_was_given():
    target, dim, index, writes = rows_of(aten.index_select.default, lambda: x().index_select(0, IDX))
    assert index is IDX


def test_indexed_rows_reads_arguments_given_by_keyword():
    assert indexed_rows(aten.index_select.default, (x(),), {"dim": 1, "index": IDX}) == (0, 1, IDX, False)
    assert indexed_rows(aten.index_select.default, (x(), 1), {"index": IDX}) == (0, 1, IDX, False)


def test_several_index_tensors_are_not_rows_of_one_dim():
    assert rows_of(aten.index.Tensor, lambda: x()[IDX, IDX]) is None
    assert indexed_rows(aten.index_put_.default, (x(), [IDX, IDX], torch.ones(2)), {}) is None


def test_a_boolean_mask_is_not_rows():
    mask = torch.tensor([True, False, True, False])
    assert rows_of(aten.index.Tensor, lambda: x()[mask]) is None
    assert rows_of(aten.index_put_.default, lambda: x().__setitem__(mask, 0.0)) is None
    assert indexed_rows(aten.index.Tensor, (x(), [mask.to(torch.uint8)]), {}) is None


def test_no_index_tensor_is_not_rows():
    assert indexed_rows(aten.index.Tensor, (x(), [None, None]), {}) is None
    assert indexed_rows(aten.index.Tensor, (x(), []), {}) is None


def test_an_indexed_op_without_an_index_tensor_or_an_int_dim_is_not_rows():
    assert indexed_rows(aten.index_select.default, (x(), 0, [0, 2]), {}) is None
    assert indexed_rows(aten.index_select.default, (x(), "rows", IDX), {}) is None


@pytest.mark.parametrize("op", [aten.add.Tensor, aten.copy_.default, aten.select.int, aten.index_select.out])
def test_other_ops_are_not_indexed(op):
    assert indexed_rows(op, (x(), x()), {}) is None


# -- kind, copy_kind and the schema helpers --------------------------------------------------------

@pytest.mark.parametrize(("op", "expected"), [
    (aten.slice.Tensor, "view"),
    (aten.view.default, "view"),
    (aten.select.int, "view"),
    (aten.empty.memory_format, "alloc"),
    (aten.empty_like.default, "alloc"),
    (aten.copy_.default, "copy"),
    (aten._to_copy.default, "to_copy"),
    (aten.nonzero.default, "blocking"),
    (aten.masked_select.default, "blocking"),
    (aten._local_scalar_dense.default, "blocking"),
    (aten.resize_.default, "unsupported"),
    (aten.set_.source_Tensor, "unsupported"),
    (aten.t_.default, "unsupported"),
    (aten.unsqueeze_.default, "unsupported"),
    (aten.add.Tensor, "queued"),
    (aten.index_fill_.int_Scalar, "queued"),
    (aten.index_put_.default, "queued"),
    (aten.zero_.default, "queued"),
], ids=str)
def test_kind_sorts_ops_by_what_they_do_to_the_stream(op, expected):
    assert kind(op) == expected


@pytest.mark.parametrize(("device_dst", "device_src", "non_blocking", "pinned", "expected"), [
    (True, True, False, False, "d2d"),
    (True, True, True, True, "d2d"),
    (False, False, True, True, "host"),
    (False, False, False, False, "host"),
    (True, False, False, True, "sync"),
    (False, True, False, True, "sync"),
    (True, False, True, True, "h2d-async"),
    (True, False, True, False, "h2d-staged"),
    (False, True, True, True, "d2h-async"),
    (False, True, True, False, "sync"),
])
def test_copy_kind_says_how_cuda_runs_a_copy(device_dst, device_src, non_blocking, pinned, expected):
    assert copy_kind(device_dst=device_dst, device_src=device_src, non_blocking=non_blocking, pinned=pinned) == expected


@pytest.mark.parametrize(("to_device", "pinned", "expected"), [
    (True, True, "h2d-staged"), (True, False, "h2d-staged"), (False, True, "sync"), (False, False, "sync")])
def test_a_copy_through_a_pageable_temporary_is_staged_or_synchronous_even_from_pinned_memory(to_device, pinned, expected):
    assert copy_kind(device_dst=to_device, device_src=not to_device, non_blocking=True, pinned=pinned,
                     temporary=True) == expected


KV = torch.zeros(2, 8, 16)  # K and V planes, 8 rows of 16


@pytest.mark.parametrize(("dst", "src", "to_device", "expected"), [
    (KV[:, 0:2], KV[:, 0:2].clone(), False, True),  # vLLM's K/V planes into a contiguous tensor: not one run
    (KV[:, 0:2], KV[:, 2:4], False, True),  # planes to planes: the host side is not contiguous
    (KV[:, 0:2], KV[:, 2:4], True, True),
    (KV[0:2], KV[2:4], True, False),  # whole rows: one cudaMemcpyAsync
    (KV[0:2], KV[2:4], False, False),
    (KV.permute(2, 1, 0), KV.clone().permute(2, 1, 0), True, False),  # the same dense layout, permuted
    (torch.zeros(4, 16), torch.zeros(16), True, True),  # a broadcast source is expanded on the host
    (torch.zeros(4, 16, dtype=torch.half), torch.zeros(4, 16), True, False),  # the dtype converts on the GPU
    (torch.zeros(4, 16, dtype=torch.half), torch.zeros(4, 16), False, False),
    (torch.zeros(16, 4).t(), torch.zeros(4, 16), False, True),  # into a transposed host tensor
    (torch.zeros(0, 4), torch.zeros(0, 4).t().t(), False, False),
    (None, KV[:, 0:2], True, True),  # .to("cuda") of planes: made contiguous on the host first
    (None, KV[0:2], True, False),
    (None, KV[:, 0:2], False, False),  # .to("cpu") of planes: the GPU makes them contiguous
], ids=str)
def test_host_temporary_follows_torchs_copy_requires_temporaries(dst, src, to_device, expected):
    assert host_temporary(dst, src, to_device=to_device) is expected


def test_copy_kind_takes_keywords_only():
    with pytest.raises(TypeError, match=r"^copy_kind\(\) takes 0 positional arguments but 4 were given$"):
        copy_kind(True, False, True, True)


def test_index_needs_host_for_a_boolean_mask_only():
    mask = torch.tensor([True, False, True, False])
    assert index_needs_host(aten.index.Tensor, (x(), [mask]))
    assert index_needs_host(aten.index_put_.default, (x(), [None, mask.to(torch.uint8)], torch.ones(1)))
    assert not index_needs_host(aten.index.Tensor, (x(), [IDX]))
    assert not index_needs_host(aten.index_select.default, (x(), 0, mask))


def test_written_args_are_the_schemas_mutated_arguments():
    assert written_args(aten.add_.Tensor) == [0]
    assert written_args(aten.add.Tensor) == []
    out = [a.name for a in aten.add.out._schema.arguments].index("out")
    assert written_args(aten.add.out) == [out]


def test_aliased_returns_name_the_argument_each_return_aliases():
    assert aliased_returns(aten.add_.Tensor) == [0]
    assert aliased_returns(aten.add.Tensor) == [None]
    assert aliased_returns(aten.index_put_.default) == [0]


# -- Triton kernels ---------------------------------------------------------------------------------

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 1, mask=offs < n)


@triton.jit
def zero_through_table(table_ptr, done_ptr, n, BLOCK: tl.constexpr):
    # vLLM's zeroer shape: the addresses to write are loaded from a table.
    pid = tl.program_id(0)
    seg = tl.load(table_ptr + pid).to(tl.pointer_type(tl.float32))
    offs = tl.arange(0, BLOCK)
    tl.store(seg + offs, tl.zeros([BLOCK], tl.float32), mask=offs < n)
    tl.store(done_ptr + pid, 1)


@triton.jit
def only_through_table(table_ptr, BLOCK: tl.constexpr):
    addr = tl.load(table_ptr + tl.program_id(0)).to(tl.pointer_type(tl.int32))
    tl.store(addr + tl.arange(0, BLOCK), 0)


@triton.jit
def through_locals(src_ptr, dst_ptr, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = dst_ptr + row * stride
    ptrs = base + tl.arange(0, BLOCK)
    values = tl.load(src_ptr + row * stride + tl.arange(0, BLOCK))
    tl.store(ptrs, values)


@triton.jit
def by_keyword(x_ptr, y_ptr):
    tl.store(value=tl.load(x_ptr), pointer=y_ptr)


@triton.jit
def counts_atomically(x_ptr, counter_ptr, hist_ptr):
    value = tl.load(x_ptr)
    tl.atomic_add(counter_ptr, 1)
    tl.atomic_max(hist_ptr + value, 1)


@triton.jit
def reuses_a_local(x_ptr, out_ptr, BLOCK: tl.constexpr):
    ptrs = x_ptr + tl.arange(0, BLOCK)
    values = tl.load(ptrs)
    ptrs = out_ptr + tl.arange(0, BLOCK)
    tl.store(ptrs, values)


def pointers_stored(kernel: Any, pointers: set[str]) -> set[str]:
    return set(kernel_flow(kernel.fn).stored) & pointers


def test_a_kernel_storing_through_one_param_writes_only_it():
    assert pointers_stored(add_one, {"x_ptr", "out_ptr"}) == {"out_ptr"}


def test_an_address_loaded_from_a_table_does_not_make_the_table_written():
    assert pointers_stored(zero_through_table, {"table_ptr", "done_ptr"}) == {"done_ptr"}
    assert pointers_stored(only_through_table, {"table_ptr"}) == set()


def test_a_param_reaching_a_store_through_local_assignments_is_written():
    assert pointers_stored(through_locals, {"src_ptr", "dst_ptr"}) == {"dst_ptr"}


def test_a_store_given_its_pointer_by_keyword_counts():
    assert pointers_stored(by_keyword, {"x_ptr", "y_ptr"}) == {"y_ptr"}


def test_atomics_write_their_pointer_but_a_loaded_offset_does_not_write_its_source():
    assert pointers_stored(counts_atomically, {"x_ptr", "counter_ptr", "hist_ptr"}) == {"counter_ptr", "hist_ptr"}


def test_a_kernel_whose_source_cannot_be_read_writes_every_argument():
    namespace: dict[str, Any] = {}
    exec("def made_at_runtime(a_ptr, b_ptr, n):\n    pass\n", namespace)
    assert kernel_flow(namespace["made_at_runtime"]).stored == frozenset({"a_ptr", "b_ptr", "n"})


def test_a_kernel_that_stores_nothing_writes_nothing():
    def reads_only(x_ptr, n):
        return tl.load(x_ptr + n)

    assert kernel_flow(reads_only).stored == frozenset()


def test_the_docstring_example_holds():
    assert kernel_flow(add_one.fn).stored == frozenset({"out_ptr"})


def test_a_local_reused_for_loading_and_then_storing_writes_only_the_stored_param():
    assert pointers_stored(reuses_a_local, {"x_ptr", "out_ptr"}) == {"out_ptr"}



def test_a_composite_op_with_a_kernel_of_its_own_for_a_device_is_not_decomposed():
    """silu_backward and mish_backward have CompositeImplicitAutograd kernels for other backends and
    kernels of their own for the CPU and CUDA: a dispatch mode gets them whole outside inference mode
    too, and decomposing them would run the math version instead of the program's kernel."""
    from racecheck.ops import op_info

    aten = torch.ops.aten
    assert op_info(aten.to.dtype_layout).composite and op_info(aten.pin_memory.default).composite
    assert op_info(aten.to.device).composite
    assert not op_info(aten.silu_backward.default).composite
    assert not op_info(aten.mish_backward.default).composite
    assert not op_info(aten.detach.default).composite


def test_a_device_argument_names_cuda_as_torch_takes_it():
    from racecheck.devices import names_cuda

    assert names_cuda("cuda") and names_cuda("cuda:1") and names_cuda(torch.device("cuda", 0)) and names_cuda(0)
    assert not any(names_cuda(d) for d in (None, "cpu", torch.device("cpu"), True, "no such device"))


@pytest.mark.parametrize("value", [
    ((1, [2, 3], torch.Size([4, 5])), (torch.ones(2),)),
    [],
    (None, "cuda", torch.device("cpu")),
    ([[1], [2, (3,)]], {"a": 1}),
    (torch.ones(1), [torch.zeros(2), None]),
])
def test_leaves_and_map_leaves_agree_with_pytree(value: object) -> None:
    """The per-op flatten and map are pytree's on what an aten op passes and returns (a dict is a leaf
    here: keyword arguments are passed as their values)."""
    if isinstance(value, tuple) and any(isinstance(v, dict) for v in value):
        assert {"a": 1} in leaves(value)  # a leaf, not opened
        return
    assert leaves(value) == tree_flatten(value)[0]
    mapped, expected = map_leaves(repr, value), tree_map(repr, value)
    assert mapped == expected and type(mapped) is type(expected)


@pytest.mark.parametrize("slot, races", [(2, []), (5, ["host-read-vs-pending-copy"])])
def test_index_select_and_gather_with_out_read_only_the_rows_their_index_names(slot, races):
    # torch.index_select(pool, 0, idx, out=staged): the out= overload reads the rows idx names, as
    # the method does; a store pending into slot 5 races with a read of slot 5 only.
    from sanitizer.sim.session import simulate

    def main() -> None:
        pool = torch.zeros((8, 16), pin_memory=True)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            pool[5].copy_(torch.ones(16, device="cuda"), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        staged = torch.empty((2, 16))
        torch.index_select(pool, 0, torch.tensor([1, slot]), out=staged)
        torch.gather(pool, 0, torch.tensor([[1] * 16, [slot] * 16]), out=staged)
        done.synchronize()

    found, error, _, _ = simulate(main)
    assert error is None and [race.kind for race in found] == races, [race.format() for race in found]
    for overload in (torch.ops.aten.index_select.out, torch.ops.aten.gather.out):
        assert op_info(overload).indexed == op_info(getattr(torch.ops.aten, overload._schema.name.split("::")[1]).default).indexed
