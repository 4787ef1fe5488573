"""The values of small integer tensors in device memory, known on the host as the program makes
them: the tables and indices a device op goes through.

vLLM's CPU offloading handler builds tables of raw addresses in numpy (``data_ptr()`` plus a block
id times a row stride), moves them with ``torch.from_numpy(table).to("cuda", non_blocking=True)``
(pageable memory) and launches a Triton kernel that loads its pointers from them; LMCache hands
``torch.from_numpy(ptrs).to(device)`` to its C++ op; zeroers build block ids with
``torch.tensor(ids, device=...)`` or on the device (``ids * ratio + torch.arange(ratio)``, a
slice). What such an op touches is in those values. On the simulator device memory is host
memory and the tools read it; on a GPU they must not (a read would wait for the device and
reorder the program). So each tool keeps a shadow of the bytes, as the program makes and changes
them, and never reads the device:

* a copy or ``.to()`` from the host (pinned or pageable) writes the host's values at the call;
* an op whose inputs are all known (a copy between device tensors, arithmetic, ``index``/``cat``,
  ``arange``/``full``, a slice is a view of known bytes) is evaluated on the host on copies of the
  shadows, and its outputs' bytes become known: the same aten op on the same values;
* any other write to those bytes (an op with an unknown input, a random op, a Triton kernel's
  store, an extension's op, a fresh allocation) makes them unknown; a later write to part of a
  tensor replaces those bytes only.

A value that is not known is ``None`` to the caller, who says so in one line and calls the run
partial: never a guess. Only allocations of at most :data:`MAX_STORAGE` bytes are shadowed, at
most :data:`MAX_TOTAL` bytes in all (the oldest shadow is dropped beyond: its values become
unknown, never wrong), and an op on a floating-point device tensor costs one dtype check. The
sanitizer's GPU observer and the fuzzer's CUDA backend each keep one :class:`DeviceValues`.

Example::

    values = DeviceValues(is_device=lambda t: t.is_cuda)
    pending = values.prepare(func, args, kwargs)   # before the op is declared and run
    result = func(*args, **kwargs)
    values.commit(pending, result)                 # its outputs' values, where known
    values.values(table)                           # -> numpy array, or None where unknown
    values.written(address, [(lo, hi)])            # a write the tool cannot evaluate: forgotten
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from racecheck.dtypes import NUMPY_INTEGERS
from racecheck.ops import leaves, map_leaves
from racecheck.ranges import byte_runs

MAX_STORAGE = 1 << 20  # bytes of one allocation whose values are shadowed (a table, an index: not a KV cache)
MAX_TOTAL = 64 << 20  # bytes shadowed in all

aten = torch.ops.aten
INTEGERS = frozenset(NUMPY_INTEGERS) | {torch.bool}
# Ops that write their first argument without reading it: its old values need not be known.
_OVERWRITES = {getattr(getattr(aten, op), overload) for op, overload in
               (("copy_", "default"), ("fill_", "Scalar"), ("fill_", "Tensor"), ("zero_", "default"))
               if hasattr(getattr(aten, op, None), overload)}
# Ops with no device input that make integer tensors from scalars, evaluated when small.
_FACTORIES = {packet for name in ("arange", "full", "zeros", "ones", "scalar_tensor")
              for packet in [getattr(aten, name, None)] if packet is not None}
# Of those, the ones whose result without a dtype is the default dtype (arange and full take theirs from
# their arguments: integers for integer arguments).
_DEFAULT_DTYPE = {packet for name in ("zeros", "ones", "scalar_tensor")
                  for packet in [getattr(aten, name, None)] if packet is not None}
_TO_COPY = aten._to_copy.default
_COPY = aten.copy_.default
# Results that differ between the host and the GPU: never evaluated, their outputs unknown.
_NONDETERMINISTIC = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)


class _Shadow:
    """One allocation's bytes as the host knows them, and which of them it knows. The mask is a numpy
    array: a device write marks its bytes unknown on every op that writes a shadowed table, and a
    numpy slice costs a fraction of a torch op's dispatch (which every mode below would see)."""

    __slots__ = ("data", "known")

    def __init__(self, nbytes: int) -> None:
        self.data = torch.zeros(nbytes, dtype=torch.uint8)
        self.known = np.zeros(nbytes, dtype=np.bool_)


