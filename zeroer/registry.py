"""Names for zeroers, and how an outside zeroer plugs in.

A zeroer is built by a *factory* ``factory(cache, runtime) -> zeroer``: ``cache`` is the
:class:`~zeroer.layout.KVCache` to zero, ``runtime`` the :class:`~zeroer.runtime.Runtime` whose
current stream each call must be ordered on; the returned object has
``zero_block_ids(block_ids: list[int]) -> None``. The built-in designs are registered by name;
``resolve_factory`` also accepts ``module:attr`` and ``path/to/file.py:attr``, which is how vLLM's
own class (behind a small adapter) or a new design is fuzzed (docs/zeroer-api.md).

Example::

    z = make_zeroer("event_ring", cache, rt)
    factory = resolve_factory("my_pkg.zeroers:make_mine")
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from .direct import TorchPerCallZeroer, make_graph_ring
from .errors import ZeroerError
from .impls import EventRingZeroer, PerCallZeroer, ReferenceZeroer, RingZeroer, SingleBufferZeroer, Zeroer
from .layout import KVCache
from .runtime import Runtime
from .zoo import ENTRIES as ZOO_ENTRIES
from .zoo.entry import BOTH

ZeroerFactory = Callable[[KVCache, Runtime], Zeroer]

REGISTRY: dict[str, ZeroerFactory] = {
    "event_ring": EventRingZeroer,
    "per_call": PerCallZeroer,
    "reference": ReferenceZeroer,
    "ring": RingZeroer,
    "single_buffer": SingleBufferZeroer,
}
RACE_FREE: tuple[str, ...] = ("event_ring", "per_call", "reference")
RACY: tuple[str, ...] = ("ring", "single_buffer")
# Race-free production forms written straight against torch.cuda (zeroer/direct), measured on
# that direct path. torch_per_call runs on cuda in the free-running mode only (it waits on
# events the controlled mode cannot gate); graph_ring's factory picks its form from the runtime:
# CUDA graphs through the driver there, its protocol modelled on the runtime everywhere else.
DIRECT: tuple[str, ...] = ("graph_ring", "torch_per_call")
REGISTRY.update({"graph_ring": make_graph_ring, "torch_per_call": TorchPerCallZeroer})
# Broken on purpose, one real bug class each (zeroer/zoo, docs/zoo.md), for `python -m fuzz.detect`.
REGISTRY.update(ZOO_ENTRIES)
ZOO: tuple[str, ...] = tuple(sorted(ZOO_ENTRIES))


class ZeroerSpecError(ZeroerError, ValueError):
    """A ``--zeroer`` value that names no usable factory."""


def zeroer_names() -> list[str]:
    return sorted(REGISTRY)


def backends_of(factory: object) -> tuple[str, ...]:
    """Where a zeroer runs: its factory's ``backends`` (zoo entries, the direct designs), else both."""
    return tuple(getattr(factory, "backends", BOTH))


def cuda_modes_of(factory: object) -> tuple[str, ...]:
    """The cuda modes a zeroer runs in: its factory's ``modes``, else controlled and free."""
    return tuple(getattr(factory, "modes", ("controlled", "free")))


def default_geometry(spec: str) -> str | None:
    """The geometry a zoo entry's bug shows on (``zoo.ratio_ignored`` -> ``ratio2``), else None."""
    entry = ZOO_ENTRIES.get(spec)
    return entry.geometry if entry is not None else None


def follows_reallocation(spec: str, zeroer: object) -> bool:
    """Whether the fuzzer may reallocate the cache under ``zeroer`` (the ``reallocate`` op).

    Registered zeroers read the cache's current address table at every call (the harness keeps
    the ``KVCache`` object and swaps its buffers), so they must follow; ``zoo.stale_table``
    does not, which is its bug. An outside zeroer may have captured the table on purpose, as
    vLLM's does, so it is reallocated under only if it sets ``follows_reallocation = True``.
    """
    return bool(getattr(zeroer, "follows_reallocation", spec in REGISTRY))


def make_zeroer(name: str, cache: KVCache, runtime: Runtime, **options: Any) -> Zeroer:
    """Build the registered zeroer ``name``; ``options`` go to its constructor."""
    if name not in REGISTRY:
        raise ZeroerSpecError(f"unknown zeroer {name!r}; built-in zeroers: {', '.join(zeroer_names())}")
    return REGISTRY[name](cache, runtime, **options)


def resolve_factory(spec: str) -> ZeroerFactory:
    """A built-in name, ``module:attr`` or ``path/to/file.py:attr`` -> a checked factory."""
    if spec in REGISTRY:
        return REGISTRY[spec]
    if ":" not in spec:
        raise ZeroerSpecError(
            f"unknown zeroer {spec!r}; use a built-in name ({', '.join(zeroer_names())}), "
            f"'module:attr' or 'path/to/file.py:attr'"
        )
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ZeroerSpecError(f"zeroer {spec!r}: file {target!r} does not exist")
        module_name = f"_zeroer_plugin_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ZeroerSpecError(f"zeroer {spec!r}: cannot import {target!r} as a Python file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:  # the user's module failed: say which and why
            raise ZeroerSpecError(f"zeroer {spec!r}: importing {target!r} failed: {exc!r}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise ZeroerSpecError(f"zeroer {spec!r}: cannot import module {target!r}: {exc!r}") from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise ZeroerSpecError(f"zeroer {spec!r}: {target!r} has no attribute {attr!r}")
    check_factory(factory, spec)
    return factory


def check_factory(factory: object, spec: str) -> None:
    """A factory must be callable as ``factory(cache, runtime)``."""
    if not callable(factory):
        raise ZeroerSpecError(f"zeroer {spec!r} is {type(factory).__name__}, not a factory(cache, runtime)")
    try:
        inspect.signature(factory).bind(object(), object())
    except TypeError as exc:
        raise ZeroerSpecError(
            f"zeroer {spec!r} has signature {inspect.signature(factory)}; a factory must accept "
            f"(cache, runtime): {exc}"
        ) from None
    except ValueError:  # builtins without a signature: accept and let the call decide
        pass
