"""Zeroers written straight against torch.cuda and the CUDA driver, as an engine would ship them.

The designs in :mod:`zeroer.impls` go through our runtime, so the simulator and the
happens-before checker can run them; that costs tens of microseconds of Python per call. These
are the production forms, fuzzed on the GPU in the free-running mode and judged by the value
oracle: ``graph_ring`` (ours) and ``torch_per_call`` (vLLM after #48399, the baseline).
graph_ring's slot protocol (:mod:`.ring_protocol`) also runs on our runtime, each graph modelled
as its copy and kernel (:mod:`.modelled_graph_ring`), so the simulator and the controlled cuda
mode fuzz the same protocol code; :func:`make_graph_ring` picks the form from the runtime.
"""

from .graph_ring import GraphRingZeroer, make_graph_ring
from .modelled_graph_ring import ModelledGraphRing
from .per_call import TorchPerCallZeroer
from .ring_protocol import GraphRingProtocol

__all__ = ["GraphRingProtocol", "GraphRingZeroer", "ModelledGraphRing", "TorchPerCallZeroer", "make_graph_ring"]