@dataclass
class Pending:
    """An op evaluated on the host before it runs: what its outputs will hold."""
    func: Any
    outputs: list[Any]  # the host results, flattened
    written: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (device arg, its host result)


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _view_over(data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s view (shape, strides, offset, dtype) over the bytes ``data`` of its storage."""
    size = like.element_size()
    flat = data[: data.numel() - data.numel() % size].view(like.dtype)
    return flat.as_strided(tuple(like.shape), tuple(like.stride()), like.storage_offset())


def _relative_runs(tensor: torch.Tensor, base: int) -> list[tuple[int, int]]:
    return [(lo - base, hi - base) for lo, hi in byte_runs(tensor)]



_OUT_TAG = getattr(torch.Tag, "out", None)


@functools.lru_cache(maxsize=None)  # one answer per overload
def _is_out_variant(func: Any) -> bool:
    """Whether ``func`` is an ``out=`` overload (``aten.add.out``): its ``out`` tensors are
    overwritten, not read. ``torch.Tag.out`` exists from torch 2.13 on; torch 2.11, on the GPU
    image, has no such tag (the H100 run of 2026-12-06 failed every table on it), so the schema
    says it there."""
    if _OUT_TAG is not None:
        return _OUT_TAG in func.tags
    return any(getattr(a, "is_out", False) for a in func._schema.arguments) or func._overloadname.startswith("out")


class DeviceValues:
    """The shadow of small integer device memory (module docstring). ``is_device(tensor)``: whether
    a tensor is device memory (a CUDA tensor; the CUDA stand-in of the tests says otherwise)."""

    def __init__(self, is_device: Callable[[torch.Tensor], bool]) -> None:
        self._is_device = is_device
        self._shadows: dict[int, _Shadow] = {}  # allocation address -> its shadow, oldest first
        self._total = 0

    # -- reading --------------------------------------------------------------------------------------
    def values(self, tensor: torch.Tensor) -> np.ndarray | None:
        """``tensor``'s values (in its shape), where every byte of it is known, else None."""
        kind = NUMPY_INTEGERS.get(tensor.dtype)
        if kind is None:
            return None
        with torch._C.DisableTorchFunction(), no_dispatch():
            host = self._host_view(tensor)
            if host is None:
                return None
            host = host.contiguous()
            # The bytes through ctypes, not Tensor.numpy(): a tool may watch numpy() (the sanitizer
            # does, for views of pinned memory), and this read of its own shadow is not the program's.
            raw = ctypes.string_at(host.data_ptr(), host.numel() * host.element_size()) if host.numel() else b""
            return np.frombuffer(raw, dtype=kind).reshape(tuple(host.shape)).copy()

    def known(self, tensor: torch.Tensor) -> bool:
        with torch._C.DisableTorchFunction(), no_dispatch():
            return self._host_view(tensor) is not None

    def _host_view(self, tensor: torch.Tensor, data: torch.Tensor | None = None) -> torch.Tensor | None:
        base, _ = _storage(tensor)
        shadow = self._shadows.get(base)
        if shadow is None:
            return None
        for lo, hi in _relative_runs(tensor, base):
            if lo < 0 or hi > shadow.known.size or not shadow.known[lo:hi].all():
                return None
        return _view_over(shadow.data if data is None else data, tensor)

    # -- writes the tool sees -------------------------------------------------------------------------
    def written(self, address: int, ranges: list[tuple[int, int]] | None = None) -> None:
        """A device write to ``ranges`` (absolute byte runs; None: all) of the allocation at
        ``address`` that the tool does not evaluate: those values are unknown now."""
        shadow = self._shadows.get(address)
        if shadow is None:
            return
        if ranges is None:
            self._drop(address)
            return
        size = shadow.known.size
        for lo, hi in ranges:
            lo, hi = max(0, lo - address), min(size, hi - address)
            if lo < hi:
                shadow.known[lo:hi] = False

    def copied(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (device memory) now holds ``src``'s values (a host tensor, or device memory known
        here), as ``dst.copy_(src)`` leaves it; unknown where ``src`` is not known."""
        pending = self.prepare(aten.copy_.default, (dst, src), {}, [t for t in (dst, src) if self._is_device(t)])
        if pending is None:
            self.written(_storage(dst)[0], byte_runs(dst))
        else:
            self.commit(pending, dst)

    def store(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """``dst`` was made from ``host``'s values (a tensor constructor's data, read on the host)."""
        self.copied(dst, host)

    # -- evaluating an op -----------------------------------------------------------------------------
    def prepare(self, func: Any, args: tuple, kwargs: dict,
                on_device: list[torch.Tensor] | None = None) -> Pending | None:
        """Before ``func`` is declared and run: its results on the host, from the shadows of its
        device inputs (``on_device``, where the caller has them), when it writes integers and every
        input it reads is known; else None (its device writes then make their bytes unknown,
        through :meth:`written`)."""
        if on_device is None:
            on_device = [v for v in leaves((args, tuple(kwargs.values())))
                         if isinstance(v, torch.Tensor) and self._is_device(v)]
        for value in on_device:
            if value.dtype not in INTEGERS:
                return None  # the common case, one check: an op on data, not on a table
        if func is _COPY and len(on_device) == 1 and len(args) >= 2 and on_device[0] is args[0]:
            # The most frequent op on a table: a copy of host values into it (a staged index, every
            # step). Its values are the host tensor's, as copy_ converts and broadcasts them: no
            # evaluation on a copy of the shadow. They are taken now, as an evaluation would take
            # them: a device-to-host copy still queued into the same host memory may land before
            # commit, at a time the GPU decides.
            src = args[1]
            if isinstance(src, torch.Tensor) and not src.is_meta and _storage(args[0])[1] <= MAX_STORAGE:
                with torch._C.DisableTorchFunction(), no_dispatch():
                    return Pending(func, [], [(args[0], src.detach().clone())])
        device_inputs = list(on_device)
        if not device_inputs and not self._small_host_op(func, args, kwargs):
            return None
        if any(tag in func.tags for tag in _NONDETERMINISTIC):
            return None
        with torch._C.DisableTorchFunction(), no_dispatch():
            return self._evaluate(func, args, kwargs, device_inputs)

    def _small_host_op(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """An op with no device input that makes a small integer device tensor: ``.to()`` of a host
        tensor, ``arange``/``full`` on the device."""
        target = kwargs.get("device")
        if target is None or torch.device(target).type == "cpu":
            return False
        if func is _TO_COPY:
            src = args[0]
            dtype = kwargs.get("dtype") or src.dtype
            return dtype in INTEGERS and src.numel() * src.element_size() <= MAX_STORAGE
        if func.overloadpacket not in _FACTORIES:
            return False
        dtype = kwargs.get("dtype")
        if dtype is None and func.overloadpacket in _DEFAULT_DTYPE:
            dtype = torch.get_default_dtype()  # torch.ones(16, device="cuda"): floats, never evaluated
        if dtype is not None and dtype not in INTEGERS:
            return False
        return _factory_numel(func, args) * 8 <= MAX_STORAGE

    def _evaluate(self, func: Any, args: tuple, kwargs: dict, device_inputs: list[torch.Tensor]) -> Pending | None:
        schema = func._schema.arguments
        names = [a.name for a in schema]
        written_pos = {i for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write}
        overwritten = {id(args[0])} if func in _OVERWRITES and args else set()
        if _is_out_variant(func):
            overwritten |= {id(kwargs[names[i]]) for i in written_pos if names[i] in kwargs}
        copies: dict[int, torch.Tensor] = {}  # allocation address -> a host copy of its shadow
        for tensor in device_inputs:
            base, nbytes = _storage(tensor)
            if nbytes > MAX_STORAGE:
                return None  # not a table: never shadowed
            if id(tensor) not in overwritten and self._host_view(tensor) is None:
                return None  # it reads a value not known
            if base not in copies:
                shadow = self._shadows.get(base)
                copies[base] = shadow.data.clone() if shadow is not None else torch.zeros(nbytes, dtype=torch.uint8)
        replicas: dict[int, torch.Tensor] = {}

        def replica(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and self._is_device(value):
                made = replicas.get(id(value))
                if made is None:
                    made = replicas[id(value)] = _view_over(copies[_storage(value)[0]], value)
                return made
            if isinstance(value, torch.device) or (isinstance(value, str) and value.startswith("cuda")):
                return torch.device("cpu")
            return value

        host_args = map_leaves(replica, args)
        host_kwargs = {k: (torch.device("cpu") if k == "device" and v is not None else
                           False if k == "pin_memory" else replica(v)) for k, v in kwargs.items()}
        try:
            result = func(*host_args, **host_kwargs)
        except Exception:  # noqa: BLE001 - the host cannot evaluate it: its outputs are unknown
            return None
        positional = list(args) + [kwargs.get(n) for n in names[len(args):]]
        written = [(positional[i], replicas[id(positional[i])]) for i in written_pos
                   if i < len(positional) and id(positional[i]) in replicas]
        return Pending(func, leaves(result), written)

    def commit(self, pending: Pending | None, result: Any) -> None:
        """After the op ran (its writes already declared): its outputs' values, from
        :meth:`prepare`. Outputs the op wrote in place are the written arguments'; fresh ones are
        new allocations."""
        if pending is None:
            return
        with torch._C.DisableTorchFunction(), no_dispatch():
            for device, host in pending.written:
                self._put(device, host)
            written = {_storage(d)[0] for d, _ in pending.written}
            outputs = leaves(result)
            for device, host in zip(outputs, pending.outputs):
                if (isinstance(device, torch.Tensor) and isinstance(host, torch.Tensor) and self._is_device(device)
                        and _storage(device)[0] not in written):
                    self._drop(_storage(device)[0])  # fresh memory: nothing of it was known
                    self._put(device, host)

    def _put(self, device: torch.Tensor, host: torch.Tensor) -> None:
        """``device``'s bytes are ``host``'s values (broadcast to its shape, in its dtype)."""
        if device.dtype not in INTEGERS:
            return
        base, nbytes = _storage(device)
        if nbytes > MAX_STORAGE or base == 0:
            return
        shadow = self._shadows.get(base)
        if shadow is None or shadow.data.numel() != nbytes:
            shadow = self._add(base, nbytes)
        _view_over(shadow.data, device).copy_(host)
        for lo, hi in _relative_runs(device, base):
            shadow.known[max(0, lo):min(nbytes, hi)] = True

    def _add(self, base: int, nbytes: int) -> _Shadow:
        self._drop(base)
        while self._shadows and self._total + nbytes > MAX_TOTAL:
            self._drop(next(iter(self._shadows)))
        shadow = self._shadows[base] = _Shadow(nbytes)
        self._total += nbytes
        return shadow

    def _drop(self, base: int) -> None:
        shadow = self._shadows.pop(base, None)
        if shadow is not None:
            self._total -= shadow.data.numel()


def _factory_numel(func: Any, args: tuple) -> int:
    """How many elements a factory op makes (an upper bound; unbounded when it cannot tell)."""
    try:
        if func.overloadpacket is aten.arange:
            numbers = [float(a) for a in args if isinstance(a, (int, float))]
            start, end, step = (0.0, numbers[0], 1.0) if len(numbers) == 1 else (
                numbers[0], numbers[1], numbers[2] if len(numbers) > 2 else 1.0)
            return max(0, math.ceil((end - start) / step))
        if func.overloadpacket is aten.scalar_tensor:
            return 1
        size = args[0]
        return math.prod(int(s) for s in size)
    except (TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError):
        return 1 << 62


__all__ = ["INTEGERS", "MAX_STORAGE", "MAX_TOTAL", "DeviceValues", "Pending"]
