"""The zeroer designs under test: the upstream ones and ours (each module's docstring says which).

Most are written once against the stream runtime (:mod:`kvdevice.runtime`), so the simulator and the
happens-before checker run them: ``single_buffer`` and ``ring`` (vLLM before and at #48085, racy),
``per_call`` (#48399), ``event_ring`` (ours) and ``reference`` (the differential baseline).
``torch_per_call`` and ``graph_ring``'s CUDA form are written straight against torch.cuda and the
CUDA driver, as an engine ships them; graph_ring's slot protocol also runs on the runtime
(:mod:`zeroer.designs.modelled_graph_ring`), so it is fuzzed on every backend.
"""

from zeroer.designs.common import KERNELS, StagedZeroer, validate_block_ids, zero_blocks_torch
from zeroer.designs.event_ring import EventRingZeroer
from zeroer.designs.graph_ring import GraphRingZeroer, make_graph_ring
from zeroer.designs.graph_ring_protocol import GraphRingProtocol
from zeroer.designs.modelled_graph_ring import ModelledGraphRing
from zeroer.designs.per_call import PerCallZeroer
from zeroer.designs.reference import ReferenceZeroer
from zeroer.designs.ring import RingZeroer
from zeroer.designs.single_buffer import SingleBufferZeroer
from zeroer.designs.torch_per_call import TorchPerCallZeroer

__all__ = [
    "KERNELS",
    "EventRingZeroer",
    "GraphRingProtocol",
    "GraphRingZeroer",
    "ModelledGraphRing",
    "PerCallZeroer",
    "ReferenceZeroer",
    "RingZeroer",
    "SingleBufferZeroer",
    "StagedZeroer",
    "TorchPerCallZeroer",
    "make_graph_ring",
    "validate_block_ids",
    "zero_blocks_torch",
]
