"""What a zeroer is, what its factory may declare, and the one place both are checked.

A zeroer is any object with vLLM's call ``zero_block_ids(block_ids) -> None`` (:class:`Zeroer`).
It may also have ``warmup()`` (compile and load its kernels, as vLLM's ``warmup`` does: the
harness calls it before any gated work) and ``close()`` (wait for its queued work and release what
it holds: the harness calls it at the end of every episode). A *factory* builds one:
``factory(cache, runtime) -> zeroer``, where ``cache`` is the KV cache to zero and ``runtime`` the
stream runtime whose current stream orders every call.

What a factory may declare is one :class:`Capabilities` record, as its ``capabilities``
attribute (a class attribute when the factory is the zeroer class itself). Nothing else about a
zeroer is looked up by name anywhere else: :func:`check_factory` reads the record once when the
zeroer is loaded, and :class:`BoundZeroer` resolves the optional hooks once when it is built.

Example::

    class MyZeroer:
        capabilities = Capabilities(backends=("sim", "cuda"), geometries=("tiny", "ratio2"))

        def __init__(self, cache, runtime): ...
        def zero_block_ids(self, block_ids): ...

    check_factory(MyZeroer, "my_zeroer.py:MyZeroer").api     # 'torch': it is intercepted
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from zeroer.errors import ZeroerError
from zeroer.id_containers import IDS_CONTAINERS, accepted_containers

__all__ = ["IDS_CONTAINERS", "Capabilities", "BoundZeroer", "Zeroer", "ZeroerFactory", "ZeroerSpecError", "check_factory"]

APIS = ("torch", "runtime")
ALL_BACKENDS = ("sim", "cuda")
ALL_CUDA_MODES = ("controlled", "free")


class ZeroerSpecError(ZeroerError, ValueError):
    """A zeroer spec, factory or declaration that cannot be used; the message says how to fix it."""

    user_fixable = True


@runtime_checkable
class Zeroer(Protocol):
    """vLLM's ``KVBlockZeroer`` call: enqueue the zeroing of ``block_ids`` on the current stream."""

    def zero_block_ids(self, block_ids: Sequence[int] | None) -> None: ...


ZeroerFactory = Callable[[Any, Any], Zeroer]


class Declared:
    """What a component's declaration shares, zeroer or offloader: its tuples of names, and where
    it runs (its ``backends``, ``cuda_modes`` and ``geometries``)."""

    backends: tuple[str, ...]
    cuda_modes: tuple[str, ...]
    geometries: tuple[str, ...] | None

    def _tuples(self, names: tuple[str, ...], error: type[Exception]) -> None:
        """Each of ``names`` as a tuple; a bare string is refused (``("sim")`` is a string)."""
        record = type(self).__name__
        for name in names:
            value = getattr(self, name)
            if isinstance(value, str):
                raise error(f"{record}({name}={value!r}): pass a tuple of names, e.g. {name}=({value!r},)")
            if value is not None:
                object.__setattr__(self, name, tuple(value))

    def supports_geometry(self, name: str) -> bool:
        return self.geometries is None or name in self.geometries

    def runs_on(self, backend: str, mode: str | None = None) -> bool:
        """Whether it runs on ``backend`` (and, on cuda, in ``mode``)."""
        if backend not in self.backends:
            return False
        return backend != "cuda" or mode is None or mode in self.cuda_modes


