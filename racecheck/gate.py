"""Gates: one-warp kernels that hold a CUDA stream until the host opens them.

The model. A gate is an int32 flag in pinned host memory plus a Triton kernel that spins until
the flag is non-zero. Launched on a stream, it stops everything queued behind it on that stream,
copies included. The host opens it by writing 1 into the flag; no CUDA call is involved, because
pinned memory is mapped into the device's address space (UVA) and the kernel's volatile load
goes over the bus on every iteration. Measured on an H200 with triton 3.6: a non-blocking copy
queued behind a gate read its pinned source only after the release, which took about 20 us.

The controlled cuda runtime (:mod:`kvdevice.runtime.cuda.controlled`) puts one gate in front of
every op, so the device runs exactly what its scheduling model decides and nothing else; the
free-running one (:mod:`kvdevice.runtime.cuda.free`) gates only its holds.

What spinning kernels cost, and how this module keeps the GPU from hanging:

* While a gate spins, a host call that waits for the GPU to drain never returns: a device-wide
  synchronise, and the first launch of a kernel whose module is not loaded yet (CUDA lazy loading
  waits for the queues to drain under the context lock: NVIDIA/nvbench#136,
  meta-pytorch/torchcomms#2334). The :class:`Watchdog` opens every gate when the host is stuck
  in one call for too long and turns the hang into a :class:`GateTimeoutError`. It only writes
  host memory, because the stuck call holds the context lock and any CUDA call would queue
  behind it.
* Streams share ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues, and a stream that shares one with
  a gated stream stalls behind its gate; :func:`request_hardware_queues` asks for 32 queues if
  CUDA has not started yet (importing this module changes nothing). And ``torch.cuda.Stream()``
  deals out a pool of 32 streams round-robin, so it can return a gated one: :func:`spare_stream`
  skips the streams a live runtime owns.
* A flag must outlive the kernel that reads it: flags return to the pool only once their kernel
  has finished (``recycle`` after a synchronisation, or ``retire`` with an event), and a pool
  dropped with gates still queued leaks its flag memory on purpose (:func:`abandon`).

Example (needs a GPU)::

    import torch
    from racecheck.gate import GatePool
    pool = GatePool()
    side = torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    gate = pool.acquire()
    pool.launch(gate, side)
    with torch.cuda.stream(side):
        x.add_(1)                  # queued behind the gate: does not run yet
    pool.open(gate)                # now it does
    side.synchronize()
    pool.recycle(gate)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from racecheck.errors import DeadlockError, RuntimeUsageError
from racecheck import interrupts, real_cuda

try:  # triton is optional: the simulator and every CPU test must import this module without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

FLAGS_PER_CHUNK = 1 << 16  # 256 KiB of pinned int32 flags; another chunk is added when all are in use
REQUESTED_HARDWARE_QUEUES = 32  # CUDA_DEVICE_MAX_CONNECTIONS to ask for: the most the driver allows
REAP_BATCH = 1024  # retired gates are checked for reuse this many at a time
WATCHDOG_POLL_S = 0.05  # how often the watchdog thread looks at the armed deadline


class GateTimeoutError(DeadlockError):
    """The GPU did not get past a gate in time, or the host was stuck while gates were closed.

    Every gate has been opened so that the GPU cannot hang; the runtime that raised this no longer
    follows its schedule.
    """


if triton is not None:

    # ``flag_addr`` is not specialised: flag addresses differ in alignment, and a recompile (a
    # module load) while other gates spin would itself wait for the GPU to drain.
    @triton.jit(do_not_specialize=["flag_addr"])
    def _gate_kernel(
        flag_addr,  # int64 address of one pinned int32 flag (host pointer == device pointer under UVA)
    ):
        ptr = flag_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        flag = tl.load(ptr, volatile=True)  # volatile: re-read over the bus, never cached
        while flag == 0:
            flag = tl.load(ptr, volatile=True)

else:  # pragma: no cover - depends on the environment
    _gate_kernel = None


def is_gate_kernel(jit: object) -> bool:
    """Whether ``jit`` is the gate kernel, the only Triton kernel the runtime launches itself."""
    return _gate_kernel is not None and jit is _gate_kernel


def gate_available() -> bool:
    """True when gates can run here: triton imports and a CUDA GPU is present."""
    return triton is not None and real_cuda.is_available()


@dataclass(frozen=True)
class Gate:
    """One flag of a :class:`GatePool`: ``chunk`` and ``slot`` locate it, ``address`` is its pointer."""

    chunk: int
    slot: int
    address: int

    def __repr__(self) -> str:
        return f"Gate({self.chunk}:{self.slot})"


class GatePool:
    """Pinned int32 flags handed out as gates, recycled once their kernel has finished.

    ``pin_memory=False`` builds a pool whose flags no GPU can read: the bookkeeping can then be
    tested on CPU (and the kernel under ``TRITON_INTERPRET=1``).
    """

    def __init__(self, flags_per_chunk: int = FLAGS_PER_CHUNK, *, pin_memory: bool = True) -> None:
        if not isinstance(flags_per_chunk, int) or flags_per_chunk < 1:
            raise RuntimeUsageError(f"flags_per_chunk {flags_per_chunk!r} must be a positive int")
        self.flags_per_chunk = flags_per_chunk
        self.pin_memory = pin_memory
        self._chunks: list[torch.Tensor] = []
        self._views = []  # numpy views of the chunks: a host write costs ~100 ns, not a torch op
        self._free: list[Gate] = []  # recycled gates, newest last (reused first: a small working set)
        self._retiring: list[tuple[Gate, object]] = []  # (gate, event recorded behind its kernel)
        self._fresh = 0  # slots of the newest chunk handed out so far
        self.in_use = 0  # gates acquired and not yet recycled
        self._grow()
        _LIVE_POOLS.add(self)

    # -- flags -------------------------------------------------------------------------------
    def _grow(self) -> None:
        chunk = torch.zeros(self.flags_per_chunk, dtype=torch.int32, pin_memory=self.pin_memory)
        self._chunks.append(chunk)
        self._views.append(chunk.numpy())
        self._fresh = 0

    def _carve(self) -> Gate:
        # Gates are made one at a time: building all 65,536 up front cost 150 ms per runtime,
        # most of a fuzz example's time on an H200 (docs/runtime.md, "Why gates are made on demand").
        if self._fresh == self.flags_per_chunk:
            # Allocating pinned memory while gates spin may wait for the GPU; callers run this
            # under the watchdog.
            self._grow()
        index, slot = len(self._chunks) - 1, self._fresh
        self._fresh += 1
        return Gate(index, slot, self._chunks[index].data_ptr() + 4 * slot)

    def _reap(self) -> None:
        still: list[tuple[Gate, object]] = []
        for gate, event in self._retiring:
            if event.query():
                self.recycle(gate)
            else:
                still.append((gate, event))
        self._retiring = still

    def acquire(self) -> Gate:
        """A closed gate (its flag reset to 0), ready to :meth:`launch`."""
        if not self._free and (len(self._retiring) >= REAP_BATCH or self._fresh == self.flags_per_chunk):
            self._reap()  # one pass over many events, not a query per acquire
        gate = self._free.pop() if self._free else self._carve()
        self._views[gate.chunk][gate.slot] = 0
        self.in_use += 1
        return gate

    def value(self, gate: Gate) -> int:
        return int(self._views[gate.chunk][gate.slot])

    def open(self, gate: Gate) -> None:
        """Let the kernel of ``gate`` finish: the host writes 1 into its flag."""
        self._views[gate.chunk][gate.slot] = 1

    def open_all(self) -> None:
        """Open every gate, closed or not. Safe from any thread: host memory writes only."""
        for view in self._views:
            view[:] = 1

    def recycle(self, gate: Gate) -> None:
        """Return ``gate`` for reuse; its kernel must have finished (the caller synchronised)."""
        self._free.append(gate)
        self.in_use -= 1

    def retire(self, gate: Gate, event: object) -> None:
        """Return ``gate`` for reuse once ``event`` (recorded behind its kernel) has completed."""
        self._retiring.append((gate, event))

    # -- kernel ------------------------------------------------------------------------------
    def launch(self, gate: Gate, stream: real_cuda.Stream) -> None:
        """Enqueue the gate kernel for ``gate`` on ``stream``: work behind it waits for :meth:`open`."""
        if _gate_kernel is None:
            raise RuntimeUsageError(
                "gates need triton, which does not import here; install triton or use backend 'sim'"
            )
        if not self.pin_memory:
            raise RuntimeUsageError(
                "this GatePool was built with pin_memory=False, so no GPU can read its flags; "
                "use GatePool() for gates on a GPU"
            )
        with real_cuda.stream(stream):
            _gate_kernel[(1,)](gate.address, num_warps=1)

    def chunks(self) -> list[torch.Tensor]:
        """The flag memory, for :func:`abandon`."""
        return list(self._chunks)

    def release(self) -> None:
        """Drop the flag memory; only once no gate kernel of this pool can still run."""
        self._chunks, self._views, self._free, self._retiring = [], [], [], []
        self._fresh = self.flags_per_chunk  # a later acquire() starts a new chunk


# -- what the driver reads when the context starts -----------------------------------------------
def _request_env(name: str, value: str) -> Literal["set", "already set", "too late"]:
    """Set ``name`` for the CUDA driver unless someone chose it or the context already exists."""
    if name in os.environ:
        return "already set"
    if real_cuda.is_initialized():
        return "too late"
    os.environ[name] = value
    return "set"


def request_eager_module_loading() -> Literal["set", "already set", "too late"]:
    """Ask CUDA to load every kernel module when the context starts (``CUDA_MODULE_LOADING=EAGER``),
    with :func:`request_hardware_queues`'s rule and answers (left alone where chosen or too late).

    A module loaded lazily, at a kernel's first launch, waits for the GPU to drain
    (NVIDIA/nvbench#136), which a closed gate keeps from happening: the first strided
    ``copy_`` of an offloader (torch's elementwise copy kernel) then hangs until the watchdog opens
    every gate. Torch's kernels loaded up front cannot do that; a Triton kernel still loads at
    its compile, before the launch is gated.
    """
    return _request_env("CUDA_MODULE_LOADING", "EAGER")


# -- streams a gate can stall ----------------------------------------------------------------
# Streams are spread over CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default); a stream that
# shares a queue with a gated one stalls behind its spinning gate (a false dependency). Ask for the
# maximum while the CUDA context does not exist yet: the driver reads it when creating it.
def request_hardware_queues() -> Literal["set", "already set", "too late"]:
    """Ask for 32 hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``) while it can still matter.

    Returns what it did:

    * ``"set"``: the variable was unset and CUDA not initialised in this process; it is now 32;
    * ``"already set"``: someone (the user, an earlier call) chose a value; it is left alone;
    * ``"too late"``: CUDA is initialised, so the driver has read the variable (or will ignore it):
      nothing is changed and streams share the default 8 queues.

    Call it before anything in the process touches CUDA: ``torch.cuda.is_available()`` creates no
    context, but most other calls (``current_device()``, a stream, an allocation) may. The
    controlled runtime calls it before its first CUDA call, and ``pytest fuzz`` calls it in
    ``pytest_configure`` so that every xdist worker asks before its context exists.

    Example::

        from racecheck.gate import request_hardware_queues
        request_hardware_queues()      # "set" in a fresh process without the variable
    """
    return _request_env("CUDA_DEVICE_MAX_CONNECTIONS", str(REQUESTED_HARDWARE_QUEUES))



def request_gate_settings() -> None:
    """Both requests a process that may run gated streams makes before its CUDA context exists:
    :func:`request_hardware_queues` and :func:`request_eager_module_loading` (where there is no
    CUDA, two variables nothing reads)."""
    request_hardware_queues()
    request_eager_module_loading()

# (device index, cuda_stream) of every stream a live CudaRuntime owns. torch.cuda.Stream() hands
# out a pool of 32 streams round-robin, so a later Stream() can be one of ours, gate and all.
_STREAMS_IN_USE: set[tuple[int, int]] = set()


def hardware_queues() -> int:
    """How many hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``) streams are spread over."""
    try:
        return max(1, int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")))
    except ValueError:
        return 8


def spare_stream(device: int | str | torch.device | None = None) -> real_cuda.Stream:
    """A pool stream that no live ``CudaRuntime`` owns: safe to read gated results on.

    Example: after ``rt.advance(s, 1)``, ``with torch.cuda.stream(spare_stream()): dev.tensor.cpu()``
    sees that op's result without waiting for the ops still held behind gates.
    """
    for _ in range(128):  # four laps of torch's pool of 32 streams per priority
        stream = real_cuda.Stream(device)
        if (stream.device.index, stream.cuda_stream) not in _STREAMS_IN_USE:
            return stream
    raise RuntimeUsageError(
        f"every pool stream of device {device!r} belongs to a live CudaRuntime; close() some runtimes"
    )


def claim_stream(device: torch.device) -> tuple[real_cuda.Stream, tuple[int, int]]:
    """A spare pool stream, now owned by the caller until :func:`release_streams` (with the key)."""
    stream = spare_stream(device)
    key = (stream.device.index, stream.cuda_stream)
    _STREAMS_IN_USE.add(key)
    return stream, key


def release_streams(keys: list[tuple[int, int]]) -> None:
    _STREAMS_IN_USE.difference_update(keys)


# Flag memory of pools dropped while gates may still be queued. The gate kernels may read it
# after its owner is gone, and PyTorch's host allocator would hand freed pinned memory (with no
# copy event on it) to the next allocation at once, which could write 0 over an opened flag.
_ABANDONED_FLAGS: list[torch.Tensor] = []


# Every pool not yet collected: a process ended by force opens all their gates on its way out
# (racecheck.interrupts), so no kernel of it spins on after its host has gone.
_LIVE_POOLS: "weakref.WeakSet[GatePool]" = weakref.WeakSet()


def open_every_gate() -> None:
    """Open every gate of every live pool of this process (host memory writes only, any thread)."""
    for pool in list(_LIVE_POOLS):
        pool.open_all()


interrupts.on_force(open_every_gate)


def abandon(pool: GatePool) -> None:
    """Open every gate of ``pool`` and keep its flag memory alive for the rest of the process."""
    pool.open_all()
    _ABANDONED_FLAGS.extend(pool.chunks())


class _Monitor:
    """The one daemon thread that checks every armed :class:`Watchdog` of the process.

    A thread per runtime cost about 20 ms to join on every close (an H200 fuzz run makes a
    runtime per example); one shared thread costs nothing to stop watching.
    """

    def __init__(self) -> None:
        # Re-entrant: a runtime's finalizer (which stops its watchdog) can run from a garbage
        # collection inside this very thread.
        self._lock = threading.RLock()
        self._dogs: set[Watchdog] = set()
        self._thread: threading.Thread | None = None

    def watch(self, dog: "Watchdog") -> None:
        with self._lock:
            self._dogs.add(dog)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zeroer-gate-watchdog", daemon=True)
                self._thread._kvz_own = True  # type: ignore[attr-defined]  # a sanitizer watching does not follow it
                self._thread.start()

    def forget(self, dog: "Watchdog") -> None:
        # Under the lock: once this returns, no check of ``dog`` is running or will run.
        with self._lock:
            self._dogs.discard(dog)

    def _run(self) -> None:
        while True:
            time.sleep(WATCHDOG_POLL_S)
            with self._lock:
                for dog in list(self._dogs):
                    dog._check()


_MONITOR = _Monitor()


class Watchdog:
    """Opens every gate of a pool when the host stays in one guarded call past ``timeout_s``.

    The host calls that can wait for a drained GPU (launches, allocations) run inside
    :meth:`guard`. A daemon thread watches the armed deadline; on expiry it opens every gate,
    which lets the stuck call return, and :meth:`guard` then raises :class:`GateTimeoutError`.

    Example::

        dog = Watchdog(pool, timeout_s=5.0)
        with dog.guard("launch of zero_kernel#3"):
            launch()
        dog.stop()
    """

    def __init__(self, pool: GatePool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.fired: str | None = None  # what was running when the watchdog opened the gates
        self._deadline: float | None = None
        self._what = ""
        self._depth = 0
        self._watched = False

    def _check(self) -> None:
        """Called by the monitor thread: fire if the armed deadline has passed."""
        deadline = self._deadline
        if deadline is not None and time.monotonic() > deadline and self.fired is None:
            self.fired = self._what
            self.pool.open_all()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Watch the call inside; nested guards (a launch fn that enqueues) share the outer deadline."""
        if not self._watched:
            _MONITOR.watch(self)
            self._watched = True
        self._depth += 1
        if self._depth == 1:
            self._what = what
            self._deadline = time.monotonic() + self.timeout_s
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._deadline = None
        if self.fired is not None:
            raise GateTimeoutError(stuck_message(self.fired, self.timeout_s))

    def stop(self) -> None:
        """Stop watching; the pool may be released once this returns."""
        _MONITOR.forget(self)
        self._watched = False


def stuck_message(what: str, timeout_s: float) -> str:
    """Why the host was stuck in ``what`` while gates were closed, and what to do about it."""
    return (
        f"the host was stuck for over {timeout_s:g} s in {what} while gates were closed, so every "
        f"gate was opened to keep the GPU from hanging and this runtime no longer follows its "
        f"schedule. Usual causes: the first launch of a kernel (lazy module loading waits for the "
        f"GPU to drain, NVIDIA/nvbench#136): run it once before gating it, or set "
        f"CUDA_MODULE_LOADING=EAGER; a launch fn that synchronises (.item(), .cpu(), "
        f"torch.cuda.synchronize()); or a pinned/device allocation that waited for the GPU. "
        f"close() this runtime and make a new one"
    )
