"""The oracle: a shadow model of every block and the checks that judge a zeroer by it.

Each logical block is ``free`` or ``live`` and has one expected int32 word for all of its pages
in every segment: ``0`` once zeroed, its owner's stamp once written, the NaN poison once freed
(fp32 Mamba state left behind, the reason vLLM zeroes at all, #35219). Because the harness keeps
every promise of the caller (the contract, docs/contract.md), program order fixes the
value every read must see, so any other value is the zeroer's fault:

* **non-zero after zeroing**: a block read (or found at the end) with anything but zeros after it
  was zeroed and before it was written;
* **clobbered**: a live block whose contents changed without a write of its owner (zeroed again,
  or stamped by someone else);
* **stray write**: a free block that lost its poison, or a guard/padding word that changed;
* **hazard**: every finding of the runtime's happens-before checker.

Reads are captured on the device and compared after the episode's one final synchronisation, so
checking does not serialise the streams.

Example::

    shadow = Shadow(num_blocks=8)
    shadow.zeroed(3, "step 2: allocate_blocks -> zero_block_ids#1")
    finding = shadow.verify(3, observed_segments, where="read#4")
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zeroer.cache.layout import GUARD_WORD, POISON_WORD

ZERO = 0
STAMP_BASE = 0x10000000  # stamps are positive and never 0, the poison or the guard word


def stamp(owner: int, generation: int) -> int:
    """The word a write of ``owner``'s ``generation`` puts in every page word of its block."""
    return STAMP_BASE + (owner % (1 << 20)) * 256 + generation % 256


def describe_word(word: int) -> str:
    """A person's reading of an int32 word found in a page."""
    word = int(word)
    if word == ZERO:
        return "0 (zeroed)"
    if word == POISON_WORD:
        return "0xffffffff (NaN poison: stale bytes never zeroed)"
    if word == GUARD_WORD:
        return f"{word:#010x} (guard sentinel)"
    if STAMP_BASE <= word < STAMP_BASE + (1 << 28):
        owner, generation = divmod(word - STAMP_BASE, 256)
        return f"{word:#010x} (stamp of owner {owner}, write {generation})"
    return f"{word & 0xFFFFFFFF:#010x} (unknown)"


@dataclass
class BlockShadow:
    state: str = "free"  # "free" | "live"
    expect: int = POISON_WORD
    owner: int = 0
    generation: int = 0
    history: list[str] = field(default_factory=list)  # what the program did to it, in order


@dataclass(frozen=True)
class Finding:
    kind: str  # "non-zero after zeroing" | "clobbered" | "stray write" | "hazard" | "zeroer raised" | "offloader raised" | "cuda error"
    block: int | None
    message: str
    caller_fault: bool = False
    details: str = ""  # "zeroer raised", "offloader raised" or "cuda error": the exception's traceback
    where: str = ""  # "... raised", "cuda error": the line of the code under test it came from, "file:line (code)" (kvdevice.origin.blame)
    step: int | None = None  # the step (1-based op of the trace) it was found at; None: at the episode's end
    stream: int | None = None  # a read's verdict: the stream the read ran on (with ``step``, which read it was)

    def __str__(self) -> str:
        prefix = "[caller fault] " if self.caller_fault else ""
        return prefix + self.message


def all_rows_match(segments: list[torch.Tensor], expect: list[int]) -> bool:
    """Whether row ``i`` of every segment tensor holds only the word ``expect[i]``.

    Each tensor is ``(len(expect), words)``, e.g. ``KVCache.pages(seg)``. A cheap yes-or-no on
    every block or read at once; :meth:`Shadow.verify` then finds and phrases what differs.
    """
    column = None
    for words in segments:
        if column is None or column.device != words.device:
            column = torch.tensor(expect, dtype=torch.int32, device=words.device).unsqueeze(1)
        if words.dtype != torch.int32 or not torch.equal(words, column.expand_as(words)):
            return False
    return True


class Shadow:
    """The expected contents of every block, and the verdict on what was observed."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [BlockShadow() for _ in range(num_blocks)]
        self.blocks[0] = BlockShadow(state="null", expect=ZERO, history=["warm-up zeroed the null block 0"])

    def zeroed(self, block: int, owner: int, note: str) -> None:
        self.loading(block, owner, ZERO, note)
        self.blocks[block].state = "live"

    def written(self, block: int, note: str) -> int:
        shadow = self.blocks[block]
        shadow.generation += 1
        shadow.expect = stamp(shadow.owner, shadow.generation)
        shadow.history.append(note)
        return shadow.expect

    def loading(self, block: int, owner: int, expect: int, note: str) -> None:
        """A component fills ``block`` with ``expect`` (an offloader's load), not to be used before it reports."""
        shadow = self.blocks[block]
        shadow.state, shadow.expect, shadow.owner, shadow.generation = "loading", expect, owner, 0
        shadow.history.append(note)

    def loaded(self, block: int, note: str) -> None:
        """The load into ``block`` was reported finished: the caller's to use."""
        shadow = self.blocks[block]
        shadow.state = "live"
        shadow.history.append(note)

    def noted(self, block: int, note: str) -> None:
        """Something the code under test did with ``block``, for its history (a store out of it)."""
        self.blocks[block].history.append(note)

    def freed(self, block: int, note: str) -> None:
        shadow = self.blocks[block]
        shadow.state, shadow.expect = "free", POISON_WORD
        shadow.history.append(note)

    @staticmethod
    def verify(
        block: int, expect: int, segments: list[torch.Tensor], where: str, history: list[str],
        *, kind: str | None = None, noun: str = "block",
    ) -> Finding | None:
        """Compare the words observed for ``block`` (one tensor per segment) with ``expect``;
        ``kind`` names the finding instead of the class of the difference, ``noun`` what was read
        (``host slot`` for an offloader's pool)."""
        for seg, words in enumerate(segments):
            bad = (words != expect).nonzero()
            if bad.numel() == 0:
                continue
            index = int(bad[0])
            observed = int(words[index])
            found = kind or Shadow._classify(expect, observed)
            story = "; ".join(history[-4:]) or "no recorded history"
            message = (
                f"{found}: {noun} {block}, segment {seg}, word {index} ({bad.numel()} of "
                f"{words.numel()} words differ) at {where}: expected {describe_word(expect)}, "
                f"observed {describe_word(observed)}. History: {story}"
            )
            return Finding(found, block if noun == "block" else None, message)
        return None

    @staticmethod
    def _classify(expect: int, observed: int) -> str:
        if expect == ZERO:
            return "non-zero after zeroing"
        if expect == POISON_WORD:
            return "stray write"
        return "clobbered"
