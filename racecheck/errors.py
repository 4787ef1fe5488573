"""The errors the shared core raises on purpose, and the base of every error the tools raise so.

They live here, at the bottom, so that the core imports nothing above it; :mod:`zeroer.errors`
builds the zeroer's own errors on them (``ZeroerError`` is :class:`KvzeroError`), so a caller
that catches one catches the other.
"""

from __future__ import annotations


class KvzeroError(Exception):
    """Base class of every error this project raises on purpose.

    ``user_fixable``: raised by the harness to refuse something the user can change (a bad
    declaration, an unroutable call), with the fix in its message: a harness error of exit
    status 2, never a finding (kvdevice.origin).
    """

    user_fixable = False


class RuntimeUsageError(KvzeroError, ValueError):
    """A runtime call with arguments that do not make sense (unknown stream, wrong device...)."""


class DeadlockError(KvzeroError, RuntimeError):
    """A host synchronisation that can never be satisfied: the work it needs is held."""


__all__ = ["DeadlockError", "KvzeroError", "RuntimeUsageError"]
