"""CUDA graphs on the simulator: a capture records the queued ops, a replay queues them again.

While a thread captures (``CUDAGraph.capture_begin`` to ``capture_end``, or inside
``torch.cuda.graph(g)``), nothing it issues runs or is queued: every op the session would enqueue
is recorded (its action, the bytes it reads and writes, the pinned bytes a copy reads or writes),
as CUDA records graph nodes. ``replay()`` queues the recorded ops in order on the current stream,
each a runtime op checked like any other; an action re-run reads what its memory holds then, so a
captured copy from a static pinned input reads what the host left there when the replay runs.
Memory allocated during the capture belongs to the graph (CUDA's private pool) and stays reserved
for its replays. What CUDA forbids while capturing (a synchronising op, ``.item()``) raises what
CUDA raises; events recorded and waited during the capture are part of the graph and order
nothing outside it.

Used by the sanitizer's program sessions (a zeroer's session refuses graphs: the fuzzer schedules
a zeroer's ops one by one).

Example (inside a program session on the simulator)::

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out.copy_(static_in_pinned, non_blocking=True)   # recorded, not queued
    g.replay()                                                  # queued now, reads static_in_pinned when run
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdevice.intercept.errors import raise_as_cuda, unroutable
from kvdevice.origin import stand_in


@dataclass(eq=False)
class CapturedOp:
    """One op recorded by a capture (stands in for the stamp ``enqueue`` returns)."""

    action: Callable[[], None]
    name: str
    reads: list
    writes: list
    cache_written: bool
    pinned_reads: list = field(default_factory=list)  # (region, view)
    pinned_writes: list = field(default_factory=list)  # (region, view)
    # an indexed op's rows, declared by each replay as it runs (what its index holds then)
    declare_rows: Callable[[Any], None] | None = None


class Capture:
    """What one capture recorded, and what it keeps alive for its replays."""

    def __init__(self) -> None:
        self.ops: list[CapturedOp] = []
        self.keep: list[Any] = []  # allocations made during the capture: the graph's own memory
        self.site: str = ""

    def record(self, action: Callable[[], None], name: str, reads: Any, writes: Any, cache_written: bool) -> CapturedOp:
        op = CapturedOp(action, name, list(reads), list(writes), cache_written)
        self.ops.append(op)
        return op


class SimGraphs:
    """The captures of one session: which thread captures now, and the graphs it recorded."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self._capturing: dict[int, Capture] = {}

    def current(self) -> Capture | None:
        if not self._capturing:
            return None
        return self._capturing.get(threading.get_ident())

    def begin(self) -> Capture:
        ident = threading.get_ident()
        if ident in self._capturing:
            raise_as_cuda(RuntimeError("CUDA error: operation not permitted when stream is capturing "
                                       "(a capture is already under way on this thread)"))
        capture = self._capturing[ident] = Capture()
        return capture

    def end(self) -> Capture | None:
        return self._capturing.pop(threading.get_ident(), None)

    def refuse_sync(self, what: str) -> None:
        """``what`` synchronises, which CUDA forbids on a capturing stream."""
        if self.current() is not None:
            raise_as_cuda(RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({what})"))

    def replay(self, capture: Capture) -> None:
        """Queue what ``capture`` recorded, in order, on the current stream."""
        session = self.session
        where = f" (captured at {capture.site})" if capture.site else " (captured into a CUDA graph)"
        for op in capture.ops:
            action = op.action if op.declare_rows is None else _ReplayDeclaringRows(op)
            stamp = session.enqueue(action, name=f"{op.name}{where}, replayed", reads=op.reads, writes=op.writes,
                                    cache_written=op.cache_written)
            if op.declare_rows is not None:
                action.stamp = stamp
            for region, view in op.pinned_reads:
                session.host.note_read(region, view, stamp)
            for region, view in op.pinned_writes:
                session.host.note_device_write(region, view, stamp)


class _ReplayDeclaringRows:
    """A replayed indexed op: declares its rows with this replay's stamp, then runs."""

    def __init__(self, op: CapturedOp) -> None:
        self.op = op
        self.stamp: Any = None

    def __call__(self) -> None:
        self.op.declare_rows(self.stamp)
        self.op.action()


def graph_classes(session: Any) -> dict[str, Any]:
    """``torch.cuda``'s graph API over ``session``'s captures: ``CUDAGraph``, ``graph``,
    ``graph_pool_handle``, ``is_current_stream_capturing``, ``make_graphed_callables`` (refused)."""
    graphs: SimGraphs = session.graphs

    @stand_in
    class CUDAGraph:
        """``torch.cuda.CUDAGraph`` on the simulator (module docstring)."""

        def __init__(self, keep_graph: bool = False) -> None:
            self._capture: Capture | None = None

        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            session.boundary("CUDAGraph.capture_begin")
            self._capture = graphs.begin()
            self._capture.site = session.site_text()

        def capture_end(self) -> None:
            graphs.end()
            session.boundary("CUDAGraph.capture_end")

        def replay(self) -> None:
            if self._capture is None:
                raise_as_cuda(RuntimeError("CUDA error: replay() of a CUDA graph that was never captured"))
            session.boundary("CUDAGraph.replay")
            graphs.replay(self._capture)

        def reset(self) -> None:
            self._capture = None

        def pool(self) -> tuple[int, int]:
            return (0, id(self))

        def instantiate(self) -> None:
            return None

        def enable_debug_mode(self) -> None:
            return None

        def debug_dump(self, path: str) -> None:
            raise unroutable("CUDAGraph.debug_dump", "the simulator records no CUDA graph to dump",
                             "dump the graph on a GPU")

    @stand_in
    class graph:  # noqa: N801 - named as the torch.cuda.graph it replaces
        """``with torch.cuda.graph(g):``: capture ``g`` (the simulator needs no capture stream)."""

        def __init__(self, cuda_graph: CUDAGraph, pool: Any = None, stream: Any = None,
                     capture_error_mode: str = "global") -> None:
            self.cuda_graph = cuda_graph

        def __enter__(self) -> None:
            session.rt.synchronize()  # torch.cuda.graph synchronises before capturing
            self.cuda_graph.capture_begin()

        def __exit__(self, *exc: object) -> None:
            self.cuda_graph.capture_end()

    def graph_pool_handle() -> tuple[int, int]:
        return (0, 0)

    def is_current_stream_capturing() -> bool:
        return graphs.current() is not None

    def make_graphed_callables(*args: Any, **kwargs: Any) -> Any:
        raise unroutable("torch.cuda.make_graphed_callables", "the simulator captures graphs only through "
                         "torch.cuda.graph / CUDAGraph", "capture with torch.cuda.graph(g) and replay g")

    return {"CUDAGraph": CUDAGraph, "graph": graph, "graph_pool_handle": graph_pool_handle,
            "is_current_stream_capturing": is_current_stream_capturing,
            "make_graphed_callables": make_graphed_callables}
