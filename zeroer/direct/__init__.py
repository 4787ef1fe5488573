"""Zeroers written straight against torch.cuda and the CUDA driver, as an engine would ship them.

The designs in :mod:`zeroer.impls` go through our runtime, so the simulator and the
happens-before checker can run them; that costs tens of microseconds of Python per call. These
are the production forms, cuda only, fuzzed in the free-running mode and judged by the value
oracle: ``graph_ring`` (ours) and ``torch_per_call`` (vLLM after #48399, the baseline).
"""

from .graph_ring import GraphRingZeroer
from .per_call import TorchPerCallZeroer

__all__ = ["GraphRingZeroer", "TorchPerCallZeroer"]
