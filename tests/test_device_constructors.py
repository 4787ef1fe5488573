"""Tables made in device memory by ``torch.tensor(data, device="cuda")``, ``torch.as_tensor``,
``torch.asarray`` and ``Tensor.new_tensor``, known to the sanitizer on a GPU
(sanitizer/gpu/constructors.py): torch fills them below the dispatch mode, so the observer wraps
the constructors. The observer runs on the CUDA stand-in (tests/fake_cuda.py), whose constructors
take a CUDA device as a CUDA build of torch does (the copy hidden from every mode for a list or a
scalar, dispatched for a tensor or a numpy array).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from fake_cuda import FakeCuda
from test_device_values import ROWS, WORDS, _handler_tables, _launch, _observe, to_cuda

KINDS_OF_DEVICE = ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0]
UNKNOWN_TABLE = (r"kvz-sanitize cannot follow Triton kernel _swap_blocks_kernel's argument 'dst_addrs' \(an address "
                 r"table the kernel goes through, in device memory whose values the program did not stage from the "
                 r"host\) at ")


def _swap(make_tables, beside: str):
    """The swap kernel on a side stream over tables ``make_tables(host, kv)`` makes there (a load:
    it writes kv block 1); ``beside="device"``: the default stream then reads block 1, unordered."""

    def program(cuda, obs):
        kv = cuda.device(torch.ones((4 * ROWS, WORDS), dtype=torch.float32))
        host = cuda.pinned(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        _launch(cuda, obs, lambda: make_tables(host, kv), ROWS)
        if beside == "device":
            kv[ROWS:2 * ROWS].sum()

    return _observe(program)


def _expect(result, beside: str) -> None:
    races, unfollowed, _ = result
    assert unfollowed == []
    assert [r.kind for r in races] == (["unordered-device-access"] if beside == "device" else [])


@pytest.mark.parametrize("beside", ["none", "device"])
@pytest.mark.parametrize("device", KINDS_OF_DEVICE, ids=repr)
def test_a_table_made_by_torch_tensor_of_a_list_on_the_device_is_followed(device, beside):
    """vLLM's and our zeroers' ``torch.tensor(list, device=...)``: clean where ordered, the race where not."""
    _expect(_swap(lambda host, kv: [torch.tensor(t.tolist(), device=device) for t in _handler_tables(host, kv, 1)],
                  beside), beside)


@pytest.mark.parametrize("beside", ["none", "device"])
@pytest.mark.parametrize("how", ["as_tensor of a list", "as_tensor of an array", "asarray of a list",
                                 "new_tensor of a device tensor", "new_tensor with a device"])
def test_a_table_made_by_the_other_constructors_is_followed(how, beside):
    def make(host, kv):
        tables = _handler_tables(host, kv, 1)
        if how == "as_tensor of a list":
            return [torch.as_tensor(t.tolist(), dtype=torch.int64, device="cuda") for t in tables]
        if how == "as_tensor of an array":  # dispatched by torch itself: the copy path knows it
            return [torch.as_tensor(t, None, "cuda") for t in tables]
        if how == "asarray of a list":
            return [torch.asarray(t.tolist(), device="cuda") for t in tables]
        if how == "new_tensor of a device tensor":  # its device and dtype are the base's
            base = to_cuda(torch.zeros(1, dtype=torch.int64))
            return [base.new_tensor(t.tolist()) for t in tables]
        return [torch.zeros(1, dtype=torch.int64).new_tensor(t.tolist(), device="cuda") for t in tables]

    _expect(_swap(make, beside), beside)


def test_a_table_computed_on_the_device_from_a_torch_tensor_table_is_followed():
    """Block ids from ``torch.tensor(list, device=...)``, rows and addresses computed on the device."""

    def make(host, kv):
        blocks = torch.tensor([0, 1], device="cuda")
        rows = (blocks[:, None] * ROWS + torch.ops.aten.arange.default(ROWS, dtype=torch.int64,
                                                                         device=torch.device("cuda"))).reshape(-1)
        stride = WORDS * 4
        sizes = torch.tensor([stride] * (2 * ROWS), device="cuda")
        return [(rows * stride + host.data_ptr())[ROWS:], (rows * stride + kv.data_ptr())[ROWS:], sizes[ROWS:]]

    _expect(_swap(make, "device"), "device")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint64, torch.int16, torch.uint8])
def test_the_values_are_the_results_dtype(dtype):
    def program(cuda, obs):
        made = torch.tensor([1, 2, 250], dtype=dtype, device="cuda")
        assert obs.values.values(made).tolist() == [1, 2, 250]
        assert obs.values.values(made).dtype == np.dtype(str(dtype).replace("torch.", ""))
        wide = torch.tensor([[1, 2], [3, 4]], dtype=dtype, device="cuda")[:, 1]  # a view of it
        assert obs.values.values(wide).tolist() == [2, 4]

    races, unfollowed, _ = _observe(program)
    assert races == [] and unfollowed == []


def test_a_generator_is_refused_as_torch_refuses_it_and_never_read_twice():
    read = []

    def ids():
        for i in (3, 1):
            read.append(i)
            yield i

    with pytest.raises(RuntimeError) as plain:
        torch.tensor(ids())
    reads_plain, read[:] = list(read), []

    def program(cuda, obs):
        with pytest.raises(RuntimeError) as observed:
            torch.tensor(ids(), device="cuda")
        assert str(observed.value) == str(plain.value)
        assert read == reads_plain

    assert _observe(program)[:2] == ([], [])


class _Table(Sequence):
    """An object of the program's own that acts as a sequence, counting its reads."""

    def __init__(self, values: list[int]) -> None:
        self.values, self.reads = values, 0

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i):
        self.reads += 1
        return self.values[i]


