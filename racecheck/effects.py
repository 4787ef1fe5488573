"""Effect models of custom ops: the machinery (what a model is, its registry, how a call is routed).

:mod:`racecheck.custom_ops` is the public face: it is this module with the engines' own models
(:mod:`racecheck.engine_ops`) registered. The engines' models are built on this module, which is
why it holds no model itself and imports none.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from racecheck.dtypes import NUMPY_INTEGERS
from racecheck.ranges import byte_runs, row_runs

Runs = list[tuple[int, int]]

#: torch's own operator namespaces: their ops' schemas say what they touch (racecheck.ops)
TORCH_NAMESPACES = frozenset({
    "aten", "prims", "prim", "profiler", "c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor",
    "quantized", "_quantized", "debugprims", "rngprims", "inductor", "higher_order", "fsdp", "streams",
    "_inductor_test", "mkldnn", "onednn", "_test", "_caffe2", "torchvision", "_nested_tensor",
})


class ValueUnknown(Exception):
    """A value the model needs (an index, a pointer table) cannot be read here yet."""


class Effects:
    """What one call of a modelled op touches, as the model declares it: byte runs read and written.

    ``values(tensor)`` gives the integers an index or a pointer table holds, as the tool can read
    them at that moment (raising :class:`ValueUnknown` where it cannot yet)."""

    def __init__(self, values: Callable[[torch.Tensor], list[int]]) -> None:
        self._values = values
        self.reads: Runs = []
        self.writes: Runs = []

    def values(self, tensor: torch.Tensor) -> list[int]:
        """The integers ``tensor`` holds (int64 indices, uint64 addresses), flattened."""
        return self._values(tensor)

    def read(self, what: torch.Tensor | int, nbytes: int | None = None) -> None:
        """The op reads a tensor view's bytes, or ``nbytes`` from address ``what``."""
        self.reads.extend(_runs(what, nbytes))

    def write(self, what: torch.Tensor | int, nbytes: int | None = None) -> None:
        """The op writes a tensor view's bytes, or ``nbytes`` from address ``what``."""
        self.writes.extend(_runs(what, nbytes))

    def read_rows(self, tensor: torch.Tensor, dim: int, rows: Sequence[int]) -> None:
        self.reads.extend(row_runs(tensor, dim, list(rows)))

    def write_rows(self, tensor: torch.Tensor, dim: int, rows: Sequence[int]) -> None:
        self.writes.extend(row_runs(tensor, dim, list(rows)))


def _runs(what: torch.Tensor | int, nbytes: int | None) -> Runs:
    if isinstance(what, torch.Tensor):
        with torch._C.DisableTorchFunction():
            return byte_runs(what)
    if nbytes is None:
        raise TypeError("an access at a raw address needs its size in bytes (nbytes=)")
    return [(int(what), int(what) + int(nbytes))] if nbytes > 0 else []


@dataclass
class EffectModel:
    """What an op touches (``effects(fx, *args)``) and how it runs without its extension.

    ``name``: ``"namespace::op"`` for a ``torch.ops`` op, ``"package.module.function"`` for a
    function of an extension module; ``schema``: the op's schema (without the namespace), to
    define it where the extension is absent; ``params``: a pybind function's parameter names
    (its keyword arguments bind by them); ``attributes``: what a stand-in module holds besides
    the function (enums, descriptor classes)."""

    name: str
    effects: Callable[..., None]
    reference: Callable[..., Any] | None = None
    schema: str | None = None
    params: tuple[str, ...] = ()
    attributes: dict[str, Any] = field(default_factory=dict)
    extension: str = ""  # the module that defines the op when present (``vllm._C``, ``sgl_kernel``)

    @property
    def is_torch_op(self) -> bool:
        return "::" in self.name

    def bind(self, args: tuple, kwargs: dict, func: Any = None) -> list[Any]:
        """The call's arguments by position (keywords placed by the schema or ``params``)."""
        if func is None and self.is_torch_op:
            func = _torch_op_overload(self)
        if func is not None and hasattr(func, "_schema"):
            names = [a.name for a in func._schema.arguments]
            defaults = [a.default_value if a.has_default_value() else None for a in func._schema.arguments]
        else:
            names, defaults = list(self.params), [None] * len(self.params)
        given = list(args)
        for i in range(len(given), len(names)):
            spellings = names[i].split("|")  # a parameter an older version named otherwise: "new|old"
            given.append(next((kwargs[n] for n in spellings if n in kwargs), defaults[i]))
        return given

    def declare(self, args: Sequence[Any], values: Callable[[torch.Tensor], list[int]]) -> Effects:
        """Run the model over ``args``; what it says the call touches."""
        fx = Effects(values)
        self.effects(fx, *args)
        return fx


