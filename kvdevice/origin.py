"""Where an exception comes from: the code under test (a zeroer, an offloader, a program), or the harness that runs it.

A finding claims that the user's code is wrong, so an exception raised while that code runs is
its finding only when its own code raised it; one that the harness raised (a simulator gap,
an op the interception cannot route, a clash in the runtime, a bug of ours) is a harness error,
never a finding. The decision is made from the traceback, not from the exception's type:

* read the frames from the raise outwards, skipping **library** frames (torch, Triton, numpy,
  Hypothesis, pytest, the standard library): a library raises on behalf of whoever called it;
* the first other frame decides. A frame of the **code under test** (the user's module, vLLM, the
  built-in designs and zoo: anything that is neither a library nor the harness) makes it the
  code's. A **forwarding** frame, harness code that hands the zeroer's own call on unchanged
  (the interception passing a torch call through, marked with :func:`forwarding`), makes it the
  zeroer's too: the library refused the zeroer's call. Any other **harness** frame makes it the
  harness's;
* a **CUDA error** the runtime raises where CUDA (torch) refuses a call for the state its
  arguments are in (``start.elapsed_time(end)`` with the end event still queued:
  :class:`kvdevice.runtime.cuda_errors.CudaStateError`, marked ``refused_by_cuda``) is raised in the
  runtime's frames, so the first rule would call it the harness's. It is whoever called the
  runtime's: the code's, when the frame outside the runtime's is the code's own or a forwarding
  stand-in handing the code's call on (``torch.cuda.Event.elapsed_time``): on a GPU, CUDA raises it
  at that very call. Called from any other harness frame, it is the harness's (exit status 3);
* one case the traceback cannot show: an ``AttributeError`` raised in the zeroer's line about an
  object the harness put there is the harness's: a gap of a stand-in for torch's (a stream, an
  event: :func:`stand_in`), or an attribute the documented KV cache does not have (:func:`documented`).

Of a harness error, :func:`blame` also says whether the user can act on it (a refusal that names
the fix, such as an unroutable call: exit status 2) or it is a bug of ours (exit status 3), and
where in the zeroer's code the call was (the innermost zeroer frame), for the one-line message.

Example::

    try:
        zeroer.zero_block_ids([1, 2])
    except Exception as error:
        verdict = blame(error)
        verdict.harness, verdict.status, verdict.where   # False, None, 'my_zeroer.py:41 (...)'
"""

from __future__ import annotations

import linecache
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from racecheck.errors import KvzeroError

# Module name prefixes of the harness; everything of this distribution that is not a zeroer.
HARNESS_MODULES = ("zeroer", "kvdevice", "fuzz", "repro", "kvzero_fuzz", "racecheck", "sanitizer")
# The runtime, which raises CUDA's errors on behalf of whoever called it (a refused elapsed_time).
RUNTIME_MODULE = "kvdevice.runtime"
# This distribution's zeroers: the built-in designs, the zoo and the kernel they launch.
ZEROER_MODULES = ("zeroer.designs", "zeroer.zoo", "zeroer.kernel")
LIBRARIES = frozenset({
    "torch", "triton", "numpy", "hypothesis", "_pytest", "pytest", "pluggy", "xdist", "execnet", "sympy",
    "typing_extensions", "_hypothesis_ftz_detector", "_frozen_importlib", "_frozen_importlib_external",
}) | frozenset(getattr(sys, "stdlib_module_names", ()))

USER_FIXABLE = 2  # the harness refused something and said how to do it instead
HARNESS_BUG = 3  # the harness failed: a bug of kvzero-fuzz

_FORWARDING: set[types.CodeType] = set()
_STAND_INS: list[type] = []
_DOCUMENTED: list[type] = []

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)


def forwarding(function: F) -> F:
    """Mark ``function`` as harness code that hands the zeroer's own call on unchanged: an
    exception a library raises under it is the zeroer's."""
    _FORWARDING.add(function.__code__)
    return function


def stand_in(cls: C) -> C:
    """Mark ``cls`` as an object the harness hands the zeroer in place of torch's (a stream, an
    event): an attribute it lacks is the harness's gap (exit status 3)."""
    _STAND_INS.append(cls)
    return cls


def documented(cls: C) -> C:
    """Mark ``cls`` as an object of the harness's documented API that the zeroer is handed (the
    KV cache): an attribute it lacks is the user's to fix (exit status 2)."""
    _DOCUMENTED.append(cls)
    return cls


