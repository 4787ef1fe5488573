"""The ``TorchFunctionMode`` an intercepted zeroer runs under: the torch calls aten never sees whole.

Most of a zeroer's device work reaches the backend's aten router by itself (a simulated CUDA
tensor's ``__torch_dispatch__``, or the CUDA ``TorchDispatchMode``). What this mode handles is what
must be decided at the torch call:

* **pinned allocations**: ``torch.empty/zeros/tensor/...(pin_memory=True)`` and ``x.pin_memory()``
  are registered with :class:`~kvdevice.intercept.host_memory.HostMemory` (on the simulator, which
  has no pinned memory, they become plain CPU tensors that are registered all the same), and
  ``x.is_pinned()`` answers from the registry there;
* **device factories** on the simulator: ``torch.empty(..., device="cuda")`` allocates simulated
  device memory on the current stream; ``zeros``/``full``/``arange``/... also queue the fill;
  ``torch.tensor(data, device="cuda")`` is a synchronous copy of host data, as on CUDA; a factory
  with no ``device=`` under a CUDA default device (``torch.set_default_device("cuda")``,
  ``with torch.device("cuda"):``) is the same call with ``device="cuda"`` (:func:`_with_default_device`);
* **host to device moves** on the simulator: ``x.to("cuda", non_blocking=...)``, ``x.cuda()``:
  fresh device memory and a copy with CUDA's meaning (:func:`racecheck.ops.copy_kind`);
* **indexing** of simulated CUDA tensors, through a cloaked twin (:mod:`kvdevice.intercept.sim_tensor`);
* **host reads** on the simulator that torch does not pass down whole (``.tolist()``, ``.numpy()``):
  :mod:`kvdevice.intercept.host_reads`;
* ``record_stream``, which takes the zeroer's stream stand-in (patched on ``torch.Tensor``: its
  argument parser would reject the stand-in before any mode sees the call).

Every handled call is a boundary at which pinned bytes are checked (:meth:`InterceptSession.boundary`).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._device import DeviceContext, _device_constructors
from torch.utils._pytree import tree_map

from kvdevice.intercept import host_reads
from kvdevice.intercept.errors import InterceptError, forward, raise_as_cuda, simulator_gap
from kvdevice.intercept.sim_tensor import SimCudaTensor, cloak, uncloak
from kvdevice.origin import forwarding
from racecheck.devices import names_cuda, names_host

_HOST_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_EMPTY = {torch.empty, torch.empty_strided, torch.empty_like}
_T = torch.Tensor
# Calls on a tensor that read its metadata, never its bytes.
_METADATA = frozenset(f"Tensor.{name}" for name in (
    "size", "stride", "dim", "ndimension", "numel", "nelement", "element_size", "is_contiguous", "storage_offset",
    "is_pinned", "untyped_storage", "get_device", "is_floating_point", "is_complex", "is_signed", "__len__"))


def _name(func: Any) -> str:
    """``torch.empty`` or ``Tensor.copy_``: how the zeroer's code spells the call."""
    name = getattr(func, "__name__", None) or str(func)
    qualname = getattr(func, "__qualname__", "") or ""
    return f"Tensor.{name}" if qualname.startswith(("TensorBase.", "Tensor.")) else f"torch.{name}"


def _tensor_data(args: tuple, kwargs: dict) -> bool:
    """Whether a host-data factory's data is a tensor (whose move to the device torch dispatches)."""
    return isinstance(args[0] if args else kwargs.get("data"), torch.Tensor)


def _with_default_device(func: Any, kwargs: dict) -> dict:
    """``kwargs`` with the device torch's default-device mode gives a factory called without one.

    ``torch.set_default_device`` puts that mode (a ``DeviceContext``) at the bottom of the mode
    stack, below this one: it would add ``device=`` only after this mode passed the call on, and a
    CUDA default would reach a CPU build of torch as a CUDA allocation. Added here by the same rule
    (its constructors, given no device), the call is routed as if the code had spelled it;
    ``*_like`` functions are not among them (their input's device)."""
    if kwargs.get("device") is not None or func not in _device_constructors():
        return kwargs
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return {**kwargs, "device": mode.device}
    return kwargs


