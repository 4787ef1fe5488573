"""Custom ops by their effect models (racecheck/custom_ops.py, racecheck/engine_ops.py) in both tools.

For each shipped model: its reference implementation moves the bytes a plain-torch computation
says; run on a side stream, it beside a read of the bytes it reads is no race, and beside a read of
the bytes it writes is one (the sanitizer on the simulator; the GPU observer through the CUDA
stand-in for the ops whose values the host holds). A custom op with no model is a harness error in
the fuzzer and one line in the sanitizer; a model a user registers is followed.
"""

from __future__ import annotations

import types

import pytest
import torch

from fake_cuda import FakeCuda
from racecheck import custom_ops
from racecheck.engine_ops import PageBufferShapeDesc
from sanitizer.sim.session import simulate
from kvdevice.intercept.errors import InterceptError


def _swap_blocks(dev, pinned):
    src = dev(torch.arange(32, dtype=torch.float32).reshape(8, 4))
    dst = dev(torch.zeros(8, 4))
    mapping = torch.tensor([[1, 3], [5, 0]])

    def expected(s, d):
        d = d.clone()
        d[3], d[0] = s[1], s[5]
        return d

    return types.SimpleNamespace(read=src, written=dst, expected=lambda: expected(src.cpu(), torch.zeros(8, 4)),
                                 call=lambda: torch.ops._C_cache_ops.swap_blocks(src, dst, 16, mapping))


def _swap_blocks_batch(dev, pinned):
    src = dev(torch.arange(32, dtype=torch.float32).reshape(8, 4))
    dst = pinned(torch.zeros(8, 4))
    src_ptrs = torch.tensor([src[2].data_ptr(), src[6].data_ptr()], dtype=torch.uint64)
    dst_ptrs = torch.tensor([dst[0].data_ptr(), dst[1].data_ptr()], dtype=torch.uint64)
    sizes = torch.tensor([16, 16])

    def expected():
        out = torch.zeros(8, 4)
        out[0], out[1] = src.cpu()[2], src.cpu()[6]
        return out

    return types.SimpleNamespace(read=src, written=dst, expected=expected,
                                 call=lambda: torch.ops._C_cache_ops.swap_blocks_batch(src_ptrs, dst_ptrs, sizes))


def _kv(dev, n=6, width=8, base=0.0):
    return dev(torch.arange(n * width, dtype=torch.float32).reshape(n, width) + base)


def _moved(src, pairs, n=6, width=8):
    out = torch.zeros(n, width)
    for s, d in pairs:
        out[d] = src.cpu()[s]
    return out


def _per_layer(dev, pinned):
    src_k, src_v, dst_k, dst_v = _kv(dev), _kv(dev, base=100), dev(torch.zeros(6, 8)), dev(torch.zeros(6, 8))
    si, di = dev(torch.tensor([1, 4])), dev(torch.tensor([0, 5]))
    return types.SimpleNamespace(
        read=src_k, written=dst_k, expected=lambda: _moved(src_k, [(1, 0), (4, 5)]),
        call=lambda: torch.ops.sgl_kernel.transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, si, di, 32, 2, 1))


def _per_layer_mla(dev, pinned):
    src, dst = _kv(dev), dev(torch.zeros(6, 8))
    si, di = dev(torch.tensor([2, 5, 3])), dev(torch.tensor([1, 4, 0]))
    return types.SimpleNamespace(
        read=src, written=dst, expected=lambda: _moved(src, [(2, 1), (5, 4), (3, 0)]),
        call=lambda: torch.ops.sgl_kernel.transfer_kv_per_layer_mla(src, dst, si, di, 32, 2, 1))