@dataclass(frozen=True)
class Blame:
    """Whose an exception is. ``harness``: the harness's (then ``status`` is 2 or 3);
    ``where``: the zeroer's line the call came from (``file:line (code)``), or None."""

    harness: bool
    status: int | None
    where: str | None


def _module(frame: types.FrameType) -> str:
    return str(frame.f_globals.get("__name__", "") or "")


def _kind(frame: types.FrameType) -> str:
    """``library``, ``forwarding``, ``harness`` or ``code`` (the code under test's)."""
    if frame.f_code in _FORWARDING:
        return "forwarding"
    module = _module(frame)
    top = module.split(".")[0]
    if top in LIBRARIES or module.startswith("<"):
        return "library"
    if top in HARNESS_MODULES and not any(module == z or module.startswith(z + ".") for z in ZEROER_MODULES):
        return "harness"
    return "code"


def describe_frame(frame: types.FrameType, line: int) -> str:
    """``path/file.py:41 (the line's code)``: where a user reads it (relative to the working
    directory when it lies below it)."""
    path = frame.f_code.co_filename
    source = linecache.getline(path, line).strip().rstrip("([{ ")  # a call spread over lines: its first, unbracketed
    try:
        path = Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except (ValueError, OSError):
        pass
    return f"{path}:{line}" + (f" ({source})" if source else "")


def blame(error: BaseException) -> Blame:
    """Whose ``error`` is (see the module docstring)."""
    frames = list(traceback.walk_tb(error.__traceback__))  # (frame, line), outermost first
    kinds = [_kind(frame) for frame, _ in frames]
    decisive = next((i for i in range(len(frames) - 1, -1, -1) if kinds[i] != "library"), None)
    code_frames = [i for i, kind in enumerate(kinds) if kind == "code"]
    where_index = max((i for i in code_frames if decisive is None or i <= decisive), default=None)
    where = describe_frame(*frames[where_index]) if where_index is not None else None
    # a library called from outside any frame we know, or forwarding the zeroer's own call: the zeroer's
    if decisive is None or kinds[decisive] == "forwarding":
        return Blame(False, None, where)
    if getattr(error, "refused_by_cuda", False) and _called_by_the_code(frames, kinds, decisive):
        return Blame(False, None, where)
    if kinds[decisive] == "code":
        owner = getattr(error, "obj", None) if isinstance(error, AttributeError) else None
        if isinstance(owner, tuple(_DOCUMENTED)):
            return Blame(True, USER_FIXABLE, where)
        if isinstance(owner, tuple(_STAND_INS)):
            return Blame(True, HARNESS_BUG, where)
        return Blame(False, None, where)
    return Blame(True, _status(error, frames, kinds, decisive), where)


def _called_by_the_code(frames: list, kinds: list[str], decisive: int) -> bool:
    """Whether the runtime call that raised at ``decisive`` was the code's: the first frame outside
    the runtime's own (and the libraries') is the code's, or a forwarding stand-in of its call."""
    outer = decisive
    while outer >= 0 and (kinds[outer] == "library" or (
            kinds[outer] == "harness" and _module(frames[outer][0]).startswith(RUNTIME_MODULE + "."))):
        outer -= 1
    return outer >= 0 and outer < decisive and kinds[outer] in ("code", "forwarding")


def _status(error: BaseException, frames: list, kinds: list[str], decisive: int) -> int:
    """2 for a refusal that names its fix, or a runtime-API zeroer misusing the runtime it
    called itself; 3 for everything else, which is a bug of ours."""
    if getattr(error, "user_fixable", False):  # a refusal that names its fix (zeroer.errors.ZeroerError)
        return USER_FIXABLE
    if isinstance(error, KvzeroError):
        # The harness frames between the zeroer's call and the raise: all the runtime's means the
        # zeroer called the runtime itself and passed it something wrong.
        start = decisive
        while start > 0 and kinds[start - 1] in ("harness", "library"):
            start -= 1
        chain = [_module(frames[i][0]) for i in range(start, decisive + 1) if kinds[i] == "harness"]
        if start > 0 and kinds[start - 1] == "code" and chain and all(m.startswith(RUNTIME_MODULE) for m in chain):
            return USER_FIXABLE
    return HARNESS_BUG