def default_device_patches() -> dict[str, Any]:
    """``DeviceContext.__torch_function__`` while code runs on the simulator (cuda_api's patches).

    A CUDA default device reaches the default-device mode in two ways. The code's own calls: with
    ``set_default_device`` the intercept mode above gave them the device already
    (:func:`_with_default_device`); ``with torch.device("cuda"):`` pushes the mode on top instead,
    and the intercept mode below sees the device it adds. The harness's own work (the simulator's
    memory, host snapshots, a queued op the simulated device runs): no intercept mode is left below
    to route it, or the device is at work, and it lives in host memory, so no device is added."""
    original = DeviceContext.__torch_function__

    @forwarding
    def __torch_function__(self: DeviceContext, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if names_cuda(self.device) and not _code_call_below():
            return func(*args, **(kwargs or {}))
        return original(self, func, types, args, kwargs)

    return {"__torch_function__": __torch_function__}


def _code_call_below() -> bool:
    """Whether a simulating intercept mode below the one handling a call will route it as the code's."""
    return any(isinstance(mode, InterceptMode) and mode.sim and not mode.device_at_work()
               for mode in _get_current_function_mode_stack())


def _meta_twin(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s sizes, strides and dtype: what a ``*_like`` op reads of it."""
    with torch._C.DisableTorchFunction():
        return torch.empty_strided(tuple(tensor.size()), tuple(tensor.stride()), dtype=tensor.dtype, device="meta")


def _has_sim(args: tuple, kwargs: dict) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, SimCudaTensor):
            return True
        if isinstance(value, (list, tuple)) and any(isinstance(v, SimCudaTensor) for v in value):
            return True
    return False


def _cloaked(value: Any) -> Any:
    return tree_map(lambda v: cloak(v) if isinstance(v, SimCudaTensor) else v, value)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
    return value


class InterceptMode(TorchFunctionMode):
    """See the module docstring."""

    def __init__(self, session: Any) -> None:
        super().__init__()
        self.session = session
        self.sim = session.backend == "sim"
        self._handlers: dict[Any, Callable[[Any, tuple, dict], Any]] = {
            _T.to: self._to,
            _T.cuda: self._cuda,
            _T.pin_memory: self._pin_memory,
            _T.is_pinned: self._is_pinned,
            _T.__getitem__: self._getitem,
            _T.__setitem__: self._setitem,
            _T.numpy: self._numpy,
            _T.__array__: self._numpy,
            _T.tolist: self._tolist,
            _T.data_ptr: self._data_ptr,
            _T.new_tensor: self._new_tensor,
        }

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.device_at_work():  # the simulated device's own calls are the harness's, on the host
            kwargs = _with_default_device(func, kwargs)
        if self.sim:
            _check_simulable(func, args, kwargs)
        handler = self._handlers.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if self.sim and args and isinstance(args[0], SimCudaTensor) and names_host(kwargs.get("device")) \
                and _name(func).endswith("_like"):
            args = (_meta_twin(args[0]), *args[1:])  # a host tensor shaped like it: its bytes are not read
        cuda = names_cuda(kwargs.get("device"))
        route = (self._device_factory if cuda and self.sim
                 else self._host_data_to_cuda if cuda and func in _HOST_DATA and not _tensor_data(args, kwargs)
                 else self._pinned_factory if kwargs.get("pin_memory")
                 else self._on_sim_tensors if self.sim and _has_sim(args, kwargs) else None)
        if route is not None:  # each a boundary
            self.session.boundary(_name(func))
            return route(func, args, kwargs)
        if self.session.block_map is not None:  # an offloader's host op on pinned memory: checked at the op
            return self._host_op(func, args, kwargs)
        return forward(func, *args, **kwargs)

    def device_at_work(self) -> bool:
        """Whether the simulated device is running a queued op now (its calls are not the code's)."""
        return bool(getattr(self.session.rt, "executing", 0))

    def _host_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` run; a torch call on host tensors that live in pinned memory (an offloader's
        staging buffer, its host pool) reads them, or writes them where it works in place (``copy_``,
        ``fill_``, ``out=``): checked against the copies pending on those bytes, whatever values it
        writes. A call that touches no byte is not an access: metadata (``stride()``, ``shape``,
        ``data_ptr`` arithmetic's inputs) and a view of the same memory (``t[3]``, ``t.view(...)``)."""
        if self.device_at_work():
            return forward(func, *args, **kwargs)  # the simulated device running a queued op: not the host
        every = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        if any(v.device.type != "cpu" for v in every):
            return forward(func, *args, **kwargs)  # a copy to or from the device: a queued op, checked as one
        host = self.session.host
        pinned = [t for t in every if host.lookup(t) is not None]
        name = _name(func)
        if not pinned or name in _METADATA or name.endswith(".__get__"):
            return forward(func, *args, **kwargs)  # no pinned bytes, or none touched (a property: metadata or a view)
        in_place = name.endswith("_") and not name.endswith("__")
        written = [args[0]] if in_place and args else []
        if isinstance(kwargs.get("out"), torch.Tensor):
            written.append(kwargs["out"])
        self.session.boundary(name)
        result = forward(func, *args, **kwargs)
        if not written and isinstance(result, torch.Tensor) and result.device.type == "cpu" \
                and any(result.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in pinned):
            return result  # a view of the same bytes (or the tensor itself): nothing read yet
        for tensor in pinned:
            write = any(tensor is w for w in written)
            verb = "writes" if write else "reads"
            label = f"the host code of {self.session.call}: {name} {verb} a pinned buffer"
            (host.host_write if write else host.host_read)(host.lookup(tensor), tensor, label)
        return result

    def _on_sim_tensors(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch call on simulated CUDA tensors. What it raises is the zeroer's only when the
        same call on plain tensors raises it too; otherwise the simulator failed (kvdevice.origin)."""
        try:
            try:
                return forward(func, *args, **kwargs)
            except RuntimeError as error:
                if "not linked with support for cuda" not in str(error):
                    raise
            # A Python binding that asks for a CUDA device guard, which a CPU-only torch lacks:
            # run it on the cloaked twins (same memory, same router; sim_tensor's docstring).
            return tree_map(uncloak, forward(func, *_cloaked(args), **_cloaked(kwargs)))
        except InterceptError:
            raise  # what the harness cannot follow (a custom op with no model), said as it is
        except Exception as error:
            if not _raises_on_plain_tensors(func, args, kwargs, type(error)):
                raise simulator_gap(_name(func), error) from error
            raise

    # -- host memory -------------------------------------------------------------------------------
    def _pinned_factory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.sim:  # no pinned memory on a CPU-only machine: a registered CPU tensor stands in
            kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        result = forward(func, *args, **kwargs)
        if isinstance(result, torch.Tensor) and result.device.type == "cpu":
            if self.sim:  # from the caching host allocator's model, where the program's session has one
                return self.session.host.pin(result, f"{_name(func)}(pin_memory=True)")
            self.session.host.register(result, f"{_name(func)}(pin_memory=True)")
        return result

    def _pin_memory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self.session.boundary("Tensor.pin_memory")
        if self.session.host.is_pinned(args[0]):  # torch returns a pinned tensor itself: registered already
            return args[0] if self.sim else forward(func, *args, **kwargs)
        if self.sim:
            return self.session.host.pin(args[0].clone(), "Tensor.pin_memory()")
        result = forward(func, *args, **kwargs)
        self.session.host.register(result, "Tensor.pin_memory()")
        return result

    def _is_pinned(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.sim:
            tensor = args[0]
            return not isinstance(tensor, SimCudaTensor) and self.session.host.is_pinned(tensor)
        return forward(func, *args, **kwargs)

    def _host_data_to_cuda(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``torch.tensor(list, device="cuda")`` on a GPU: torch copies the data to the device below
        the dispatcher's Python key, where no mode sees it: a blocking copy on a stream whose gates
        spin in the controlled mode, i.e. a hang. The same copy made visible: the host tensor, then
        a blocking ``.to`` that the dispatch mode routes (the stream is run first, as CUDA does)."""
        host = forward(func, *args, **{**kwargs, "device": "cpu"})  # "cpu": not the default device's
        return host.to(kwargs["device"])

    def _new_tensor(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``x.new_tensor(data)``: torch's host-data copy again (:meth:`_host_data_to_cuda`)."""
        tensor, data = args[0], args[1] if len(args) > 1 else kwargs.get("data")
        device = kwargs.get("device") or tensor.device
        if not names_cuda(device) or isinstance(data, torch.Tensor):
            return forward(func, *args, **kwargs)
        self.session.boundary("Tensor.new_tensor")
        factory = {"dtype": kwargs.get("dtype") or tensor.dtype, "device": device}
        if self.sim:
            return self._device_factory(torch.tensor, (data,), factory)
        return self._host_data_to_cuda(torch.tensor, (data,), factory)

    # -- device memory (simulator) -------------------------------------------------------------------
    def _device_factory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        ops = self.session.sim_ops
        host_kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")}
        if func in _HOST_DATA:
            data = args[0] if args else kwargs.get("data")
            if isinstance(data, SimCudaTensor):
                dtype = kwargs.get("dtype")
                return data if dtype is None or dtype == data.dtype else data.to(dtype)
            host = forward(func, *args, **host_kwargs, device="cpu")  # "cpu": not the default device's
            return ops.to_device(host, None, non_blocking=False)  # a synchronous copy, as on CUDA
        requires_grad = bool(host_kwargs.pop("requires_grad", False))
        meta = forward(func, *tree_map(_meta, args), **{**host_kwargs, "device": "meta"})
        out = ops.new(tuple(meta.size()), meta.dtype, tuple(meta.stride()), name=_name(func))
        if requires_grad:  # a leaf that requires grad, as on CUDA (autograd on it is refused: _check_simulable)
            out.requires_grad_(True)
        if func in _EMPTY:
            return out
        inner_args = tree_map(lambda v: v._inner if isinstance(v, SimCudaTensor) else v, args)
        reads = [a._alloc.block for a in args if isinstance(a, SimCudaTensor)]
        target = out._inner
        # Made from no device memory (zeros, full, randn, arange), the values are drawn now, as CUDA
        # takes a random op's generator state when the op is issued: seeding before each call gives the
        # same draws, whenever the stream runs them.
        made = None if reads else forward(func, *inner_args, **{**host_kwargs, "device": "cpu"})

        def fill() -> None:
            target.copy_(made if made is not None else forward(func, *inner_args, **{**host_kwargs, "device": "cpu"}))

        self.session.enqueue(fill, name=_name(func), reads=reads, writes=[out._alloc.block])
        return out

    def _to(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensor = args[0]
        if not self.sim:
            return forward(func, *args, **kwargs)
        kwargs = dict(kwargs)
        copy = bool(kwargs.pop("copy", False))
        if len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other): its device and dtype
            device, dtype = args[1].device, args[1].dtype
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        else:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        if device is not None and device.type == "cuda" and not isinstance(tensor, SimCudaTensor):
            self.session.boundary("Tensor.to")
            return self.session.sim_ops.to_device(tensor, dtype, non_blocking)
        if isinstance(tensor, SimCudaTensor) and (device is None or device.type == "cuda"):
            if not copy and (dtype is None or dtype == tensor.dtype):
                return tensor  # what CUDA does: the same tensor
        if isinstance(tensor, SimCudaTensor):
            self.session.boundary("Tensor.to")
        return forward(func, *args, **kwargs)

    def _cuda(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensor = args[0]
        if not self.sim:
            return forward(func, *args, **kwargs)
        if isinstance(tensor, SimCudaTensor):
            return tensor
        self.session.boundary("Tensor.cuda")
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        return self.session.sim_ops.to_device(tensor, None, non_blocking)

    def patches(self) -> dict[str, Any]:
        """``torch.Tensor`` methods replaced while the zeroer runs: ``record_stream``'s argument
        parser rejects the stream stand-in before any mode could see the call."""
        original = torch.Tensor.record_stream
        mode = self

        def record_stream(tensor: torch.Tensor, stream: Any) -> None:
            mode.record_stream(original, tensor, stream)

        return {"record_stream": record_stream}

    def record_stream(self, original: Any, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor.record_stream(stream)``: its memory is in use on ``stream`` too."""
        runtime_stream = self.session.cuda_api.stream_of(stream)
        self.session.boundary("Tensor.record_stream")
        if self.sim:
            if not isinstance(tensor, SimCudaTensor):
                # aten::record_stream has a CUDA kernel only: a host tensor, pinned or not, is refused
                # on a GPU too (torch's caching host allocator learns of copies from copy_ itself)
                raise_as_cuda(NotImplementedError(
                    "Could not run 'aten::record_stream' with arguments from the 'CPU' backend."))
            self.session.memory.record_stream(tensor._alloc, runtime_stream)
            return
        self.session.cuda_ops.record_stream(tensor, runtime_stream)
        # torch's own record_stream comes back through __torch_function__, which looks the method
        # up on torch.Tensor: this stand-in, now with torch's stream. Past the modes, it is torch's.
        with torch._C.DisableTorchFunction():
            forward(original, tensor, runtime_stream.handle)

    # -- indexing and host views ---------------------------------------------------------------------
    def _getitem(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensor, index = args[0], args[1]
        if not (self.sim and isinstance(tensor, SimCudaTensor)):
            return forward(func, *args, **kwargs)
        return tree_map(uncloak, forward(func, cloak(tensor), _cloaked(index)))

    def _setitem(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensor, index, value = args
        if not (self.sim and isinstance(tensor, SimCudaTensor)):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self.session.boundary("Tensor.__setitem__")
                if self.session.block_map is not None and self.session.host.lookup(tensor) is not None:
                    self._host_op(torch.Tensor.copy_, (tensor[index], value), {})  # the rows it writes
            return forward(func, *args, **kwargs)
        self.session.boundary("Tensor.__setitem__")
        value = cloak(value) if isinstance(value, SimCudaTensor) else value
        return forward(func, cloak(tensor), _cloaked(index), value)

    def _numpy(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.sim and isinstance(args[0], SimCudaTensor):
            host_reads.refuse_numpy(args[0])
        return forward(func, *args, **kwargs)

    def _tolist(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.sim and isinstance(args[0], SimCudaTensor):
            self.session.boundary("Tensor.tolist")
            return host_reads.tolist(args[0])
        return forward(func, *args, **kwargs)

    def _data_ptr(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if isinstance(args[0], SimCudaTensor):
            return args[0]._inner.data_ptr()
        return forward(func, *args, **kwargs)


def _plain(value: Any) -> Any:
    return value._inner.clone(memory_format=torch.preserve_format) if isinstance(value, SimCudaTensor) else value


_DATA = torch._C.TensorBase.__dict__["data"]  # ``t.data = x``'s descriptor
# Calls that record no autograd graph whatever their inputs require.
_NO_GRAPH = _METADATA | {f"Tensor.{name}" for name in ("detach", "detach_", "requires_grad_", "retain_grad", "is_leaf")} \
    | {"torch._has_compatible_shallow_copy_type", "torch.is_tensor", "torch.numel"}


def _check_simulable(func: Any, args: tuple, kwargs: dict) -> None:
    """Refuse, in one line, what the simulator cannot run and a CPU build of torch would crash on
    rather than raise: autograd on its CUDA tensors (torch asks for a CUDA device guard a CPU build
    lacks and aborts the process), and ``t.data = x`` between a simulated CUDA tensor and a plain
    one (``nn.Module.to("cuda")`` does it: the parameter would claim CUDA with no memory behind it)."""
    if getattr(func, "__self__", None) is _DATA and len(args) == 2:
        if isinstance(args[0], SimCudaTensor) != isinstance(args[1], SimCudaTensor):
            raise InterceptError(
                "t.data = x between a simulated CUDA tensor and a plain one (nn.Module.to('cuda') or .cuda() "
                "does it for each parameter): the simulator cannot move a tensor's storage in place; build the "
                "module on the device (nn.Linear(..., device='cuda')) or run the code on a GPU")
        return
    if not torch.is_grad_enabled() or isinstance(func, types.FunctionType):
        return  # a torch function written in Python (nn.init's, under no_grad): its calls are checked one by one
    if not _requires_grad(args) and not (kwargs and _requires_grad(kwargs.values())):
        return  # the common case, one pass
    name = _name(func)
    if name in _NO_GRAPH or name.endswith(("__get__", "__set__")):
        return
    if _has_sim(args, kwargs) or names_cuda(kwargs.get("device")) or func is _T.cuda or (
            func is _T.to and any(names_cuda(a) for a in args[1:])):
        raise InterceptError(
            f"{name} with grad enabled on a tensor that requires grad: the simulator cannot run autograd "
            f"on its CUDA tensors (CPU memory under a CPU build of torch, which has no CUDA autograd); run the "
            f"code under torch.no_grad() or torch.inference_mode() where it needs no gradients, or on a GPU")


def _requires_grad(values: Any) -> bool:
    """Whether a tensor among ``values`` (or in a list among them) requires grad."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor) and item.requires_grad:
                    return True
    return False


def _raises_on_plain_tensors(func: Any, args: tuple, kwargs: dict, kind: type) -> bool:
    """Whether ``func`` raises ``kind`` on plain CPU copies of its simulated tensors too: then the
    call itself is wrong, as it would be on CUDA; otherwise the failure is the simulator's."""
    try:
        func(*tree_map(_plain, args), **tree_map(_plain, kwargs))
    except kind:
        return True
    except Exception:  # noqa: BLE001 - another failure is not the same one
        return False
    return False
