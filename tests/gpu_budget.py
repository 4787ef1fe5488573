"""The test suite on a machine with a GPU: how many pytest-xdist workers ``-n auto`` starts, and a
budget of GPU slots that every process of the suite shares.

On one H100, ``pytest -n auto`` started 16 workers, and many of their tests start children of their
own (``python -m sanitizer``, ``pytest fuzz``) that each make a CUDA context: 127 tests failed with
``the GPU refused a context, stream or pinned allocation``, ``CUDA error: out of memory`` or a gate
kernel's 30 s warm-up timeout (a GPU time-slices between contexts, and the controlled runtime's gates
spin while they wait). So, where CUDA is available:

* ``-n auto`` is :attr:`GpuBudget.workers`, so that workers and the children of the tests that hold
  slots make at most :data:`CONTEXTS` CUDA contexts at once (a worker keeps its context, and the
  hardware queues its streams took, until it exits);
* a test that uses the GPU holds one of :attr:`GpuBudget.slots` slots while it runs: a test with a
  CUDA ``skipif`` from its setup, any other test from the moment it starts a child process (which,
  on this machine, may make a context of its own) unless the child runs on the simulator
  (:func:`stays_off_the_gpu`). A slot is an exclusive ``flock`` on a file in a
  folder every process of the machine shares, so the budget holds across workers, across
  concurrent runs, and the lock goes with a process that dies. A child started by a test that holds
  a slot is inside it (``KVZ_GPU_SLOT_HELD``) and takes none, so no test waits for its own parent.

Without CUDA nothing changes: xdist's own ``-n auto`` and no slots. ``KVZ_GPU_SLOTS=N`` sets the
number of slots (``0``: no budget); ``KVZ_GPU_SLOTS_DIR`` the folder of their lock files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# CUDA contexts one GPU held at once without refusing one: what binds is hardware queues, not bytes
# (each process asks for 32, CUDA_DEVICE_MAX_CONNECTIONS, for the gated streams). On one H100
# (2026-12-06): 8 workers and their tests' children, up to 12 contexts, ran 1,611 tests with no
# refusal; 14 workers, 13 to 16 contexts with 32 GiB of 80 in use, had a context refused ("CUDA error:
# out of memory") within 4 minutes; 16 workers had 127 tests fail so (the issue's run).
CONTEXTS = 12
# GPU memory one slot stands for: a gated runtime's context, pinned pools, and the children of one
# test (a benchmark run with -j 6 makes six contexts). Seen on one H100: 1.3 GiB for one test's
# process, 28 to 35 GiB for 9 to 16 contexts at once.
SLOT_GIB = 10
MAX_SLOTS = CONTEXTS // 3  # a third of the contexts for the children of the tests that hold slots
WAIT_S = 900.0  # a test waits this long for a slot, then runs without one (a budget never fails a test)
HELD = "KVZ_GPU_SLOT_HELD"


@dataclass(frozen=True)
class GpuBudget:
    """What one machine's GPU holds: ``slots`` tests on it at once, ``workers`` xdist workers."""

    memory_gib: float
    slots: int
    workers: int