def _all_layer(dev, pinned):  # HiCache's load: host pool (pinned) to the device's layers
    src_k = [_kv(pinned, base=10 * i) for i in range(2)]
    src_v = [_kv(pinned, base=100 + 10 * i) for i in range(2)]
    dst_k = [dev(torch.zeros(6, 8)) for _ in range(2)]
    dst_v = [dev(torch.zeros(6, 8)) for _ in range(2)]

    def table(tensors):
        return dev(torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64))

    tables = [table(t) for t in (src_k, dst_k, src_v, dst_v)]
    si, di = dev(torch.tensor([1, 4])), dev(torch.tensor([0, 5]))
    return types.SimpleNamespace(
        read=src_k[1], written=dst_k[1], expected=lambda: _moved(src_k[1], [(1, 0), (4, 5)]),
        keep=(src_k, src_v, dst_k, dst_v),  # the tables hold only their addresses
        call=lambda: torch.ops.sgl_kernel.transfer_kv_all_layer(*tables, si, di, 32, 2, 2, 1))


def _lmcache(dev, pinned):
    nl, nb, bs, nh, hs = 2, 4, 2, 1, 4
    chunk = 2 * bs
    layers = [dev(torch.zeros(2, nb, bs, nh, hs)) for _ in range(nl)]
    obj = pinned(torch.arange(2 * nl * chunk * nh * hs, dtype=torch.float32).reshape(2, nl, chunk, nh * hs))
    table = dev(torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64))
    block_ids = dev(torch.tensor([3, 1]))
    desc = PageBufferShapeDesc()
    desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs, desc.element_size = 2, nl, nb, bs, nh, hs, 4

    def expected():  # layer 1 after the load: blocks 3 and 1 from the object's token rows 0-1 and 2-3
        out = torch.zeros(2, nb, bs, nh, hs)
        for j, block in enumerate([3, 1]):
            out[:, block] = obj[:, 1, j * bs:(j + 1) * bs].reshape(2, bs, nh, hs)
        return out

    def call():
        import lmcache.c_ops as ops  # the engine's own import: the stand-in where LMCache is absent

        ops.multi_layer_block_kv_transfer(table, [obj.data_ptr()], block_ids, torch.device("cuda"),
                                          ops.TransferDirection.H2D, desc, chunk, ops.GPUKVFormat.NL_X_TWO_NB_BS_NH_HS, 0)

    # keep: the table holds only the layers' addresses; layer 0, dropped, was written after its free
    # (a CI run aborted in the next allocation)
    return types.SimpleNamespace(read=obj, written=layers[1], expected=expected, call=call, keep=layers)


CASES = {"swap_blocks": _swap_blocks, "swap_blocks_batch": _swap_blocks_batch,
         "transfer_kv_per_layer": _per_layer, "transfer_kv_per_layer_mla": _per_layer_mla,
         "transfer_kv_all_layer": _all_layer, "multi_layer_block_kv_transfer": _lmcache}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_reference_moves_the_bytes_a_plain_torch_copy_moves(name):
    case = CASES[name](lambda t: t, lambda t: t)
    with custom_ops.extension_modules():
        case.call()
    assert torch.equal(case.written, case.expected())


def _as_on_a_gpu(monkeypatch, device_runs):
    """CUDA running, PyTorch's allocator holding ``device_runs`` (start, end) as device memory of
    cuda:0, the driver calling everything else host memory; the device's byte views played by the
    host's bytes (a CPU has no device memory). Returns the views made: (address, bytes, device type)."""
    from racecheck import raw_copies

    monkeypatch.setattr(raw_copies, "cuda_running", lambda: True)
    monkeypatch.setattr(raw_copies, "allocator_segments",
                        lambda: [(start, end, torch.device("cuda", 0)) for start, end in device_runs])
    monkeypatch.setattr(raw_copies, "ask_driver", lambda address, nbytes: torch.device("cpu"))
    views, real = [], raw_copies.byte_view

    def view(address, nbytes, device):
        views.append((address, nbytes, device.type))
        return real(address, nbytes, torch.device("cpu"))

    monkeypatch.setattr(raw_copies, "byte_view", view)
    return views


