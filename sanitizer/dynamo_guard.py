"""Keeping torch.compile out of the sanitizer's own frames, without paying for it when unused.

The sanitizer's dispatch modes opt out of torch's dynamo hook (``_should_skip_dynamo``): that saves
importing ``torch._dynamo`` (seconds) and a guard on every op (microseconds). But once a program
imports it to ``torch.compile``, dynamo would trace a mode's handler whenever an op runs inside a
compiled region (seen on torch 2.13: dozens of the sanitizer's frames compiled for one small
function). From the first op after that import, every mode of the sanitizer (a :class:`SanitizerMode`)
is wrapped as torch wraps modes by default (``torch._disable_dynamo``).

Example::

    class MyMode(SanitizerMode):
        def on_dispatch(self, func, args, kwargs):    # every op, kwargs always a dict
            return func(*args, **kwargs)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zeroer.origin import forwarding


class SanitizerMode(TorchDispatchMode):
    """A dispatch mode of the sanitizer's (see the module docstring)."""

    guarded = False  # whether __torch_dispatch__ is wrapped by torch._disable_dynamo yet

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._dynamo import, no per-op dynamo guard (module docstring)

    @forwarding  # the program's own call, handed on: what torch raises under it is the program's
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not SanitizerMode.guarded and "torch._dynamo" in sys.modules:
            SanitizerMode.guarded = True
            # Wrap the unwrapped handler: two threads here at once wrap it alike, never twice.
            SanitizerMode.__torch_dispatch__ = torch._disable_dynamo(_UNGUARDED, recursive=True)  # type: ignore[method-assign]
        return self.on_dispatch(func, args, kwargs or {})

    def on_dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError


_UNGUARDED = SanitizerMode.__dict__["__torch_dispatch__"]
