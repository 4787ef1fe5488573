"""What the intercepted zeroers of one runtime share: the device allocator, and the numbers that
name their streams, pinned buffers and device blocks.

The model. A process that holds several KV caches holds one zeroer per cache, all on one device:
one caching allocator, one set of streams. The ``x2`` campaigns do that (``EpisodeConfig(zeroers=2)``:
two caches, each with a zeroer from the same factory, on ONE runtime), and each zeroer runs in an
:class:`~kvdevice.intercept.session.InterceptSession` of its own. Whatever names a thing of the
runtime must then be unique per runtime, not per session:

* a stream's name: the runtime refuses a name twice (both constructors' ``torch.cuda.Stream()``
  asked for ``zeroer-1``);
* a happens-before key (``("pinned", 3)``, ``("simdev", 5)``): two zeroers' buffers under one key
  are one memory to the checker, which would take the second zeroer's use of its own buffer for
  a race with the first's.

So pinned buffers are numbered here, per runtime, and on the simulator the device memory is one
:class:`~kvdevice.intercept.sim_memory.SimDeviceMemory` per runtime (its blocks numbered by it), as
PyTorch has one caching allocator per device. Sessions are indexed from 0 in the order they are
bound; the episode binds cache ``k``'s zeroer ``k``-th, so a session's index is its cache's number.
Everything is numbered in the order it is made, so an episode names things the same way on every
run, and the first session is named as a lone zeroer is (its first pinned buffer is ``p1``, its
first stream ``zeroer-1``). Once a runtime has several sessions, their labels carry the index
(:attr:`InterceptSession.name`, ``spec[1].zero_block_ids#3``).

Nothing here keeps a runtime alive: the share is found through a weak mapping and refers to its
runtime weakly, so an episode's runtime, caches and memory go when the episode does.

Example::

    first, second = InterceptSession(rt, "z.py:f"), InterceptSession(rt, "z.py:f")
    first.index, second.index, first.name, second.name     # 0, 1, 'z.py:f[0]', 'z.py:f[1]'
    first.memory is second.memory                          # True on the simulator
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from kvdevice.intercept.sim_memory import SimDeviceMemory
from kvdevice.runtime import Runtime


class RuntimeShare:
    """The sessions of one runtime and what they share (see the module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        # A weak proxy: the share lives in a weak mapping keyed by the runtime, which a strong
        # reference from the value would keep alive for ever.
        self._rt = weakref.proxy(runtime)
        self._sessions: list[weakref.ref] = []
        self.pinned_ids = itertools.count(1)  # p1, p2, ... across the runtime's zeroers
        self.recorded: set[int] = set()  # CUDA storages record_stream tied elsewhere (cuda_ops)
        self._memory: SimDeviceMemory | None = None

    def join(self, session: Any) -> int:
        """Add ``session``; its index. A second session renames the first's pinned buffers, which
        were named for a lone zeroer."""
        index = len(self._sessions)
        self._sessions.append(weakref.ref(session))
        if index == 1:
            first = self._sessions[0]()
            if first is not None:
                first.host.rename_owner(first.owner)
        return index

    @property
    def count(self) -> int:
        return len(self._sessions)

    def sim_memory(self) -> SimDeviceMemory:
        """The simulated device's caching allocator, one per runtime."""
        if self._memory is None:
            self._memory = SimDeviceMemory(self._rt)  # type: ignore[arg-type]
        return self._memory


_SHARES: "weakref.WeakKeyDictionary[Runtime, RuntimeShare]" = weakref.WeakKeyDictionary()


def share_of(runtime: Runtime) -> RuntimeShare:
    """The share of ``runtime``'s intercepted zeroers (made on first use)."""
    share = _SHARES.get(runtime)
    if share is None:
        share = _SHARES[runtime] = RuntimeShare(runtime)
    return share
