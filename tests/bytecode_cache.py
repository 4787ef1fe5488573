"""One bytecode cache for a test run's processes where the environment forbids writing bytecode.

The GPU image sets ``PYTHONDONTWRITEBYTECODE=1``, so no ``.pyc`` is ever written there: every
process compiles each module it imports from source. The suite's GPU tests start a process per
campaign or sanitizer run, and each compiled torch and its lazily imported modules again: 3 to 4 s
of a 10 to 16 s child on the H100 (its profile, 2026-12: ``builtins.compile``, 1,000+ calls). With
``PYTHONPYCACHEPREFIX`` naming a folder in the temp directory the sources stay unwritten, as the
setting intends, and each module is compiled once per machine.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping


def share_bytecode_cache(environ: MutableMapping[str, str]) -> str | None:
    """Where ``environ`` forbids bytecode (``PYTHONDONTWRITEBYTECODE``) and names no cache folder,
    name one for this run and its children and allow writing there; the folder, or None when
    nothing changed (bytecode already written, or the run chose its own ``PYTHONPYCACHEPREFIX``)."""
    if not environ.get("PYTHONDONTWRITEBYTECODE") or environ.get("PYTHONPYCACHEPREFIX"):
        return None
    prefix = os.path.join(tempfile.gettempdir(), f"kvzero-pycache-{os.getuid()}")
    del environ["PYTHONDONTWRITEBYTECODE"]
    environ["PYTHONPYCACHEPREFIX"] = prefix
    return prefix
