"""The built-in zeroers by name, and how a zeroer named on a command line is loaded.

Every built-in is one :class:`Builtin` row: its name, its factory and what its campaigns must show
(``race-free``: no finding; ``racy``: the fuzzer must find its race), plus, for a zoo entry, the
geometry its bug shows on. ``load_zeroer`` accepts a built-in name, ``module:attr`` or
``path/to/file.py:attr`` and checks the factory and its declared :class:`~zeroer.protocol.Capabilities`
once (:func:`zeroer.protocol.check_factory`); :meth:`LoadedZeroer.build` then builds and binds a
zeroer, under interception when it is a plain torch zeroer (:mod:`zeroer.bind`).

Example::

    loaded = load_zeroer("event_ring")
    zeroer = loaded.build(cache, rt)            # a BoundZeroer: zero_block_ids, warmup, close
    load_zeroer("examples/torch_zeroers.py:single_pinned_buffer").capabilities.api    # 'torch'
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroer.cache.layout import KVCache
from zeroer.designs import (EventRingZeroer, PerCallZeroer, ReferenceZeroer, RingZeroer, SingleBufferZeroer,
                            StagedZeroer, TorchPerCallZeroer, make_graph_ring)
from zeroer.offload import HostPool, OffloaderCapabilities, OffloaderSpecError, check_offloader_factory
from zeroer.protocol import BoundZeroer, Capabilities, ZeroerFactory, ZeroerSpecError, check_factory
from kvdevice.runtime import Runtime
from zeroer.zoo import ENTRIES as ZOO_ENTRIES

VERDICTS = ("race-free", "racy")


@dataclass(frozen=True)
class Builtin:
    """One built-in zeroer: what it is called, how it is built, what the fuzzer must conclude."""

    name: str
    factory: ZeroerFactory
    verdict: str  # "race-free" or "racy"
    zoo_geometry: str | None = None  # a zoo entry: the geometry its bug shows on
    direct: bool = False  # written straight against torch.cuda, as an engine ships it (measured on that path)

    @property
    def is_zoo(self) -> bool:
        return self.zoo_geometry is not None


BUILTINS: dict[str, Builtin] = {
    b.name: b
    for b in (
        Builtin("event_ring", EventRingZeroer, "race-free"),
        Builtin("per_call", PerCallZeroer, "race-free"),
        Builtin("reference", ReferenceZeroer, "race-free"),
        Builtin("ring", RingZeroer, "racy"),
        Builtin("single_buffer", SingleBufferZeroer, "racy"),
        # Race-free production forms written straight against torch (zeroer/designs/torch_per_call.py,
        # graph_ring.py); graph_ring's factory picks its form from the runtime.
        Builtin("graph_ring", make_graph_ring, "race-free", direct=True),
        Builtin("torch_per_call", TorchPerCallZeroer, "race-free", direct=True),
        # Broken on purpose, one real bug class each (zeroer/zoo, docs/zoo.md).
        *(Builtin(name, cls, "racy", cls.geometry) for name, cls in sorted(ZOO_ENTRIES.items())),
    )
}


def builtin_names(*, verdict: str | None = None, zoo: bool | None = None, direct: bool | None = None) -> tuple[str, ...]:
    """Built-in names, sorted, filtered by verdict, by whether they are zoo entries and direct designs."""
    return tuple(
        sorted(
            name for name, b in BUILTINS.items()
            if (verdict is None or b.verdict == verdict) and (zoo is None or b.is_zoo == zoo)
            and (direct is None or b.direct == direct)
        )
    )


# Views of the table that many callers need.
RACE_FREE = builtin_names(verdict="race-free", zoo=False, direct=False)  # on the runtime: every backend
RACY = builtin_names(verdict="racy", zoo=False)  # the upstream races: their campaigns must find them
DIRECT = builtin_names(direct=True)
ZOO = builtin_names(zoo=True)


def zeroer_names() -> list[str]:
    return sorted(BUILTINS)


def default_geometry(spec: str) -> str | None:
    """The geometry a zoo entry's bug shows on (``zoo.ratio_ignored`` -> ``ratio2``), else None."""
    return getattr(BUILTINS.get(spec), "zoo_geometry", None)


@dataclass(frozen=True)
class LoadedZeroer:
    """A checked factory and what it declares; :meth:`build` makes zeroers from it."""

    spec: str
    factory: ZeroerFactory
    capabilities: Capabilities

    @property
    def builtin(self) -> Builtin | None:
        return BUILTINS.get(self.spec)

    def build(self, cache: KVCache, runtime: Runtime, **options: Any) -> BoundZeroer:
        """Build a zeroer for ``cache`` on ``runtime``; ``options`` go to a built-in's constructor.

        A plain torch zeroer (``api="torch"``) is built, warmed up and called under interception
        (:func:`zeroer.bind.bind`), on every backend.
        """
        if self.capabilities.api == "torch":
            from zeroer.bind import bind  # the layer above the designs; imported only when used

            return bind(self, cache, runtime, **options)
        return BoundZeroer(self.factory(cache, runtime, **options), self.spec, self.capabilities)


