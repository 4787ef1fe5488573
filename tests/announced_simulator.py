"""A pytest plugin for a CPU: the simulator's runtimes announce themselves in racecheck.schedules, as
kvzero's CUDA harness runtime does on a GPU.

On a GPU the fuzz harness runs on CUDA runtimes that announce themselves when they start and when
they close (kvdevice/runtime/cuda/common.py), so that a sanitizer in the same process steps aside
while they run. A test that leaves one open leaves every later observer of its process aside, with
an extra line ``kvz-sanitize cannot follow kvzero's CUDA harness runtime ...``. On a CPU the same
tests run on the simulator, which announces nothing, so such a leak cannot show there. Under this
plugin every :class:`~kvdevice.runtime.sim.SimRuntime` made during a test of the files named by
``--announce-simulator`` announces itself the same way and ends when it is closed: a test that
leaves one open leaves what it would leave on a GPU.

Example (tests/test_state_guard.py runs it)::

    pytest -p state_guard -p announced_simulator --announce-simulator tests/test_designs.py \
        tests/test_designs.py tests/test_table_kernels.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from racecheck import schedules
from kvdevice.runtime.sim import SimRuntime

WHAT = "kvzero's CUDA harness runtime"  # as the CUDA runtime names itself: the observer's line is the same
_ANNOUNCING: list[bool] = [False]  # whether the test running now is in one of the named files


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--announce-simulator", action="append", default=[], metavar="FILE",
                     help="the simulator's runtimes made by this file's tests announce themselves as kvzero's "
                          "CUDA harness runtime does (racecheck.schedules); repeatable")


def pytest_configure(config: pytest.Config) -> None:
    files = [Path(name).resolve() for name in config.getoption("announce_simulator")]
    if files:
        config.pluginmanager.register(_Announcing(files), "announced-simulator-files")


class _Announcing:
    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self._init, self._close = SimRuntime.__init__, SimRuntime.close

    def pytest_sessionstart(self) -> None:
        init, close = self._init, self._close

        def announced_init(rt: SimRuntime, *args: Any, **kwargs: Any) -> None:
            init(rt, *args, **kwargs)
            if _ANNOUNCING[0]:
                schedules.started(rt, WHAT)

        def announced_close(rt: SimRuntime) -> None:
            try:
                close(rt)
            finally:
                schedules.ended(rt)

        SimRuntime.__init__, SimRuntime.close = announced_init, announced_close  # type: ignore[method-assign]

    def pytest_sessionfinish(self) -> None:
        SimRuntime.__init__, SimRuntime.close = self._init, self._close  # type: ignore[method-assign]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        _ANNOUNCING[0] = item.path.resolve() in self.files
        try:
            return (yield)
        finally:
            _ANNOUNCING[0] = False
