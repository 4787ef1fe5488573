"""Keeping torch.compile out of the sanitizer's own frames, without paying for it when unused.

The sanitizer's dispatch modes are :class:`racecheck.lazy_dynamo.LazyDynamoMode` modes: no
``torch._dynamo`` import (seconds) and no guard on every op (microseconds) until the program imports
it to ``torch.compile``; from the first op after that import, every mode of the sanitizer (a
:class:`SanitizerMode`) is wrapped as torch wraps modes by default (``torch._disable_dynamo``).

Example::

    class MyMode(SanitizerMode):
        def on_dispatch(self, func, args, kwargs):    # every op, kwargs always a dict
            return func(*args, **kwargs)
"""

from __future__ import annotations

from typing import Any

from racecheck.lazy_dynamo import LazyDynamoMode, guard_once_dynamo_loaded
from kvdevice.origin import forwarding


class SanitizerMode(LazyDynamoMode):
    """A dispatch mode of the sanitizer's (see the module docstring)."""

    @forwarding  # the program's own call, handed on: what torch raises under it is the program's
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        guard_once_dynamo_loaded(SanitizerMode)
        return self.on_dispatch(func, args, kwargs or {})

    def on_dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError
