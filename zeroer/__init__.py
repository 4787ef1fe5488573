"""Zeroers, the KV-cache layout and the zero kernel, and the offloader protocol (docs/zeroer-api.md).

The device layer they run on (the stream runtime, the simulator, the interception) is
:mod:`kvdevice`; ``zeroer.runtime`` re-exports its runtime under the name the docs first gave it.
"""

__distribution__ = "kvzero-fuzz"  # checked by kvzero_fuzz.shadowing: the name is generic