def test_without_its_extension_on_a_gpu_machine_the_reference_copies_device_memory_on_the_device(monkeypatch):
    case = CASES["swap_blocks_batch"](lambda t: t, lambda t: t)
    start = case.written.data_ptr()  # the destination's first two rows held by PyTorch's CUDA allocator
    views = _as_on_a_gpu(monkeypatch, [(start, start + 32)])
    with custom_ops.extension_modules():  # no tool routes: the stand-in runs the reference
        case.call()
    assert torch.equal(case.written, case.expected())
    assert [v for v in views if v[2] == "cuda"] == [(start, 16, "cuda"), (start + 16, 16, "cuda")]
    assert len([v for v in views if v[2] == "cpu"]) == 2  # the sources, host memory


def test_without_its_extension_an_address_nothing_can_place_is_refused_before_any_byte_moves(monkeypatch):
    import sys

    from racecheck import raw_copies

    case = CASES["swap_blocks_batch"](lambda t: t, lambda t: t)
    before = case.written.clone()
    monkeypatch.setattr(raw_copies, "cuda_running", lambda: True)
    monkeypatch.setattr(raw_copies, "allocator_segments", lambda: [])
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # no cuda-bindings to ask the driver with
    with custom_ops.extension_modules():
        with pytest.raises(RuntimeError, match=r"^address 0x[0-9a-f]+ \(16 bytes\) is in no allocation PyTorch knows, "
                                               r"and without cuda-bindings kvzero cannot ask the driver whether it is "
                                               r"device or host memory: install cuda-bindings"):
            case.call()
    assert torch.equal(case.written, before)


def test_a_references_copies_are_seen_by_no_torch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    case = CASES["transfer_kv_all_layer"](lambda t: t, lambda t: t)
    with custom_ops.extension_modules(), Watch():
        case.call()
    assert torch.equal(case.written, case.expected())
    assert not [op for op in seen if "copy" in op], seen


def test_without_its_extension_the_reference_refuses_a_device_tensor_argument():
    src, dst = torch.ones(2, 4, device="meta"), torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match=r"_C_cache_ops::swap_blocks: its extension is not installed, and kvzero's "
                                           r"reference implementation runs on host and CUDA memory only, "
                                           r"not on a meta tensor: install the extension, or run it under a tool"):
        custom_ops.route(_model("_C_cache_ops::swap_blocks"), (src, dst, 16, torch.tensor([[0, 1]])), {})
    assert not dst.any()


def _model(name: str) -> custom_ops.EffectModel:
    return next(m for m in custom_ops.models() if m.name == name)


def _program(name: str, beside: str) -> dict:
    """The op on a side stream, the main stream reading its source or its destination meanwhile."""
    out: dict = {}

    def main() -> None:
        case = CASES[name](lambda t: t.to("cuda"), lambda t: t.pin_memory())
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            case.call()
        getattr(case, beside).sum()  # a read of the same bytes, ordered with nothing
        torch.cuda.synchronize()
        out["moved"] = torch.equal(case.written.cpu(), case.expected())

    out["races"], out["error"], _, out["unfollowed"] = simulate(main)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_modelled_op_reading_beside_a_read_is_no_race_and_writing_is_one(name):
    reading = _program(name, "read")
    assert reading["error"] is None and reading["races"] == [] and reading["moved"]
    writing = _program(name, "written")
    assert writing["error"] is None and writing["moved"]
    assert {r.kind for r in writing["races"]} in ({"unordered-device-access"}, {"host-read-vs-pending-copy"})
    assert name in str(writing["races"][0])


# -- an op of the user's own ---------------------------------------------------------------------------

_LIB = torch.library.Library("kvz_test", "FRAGMENT")
_LIB.define("scatter_rows(Tensor src, Tensor dst, Tensor rows) -> ()")  # like the engines': no (a!)


def _scatter_rows(src, dst, rows):
    dst.index_copy_(0, rows, src)


_LIB.impl("scatter_rows", _scatter_rows, "CPU")


