"""What makes two findings the same bug: a signature that every trace of the bug shares.

Campaigns of one zeroer (its geometries, seed shards, the two-zeroer ``x2`` campaign, the cuda
modes) usually find the same race, each in a different program: other blocks, other streams,
other call numbers. A finding's :class:`Signature` keeps what the bug is and drops what the
program happened to do:

* **kept**: the finding's kind; the zeroer (as named, without the checkout's location); the
  caller fault of a caller-fault campaign; and *where in the zeroer* it showed, as far as the
  finding records it:

  - a **hazard** names the zeroer's two conflicting operations and the zeroer's code between
    them (``the host code of <zeroer>.zero_block_ids between the start of the call and
    Tensor.copy_``), the resource they share (``pinned host buffer pN of the zeroer``), the op
    kinds (``copy_ (h2d)``, ``triton _zero_kv_blocks_kernel``, ``poison (free_block)``) and
    whether a stream is the caller's or the zeroer's own;
  - a **zeroer raised** finding: the call that raised, the exception's type and the ``file:line``
    of the zeroer's frame it came from (:func:`kvdevice.origin.blame`);
  - a **cuda error** finding: the call of the code under test, CUDA's call it made and the state
    CUDA refused it in (``get_finished(): elapsed_time on an end event that had not completed``),
    torch's words, and the ``file:line`` it came from;
  - a **value** finding (``non-zero after zeroing``, ``clobbered``, a ``stray write`` to a block
    or a guard word) records no place in the zeroer's code, only what was observed: the expected
    and observed words' classes (``expected 0 (zeroed), observed NaN poison``) or which guard
    word changed. It is only the same bug **on the same geometry**, so the geometry is kept too:
    two geometries that both leave a block unzeroed may be two different bugs;

* **dropped**: step and call numbers (``#4``), block ids and id lists (``([2, 3])``), buffer and
  block numbers (``p1``, ``d9``, ``block 7``), addresses, ring slots, word positions, the names
  of the caller's streams (``main``, ``s1``, ``s2``: which one is the program's choice), and which
  of several zeroer instances it was when only one takes part (an ``x2`` campaign's race within
  one instance is the single campaign's race; a race between two instances keeps them apart as
  ``[A]`` and ``[B]``).

A violation's signature is that of its first finding, the one the fuzzer stopped at and the one
:func:`~fuzz.engine.minimize.minimize` keeps. Too fine a signature only costs a second shrink of
the same bug; too coarse a one would hide a bug behind another, so when in doubt a detail stays.

Standard library only: reports and merges read signatures without torch.

Example::

    sig = violation_signature(violation)
    str(sig)   # 'hazard | single_buffer | host write to pinned host buffer N by single_buffer.zero_block_ids while ...'
    sig.key    # 16 hex digits: the bug's id in a summary, its file name in the run's registry
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuzz.engine.bugs import bug_id
from fuzz.engine.component import COMPONENT_KINDS  # standard library only, too
from fuzz.engine.cuda_error import CUDA_ERROR  # standard library only, too
from fuzz.engine.violation import ZeroerViolation  # standard library only: reports read signatures without torch

VALUE_KINDS = ("non-zero after zeroing", "clobbered", "stray write",
               "wrong bytes loaded", "transfer not done", "slot clobbered")  # the last three: an offloader's
RAISED_KINDS = ("zeroer raised", *(f"{kind} raised" for kind in COMPONENT_KINDS))  # the code under test raised (its call, its queued op)
CALLER_STREAM = re.compile(r"stream '(?:main|s\d+)'")  # fuzz.engine.episode names the caller's streams so


@dataclass(frozen=True)
class Signature:
    """A finding with everything trace-specific taken out (see the module docstring)."""

    kind: str
    zeroer: str  # the spec as named, a file's factory by its file name
    site: str  # where and how it showed
    caller_fault: str | None = None
    geometry: str | None = None  # value findings only: they record no place in the zeroer's code

    def __str__(self) -> str:
        parts = [self.kind, self.zeroer]
        if self.caller_fault:
            parts.append(f"caller fault {self.caller_fault}")
        if self.geometry:
            parts.append(f"on {self.geometry}")
        return " | ".join([*parts, self.site])

    @property
    def key(self) -> str:
        """A short stable name for the signature: the bug's id in a summary, its file name in the
        run's registry."""
        return bug_id(str(self))


def zeroer_label(spec: str) -> str:
    """The zeroer as named, without where the checkout lies: a file's factory by its file name.

    >>> zeroer_label("/home/me/engine/zeroers.py:make")
    'zeroers.py:make'
    >>> zeroer_label("zoo.stale_table")
    'zoo.stale_table'
    """
    target, colon, attr = spec.rpartition(":")
    if colon and target.endswith(".py"):
        return f"{Path(target).name}:{attr}"
    return spec


def finding_signature(finding: Any, *, zeroer: str, geometry: str, caller_fault: str | None = None) -> Signature:
    """The signature of ``finding`` (a :class:`~fuzz.engine.oracle.Finding`, or a finding as a
    trace file stores it) made by zeroer ``zeroer`` (the spec as given) on ``geometry``."""
    kind, message, where = (_field(finding, name) for name in ("kind", "message", "where"))
    label = zeroer_label(zeroer)
    text = message.replace(zeroer, label) if zeroer != label else message
    if kind in RAISED_KINDS:
        site = _raised_site(text, where)
    elif kind == CUDA_ERROR:
        site = _cuda_error_site(text, where)
    elif kind in VALUE_KINDS:
        return Signature(kind, label, _value_site(text), caller_fault, geometry)
    else:  # a hazard, an illegal address, or a kind this module does not know: its words, normalised
        site = _normalise(re.sub(r"^hazard at step \d+: ", "", text))
        site = site.split(": no event or synchronisation observed by the host", 1)[0]  # the #48085 hazard's fixed tail
    return Signature(kind, label, site, caller_fault)


