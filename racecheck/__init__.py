"""The race-checking core that the fuzzer and the sanitizer share.

Both tools ask the same questions of GPU memory traffic (which op touched which bytes, on which
stream, ordered after what by which host thread), so the answers live here once:

* :mod:`.hb`: the happens-before checker: vector clocks for host threads and streams, accesses to
  byte ranges of memory, and the hazards that follow;
* :mod:`.ops`: what an aten op does to memory and to the stream (its kind, its read and write
  sets, the rows an indexed op touches);
* :mod:`.ranges`: the bytes a tensor view covers, as runs of addresses;
* :mod:`.pinned`: pinned host memory, the byte snapshots that expose host writes no call shows,
  and the copies still pending on it;
* :mod:`.gate`, :mod:`.real_cuda`: gate kernels that hold a CUDA stream until the host opens
  them, over torch's own CUDA calls;
* :mod:`.schedules`: runtimes that order streams on a schedule no torch hook shows (the fuzz
  harness's gated CUDA runtime), announced so that an observer can step aside.

It imports nothing of this project; its errors are its own (:mod:`racecheck.errors`).
"""

__distribution__ = "kvzero-fuzz"  # checked by kvzero_fuzz.shadowing
