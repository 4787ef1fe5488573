"""Where in the program's own code a torch call was made: ``file:line`` of its first frame that is
not torch's, Triton's, the standard library's plumbing, or the sanitizer's.

A report names two code locations (the queued op and the later access or host write) and a
buffer's allocation site; each is the innermost frame of the program, found by walking the stack
up from the hook that saw the call. Whether a code object is the program's is decided once per
code object, so a walk costs a few frame hops.

Example::

    site = caller_site()          # inside a hook called from prog.py line 12
    str(site)                     # 'prog.py:12 (main)'
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType

import numpy
import torch
import triton

import racecheck

_SANITIZER = str(Path(__file__).resolve().parent) + os.sep
# The benchmark's programs live inside the package but are programs, not the sanitizer's plumbing.
_PROGRAMS = _SANITIZER + "bench" + os.sep
# racecheck's frames too: a custom op's call reaches the tool through its router (racecheck.effects).
_SKIPPED = tuple(
    str(Path(module.__file__).resolve().parent) + os.sep
    for module in (torch, contextlib, threading, numpy, racecheck, triton)
    if getattr(module, "__file__", None)
) + (_SANITIZER,)
_STDLIB_PLUMBING = {functools.__file__, contextlib.__file__}
_ALSO: list[str] = []


def also_skip(directory: str | Path) -> None:
    """Count the frames of ``directory`` (or of one file) as plumbing too (the simulator's
    interception, whose frames stand between a program and torch there)."""
    path = Path(directory).resolve()
    prefix = str(path) + ("" if path.is_file() else os.sep)
    if prefix not in _ALSO:
        _ALSO.append(prefix)
        _LIBRARY.clear()


@dataclass(frozen=True)
class Site:
    """One line of the program: ``file`` (relative to the working directory when under it)."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"

    @property
    def short(self) -> str:
        return f"{self.file}:{self.line}"


UNKNOWN = Site("<unknown>", 0, "?")


_LIBRARY: dict[CodeType, bool] = {}  # code object -> whether it is plumbing: one dict lookup a frame on a walk


def _is_library(code: CodeType) -> bool:
    known = _LIBRARY.get(code)
    if known is None:
        if len(_LIBRARY) > 16384:
            _LIBRARY.clear()
        known = _LIBRARY[code] = _decide(code)
    return known


def _decide(code: CodeType) -> bool:
    name = code.co_filename
    if name in _STDLIB_PLUMBING or name.startswith("<frozen"):
        return True
    try:
        resolved = str(Path(name).resolve())
    except (OSError, ValueError):
        return False
    if resolved.startswith(_PROGRAMS):
        return False
    return resolved.startswith(_SKIPPED) or resolved.startswith(tuple(_ALSO))


@functools.lru_cache(maxsize=4096)
def _display(filename: str) -> str:
    try:
        shown = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        return filename
    return filename if shown.startswith("..") else shown


def caller_site(skip: int = 1) -> Site:
    """The innermost frame of the program's own code above the caller (``skip`` frames up)."""
    try:
        frame: FrameType | None = sys._getframe(skip)
    except ValueError:  # fewer frames than that: a trace callback on a thread of C++ code (no Python caller)
        return UNKNOWN
    library = _LIBRARY
    while frame is not None:
        known = library.get(frame.f_code)
        if known is None:
            known = _is_library(frame.f_code)
        if not known:
            break
        frame = frame.f_back
    if frame is None:
        return UNKNOWN
    code, line = frame.f_code, frame.f_lineno
    key = (code, line)
    site = _SITES.get(key)
    if site is None:  # one Site per program line: a loop's ops share it (a frozen dataclass costs to make)
        if len(_SITES) > 65536:
            _SITES.clear()
        site = _SITES[key] = Site(_display(code.co_filename), line, code.co_name)
    return site


_SITES: dict[tuple[CodeType, int], Site] = {}