@dataclass(frozen=True)
class Capabilities(Declared):
    """What a zeroer's factory declares about it (every field has the default an engine's class needs).

    * ``api``: ``"torch"`` (the default) for a zeroer written in plain torch, Triton and
      ``torch.cuda``, as vLLM's is: while it runs, the harness intercepts its pinned allocations,
      copies, kernel launches, streams and events and routes them to the runtime
      (docs/fuzz-your-zeroer.md). ``"runtime"`` for a zeroer written against
      :mod:`kvdevice.runtime` (every built-in design): it is called as it is.
    * ``backends`` and ``cuda_modes``: where it can run.
    * ``follows_reallocation``: it reads the cache's address table on every call, so the fuzzer
      may move the cache under it (the ``reallocate`` op); vLLM's class captures the table once,
      so the default is False.
    * ``geometries``: the KV-cache presets it supports (``zeroer.cache.geometries``); None means
      every one. The fuzzer skips the others and says why.
    * ``ids_as``: the containers ``zero_block_ids`` takes its ids in (``list``, ``tuple``,
      ``array``: numpy, ``tensor``: CPU torch); None reads them from its annotation, and without
      one it is ``list[int]``, vLLM's contract (:mod:`zeroer.id_containers`). The fuzzer's caller
      hands ids over in these only.
    """

    api: str = "torch"
    backends: tuple[str, ...] = ALL_BACKENDS
    cuda_modes: tuple[str, ...] = ALL_CUDA_MODES
    follows_reallocation: bool = False
    geometries: tuple[str, ...] | None = None
    ids_as: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self._tuples(("backends", "cuda_modes", "geometries", "ids_as"), ZeroerSpecError)
        if self.api not in APIS:
            raise ZeroerSpecError(
                f"Capabilities(api={self.api!r}) is not an api; choose 'torch' (plain torch and Triton, "
                f"intercepted) or 'runtime' (written against kvdevice.runtime)"
            )
        check_subset("backends", self.backends, ALL_BACKENDS)
        check_subset("cuda_modes", self.cuda_modes, ALL_CUDA_MODES)
        if self.ids_as is not None:
            check_subset("ids_as", self.ids_as, IDS_CONTAINERS)
        if not isinstance(self.follows_reallocation, bool):
            raise ZeroerSpecError(f"Capabilities(follows_reallocation={self.follows_reallocation!r}): pass True or False")
        check_geometries(self.geometries)


def check_subset(name: str, values: tuple[str, ...], allowed: tuple[str, ...], record: str = "Capabilities",
                  error: type[Exception] = ZeroerSpecError) -> None:
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise error(
            f"{record}({name}={values!r}): "
            + (f"{bad[0]!r} is not one of {', '.join(allowed)}" if bad else f"name at least one of {', '.join(allowed)}")
        )


def check_geometries(geometries: tuple[str, ...] | None, record: str = "Capabilities",
                     error: type[Exception] = ZeroerSpecError) -> None:
    """Declared geometries name presets (None: every one), or ``error`` names the bad one."""
    if geometries is None:
        return
    from zeroer.cache.geometries import GEOMETRIES, LARGE_GEOMETRIES  # the presets live above this module

    known = {**GEOMETRIES, **LARGE_GEOMETRIES}
    unknown = [g for g in geometries if g not in known]
    if unknown or not geometries:
        raise error(
            f"{record}(geometries={geometries!r}): "
            + (f"{unknown[0]!r} is not a geometry" if unknown else "name at least one geometry")
            + f"; known: {', '.join(sorted(known))} (or None for every one)"
        )


def check_callable_factory(factory: object, spec: str, parameters: tuple[str, ...], what: str = "zeroer",
                           error: type[Exception] = ZeroerSpecError) -> None:
    """``factory`` is callable with ``parameters`` (names for the message), or ``error`` says why."""
    shape = f"factory({', '.join(parameters)})"
    if not callable(factory):
        raise error(f"{what} {spec!r} is {type(factory).__name__}, not a {shape}")
    try:
        inspect.signature(factory).bind(*(object() for _ in parameters))
    except TypeError as exc:
        raise error(
            f"{what} {spec!r} has signature {inspect.signature(factory)}; a factory must accept "
            f"({', '.join(parameters)}): {exc}"
        ) from None
    except ValueError:  # builtins without a signature: accept and let the call decide
        pass


def declaration(factory: object, spec: str, record: type, package: str = "zeroer.protocol", what: str = "zeroer",
                error: type[Exception] = ZeroerSpecError) -> Any:
    """What ``factory`` declares as its ``capabilities`` attribute, a ``record`` (the defaults if
    nothing); anything else is ``error``. The one place a declaration is read."""
    declared = getattr(factory, "capabilities", None)
    if declared is None:
        return record()
    if not isinstance(declared, record):
        raise error(
            f"{what} {spec!r} declares capabilities = {declared!r} ({type(declared).__name__}); "
            f"declare a {package}.{record.__name__}(...) instead"
        )
    return declared


