"""The sanitizer on the CPU simulator: the same program, its ``cuda`` tensors simulated.

Where there is no GPU (CI), a program's torch code runs under :mod:`zeroer.intercept`, the
interception the fuzzer uses for plain torch zeroers: device tensors live in simulated device
memory, streams and events are the simulator's, and the same happens-before checker sees every op.
A queued op runs only when the host waits for its stream, so a copy from pinned memory always reads
what the host left there by then: the simulator runs every program with the window forced open.

This module adds what a program's report needs and a zeroer's does not: each op and each host
write labelled with the program line it came from, pinned buffers with their allocation sites, and
the checker's hazards turned into :class:`~sanitizer.races.Race` records, the same records the
GPU observer (:mod:`sanitizer.observer`) makes.

Example::

    races = run_simulated(program.main)     # -> [Race(...)] on a racy program, [] on its twin
"""

from __future__ import annotations

import re
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sanitizer.races import Access, Race
from sanitizer.sites import Site, also_skip, caller_site
from zeroer.intercept.session import InterceptSession
from zeroer.runtime import make_runtime
from racecheck.hb import Hazard, OpStamp

_STREAM = re.compile(r"^zeroer-(\d+)$")


class _HostWrite(str):
    """The label of a host write the shadow diff saw: the program lines it was seen between."""

    access: Access


class ProgramSession(InterceptSession):
    """An :class:`InterceptSession` for a whole program: labels are program lines."""

    def __init__(self, name: str) -> None:
        import zeroer

        for part in ("intercept", "runtime", "triton_cpu.py", "origin.py"):
            also_skip(Path(zeroer.__file__).parent / part)
        super().__init__(make_runtime("sim"), name)
        self.host.rename_owner("the program")
        self.ops: dict[str, Access] = {}
        self.allocated: dict[tuple, Site] = {}
        self._site: Site | None = None
        register = self.host.register

        def registered(tensor: Any, origin: str = "") -> Any:
            buffer = register(tensor, origin)
            self.allocated[buffer.key] = caller_site()
            return buffer

        self.host.register = registered  # type: ignore[method-assign]
        self._numpy_at: dict[tuple, Site] = {}  # pinned buffer key -> where its numpy view was last taken
        numpy_handler = self.mode._handlers[torch.Tensor.numpy]

        def numpy(func: Any, args: tuple, kwargs: dict) -> Any:
            buffer = self.host.lookup(args[0]) if isinstance(args[0], torch.Tensor) else None
            if buffer is not None:
                self.boundary("Tensor.numpy")
                self._numpy_at[buffer.key] = self._site or caller_site()
            return numpy_handler(func, args, kwargs)

        self.mode._handlers[torch.Tensor.numpy] = numpy
        self.mode._handlers[torch.Tensor.__array__] = numpy
        host_write = self.rt.hb.host_write

        def through_numpy(key: tuple, label: str) -> None:
            site = self._numpy_at.get(key)
            if site is not None and isinstance(label, _HostWrite):
                label = _HostWrite(label)
                label.access = Access("host write through the buffer's numpy view", "the host", site,
                                      until=self._site)
            host_write(key, label)

        self.rt.hb.host_write = through_numpy  # type: ignore[method-assign]

    def _stream(self) -> str:
        name = self.rt.current_stream().name
        match = _STREAM.match(name)
        if name == "main":
            return "the default stream"
        return f"stream {match.group(1)} (made by the program)" if match else f"stream '{name}'"

    def _note(self, stamp: OpStamp, name: str, site: Site) -> None:
        self.ops[stamp.label] = Access(name, self._stream(), site)

    def enqueue(self, fn: Callable[[], None], *, name: str, reads: Sequence[Any] = (), writes: Sequence[Any] = (),
                cache_written: bool = False) -> OpStamp:
        site = caller_site()
        stamp = super().enqueue(fn, name=name, reads=reads, writes=writes, cache_written=cache_written)
        self._note(stamp, name, site)
        return stamp

    def boundary(self, what: str) -> None:
        site = caller_site()
        label = _HostWrite("host write")
        label.access = Access("host write", "the host", self._site or site, until=site)
        self.host.check(label)
        self._site = site
        self._last = what


def run_simulated(main: Callable[[], Any], name: str = "program") -> tuple[list[Race], BaseException | None]:
    """Run ``main`` with its ``cuda`` work on the simulator; its races, and what it raised (if anything,
    a ``KeyboardInterrupt`` included: the races seen before Ctrl-C are not lost)."""
    session = ProgramSession(name)
    raised: BaseException | None = None
    with session.running("main"):
        try:
            main()
        except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - reported beside its races
            raised = error
    return [race_of(session, hazard) for hazard in session.rt.hb.hazards], raised


def race_of(session: ProgramSession, hazard: Hazard) -> Race:
    """The checker's ``hazard`` as the report's :class:`Race`, with the program lines the session noted."""
    queued = session.ops.get(hazard.first) or Access(hazard.first, "?", None)
    if hazard.kind == "host-write-vs-pending-copy":
        later = getattr(hazard.second, "access", None) or Access(str(hazard.second), "the host", None)
        key = next((k for k, s in session.allocated.items() if session.rt.hb._name(k) == hazard.resource), None)
        return Race(hazard.kind, hazard.resource, session.allocated.get(key) if key else None, queued, later)
    later = session.ops.get(hazard.second) or Access(hazard.second, "?", None)
    return Race(hazard.kind, hazard.resource, None, queued, later)
