"""A race sanitizer for any torch program: pinned staging, host reads and writes, streams, reuse.

The bug class of vLLM #48085 (the host rewrites pinned memory a queued non-blocking copy has not
read yet) is not special to a KV-cache zeroer; this package checks it, and the races beside it, in
any program or test suite (docs/sanitizer.md). It stands on the core the fuzzer shares
(:mod:`racecheck`) and, where there is no GPU, on the fuzzer's simulator (:mod:`kvdevice.intercept`).

* :mod:`.runner`: one sanitized run, whichever backend; :mod:`.__main__`: the command
  (``python -m sanitizer -- python my_script.py``); :mod:`.pytest_plugin`: ``pytest --kvz-sanitize``;
* :mod:`.races`, :mod:`.sites`: what a report says, and the program lines it names;
* the GPU observer, the program's own schedule observed, and force mode's gates;
* the simulator backend: the program's cuda work on kvzero's CPU simulator;
* :mod:`.bench`: the benchmark, its programs and the corpus of the engines' own races.
"""

__distribution__ = "kvzero-fuzz"  # checked by kvzero_fuzz.shadowing
