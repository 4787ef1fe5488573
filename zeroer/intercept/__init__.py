"""Interception of plain torch zeroers (work in progress in this commit: see the next ones)."""

from __future__ import annotations

import contextlib
from typing import Any


def import_scope() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def bind(loaded: Any, cache: Any, runtime: Any, **options: Any) -> Any:
    from zeroer.protocol import BoundZeroer

    return BoundZeroer(loaded.factory(cache, runtime, **options), loaded.spec, loaded.capabilities)
