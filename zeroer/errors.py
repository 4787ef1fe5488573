"""The project's small error hierarchy.

Every message names the bad value and says what would be valid, so a user can fix the
input without reading our code (see docs/contract.md for the messages a zeroer raises).
"""

from __future__ import annotations

from racecheck.errors import DeadlockError, KvzeroError, RuntimeUsageError


ZeroerError = KvzeroError  # the base of every error raised on purpose (racecheck.errors, where the core raises its own)


class CacheSpecError(ZeroerError, ValueError):
    """A KV-cache spec that cannot be laid out (for example a page that is not whole int32 words)."""




__all__ = ["CacheSpecError", "DeadlockError", "RuntimeUsageError", "ZeroerError"]
