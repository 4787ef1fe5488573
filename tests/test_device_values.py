"""The values of small integer tensors in device memory, known to both tools on a GPU as on the
simulator (racecheck/device_values.py): a table staged through ``.to()`` of pageable memory, a table
computed on the device, a later write over part of one, and a value that cannot be known (one line,
the run partial, never a verdict). The sanitizer's observer runs on the CUDA stand-in
(tests/fake_cuda.py), the fuzzer's CUDA path on the same values where it can run on a CPU.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_flatten

import triton_swap_offload as swap
from fake_cuda import FakeCuda
from racecheck.device_values import MAX_STORAGE, DeviceValues

ROWS, WORDS = 2, 16  # rows per block, float32 words per row
aten = torch.ops.aten
CUDA = torch.device("cuda")


# What ``t.to("cuda", non_blocking=True)``, ``torch.arange(n, device="cuda")`` and ``torch.full(...,
# device="cuda")`` dispatch to (a CPU build of torch refuses "cuda" before dispatching the Python call).
def to_cuda(t: torch.Tensor) -> torch.Tensor:
    return aten._to_copy.default(t, device=CUDA, non_blocking=True)


def arange_cuda(n: int) -> torch.Tensor:
    return aten.arange.default(n, dtype=torch.int64, device=CUDA)


def full_cuda(n: int, value: int) -> torch.Tensor:
    return aten.full.default([n], value, dtype=torch.int64, device=CUDA)


# -- the shared shadow ------------------------------------------------------------------------------------

def _values() -> tuple[DeviceValues, set]:
    device: set[int] = set()
    return DeviceValues(lambda t: t.untyped_storage().data_ptr() in device), device


def _run(values: DeviceValues, on: set, func, *args, **kwargs):
    """``func`` as a tool runs it: evaluated before, its writes forgotten, run, committed."""
    on_device = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in on]
    pending = values.prepare(func, args, kwargs, on_device)
    for position in [i for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write]:
        values.written(args[position].untyped_storage().data_ptr(), [(args[position].data_ptr(), args[position].data_ptr() + args[position].nbytes)])
    host_kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
    result = func(*args, **host_kwargs)
    for out in (result if isinstance(result, (tuple, list)) else (result,)):
        on.add(out.untyped_storage().data_ptr())
    values.commit(pending, result)
    return result


def test_a_later_copy_over_part_of_a_table_replaces_those_values_and_keeps_the_rest():
    values, device = _values()
    ids = torch.zeros(8, dtype=torch.int64)
    device.add(ids.untyped_storage().data_ptr())
    values.copied(ids, torch.arange(8))
    values.copied(ids[2:4], torch.tensor([70, 80]))
    assert values.values(ids).tolist() == [0, 1, 70, 80, 4, 5, 6, 7]  # never the first copy's 2 and 3
    assert values.values(ids.view(torch.int32)[:2]).tolist() == [0, 0]  # the same bytes, read as int32


@pytest.mark.parametrize("src", [
    torch.tensor([7], dtype=torch.int32),                 # broadcast over the slice
    torch.tensor([1.9, -2.5, 3.0]),                      # converted as copy_ converts
    torch.arange(6, dtype=torch.int64)[::2],              # a strided host view
    torch.tensor([True, False, True]),
], ids=["broadcast", "float", "strided", "bool"])
def test_a_copy_of_host_values_into_a_table_leaves_what_evaluating_it_on_the_host_would(src, monkeypatch):
    # copy_ from the host takes a shortcut (no evaluation on a copy of the shadow): the values must be the same
    import racecheck.device_values as device_values

    def known_after(shortcut: bool) -> list[int]:
        if not shortcut:
            monkeypatch.setattr(device_values, "_COPY", None)
        values, on = _values()
        table = torch.zeros(8, dtype=torch.int64)
        on.add(table.untyped_storage().data_ptr())
        _run(values, on, aten.copy_.default, table, torch.arange(8, dtype=torch.int64))
        _run(values, on, aten.copy_.default, table[2:5], src, True)
        monkeypatch.undo()
        return values.values(table).tolist()

    expected = torch.arange(8, dtype=torch.int64)
    expected[2:5].copy_(src)
    assert known_after(shortcut=True) == known_after(shortcut=False) == expected.tolist()


def test_a_copy_of_host_values_into_a_table_takes_them_as_the_copy_is_called():
    # the values the host holds at the call, whatever lands in that host memory before the op returns
    # (a device-to-host copy queued into it earlier, on a GPU)
    values, on = _values()
    table = torch.zeros(4, dtype=torch.int64)
    on.add(table.untyped_storage().data_ptr())
    host = torch.tensor([1, 2, 3, 4])
    pending = values.prepare(aten.copy_.default, (table, host), {}, [table])
    host.fill_(9)  # lands while the op runs
    values.commit(pending, table)
    assert values.values(table).tolist() == [1, 2, 3, 4]


def test_a_device_write_the_tool_cannot_evaluate_makes_those_bytes_unknown_and_only_those():
    values, device = _values()
    ids = torch.zeros(8, dtype=torch.uint64)
    device.add(ids.untyped_storage().data_ptr())
    values.copied(ids, torch.arange(8).to(torch.uint64))
    values.written(ids.untyped_storage().data_ptr(), [(ids[4:].data_ptr(), ids[4:].data_ptr() + 8)])
    assert values.values(ids[:4]).tolist() == [0, 1, 2, 3]
    assert values.values(ids) is None and values.values(ids[4:5]) is None
    assert values.values(ids[5:]).tolist() == [5, 6, 7]


def test_tables_computed_on_the_device_are_known_from_the_values_they_were_computed_from():
    values, device = _values()
    blocks = _run(values, device, aten._to_copy.default, torch.tensor([3, 1]), device=torch.device("cuda"),
                  non_blocking=True)
    rows = _run(values, device, aten.arange.default, 2, dtype=torch.int64, device=torch.device("cuda"))
    table = _run(values, device, aten.add.Tensor,
                 _run(values, device, aten.mul.Tensor, blocks.unsqueeze(1), 2), rows)  # a block's rows
    addrs = _run(values, device, aten.add.Tensor, _run(values, device, aten.mul.Tensor, table.reshape(-1), 64), 4096)
    both = _run(values, device, aten.cat.default, [addrs[1:], blocks])
    assert values.values(addrs).tolist() == [4096 + 64 * r for r in (6, 7, 2, 3)]
    assert values.values(both).tolist() == [4096 + 64 * 7, 4096 + 64 * 2, 4096 + 64 * 3, 3, 1]
    _run(values, device, aten.add_.Tensor, addrs, 8)  # in place: the old values read, the new ones kept
    assert values.values(addrs[:1]).tolist() == [4096 + 64 * 6 + 8]


def test_a_random_op_or_an_op_on_unknown_values_leaves_its_output_unknown():
    values, device = _values()
    unknown = torch.zeros(4, dtype=torch.int64)
    device.add(unknown.untyped_storage().data_ptr())
    assert values.values(_run(values, device, aten.add.Tensor, unknown, 1)) is None
    drawn = _run(values, device, aten.randint.low, 0, 9, [4], dtype=torch.int64, device=torch.device("cuda"))
    assert values.values(drawn) is None


def test_only_small_integer_tensors_are_shadowed():
    values, device = _values()
    data = torch.zeros(4)
    big = torch.zeros(MAX_STORAGE // 8 + 1, dtype=torch.int64)
    device.update({data.untyped_storage().data_ptr(), big.untyped_storage().data_ptr()})
    assert values.prepare(aten.add.Tensor, (data, 1), {}, [data]) is None  # data: one dtype check, no work
    values.copied(big, torch.ones_like(big))
    assert values.values(big[:2]) is None


# -- the sanitizer's observer, on the CUDA stand-in ------------------------------------------------------

def _observe(program):
    """Run ``program(cuda)`` under the observer as it runs on a GPU; (races, unfollowed lines, notes)."""
    from sanitizer.gpu.observer import Observer

    cuda = FakeCuda()
    with cuda.placing():
        obs = Observer(device=cuda)
        cuda.obs = obs
        obs.start()
        try:
            program(cuda, obs)
        finally:
            races = obs.stop()
    return races, [u.message() for u in obs.take_unfollowed()], list(obs.notes)


def _launch(cuda, obs, make_tables, n: int, side=None) -> None:
    """The swap kernel on a side stream (a new one unless given), its tables made there first (as
    vLLM's handler makes them on its transfer stream), as the observer's JITFunction.run wrapper
    sees it, then run."""
    from sanitizer.gpu.launches import on_launch
    from kvdevice.triton_cpu import launch_on_cpu

    side = cuda.new_stream() if side is None else side
    with cuda.stream(side):
        tables = make_tables()
        with obs.lock:
            on_launch(obs, swap._swap_blocks_kernel, (*tables, n), {"BYTES_PER_CHUNK": 64}, (2,))
        launch_on_cpu(swap._swap_blocks_kernel, (2,), *tables, n, BYTES_PER_CHUNK=64)


def _handler_tables(src: torch.Tensor, dst: torch.Tensor, block: int) -> list[np.ndarray]:
    rows = np.arange(ROWS, dtype=np.int64) + block * ROWS
    stride = WORDS * 4
    return [src.data_ptr() + rows * stride, dst.data_ptr() + rows * stride, np.full(ROWS, stride, dtype=np.int64)]


@pytest.mark.parametrize(("beside", "kind"), [("none", None), ("device", "unordered-device-access")])
def test_the_observer_follows_tables_staged_through_to_of_pageable_memory(beside, kind):
    """vLLM's handler: numpy tables, ``torch.from_numpy(t).to("cuda", non_blocking=True)``, the kernel."""

    def program(cuda, obs):
        kv = cuda.device(torch.ones((4 * ROWS, WORDS), dtype=torch.float32))
        host = cuda.pinned(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        _launch(cuda, obs, lambda: [to_cuda(torch.from_numpy(t)) for t in _handler_tables(host, kv, 1)],
                ROWS)  # a load: writes kv block 1
        if beside == "device":
            kv[ROWS:2 * ROWS].sum()

    races, unfollowed, _ = _observe(program)
    assert unfollowed == []
    assert [r.kind for r in races] == ([kind] if kind else [])


def test_the_tables_are_read_as_the_kernel_starts_even_where_every_argument_counts_as_written(monkeypatch):
    # Where a kernel's source cannot be read every argument counts as written, tables included; the
    # tables were then forgotten before they were traced (one reading of the H100's 'cannot follow
    # ... dst_addrs, sizes and src_addrs' on vLLM's handler, 2026-12-06).
    from sanitizer.gpu import launches

    flow = launches.kernel_flow
    monkeypatch.setattr(launches, "kernel_flow",
                        lambda fn: flow(fn)._replace(stored=frozenset(launches.inspect.signature(fn).parameters)))

    def program(cuda, obs):
        kv = cuda.device(torch.ones((4 * ROWS, WORDS), dtype=torch.float32))
        host = cuda.pinned(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        _launch(cuda, obs, lambda: [to_cuda(torch.from_numpy(t)) for t in _handler_tables(host, kv, 1)], ROWS)

    races, unfollowed, _ = _observe(program)
    assert unfollowed == [] and races == []


def test_the_observer_follows_a_table_computed_on_the_device_and_a_slice_of_it():
    def program(cuda, obs):
        kv = cuda.device(torch.ones((4 * ROWS, WORDS), dtype=torch.float32))
        host = cuda.pinned(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        def tables() -> list[torch.Tensor]:
            blocks = to_cuda(torch.tensor([0, 1]))  # block 1's rows are copied, block 0's pad the table
            rows = (blocks[:, None] * ROWS + arange_cuda(ROWS)).reshape(-1)
            stride = WORDS * 4
            src = rows * stride + host.data_ptr()
            dst = rows * stride + kv.data_ptr()
            sizes = full_cuda(2 * ROWS, stride)
            return [src[ROWS:], dst[ROWS:], sizes[ROWS:]]  # a slice: block 1 only

        _launch(cuda, obs, tables, ROWS)
        kv[0:ROWS].sum()  # block 0 on the default stream: not what the kernel touched
        kv[ROWS:2 * ROWS].sum()  # block 1: the kernel wrote it, unordered

    races, unfollowed, _ = _observe(program)
    assert unfollowed == []
    assert [r.kind for r in races] == ["unordered-device-access"]  # block 1 only: block 0's read is apart
    assert "_swap_blocks_kernel" in str(races[0])


def test_the_observers_values_are_the_later_copys_where_it_overwrote_part_of_a_table():
    def program(cuda, obs):
        ids = to_cuda(torch.arange(8))
        ids[2:4].copy_(torch.tensor([70, 80]))
        assert obs.indices.values(ids) == [0, 1, 70, 80, 4, 5, 6, 7]

    races, unfollowed, _ = _observe(program)
    assert races == [] and unfollowed == []


def test_a_table_a_device_op_the_tool_cannot_evaluate_wrote_is_one_line_and_no_verdict():
    def program(cuda, obs):
        kv = cuda.device(torch.ones((4 * ROWS, WORDS), dtype=torch.float32))
        host = cuda.pinned(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        def tables() -> list[torch.Tensor]:
            made = [to_cuda(torch.from_numpy(t)) for t in _handler_tables(host, kv, 1)]
            made[1].random_(0, 8)  # values drawn on the device: not known on the host
            with torch._C.DisableTorchFunction(), no_dispatch():  # the bytes made right where no hook sees it
                made[1].copy_(torch.from_numpy(_handler_tables(host, kv, 1)[1]))
            return made

        _launch(cuda, obs, tables, ROWS)
        kv[ROWS:2 * ROWS].sum()

    races, unfollowed, _ = _observe(program)
    assert races == []  # not a verdict on what the kernel touched
    assert len(unfollowed) == 1
    assert re.match(r"kvz-sanitize cannot follow Triton kernel _swap_blocks_kernel's argument 'dst_addrs' \(an "
                    r"address table the kernel goes through, in device memory whose values the program did not "
                    r"stage from the host\) at ", unfollowed[0])


# -- the fuzzer's CUDA path -------------------------------------------------------------------------------

def test_on_cuda_the_fuzzer_follows_a_table_computed_on_the_device():
    """through_tables_on_cuda on the values its CudaOps keeps (the same DeviceValues, fed as it feeds it)."""
    from kvdevice.intercept.kernel_accesses import through_tables_on_cuda
    from racecheck.placement import Placed

    values, device = _values()
    kv = torch.ones((4 * ROWS, WORDS), dtype=torch.float32)
    host = torch.zeros((4 * ROWS, WORDS), dtype=torch.float32)
    stride = WORDS * 4
    rows = _run(values, device, aten._to_copy.default, torch.arange(ROWS) + 2 * ROWS, device=torch.device("cuda"),
                non_blocking=True)  # block 2's rows
    scaled = _run(values, device, aten.mul.Tensor, rows, stride)
    tables = [_run(values, device, aten.add.Tensor, scaled, base) for base in (kv.data_ptr(), host.data_ptr())]
    tables.append(_run(values, device, aten.full.default, [ROWS], stride, dtype=torch.int64, device=torch.device("cuda")))
    places: list = []

    def place(address: int, size: int, call: str, role: str) -> Placed:
        places.append((address, address + size, role))
        return Placed(None, ("cudamem", address), "device", [(address, address + size)])

    session = SimpleNamespace(cuda_ops=SimpleNamespace(values=values), driver=SimpleNamespace(place=place))
    arguments = {"src_addrs": tables[0], "dst_addrs": tables[1], "sizes": tables[2], "n_jobs": ROWS,
                 "BYTES_PER_CHUNK": 64}
    found = through_tables_on_cuda(session, "triton _swap_blocks_kernel", swap._swap_blocks_kernel.fn, arguments,
                                   (2,), ["dst_addrs", "sizes", "src_addrs"])
    assert [(p.start, p.end, write) for p, write in found] == [
        (kv.data_ptr() + 2 * ROWS * stride, kv.data_ptr() + 3 * ROWS * stride, False),
        (host.data_ptr() + 2 * ROWS * stride, host.data_ptr() + 3 * ROWS * stride, True),
    ]


@pytest.mark.parametrize("tagged", [True, False], ids=["torch-2.13-tags", "torch-2.11-no-out-tag"])
def test_an_out_variant_is_told_with_or_without_torchs_out_tag(tagged, monkeypatch):
    # torch 2.11 (the GPU image) has no torch.Tag.out: on the H100 every op the shadow evaluated
    # raised AttributeError there, and every table kernel was a harness error.
    import racecheck.device_values as device_values

    if not tagged:
        monkeypatch.setattr(device_values, "_OUT_TAG", None)
    device_values._is_out_variant.cache_clear()  # answers are kept per overload
    try:
        assert device_values._is_out_variant(torch.ops.aten.add.out)
        assert not device_values._is_out_variant(torch.ops.aten.add.Tensor)
        assert not device_values._is_out_variant(torch.ops.aten.add_.Tensor)
    finally:
        device_values._is_out_variant.cache_clear()


# Tags of torch.Tag the product may name directly: those torch 2.11 has (the oldest torch the tools
# run on, the GPU image's); any other must be looked up with getattr and a fallback.
TAGS_IN_TORCH_2_11 = {"inplace_view", "data_dependent_output", "nondeterministic_seeded", "nondeterministic_bitwise",
                      "core", "pointwise", "inplace", "view_copy", "dynamic_output_shape", "generated"}


def test_the_product_names_only_torch_tags_that_torch_2_11_has():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    named = []
    for package in ("racecheck", "kvdevice", "zeroer", "fuzz", "repro", "sanitizer"):
        for path in sorted((root / package).rglob("*.py")) if (root / package).is_dir() else []:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                        and node.value.attr == "Tag" and isinstance(node.value.value, ast.Name)
                        and node.value.value.id == "torch" and node.attr not in TAGS_IN_TORCH_2_11):
                    named.append(f"{path.relative_to(root)}:{node.lineno}: torch.Tag.{node.attr}")
    assert not named, named


# What ``x.to("cuda", non_blocking=True)`` and ``x.to(device, dtype, non_blocking)`` dispatch to under
# torch.inference_mode(): the composite op, whole (racecheck.ops.decomposed). A CPU build refuses
# "cuda" in Tensor.to's own arguments, so the test calls the overloads it reaches.
TO_FORMS = {
    "to.dtype_layout": lambda t: aten.to.dtype_layout(t, dtype=t.dtype, layout=torch.strided, device=CUDA,
                                                      non_blocking=True),
    "to.device": lambda t: aten.to.device(t, CUDA, t.dtype, True),
}


@pytest.mark.parametrize("form", sorted(TO_FORMS))
@pytest.mark.parametrize(("beside", "kind"), [("none", None), ("device", "unordered-device-access")])
def test_under_inference_mode_the_observer_follows_tables_staged_through_to(form, beside, kind):
    """vLLM's tests run its handlers under ``@torch.inference_mode()``: seen on an H100, every table
    staged by ``.to()`` there was unknown to the sanitizer, and the kernel not followed."""

    def program(cuda, obs):
        kv = cuda.device(torch.ones((4 * ROWS, WORDS), dtype=torch.float32))
        host = cuda.pinned(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        with torch.inference_mode():
            _launch(cuda, obs, lambda: [TO_FORMS[form](torch.from_numpy(t)) for t in _handler_tables(host, kv, 1)],
                    ROWS)
            if beside == "device":
                kv[ROWS:2 * ROWS].sum()

    races, unfollowed, _ = _observe(program)
    assert unfollowed == []
    assert [r.kind for r in races] == ([kind] if kind else [])


@pytest.mark.parametrize("synced", [False, True])
def test_a_pinned_temporary_dropped_under_a_kernel_reading_it_through_its_pointer_races_its_next_tenant(synced):
    """LMCache #4830 on a GPU: torch's caching host allocator waits only for torch's own copies of a
    block; one a kernel reads through its raw address goes to the next ``pin_memory()`` at once. An
    H100 run missed it: the sanitizer forgot the old block when the new tenant was noted."""

    def program(cuda, obs):
        kv = cuda.device(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        chunk = torch.ones((4 * ROWS, WORDS), dtype=torch.float32)
        temporary = aten._pin_memory.default(chunk)
        address = temporary.data_ptr()
        _launch(cuda, obs, lambda: [to_cuda(torch.from_numpy(t)) for t in _handler_tables(temporary, kv, 1)], ROWS)
        if synced:
            cuda.synchronize()
        del temporary  # the program's last reference: the block is free (no event records the kernel's read)
        again = aten._pin_memory.default(chunk)
        assert again.data_ptr() == address  # the stand-in's pool, as torch's allocator, handed it out again

    races, unfollowed, _ = _observe(program)
    assert unfollowed == []
    assert [r.kind for r in races] == ([] if synced else ["host-write-vs-pending-copy"])
    if not synced:
        assert races[0].later.reused and races[0].later.what.startswith("pinned memory handed out again"), races[0]
        from sanitizer.races import Race
        assert Race.from_json(races[0].to_json()).later.reused  # a saved report keeps which advice it gets
        assert "before the last reference goes (LMCache #4830)" in races[0].format()


def test_a_pinned_block_a_torch_copy_read_is_not_raced_by_its_next_tenant():
    # torch's own non-blocking copy records an event on the block and the allocator waits for it
    def program(cuda, obs):
        chunk = torch.ones(64, dtype=torch.float32)
        temporary = aten._pin_memory.default(chunk)
        device = cuda.device(torch.zeros(64, dtype=torch.float32))
        with cuda.stream(cuda.new_stream()):
            device.copy_(temporary, non_blocking=True)
        del temporary
        aten._pin_memory.default(chunk)

    races, unfollowed, _ = _observe(program)
    assert races == [] and unfollowed == []


@pytest.mark.parametrize(("copy", "kind"), [("none", "host-write-vs-pending-copy"), ("after", None),
                                            ("before", "host-write-vs-pending-copy")])
def test_a_pinned_block_a_torch_copy_read_after_its_raw_access_is_not_raced_by_its_next_tenant(copy, kind):
    """torch's caching host allocator hands a block out again only once the events behind torch's own
    copies of it have completed (CachingHostAllocator_recordEvent): a kernel that read the block
    through its pointer before such a copy, on that copy's stream, has completed too. A raw access
    after the copy is still pending when the block comes back."""

    def program(cuda, obs):
        from sanitizer.sites import caller_site

        kv = cuda.device(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        dev = cuda.device(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        chunk = torch.ones((4 * ROWS, WORDS), dtype=torch.float32)
        temporary = aten._pin_memory.default(chunk)
        address = temporary.data_ptr()
        side = cuda.new_stream()
        if copy == "before":
            with cuda.stream(side):
                dev.copy_(temporary, non_blocking=True)
        _launch(cuda, obs, lambda: [to_cuda(torch.from_numpy(t)) for t in _handler_tables(temporary, kv, 1)], ROWS,
                side=side)
        if copy == "after":
            with cuda.stream(side):
                dev.copy_(temporary, non_blocking=True)  # torch's own: an event on the block behind the kernel
        del temporary
        obs.scope_end(caller_site())  # a test's end: the observer lets go of its alias of the copy's source
        again = aten._pin_memory.default(chunk)
        assert again.data_ptr() == address

    races, unfollowed, _ = _observe(program)
    assert unfollowed == []
    assert [r.kind for r in races] == ([kind] if kind else [])
