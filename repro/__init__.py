"""Repro: findings as trace files that replay on the simulator and on CUDA."""