def _user_program(beside: str):
    def main() -> None:
        src, dst = torch.ones(2, 4, device="cuda"), torch.zeros(8, 4, device="cuda")
        rows = torch.tensor([6, 2], device="cuda")
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.ops.kvz_test.scatter_rows(src, dst, rows)
        (src[1] if beside == "read" else dst[2]).sum()
        torch.cuda.synchronize()

    return simulate(main)


def test_a_custom_op_with_no_model_is_one_line_in_the_sanitizer_and_the_run_goes_on():
    races, error, _, unfollowed = _user_program("written")
    assert error is None and races == []
    assert len(unfollowed) == 1
    assert unfollowed[0].startswith("kvz-sanitize cannot follow custom op kvz_test::scatter_rows (no effect model")
    assert "effect_model('kvz_test::scatter_rows'" in unfollowed[0]


def test_a_custom_op_with_no_model_is_a_harness_error_in_the_fuzzer():
    from kvdevice.intercept.session import InterceptSession
    from kvdevice.runtime import make_runtime

    session = InterceptSession(make_runtime("sim"), "mine")
    with pytest.raises(InterceptError, match=r"^custom op kvz_test::scatter_rows: no effect model says what it "
                                             r"reads and writes .*effect_model\('kvz_test::scatter_rows'"):
        with session.running("zero_block_ids", [0]):
            dst = torch.zeros(8, 4, device="cuda")
            torch.ops.kvz_test.scatter_rows(torch.ones(2, 4, device="cuda"), dst, torch.tensor([6, 2], device="cuda"))


@pytest.fixture(params=["with-reference", "the-programs-own-op"])
def user_model(request):
    """A model of the user's op; without ``reference=`` the simulator runs the op the program defined
    (its CPU kernel), as the docs say a program that defines its op gets its own op."""
    def effects(fx, src, dst, rows):
        fx.read(src)
        fx.read(rows)
        fx.write_rows(dst, 0, fx.values(rows))

    reference = _scatter_rows if request.param == "with-reference" else None
    custom_ops.register(custom_ops.EffectModel("kvz_test::scatter_rows", effects, reference=reference))
    yield
    custom_ops.unregister("kvz_test::scatter_rows")


def test_a_model_the_user_registers_is_followed(user_model):
    races, error, _, unfollowed = _user_program("written")
    assert error is None and unfollowed == []
    assert [r.kind for r in races] == ["unordered-device-access"] and "scatter_rows" in str(races[0])
    races, error, _, unfollowed = _user_program("read")
    assert error is None and unfollowed == [] and races == []


def test_the_programs_own_op_run_for_a_model_without_a_reference_moves_its_bytes():
    def effects(fx, src, dst, rows):
        fx.read(src)
        fx.read(rows)
        fx.write_rows(dst, 0, fx.values(rows))

    seen = []

    def main() -> None:
        src, dst = torch.ones(2, 4, device="cuda"), torch.zeros(8, 4, device="cuda")
        torch.ops.kvz_test.scatter_rows(src, dst, torch.tensor([6, 2], device="cuda"))
        seen.append(dst.sum(dim=1).tolist())

    custom_ops.register(custom_ops.EffectModel("kvz_test::scatter_rows", effects))
    try:
        races, error, _, unfollowed = simulate(main)
    finally:
        custom_ops.unregister("kvz_test::scatter_rows")
    assert error is None and unfollowed == [] and races == []
    assert seen == [[0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 4.0, 0.0]]


# -- the GPU observer, through the CUDA stand-in ----------------------------------------------------------

def _observe(body):
    from sanitizer.gpu.observer import Observer

    cuda = FakeCuda()
    obs = Observer(device=cuda)
    cuda.obs = obs
    obs.start()
    try:
        body(cuda)
    finally:
        races = obs.stop()
    return races, [u.message() for u in obs.take_unfollowed()], obs.take_notes()


