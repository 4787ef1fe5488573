"""Zeroers, the stream runtime, the KV-cache layout and the zero kernel (docs/zeroer-api.md)."""

__distribution__ = "kvzero-fuzz"  # checked by kvzero_fuzz.shadowing: the name is generic
