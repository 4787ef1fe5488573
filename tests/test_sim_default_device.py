"""Engine test code that leans on torch's defaults for CUDA runs on the sanitizer's simulator as on a GPU.

vLLM's KV-cache tests call ``torch.set_default_device("cuda")`` and then make their tensors with no
``device=``; other engines' tests scope it with ``with torch.device("cuda"):``, and seed a
``torch.Generator(device="cuda")`` to pass as ``generator=`` to their random factories. On a CPU
build of torch both failed before the program's first line of real work (a CUDA allocation torch
cannot make, a CUDA generator it cannot build). Each test is a small program run in-process with
:func:`sanitizer.sim.session.simulate`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from torch.utils._device import DeviceContext

from sanitizer.sim.session import simulate
from test_sanitizer_sim_cuda import simulated

# Each factory the simulator makes device memory with, called as engine tests call it: no device.
FACTORIES: dict[str, Callable[[], torch.Tensor]] = {
    "arange": lambda: torch.arange(8),
    "as_tensor": lambda: torch.as_tensor([1.0, 2.0]),
    "empty": lambda: torch.empty(4, 3),
    "empty_strided": lambda: torch.empty_strided((2, 3), (3, 1)),
    "full": lambda: torch.full((3,), 7.0),
    "linspace": lambda: torch.linspace(0.0, 1.0, 5),
    "ones": lambda: torch.ones(2, 2),
    "rand": lambda: torch.rand(4),
    "randint": lambda: torch.randint(0, 10, (6,)),
    "randn": lambda: torch.randn(4),
    "tensor": lambda: torch.tensor([1, 2, 3]),
    "zeros": lambda: torch.zeros(5),
}
UNINITIALISED = ("empty", "empty_strided")  # no values to compare
SEED = 1234


def _made_on_the_default_device(name: str) -> tuple[bool, torch.Tensor, bool]:
    """Whether ``name``'s tensor is CUDA under a CUDA default, its values, whether the next one is not."""
    torch.set_default_device("cuda")
    try:
        torch.manual_seed(SEED)
        tensor = FACTORIES[name]()
        on_cuda = tensor.is_cuda
        values = torch.zeros(0) if name in UNINITIALISED else tensor.cpu()
    finally:
        torch.set_default_device(None)
    return on_cuda, values, torch.zeros(1).is_cuda


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_factory_with_no_device_under_a_cuda_default_device_makes_device_memory_with_its_values(name):
    _races, (on_cuda, values, after) = simulated(lambda: _made_on_the_default_device(name))
    assert on_cuda and not after  # the default restored: host memory again
    if name not in UNINITIALISED:
        torch.manual_seed(SEED)
        torch.testing.assert_close(values, FACTORIES[name]())  # the CPU generator's draws, as seeded


def test_a_torch_device_scope_makes_device_memory_and_its_end_host_memory_again():
    @torch.inference_mode()
    def main():
        with torch.device("cuda"):
            kv = torch.ones(4, 8) * 2
            ids = torch.tensor([1, 3])
            rows = kv.index_select(0, ids)
            inside = (kv.is_cuda, ids.is_cuda, rows.sum().item())
        return inside, torch.zeros(1).is_cuda

    races, (inside, after) = simulated(main)
    assert races == [] and inside == (True, True, 32.0) and after is False


def test_like_factories_follow_their_input_under_a_cuda_default_device():
    def main():
        torch.set_default_device("cuda")
        try:
            host, device = torch.zeros(3, device="cpu"), torch.zeros(3)
            return torch.zeros_like(host).is_cuda, torch.empty_like(device).is_cuda, torch.get_default_device()
        finally:
            torch.set_default_device(None)

    _races, answers = simulated(main)
    assert answers == (False, True, torch.device("cuda", 0))


def test_a_race_on_memory_made_on_the_default_device_is_found_and_names_its_line():
    def main():
        torch.set_default_device("cuda")
        try:
            side = torch.cuda.Stream()
            kv = torch.ones(64)  # the allocation
            with torch.cuda.stream(side):
                kv.mul_(2)  # no wait for the default stream's write
        finally:
            torch.set_default_device(None)

    races, error, _, _ = simulate(main)
    assert error is None and [race.kind for race in races] == ["unordered-device-access"]
    lines = inspect.getsource(main).splitlines()
    allocated = races[0].allocated_at
    assert allocated is not None and lines[allocated.line - main.__code__.co_firstlineno].strip().startswith("kv = torch.ones")


# -- torch.Generator(device="cuda") ----------------------------------------------------------------
def _draws(seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device="cuda")
    assert generator.manual_seed(seed) is generator
    kv = torch.randn((4, 8), device="cuda", generator=generator)
    ids = torch.randint(0, 64, (5,), device="cuda", generator=generator)
    order = torch.randperm(6, device="cuda", generator=generator)
    uniform = torch.empty(3, device="cuda").uniform_(generator=generator)
    return tuple(t.cpu() for t in (kv, ids, order, uniform))


def test_a_seeded_cuda_generator_gives_the_same_draws_for_the_same_seed():
    def main():
        return _draws(0), _draws(0), _draws(1)

    _races, (first, again, other) = simulated(main)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


def test_a_cuda_generator_says_cuda_and_is_a_generator_and_a_cpu_one_stays_torchs():
    def main():
        cuda, cpu = torch.Generator(device="cuda"), torch.Generator()
        return (cuda.device, isinstance(cuda, torch.Generator), cpu.device, type(cpu) is torch._C.Generator,
                isinstance(cpu, torch.Generator))

    _races, answers = simulated(main)
    assert answers == (torch.device("cuda", 0), True, torch.device("cpu"), True, True)


def test_the_stand_ins_are_undone_when_the_program_ends_even_when_it_raises():
    original = DeviceContext.__torch_function__

    def main():
        torch.Generator(device="cuda")
        raise RuntimeError("the program's own")

    _races, error, _, _ = simulate(main)
    assert isinstance(error, RuntimeError)
    assert torch.Generator is torch._C.Generator and DeviceContext.__torch_function__ is original
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.Generator(device="cuda")  # torch's own again: a CPU build has none
