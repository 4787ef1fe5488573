"""One intercepted zeroer's world: its runtime, memory, streams, and the scope its code runs in.

:meth:`InterceptSession.running` is the scope every call of the zeroer runs in (its constructor,
``warmup``, each ``zero_block_ids``, ``close``). Inside it:

* a ``TorchFunctionMode`` (:mod:`kvdevice.intercept.torch_mode`) sees every torch call: device
  factories, pinned allocations, ``.to``/``.cuda``/``.pin_memory``, indexing of device tensors,
  ``record_stream``;
* on the simulator, device tensors are :class:`~kvdevice.intercept.sim_tensor.SimCudaTensor` and
  their aten ops reach :class:`~kvdevice.intercept.sim_ops.SimOps`; on CUDA, a
  ``TorchDispatchMode`` (:mod:`kvdevice.intercept.cuda_ops`) routes the aten ops on CUDA tensors;
* ``torch.cuda``'s streams, events and synchronisation are stand-ins over the runtime
  (:mod:`kvdevice.intercept.cuda_api`) and ``JITFunction.run`` is wrapped
  (:mod:`kvdevice.intercept.triton_launch`); both patches are undone on exit, even on error;
* every boundary between the zeroer's code and the harness compares the pinned bytes that queued
  work will read with what they were (:mod:`kvdevice.intercept.host_memory`);
* threads the code starts run its torch work through the session, one at a time, and have all
  run until they wait before the call returns (:mod:`kvdevice.intercept.helper_threads`).

Everything the zeroer enqueues goes through :meth:`enqueue` (one runtime op) or :meth:`run_now`
(a synchronising op), labelled with the call it belongs to, so a race report names the call and
the op, exactly as for a runtime-API zeroer.

A runtime may hold several sessions, one per zeroer (:mod:`kvdevice.intercept.shared`): a session
has an ``index`` in the order they were bound, shares the runtime's pinned-buffer numbering and
(on the simulator) device memory, and once there are several its labels say which zeroer it is
(``spec[1].zero_block_ids#3([4])``, ``pinned host buffer p3 of zeroer 1``, stream ``zeroer[1]-1``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Iterator

import torch

from kvdevice.intercept.cuda_api import CudaApi, patched
from kvdevice.intercept.cache_access import CacheAccess
from kvdevice.intercept.driver_copies import DriverCopies
from kvdevice.intercept.helper_threads import HelperThreads
from kvdevice.intercept.host_memory import HostMemory
from kvdevice.intercept.shared import share_of
from kvdevice.intercept.sim_memory import SIM_DEVICE, Block, SimDeviceMemory
from kvdevice.intercept.triton_launch import TritonLaunches
from kvdevice.intercept.unroutable import unroutable_guard
from kvdevice.runtime import Runtime
from racecheck import custom_ops
from racecheck.hb import OpStamp
from racecheck.placement import Placed


class InterceptSession:
    """See the module docstring. ``spec`` names the zeroer in labels and messages."""

    host_memory_class = HostMemory
    #: threads the code starts take turns (None: a program session follows them its own way)
    helper_threads_class: type[HelperThreads] | None = HelperThreads
    role = "zeroer"  # what the code under test is, in names: "the zeroer", stream "zeroer-1"
    #: on the simulator, a Triton kernel's device arguments are declared by the bytes it touched once
    #: it has run (a program session), else whole at its launch (the fuzzer's sessions, whose
    #: campaigns are measured that way)
    kernel_arguments_by_bytes = False

    def __init__(self, runtime: Runtime, spec: str) -> None:
        self.rt = runtime
        self.spec = spec
        self.backend = runtime.backend
        self.device = SIM_DEVICE if self.backend == "sim" else runtime.device
        self.share = share_of(runtime)
        self.host = self.host_memory_class(runtime, self.share.pinned_ids)
        self.index = self.share.join(self)  # after self.host: a second session renames the first's buffers
        self.host.rename_owner(self.owner)
        self.cuda_api = CudaApi(self)
        self.triton = TritonLaunches(self)
        self.driver = DriverCopies(self)  # copies through cuda-bindings and ctypes
        self.helpers = self.helper_threads_class(self) if self.helper_threads_class is not None else None
        self.memory: SimDeviceMemory | None = None
        self.sim_ops: Any = None
        self.cuda_ops: Any = None
        if self.backend == "sim":
            from kvdevice.intercept.sim_ops import SimOps

            self.memory = self.share.sim_memory()
            self.sim_ops = SimOps(self)
        else:
            from kvdevice.intercept.cuda_ops import CudaOps

            self.cuda_ops = CudaOps(self)
        from kvdevice.intercept.custom_calls import CustomCalls
        from kvdevice.intercept.torch_mode import InterceptMode

        self.custom = CustomCalls(self)  # custom ops by their effect models (racecheck.custom_ops)
        self.mode = InterceptMode(self)
        self.graphs: Any = None  # CUDA graph captures, where the session supports them (kvdevice.intercept.sim_graphs)
        # An offloader's session maps the KV-cache bytes its ops touch to logical blocks (the keys the
        # caller's own accesses use); a zeroer's declares the blocks of its zero call instead.
        self.block_map: Any = None
        self.call: str = "construction"  # what the zeroer is doing now: its label in reports
        self.ids: tuple[int, ...] = ()  # the ids of the zero call in progress
        self._last: str = "the start of the call"
        self._calls = itertools.count(1)
        self._depth = 0

    # -- which zeroer ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The zeroer in labels: its spec, with its index once the runtime has several (``spec[1]``)."""
        return self.spec if self.share.count == 1 else f"{self.spec}[{self.index}]"

    @property
    def owner(self) -> str:
        """The zeroer in resource names: ``the zeroer``, or ``zeroer 1`` once the runtime has several."""
        return f"the {self.role}" if self.share.count == 1 else f"{self.role} {self.index}"

    @property
    def in_call(self) -> bool:
        """Whether one of the zeroer's calls is running (its code, not the harness's, is asking)."""
        return self._depth > 0

    # -- the scope ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, what: str, ids: Sequence[int] = ()) -> Iterator[None]:
        """Run the zeroer's ``what`` (e.g. ``"zero_block_ids"``) under interception."""
        if self._depth:  # a zeroer method calling another (warmup -> zero_block_ids): one scope
            yield
            return
        number = next(self._calls)
        shown = list(ids) if len(ids) <= 8 else [*ids[:8], "..."]
        self.call = f"{self.name}.{what}#{number}" + (f"({shown})" if what in LABELLED_WITH_IDS else "")
        self.ids = tuple(int(i) for i in ids)
        self._last = "the start of the call"
        self.host.check(f"the host, before {self.call}")
        self._depth += 1
        try:
            with contextlib.ExitStack() as scope:
                scope.enter_context(self.rt.annotate(self.call))
                # On CUDA this also makes the runtime's current stream torch's: what torch allocates
                # and launches inside lands there.
                scope.enter_context(self.rt.use_stream(self.rt.current_stream()))
                # Whatever stream the zeroer made current (torch.cuda.set_stream, a scope it left
                # open), the caller's is current again when the call ends.
                scope.callback(self.cuda_api.restore_streams)
                scope.enter_context(unroutable_guard(self))
                scope.enter_context(custom_ops.routing(self.route_custom))
                scope.enter_context(custom_ops.extension_modules())
                if self.helpers is not None:
                    scope.enter_context(self.helpers.calling())
                for module, table in self.patch_tables():
                    scope.enter_context(patched(module, table))
                from triton.runtime.jit import JITFunction

                scope.enter_context(patched(JITFunction, self.triton.patches()))
                scope.enter_context(patched(torch.Tensor, self.mode.patches()))
                for mode in self.modes():
                    scope.enter_context(mode)
                try:
                    yield
                except BaseException as error:
                    if self.driver.kept is not None and error is not self.driver.kept:
                        raise self.driver.kept from error  # what the code's error followed from
                    raise
                if self.helpers is not None:
                    self.helpers.settle()
                self.boundary("the end of the call")
        finally:
            self._depth -= 1
            self.call, self.ids = "the harness", ()
            self.driver.kept = None

    def route_custom(self, model: Any, args: tuple, kwargs: dict, real: Any) -> Any:
        """A modelled call no dispatch saw (a pybind function, a torch op on host tensors only)."""
        if self.backend == "sim":
            return self.custom.sim(model, args, kwargs)
        return self.custom.cuda(model, real, args, kwargs)  # real None: the model's reference, on the device

    def unmodelled_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A custom op with no effect model: the harness cannot say what it touches."""
        from kvdevice.intercept.custom_calls import unmodelled

        raise unmodelled(custom_ops.op_name(func))

    def patch_tables(self) -> list[tuple[Any, dict[str, Any]]]:
        """(module, attribute -> stand-in) patched while the code runs (:mod:`kvdevice.intercept.cuda_api`,
        :mod:`kvdevice.intercept.helper_threads`)."""
        return self.cuda_api.patch_tables() + (self.helpers.patches() if self.helpers is not None else [])

    def cannot_follow(self, error: BaseException) -> bool:
        """What the code did that the harness cannot follow (``error`` says it): whether it was
        reported and the code may go on (a program session's line); else the harness raises it."""
        return False

    def allocation_context(self) -> str:
        """What a device block's name says it was allocated in: the call of the code under test
        (a program session says nothing here: a race names the allocating line)."""
        return self.call

    def device_allocated(self, block: Any) -> None:
        """The code's op was handed device ``block`` (new, or freed and handed out again; a program
        session keeps the line)."""

    def event_recorded(self, event: Any) -> None:
        """The code recorded ``event`` (a runtime event; a program session keeps the line)."""

    def event_times_read(self, start: Any, end: Any) -> None:
        """The code is about to read ``start``'s and ``end``'s times (``elapsed_time``; a program
        session checks that the host has seen them complete)."""

    def query_event(self, event: Any) -> bool:
        """The code's ``Event.query()`` (a program session lets a polled event complete)."""
        return self.rt.query_event(event)

    def query_stream(self, stream: Any) -> bool:
        """The code's ``Stream.query()``."""
        return self.rt.query_stream(stream)

    def close_helpers(self) -> None:
        """End the threads the code started that still wait (its component is closed)."""
        if self.helpers is not None:
            self.helpers.close()

    def modes(self) -> list[Any]:
        """The torch modes the code runs under, outermost first: the caller's thread enters them for
        each call, and every thread the code starts enters the same ones (torch modes are per
        thread). On CUDA that includes the dispatch mode that routes each op on a CUDA tensor to the
        runtime: a copy thread's ops issued without it went straight to a gated stream, unseen, and
        a blocking one waited there for a gate nothing would open (the GPU check's hang)."""
        return [self.cuda_ops, self.mode] if self.cuda_ops is not None else [self.mode]

    def boundary(self, what: str) -> None:
        """The zeroer reached ``what``: check the pinned bytes pending reads will see."""
        self.driver.raise_kept()
        self.host.check(f"the host code of {self.call} between {self._last} and {what}")
        self._last = what

    # -- device work -------------------------------------------------------------------------------
    def _declare(self, reads: Sequence[Any], writes: Sequence[Any], cache_written: Any) -> dict[str, Any]:
        declared = {"reads": [Placed.whole(k) for k in reads], "writes": [Placed.whole(k) for k in writes]}
        cuda_ops = getattr(self, "cuda_ops", None)
        if cuda_ops is not None:  # values known in written memory are stale (a table kernel's)
            cuda_ops.forget_written([w.key[1] for w in declared["writes"]
                                     if isinstance(w.key, tuple) and w.key[:1] == ("cudamem",)])
        if isinstance(cache_written, CacheAccess):  # an offloader's op: the blocks its bytes meet
            declared["blocks_read"] = sorted(self.block_map.of_runs(cache_written.read))
            written = self.block_map.of_runs(cache_written.written)
            if cache_written.rows_unknown:  # indexed by device values: the blocks of the call
                written.update(self.ids)
            declared["blocks_written"] = sorted(written)
            return declared
        declared["blocks_written"] = self.ids if cache_written else ()
        return declared

    def enqueue(self, fn: Callable[[], None], *, name: str, reads: Sequence[Any] = (), writes: Sequence[Any] = (),
                cache_written: bool = False, uses: Sequence[Any] = ()) -> OpStamp:
        """One queued op on the current stream; ``reads``/``writes`` are memory keys or blocks. While
        the calling thread captures a CUDA graph it is recorded instead (:mod:`kvdevice.intercept.sim_graphs`).
        ``uses``: memory the op may touch and declares once it has run (a program session's labels
        keep its allocation generations, :class:`sanitizer.sim.session.ProgramSession`)."""
        if self.graphs is not None:
            capture = self.graphs.current()
            if capture is not None:
                return capture.record(fn, name, reads, writes, cache_written)  # type: ignore[return-value]
        return self.rt.launch(fn, name=name, **self._declare(reads, writes, cache_written))

    def stream_name(self, number: int) -> str:
        """The runtime name of the ``number``-th stream the code under test makes: ``zeroer-1``, or
        ``zeroer[1]-1`` for the runtime's second zeroer (a program session names them otherwise)."""
        tag = "" if self.index == 0 else f"[{self.index}]"
        return f"{self.role}{tag}-{number}"

    def run_now(self, fn: Callable[[], None], *, name: str, reads: Sequence[Any] = (), writes: Sequence[Any] = (),
                cache_written: bool = False) -> None:
        """A synchronising op: the current stream is run first, then ``fn`` (``Runtime.run_now``)."""
        if self.graphs is not None:
            self.graphs.refuse_sync(name)
        self.rt.run_now(fn, name=name, **self._declare(reads, writes, cache_written))

    # -- memory ------------------------------------------------------------------------------------
    def memory_key(self, tensor: torch.Tensor) -> Any | None:
        """What the happens-before checker calls ``tensor``'s device memory (None: host memory)."""
        if self.sim_ops is not None:
            from kvdevice.intercept.sim_tensor import SimCudaTensor

            return tensor._alloc.block if isinstance(tensor, SimCudaTensor) else None
        return self.cuda_ops.key(tensor) if tensor.is_cuda else None

    def address_ranges(self, host: Any = None) -> list[tuple[int, int, Any]]:
        """[start, end) of every byte the zeroer's kernels may touch on the simulator, sorted;
        ``host``: the pinned regions to take (:meth:`racecheck.pinned.PinnedMemory.frozen`), else those now."""
        ranges = list(self.memory.ranges()) if self.memory is not None else []
        for region in (host.regions() if host is not None else self.host.buffers()):
            ranges.append((region.start, region.end, region))
        return sorted(ranges, key=lambda r: r[0])

    def describe_address(self, address: int) -> str:
        nearest = None
        for start, end, owner in self.address_ranges():
            if start <= address < end:
                return f"inside {_name(owner)}"
            gap = address - end if address >= end else start - address
            if nearest is None or gap < nearest[0]:
                nearest = (gap, "past the end of" if address >= end else "before the start of", owner)
        if nearest is None:
            return "no memory near it"
        return f"{nearest[0]} bytes {nearest[1]} {_name(nearest[2])}"


LABELLED_WITH_IDS = ("zero_block_ids", "store", "load")


def _name(owner: Any) -> str:
    if isinstance(owner, Block):
        return f"device block d{owner.id} ({owner.name})"
    return getattr(owner, "name", repr(owner))
