"""Replacing a method of a type defined in C, which ``setattr`` refuses, and putting it back.

torch's device-generic ``torch.Event`` and ``torch.Stream`` are static C types, immutable since
Python 3.10: ``setattr(torch.Event, "query", f)`` raises ``TypeError``. A Python subclass put in
``torch.Event``'s place would not reach most of the engines' events: those torch makes in C
(``torch.Stream.record_event()`` returns the C type, as ``torch.accelerator.current_stream()``
returns a C ``torch.Stream``), those made before the sanitizer started, and every name bound by
``from torch import Event`` before it started. So the method is replaced in the type's own
namespace, the dictionary its read-only ``__dict__`` proxies, and the interpreter is told that the
type changed (``PyType_Modified``, which drops its method caches and its specialised attribute
lookups), as it is told for any assignment to a mutable type. Every instance, whoever made it and
whenever, then calls the replacement; its subclasses (``torch.cuda.Event`` on a CUDA build) keep
the methods they define themselves.

Tested on CPython 3.11, 3.12 and 3.13. Where a type's namespace cannot be reached this way,
:func:`replace` raises ``TypeError`` and nothing is changed.

Example::

    original = torch.Event.query
    undo = replace(torch.Event, "query", lambda self: original(self))
    ...
    undo()                      # torch.Event.query is torch's own again
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from typing import Any


def replace(owner: type, name: str, value: Any) -> Callable[[], None]:
    """Make ``value`` the attribute ``name`` of the C type ``owner``; the function that puts the
    attribute back as it was."""
    namespace = _namespace(owner)
    had, original = name in namespace, namespace.get(name)
    namespace[name] = value
    _modified(owner)
    if owner.__dict__.get(name) is not value:  # pragma: no cover - a CPython whose proxy is not its namespace
        _restore(owner, namespace, name, had, original)
        raise TypeError(f"cannot replace {owner.__qualname__}.{name}: its namespace did not take the change")

    def undo() -> None:
        _restore(owner, namespace, name, had, original)

    return undo


def _namespace(owner: type) -> dict[str, Any]:
    """The dictionary behind ``owner.__dict__`` (a ``mappingproxy`` refers to exactly one mapping)."""
    mappings = [ref for ref in gc.get_referents(owner.__dict__) if isinstance(ref, dict)]
    if len(mappings) != 1:
        raise TypeError(f"cannot reach the namespace of {owner.__qualname__} (a C type that refuses setattr)")
    return mappings[0]


def _restore(owner: type, namespace: dict[str, Any], name: str, had: bool, original: Any) -> None:
    if had:
        namespace[name] = original
    else:
        namespace.pop(name, None)
    _modified(owner)


def _modified(owner: type) -> None:
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(owner))