def check_factory(factory: object, spec: str) -> Capabilities:
    """Check that ``factory`` can build zeroers and return what it declares (the defaults if nothing)."""
    check_callable_factory(factory, spec, ("cache", "runtime"))
    _not_an_offloader_factory(factory, spec)
    return declaration(factory, spec, Capabilities)


def _not_an_offloader_factory(factory: object, spec: str) -> None:
    """An offloader's factory, ``(cache, host_pool, runtime=None)``, binds two arguments too: given as a
    zeroer, its host pool would be handed the runtime. Its parameter's name tells it apart."""
    try:
        names = list(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return
    if "host_pool" in names:
        raise ZeroerSpecError(f"zeroer {spec!r} has signature {inspect.signature(factory)}, an offloader's factory "
                              f"(cache, host_pool, runtime); fuzz it with --offloader {spec}, or give --zeroer a "
                              f"factory(cache, runtime)")


def optional_hook(obj: object, name: str, spec: str, what: str = "zeroer",
                  error: type[Exception] = ZeroerSpecError) -> Callable[..., None] | None:
    """``obj``'s optional method ``name``, or None; an attribute of that name that is not callable is ``error``."""
    hook = getattr(obj, name, None)
    if hook is not None and not callable(hook):
        raise error(
            f"{what} {spec!r}: its {name} attribute is a {type(hook).__name__}, not a method; "
            f"define {name}(self) -> None or remove it"
        )
    return hook


def _required_arguments(hook: Callable[..., Any], spec: str, name: str) -> int:
    """How many arguments ``hook`` needs (0, or 1: vLLM's ``warmup(num_kv_blocks)``)."""
    try:
        parameters = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):  # no signature to read: call it as the harness always has
        return 0
    required = [p for p in parameters
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) > 1:
        raise ZeroerSpecError(
            f"zeroer {spec!r}: its {name}({', '.join(p.name for p in required)}) needs {len(required)} arguments; the harness "
            f"calls {name}() or {name}(num_blocks): bind the others first (functools.partial) or give them defaults"
        )
    return len(required)


class BoundZeroer:
    """A built zeroer with its optional hooks resolved once: ``warmup`` falls back to zeroing the
    null block 0 (what vLLM's warm-up does), and gets the number of blocks when it asks for one
    (vLLM's ``warmup(num_kv_blocks)``); ``close`` falls back to nothing; ``ids_as`` is the
    containers ``zero_block_ids`` takes (its declaration, else its annotation).

    Example::

        bound = BoundZeroer(factory(cache, rt), "event_ring", capabilities)
        bound.warmup(64); bound.zero_block_ids([3]); bound.close()
    """

    __slots__ = ("zeroer", "spec", "capabilities", "zero_block_ids", "ids_as", "_warmup", "_warmup_takes_blocks", "_close")

    def __init__(self, zeroer: object, spec: str, capabilities: Capabilities) -> None:
        call = getattr(zeroer, "zero_block_ids", None)
        if not callable(call):
            raise ZeroerSpecError(
                f"zeroer {spec!r}: its factory returned a {type(zeroer).__name__}, which has no "
                f"zero_block_ids(block_ids) method; return an object that has one"
            )
        self.zeroer = zeroer
        self.spec = spec
        self.capabilities = capabilities
        self.zero_block_ids: Callable[[Sequence[int] | None], None] = call
        declared = capabilities.ids_as
        try:
            self.ids_as: tuple[str, ...] = declared if declared is not None else accepted_containers(call, spec)
        except ValueError as error:  # an annotation that admits no container the caller has
            raise ZeroerSpecError(str(error)) from None
        self._warmup = optional_hook(zeroer, "warmup", spec)
        self._warmup_takes_blocks = self._warmup is not None and _required_arguments(self._warmup, spec, "warmup") == 1
        self._close = optional_hook(zeroer, "close", spec)

    def warmup(self, num_blocks: int) -> None:
        """Compile and load the zeroer's kernels; ``num_blocks`` for a ``warmup(num_kv_blocks)``."""
        if self._warmup is None:
            self.zero_block_ids([0])
        elif self._warmup_takes_blocks:
            self._warmup(num_blocks)
        else:
            self._warmup()

    def close(self) -> None:
        if self._close is not None:
            self._close()
