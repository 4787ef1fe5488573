"""The project's small error hierarchy.

Every message names the bad value and says what would be valid, so a user can fix the
input without reading our code (see docs/contract.md for the messages a zeroer raises).
"""

from __future__ import annotations


class ZeroerError(Exception):
    """Base class of every error this package raises on purpose.

    ``user_fixable``: raised by the harness to refuse something the user can change (a bad
    declaration, an unroutable call), with the fix in its message: a harness error of exit
    status 2, never a finding (zeroer.origin).
    """

    user_fixable = False


class CacheSpecError(ZeroerError, ValueError):
    """A KV-cache spec that cannot be laid out (for example a page that is not whole int32 words)."""


class RuntimeUsageError(ZeroerError, ValueError):
    """A runtime call with arguments that do not make sense (unknown stream, wrong device...)."""


class DeadlockError(ZeroerError, RuntimeError):
    """A host synchronisation that can never be satisfied: the work it needs is held."""