def make_zeroer(name: str, cache: KVCache, runtime: Runtime, **options: Any) -> Any:
    """Build the built-in zeroer ``name`` itself (not bound); ``options`` go to its constructor."""
    if name not in BUILTINS:
        raise ZeroerSpecError(f"unknown zeroer {name!r}; built-in zeroers: {', '.join(zeroer_names())}")
    return BUILTINS[name].factory(cache, runtime, **options)


def kernel_options(spec: str, kernel: str | None) -> dict[str, Any]:
    """The ``kernel=`` option for the built-in staged designs (torch or triton), else nothing."""
    factory = getattr(BUILTINS.get(spec), "factory", None)
    if kernel is None or not (isinstance(factory, type) and issubclass(factory, StagedZeroer)):
        return {}
    return {"kernel": kernel}


@functools.lru_cache(maxsize=None)
def load_zeroer(spec: str) -> LoadedZeroer:
    """A built-in name, ``module:attr`` or ``path/to/file.py:attr`` -> a checked :class:`LoadedZeroer`."""
    if spec in BUILTINS:
        factory = BUILTINS[spec].factory
    elif ":" not in spec:
        named = f"; name the factory in it: '{spec}:<factory>'" if spec.endswith(".py") else ""
        raise ZeroerSpecError(
            f"unknown zeroer {spec!r}{named}; use a built-in name ({', '.join(zeroer_names())}), "
            f"'module:attr' or 'path/to/file.py:attr'"
        )
    else:
        factory = _factory(spec)
    return LoadedZeroer(spec, factory, check_factory(factory, spec))


def _factory(spec: str, what: str = "zeroer") -> Any:
    """The factory that ``spec`` (``module:attr`` or ``path/to/file.py:attr``) names."""
    target, _, attr = spec.rpartition(":")
    module = _import_file(spec, target, what) if target.endswith(".py") else _import_module(spec, target, what)
    factory = getattr(module, attr, None)
    if factory is None:
        raise ZeroerSpecError(f"{what} {spec!r}: {target!r} has no attribute {attr!r}")
    return factory


def _import_file(spec: str, target: str, what: str = "zeroer") -> Any:
    path = Path(target)
    if not path.is_file():
        raise ZeroerSpecError(f"{what} {spec!r}: file {target!r} does not exist")
    # A stable module name: the same file imported twice is one module.
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"_zeroer_plugin_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ZeroerSpecError(f"{what} {spec!r}: cannot import {target!r} as a Python file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    # As when the file is run as a script: its own directory is importable, so it may import its
    # sibling modules by name.
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.append(directory)
    try:
        with _import_scope():
            loader_spec.loader.exec_module(module)
    except Exception as exc:  # the user's module failed: say which and why
        del sys.modules[module_name]
        raise ZeroerSpecError(f"{what} {spec!r}: importing {target!r} failed: {exc!r}") from exc
    return module


def _import_module(spec: str, target: str, what: str = "zeroer") -> Any:
    try:
        with _import_scope():
            return importlib.import_module(target)
    except Exception as exc:
        raise ZeroerSpecError(f"{what} {spec!r}: cannot import module {target!r}: {exc!r}") from exc


def _import_scope() -> Any:
    """What a user's module is imported under: torch.cuda as a plain torch zeroer sees it while
    it runs (vLLM decides ``PIN_MEMORY`` from ``torch.cuda.is_available()`` at import)."""
    from zeroer.bind import import_scope

    return import_scope()


@dataclass(frozen=True)
class LoadedOffloader:
    """A checked offloader factory and what it declares; :meth:`build` makes offloaders from it."""

    spec: str
    factory: Any
    capabilities: OffloaderCapabilities

    def build(self, cache: KVCache, pool: HostPool, runtime: Runtime) -> Any:
        """Build an offloader for ``cache`` and ``pool`` on ``runtime``, under interception."""
        from zeroer.bind.offload import bind_offloader  # the layer above the designs

        return bind_offloader(self, cache, pool, runtime)


@functools.lru_cache(maxsize=None)
def load_offloader(spec: str) -> LoadedOffloader:
    """``module:attr`` or ``path/to/file.py:attr`` -> a checked :class:`LoadedOffloader`
    (:func:`zeroer.offload.check_offloader_factory`)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise OffloaderSpecError(f"offloader {spec!r}: name its factory as 'module:attr' or 'path/to/file.py:attr'")
    try:
        factory = _factory(spec, "offloader")
    except ZeroerSpecError as error:
        raise OffloaderSpecError(str(error)) from None
    return LoadedOffloader(spec, factory, check_offloader_factory(factory, spec))
