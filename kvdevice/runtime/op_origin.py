"""Whose code queued a device op, and in which of its calls: an op's structured origin.

A queued op that raises when it runs (on the simulator an op runs lazily, at a later
synchronisation of the caller's) is judged by whose it is: an op of the code under test is a
finding, one of the harness's own (the caller's writes and reads, a zeroer that is not under test)
is our error. The label an op carries in reports (``copy#12 on stream 's1' (spec.store#3([1]))``)
is text for people; the code under test names its own kernels and annotations, so a label says
nothing reliable about who queued the op. Each op carries an :class:`OpOrigin` instead:

* ``owner``: whose code queued it. The caller that drives the code under test says so around each
  call of it (``Runtime.annotate(owner="offloader")``); annotations inside, the code's own
  (``rt.annotate("reference.zero_block_ids#3([1])")``) or the interception's, keep it. The names are
  those of the code's kind (``"zeroer"``, ``"offloader"``: fuzz.engine.component.COMPONENT_KINDS),
  :data:`HARNESS` for the harness's own ops and :data:`PROGRAM` for a program the sanitizer runs;
  None where nobody said.
* ``call``: the call the op belongs to, as its label shows it (``spec.zero_block_ids#3([1])``).

A runtime that runs an op which raises marks the error with the op (:func:`mark_failed`), and
whoever judges the error reads it back (:func:`failed_op`); the ``while running ...`` note the
error also gets is for people.

Example::

    rt = make_runtime("sim")
    with rt.annotate(owner="zeroer"), rt.annotate("my.zero_block_ids#1([3])"):
        rt.launch(lambda: 1 / 0, name="write")      # a label that looks like the caller's own op
    try:
        rt.synchronize()
    except ZeroDivisionError as error:
        failed_op(error).origin                     # OpOrigin(owner='zeroer', call='my.zero_block_ids#1([3])')
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["HARNESS", "PROGRAM", "FailedOp", "OpOrigin", "failed_op", "mark_failed"]

HARNESS = "harness"  # the harness's own ops: the caller's writes, reads and poison, a zeroer not under test
PROGRAM = "program"  # a program the sanitizer runs


class OpOrigin(NamedTuple):
    """Whose code queued an op (``owner``) and in which call (``call``, as labels show it).

    A tuple, not a dataclass: one is built each time an annotation is entered, which is every zero
    call and every fuzzer op."""

    owner: str | None
    call: str | None


class FailedOp(NamedTuple):
    """The queued op an error was raised in: its label (for messages) and its origin (for blame)."""

    label: str
    origin: OpOrigin | None


_ATTRIBUTE = "_kvdevice_failed_op"  # every exception has a __dict__ (add_note keeps __notes__ there too)


def mark_failed(error: BaseException, label: str, origin: OpOrigin | None) -> None:
    """Say that ``error`` was raised while the queued op ``label`` of ``origin`` ran. The innermost
    op wins: an op that synchronises inside itself marks the error first."""
    if getattr(error, _ATTRIBUTE, None) is None:
        setattr(error, _ATTRIBUTE, FailedOp(label, origin))


def failed_op(error: BaseException) -> FailedOp | None:
    """The queued op ``error`` was raised in (:func:`mark_failed`), or None when it was not raised
    by one."""
    return getattr(error, _ATTRIBUTE, None)
