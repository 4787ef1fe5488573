"""Triton kernels that go through tables of addresses (vLLM's CPU offloading handler's
``_swap_blocks_kernel``) are seen as exactly the bytes they read and the bytes they write: on the
simulator from the interpreter's own loads and stores (both tools), on a GPU from the tables'
values as the program staged them (the sanitizer's observer, here through the CUDA stand-in).
A reading kernel beside a read of the same bytes is no hazard, a writing one is; a table the
host never staged is one line, never a silent pass. The offloader is tests/triton_swap_offload.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import triton_swap_offload as swap
from fake_cuda import FakeCuda
from racecheck.triton_stores import kernel_flow
from sanitizer.sim.session import simulate

ROOT = Path(__file__).resolve().parents[1]
OFFLOADER = "tests/triton_swap_offload.py"
ROWS, WORDS = 2, 16  # rows per block, float32 words per row
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_swap_kernels_tables_are_read_from_its_source():
    flow = kernel_flow(swap._swap_blocks_kernel.fn)
    assert (flow.tables, flow.deeper) == (frozenset({"src_addrs", "dst_addrs", "sizes"}), False)


def _tables(src: torch.Tensor, src_block: int, dst: torch.Tensor, dst_block: int) -> list[np.ndarray]:
    """One job per row of a block, as the handler builds them (data_ptr + row * stride)."""
    rows = np.arange(ROWS, dtype=np.int64)
    stride = WORDS * 4
    return [src.data_ptr() + (src_block * ROWS + rows) * stride, dst.data_ptr() + (dst_block * ROWS + rows) * stride,
            np.full(ROWS, stride, dtype=np.int64)]


# -- the simulator (the sanitizer's program session; the fuzzer's sessions share the launch) ------------

def _program(direction: str, beside: str):
    """A swap kernel on a side stream, a read of the same block on the default stream (or the host)."""

    def main() -> None:
        kv = torch.ones((4 * ROWS, WORDS), dtype=torch.float32, device="cuda")
        host = torch.zeros((4 * ROWS, WORDS), dtype=torch.float32, pin_memory=True)
        side = torch.cuda.Stream()
        src, dst = (kv, host) if direction == "store" else (host, kv)
        tables = [torch.from_numpy(a).to("cuda", non_blocking=True) for a in _tables(src, 1, dst, 1)]
        side.wait_stream(torch.cuda.current_stream())  # the tables' copies (and kv's fill) come first
        with torch.cuda.stream(side):
            swap._swap_blocks_kernel[(2,)](*tables, ROWS, BYTES_PER_CHUNK=64)
        if beside == "device":
            kv[ROWS:2 * ROWS].sum()  # the default stream reads block 1
        else:
            host[ROWS:2 * ROWS].tolist()  # the host reads slot 1
        torch.cuda.synchronize()

    return main


@pytest.mark.parametrize(("direction", "beside", "kind"), [
    ("store", "device", None),  # reads kv block 1: beside a read, no hazard
    ("load", "device", "unordered-device-access"),  # writes kv block 1
    ("load", "host", None),  # reads host slot 1: beside a host read, no hazard
    # writes host slot 1 as it runs; the host read before the host synchronises is checked then
    ("store", "host", "host-read-vs-pending-copy"),
])
def test_on_the_simulator_a_table_kernel_reads_and_writes_what_its_loads_and_stores_touch(direction, beside, kind):
    races, error, _, _ = simulate(_program(direction, beside))
    assert error is None
    assert [r.kind for r in races] == ([kind] if kind else [])
    if kind:
        assert "_swap_blocks_kernel" in str(races[0])


# -- a GPU, through the CUDA stand-in -----------------------------------------------------------------

def _observe(direction: str, beside: str, *, staged: bool = True):
    from sanitizer.gpu.launches import on_launch
    from sanitizer.gpu.observer import Observer
    from kvdevice.triton_cpu import launch_on_cpu

    cuda = FakeCuda()
    obs = Observer(device=cuda)
    cuda.obs = obs
    obs.start()
    try:
        kv = cuda.device(torch.ones((4 * ROWS, WORDS), dtype=torch.float32))
        host = cuda.pinned(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        src, dst = (kv, host) if direction == "store" else (host, kv)
        tables = []
        for values in _tables(src, 1, dst, 1):
            table = cuda.device(torch.zeros(ROWS, dtype=torch.int64))
            if staged:
                table.copy_(torch.from_numpy(values))  # the H2D copy the observer follows
            else:
                with torch._C.DisableTorchFunction():  # filled where no hook sees it (a kernel of its own)
                    table.numpy()[:] = values
            tables.append(table)
        side = cuda.new_stream()
        with cuda.stream(side):
            with obs.lock:  # what the observer's JITFunction.run wrapper does, then the "GPU" runs it
                on_launch(obs, swap._swap_blocks_kernel, (*tables, ROWS), {"BYTES_PER_CHUNK": 64}, (2,))
            launch_on_cpu(swap._swap_blocks_kernel, (2,), *tables, ROWS, BYTES_PER_CHUNK=64)
        if beside == "device":
            kv[ROWS:2 * ROWS].sum()
        else:
            host[ROWS:2 * ROWS].tolist()
    finally:
        races = obs.stop()
    return races, [u.message() for u in obs.take_unfollowed()]


@pytest.mark.parametrize(("direction", "beside", "kind"), [
    ("store", "device", None),
    ("load", "device", "unordered-device-access"),
    ("load", "host", None),
    ("store", "host", "host-read-vs-pending-copy"),
])
def test_on_a_gpu_a_table_kernel_touches_what_its_staged_tables_say(direction, beside, kind):
    races, unfollowed = _observe(direction, beside)
    assert unfollowed == []
    assert [r.kind for r in races] == ([kind] if kind else [])


def test_on_a_gpu_tables_the_host_never_staged_are_one_line_that_names_each():
    """Every unknown table is named, in name order (an H100 run said only 'dst_addrs', the first of
    the three by name, when none of them was known)."""
    races, unfollowed = _observe("load", "device", staged=False)
    assert races == []
    assert len(unfollowed) == 1
    assert re.match(r"kvz-sanitize cannot follow Triton kernel _swap_blocks_kernel's arguments 'dst_addrs', 'sizes' "
                    r"and 'src_addrs' \(address tables the kernel goes through, in device memory whose values the "
                    r"program did not stage from the host\) at ", unfollowed[0])


# -- the tools as a user runs them ----------------------------------------------------------------------

def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(("factory", "clean"), [("make", True), ("racy_store", False)])
def test_the_fuzzer_passes_the_vllm_shaped_handler_and_finds_its_racy_twin(factory, clean):
    done = _run("-m", "pytest", "fuzz", "--offloader", f"{OFFLOADER}:{factory}", "--backend", "sim",
                "--geometry", "tiny", "--host-memory", "pinned", "-p", "no:randomly", "-q")
    out = done.stdout + done.stderr
    if clean:
        assert done.returncode == 0, out
    else:
        assert done.returncode == 1, out
        assert re.search(r"hazard at step \d+: block \d+: .* writes it and triton _swap_blocks_kernel#\d+ on stream "
                         r"'offloader-1' \(tests/triton_swap_offload.py:racy_store.store#\d+\(\[\d+\]\)\) reads it", out)


def _marks() -> dict[str, int]:
    """``race[racy_store]: queued`` on the compute stream's write, ``...: later`` on the kernel that overtakes it."""
    from sanitizer.bench.programs import marked_lines

    return marked_lines(ROOT / OFFLOADER, "racy_store")


