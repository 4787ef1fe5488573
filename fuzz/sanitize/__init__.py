"""A race sanitizer for any torch program: pinned staging, cross-stream access, allocator reuse.

The bug class of vLLM #48085 (the host rewrites pinned memory a queued non-blocking copy has not
read yet) is not special to a KV-cache zeroer; this package checks it, and two device-memory races
beside it, in any program or test suite (docs/sanitizer.md):

* :mod:`.observer`: on a GPU, the program's own schedule observed (observe mode);
* :mod:`.forcing`: force mode, queued copies held behind gate kernels until the host synchronises;
* :mod:`.simulated`: on a machine without a GPU, the program's cuda work on the simulator;
* :mod:`.races`, :mod:`.sites`: what a report says, and the program lines it names;
* :mod:`.runner`: one sanitized run, whichever backend; :mod:`.__main__`: the command
  (``python -m fuzz.sanitize -- python my_script.py``); :mod:`.pytest_plugin`: ``pytest --kvz-sanitize``.
"""
