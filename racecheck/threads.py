"""Python threads as host threads of a happens-before checker.

Engines issue CUDA work from more than one thread: vLLM's async output thread copies sampled
tokens to the host on a copy stream of its own, SGLang's cache controller loads and stores KV on
helper threads. Each Python thread is a host thread of the checker (:mod:`racecheck.clocks`), with
the clock of what it has seen: the thread that made the checker is :data:`~racecheck.clocks.HOST`;
a thread started under a sanitizer's watch knows what its starter knew (:meth:`HostThreads.started`);
a thread met without having been seen starting (made before the sanitizer started) knows nothing,
and what it does is ordered only by the hand-offs the checker follows.

Example::

    threads = HostThreads(hb)
    child = threads.started(parent=threading.get_ident(), child=worker.ident, name="worker")
    threads.current()        # HOST on the main thread, ``child`` on the worker
"""

from __future__ import annotations

import threading

from racecheck.clocks import HOST


class HostThreads:
    """Which host thread of ``hb`` (a :class:`racecheck.hb.HappensBefore`) each Python thread is."""

    def __init__(self, hb: object) -> None:
        self.hb = hb
        self._index: dict[int, int] = {threading.get_ident(): HOST}
        self._lock = threading.Lock()

    def current(self) -> int:
        """The host thread asking (a thread met for the first time is added, knowing nothing)."""
        ident = threading.get_ident()
        index = self._index.get(ident)
        if index is None:
            with self._lock:
                index = self._index.get(ident)
                if index is None:
                    name = threading.current_thread().name
                    index = self._index[ident] = self.hb.add_host(f"thread '{name}'", parent=None)
        return index

    def started(self, parent: int, child: int, name: str) -> int:
        """Python thread ``child`` (an ident) was started by ``parent``: it knows what ``parent`` knew."""
        with self._lock:
            parent_index = self._index.get(parent)
            index = self.hb.add_host(f"thread '{name}'", parent=parent_index)
            self._index[child] = index
            return index

    def ended(self, ident: int) -> None:
        """Python thread ``ident`` ended: its ident may be reused by a new thread."""
        with self._lock:
            if self._index.get(ident) != HOST:
                self._index.pop(ident, None)

    def known(self, ident: int) -> bool:
        return ident in self._index