@pytest.mark.parametrize("variant", ["make", "racy_store"])
def test_the_sanitizer_reports_the_racy_engine_loop_at_both_lines_and_not_the_fixed_one(variant):
    done = _run("-m", "sanitizer", "--backend", "sim", "--", "python", OFFLOADER, variant)
    out = done.stdout + done.stderr
    if variant == "make":
        assert f"kvz-sanitize: no race in {OFFLOADER} [simulator]" in out, out
        return
    marks = _marks()
    assert "[unordered-device-access]" in out, out
    assert f"at {OFFLOADER}:{marks['queued']} (main)" in out, out
    assert "triton _swap_blocks_kernel on stream" in out and f"at {OFFLOADER}:{marks['later']} (transfer)" in out, out


# -- the fuzzer on CUDA: the tables from their host source ------------------------------------------------

def _cuda_session(places: list) -> SimpleNamespace:
    """What through_tables_on_cuda asks of a session: its known device values, and where a run lands."""
    from racecheck.device_values import DeviceValues

    from racecheck.placement import Placed

    def place(address: int, size: int, call: str, role: str) -> Placed:
        places.append((address, address + size, role))
        return Placed(None, ("cudamem", address), "device", [(address, address + size)])

    device: set[int] = set()  # the storages the test calls device memory (session.device)
    values = DeviceValues(lambda t: t.untyped_storage().data_ptr() in device)
    return SimpleNamespace(cuda_ops=SimpleNamespace(values=values), driver=SimpleNamespace(place=place), device=device)


