"""Benchmarks, each with its command line, report and plots:

* ``python -m fuzz.bench.detect``: what the fuzzer finds in the bug zoo, against three baselines;
* ``python -m fuzz.bench.speed``: fuzzer throughput and time to a finding;
* ``python -m fuzz.bench.kernel``: the zero kernel's bandwidth and each design's host cost;
  ``python -m fuzz.bench.kernel.scatter``: what limits it on scattered pages;
* ``python -m fuzz.bench.selfcheck``: every self-check campaign over many seeds.
"""
