"""pytest wiring for tests/: the CUDA setup every GPU test expects, examples/ on the path, one
bytecode cache for the run's processes where bytecode is off (bytecode_cache), and on a machine with a
GPU the worker count of ``-n auto`` and the GPU slots tests share (gpu_budget)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from bytecode_cache import share_bytecode_cache
from gpu_budget import HELD, Slot, auto_workers, children_take_the_slot, machine_budget, slots_folder, uses_gpu
from racecheck.gate import request_gate_settings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytest_plugins = ["state_guard"]  # no state crosses tests (-p no:state_guard turns it off)


def pytest_configure(config: pytest.Config) -> None:
    # Before xdist starts its workers: they and every child a test starts inherit the cache.
    prefix = share_bytecode_cache(os.environ)
    if prefix is not None:
        sys.dont_write_bytecode, sys.pycache_prefix = False, prefix
    # Before any test touches CUDA: the controlled runtime's gated streams need their own hardware
    # queues and every kernel module loaded up front, and the driver reads both once, when CUDA
    # starts (the fuzz plugin asks for them only in a run that collects its campaigns).
    request_gate_settings()
    if str(EXAMPLES) not in sys.path:  # tests import the example zeroers as modules
        sys.path.insert(0, str(EXAMPLES))
    # A run started by a test that holds a GPU slot is inside that slot (gpu_budget).
    config._kvz_gpu_budget = None if os.environ.get(HELD) else machine_budget()  # type: ignore[attr-defined]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu-tests-only", action="store_true",
                     help="run only the tests that need CUDA (a skipif naming CUDA or a GPU): the GPU check's stage")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--gpu-tests-only"):
        return
    chosen = [item for item in items if uses_gpu(list(item.iter_markers()))]
    kept = {id(item) for item in chosen}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = chosen


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` on a machine with a GPU: as many workers as its budget holds (None: xdist's own)."""
    return auto_workers()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201 - a hook wrapper
    budget = getattr(item.config, "_kvz_gpu_budget", None)
    if budget is None or budget.slots == 0:
        yield
        return
    slot = Slot(slots_folder(), budget.slots)
    warn = lambda message: item.warn(pytest.PytestWarning(message))  # noqa: E731
    try:
        if uses_gpu(list(item.iter_markers())):
            if not slot.take():
                warn("no GPU slot came free in time; this test runs without one")
            yield
        else:
            with children_take_the_slot(slot, warn):
                yield
    finally:
        slot.give_back()
