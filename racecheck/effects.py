"""Effect models of custom ops: the machinery (what a model is, its registry, how a call is routed,
and the names the tools take while they run: stand-ins only where nothing of the program's answers).

:mod:`racecheck.custom_ops` is the public face: it is this module with the engines' own models
(:mod:`racecheck.engine_ops`) registered. The engines' models are built on this module, which is
why it holds no model itself and imports none.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import handle_torch_function, has_torch_function

from racecheck.dtypes import NUMPY_INTEGERS
from racecheck.errors import KvzeroError
from racecheck.ranges import byte_runs, row_runs
from racecheck.raw_copies import Placement, Unplaced, allocator_segments, copy_bytes

Runs = list[tuple[int, int]]

#: torch's own operator namespaces: their ops' schemas say what they touch (racecheck.ops)
TORCH_NAMESPACES = frozenset({
    "aten", "prims", "prim", "profiler", "c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor",
    "quantized", "_quantized", "debugprims", "rngprims", "inductor", "higher_order", "fsdp", "streams",
    "_inductor_test", "mkldnn", "onednn", "_test", "_caffe2", "torchvision", "_nested_tensor",
})


class ValueUnknown(Exception):
    """A value the model needs (an index, a pointer table) cannot be read here yet."""


class NeedsExtension(KvzeroError, RuntimeError):
    """A modelled call kvzero's reference cannot make here (device memory, or no reference): the
    op's extension is needed. A refusal that names its fix (``user_fixable``), never a bug of ours."""

    user_fixable = True


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

    @property
    def short_name(self) -> str:
        """How a report names the op: ``swap_blocks``, ``multi_layer_block_kv_transfer``."""
        return self.name.replace("::", ".").rpartition(".")[2]

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
    """Add (or replace) ``model``. Nothing is defined or installed here: while a tool runs, its
    calls are routed by name (:func:`extension_modules`), and nothing of the program's is taken."""
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


def copy_runs(copies: Sequence[tuple[int, int, int]], tensors: Sequence[Any] = ()) -> None:
    """Make ``(source, destination, bytes)`` copies, in order, where their bytes lie: host memory on
    the host, device memory on its device, each as a torch copy on the caller's current stream
    (:mod:`racecheck.raw_copies`); ``tensors`` are the op's arguments (their storages are placed
    first). An address that cannot be placed is refused before any byte moves."""
    placement = Placement(_tensors_in(list(tensors)))
    try:
        copy_bytes(copies, placement)
    except Unplaced as error:
        raise NeedsExtension(str(error)) from None


def device_runs() -> Runs:
    """The device memory PyTorch's CUDA allocator holds now, as (start, end) runs: none where CUDA
    was never initialised in this process, and none in a CPU build of torch (where the simulator's
    device memory is CPU memory)."""
    return [(start, end) for start, end, _ in allocator_segments()]


# What a reference implementation reads an index or a pointer table in device memory by: the values
# the active tool knows (racecheck.device_values), set around the reference's call (known_values).
_KNOWN: contextvars.ContextVar[Callable[[torch.Tensor], Any] | None] = contextvars.ContextVar(
    "kvzero_known_values", default=None)


@contextlib.contextmanager
def known_values(values: Callable[[torch.Tensor], Any]) -> Iterator[None]:
    """While inside, :func:`reference_values` of a device tensor asks ``values(tensor)`` first (a
    tool's knowledge of what the program staged there: integers, or None where it knows none)."""
    token = _KNOWN.set(values)
    try:
        yield
    finally:
        _KNOWN.reset(token)


def reference_values(tensor: torch.Tensor) -> list[int]:
    """The integers ``tensor`` holds, for a reference implementation about to make its copies: a
    host tensor's from its memory; a device tensor's as the active tool knows them, else read back
    on the caller's current stream (what the op's kernel, queued there now, would read; the read
    waits for that stream, as a blocking ``.cpu()`` would, and no torch mode sees it)."""
    with torch._C.DisableTorchFunction():
        on_device = tensor.device.type != "cpu"
    if not on_device:
        return host_values(tensor)
    ask = _KNOWN.get()
    if ask is not None:
        known = ask(tensor)
        if known is not None:
            return [int(v) for v in np.asarray(known).reshape(-1).tolist()]
    from torch.utils._mode_utils import no_dispatch

    with torch._C.DisableTorchFunction(), no_dispatch():
        if tensor.dtype not in NUMPY_INTEGERS:
            raise ValueUnknown(f"a {tensor.dtype} tensor holds no indices")
        return host_values(tensor.to("cpu"))


