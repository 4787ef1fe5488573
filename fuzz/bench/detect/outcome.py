"""What one detection method reports for one zeroer and one seed (``python -m fuzz.bench.detect``).

A *method* is a function ``method(config, budget_s, seed) -> DetectionOutcome``: it looks for a
bug in the zeroer that ``config`` (a :class:`~fuzz.engine.episode.EpisodeConfig`) names for at most
``budget_s`` seconds, with randomness derived from ``seed`` only. The fuzzer is one method
(``fuzz``, :mod:`fuzz.bench.detect.run`); the baselines it is compared against are others
(``fuzz.bench.detect.baselines.METHODS``: ``stress``, ``sanitizer``, ``handwritten``).

Example::

    DetectionOutcome(found=True, seconds=0.05, examples=9, steps=140, trace_len=3,
                     repro="repro/detect/zoo_single_buffer-tiny-0123.json", message="hazard at step 3: ...")
"""

from __future__ import annotations

from dataclasses import dataclass

QUICK = "quick"  # the profile of a quick-profile campaign job, as ``pytest fuzz`` runs it
FUZZ = "fuzz"  # the fuzzer's method, beside the baselines


@dataclass(frozen=True)
class DetectionOutcome:
    found: bool
    seconds: float | None      # wall seconds to the first finding (None if not found)
    examples: int | None       # episodes/iterations run until the first finding (or in total if not found)
    steps: int                 # ops executed in total
    trace_len: int | None      # ops in the reproducing trace (None if not found)
    repro: str | None          # path of a trace file written for the finding, if any
    message: str               # first finding, one line, or "no finding"
    error: str | None = None   # set when the method could not run (e.g. no CUDA)
    replays: int | None = None  # times the shrunk trace was replayed (fuzz method, on a finding)
    reproduced: int | None = None  # how many of those replays showed a finding
    resource_error: bool = False  # the GPU ran out of memory: neither found nor missed
