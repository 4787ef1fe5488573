"""Engine code's idioms on device tensors run on the simulator exactly as on CUDA.

Each row of ``IDIOMS`` is a small function written the way vLLM's zeroer, runners and tests write
it, parameterised by where it runs (``On``: the device, whether to pin, the event class). It runs
once inside an intercepted zeroer's constructor on the simulator (device ``cuda``) and once in
plain CPU torch (device ``cpu``, nothing pinned, events that have nothing to wait for), and the two
must agree on values, dtypes, shapes and Python types: the pattern of Hypothesis's database tests,
one operation against two implementations. Each row cites where vLLM does it, in the abbreviations
of the idiom catalogue: U = vllm/v1/worker/utils.py, TU = vllm/utils/torch_utils.py,
V1U = vllm/v1/utils.py, GMR = vllm/v1/worker/gpu_model_runner.py, MR2 = vllm/v1/worker/gpu/model_runner.py,
AU = vllm/v1/worker/gpu/async_utils.py, BU = vllm/v1/worker/gpu/buffer_utils.py,
T = tests/v1/worker/test_kv_block_zeroer.py.

Below the table: what the stream and event idioms mean on the simulator (a host read waits for
the stream, an event makes a device-to-host copy visible, ``set_stream`` is scoped to the call).
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

from zeroer.cache.geometries import geometry
from zeroer.cache.layout import build_cache
from kvdevice.intercept.errors import InterceptError
from zeroer.protocol import check_factory
from zeroer.registry import LoadedZeroer
from kvdevice.runtime import make_runtime


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


class _SynchronousEvent:
    """Plain CPU torch has no events (``cpu backend doesn't support events``), and needs none: its
    work is done when the call returns. The reference run's ``torch.cuda.Event``."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class On:
    """Where an idiom runs: ``cuda`` (the simulator, under interception) or ``cpu`` (the reference)."""

    device: str

    @property
    def pin(self) -> bool:  # vLLM's PIN_MEMORY: True with a GPU; a CPU-only torch cannot pin
        return self.device == "cuda"

    @property
    def Event(self) -> Any:  # looked up when called: inside the zeroer's call it is the stand-in
        return torch.cuda.Event if self.device == "cuda" else _SynchronousEvent


SIM, REFERENCE = On("cuda"), On("cpu")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")
BACKENDS = ["sim", pytest.param("cuda", marks=cuda)]  # cuda: the controlled mode, on a GPU


@dataclass(frozen=True)
class Idiom:
    name: str
    run: Callable[[On], Any]
    printed: bool = False  # returns torch's text for a tensor: CUDA's carries device='cuda:0'


def _synchronized(on: On) -> None:
    done = on.Event()
    done.record()
    done.synchronize()


# -- the idioms, each as engine code writes it ------------------------------------------------------
def tolist_of_the_address_table(on):  # T (V7 tests): seg_addrs.tolist() of a device uint64 tensor
    addrs = torch.tensor([2**40 + 64, 2**63 + 128], dtype=torch.uint64, device=on.device)  # U:197
    return addrs.tolist()


def tolist_of_device_ids(on):  # cache.table.addrs.tolist() in a constructor (issue 22)
    return torch.arange(4, dtype=torch.int64, device=on.device).tolist()


def item_of_a_device_flag(on):  # GMR:352, AU:94: self._has_fault.item()
    return torch.tensor([0, 7, 0], device=on.device).max().item()


def int_float_and_bool_of_device_scalars(on):  # the host reads a count before a launch
    n = torch.tensor(3, device=on.device)
    return int(n), float(n * 0.5), bool(n > 2)


def torch_all_used_as_a_bool(on):  # T:39-42: assert torch.all(storage[i] == 1)
    storage = torch.ones((4, 4), dtype=torch.int32, device=on.device)
    storage[1].zero_()
    return [bool(torch.all(storage[i] == 1)) for i in range(4)], "zeroed" if not torch.all(storage == 1) else "not"


def len_of_a_device_tensor(on):  # U:209: n_blocks = len(...)
    return len(torch.empty(5, 2, device=on.device))


def iteration_over_a_device_tensor(on):  # cpu_model_runner.py:193 indexes kv[block_id]; §3 item 87
    return [int(b) for b in torch.tensor([3, 1, 2], device=on.device)]


def repr_of_a_device_tensor(on):
    return repr(torch.tensor([1, 2, 3], device=on.device))


def str_of_a_float16_device_tensor(on):
    return str(torch.tensor([0.5, 1.5], dtype=torch.float16, device=on.device))


def f_string_of_a_device_tensor(on):  # logging the ids a call zeroes
    return f"zeroing {torch.tensor([4, 5], device=on.device)}"


def format_spec_of_a_0_dim_device_tensor(on):
    return f"{torch.tensor(0.25, device=on.device):.3f}"


def cpu_then_numpy(on):  # GMR:5730
    values = torch.arange(6, dtype=torch.int32, device=on.device).view(2, 3).cpu().numpy()
    return values.dtype.str, values.shape, values.tolist()


def cpu_then_tolist(on):  # GMR:357, AU:99
    return (torch.arange(3, device=on.device) * 2).cpu().tolist()


def non_blocking_to_cpu_then_event_synchronize_then_tolist(on):  # GMR:300-302, 316, 324, 330; AU:65-76
    host = (torch.arange(4, device=on.device) + 10).to("cpu", non_blocking=True)
    _synchronized(on)
    return host.tolist(), host.numpy().tolist(), host.is_pinned() == on.pin  # AU:149-150: .numpy()


def d2h_into_pinned_then_event_synchronize(on):  # GMR:1618-1620, 7798-7802 (_to_list); V1U:148-149
    pinned = torch.zeros(8, dtype=torch.int64, pin_memory=on.pin)
    dev = torch.arange(8, dtype=torch.int64, device=on.device) * 3
    pinned[:5].copy_(dev[:5], non_blocking=True)
    _synchronized(on)
    return pinned.tolist()


def as_tensor_of_a_list_and_an_array(on):  # issue 22 (§3 item 73: not in the files read)
    a = torch.as_tensor([1, 2, 3], device=on.device)
    b = torch.as_tensor(np.array([4, 5], dtype=np.int32), device=on.device)
    return a.cpu(), b.cpu()


def from_numpy_pinned_then_to_device_with_a_dtype(on):  # TU:698-702 (async_tensor_h2d), TU:707, TU:753
    t = torch.from_numpy(np.array([[1, 2], [3, 4]], dtype=np.int64))
    t = t.pin_memory() if on.pin else t
    return t.is_pinned() == on.pin, t.to(device=on.device, dtype=torch.int32, non_blocking=True).cpu()


def tensor_pinned_on_cpu_then_to_device(on):  # TU:700-702, the zeroer's async_tensor_h2d (U:210)
    ids = torch.tensor([7, 3, 5], dtype=torch.int64, pin_memory=on.pin, device="cpu")
    return ids.to(device=on.device, dtype=torch.int64, non_blocking=True).cpu()


def tensor_pinned_without_a_device_then_positional_to(on):  # GMR:1888-1890
    return torch.tensor([2, 4], dtype=torch.int64, pin_memory=on.pin).to(on.device, non_blocking=True).cpu()


def zeros_like_a_cpu_tensor_on_the_device(on):  # V1U:123-126 (CpuGpuBuffer)
    cpu = torch.zeros(2, 3, dtype=torch.int32, device="cpu", pin_memory=on.pin)
    gpu = torch.zeros_like(cpu, device=on.device)
    gpu[:1].copy_(torch.ones(1, 3, dtype=torch.int32), non_blocking=True)  # V1U:141 copy_to_gpu
    return gpu.cpu()


def empty_like_a_cpu_tensor_on_the_device(on):  # BU:37 (async_copy_to_gpu's out)
    out = torch.empty_like(torch.ones(3, dtype=torch.float16), device=on.device)
    return out.shape, out.dtype, out.device.type == on.device


def view_dtype_reinterprets_bytes(on):  # TU:580, V1U:787, gpu/attn_utils.py:262
    raw = torch.zeros(8, dtype=torch.int8, device=on.device)
    raw.view(torch.int32)[1] = 258
    return raw.view(torch.uint8).cpu(), raw.view(torch.int32).view(2, 1).cpu()


def as_strided_over_a_raw_buffer(on):  # gpu/attn_utils.py:255-259, TU:577-580
    raw = torch.arange(12, dtype=torch.int32, device=on.device)
    return torch.as_strided(raw, (2, 3), (6, 1), storage_offset=1).cpu()


def fill_and_zero_of_slices(on):  # GMR:2099, GMR:1010-1012, cpu_model_runner.py:194
    t = torch.ones(6, dtype=torch.float32, device=on.device)
    t[:2].fill_(5)
    t[4:].zero_()
    return t.cpu()


def index_fill_with_device_ids(on):  # gpu/sample/penalties.py:281-282
    t = torch.ones(5, dtype=torch.int64, device=on.device)
    return t.index_fill_(0, torch.tensor([1, 3], device=on.device), 0).cpu()


def scatter_into_a_device_tensor(on):  # GMR:1894-1900
    t = torch.zeros(4, dtype=torch.int64, device=on.device)
    t.scatter_(dim=0, index=torch.tensor([3, 0], device=on.device), src=torch.tensor([9, 8], device=on.device))
    return t.cpu()


def advanced_index_copy_between_blocks(on):  # U:575-576: blocks[dst] = blocks[src]
    blocks = torch.arange(12, dtype=torch.int32, device=on.device).view(4, -1)
    blocks[torch.tensor([0, 1], device=on.device)] = blocks[torch.tensor([2, 3], device=on.device)]
    return blocks.cpu()


def untyped_storage_data_ptr_is_the_tensors(on):  # U:555; U:164 kv.data_ptr()
    kv = torch.zeros(2, 4, dtype=torch.int32, device=on.device)
    return kv.untyped_storage().data_ptr() == kv.data_ptr(), kv[1].data_ptr() - kv.data_ptr(), kv.element_size()


def is_pinned_of_pinned_and_pageable_memory(on):  # TU:889
    return torch.empty(2, pin_memory=on.pin).is_pinned() == on.pin, torch.empty(2).is_pinned()


def pinned_numpy_view_written_then_copied(on):  # U@V2:208-210: _ids_pinned[:n].numpy()[:] = block_ids
    pinned = torch.empty(4, dtype=torch.int64, pin_memory=on.pin)
    gpu = torch.zeros(4, dtype=torch.int64, device=on.device)
    pinned[:2].numpy()[:] = [6, 9]
    gpu[:2].copy_(pinned[:2], non_blocking=True)
    return gpu.cpu()


def ndarray_to_device_then_unbind(on):  # U:564-566: async_tensor_h2d(np.array(pairs)), indices.unbind(dim=1)
    t = torch.from_numpy(np.array([[0, 1], [2, 3], [4, 5]], dtype=np.int64))
    src, dst = (t.pin_memory() if on.pin else t).to(device=on.device, non_blocking=True).unbind(dim=1)
    return src.cpu(), dst.cpu()


def data_shaped_ops_read_on_the_host(on):  # nonzero and masks: CUDA reads a count first
    x = torch.tensor([0, 3, 0, 5], device=on.device)
    return x.nonzero().cpu(), x[x > 0].cpu(), (x > 0).sum().item()


def new_tensor_on_a_device_tensors_device(on):  # data put where an existing tensor lives
    t = torch.zeros(2, dtype=torch.int32, device=on.device).new_tensor([5, 6])
    return t.device.type == on.device, t.cpu()


def to_another_tensors_device_and_dtype(on):  # .to(other)
    other = torch.zeros(1, dtype=torch.float64, device=on.device)
    return torch.tensor([1, 2]).to(other).cpu()


IDIOMS = sorted([
    Idiom("advanced_index_copy_between_blocks", advanced_index_copy_between_blocks),
    Idiom("as_strided_over_a_raw_buffer", as_strided_over_a_raw_buffer),
    Idiom("as_tensor_of_a_list_and_an_array", as_tensor_of_a_list_and_an_array),
    Idiom("cpu_then_numpy", cpu_then_numpy),
    Idiom("cpu_then_tolist", cpu_then_tolist),
    Idiom("d2h_into_pinned_then_event_synchronize", d2h_into_pinned_then_event_synchronize),
    Idiom("data_shaped_ops_read_on_the_host", data_shaped_ops_read_on_the_host),
    Idiom("empty_like_a_cpu_tensor_on_the_device", empty_like_a_cpu_tensor_on_the_device),
    Idiom("f_string_of_a_device_tensor", f_string_of_a_device_tensor, printed=True),
    Idiom("fill_and_zero_of_slices", fill_and_zero_of_slices),
    Idiom("format_spec_of_a_0_dim_device_tensor", format_spec_of_a_0_dim_device_tensor),
    Idiom("from_numpy_pinned_then_to_device_with_a_dtype", from_numpy_pinned_then_to_device_with_a_dtype),
    Idiom("index_fill_with_device_ids", index_fill_with_device_ids),
    Idiom("int_float_and_bool_of_device_scalars", int_float_and_bool_of_device_scalars),
    Idiom("is_pinned_of_pinned_and_pageable_memory", is_pinned_of_pinned_and_pageable_memory),
    Idiom("item_of_a_device_flag", item_of_a_device_flag),
    Idiom("iteration_over_a_device_tensor", iteration_over_a_device_tensor),
    Idiom("len_of_a_device_tensor", len_of_a_device_tensor),
    Idiom("ndarray_to_device_then_unbind", ndarray_to_device_then_unbind),
    Idiom("new_tensor_on_a_device_tensors_device", new_tensor_on_a_device_tensors_device),
    Idiom("non_blocking_to_cpu_then_event_synchronize_then_tolist", non_blocking_to_cpu_then_event_synchronize_then_tolist),
    Idiom("pinned_numpy_view_written_then_copied", pinned_numpy_view_written_then_copied),
    Idiom("repr_of_a_device_tensor", repr_of_a_device_tensor, printed=True),
    Idiom("scatter_into_a_device_tensor", scatter_into_a_device_tensor),
    Idiom("str_of_a_float16_device_tensor", str_of_a_float16_device_tensor, printed=True),
    Idiom("tensor_pinned_on_cpu_then_to_device", tensor_pinned_on_cpu_then_to_device),
    Idiom("tensor_pinned_without_a_device_then_positional_to", tensor_pinned_without_a_device_then_positional_to),
    Idiom("to_another_tensors_device_and_dtype", to_another_tensors_device_and_dtype),
    Idiom("tolist_of_device_ids", tolist_of_device_ids),
    Idiom("tolist_of_the_address_table", tolist_of_the_address_table),
    Idiom("torch_all_used_as_a_bool", torch_all_used_as_a_bool),
    Idiom("untyped_storage_data_ptr_is_the_tensors", untyped_storage_data_ptr_is_the_tensors),
    Idiom("view_dtype_reinterprets_bytes", view_dtype_reinterprets_bytes),
    Idiom("zeros_like_a_cpu_tensor_on_the_device", zeros_like_a_cpu_tensor_on_the_device),
], key=lambda idiom: idiom.name)


# -- running an idiom both ways --------------------------------------------------------------------
def described(value: Any) -> Any:
    """``value`` as comparable data: a tensor by dtype, shape and values (read on the host), every
    other value with its Python type."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.cpu().tolist())
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tolist())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [described(v) for v in value])
    return (type(value).__name__, value)


_OPEN: list[Any] = []  # runtimes made by the test running now


@pytest.fixture(autouse=True)
def _close_runtimes():
    """Close the test's runtimes after it: on a GPU, work left gated would spin under the next test."""
    yield
    with contextlib.ExitStack() as closing:  # last made first; each closed whatever an earlier close raised
        for rt in _OPEN:
            closing.callback(rt.close)
        _OPEN.clear()


def in_a_zeroer(body: Callable[[Any], Any], backend: str = "sim") -> tuple[Any, Any]:
    """What ``body(cache)`` returns when a zeroer's constructor runs it on the simulator (or on a
    GPU in the controlled mode), and the runtime."""
    box: dict[str, Any] = {}

    class Probe:
        def __init__(self, cache, runtime) -> None:
            box["value"] = body(cache)

        def zero_block_ids(self, block_ids: list[int]) -> None:
            pass

    rt = make_runtime(backend)
    _OPEN.append(rt)
    cache = build_cache(geometry("tiny"), device=rt.device)
    box["bound"] = LoadedZeroer("probe", Probe, check_factory(Probe, "probe")).build(cache, rt)
    return box["value"], rt


def as_printed_on_cuda(text: str) -> str:
    """torch's text for a CPU tensor, as it prints the same values on ``cuda:0`` (the device is its
    first suffix; short, one-line tensors only)."""
    if ", dtype=" in text:
        return text.replace(", dtype=", ", device='cuda:0', dtype=", 1)
    return text[:-1] + ", device='cuda:0')"


@pytest.mark.parametrize("idiom", IDIOMS, ids=[i.name for i in IDIOMS])
def test_each_engine_idiom_gives_on_the_simulator_what_it_gives_in_plain_torch_as_on_cuda(idiom):
    simulated, _ = in_a_zeroer(lambda cache: described(idiom.run(SIM)))
    reference = described(idiom.run(REFERENCE))
    if idiom.printed:
        reference = (reference[0], as_printed_on_cuda(reference[1]))
    assert simulated == reference


@cuda
@pytest.mark.parametrize("idiom", IDIOMS, ids=[i.name for i in IDIOMS])
def test_each_engine_idiom_gives_under_interception_on_a_gpu_what_it_gives_in_plain_cuda(idiom):
    # Plain first: it also loads the kernels the idiom launches. Launched for the first time
    # behind a closed gate, a kernel's module load waits for the GPU to drain, i.e. for ever
    # (docs/fuzz-your-zeroer.md): on the H200 ten idioms stopped at the gate's 30 s timeout
    # when this ran second in a fresh xdist worker.
    plain = described(idiom.run(SIM))
    intercepted, _ = in_a_zeroer(lambda cache: described(idiom.run(SIM)), backend="cuda")
    assert intercepted == plain


@cuda
@pytest.mark.parametrize("idiom", IDIOMS, ids=[i.name for i in IDIOMS])
def test_each_engine_idiom_gives_on_the_simulator_what_it_gives_in_plain_cuda(idiom):
    simulated, _ = in_a_zeroer(lambda cache: described(idiom.run(SIM)))
    assert simulated == described(idiom.run(SIM))


def test_a_tensor_the_zeroer_prints_reads_as_torch_prints_a_cuda_tensor():
    def printed(cache):
        return [repr(torch.tensor([1, 2], dtype=torch.int32, device="cuda")),
                str(torch.zeros(0, 3, device="cuda")),
                repr(torch.tensor([True, False], device="cuda")),
                f"{torch.arange(3, device='cuda')}"]

    texts, _ = in_a_zeroer(printed)
    assert texts == ["tensor([1, 2], device='cuda:0', dtype=torch.int32)",
                     "tensor([], device='cuda:0', size=(0, 3))",
                     "tensor([ True, False], device='cuda:0')",
                     "tensor([0, 1, 2], device='cuda:0')"]


def test_a_tensor_the_harness_prints_is_described_without_running_a_stream():
    held, rt = in_a_zeroer(lambda cache: torch.ones(3, dtype=torch.int64, device="cuda"))
    assert rt.pending(rt.default_stream) == 1  # the fill is still queued
    assert re.fullmatch(r"SimCudaTensor\(shape=\(3,\), dtype=torch\.int64, device='cuda:0', block=d\d+\)", repr(held))
    assert rt.pending(rt.default_stream) == 1


def test_numpy_of_a_device_tensor_is_cudas_own_type_error():
    def body(cache):
        torch.arange(2, device="cuda").numpy()

    with pytest.raises(TypeError, match=exactly(
            "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory "
            "first.")):
        in_a_zeroer(body)


# -- host reads wait for the stream ----------------------------------------------------------------
HOST_READS = {
    "tolist": lambda t: t.tolist(),
    "item": lambda t: t[0].item(),
    "int": lambda t: int(t[0]),
    "bool": lambda t: bool(torch.all(t == 7)),
    "repr": lambda t: repr(t),
    "cpu": lambda t: t.cpu(),
    "iteration": lambda t: [int(v) for v in t],
}


@pytest.mark.parametrize("read", sorted(HOST_READS))
def test_a_host_read_of_device_values_waits_for_the_current_stream_as_on_cuda(read):
    def body(cache):
        staged = torch.tensor([7, 7, 7], dtype=torch.int64, pin_memory=True)
        values = staged.to("cuda", non_blocking=True)  # queued: reads staged when the stream gets there
        seen = HOST_READS[read](values)  # the host waits for the stream: the copy has run
        staged.numpy()[:] = 0  # so rewriting staged is no race
        return described(seen)

    seen, rt = in_a_zeroer(body)
    assert rt.pending(rt.default_stream) == 0 and not rt.hazards
    assert read == "repr" or seen == described(HOST_READS[read](torch.full((3,), 7, dtype=torch.int64)))


def test_without_a_host_read_the_same_rewrite_is_a_race():
    def body(cache):
        staged = torch.tensor([7, 7, 7], dtype=torch.int64, pin_memory=True)
        staged.to("cuda", non_blocking=True)
        staged.numpy()[:] = 0

    _, rt = in_a_zeroer(body)
    [hazard] = rt.hazards
    assert hazard.kind == "host-write-vs-pending-copy"


def test_a_non_blocking_copy_of_kv_planes_goes_through_a_pageable_temporary_as_on_cuda():
    """torch copies K/V planes (``kv[:, a:b]``, not one run) through a host temporary: into pinned
    memory the copy is synchronous, from it the bytes are staged at the call. Neither leaves a
    pinned access queued; the same copy of whole rows does (aten/src/ATen/native/cuda/Copy.cu)."""
    def body(cache):
        pinned = torch.zeros(2, 4, 8, dtype=torch.int64, pin_memory=True)
        dev = torch.arange(64, dtype=torch.int64, device="cuda").reshape(2, 4, 8)
        pinned[:, 0:2].copy_(dev[:, 0:2], non_blocking=True)
        landed = pinned[:, 0:2].tolist()  # no sync: the copy returned once its bytes were there
        dev[:, 2:4].copy_(pinned[:, 0:2], non_blocking=True)
        pinned.numpy()[:] = -1  # the staged copy has read its source already: no race
        return landed, dev.tolist()

    (landed, after), rt = in_a_zeroer(body)
    assert landed == torch.arange(64).reshape(2, 4, 8)[:, 0:2].tolist()
    assert after == [[list(range(p * 32, p * 32 + 8)), list(range(p * 32 + 8, p * 32 + 16)),
                      list(range(p * 32, p * 32 + 8)), list(range(p * 32 + 8, p * 32 + 16))] for p in (0, 1)]
    assert not rt.hazards


def test_the_same_copy_of_whole_rows_stays_queued_and_its_host_rewrite_is_a_race():
    def body(cache):
        pinned = torch.zeros(4, 8, dtype=torch.int64, pin_memory=True)
        dev = torch.zeros(4, 8, dtype=torch.int64, device="cuda")
        dev[2:4].copy_(pinned[0:2], non_blocking=True)
        pinned.numpy()[:] = -1

    _, rt = in_a_zeroer(body)
    [hazard] = rt.hazards
    assert hazard.kind == "host-write-vs-pending-copy"


def test_an_event_recorded_after_a_d2h_copy_and_synchronized_makes_the_pinned_bytes_visible_as_on_cuda():
    def body(cache):
        pinned = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        dev = torch.arange(4, dtype=torch.int64, device="cuda") + 1
        pinned.copy_(dev, non_blocking=True)
        before = pinned.tolist()  # the simulator runs the copy only once the host waits for it
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return before, pinned.tolist(), pinned.is_pinned()

    (before, after, pinned), _ = in_a_zeroer(body)
    assert (before, after, pinned) == ([0, 0, 0, 0], [1, 2, 3, 4], True)


def test_a_non_blocking_move_to_the_host_is_pinned_and_queued_until_an_event_as_on_cuda():
    def body(cache):
        host = torch.arange(3, device="cuda").to("cpu", non_blocking=True)
        before = host.tolist()
        torch.cuda.current_stream().synchronize()
        return before, host.tolist(), host.is_pinned()

    (before, after, pinned), _ = in_a_zeroer(body)
    assert (before, after, pinned) == ([0, 0, 0], [0, 1, 2], True)


# -- streams and events ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_streams_and_events_take_the_arguments_engine_code_passes_as_on_cuda(backend):
    def body(cache):
        dev = cache.device
        main = torch.cuda.current_stream(dev)  # MR2:443-446
        side = torch.cuda.Stream(device=dev)  # stream-gated variant tests
        other = torch.cuda.Stream(dev)  # MR2:169
        done = torch.cuda.Event(blocking=True)  # GMR:286, AU:40
        plain = torch.cuda.Event(enable_timing=False)
        side.wait_stream(main)  # GMR:299
        with torch.cuda.stream(side):
            torch.zeros(4, device=dev)
            done.record()  # GMR:316
        plain.record(other)  # AU:66
        marker = side.record_event()  # gpu/pp_utils.py:152
        main.wait_event(done)  # gpu/pp_utils.py:118
        done.synchronize()  # GMR:324: side has run up to done, not to the marker after it
        pending = marker.query()
        side.synchronize()  # T:37
        return (type(marker) is torch.cuda.Event, done.query(), pending, marker.query(), side != main,
                torch.cuda.current_stream() == main)

    result, _ = in_a_zeroer(body, backend)
    assert result == (True, True, False, True, True, True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_set_stream_switches_inside_a_call_and_the_callers_stream_is_current_after_it_as_on_cuda(backend):
    def body(cache):
        caller = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        # AU:153-162, vLLM's stream(to_stream, from_stream) helper
        torch.cuda.set_stream(side)
        try:
            on_side = torch.cuda.current_stream() == side
            torch.zeros(2, device="cuda")  # queued on side
        finally:
            torch.cuda.set_stream(caller)
        back = torch.cuda.current_stream() == caller
        torch.cuda.set_stream(side)  # TU:778-815: switched for good, as vLLM's current_stream() does
        return on_side, back, side.runtime_stream

    (on_side, back, side), rt = in_a_zeroer(body, backend)
    assert (on_side, back) == (True, True)
    assert rt.pending(side) == 1 and rt.current_stream() is rt.default_stream  # restored at the call's end


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stream_scope_undoes_a_set_stream_made_inside_it_as_on_cuda(backend):
    def body(cache):
        caller, side, other = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda.set_stream(other)
            inside = torch.cuda.current_stream() == other
        return inside, torch.cuda.current_stream() == caller

    result, _ = in_a_zeroer(body, backend)
    assert result == (True, True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_accelerator_synchronize_waits_for_every_stream_through_the_runtime_as_on_cuda(backend):
    def body(cache):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.ones(4, device="cuda")
        torch.accelerator.synchronize()  # U@V3:215, when the ring grows
        return side.runtime_stream, torch.accelerator.current_stream() == torch.cuda.current_stream()

    (side, same), rt = in_a_zeroer(body, backend)
    assert rt.pending(side) == 0 and same


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_device_generic_event_and_stream_are_the_runtimes_as_on_cuda(backend):
    def body(cache):
        stream = torch.Stream()  # GMR:907
        event = torch.Event()  # GMR:907, 927-928
        with torch.cuda.stream(stream):
            torch.ones(2, device="cuda")
            event.record()
        torch.cuda.current_stream().wait_event(event)
        event.synchronize()
        return (isinstance(stream, torch.Stream), isinstance(torch.cuda.Stream(), torch.Stream), event.query(),
                stream.runtime_stream)

    (*checks, stream), rt = in_a_zeroer(body, backend)
    assert checks == [True, True, True] and rt.pending(stream) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_timing_events_from_a_pool_time_each_transfer_consistently_as_on_cuda(backend):
    # vLLM's offloading handler and SGLang's HiCache take a stream and two timing events from pools
    # per transfer and report start.elapsed_time(end) once the end event has completed.
    def body(cache):
        pool = [(torch.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(2)]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        times = []
        for job, size in enumerate((1, 3, 2, 4)):
            start, end = pool[job % 2]
            stream = streams[job % 2]
            start.record(stream)
            with torch.cuda.stream(stream):
                for _ in range(size):
                    torch.ones(4, device="cuda")
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times

    times, _ = in_a_zeroer(body, backend)
    assert all(t >= 0.0 for t in times)
    if backend == "sim":  # the simulator's clock: one step per op run between the records, the end's included
        from kvdevice.runtime.sim import SIM_MS_PER_STEP

        assert [round(t / SIM_MS_PER_STEP) for t in times] == [2, 4, 3, 5]


# elapsed_time's refusals as torch 2.8 and later raise them (pytorch/pytorch#151404, CUDAEvent.h and
# InlineEvent.h): its type, its words, and the call and state the runtime names with them.
ELAPSED_TIME_REFUSALS = {
    "untimed": ("ValueError", "Both events must be created with argument 'enable_timing=True'.",
                "a start event made without enable_timing=True"),
    "unrecorded": ("ValueError", "Both events must be recorded before calculating elapsed time.",
                   "a start event that was never recorded"),
    "queued": ("RuntimeError", "Both events must be completed before calculating elapsed time.",
               "an end event that had not completed"),
}
TORCH_TYPES = {"ValueError": ValueError, "RuntimeError": RuntimeError}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["untimed", "unrecorded"])
def test_elapsed_time_raises_what_torch_raises_on_events_it_cannot_time(backend, case):
    def body(cache):
        start, end = torch.cuda.Event(enable_timing=case != "untimed"), torch.cuda.Event(enable_timing=True)
        if case != "unrecorded":
            start.record()
        end.record()
        end.synchronize()
        start.synchronize()
        try:
            start.elapsed_time(end)
        except (ValueError, RuntimeError) as error:
            return error
        return None

    error, _ = in_a_zeroer(body, backend)
    kind, message, state = ELAPSED_TIME_REFUSALS[case]
    assert isinstance(error, TORCH_TYPES[kind]) and str(error) == message
    assert (error.call, error.state) == ("elapsed_time", state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_elapsed_time_of_an_event_still_queued_is_torchs_not_completed_error(backend):
    def body(cache):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.ones(4, device="cuda")
        end.record()
        try:
            start.elapsed_time(end)
        except RuntimeError as error:
            return error

    error, _ = in_a_zeroer(body, backend)
    kind, message, _ = ELAPSED_TIME_REFUSALS["queued"]
    assert isinstance(error, TORCH_TYPES[kind]) and not isinstance(error, ValueError) and str(error) == message
    # both events queued (nothing has run): torch stops at the start; the runtime names the end, whose
    # completion a time claims
    assert (error.call, error.state) == ("elapsed_time", "an end event that had not completed")


@cuda
@pytest.mark.parametrize("case", ["untimed", "unrecorded", "queued"])
def test_torchs_own_events_refuse_elapsed_time_as_the_runtime_does(case):
    """The reference for the rows above: a plain torch.cuda.Event on the GPU, outside the harness."""
    start, end = torch.cuda.Event(enable_timing=case != "untimed"), torch.cuda.Event(enable_timing=True)
    if case != "unrecorded":
        start.record()
    if case == "queued":
        torch.cuda._sleep(1 << 30)  # about a second of device cycles: end is still queued when it is timed
    end.record()
    if case != "queued":
        torch.cuda.synchronize()
    try:
        start.elapsed_time(end)
        error = None
    except (ValueError, RuntimeError) as raised:
        error = raised
    torch.cuda.synchronize()
    kind, message, _ = ELAPSED_TIME_REFUSALS[case]
    assert error is not None and type(error).__name__ == kind and str(error).startswith(message), repr(error)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_priorities_are_accepted_clamped_and_reported_as_on_cuda(backend):
    # vLLM's SimpleCPUOffload makes its copy streams at the lowest priority of the range
    def body(cache):
        low, high = torch.cuda.Stream.priority_range()
        made = [torch.cuda.Stream(priority=p) for p in (low, high, high - 10, low + 10)]
        return (low, high), [s.priority for s in made], torch.cuda.current_stream().priority

    ((low, high), priorities, current), _ = in_a_zeroer(body, backend)
    assert low == 0 and high < 0
    assert priorities == [low, high, high, low] and current == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_raw_stream_handle_names_its_stream_again_through_external_stream_as_on_cuda(backend):
    def body(cache):
        side = torch.cuda.Stream()
        again = torch.cuda.ExternalStream(side.cuda_stream)
        also = torch.cuda.get_stream_from_external(side.cuda_stream)
        return again == side and also == side and again.cuda_stream == side.cuda_stream

    same, _ = in_a_zeroer(body, backend)
    assert same


def test_a_raw_stream_handle_the_harness_did_not_make_is_refused_naming_the_call():
    def body(cache):
        torch.cuda.ExternalStream(0xDEAD)

    with pytest.raises(InterceptError, match=r"^torch\.cuda\.ExternalStream\(57005\): it is a stream the harness "
                                             r"did not make, so it can neither order nor schedule it; use a stream "
                                             r"made with torch\.cuda\.Stream\(\) \(its \.cuda_stream is followed\)$"):
        in_a_zeroer(body)


# -- the device --------------------------------------------------------------------------------------
def test_device_queries_answer_for_one_hopper_like_gpu_on_the_simulator():
    def body(cache):
        props = torch.cuda.get_device_properties(cache.device.index)  # GMR:1172 (num_compute_units)
        return (torch.cuda.current_device(), props.name, props.major, props.minor, props.multi_processor_count,
                props.total_memory, torch.accelerator.current_accelerator(), torch.accelerator.is_available())

    result, _ = in_a_zeroer(body)
    assert result == (0, "simulated GPU (kvzero-fuzz)", 9, 0, 132, 80 * 2**30, torch.device("cuda"), True)


def test_a_second_cuda_device_is_refused_naming_the_fix():
    with pytest.raises(InterceptError, match=exactly(
            "CUDA device 1: the simulator has one device, cuda:0; use the device of the KV cache the factory gets "
            "(cache.device)")):
        in_a_zeroer(lambda cache: torch.cuda.get_device_properties(1))


# -- the harness calls what the factory made ---------------------------------------------------------
def test_a_warmup_replaced_by_a_partial_of_a_bound_method_is_called_as_written():
    calls = []

    class Zeroer:
        def __init__(self, cache) -> None:
            self.device = cache.device

        def warmup(self, num_kv_blocks: int) -> None:  # U (V6): warmup(num_kv_blocks)
            calls.append(num_kv_blocks)
            torch.zeros(1, device=self.device)

        def zero_block_ids(self, block_ids: list[int]) -> None:
            pass

    def factory(cache, runtime):
        z = Zeroer(cache)
        z.warmup = functools.partial(z.warmup, 64)
        return z

    rt = make_runtime("sim")
    _OPEN.append(rt)
    cache = build_cache(geometry("tiny"), device=rt.device)
    bound = LoadedZeroer("probe", factory, check_factory(factory, "probe")).build(cache, rt)
    bound.warmup(cache.spec.num_blocks)
    assert calls == [64]


@pytest.mark.parametrize("backend", BACKENDS)
def test_record_stream_of_a_pinned_host_tensor_is_refused_as_on_cuda(backend):
    # aten::record_stream has a CUDA kernel only; torch's caching host allocator learns of a pinned
    # block's copies from copy_ itself (LMCache #4830 could not have been fixed with record_stream)
    def body(cache):
        pinned = torch.empty(4, pin_memory=True)
        try:
            pinned.record_stream(torch.cuda.Stream())
        except NotImplementedError as error:
            return str(error)
        return None

    said, _ = in_a_zeroer(body, backend)
    assert said is not None and said.startswith("Could not run 'aten::record_stream' with arguments from the 'CPU' backend")
