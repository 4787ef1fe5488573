"""What the code under test asks of the caller that drives it: the caller core's public side.

An episode (:class:`fuzz.engine.episode.Episode`) is the caller: it owns the KV caches and their
blocks, the streams and the fences between them, the shadow that says what each block must hold,
and the findings. The zeroer is driven by the episode itself; an offloader's side
(:class:`fuzz.engine.offload.OffloadSide`) plugs in beside it and reaches the caller only through
the methods :class:`CallerCore` names, so neither module imports the other's internals (and
``fuzz.engine.offload`` does not import ``fuzz.engine.episode`` at all).

A call of the code under test is labelled in reports by what it is: ``the zeroer's zero_block_ids
([3])`` or, for an offloader, :data:`OFFLOADER_CALL` followed by the call (``the offloader's
store(2, [1], [1])``); a finding raised there is filed as ``zeroer raised`` or ``offloader raised``
accordingly.
"""

from __future__ import annotations

from typing import Any, Protocol

OFFLOADER_CALL = "the offloader's "  # the prefix of an offloader's call in reports and findings


class CallerCore(Protocol):
    """The caller's methods a component uses (an :class:`~fuzz.engine.episode.Episode` provides them)."""

    config: Any
    rt: Any  # the runtime: streams, events, the happens-before checker
    groups: list[Any]  # the KV caches, each with its blocks' shadow and last accesses
    owners: int  # allocations made so far: a block's owner tag
    step: int

    def stream_of(self, index: int) -> Any:
        """The runtime stream the episode calls ``index``."""

    def note(self, text: str) -> str:
        """``text`` placed at the current step, for a finding's history."""

    def component_call(self, group: Any, what: str) -> Any:
        """A context for one call of the code under test (``what`` names it): what it raises is its finding."""

    def factory_call(self, component: str, spec: str, signature: str) -> Any:
        """A context for building a component: a factory that raises is a usage error, never a finding."""

    def order_before(self, group: Any, block: int, stream: int, skip_kinds: tuple[str, ...] = ()) -> None:
        """Make ``stream`` wait for the last access to ``block`` of ``group`` on another stream."""

    def device_work(self, fn: Any, *args: Any) -> Any:
        """Run a runtime call that may execute queued device work of the code under test."""

    def hand_out(self, group: Any, stream: int, *, oldest: bool = False) -> int:
        """A free block for the component to fill on ``stream``, its last tenant ordered before it."""

    def check_live(self, group: Any, block: int, what: str) -> None:
        """Raise the caller's usage error unless ``block`` is allocated and live."""

    def read_capture(self, group: Any, block: int, stream: int, where: str, kind: str | None = None) -> None:
        """Read ``block`` on ``stream`` and keep what it saw for the oracle's verdict."""


__all__ = ["OFFLOADER_CALL", "CallerCore"]