def violation_signature(violation: ZeroerViolation) -> Signature | None:
    """The signature of a :class:`~fuzz.engine.violation.ZeroerViolation`: its first finding's
    (None without findings)."""
    if not violation.findings:
        return None
    config = violation.config
    under_test = getattr(config, "offloader", None) or config.zeroer  # an offload campaign's: its offloader
    return finding_signature(violation.findings[0], zeroer=under_test, geometry=config.geometry,
                             caller_fault=config.caller_fault)


def _field(finding: Any, name: str) -> str:
    value = finding.get(name) if isinstance(finding, Mapping) else getattr(finding, name, "")
    return str(value or "")


def _normalise(text: str) -> str:
    """``text`` without the numbers, ids and names that change from one trace to another."""
    text = _instances(text)
    text = re.sub(r"\(\[[^\]]*\]\)", "", text)  # the ids of a zero call: ([2, 3])
    text = CALLER_STREAM.sub("a caller stream", text)
    text = re.sub(r"\(step \d+ ", "(", text)  # a caller op: (step 9 free_block)
    text = re.sub(r"(?<=[\w)])#\d+", "", text)  # call and op numbers: zero_block_ids#4, copy_ (h2d)#6
    text = re.sub(r"0x[0-9a-fA-F]+", "0x?", text)  # addresses and words
    text = re.sub(r"\b([pd])\d+\b", r"\1N", text)  # pinned buffer p1, device block d9
    text = re.sub(r"(?<![\w#])\d+(?!\w)", "N", text)  # block 7, host buffer 2, slot 1, zeroer-1
    return " ".join(text.split())


def _instances(text: str) -> str:
    """Zeroer instances (``spec[1].zero_block_ids``, ``of zeroer 1``, stream ``zeroer[1]-2``)
    named by their order of appearance; dropped when only one takes part."""
    patterns = (r"\[(\d+)\](?=\.)", r"\bzeroer (\d+)\b", r"\bzeroer\[(\d+)\](?=-)")
    matches = sorted((m for p in patterns for m in re.finditer(p, text)), key=lambda m: m.start())
    seen = list(dict.fromkeys(m.group(1) for m in matches))  # in order of first appearance
    if not seen:
        return text
    names = {index: ("" if len(seen) == 1 else chr(ord("A") + position)) for position, index in enumerate(seen)}

    def bracketed(match: re.Match) -> str:
        name = names[match.group(1)]
        return f"[{name}]" if name else ""

    text = re.sub(patterns[0], bracketed, text)
    text = re.sub(patterns[2], lambda m: "zeroer" + bracketed(m), text)
    return re.sub(patterns[1], lambda m: f"zeroer {names[m.group(1)]}" if names[m.group(1)] else "the zeroer", text)


def _word_class(description: str) -> str:
    """``NaN poison`` of ``NaN poison: stale bytes never zeroed``; ``stamp`` of ``stamp of owner
    1, write 2``."""
    head = re.split(r"[:,]", description, maxsplit=1)[0].strip()
    return re.sub(r" of owner \d+$", "", head)


def _value_site(message: str) -> str:
    words = re.search(r"expected \S+ \(([^)]*)\), observed \S+ \(([^)]*)\)", message)
    if words:
        return f"expected {_word_class(words.group(1))}, observed {_word_class(words.group(2))}"
    guard = re.search(r": word \d+ \(([^)]*)\) is ", message)  # KVCache.guard_violations
    if guard:
        return f"guard or padding word changed: {_normalise(guard.group(1))}"
    return _normalise(re.sub(r"^(cache \d+: )?", "", message))


def _raised_site(message: str, where: str) -> str:
    raised = re.match(r"(?:zeroer|offloader) raised at step \d+ in (?:cache \d+: )?(?P<what>.+?): (?P<type>[A-Za-z_]\w*): ",
                      message + ": ")
    if raised is None:
        return _normalise(message)
    what = re.sub(r"\(.*\)$", "", raised.group("what"))  # zero_block_ids([1, 2]) -> zero_block_ids
    location = where.split(" (", 1)[0]  # kvdevice.origin's "file:line (code)"
    return f"{what} raised {raised.group('type')}" + (f" at {location}" if location else "")


def _cuda_error_site(message: str, where: str) -> str:
    """``get_finished(): elapsed_time on an end event that had not completed: ... (RuntimeError: ...)
    at file.py:363``: fuzz.engine.cuda_error's words without the step and the call's arguments."""
    location = where.split(" (", 1)[0]
    text = re.sub(r"^cuda error at step \d+ in (the \w+'s )(?:cache \d+: )?", r"\1", message)  # which cache: the program's
    if location:
        text = text.replace(f" at {location}: ", ": ", 1)
    call, _, rest = text.partition(": ")
    call = re.sub(r"\(.*\)$", "", call)  # transfer_async(2, (GPU[1], CPU[1])) -> transfer_async
    return f"{call}: {_normalise(rest)}" + (f" at {location}" if location else "")