_MODELS: dict[str, EffectModel] = {}


def register(model: EffectModel) -> EffectModel:
    """Add (or replace) ``model``. A torch op is defined (where its extension is absent) once a tool
    starts (:func:`define_references`), not here: an extension loaded later would find it taken."""
    _MODELS[model.name] = model
    return model


def effect_model(name: str, *, schema: str | None = None, reference: Callable[..., Any] | None = None,
                 params: Sequence[str] = (), attributes: dict[str, Any] | None = None,
                 extension: str = "") -> Callable[[Callable], Callable]:
    """Decorator: register the decorated ``effects(fx, *args)`` as ``name``'s model."""
    def decorate(effects: Callable[..., None]) -> Callable[..., None]:
        register(EffectModel(name, effects, reference, schema, tuple(params), dict(attributes or {}), extension))
        return effects

    return decorate


def unregister(name: str) -> None:
    _MODELS.pop(name, None)


def op_name(func: Any) -> str:
    """``namespace::op`` of an OpOverload (``_C_cache_ops::swap_blocks``)."""
    return func._schema.name if hasattr(func, "_schema") else str(func)


def model_for(func: Any) -> EffectModel | None:
    """The model of the op ``func`` (an OpOverload), if one is registered."""
    if not _MODELS:
        return None
    schema = getattr(func, "_schema", None)
    return _MODELS.get(schema.name) if schema is not None else None


def is_custom(func: Any) -> bool:
    """Whether ``func`` is a ``torch.ops`` op of an extension (outside torch's own namespaces)."""
    namespace = getattr(func, "namespace", None)
    return isinstance(namespace, str) and namespace not in TORCH_NAMESPACES


def missing_model(name: str) -> str:
    """Why a custom op with no model cannot be followed, and how to add one."""
    return (f"no effect model says what it reads and writes (its schema need not say); add one with "
            f"racecheck.custom_ops.effect_model({name!r}, schema=...) (docs/sanitizer.md, 'Custom ops')")


def models() -> list[EffectModel]:
    return [m for _, m in sorted(_MODELS.items())]


# -- values ---------------------------------------------------------------------------------------

def host_values(tensor: torch.Tensor) -> list[int]:
    """The integers a CPU tensor holds, read from its memory (no torch op: callers may be inside a
    dispatch mode). uint64 addresses come back as Python ints."""
    if tensor.device.type != "cpu" or tensor.is_cuda:
        raise ValueUnknown("device memory")
    with torch._C.DisableTorchFunction():
        if not tensor.is_contiguous():
            from torch.utils._mode_utils import no_dispatch

            with no_dispatch():
                tensor = tensor.contiguous()
        count, size = tensor.numel(), tensor.element_size()
        dtype = NUMPY_INTEGERS.get(tensor.dtype)
        if dtype is None:
            raise ValueUnknown(f"a {tensor.dtype} tensor holds no indices")
        if count == 0:
            return []
        raw = ctypes.string_at(tensor.data_ptr(), count * size)
    return [int(v) for v in np.frombuffer(raw, dtype=dtype)]


def copy_runs(copies: Sequence[tuple[int, int, int]]) -> None:
    """Make ``(source, destination, bytes)`` copies between CPU addresses, in order. An address in
    device memory PyTorch's CUDA allocator holds is refused before any byte moves."""
    device = device_runs()
    for src, dst, nbytes in copies if device else ():
        for address in (src, dst):
            if any(lo < int(address) + int(nbytes) and int(address) < hi for lo, hi in device):
                raise RuntimeError(f"address {int(address):#x} ({int(nbytes)} bytes) is device memory: kvzero's "
                                   f"reference implementations copy CPU memory only; install the op's extension "
                                   f"to run it on a GPU")
    for src, dst, nbytes in copies:
        if nbytes > 0:
            ctypes.memmove(int(dst), int(src), int(nbytes))


