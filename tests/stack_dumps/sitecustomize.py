"""Loaded at start-up by every Python process that a signal test runs (``tests.signal_runs.clean_env``
puts this directory on ``PYTHONPATH`` and names a folder in ``KVZERO_TEST_STACKS``): SIGUSR1 makes
the process write the stack of each of its threads to ``<folder>/<pid>.txt`` and go on, so a run
that is late to exit can say where it was stuck without being stopped. A file of its own, because
pytest's output capture may be holding stderr at that moment; opened again in a forked child, whose
pid is new."""

import faulthandler
import os
import signal

_FOLDER = os.environ.get("KVZERO_TEST_STACKS")
_open = []  # faulthandler writes to the file's descriptor: keep the file open


def _register() -> None:
    if _FOLDER and os.path.isdir(_FOLDER):
        _open[:] = [open(os.path.join(_FOLDER, f"{os.getpid()}.txt"), "w")]
        faulthandler.register(signal.SIGUSR1, file=_open[0], all_threads=True)


_register()
os.register_at_fork(after_in_child=_register)
