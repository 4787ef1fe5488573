"""Keeping torch.compile out of the sanitizer's own frames, without paying for it when unused.

The sanitizer's dispatch modes opt out of torch's dynamo hook (``_should_skip_dynamo``): that saves
importing ``torch._dynamo`` (seconds) and a guard on every op (microseconds). But once a program
imports it to ``torch.compile``, dynamo would trace a mode's handler whenever an op runs inside a
compiled region (seen on torch 2.13: dozens of the sanitizer's frames compiled for one small
function). From the first op after that import, every mode registered here is wrapped as torch wraps
modes by default (``torch._disable_dynamo``).

Example::

    GUARD.add(MyMode)                             # at class definition
    if not GUARD.done and "torch._dynamo" in sys.modules:   # first thing in __torch_dispatch__
        GUARD.apply()
"""

from __future__ import annotations

import torch


class DynamoGuard:
    """The modes to wrap, and whether they are (see the module docstring)."""

    def __init__(self, *modes: type) -> None:
        self.modes: list[type] = list(modes)
        self.done = False

    def add(self, mode: type) -> None:
        self.modes.append(mode)
        if self.done:
            self._wrap(mode)

    def apply(self) -> None:
        self.done = True
        for mode in self.modes:
            self._wrap(mode)

    @staticmethod
    def _wrap(mode: type) -> None:
        raw = mode.__dict__["__torch_dispatch__"]
        if not getattr(raw, "_kvz_dynamo_disabled", False):
            wrapped = torch._disable_dynamo(raw, recursive=True)
            wrapped._kvz_dynamo_disabled = True  # type: ignore[attr-defined]
            mode.__torch_dispatch__ = wrapped  # type: ignore[method-assign]


GUARD = DynamoGuard()
