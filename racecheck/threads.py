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
from typing import Any

from racecheck.clocks import HOST


class HostThreads:
    """Which host thread of ``hb`` (a :class:`racecheck.hb.HappensBefore`) each Python thread is.

    Threads are told apart by their ``threading.Thread`` object, not only their ident: the OS
    gives an ended thread's ident to the next one, which must not inherit what the first had seen.
    """

    def __init__(self, hb: object) -> None:
        self.hb = hb
        self._index: dict[int, tuple[Any, int]] = {threading.get_ident(): (threading.current_thread(), HOST)}
        self._lock = threading.Lock()

    def current(self) -> int:
        """The host thread asking (a thread met for the first time is added, knowing nothing)."""
        ident = threading.get_ident()
        entry = self._index.get(ident)
        # The thread object without threading.current_thread(), which makes a dummy thread (and
        # runs code) for a thread it does not know yet, as one is while it starts.
        thread = getattr(threading, "_active", {}).get(ident)
        if entry is not None and (thread is None or entry[0] is thread):
            return entry[1]
        with self._lock:
            entry = self._index.get(ident)
            if entry is not None and (thread is None or entry[0] is thread):
                return entry[1]
            name = thread.name if thread is not None else str(ident)
            index = self.hb.add_host(f"thread '{name}'", parent=None)
            self._index[ident] = (thread, index)
            return index

    def started(self, parent: int, child: int, name: str, thread: Any = None) -> int:
        """Python thread ``child`` (an ident; ``thread`` its object, found by the ident if not given)
        was started by ``parent`` (an ident): it knows what ``parent`` knew."""
        with self._lock:
            entry = self._index.get(parent)
            return self._add(child, name, thread, entry[1] if entry is not None else None)

    def started_from(self, snapshot: tuple[int, ...], child: int, name: str, thread: Any = None) -> int:
        """Python thread ``child`` was started by a thread whose clock was ``snapshot`` when it called
        ``start()``: it knows that, and nothing its starter learned after."""
        with self._lock:
            index = self._add(child, name, thread, None)
            self.hb.host_acquires(index, snapshot)
            return index

    def _add(self, child: int, name: str, thread: Any, parent: int | None) -> int:
        index = self.hb.add_host(f"thread '{name}'", parent=parent)
        if thread is None:
            thread = next((t for t in threading.enumerate() if t.ident == child), threading.current_thread())
        self._index[child] = (thread, index)
        return index

    def ended(self, ident: int) -> None:
        """Python thread ``ident`` ended: its ident may be reused by a new thread."""
        with self._lock:
            entry = self._index.get(ident)
            if entry is not None and entry[1] != HOST:
                del self._index[ident]

    def known(self, ident: int) -> bool:
        return ident in self._index
