"""What a result was measured on, as the fuzzer's scripts import it.

Both tools share it from :mod:`racecheck.environment`; this name stays for the standalone scripts
``python -m repro export`` writes (``from fuzz.environment import describe, environment``), so a
script exported before keeps running.
"""

from __future__ import annotations

from racecheck.environment import describe, environment

__all__ = ["describe", "environment"]
