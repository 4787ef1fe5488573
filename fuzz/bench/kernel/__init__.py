"""Zeroer performance: the zero kernel's bandwidth against measured ceilings, and the host cost
of every design's ``zero_block_ids`` call (issue 6; docs/performance.md).

Run it on the GPU (one run gives every table, the targets, the JSON and, with matplotlib, the
figures; it stops measuring after ``--max-seconds`` and always writes its JSON)::

    python -m fuzz.bench.kernel --json docs/data/h200-zeroer-bench-$(date +%Y-%m).json --png-dir docs/img

and without one, as CI does, to check that it still runs (no figures)::

    python -m fuzz.bench.kernel --quick

Figures can be drawn later from the JSON, where matplotlib is installed::

    python -m fuzz.bench.kernel plot docs/data/h200-zeroer-bench-2026-12.json --png-dir docs/img

Modules: :mod:`.caches` (the benchmark's KV caches), :mod:`.timing` (how things are timed),
:mod:`.measure` (one function per table), :mod:`.report` (targets, tables, JSON),
:mod:`.plots` (figures), :mod:`.cli` (the command line); :mod:`.scatter` is a separate
command, ``python -m fuzz.bench.kernel.scatter``: what limits the kernel on scattered pages.
"""

from fuzz.bench.kernel.cli import main

__all__ = ["main"]