@pytest.mark.parametrize("direction", ["store", "load"])
def test_on_cuda_the_fuzzer_places_what_the_kernel_touches_through_the_tables_the_host_staged(direction):
    from kvdevice.intercept.kernel_accesses import through_tables_on_cuda

    kv = torch.ones((4 * ROWS, WORDS), dtype=torch.float32)  # "device" memory, to the stand-in
    host = torch.zeros((4 * ROWS, WORDS), dtype=torch.float32)
    src, dst = (kv, host) if direction == "store" else (host, kv)
    places: list = []
    session = _cuda_session(places)
    tables = [torch.zeros(ROWS, dtype=torch.int64) for _ in range(3)]  # the device tables
    session.device.update(t.untyped_storage().data_ptr() for t in tables)
    for table, values in zip(tables, _tables(src, 1, dst, 2)):
        session.cuda_ops.values.copied(table, torch.from_numpy(values))  # as CudaOps records an H2D copy
    arguments = {"src_addrs": tables[0], "dst_addrs": tables[1], "sizes": tables[2], "n_jobs": ROWS,
                 "BYTES_PER_CHUNK": 64}
    found = through_tables_on_cuda(session, "triton _swap_blocks_kernel", swap._swap_blocks_kernel.fn, arguments,
                                   (2,), ["dst_addrs", "sizes", "src_addrs"])
    row = WORDS * 4
    assert [(p.start, p.end, write) for p, write in found] == [
        (src.data_ptr() + ROWS * row, src.data_ptr() + 2 * ROWS * row, False),  # block 1 of the source, read
        (dst.data_ptr() + 2 * ROWS * row, dst.data_ptr() + 3 * ROWS * row, True),  # block 2 of the destination
    ]
    assert kv.eq(1).all() and host.eq(0).all()  # traced, not run: no byte moved
    assert [role for _, _, role in places] == ["source", "destination"]


@pytest.mark.parametrize("how", ["never staged", "written since"])
def test_on_cuda_a_table_whose_values_are_not_known_is_a_harness_error_that_names_it(how):
    from kvdevice.intercept.errors import InterceptError
    from kvdevice.intercept.kernel_accesses import through_tables_on_cuda

    kv = torch.ones((4 * ROWS, WORDS), dtype=torch.float32)
    session = _cuda_session([])
    tables = [torch.zeros(ROWS, dtype=torch.int64) for _ in range(3)]
    session.device.update(t.untyped_storage().data_ptr() for t in tables)
    for table, values in zip(tables, _tables(kv, 1, kv, 2)):
        if how == "written since" or table is not tables[1]:
            session.cuda_ops.values.copied(table, torch.from_numpy(values))
    if how == "written since":
        session.cuda_ops.values.written(tables[1].untyped_storage().data_ptr())  # a device op wrote dst_addrs
    arguments = {"src_addrs": tables[0], "dst_addrs": tables[1], "sizes": tables[2], "n_jobs": ROWS,
                 "BYTES_PER_CHUNK": 64}
    with pytest.raises(InterceptError, match=r"^triton _swap_blocks_kernel: argument 'dst_addrs': it is a table of addresses .* whose values the code did not make from the host"):
        through_tables_on_cuda(session, "triton _swap_blocks_kernel", swap._swap_blocks_kernel.fn, arguments, (2,),
                               ["dst_addrs", "sizes", "src_addrs"])


