"""What an offloader is, what its factory may declare, and the one place both are checked.

An offloader moves KV blocks between the device cache and a host pool on its own terms, the way
vLLM's CPU offload handlers (``transfer_async`` / ``get_finished``) and SGLang's HiCache controller
(``write`` / ``load`` with events polled later) do. Both fit one protocol of three calls, each
returning at once with the copy queued:

* ``store(job_id, block_ids, slot_ids)``: copy device block ``block_ids[i]`` into host slot
  ``slot_ids[i]``, ordered after the work the caller queued on its current stream;
* ``load(job_id, slot_ids, block_ids)``: copy host slot ``slot_ids[i]`` into device block
  ``block_ids[i]``, ordered after the blocks' earlier use (which the caller ordered before its
  current stream);
* ``get_finished()``: the jobs that completed since the last call, without blocking: job ids, or
  ``(job_id, success)`` pairs as vLLM's ``TransferResult`` is.

vLLM's handler shape is taken as it is too: an offloader with ``transfer_async(job_id, (src, dst))``
instead of ``store`` and ``load`` gets spec objects whose ``block_ids`` is a numpy array and whose
``medium()`` is ``"GPU"`` or ``"CPU"`` (a store is GPU -> CPU, a load CPU -> GPU), and
``get_finished()`` may list vLLM's ``TransferResult`` objects (``job_id``, ``success``).

Optional: ``wait(job_ids)`` (block until those jobs have finished, as vLLM's handlers do; without
it the caller waits for the whole device instead), ``evict(slot_ids)`` (the caller asks to free
host slots for their next tenant and the offloader answers: ``True``, freed, or ``False``, kept
because a job of its own still uses them, as SGLang's host eviction skips pages under a host lock;
without it the caller frees a slot itself once every job on it is reported), and, as for a zeroer,
``warmup()`` (called once before any job) and ``close()`` (wait for queued work and release; called
at the end of every episode). A factory builds one:
``factory(cache, host_pool, runtime)``, where ``cache`` is the device KV cache, ``host_pool`` the
host :class:`~zeroer.offload.host_pool.HostPool`'s cache (one slot per row, the device cache's
layout) and ``runtime`` what a runtime-API component would use (a plain torch offloader must not).

What the caller promises and what the offloader promises: docs/offload-contract.md.

Example::

    class MyOffloader:
        capabilities = OffloaderCapabilities(geometries=("tiny",))

        def __init__(self, cache, host_pool, runtime): ...
        def store(self, job_id, block_ids, slot_ids): ...
        def load(self, job_id, slot_ids, block_ids): ...
        def get_finished(self): ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from zeroer.errors import ZeroerError
from zeroer.offload.host_pool import HOST_MEMORY
from zeroer.protocol import (ALL_BACKENDS, ALL_CUDA_MODES, Declared, check_callable_factory, check_geometries, check_subset,
                             declaration, optional_hook)

REQUIRED = ("store", "load", "get_finished")


class OffloaderSpecError(ZeroerError, ValueError):
    """An offloader spec, factory or declaration that cannot be used; the message says how to fix it."""

    user_fixable = True


class OffloaderAnswerError(ZeroerError, TypeError):
    """An answer of the offloader's that the protocol does not allow (``get_finished()`` listing
    something that is not a job, ``evict`` answering other than True or False). Its code is wrong,
    but not racy: the run cannot go on, and the user fixes it (exit status 2), never ours to fix."""

    user_fixable = True


@dataclass(frozen=True)
class OffloaderCapabilities(Declared):
    """What an offloader's factory declares (every default is what an engine's class needs).

    * ``backends``, ``cuda_modes``: where it runs.
    * ``geometries``: the KV-cache presets it supports (None: every one).
    * ``host_memory``: the host pools it works with: ``"pinned"`` (allocated page-locked) and
      ``"registered"`` (registered with ``cudaHostRegister``); both by default.
    * ``transfer_specs``: for vLLM's handler shape, ``(gpu_spec, cpu_spec)``, each called with a
      side's block ids (a list of ints) to make the spec ``transfer_async`` receives. vLLM's
      handlers tell a store from a load by the spec's class (``isinstance(src, CPULoadStoreSpec)``),
      so such a handler declares its own classes, e.g. ``(GPULoadStoreSpec, CPULoadStoreSpec)``;
      without them it gets specs with ``block_ids`` and ``medium()`` only.

    An offloader is plain torch (and Triton) code, run under interception on every backend.
    """

    backends: tuple[str, ...] = ALL_BACKENDS
    cuda_modes: tuple[str, ...] = ALL_CUDA_MODES
    geometries: tuple[str, ...] | None = None
    host_memory: tuple[str, ...] = HOST_MEMORY
    transfer_specs: tuple[Callable[[list[int]], Any], Callable[[list[int]], Any]] | None = None

    def __post_init__(self) -> None:
        self._tuples(("backends", "cuda_modes", "geometries", "host_memory"), OffloaderSpecError)
        specs = self.transfer_specs
        if specs is not None and not (isinstance(specs, tuple) and len(specs) == 2 and all(map(callable, specs))):
            raise OffloaderSpecError(
                f"OffloaderCapabilities(transfer_specs={specs!r}): pass (gpu_spec, cpu_spec), two classes or "
                f"functions that make a transfer side from its block ids, e.g. (GPULoadStoreSpec, CPULoadStoreSpec)")
        for name, allowed in (("backends", ALL_BACKENDS), ("cuda_modes", ALL_CUDA_MODES), ("host_memory", HOST_MEMORY)):
            check_subset(name, getattr(self, name), allowed, "OffloaderCapabilities", OffloaderSpecError)
        check_geometries(self.geometries, "OffloaderCapabilities", OffloaderSpecError)


def check_offloader_factory(factory: object, spec: str) -> OffloaderCapabilities:
    """Check that ``factory`` can build offloaders and return what it declares (the defaults if nothing)."""
    check_callable_factory(factory, spec, ("cache", "host_pool", "runtime"), "offloader", OffloaderSpecError)
    return declaration(factory, spec, OffloaderCapabilities, "zeroer.offload", "offloader", OffloaderSpecError)


def finished_job_ids(reported: Any, spec: str) -> list[tuple[int, bool]]:
    """``get_finished()``'s answer as ``(job_id, success)`` pairs: it may list job ids, or pairs
    as vLLM's ``TransferResult``; anything else is the offloader's error (:class:`OffloaderAnswerError`)."""
    if reported is None:
        return []
    if not isinstance(reported, Iterable):
        raise OffloaderAnswerError(f"offloader {spec!r}: get_finished() returned {type(reported).__name__}, not an "
                                   f"iterable of job ids; fix it to return the finished job ids or (job_id, success) pairs")
    out = []
    for item in reported:
        if isinstance(item, tuple) and len(item) == 2:
            job, ok = item
        elif hasattr(item, "job_id"):  # vLLM's TransferResult dataclass
            job, ok = item.job_id, getattr(item, "success", True)
        else:
            job, ok = item, True
        if isinstance(job, bool) or not isinstance(job, int):
            try:
                job = int(job)  # a numpy or 0-d tensor id
            except (TypeError, ValueError):
                raise OffloaderAnswerError(f"offloader {spec!r}: get_finished() listed {item!r}, not a job id or "
                                           f"(job_id, success); fix it to list only those") from None
        out.append((int(job), bool(ok)))
    return out


class BlockIds:
    """A transfer side as vLLM's handlers read one: ``block_ids`` (a numpy int64 array) on ``medium()``."""

    def __init__(self, medium: str, ids: list[int]) -> None:
        import numpy as np

        self._medium = medium
        self.block_ids = np.asarray(ids, dtype=np.int64)

    def medium(self) -> str:
        return self._medium

    def __repr__(self) -> str:
        return f"{self._medium}{self.block_ids.tolist()}"


