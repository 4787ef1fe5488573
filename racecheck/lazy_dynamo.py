"""Dispatch modes that leave ``torch._dynamo`` unimported until the program imports it.

torch wraps every :class:`~torch.utils._python_dispatch.TorchDispatchMode` subclass's handler in
``torch._disable_dynamo``, which imports ``torch._dynamo`` at the mode's first op: 4.5 s on the
H100 image (torch 2.11, where bytecode is not cached), in every process that starts a fuzz campaign
on CUDA, and a guard on every op after it. Nothing in our handlers needs dynamo. But once a program
imports it to ``torch.compile``, dynamo would trace a mode's handler whenever an op runs inside a
compiled region (seen on torch 2.13: dozens of our frames compiled for one small function); so from
the first op after that import, the handler is wrapped as torch wraps it by default.

Example::

    class MyMode(LazyDynamoMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            guard_once_dynamo_loaded(type(self))
            return func(*args, **(kwargs or {}))
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LazyDynamoMode(TorchDispatchMode):
    """A dispatch mode whose handler torch does not wrap for dynamo (see the module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._dynamo import, no per-op dynamo guard (module docstring)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "__torch_dispatch__" in cls.__dict__:
            cls._unguarded_dispatch = cls.__dict__["__torch_dispatch__"]
            cls._dynamo_guarded = False


def guard_once_dynamo_loaded(cls: type) -> None:
    """At the top of a :class:`LazyDynamoMode` handler: once the program has imported
    ``torch._dynamo``, wrap ``cls``'s handler with ``torch._disable_dynamo`` from the next op on."""
    if "torch._dynamo" in sys.modules and not cls._dynamo_guarded:
        owner = next(c for c in cls.__mro__ if "_unguarded_dispatch" in c.__dict__)
        owner._dynamo_guarded = True
        # Two threads here at once wrap the same unwrapped handler: never twice.
        owner.__torch_dispatch__ = torch._disable_dynamo(owner._unguarded_dispatch, recursive=True)