def device_runs() -> Runs:
    """The device memory PyTorch's CUDA allocator holds now, as (start, end) runs: none where CUDA
    was never initialised in this process, and none in a CPU build of torch (where the simulator's
    device memory is CPU memory)."""
    if not hasattr(torch._C, "_cuda_memorySnapshot") or not torch.cuda.is_initialized():
        return []
    return [(int(segment["address"]), int(segment["address"]) + int(segment["total_size"]))
            for segment in torch.cuda.memory_snapshot()]


def _device_tensors(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _device_tensors(value)


# -- routing: who handles a modelled call while a tool runs ----------------------------------------

Router = Callable[[EffectModel, tuple, dict, "Callable[..., Any] | None"], Any]
_ROUTERS: list[Router] = []


@contextlib.contextmanager
def routing(router: Router) -> Iterator[None]:
    """While inside, modelled calls that reach no dispatch mode (a pybind function, a torch op on
    host tensors only) go to ``router(model, args, kwargs, real)`` (the innermost router)."""
    _ROUTERS.append(router)
    try:
        yield
    finally:
        _drop_router(router)  # unless an OpenRoute's close() dropped it already


@contextlib.contextmanager
def unrouted() -> Iterator[None]:
    """While inside, modelled calls go to the real function or the reference, past every router (a
    tool running the op itself, once it has declared what the op touches)."""
    saved, _ROUTERS[:] = list(_ROUTERS), []
    try:
        yield
    finally:
        _ROUTERS[:] = saved


def route(model: EffectModel, args: tuple, kwargs: dict, real: Callable[..., Any] | None = None) -> Any:
    """A modelled call: to the active tool, else the real function, else the reference."""
    if _ROUTERS:
        return _ROUTERS[-1](model, args, kwargs, real)
    if real is not None:
        return real(*args, **kwargs)
    # A GPU machine without the engine's extension: the reference copies CPU memory only, and a
    # raw address is checked against device memory before it is copied (copy_runs).
    device = next(_device_tensors([*args, *kwargs.values()]), None)
    if device is not None:
        raise RuntimeError(f"{model.name}: its extension is not installed, and kvzero's reference "
                           f"implementation runs on CPU memory only (the simulator's), not on a {device.device} "
                           f"tensor: install the extension, or run it under a tool")
    if model.reference is None:
        raise RuntimeError(f"{model.name} has no implementation here (its extension is absent)")
    return model.reference(*model.bind(args, kwargs, _torch_op_overload(model)))


def _torch_op_overload(model: EffectModel) -> Any:
    if not model.is_torch_op:
        return None
    packet = _torch_op(*model.name.split("::"))
    return getattr(packet, "default", None) if packet is not None else None


def define_references() -> None:
    """Define every modelled torch op whose extension is absent, as its reference (called as a tool
    starts): the engine's unmodified ``torch.ops.<namespace>.<op>(...)`` call then resolves."""
    for model in models():
        if model.is_torch_op and model.schema is not None and model.reference is not None:
            _define_where_absent(model)


def _define_where_absent(model: EffectModel) -> None:
    namespace, op = model.name.split("::")
    if _torch_op(namespace, op) is not None:
        return  # the extension's own op (or ours, defined already): its kernels run, the tools model it
    if model.extension and _import_if_found(model.extension) is not None and _torch_op(namespace, op) is not None:
        return
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    lib.define(model.schema)

    def cpu(*args: Any, **kwargs: Any) -> Any:
        return route(model, args, kwargs)

    lib.impl(op, cpu, "CPU")


_LIBRARIES: dict[str, Any] = {}


def _torch_op(namespace: str, op: str) -> Any:
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return None
    return packet


# -- extension modules ---------------------------------------------------------------------------

class _ExtensionScope:
    """What one :func:`extension_modules` scope changed: the real functions it wrapped and the
    stand-in modules it put into ``sys.modules``, put back by :meth:`undo`."""

    def __init__(self) -> None:
        self.restore: list[tuple[Any, str, Any]] = []
        self.installed: list[str] = []

    def undo(self) -> None:
        for module, function, real in reversed(self.restore):
            setattr(module, function, real)
        for name in reversed(self.installed):
            sys.modules.pop(name, None)
        self.restore, self.installed = [], []


_SCOPES: list[_ExtensionScope] = []  # extension_modules() scopes open now, innermost last


@contextlib.contextmanager
def extension_modules() -> Iterator[list[str]]:
    """While inside, every modelled function of an extension module is routed (:func:`route`): the
    real module's function wrapped, or, where the module cannot be imported, a stand-in module in
    ``sys.modules`` (its parent packages too, where absent). Yields the stand-ins installed."""
    scope = _ExtensionScope()
    _SCOPES.append(scope)
    try:  # set up inside: what an import raises half-way is undone as well
        for model in models():
            if model.is_torch_op:
                continue
            module_name, _, function = model.name.rpartition(".")
            module = _import(module_name)
            if module is None:
                module = _stand_in(module_name, scope.installed)
                for key, value in model.attributes.items():
                    if not hasattr(module, key):
                        setattr(module, key, value)
                real = None
            else:
                real = getattr(module, function, None)
                scope.restore.append((module, function, real))
            setattr(module, function, _routed(model, real))
        yield list(scope.installed)
    finally:
        _close_scope(scope)


@dataclass(frozen=True)
class OpenRoute:
    """One route of modelled calls open now: what it is (a line of a message), what holds it open
    (the same object for as long as it stays open) and how to undo it."""

    what: str
    owner: Any
    close: Callable[[], None]


def open_routes() -> list[OpenRoute]:
    """What routes modelled calls now, outermost first: each router (:func:`routing`), then each open
    :func:`extension_modules` scope, with the stand-in modules it put into ``sys.modules``. A tool
    closes its own on exit; these are for finding (and undoing) one left open."""
    routes = [OpenRoute(f"a router of modelled calls still routing ({getattr(router, '__qualname__', router)})",
                        router, lambda router=router: _drop_router(router)) for router in _ROUTERS]
    for scope in _SCOPES:
        stand_ins = f", stand-in modules {', '.join(scope.installed)} in sys.modules" if scope.installed else ""
        routes.append(OpenRoute(f"extension functions still routed ({len(scope.restore)} real ones wrapped{stand_ins})",
                                scope, lambda scope=scope: _close_scope(scope)))
    return routes


def _drop_router(router: Router) -> None:
    if router in _ROUTERS:
        _ROUTERS.remove(router)


def _close_scope(scope: _ExtensionScope) -> None:
    scope.undo()
    if scope in _SCOPES:
        _SCOPES.remove(scope)


def _import_if_found(name: str) -> Any:
    """``name`` imported where its top package is installed (no import attempt otherwise)."""
    import importlib.util

    try:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            return None
    except (ImportError, ValueError):
        return None
    return _import(name)


def _import(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - absent, or present without its GPU: the stand-in serves
        return None


def _stand_in(name: str, installed: list[str]) -> types.ModuleType:
    parts = name.split(".")
    module: Any = None
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        existing = sys.modules.get(prefix)
        if existing is None:
            existing = types.ModuleType(prefix, f"kvzero's stand-in for {prefix} (racecheck.custom_ops)")
            existing.__path__ = []  # a package, so that its children import
            sys.modules[prefix] = existing
            installed.append(prefix)
            if module is not None:
                setattr(module, parts[i - 1], existing)
        module = existing
    return module


def _routed(model: EffectModel, real: Callable[..., Any] | None) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return route(model, args, kwargs, real)

    call.__name__ = model.name.rpartition(".")[2]
    call.__qualname__ = call.__name__
    call.__wrapped_model__ = model  # type: ignore[attr-defined]
    return call


__all__ = ["EffectModel", "Effects", "OpenRoute", "ValueUnknown", "copy_runs", "define_references", "device_runs",
           "effect_model", "extension_modules", "host_values", "is_custom", "missing_model", "model_for", "models",
           "open_routes", "register", "route", "routing", "unregister", "unrouted"]
