"""A torch program's GPU work, intercepted and routed to a :mod:`kvdevice.runtime` runtime.

One :class:`~kvdevice.intercept.session.InterceptSession` holds the scope while the code under
test runs; which mechanism covers which call (docs/fuzz-your-zeroer.md has the table):

* ``TorchFunctionMode`` (:mod:`.torch_mode`): pinned allocations, device factories, ``.to``,
  ``.cuda``, ``.pin_memory``, ``is_pinned``, indexing, ``record_stream``;
* aten ops: a tensor subclass's ``__torch_dispatch__`` on the simulator (:mod:`.sim_tensor`,
  :mod:`.sim_ops`), a ``TorchDispatchMode`` on CUDA (:mod:`.cuda_ops`);
* custom ops (:mod:`.custom_calls`), CUDA driver calls (:mod:`.driver_copies`) and helper threads
  (:mod:`.helper_threads`);
* patched, in one place and undone on exit: ``torch.cuda``'s, ``torch.accelerator``'s and the
  device-generic ``torch.Stream``/``torch.Event``'s streams, events and synchronisation
  (:mod:`.cuda_api`; on the simulator also the device queries, :mod:`.sim_device`) and
  ``JITFunction.run`` (:mod:`.triton_launch`);
* device values read on the host, after the stream, as on CUDA (:mod:`.host_reads`);
* shadow copies of pinned buffers for host writes no torch op sees (:mod:`.host_memory`);
* refused with a clear error: GPU packages other than torch, CUDA libraries through ctypes
  (:mod:`.unroutable`).

A zeroer or an offloader is bound to a session by :mod:`zeroer.bind`; a whole program by the
sanitizer's simulator backend (:mod:`sanitizer.sim`).
"""
