"""The controlled cuda runtime: the GPU takes exactly the simulator's scheduling decisions.

``CudaRuntime(mode="controlled")`` (``scheduled = True``) keeps the simulator's model
(:class:`StreamQueues`, one model stream per stream, the same op kinds and labels; nothing runs
until ``advance`` or a host sync asks, like the simulator's lazy schedule). Every op is issued on
its real stream when it is enqueued, behind its own closed gate (:mod:`racecheck.gate`),
and followed by a "done" event. When the model executes an op, the host opens that op's gate and
waits for its done event. So an op has really run when the model says so, and nothing runs
before: a copy reads its pinned source at ``advance``, not at enqueue. Event queries answer from
the model, which matches the device because the model only moves while the host waits for it.
Host syncs run the model's least progress first (so a held stream raises
:class:`~zeroer.errors.DeadlockError` instead of hanging the GPU), then the real sync, which is
then immediate.

Rules while a controlled runtime has queued work (gates spin on the GPU):

* do not synchronise the device yourself (``torch.cuda.synchronize()``, ``.item()``, ``.cpu()``
  of gated data): use the runtime's ``synchronize*``, which open the gates they need first, or
  read on :func:`~racecheck.gate.spare_stream` after ``advance``;
* launch every kernel once before gating it (inside :meth:`ControlledCudaRuntime.ungated`, or
  before any op is queued): a kernel's first launch loads its module, which waits for the GPU to
  drain (NVIDIA/nvbench#136); ``CUDA_MODULE_LOADING=EAGER`` does that up front for torch's kernels;
* use at most ``CUDA_DEVICE_MAX_CONNECTIONS`` streams (a stream that shares a hardware queue with
  a gated one stalls behind its gate); the runtime asks for 32 queues before it first touches CUDA
  (:func:`~racecheck.gate.request_hardware_queues`), which only helps if nothing in the
  process initialised CUDA earlier.

Example (needs a GPU)::

    from kvdevice.runtime import make_runtime
    rt = make_runtime("cuda", mode="controlled")
    host, dev = rt.host_buffer(1), rt.device_buffer(1)
    rt.write_host(host, [1])
    rt.copy_h2d(dev, host)              # issued now, behind a closed gate
    rt.write_host(host, [2])            # the copy has not read host: a hazard is recorded
    rt.advance(rt.default_stream, 1)    # opens the gate: the copy reads [2]
    rt.synchronize()
    assert dev.tensor.tolist() == [2] and rt.hazards
    rt.close()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Callable

from racecheck.errors import RuntimeUsageError
from kvdevice.runtime.base import Stream
from racecheck import real_cuda
from kvdevice.runtime.cuda.common import CudaRuntimeBase
from racecheck.gate import hardware_queues, request_eager_module_loading, request_hardware_queues
from kvdevice.runtime.queues import ModelledStreams, QueuedOp, StreamQueues


class ControlledCudaRuntime(ModelledStreams, CudaRuntimeBase):
    """The cuda backend with every op gated and run when its model says. See the module docstring."""

    mode = "controlled"
    scheduled = True
    #: what :func:`~racecheck.gate.request_hardware_queues` did when this runtime was
    #: built ("too late": something in the process had initialised CUDA first)
    hardware_queue_request: str
    max_streams: int  # the hardware queues its streams share, so the most streams it may have

    def _before_cuda_starts(self) -> None:
        # The base creates the "main" stream through our hooks: the model exists first.
        self.queues = StreamQueues(execute=self._execute)
        self._ungated = False  # inside ungated(): ops run at once, with no gate
        # The driver reads CUDA_DEVICE_MAX_CONNECTIONS once, when it creates the context, and the
        # next call (resolving the device) may create it: ask now. What happened is kept for
        # diagnosis ("too late" means something else initialised CUDA first).
        self.hardware_queue_request = request_hardware_queues()
        request_eager_module_loading()
        self.max_streams = hardware_queues()

    # -- the gated model ---------------------------------------------------------------------
    def _submit(self, stream: Stream, kind: str, label: str, issue: Callable[[], None] | None = None,
                **fields: object) -> int:
        return self._enqueue(stream, QueuedOp(kind, label, origin=self.origin, **fields), issue)

    def _enqueue(self, stream: Stream, op: QueuedOp, issue: Callable[[], None] | None = None) -> int:
        """Issue ``op`` behind a fresh closed gate and queue it in the model. Inside :meth:`ungated`
        it has no gate, and the model executes it at once."""
        ungated = self._ungated
        if ungated and op.kind == "hold":
            raise RuntimeUsageError(
                f"{op.label}: a hold inside ungated() could never stop anything; place it outside"
            )
        with self._guarded(op.label), self._on(stream):
            gate = None if ungated else self.gates.acquire()
            if gate is not None:
                self.gates.launch(gate, stream.handle)
            try:
                if issue is not None:
                    issue()
            except BaseException as exc:
                if gate is not None:
                    # The op never reaches the model, so nothing would open its gate: open it now;
                    # whatever it issued runs in stream order.
                    self.gates.open(gate)
                    with contextlib.suppress(Exception):
                        marker = real_cuda.Event()
                        marker.record(stream.handle)
                        self.gates.retire(gate, marker)
                    exc.add_note(f"{op.label} was not queued; its gate was opened")
                raise
            done = real_cuda.Event()
            done.record(stream.handle)
        op.payload["gate"], op.payload["done"] = gate, done
        position = self.queues.enqueue(stream.index, op)
        if ungated:  # every stream was idle on entry and each op runs at once: nothing can block it
            self.queues.advance(stream.index, op.remaining)
        return position

    @contextlib.contextmanager
    def ungated(self) -> Iterator[None]:
        """Run every op enqueued inside at once and without a gate, as if advanced right away.

        For warm-ups: the first launch of a kernel loads its module, which waits for the GPU to
        drain and so never returns while a gate spins (NVIDIA/nvbench#136). Needs an idle
        runtime.

        Example::

            with rt.ungated():
                zeroer.warmup()        # compiles and loads the zero kernel
        """
        self._check_usable()
        busy = [f"'{s.name}' ({self.queues.pending(s.index)})" for s in self.streams if self.queues.pending(s.index)]
        if busy:
            raise RuntimeUsageError(
                f"ungated() needs an idle runtime, but ops are queued on stream(s) {', '.join(busy)}; "
                f"call synchronize() first"
            )
        self._ungated = True
        try:
            yield
        finally:
            self._ungated = False

    def _execute(self, op: QueuedOp) -> None:
        """The model runs ``op``: open its gate and wait until the GPU has run it."""
        gate, done = op.payload["gate"], op.payload["done"]
        if gate is not None:
            self.gates.open(gate)
        self._poll(done.query, op.label)
        if gate is not None:
            self.gates.recycle(gate)

    # -- streams -----------------------------------------------------------------------------
    def _new_stream_handle(self, stream: Stream) -> object:
        self._check_usable()
        if stream.index >= self.max_streams:
            raise RuntimeUsageError(
                f"stream {stream.name!r} would be stream {stream.index + 1} of a controlled runtime, "
                f"over the {self.max_streams} hardware queues (CUDA_DEVICE_MAX_CONNECTIONS) that "
                f"streams share: a stream sharing a queue with a gated one stalls behind its gate. "
                f"Use at most {self.max_streams} streams, or set CUDA_DEVICE_MAX_CONNECTIONS=32 "
                f"before CUDA initialises"
            )
        handle = super()._new_stream_handle(stream)
        self.queues.add_stream(stream.name)
        return handle

    # -- syncs (holds, delays, advance and queries are the model's: ModelledStreams) ---------
    def _before_sync(self, what: str, stream: int | None = None, position: int | None = None) -> None:
        # The model runs the least work the sync needs (a held stream raises DeadlockError), so
        # the real sync that follows is immediate.
        if stream is None:
            self.queues.drain_all()
        elif position is None:
            self.queues.drain(stream)
        else:
            self.queues.run_until(stream, position)