class BoundOffloader:
    """A built offloader with its optional hooks resolved once (``warmup`` and ``close`` fall back to
    nothing)."""

    def __init__(self, offloader: object, spec: str, capabilities: OffloaderCapabilities) -> None:
        transfer = getattr(offloader, "transfer_async", None)
        vllm_shape = callable(transfer) and not callable(getattr(offloader, "store", None))
        missing = [name for name in REQUIRED if not callable(getattr(offloader, name, None))
                   and not (vllm_shape and name in ("store", "load"))]
        if missing:
            raise OffloaderSpecError(
                f"offloader {spec!r}: its factory returned a {type(offloader).__name__}, which has no "
                f"{' or '.join(f'{m}()' for m in missing)}; an offloader has store(job_id, block_ids, slot_ids), "
                f"load(job_id, slot_ids, block_ids) (or vLLM's transfer_async(job_id, spec)) and get_finished()"
            )
        self.offloader = offloader
        self.spec = spec
        self.capabilities = capabilities
        self.vllm_shape = vllm_shape
        if vllm_shape:
            gpu, cpu = capabilities.transfer_specs or (lambda ids: BlockIds("GPU", ids), lambda ids: BlockIds("CPU", ids))

            def store(job_id: int, block_ids: list[int], slot_ids: list[int]) -> None:
                transfer(job_id, (gpu(list(block_ids)), cpu(list(slot_ids))))

            def load(job_id: int, slot_ids: list[int], block_ids: list[int]) -> None:
                transfer(job_id, (cpu(list(slot_ids)), gpu(list(block_ids))))

            self.store, self.load = store, load
        else:
            self.store = offloader.store  # type: ignore[attr-defined]
            self.load = offloader.load  # type: ignore[attr-defined]
        self._get_finished: Callable[[], Any] = offloader.get_finished  # type: ignore[attr-defined]
        self._warmup, self._close, self._wait, self._evict = (
            optional_hook(offloader, name, spec, "offloader", OffloaderSpecError)
            for name in ("warmup", "close", "wait", "evict"))

    def spelled(self, direction: str, job_id: int, block_ids: list[int], slot_ids: list[int]) -> str:
        """A store or load as the offloader's own code is called, for messages: ``store(3, [1], [0])``,
        or vLLM's ``transfer_async(3, (GPU[1], CPU[0]))``."""
        if self.vllm_shape:
            gpu, cpu = f"GPU{list(block_ids)}", f"CPU{list(slot_ids)}"
            src, dst = (gpu, cpu) if direction == "store" else (cpu, gpu)
            return f"transfer_async({job_id}, ({src}, {dst}))"
        if direction == "store":
            return f"store({job_id}, {list(block_ids)}, {list(slot_ids)})"
        return f"load({job_id}, {list(slot_ids)}, {list(block_ids)})"

    @property
    def waits(self) -> bool:
        """Whether it has ``wait(job_ids)``."""
        return self._wait is not None

    def wait(self, job_ids: set[int]) -> None:
        if self._wait is not None:
            self._wait(job_ids)

    @property
    def evicts(self) -> bool:
        """Whether it has ``evict(slot_ids)``: host slots are freed when it says so (their host
        lock is its own), not once the caller has heard of every job on them."""
        return self._evict is not None

    def evict(self, slot_ids: list[int]) -> bool:
        """Whether the offloader freed ``slot_ids`` for their next tenant; anything but a bool is the
        offloader's error (:class:`OffloaderAnswerError`), as a malformed ``get_finished()`` answer is."""
        freed = self._evict(list(slot_ids))
        if not isinstance(freed, bool):
            raise OffloaderAnswerError(f"offloader {self.spec!r}: evict({list(slot_ids)}) returned {freed!r}; fix it to "
                                       f"return True (the slots are freed) or False (a job of its own still uses them)")
        return freed

    def get_finished(self) -> list[tuple[int, bool]]:
        return finished_job_ids(self._get_finished(), self.spec)

    def warmup(self) -> None:
        if self._warmup is not None:
            self._warmup()

    def close(self) -> None:
        if self._close is not None:
            self._close()

