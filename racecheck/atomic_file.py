"""Writing a file whole or not at all: a temp file in the same directory, then ``os.replace``.

Readers never see half a file, and two writers of one path (two pytest-xdist workers saving the
same trace, say) leave one whole file, never an interleaving (STYLE.md: "write files with temp +
rename"). The temp file lives next to the target, so the rename stays within one file system; it
is named ``.<name>.<random>.tmp``, so a glob for ``*.json`` or ``*.py`` never picks it up, and it
is removed on any error, Ctrl-C included. Missing parent directories are created. The new file
gets the mode of the file it replaces, or what a plain ``open(path, "w")`` would give (0o666 less
the umask), not mkstemp's private 0o600.

``fsync=True`` also flushes the data to the disk before the rename, for files that must survive a
power cut; a process killed by a CUDA fault loses nothing without it (the kernel keeps the page
cache), so the default is off: the in-flight journal writes once per op.

Example::

    write_json_atomically(Path("repro/summary.json"), {"campaigns": []})
    write_text_atomically(Path("repro/cases/ring_overrun.py"), script)
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_UMASK = os.umask(0o022)  # reading the umask means setting it: read once and put it back
os.umask(_UMASK)


def write_bytes_atomically(path: Path | str, data: bytes, *, fsync: bool = False) -> Path:
    """Replace ``path`` with ``data`` (see the module docstring); returns ``path`` as a Path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), _mode_for(path))
            handle.write(data)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text_atomically(path: Path | str, text: str, *, fsync: bool = False) -> Path:
    """Replace ``path`` with ``text``, encoded as UTF-8."""
    return write_bytes_atomically(path, text.encode("utf-8"), fsync=fsync)


def write_json_atomically(
    path: Path | str,
    data: Any,
    *,
    default: Callable[[Any], Any] | None = None,
    fsync: bool = False,
) -> Path:
    """Replace ``path`` with ``data`` as JSON: ``indent=1`` and a final newline, the layout of
    every JSON file this project writes; ``default`` as for :func:`json.dumps`."""
    return write_text_atomically(path, json.dumps(data, indent=1, default=default) + "\n", fsync=fsync)


def _mode_for(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:  # a new file
        return 0o666 & ~_UMASK
