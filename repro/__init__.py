"""Repro: findings as trace files that replay on the simulator and on CUDA."""

__distribution__ = "kvzero-fuzz"  # checked by kvzero_fuzz.shadowing: other projects have a 'repro' too