def test_a_sequence_of_the_programs_own_is_read_once_and_its_table_is_one_line():
    """Reading it again could give other values: not read, so unknown, and said (never a guess)."""

    def make(host, kv):
        tables = [_Table(t.tolist()) for t in _handler_tables(host, kv, 1)]
        made = [torch.tensor(t, device="cuda") for t in tables]
        plain = _Table(tables[0].values)
        torch.tensor(plain)
        assert [t.reads for t in tables] == [plain.reads] * 3
        return made

    races, unfollowed, _ = _swap(make, "device")
    assert races == []  # no verdict on what the kernel touched
    assert len(unfollowed) == 1
    assert re.match(r"kvz-sanitize cannot follow Triton kernel _swap_blocks_kernel's arguments 'dst_addrs', 'sizes' "
                    r"and 'src_addrs' \(address tables the kernel goes through", unfollowed[0])


def test_a_hidden_copy_is_a_write_on_the_current_stream_the_host_has_seen():
    """torch's blocking copy: a write of the fresh table on the stream, then the host waits for it."""
    from sanitizer.gpu.observer import Observer

    cuda = FakeCuda()
    with cuda.placing():
        obs = Observer(device=cuda)
        cuda.obs = obs
        obs.start()
        try:
            side = cuda.new_stream()
            with cuda.stream(side):
                made = torch.tensor([1, 2], device="cuda")
            made.add_(1)  # the default stream: ordered after the copy by the host's wait
            assert obs.values.values(made).tolist() == [2, 3]
        finally:
            races = obs.stop()
    assert races == []
    assert any(label.startswith("torch.tensor (H2D copy)") for label in _labels(obs))


def _labels(obs) -> list[str]:
    return [access.what for access in obs._accesses.values()]


def test_the_constructors_are_put_back_when_the_observer_stops():
    from sanitizer.gpu.observer import Observer

    owners = [(torch, "tensor"), (torch, "as_tensor"), (torch, "asarray"), (torch.Tensor, "new_tensor")]
    before = [getattr(owner, name) for owner, name in owners]
    obs = Observer(device=FakeCuda())
    obs.start()
    try:
        assert all(getattr(owner, name) is not b for (owner, name), b in zip(owners, before))
        assert torch.tensor([1, 2]).tolist() == [1, 2]  # host data on the host: handed on
    finally:
        obs.stop()
    assert [getattr(owner, name) for owner, name in owners] == before


def test_to_of_pageable_tables_made_in_a_row_are_all_known_at_each_launch():
    """SwapHandler.transfer's shape (tests/triton_swap_offload.py): three tables from
    ``torch.from_numpy(a).to("cuda", non_blocking=True)`` in one generator, on a side stream, under
    inference mode, job after job so that the allocator hands the freed tables' memory out again
    (its trace callback comes inside each copy, as on a GPU)."""

    def program(cuda, obs):
        kv = cuda.device(torch.ones((4 * ROWS, WORDS), dtype=torch.float32))
        host = cuda.pinned(torch.zeros((4 * ROWS, WORDS), dtype=torch.float32))
        side = cuda.new_stream()
        for block in (1, 2, 1, 3):
            _launch(cuda, obs, lambda: tuple(to_cuda(torch.from_numpy(a)) for a in _handler_tables(host, kv, block)),
                    ROWS, side)

    with torch.inference_mode():
        races, unfollowed, _ = _observe(program)
    assert unfollowed == [] and races == []


class _Gates:
    """Force mode's gates as the observer drives them: whether they were opened, and when."""

    holding = True

    def __init__(self) -> None:
        self.opened: list[str] = []

    def release(self, site):
        self.opened.append(getattr(site, "function", None))
        return []

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("device", "opens"), [("cuda", True), (0, True), ("cpu", False), (None, False)])
def test_in_force_mode_the_gates_open_before_a_constructors_blocking_copy_to_the_device(device, opens):
    """torch's hidden copy waits for the current stream: a gate still closed there would hold the host."""
    from sanitizer.gpu.observer import Observer

    cuda, gates = FakeCuda(), _Gates()
    with cuda.placing():
        obs = Observer(device=cuda, forcing=gates)
        cuda.obs = obs
        obs.start()
        try:
            def make_table():
                return torch.tensor([1, 2], device=device)

            gates.opened.clear()
            make_table()
        finally:
            obs.stop()
    assert ("make_table" in gates.opened) == opens
