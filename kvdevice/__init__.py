"""The device layer both tools run on: the simulator, the CUDA interception and the stream runtime.

What lives here is the substrate of every tool, not a part of any system under test:

* :mod:`kvdevice.runtime`: the stream runtime (streams, events, buffers, holds) with its simulated
  backend (``sim``) and its CUDA backends (controlled and free modes); each queued op carries whose
  code queued it, in which call (:mod:`kvdevice.runtime.op_origin`);
* :mod:`kvdevice.intercept`: a torch program's GPU work routed to a runtime: torch dispatch, Triton
  launches, custom ops, CUDA driver calls, helper threads, pinned and registered host memory;
* :mod:`kvdevice.origin`: whose an exception is, the code under test's or the harness's;
* :mod:`kvdevice.triton_cpu`: Triton kernels on CPU tensors under the interpreter.

It sits on the floor above :mod:`racecheck` (the happens-before core) and below ``zeroer``, the
fuzzer and the sanitizer (docs/architecture.md); it imports nothing of theirs.

Why this name: the tools import into the user's own process, and a tool never takes a name the
program owns. A plain ``device``, ``runtime`` or ``intercept`` is a name a user's repository may
well hold as its own top-level module (and ``python -m pytest`` puts the repository first on
``sys.path``); ``kvdevice`` carries the project's ``kv`` prefix, is no distribution on PyPI we
know of, and is checked at load like the other top-level names (``kvzero_fuzz.shadowing``).
"""

__distribution__ = "kvzero-fuzz"  # checked by kvzero_fuzz.shadowing: a user's package may shadow a top-level name
