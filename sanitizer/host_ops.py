"""Host ops on pinned memory: a torch op on a CPU tensor that lives in pinned memory is a host read
or a host write of those bytes, the same on the GPU and on the simulator.

``buf.fill_(0)``, ``buf[:n].copy_(src)``, ``buf + 1``, ``buf.sum()``, ``int(buf[0])`` (``.item()``,
``aten._local_scalar_dense``) and every other aten op on the CPU side reach the sanitizer's
dispatch mode; the tensors among its arguments that are pinned are read, or written where the op's
schema marks them ``(a!)``. Each is checked, at the op's own line, against the copies pending on
those bytes: a write against queued copies that read or write them (vLLM #48085), a read against
queued device-to-host copies that write them (vLLM #36013).
"""

from __future__ import annotations

from typing import Any

import torch

from racecheck.ops import kind, written_args
from sanitizer.sites import Site, caller_site

_WRITTEN: dict[Any, list[int]] = {}
_NAMES: dict[Any, str] = {}


def pinned_access(watch: Any, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Site | None:
    """Check ``func``'s host reads and writes of pinned memory (``watch`` is a
    :class:`~sanitizer.watch.HostWatch`); the op's site when it touches any, else None."""
    if kind(func) in ("view", "alloc"):
        return None  # metadata only: a view reads nothing yet
    lookup = watch.pinned.lookup
    pinned = [t for t in tensors if lookup(t) is not None]
    if not pinned:
        return None
    site = caller_site()
    written = written_tensors(func, args, kwargs)
    name = op_name(func)
    with watch.lock:
        watch.boundary(site)
        for tensor in pinned:
            if any(tensor is w for w in written):
                watch.host_access(tensor, write=True, what=f"host write ({name} on the pinned buffer)", site=site)
            else:
                watch.host_access(tensor, write=False, what=f"host read ({name} of the pinned buffer)", site=site)
    return site


def tensors_of(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments (lists of tensors included)."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def op_name(func: Any) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func).replace("aten.", "").replace(".default", "")
    return name


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's ``(a!)`` arguments)."""
    positions = _WRITTEN.get(func)
    if positions is None:
        positions = _WRITTEN[func] = written_args(func)
    if not positions:
        return []
    positional = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
    return [positional[i] for i in positions if i < len(positional) and isinstance(positional[i], torch.Tensor)]