@pytest.mark.parametrize("name", ["swap_blocks", "swap_blocks_batch"])
def test_the_gpu_observer_follows_a_modelled_op(name):
    def body(beside):
        def run(cuda):
            case = CASES[name](cuda.device, cuda.pinned)
            side = cuda.new_stream()
            with cuda.stream(side):
                case.call()
            getattr(case, beside).sum()

        return run

    races, unfollowed, _ = _observe(body("read"))
    assert races == [] and unfollowed == []
    races, unfollowed, _ = _observe(body("written"))
    assert unfollowed == [] and {r.kind for r in races} in ({"unordered-device-access"}, {"host-read-vs-pending-copy"})


def test_the_gpu_observer_says_a_custom_op_with_no_model_in_one_line():
    def body(cuda):
        src, dst = cuda.device(torch.ones(2, 4)), cuda.device(torch.zeros(8, 4))
        torch.ops.kvz_test.scatter_rows(src, dst, torch.tensor([6, 2]))

    races, unfollowed, _ = _observe(body)
    assert races == [] and len(unfollowed) == 1
    assert unfollowed[0].startswith("kvz-sanitize cannot follow custom op kvz_test::scatter_rows (no effect model")


# -- the fuzzer on CUDA, where the program has no extension -----------------------------------------------

def test_on_cuda_without_its_extension_the_fuzzer_queues_the_models_copies_as_one_op_of_the_runtime():
    # On controlled cuda the runtime calls an op's issue() behind the op's closed gate on its stream,
    # so the copies must be made there, not at the call (the session here queues issue() and runs
    # it later, as the schedule would). Host tensors stand in for the device's.
    from racecheck.device_values import DeviceValues
    from racecheck.placement import Extents
    from kvdevice.intercept.custom_calls import CustomCalls

    src = [_kv(lambda t: t, base=10 * i) for i in range(2)]
    dst = [torch.zeros(6, 8) for _ in range(2)]
    tables = [torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64) for layers in (src, dst, src, dst)]
    si, di = torch.tensor([1, 4]), torch.tensor([0, 5])
    everything = types.SimpleNamespace(key="memory", end=1 << 64)
    queued = []
    session = types.SimpleNamespace(
        call="offloader.load#1", block_map=None,
        cuda_ops=types.SimpleNamespace(values=DeviceValues(is_device=lambda t: t.is_cuda), _cache_storages={}),
        host=types.SimpleNamespace(lookup=lambda tensor: everything,
                                   regions=Extents([(0, everything.end, everything, everything.key, "pinned")])),
        enqueue=lambda issue, **declared: queued.append((issue, declared)))
    model = _model("sgl_kernel::transfer_kv_all_layer")
    assert CustomCalls(session).cuda(model, None, (*tables, si, di, 32, 2, 2, 1), {}) is None
    assert len(queued) == 1 and queued[0][1]["name"] == "transfer_kv_all_layer"
    written = [run for touch in queued[0][1]["writes"] for run in touch.ranges]
    assert (dst[1][0].data_ptr(), dst[1][0].data_ptr() + 32) in written
    assert not any(d.any() for d in dst)  # nothing moved at the call
    queued[0][0]()  # the schedule runs the op
    assert torch.equal(dst[1], _moved(src[1], [(1, 0), (4, 5)]))


@pytest.mark.parametrize("name", ["multi_layer_block_kv_transfer", "swap_blocks_batch", "transfer_kv_all_layer"])
def test_the_gpu_observer_takes_a_raw_access_to_pageable_host_memory_as_the_hosts_at_the_call(name):
    # Under pytest --kvz-sanitize on a GPU these ops over plain host tensors (reached through tables
    # of addresses and lists of pointers, not arguments) gave "could not place the 32 bytes at ...
    # (no allocation it knows holds them)": CUDA stages a copy from or to pageable memory before the
    # call returns, so those bytes are the host's, at the call, and no note is owed.
    moved = {}

    def body(cuda):
        case = CASES[name](lambda t: t, lambda t: t)
        case.call()
        moved["ok"] = torch.equal(case.written, case.expected())

    races, unfollowed, notes = _observe(body)
    assert races == [] and unfollowed == [] and moved["ok"]
    assert not [n for n in notes if "could not place" in n], notes