def plan(cpus: int, memory_gib: float, slots_override: str | None = None) -> GpuBudget:
    """The budget of a machine with ``cpus`` CPUs and a GPU of ``memory_gib`` GiB.

    Example::

        plan(16, 79.6)    # GpuBudget(memory_gib=79.6, slots=4, workers=8): one H100
    """
    slots = max(1, min(MAX_SLOTS, int(memory_gib // SLOT_GIB)))
    if slots_override is not None:
        try:
            slots = int(slots_override)
        except ValueError:
            raise ValueError(f"KVZ_GPU_SLOTS={slots_override!r}: give a whole number of slots (0: no budget)") from None
        if slots < 0:
            raise ValueError(f"KVZ_GPU_SLOTS={slots_override!r}: give a whole number of slots (0: no budget)")
    workers = max(1, min(cpus, CONTEXTS - min(slots, MAX_SLOTS)))
    return GpuBudget(memory_gib, slots, workers)


def gpu_memory_gib(query: Callable[[list[str]], str] | None = None) -> float | None:
    """The first visible GPU's memory in GiB, from ``nvidia-smi`` (no CUDA context made here); None
    where it cannot say."""
    query = query or (lambda argv: subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    argv = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    if visible:
        argv.append(f"--id={visible}")
    try:
        return int(query(argv).split()[0]) / 1024  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()  # makes no context


def auto_workers() -> int | None:
    """What ``-n auto`` starts on this machine: its budget's workers, or None (xdist's own count)."""
    budget = machine_budget()
    return budget.workers if budget is not None else None


def machine_budget() -> GpuBudget | None:
    """This machine's budget, or None without CUDA (nothing changes then)."""
    if not cuda_available():
        return None
    memory = gpu_memory_gib()
    return plan(os.cpu_count() or 1, memory if memory is not None else SLOT_GIB, os.environ.get("KVZ_GPU_SLOTS"))


class Slot:
    """One of ``count`` slots, taken by an exclusive lock on its file in ``folder``."""

    def __init__(self, folder: Path, count: int) -> None:
        self.folder = folder
        self.count = count
        self._fd: int | None = None
        self._lock = threading.Lock()  # a test may start children from several threads

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take(self, wait_s: float = WAIT_S, poll_s: float = 0.05) -> bool:
        """Hold a free slot, waiting up to ``wait_s``: True once held, False if none came free."""
        with self._lock:
            if self._fd is not None:
                return True
            self.folder.mkdir(parents=True, exist_ok=True)
            deadline = time.monotonic() + wait_s
            while True:
                for index in range(self.count):
                    fd = os.open(self.folder / f"slot-{index}", os.O_RDWR | os.O_CREAT, 0o666)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        os.close(fd)
                        continue
                    self._fd = fd
                    os.environ[HELD] = "1"  # the test's children are inside this slot
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(poll_s)

    def give_back(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)  # closing the descriptor drops the lock
                self._fd = None
                os.environ.pop(HELD, None)


def slots_folder() -> Path:
    return Path(os.environ.get("KVZ_GPU_SLOTS_DIR") or Path(tempfile.gettempdir()) / f"kvzero-gpu-slots-{os.getuid()}")


def uses_gpu(markers: list) -> bool:
    """Whether a test's marks say it runs only with CUDA (a ``skipif`` naming CUDA or a GPU)."""
    for mark in markers:
        reason = str(mark.kwargs.get("reason", ""))
        if mark.name == "skipif" and ("cuda" in reason.lower() or "gpu" in reason.lower()):
            return True
    return False


_SIM_FLAGS = ("--backend", "--kvz-sanitize-backend")
# Programs the suite starts that make no CUDA context: ``git`` (the commit a report or a benchmark's
# data file records, racecheck.environment). A test of test_examples or test_intercept that asked git
# for the commit took a slot and held it for the rest of its simulator run (the suite's children,
# logged on the CPU, 2026-12-06).
_NO_CUDA_PROGRAMS = frozenset({"git"})


def stays_off_the_gpu(args: tuple, kwargs: dict) -> bool:
    """Whether a child started with ``Popen(*args, **kwargs)`` makes no CUDA context: one of our
    commands told to run on the simulator (``--backend sim``, ``--kvz-sanitize-backend sim``), a
    program that never makes one (``git``), or a child whose environment hides the GPU
    (``CUDA_VISIBLE_DEVICES=""``). On an H100 the README's
    test command ran out of its 8 minutes with 4 of 8 workers waiting for a slot that tests with
    such children held: most of the suite's children fuzz on the simulator."""
    env = kwargs.get("env")
    if isinstance(env, dict) and env.get("CUDA_VISIBLE_DEVICES", None) == "":
        return True
    argv = args[0] if args else kwargs.get("args")
    if isinstance(argv, (str, bytes)) or not isinstance(argv, (list, tuple)):
        return False  # a shell line: not read
    words = [str(a) for a in argv]
    if words and os.path.basename(words[0]) in _NO_CUDA_PROGRAMS:
        return True
    backends = [words[i + 1] for i, w in enumerate(words[:-1]) if w in _SIM_FLAGS]
    backends += [w.split("=", 1)[1] for w in words if w.split("=", 1)[0] in _SIM_FLAGS and "=" in w]
    return bool(backends) and all(b == "sim" for b in backends)


@contextlib.contextmanager
def children_take_the_slot(slot: Slot, warn: Callable[[str], None]) -> Iterator[None]:
    """Inside: the first child process started takes ``slot`` first (where none is held yet),
    unless it :func:`stays_off_the_gpu`."""
    original = subprocess.Popen.__init__

    def start(self: subprocess.Popen, *args: object, **kwargs: object) -> None:
        if not slot.held and not stays_off_the_gpu(args, kwargs) and not slot.take():
            warn(f"no GPU slot came free in {WAIT_S:g} s; this test's child runs without one")
        original(self, *args, **kwargs)

    subprocess.Popen.__init__ = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original  # type: ignore[method-assign]
