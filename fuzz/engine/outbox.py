"""An example database that works offline: writes the shared database cannot take wait in an
outbox on this host and are published, in order, on the next successful contact.

``OutboxDatabase(shared, outbox_dir)`` forwards every call to ``shared`` (the fleet's Redis,
:mod:`fuzz.engine.database`). When a call fails with one of the ``unreachable`` errors it warns
once (``FuzzDatabaseWarning``), stops trying ``shared`` for ``retry_s`` seconds, and meanwhile:

* a save, delete or move is written to the outbox, one small JSON file per op named by the time
  it was made (``<ns>-<pid>-<n>.json``, written whole with temp + rename);
* a fetch returns nothing from ``shared`` (the local layer in front of it still answers).

Before its next call to ``shared`` (in this process, or in a later run on this host that uses
the same local directory) it publishes the outbox oldest first under a file lock, so that two
pytest-xdist workers never publish the same op at once, and deletes each file once its op went
through. Every op is a set operation (``SADD``, ``SREM``), so publishing one twice (a process
killed between publishing and deleting its file) changes nothing: delivery is at least once, and
in order for the ops of one host.

Why not Hypothesis's own ``BackgroundWriteDatabase``: it moves writes to a thread, which helps
with a slow database but not with an absent one. A write that raises there kills the thread; the
write is lost, later ones wait in a queue that nobody reads, and the next ``fetch``, which waits
for that queue to drain, waits forever (tried with Hypothesis 6.170: a save to a database whose
``save`` raises ``ConnectionError``, then a fetch: still blocked after 3 s, and for good). Its
queue also dies with the process. A nightly host needs the opposite: writes that outlive both the
outage and the process, and calls that never wait on the network longer than a connect timeout.

Example::

    from hypothesis.database import InMemoryExampleDatabase
    shared = InMemoryExampleDatabase()
    db = OutboxDatabase(shared, Path("/tmp/outbox"), unreachable=(ConnectionError,))
    db.save(b"key", b"value")   # goes straight to shared while it answers
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import itertools
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from hypothesis.database import ExampleDatabase

from racecheck.atomic_file import write_json_atomically

OPS = ("save", "delete", "move")


class FuzzDatabaseWarning(UserWarning):
    """The shared example database did not answer; the run goes on with the local one."""


class OutboxDatabase(ExampleDatabase):
    """``shared``, or an outbox in ``outbox`` while ``shared`` raises one of ``unreachable``."""

    def __init__(self, shared: ExampleDatabase, outbox: Path, *,
                 unreachable: tuple[type[BaseException], ...] = (OSError,), retry_s: float = 60.0,
                 name: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.shared = shared
        self.outbox = Path(outbox)
        self.name = name or repr(shared)  # how messages call the shared database (no password)
        self._unreachable = unreachable
        self._retry_s = retry_s
        self._clock = clock
        self._offline_until: float | None = None  # clock() before which shared is not tried
        self._warned = False
        self._sequence = itertools.count()

    def __repr__(self) -> str:
        # self.name, not repr(shared): a Redis client's repr shows its password
        return f"OutboxDatabase({self.name}, outbox={str(self.outbox)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutboxDatabase) and (self.shared, self.outbox) == (other.shared, other.outbox)

    __hash__ = object.__hash__

    @property
    def online(self) -> bool:
        """False from a failed call until the next one that goes through."""
        return self._offline_until is None

    def pending(self) -> list[Path]:
        """The outbox's ops not yet published, oldest first."""
        return sorted(self.outbox.glob("*.json")) if self.outbox.is_dir() else []

    # -- the database ------------------------------------------------------------------------
    def fetch(self, key: bytes) -> Iterable[bytes]:
        went, values = self._through(lambda: list(self.shared.fetch(key)))
        return values if went else []

    def save(self, key: bytes, value: bytes) -> None:
        self._write("save", key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self._write("delete", key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self._write("move", src, dest, value)

    def flush(self) -> int:
        """Publish the outbox to ``shared``, oldest op first; returns how many went. An
        ``unreachable`` error stops it and propagates; the ops not yet published stay."""
        if not self.pending():
            return 0
        published = 0
        with self._locked():
            for path in self.pending():  # listed again under the lock: another worker may have published
                try:
                    record = json.loads(path.read_text())
                    op, args = record["op"], [base64.b64decode(a) for a in record["args"]]
                    if op not in OPS:
                        raise ValueError(op)
                except FileNotFoundError:
                    continue
                except (ValueError, KeyError, TypeError):
                    path.rename(path.with_suffix(".unreadable"))  # kept for a person, never replayed
                    continue
                getattr(self.shared, op)(*args)
                path.unlink(missing_ok=True)
                published += 1
        return published

    # -- listening (HypoFuzz's dashboard): through to shared while it answers -------------------
    def _start_listening(self) -> None:
        try:
            self.shared.add_listener(self._broadcast_change)
        except self._unreachable as error:
            self._lost(error)

    def _stop_listening(self) -> None:
        with contextlib.suppress(*self._unreachable):
            self.shared.remove_listener(self._broadcast_change)

    # -- plumbing ----------------------------------------------------------------------------
    def _write(self, op: str, *args: bytes) -> None:
        went, _ = self._through(lambda: getattr(self.shared, op)(*args))
        if not went:
            self._enqueue(op, args)

    def _through(self, call: Callable[[], Any]) -> tuple[bool, Any]:
        """``call()`` on ``shared`` unless it is offline, after the outbox (first the older ops, so
        they keep their order): whether it went through, and what it returned."""
        if self._offline_until is None or self._clock() >= self._offline_until:  # online, or time to retry
            try:
                self.flush()
                result = call()
            except self._unreachable as error:
                self._lost(error)
            else:
                self._offline_until = None
                return True, result
        return False, None

    def _lost(self, error: BaseException) -> None:
        self._offline_until = self._clock() + self._retry_s
        if not self._warned:
            self._warned = True
            warnings.warn(FuzzDatabaseWarning(
                f"example database {self.name} is unreachable ({type(error).__name__}: {error}); its writes wait "
                f"in {self.outbox} and are published on the next contact (tried again after {self._retry_s:g} s, "
                f"and by the next run on this host)"), stacklevel=2)

    def _enqueue(self, op: str, args: tuple[bytes, ...]) -> None:
        name = f"{time.time_ns():020d}-{os.getpid()}-{next(self._sequence):06d}.json"
        write_json_atomically(self.outbox / name, {"op": op, "args": [base64.b64encode(a).decode() for a in args]})

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.outbox.mkdir(parents=True, exist_ok=True)
        with open(self.outbox / ".lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released by close, or by the kernel if we die
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