def test_the_gpu_observer_still_names_a_raw_access_it_cannot_place():
    def effects(fx, src, dst, rows):
        fx.read(src)
        fx.write(0x10, 16)  # an address in no memory the observer knows, nor the host's

    custom_ops.register(custom_ops.EffectModel("kvz_test::scatter_rows", effects, reference=_scatter_rows))
    try:
        def body(cuda):
            cuda.is_pageable = lambda address, size: False  # the driver does not call it host memory
            src, dst = cuda.device(torch.ones(2, 4)), cuda.device(torch.zeros(8, 4))
            torch.ops.kvz_test.scatter_rows(src, dst, torch.tensor([6, 2]))

        races, unfollowed, notes = _observe(body)
    finally:
        custom_ops.unregister("kvz_test::scatter_rows")
    assert [n for n in notes if n.startswith("kvz-sanitize could not place the 16 bytes at 0x10 that "
                                             "kvz_test::scatter_rows")], notes


@pytest.mark.parametrize("read_after_sync", [False, True])
def test_the_gpu_observer_places_an_ops_writes_to_pinned_objects_that_lie_side_by_side(read_after_sync):
    # On an H100 (torch 2.11) the host allocator handed LMCache's gather two small pin_memory=True
    # objects side by side; the op's writes through its list of pointers, merged into one run, lay
    # in no single allocation, and the observer said "could not place the 1024 bytes ... that access
    # is not checked". Each object's bytes are its own region's: the run is cut where one ends.
    nl, nb, bs, nh, hs = 2, 4, 2, 1, 4
    shape = (2, nl, bs, nh * hs)
    per_object = 2 * nl * bs * nh * hs
    backing = torch.zeros(2 * per_object).numpy()  # one buffer: two tensors over its halves, storages of their own
    moved = {}

    def body(cuda):
        import lmcache.c_ops as ops  # the engine's own import: the stand-in where LMCache is absent

        layers = [cuda.device(torch.arange(2 * nb * bs * nh * hs, dtype=torch.float32).reshape(2, nb, bs, nh, hs)
                              + 100 * i) for i in range(nl)]
        objects = [cuda.pinned(torch.from_numpy(backing[i * per_object:(i + 1) * per_object]).view(shape))
                   for i in range(2)]
        assert objects[0].data_ptr() + objects[0].nbytes == objects[1].data_ptr()  # side by side
        table, block_ids = cuda.device(torch.zeros(nl, dtype=torch.uint64)), cuda.device(torch.zeros(2, dtype=torch.int64))
        table.copy_(torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64))  # staged from the host:
        block_ids.copy_(torch.tensor([3, 1]))  # their values are known
        desc = PageBufferShapeDesc()
        desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs, desc.element_size = 2, nl, nb, bs, nh, hs, 4
        side = cuda.new_stream()
        with cuda.stream(side):
            ops.multi_layer_block_kv_transfer(table, [o.data_ptr() for o in objects], block_ids, torch.device("cuda"),
                                              ops.TransferDirection.D2H, desc, bs, ops.GPUKVFormat.NL_X_TWO_NB_BS_NH_HS, 0)
        if read_after_sync:
            cuda.synchronize()
        objects[1].sum()  # the host reads the second object
        moved["ok"] = torch.equal(objects[1][:, 1].reshape(2, bs, nh, hs), layers[1][:, 1])
        moved["keep"] = layers

    races, unfollowed, notes = _observe(body)
    assert not [n for n in notes if "could not place" in n], notes
    assert unfollowed == [] and moved["ok"]
    assert [r.kind for r in races] == ([] if read_after_sync else ["host-read-vs-pending-copy"]), races