def test_the_gpu_observers_index_values_are_never_an_older_copys_where_a_later_one_overwrote_part():
    from racecheck.device_values import DeviceValues
    from sanitizer.gpu.indices import Indices

    ids = torch.zeros(8, dtype=torch.int64)

    def is_device(t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == ids.untyped_storage().data_ptr()

    obs = SimpleNamespace(device=SimpleNamespace(is_device=is_device), values=DeviceValues(is_device))
    indices = Indices(obs)
    obs.values.copied(ids, torch.arange(8))
    assert indices.values(ids) == list(range(8))
    obs.values.copied(ids[2:4], torch.tensor([70, 80]))  # a later copy over part of them
    assert indices.values(ids) == [0, 1, 70, 80, 4, 5, 6, 7]  # not the first copy's values at 2 and 3


@CUDA
@pytest.mark.parametrize(("factory", "clean"), [("make", True), ("racy_store", False), ("racy_load", False)])
def test_on_a_gpu_the_fuzzer_follows_the_handlers_tables_passes_it_and_finds_its_racy_twins(factory, clean):
    done = _run("-m", "pytest", "fuzz", "--offloader", f"{OFFLOADER}:{factory}", "--backend", "cuda",
                "--geometry", "tiny", "--host-memory", "pinned", "-p", "no:randomly", "-q")
    out = done.stdout + done.stderr
    assert "harness error" not in out.lower(), out
    assert done.returncode == (0 if clean else 1), out
    if not clean:
        assert "triton _swap_blocks_kernel" in out, out


# -- a kernel handed the whole KV cache (no table of addresses) ---------------------------------------

@triton.jit
def _gather_blocks(cache, block_ids, out, BLOCK_NUMEL: tl.constexpr):
    i = tl.program_id(0)
    block = tl.load(block_ids + i).to(tl.int64)
    offsets = tl.arange(0, BLOCK_NUMEL)
    tl.store(out + i * BLOCK_NUMEL + offsets, tl.load(cache + block * BLOCK_NUMEL + offsets))


@pytest.mark.parametrize("written", [5, 1])
def test_on_the_simulator_a_kernel_over_the_whole_cache_touches_only_the_blocks_it_loads(written):
    # The offload gathers blocks 1 and 2 on its stream while the next step writes block `written`
    # on the default stream: block 5 is no race (the kernel never loads it), block 1 is one.
    def main() -> None:
        cache = torch.ones((8, 16), device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ids = torch.from_numpy(np.array([1, 2], dtype=np.int32)).to("cuda", non_blocking=True)
            staged = torch.empty((2, 16), device="cuda")
            _gather_blocks[(2,)](cache, ids, staged, BLOCK_NUMEL=16)
        cache[written].fill_(0.5)
        torch.cuda.synchronize()

    races, error, _, unfollowed = simulate(main)
    assert error is None and unfollowed == []
    assert [race.kind for race in races] == ([] if written == 5 else ["unordered-device-access"]), \
        [race.format() for race in races]


def test_on_a_gpu_a_table_kernels_rows_into_pinned_objects_side_by_side_are_each_their_own():
    # Rows stored into pinned objects the host allocator laid side by side (torch 2.11 on an H100
    # did so for small pin_memory=True objects): the kernel's words merge into one run across both;
    # each object's bytes are placed in its own region, not left as bytes no allocation holds.
    from sanitizer.gpu.launches import on_launch
    from sanitizer.gpu.observer import Observer
    from kvdevice.triton_cpu import launch_on_cpu

    cuda = FakeCuda()
    obs = Observer(device=cuda)
    cuda.obs = obs
    obs.start()
    backing = torch.zeros(2 * WORDS, dtype=torch.float32).numpy()  # one buffer, two storages over its halves
    try:
        kv = cuda.device(torch.arange(4 * ROWS * WORDS, dtype=torch.float32).reshape(4 * ROWS, WORDS))
        objects = [cuda.pinned(torch.from_numpy(backing[i * WORDS:(i + 1) * WORDS])) for i in range(ROWS)]
        assert objects[0].data_ptr() + 4 * WORDS == objects[1].data_ptr()
        src, _, sizes = _tables(kv, 1, kv, 1)
        tables = []
        for values in (src, np.array([o.data_ptr() for o in objects], dtype=np.int64), sizes):
            table = cuda.device(torch.zeros(ROWS, dtype=torch.int64))
            table.copy_(torch.from_numpy(values))
            tables.append(table)
        side = cuda.new_stream()
        with cuda.stream(side):
            with obs.lock:
                on_launch(obs, swap._swap_blocks_kernel, (*tables, ROWS), {"BYTES_PER_CHUNK": 64}, (2,))
            launch_on_cpu(swap._swap_blocks_kernel, (2,), *tables, ROWS, BYTES_PER_CHUNK=64)
        objects[1].tolist()  # the host reads the second row's object before it saw the kernel finish
    finally:
        races = obs.stop()
    assert [u.message() for u in obs.take_unfollowed()] == []
    assert torch.equal(objects[1], kv[ROWS + 1])
    assert [r.kind for r in races] == ["host-read-vs-pending-copy"]