def _device_tensors(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "cuda"):
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
        return _handed_on(real, args, kwargs)
    # A machine without the engine's extension: the reference makes the op's copies itself, on the
    # host or on a CUDA device, each address placed first (copy_runs); memory of another kind of
    # device (meta, XPU) it cannot copy.
    device = next(_device_tensors([*args, *kwargs.values()]), None)
    if device is not None:
        raise NeedsExtension(f"{model.name}: its extension is not installed, and kvzero's reference "
                           f"implementation runs on host and CUDA memory only, not on a {device.device} "
                           f"tensor: install the extension, or run it under a tool")
    if model.reference is None:
        raise NeedsExtension(f"{model.name} has no implementation here (its extension is absent)")
    return model.reference(*model.bind(args, kwargs, _torch_op_overload(model)))


def _torch_op_overload(model: EffectModel) -> Any:
    """The overload a call of torch op ``model`` binds its keywords by: the defined op's (its
    extension's, or the program's own), else the stand-in's (the model's schema)."""
    if not model.is_torch_op:
        return None
    packet = _defined_op(*model.name.split("::"))
    if packet is None:
        packet = _stand_in_op(model)
    return getattr(packet, "default", None) if packet is not None else None


def _handed_on(function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The program's own function or op, called as the program called it: what it raises is the
    program's, not a stand-in's (:func:`failed_inside` stops at this frame)."""
    return function(*args, **kwargs)


# -- the names a tool takes while it runs ------------------------------------------------------------
# Models attach to the program's functions and ops by name, as the program calls them. So a tool
# takes a name only where nothing of the program's answers to it, only while it runs, and gives it
# back the moment something does:
#
# * ``torch.ops.<namespace>.<op>`` of a modelled op that nothing defines resolves to a stand-in, a
#   Python callable that routes the call (:class:`_StandInOp`). Nothing is registered with torch's
#   dispatcher, so the program's own definition (``torch.library`` DEF or FRAGMENT, ``custom_op``,
#   its extension's load), before or after the tool started, never meets one of ours; from then on
#   the lookup finds the program's op, and the model follows its calls by its name at dispatch.
# * A modelled module (``lmcache.c_ops``) and its packages are the program's wherever another import
#   finder finds them: :class:`_Finder` asks every other finder first, and wraps the modelled
#   functions of the module it loads. Only where none finds one, or what it finds is an extension
#   that cannot load here, does a stand-in serve (:class:`_StandInModule`); a stand-in package gives
#   way to the program's own as soon as that can be imported. Stand-ins leave ``sys.modules`` as the
#   last scope closes.
#
# Of torch's private API this relies on ``torch._ops._OpNamespace`` (the class of ``torch.ops.<ns>``,
# whose ``__getattr__`` resolves an op and whose ``name`` is the namespace), the same from torch 2.0
# to 2.13, and ``torch._C.parse_schema``.

_OpNamespace = torch._ops._OpNamespace
# torch's own lookup (also where this module is imported again while a scope of its first import is open)
_TORCH_LOOKUP = getattr(_OpNamespace.__dict__["__getattr__"], "_kvzero_torch_lookup",
                        _OpNamespace.__dict__["__getattr__"])


def _defined_op(namespace: str, op: str) -> Any:
    """``torch.ops.<namespace>.<op>`` as torch defines it now (its extension's, or the program's),
    past the tools' stand-ins; None where nothing defines it."""
    space = getattr(torch.ops, namespace)
    cached = vars(space).get(op)
    if cached is not None:
        return cached
    try:
        return _TORCH_LOOKUP(space, op)
    except (AttributeError, RuntimeError):
        return None


def _op_or_stand_in(space: Any, op: str) -> Any:
    """``torch.ops.<namespace>.<op>`` while a tool runs: the op torch finds, else (for a modelled op
    nothing defines, its extension not importable here either) a stand-in, not cached on the
    namespace: the program's own definition, whenever it comes, is what the next lookup finds."""
    try:
        return _TORCH_LOOKUP(space, op)
    except AttributeError:
        model = _MODELS.get(f"{space.name}::{op}")
        if model is None or _stand_in_op(model) is None:
            raise
        if _extension_defines(model):
            return _TORCH_LOOKUP(space, op)
        return _stand_in_op(model)


_op_or_stand_in._kvzero_torch_lookup = _TORCH_LOOKUP  # type: ignore[attr-defined]


_TRIED: set[str] = set()  # the extensions a lookup tried to import


def _extension_defines(model: EffectModel) -> bool:
    """Whether importing the op's extension, where installed, defines it (tried once a process: an
    extension absent or failing to import stays so; the program imports its own when it has one)."""
    if not model.extension or model.extension in _TRIED:
        return False
    _TRIED.add(model.extension)
    return _import_if_found(model.extension) is not None and _defined_op(*model.name.split("::")) is not None


class _StandInOp:
    """``torch.ops.<namespace>.<op>`` of a modelled op nothing defines, while a tool runs. A call
    meets the torch-function modes on its tensors as a defined op's does (the tool's sees it there),
    then goes to the tool (:func:`route`); once the program has defined the op, to the program's op.
    ``default`` is its one overload, with the model's schema."""

    def __init__(self, model: EffectModel) -> None:
        self.model = model
        self.namespace, self.op = model.name.split("::")
        self.__name__ = self.__qualname__ = self.op
        self.default = _StandInOverload(self, torch._C.parse_schema(f"{self.namespace}::{model.schema}"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        defined = _defined_op(self.namespace, self.op)
        if defined is not None:  # defined since the program looked it up: the model follows it there
            return _handed_on(defined, args, kwargs)
        tensors = tuple(_tensors_in([*args, *kwargs.values()]))
        if has_torch_function(tensors):
            return handle_torch_function(self, tensors, *args, **kwargs)
        return route(self.model, args, kwargs)

    def overloads(self) -> list[str]:
        return ["default"]

    def __repr__(self) -> str:
        return f"<{_stand_in_op_named(self.model.name)}>"


class _StandInOverload:
    """The stand-in's ``default``: its schema is what a call's keywords bind by."""

    def __init__(self, packet: _StandInOp, schema: Any) -> None:
        self.overloadpacket = packet
        self.namespace = packet.namespace
        self._schema = schema
        self._overloadname = "default"
        self.__name__ = self.__qualname__ = f"{packet.op}.default"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.overloadpacket(*args, **kwargs)

    def name(self) -> str:
        return f"{self._schema.name}.default"


_STAND_IN_OPS: dict[str, _StandInOp] = {}


def _stand_in_op(model: EffectModel) -> _StandInOp | None:
    """The stand-in of torch op ``model`` (one per model), where the model can be one: it says the
    op's schema and has a reference implementation."""
    if not model.is_torch_op or model.schema is None or model.reference is None:
        return None
    stand_in = _STAND_IN_OPS.get(model.name)
    if stand_in is None or stand_in.model is not model:
        stand_in = _STAND_IN_OPS[model.name] = _StandInOp(model)
    return stand_in


def _tensors_in(values: Sequence[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors_in(value)


# -- modules ----------------------------------------------------------------------------------------

def _module_role(name: str) -> str | None:
    """``"module"`` for a module a model names a function of (``lmcache.c_ops``), ``"package"`` for
    one of its packages (``lmcache``), else None."""
    role = None
    for model in list(_MODELS.values()):  # asked on every import while a tool runs, from any thread
        if model.is_torch_op:
            continue
        module = model.name.rpartition(".")[0]
        if module == name:
            return "module"
        if module.startswith(name + "."):
            role = "package"
    return role


def _functions_of(module_name: str) -> list[EffectModel]:
    return [m for m in models() if not m.is_torch_op and m.name.rpartition(".")[0] == module_name]


class _StandInModule(types.ModuleType):
    """kvzero's stand-in for a module nothing else could import: a modelled module (its modelled
    functions and the names its model holds) or one of its packages. A name it lacks is first looked
    for in the program's own module of that name, which takes its place once it can be imported."""

    _kvzero_gives_way = True  # a name no program gives its module: lookups of any other are forwarded

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # what tools look up on every module (__file__, __wrapped__): nobody's
            raise AttributeError(attr)
        real = _real_in_place_of(self)
        if real is not None:
            return getattr(real, attr)
        _LACKED[f"{self.__name__}.{attr}"] = self.__name__
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}: it is kvzero's stand-in, as "
                             f"nothing else could import {self.__name__!r} here", name=attr, obj=self)


class _StandInExtension(_StandInModule):
    """kvzero's stand-in for a modelled extension module another finder found but that cannot load
    here (a CUDA build on a machine without CUDA's libraries): it does not give way to it."""

    _kvzero_gives_way = False


# "package.name" a stand-in was asked for and lacked -> that stand-in's name (while or since the last
# scope opened): how an ImportError the program's own line raised is told to be a stand-in's
_LACKED: dict[str, str] = {}


def _stand_in_above(name: str) -> str | None:
    """The outermost stand-in in ``sys.modules`` among ``name`` and its packages."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if isinstance(sys.modules.get(prefix), _StandInModule):
            return prefix
    return None


def _real_in_place_of(stand_in: _StandInModule) -> types.ModuleType | None:
    """The program's module of the stand-in's name, where it has one now: the one in
    ``sys.modules``, or (while the tools' names are taken) one another finder finds, imported in
    place of the stand-in and of every stand-in below it."""
    name = stand_in.__name__
    current = sys.modules.get(name)
    if current is not None and not isinstance(current, _StandInModule):
        return current
    if not stand_in._kvzero_gives_way:
        return None
    root = _stand_in_above(name)
    if root is None or _HOOK.finder is None or _find_elsewhere(root, _parent_path(root)) is None:
        return None
    _give_way(root)
    return importlib.import_module(name)


def _parent_path(name: str) -> list[str] | None:
    parent = name.rpartition(".")[0]
    return getattr(sys.modules.get(parent), "__path__", None) if parent else None


def _give_way(root: str) -> None:
    """Take the stand-ins ``root`` and below out of ``sys.modules`` (and ``root`` off its program's
    package), then import the program's ``root``, which another finder finds now."""
    for name, module in list(sys.modules.items()):
        if isinstance(module, _StandInModule) and (name == root or name.startswith(root + ".")):
            del sys.modules[name]
    _detach(root)
    for key in [key for key in _LACKED if key.startswith(root + ".")]:
        del _LACKED[key]
    importlib.import_module(root)


def _detach(name: str) -> None:
    """Remove stand-in ``name`` from its parent package where the parent holds it."""
    parent, _, child = name.rpartition(".")
    holder = sys.modules.get(parent) if parent else None
    if holder is not None and isinstance(vars(holder).get(child), _StandInModule):
        delattr(holder, child)


def _find_elsewhere(name: str, path: Any, target: Any = None) -> Any:
    """The spec another finder on ``sys.meta_path`` finds for ``name``, in their order."""
    for finder in list(sys.meta_path):
        find = getattr(finder, "find_spec", None)
        if isinstance(finder, _Finder) or find is None:
            continue
        spec = find(name, path, target)
        if spec is not None:
            return spec
    return None


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while the tools' names are taken; it answers only for modelled
    modules, their packages and names below a stand-in. What another finder finds is the program's
    (a modelled module's loader wrapped, :class:`_RoutingLoader`); a stand-in serves only where none
    does; below a stand-in, the program's own package takes the stand-in's place once it is found."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        parent = name.rpartition(".")[0]
        role, root = _module_role(name), _stand_in_above(parent) if parent else None
        if role is None and root is None:
            return None
        if root is not None and _find_elsewhere(root, _parent_path(root)) is not None:
            _give_way(root)  # the program's package is importable now: it takes the stand-in's place
            path, root = getattr(importlib.import_module(parent), "__path__", None), None
        spec = _find_elsewhere(name, path, target)
        if spec is not None:
            return _routed_spec(spec) if role == "module" else spec
        if role is None:
            if root is not None:
                _LACKED[name] = root  # a module of a package that is kvzero's stand-in
            return None
        return importlib.machinery.ModuleSpec(name, _StandInLoader(), is_package=role == "package")


class _StandInLoader(importlib.abc.Loader):
    """Makes the stand-in module (or package) :class:`_Finder` serves where no other finder answers."""

    def create_module(self, spec: Any) -> types.ModuleType:
        return _StandInModule(spec.name, f"kvzero's stand-in for {spec.name}, which nothing else could import "
                                         f"(racecheck.custom_ops)")

    def exec_module(self, module: types.ModuleType) -> None:
        _fill(module)


def _routed_spec(spec: Any) -> Any:
    """``spec`` of a modelled module another finder found, loading through :class:`_RoutingLoader`."""
    real = spec.loader
    if real is None or not hasattr(real, "exec_module"):
        return spec  # a loader of the old protocol: the module loads unwrapped
    spec.loader = _RoutingLoader(real)
    return spec


class _RoutingLoader(importlib.abc.Loader):
    """A modelled module's own loader, then its modelled functions wrapped (:func:`route`). An
    extension that cannot load here (a CUDA build on a machine without CUDA's libraries) is stood
    in for instead, as if it were absent."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.stood_in = False

    def create_module(self, spec: Any) -> types.ModuleType | None:
        create = getattr(self.real, "create_module", None)
        try:
            return create(spec) if create is not None else None
        except (ImportError, OSError):
            if not isinstance(self.real, importlib.machinery.ExtensionFileLoader):
                raise
        self.stood_in = True
        return _StandInExtension(spec.name, f"kvzero's stand-in for {spec.name}: its extension cannot load here")

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.real  # the module's own loader, as without a tool
        if self.stood_in:
            _fill(module)
            return
        self.real.exec_module(module)
        _HOOK.wrapped.extend(_wrap(module))


def _fill(stand_in: types.ModuleType) -> None:
    """A stand-in module's modelled functions (each the model's: :func:`route`) and the names its
    models hold (enums, descriptor classes)."""
    for model in _functions_of(stand_in.__name__):
        setattr(stand_in, model.name.rpartition(".")[2], _routed(model, None))
        for key, value in model.attributes.items():
            vars(stand_in).setdefault(key, value)
    _HOOK.served.append(stand_in)


@dataclass(frozen=True)
class _Wrap:
    """A real module's function replaced by its routed twin, put back while still the twin."""

    module: types.ModuleType
    function: str
    real: Callable[..., Any]
    twin: Callable[..., Any]

    def undo(self) -> None:
        if vars(self.module).get(self.function) is self.twin:
            setattr(self.module, self.function, self.real)


def _wrap(module: types.ModuleType) -> list[_Wrap]:
    """Route the modelled functions a real module defines (one it lacks stays lacking)."""
    wrapped = []
    for model in _functions_of(module.__name__):
        function = model.name.rpartition(".")[2]
        real = vars(module).get(function)
        if real is None or getattr(real, "__wrapped_model__", None) is model:
            continue
        twin = _routed(model, real)
        setattr(module, function, twin)
        wrapped.append(_Wrap(module, function, real, twin))
    return wrapped


def _routed(model: EffectModel, real: Callable[..., Any] | None) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return route(model, args, kwargs, real)

    call.__name__ = model.name.rpartition(".")[2]
    call.__qualname__ = call.__name__
    call.__wrapped_model__ = model  # type: ignore[attr-defined]
    return call


# -- scopes -----------------------------------------------------------------------------------------

class _Hook:
    """What the open scopes share while any is open: the finder first on ``sys.meta_path``, torch's
    op lookup answering with stand-ins, and what those served meanwhile (stand-in modules, wrapped
    functions of modules the program imported), all undone as the last scope closes."""

    def __init__(self) -> None:
        self.finder: _Finder | None = None
        self.served: list[types.ModuleType] = []
        self.wrapped: list[_Wrap] = []

    def install(self) -> None:
        _LACKED.clear()  # what the stand-ins of an earlier run lacked says nothing of this one's
        self.finder = _Finder()
        sys.meta_path.insert(0, self.finder)
        _OpNamespace.__getattr__ = _op_or_stand_in

    def uninstall(self) -> None:
        """Every step taken whatever an earlier one raises."""
        try:
            for wrap in reversed(self.wrapped):
                wrap.undo()
            for module in reversed(self.served):
                if sys.modules.get(module.__name__) is module:
                    del sys.modules[module.__name__]
                _detach(module.__name__)
        finally:
            _OpNamespace.__getattr__ = _TORCH_LOOKUP
            if self.finder in sys.meta_path:
                sys.meta_path.remove(self.finder)
            self.finder, self.served, self.wrapped = None, [], []


_HOOK = _Hook()


class _ExtensionScope:
    """One :func:`extension_modules` scope: the functions of modules already imported that it
    wrapped as it opened, put back by :meth:`undo`."""

    def __init__(self) -> None:
        self.wrapped: list[_Wrap] = []

    def undo(self) -> None:
        for wrap in reversed(self.wrapped):
            wrap.undo()
        self.wrapped = []


_SCOPES: list[_ExtensionScope] = []  # extension_modules() scopes open now, innermost last


@contextlib.contextmanager
def extension_modules() -> Iterator[None]:
    """While inside, the program's calls of modelled functions and torch ops are routed
    (:func:`route`): a modelled function of a module imported already is wrapped now, one of a module
    imported meanwhile as it loads, and a module or op that nothing else answers to is a stand-in
    (see "the names a tool takes while it runs" above)."""
    scope = _ExtensionScope()
    _SCOPES.append(scope)
    try:  # set up inside: what a step raises half-way is undone as well
        if _HOOK.finder is None:
            _HOOK.install()
        for name in sorted({m.name.rpartition(".")[0] for m in models() if not m.is_torch_op}):
            module = sys.modules.get(name)
            if module is not None and not isinstance(module, _StandInModule):
                scope.wrapped.extend(_wrap(module))
        yield
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
    :func:`extension_modules` scope (the outermost with what the names it took served). A tool
    closes its own on exit; these are for finding (and undoing) one left open."""
    routes = [OpenRoute(f"a router of modelled calls still routing ({getattr(router, '__qualname__', router)})",
                        router, lambda router=router: _drop_router(router)) for router in _ROUTERS]
    for i, scope in enumerate(_SCOPES):
        wrapped = len(scope.wrapped) + (len(_HOOK.wrapped) if i == 0 else 0)
        stand_ins = sorted({m.__name__ for m in _HOOK.served if sys.modules.get(m.__name__) is m}) if i == 0 else []
        served = f", stand-in modules {', '.join(stand_ins)} in sys.modules" if stand_ins else ""
        routes.append(OpenRoute(f"extension functions still routed ({wrapped} real ones wrapped{served}; an import "
                                f"finder and torch's op lookup still taking modelled names)",
                                scope, lambda scope=scope: _close_scope(scope)))
    return routes


def _drop_router(router: Router) -> None:
    if router in _ROUTERS:
        _ROUTERS.remove(router)


def _close_scope(scope: _ExtensionScope) -> None:
    try:
        scope.undo()
    finally:
        if scope in _SCOPES:
            _SCOPES.remove(scope)
        if not _SCOPES and _HOOK.finder is not None:
            _HOOK.uninstall()


def _import_if_found(name: str) -> Any:
    """``name`` imported where its top package is installed (no import attempt otherwise)."""
    try:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            return None
    except (ImportError, ValueError):
        return None
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - present without its GPU: the stand-in serves
        return None


# -- what of a tool's a program failed inside ---------------------------------------------------------

# Module names whose frames are libraries': they raise on behalf of whoever called them.
_LIBRARY_TOPS = frozenset({"torch", "numpy", "triton"}) | frozenset(getattr(sys, "stdlib_module_names", ()))
_CANNOT_IMPORT = re.compile(r"^cannot import name '([^']+)'")


def failed_inside(error: BaseException) -> str | None:
    """Which of the tools' stand-ins or models ``error`` was raised inside, named for one line: a
    name a stand-in module lacks (``kvzero's stand-in module 'lmcache' (...)``), a stand-in op, or the
    code of a model or of its reference (``kvzero's effect model of sgl_kernel::transfer_kv_per_layer
    (racecheck/engine_ops.py:97, in _transfer)``). None where the innermost frame that is not a
    library's is no such code: the program's own (then it failed on its own), or another part of a
    tool (:func:`kvdevice.origin.blame` says whose)."""
    owner = getattr(error, "obj", None) if isinstance(error, AttributeError) else None
    if isinstance(owner, _StandInOverload):
        owner = owner.overloadpacket
    if isinstance(owner, _StandInOp):
        return _stand_in_op_named(owner.model.name)
    if isinstance(owner, _StandInModule):
        return _stand_in_module_named(owner.__name__)
    lacked = _LACKED.get(_missing_name(error) or "") if isinstance(error, ImportError) else None
    if lacked is not None:
        return _stand_in_module_named(lacked)
    return _model_frame(error)


def _missing_name(error: ImportError) -> str | None:
    """``package.name`` an import could not find: a module not found, or ``from package import name``."""
    if isinstance(error, ModuleNotFoundError):
        return error.name
    if error.path is not None:
        return None  # a module with a file: not a stand-in
    name = getattr(error, "name_from", None)  # Python 3.12 on
    if name is None:
        match = _CANNOT_IMPORT.match(str(error))
        name = match.group(1) if match else None
    return f"{error.name}.{name}" if error.name and name else None


def _stand_in_op_named(name: str) -> str:
    return f"kvzero's stand-in for op {name} (nothing defined it here when the program looked it up)"


def _stand_in_module_named(name: str) -> str:
    return f"kvzero's stand-in module {name!r} (nothing else could import {name!r} when the program imported it)"


def _model_frame(error: BaseException) -> str | None:
    frames = list(traceback.walk_tb(error.__traceback__))
    inner = next((i for i in range(len(frames) - 1, -1, -1) if not _library(frames[i][0])), None)
    if inner is None or not _module(frames[inner][0]).startswith("racecheck.") \
            or frames[inner][0].f_code is _handed_on.__code__:
        return None
    frame, line = frames[inner]
    where = f"{_short_path(frame.f_code.co_filename)}:{line}, in {frame.f_code.co_name}"
    declaring = False
    for outer, _ in reversed(frames[:inner + 1]):
        if not _module(outer).startswith("racecheck."):
            break
        declaring = declaring or outer.f_code is EffectModel.declare.__code__
        model = _model_of(outer)
        if model is not None:
            what = "effect model of" if declaring else "stand-in for"
            return f"kvzero's {what} {model.name} ({where})"
    return None


def _model_of(frame: types.FrameType) -> EffectModel | None:
    names = frame.f_locals
    for value in (names.get("model"), names.get("self")):
        if isinstance(value, EffectModel):
            return value
        if isinstance(value, _StandInOp):
            return value.model
    return None


def _module(frame: types.FrameType) -> str:
    return str(frame.f_globals.get("__name__", "") or "")


def _library(frame: types.FrameType) -> bool:
    module = _module(frame)
    return module.startswith("<") or module.split(".")[0] in _LIBRARY_TOPS


def _short_path(path: str) -> str:
    """``racecheck/engine_ops.py``: a file of this project from its package on."""
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:]) if len(parts) > 1 else path


__all__ = ["EffectModel", "Effects", "NeedsExtension", "OpenRoute", "ValueUnknown", "copy_runs", "device_runs",
           "effect_model", "extension_modules", "failed_inside", "host_values", "is_custom", "known_values",
           "missing_model", "model_for", "models", "open_routes", "reference_values", "register", "route", "routing",
           "unregister", "unrouted"]
