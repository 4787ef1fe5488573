"""The zeroer designs, each written once against the runtime (see each module's docstring)."""

from .common import KERNELS, StagedZeroer, Zeroer, validate_block_ids, zero_blocks_torch
from .event_ring import EventRingZeroer
from .per_call import PerCallZeroer
from .reference import ReferenceZeroer
from .ring import RingZeroer
from .single_buffer import SingleBufferZeroer

__all__ = [
    "KERNELS",
    "EventRingZeroer",
    "PerCallZeroer",
    "ReferenceZeroer",
    "RingZeroer",
    "SingleBufferZeroer",
    "StagedZeroer",
    "Zeroer",
    "validate_block_ids",
    "zero_blocks_torch",
]
