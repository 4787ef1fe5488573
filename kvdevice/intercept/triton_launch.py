"""Triton launches of an intercepted zeroer: one queued runtime op each, on every backend.

A zeroer launches its kernel as ``kernel[grid](*args)``, which is ``JITFunction.run``. While the
zeroer runs, that one method is wrapped (and put back on exit, even on error):

* on the **simulator** the launch becomes a queued op that runs the kernel's own Python source
  under Triton's interpreter when the simulated stream reaches it, with the arguments it was
  launched with: device tensors are their simulated memory, so raw addresses the kernel loads
  from a table (vLLM's ``seg_addrs``) land in the simulated KV cache. While the interpreter runs,
  every load and store is checked against the memory that exists (simulated device blocks, the
  KV cache, the zeroer's pinned buffers): an access anywhere else, which would be an illegal
  address on a GPU and a wild write into this process here, is skipped and reported;
* on **CUDA** the launch itself is the queued op: issued behind the op's gate in the controlled
  mode, at once in the free-running mode, on the runtime's current stream (Triton launches on
  torch's current stream, which the runtime sets).

A pinned host tensor passed to a kernel is read by the GPU when the kernel runs (zero-copy), like
a non-blocking copy (written, when the kernel stores through it, like a device-to-host copy): it is
checked the same way (:mod:`kvdevice.intercept.host_memory`). A pageable
CPU tensor cannot be read by a GPU kernel at all, and is refused as CUDA would.

Under the interpreter, a kernel's ``@triton.jit`` callees (Triton's own ``tl.zeros`` among them)
are interpreted too (:mod:`kvdevice.triton_cpu`).

Example::

    @triton.jit
    def zero_kernel(table_ptr, ids_ptr, n, BLOCK: tl.constexpr): ...

    zero_kernel[(n,)](seg_addrs, ids, n, BLOCK=1024)    # inside an intercepted call: one queued op
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import numpy as np
import torch
from triton.runtime import interpreter as triton_interpreter
from triton.runtime.jit import JITFunction

from kvdevice.intercept.errors import SimulatorGap, forward, unroutable
from kvdevice.intercept.driver_copies import host_view
from kvdevice.intercept.kernel_accesses import Touched, declare, through_tables_on_cuda
from kvdevice.intercept.sim_graphs import CapturedOp
from kvdevice.intercept.sim_tensor import SimCudaTensor
from racecheck.gate import is_gate_kernel
from racecheck.hb import Hazard
from racecheck.triton_stores import kernel_flow
from kvdevice.triton_cpu import interpreted, kernel_error, nested_calls_interpreted, raised_by_interpreter


class _AddressCheck:
    """Every load and store of an interpreted kernel, checked against the memory that exists."""

    def __init__(self, session: Any, kernel: str, touched: Touched | None = None) -> None:
        self.session = session
        self.kernel = kernel
        self.touched = touched  # where every load and store lands, when the launch declares them so

    def _bad(self, ptrs: Any, mask: Any, *, write: bool) -> tuple[int, int] | None:
        addresses = np.asarray(ptrs.data, dtype=np.uint64).reshape(-1)
        on = np.asarray(mask.data, dtype=bool).reshape(-1) if mask is not None else np.ones(addresses.shape, bool)
        if not on.any():
            return None
        width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        starts, ends = self._starts, self._ends
        wanted = addresses[on]
        slot = np.searchsorted(starts, wanted, side="right").astype(np.int64) - 1
        inside = (slot >= 0) & (wanted + np.uint64(width) <= ends[np.maximum(slot, 0)]) & (wanted >= starts[np.maximum(slot, 0)])
        if self.touched is not None:  # an illegal access is skipped: it touches nothing
            self.touched.add(wanted[inside], width, write=write)
        if inside.all():
            return None
        first = int(np.flatnonzero(~inside)[0])
        return int(wanted[first]), int((~inside).sum())

    def report(self, verb: str, found: tuple[int, int]) -> None:
        address, count = found
        where = self.session.describe_address(address)
        message = (f"illegal address: kernel {self.kernel} {verb} {count} word(s) outside every allocation, "
                   f"the first at {address:#x} ({where}); on a GPU this is cudaErrorIllegalAddress, here the "
                   f"access was skipped")
        self.session.rt.hazards.append(Hazard("illegal-address", where, self.kernel, self.kernel, message))

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        # The memory that exists cannot change while one kernel runs: its bounds are read once.
        ranges = self.session.address_ranges()
        self._starts = np.fromiter((r[0] for r in ranges), dtype=np.uint64, count=len(ranges))
        self._ends = np.fromiter((r[1] for r in ranges), dtype=np.uint64, count=len(ranges))
        builder = triton_interpreter.interpreter_builder
        store, load = builder.create_masked_store, builder.create_masked_load
        check = self

        def masked_store(ptrs: Any, value: Any, mask: Any, *rest: Any) -> Any:
            bad = check._bad(ptrs, mask, write=True)
            if bad is not None:
                check.report("stores", bad)
                return None
            return store(ptrs, value, mask, *rest)

        def masked_load(ptrs: Any, mask: Any, other: Any, *rest: Any) -> Any:
            bad = check._bad(ptrs, mask, write=False)
            if bad is not None:
                check.report("loads", bad)
                mask = triton_interpreter.TensorHandle(np.zeros_like(np.asarray(mask.data), dtype=bool), mask.dtype)
            return load(ptrs, mask, other, *rest)

        builder.create_masked_store, builder.create_masked_load = masked_store, masked_load
        try:
            with nested_calls_interpreted():
                yield
        finally:
            builder.create_masked_store, builder.create_masked_load = store, load


class TritonLaunches:
    """The launch side of one session: what ``JITFunction.run`` does while the zeroer runs."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.original = JITFunction.run

    def patches(self) -> dict[str, Any]:
        launches = self

        def run(jit: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            return launches.launch(jit, args, kwargs, grid, warmup)

        return {"run": run}

    def launch(self, jit: JITFunction, args: tuple, kwargs: dict, grid: Any, warmup: bool) -> Any:
        session = self.session
        # The runtime's own gate kernel, launched whenever the controlled CUDA runtime queues an op
        # for the zeroer (a copy, a kernel, an event record or wait): never the zeroer's. Taken for
        # the zeroer's, it would be queued behind a new gate, itself a launch, and so on.
        if is_gate_kernel(jit):
            return self.original(jit, *args, grid=grid, warmup=warmup, **kwargs)
        name = f"triton {getattr(jit.fn, '__name__', 'kernel')}"
        session.boundary(name)
        signature = inspect.signature(jit.fn)
        kernel_kwargs = {k: v for k, v in kwargs.items() if k in signature.parameters}
        try:
            bound = forward(signature.bind, *args, **kernel_kwargs)  # a launch that does not fit is the zeroer's
        except TypeError as error:
            error.add_note(f"launching {name}")
            raise
        bound.apply_defaults()
        flow = kernel_flow(jit.fn)
        written = flow.stored
        reads, writes, pinned = [], [], []
        for param, value in bound.arguments.items():
            if isinstance(value, torch.Tensor):
                key = session.memory_key(value)
                if key is None:  # host memory
                    buffer = session.host.lookup(value)
                    if buffer is None:
                        raise unroutable(f"{name}: argument {param!r}",
                                         "it is a pageable CPU tensor, which a GPU kernel cannot read",
                                         "pass a device tensor, or pinned memory (pin_memory=True)")
                    pinned.append((buffer, value, param in written))
                else:
                    (writes if param in written else reads).append(key)
        if session.backend == "sim":
            if warmup:
                return None  # nothing to compile: the interpreter runs the source
            # A pinned argument by its address: the queued kernel does not keep the tensor alive (LMCache #4830).
            values = [value._inner if isinstance(value, SimCudaTensor)
                      else session.host.by_address(value) if isinstance(value, torch.Tensor) else value
                      for value in bound.arguments.values()]
            launch_grid = grid(dict(bound.arguments)) if callable(grid) else grid
            launch_grid = tuple(launch_grid) if isinstance(launch_grid, (tuple, list)) else (launch_grid,)
            touched = Touched()
            check = _AddressCheck(session, name, touched)
            kernel = interpreted(jit.fn)
            space = session.rt._block_space  # which cache "block N" means, as the launch is queued
            uses: list[Any] = []  # memory its arguments hold, its accesses there declared once it has run
            if session.kernel_arguments_by_bytes:
                # A kernel handed the whole KV cache touches the blocks its ids name (vLLM's Triton
                # reshape_and_cache, a gather of the blocks to offload): the bytes it loaded and
                # stored are its accesses, declared once it has run, never the whole allocation.
                uses, reads, writes = reads + writes, [], []
            # What the launch declares from its arguments; the rest of what it touched is declared
            # once it has run, from its actual loads and stores (kvdevice.intercept.kernel_accesses).
            declared = {getattr(k, "key", k) for k in reads + writes} | {region.key for region, _, _ in pinned}
            at: list[Any] = []  # the stamp it runs as (a replay of a captured graph: that replay's)
            session.rt.hb.expect_late_host_accesses()  # what it touched is declared once it has run
            regions = session.host.regions.frozen()  # the pinned bytes it reads are these, as queued

            def run() -> None:
                touched.clear()
                with check.installed():
                    try:
                        kernel[launch_grid](*values)
                    except Exception as error:
                        # Triton's interpreter, not the GPU, ran the kernel: what the interpreter
                        # itself fails at (an op or an operand it does not take) is the simulator's,
                        # never a finding. What the kernel's own code raises (an IndexError in its
                        # Python, say) is the zeroer's, as kvdevice.origin reads it from the traceback.
                        cause = kernel_error(error)  # under the interpreter's InterpreterError
                        if raised_by_interpreter(cause):
                            raise interpreter_gap(name, cause) from error
                        raise cause from None
                if at and not isinstance(at[0], CapturedOp):
                    declare(session, at[0], touched, space, skip=declared, host=regions)

            # A zeroer's session has no block map: its kernel writes the blocks of its zero call.
            stamp = session.enqueue(run, name=name, reads=reads, writes=writes,
                                    cache_written=session.block_map is None, uses=uses)
            at.append(stamp)
            if isinstance(stamp, CapturedOp):  # each replay declares what it touched then
                stamp.declare_rows = lambda replayed: at.__setitem__(0, replayed)
            result = None
        else:
            if warmup:
                return self.original(jit, *args, grid=grid, warmup=True, **kwargs)
            tables = sorted(n for n in flow.tables if isinstance(bound.arguments.get(n), torch.Tensor))
            cache_written: Any = True  # a zeroer's session: its kernel writes the blocks of its zero call
            through: list[tuple[Any, bool]] = []
            if tables and session.block_map is not None:
                # What a kernel touches through a device table (vLLM's _swap_blocks_kernel) follows from
                # the values the host staged into the table: traced before the launch, declared as
                # the copy those bytes make would be (kvdevice.intercept.kernel_accesses).
                through = through_tables_on_cuda(session, name, jit.fn, dict(bound.arguments), grid, tables)
                more_reads, more_writes, cache_written = session.driver.accesses(
                    [p for p, write in through if not write], [p for p, write in through if write])
                reads, writes = reads + more_reads, writes + more_writes
            box: list[Any] = []

            def issue() -> None:
                box.append(forward(self.original, jit, *args, grid=grid, warmup=False, **kwargs))

            stamp = session.enqueue(issue, name=name, reads=reads, writes=writes, cache_written=cache_written)
            result = box[0] if box else None
            for place, stored in through:  # pinned host memory the kernel reaches through a table
                if place.kind == "pinned":
                    pinned.append((place.memory, host_view(place), stored))
        for buffer, view, stored in pinned:
            if stored:  # the kernel writes this pinned memory, as a device-to-host copy would
                session.host.note_device_write(buffer, view, stamp)
            else:
                session.host.note_read(buffer, view, stamp)
        return result


def interpreter_gap(kernel: str, error: BaseException) -> SimulatorGap:
    return SimulatorGap(
        f"Triton's interpreter could not run {kernel} on the simulator ({type(error).__name__}: {error}); the "
        f"simulator runs kernels under it, a GPU compiles them: run this code on a GPU (--backend cuda), and "
        f"report the kernel to kvzero-fuzz if it runs there"
    )
