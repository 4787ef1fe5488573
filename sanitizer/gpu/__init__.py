"""The sanitizer on a GPU: the program's own schedule, observed, never changed (observe mode), or
with copies held open until the host synchronises (force mode).

Nothing the program calls is replaced: its streams and events stay torch's, every op runs where
torch runs it. The observer (:mod:`.observer`) feeds the checker the program's work through:

* :mod:`.dispatch`: a ``TorchDispatchMode`` in every thread, which sees every aten op with the bytes
  it reads and writes, on the stream torch is about to use: device ops, copies in each direction,
  host ops on pinned memory, pinned allocations;
* :mod:`.trace`: torch's GPU trace callbacks (what ``TORCH_CUDA_SANITIZER`` also uses): streams,
  event record and wait, event, stream and device synchronisations, the caching allocator;
* :mod:`.patches`: the few Python functions that are no aten op: ``Event.query``/``Stream.query``
  and ``Event.elapsed_time`` (of the device-generic C types too, through :mod:`.c_methods`),
  ``Tensor.numpy``/``tolist``, ``empty_cache``, Triton's ``JITFunction.run``, CUDA graph capture
  and replay (:mod:`.graphs`), ``cudaHostRegister``;
* :mod:`.indices`: the rows an indexed op touches, from the values staged into its index tensor;
* :mod:`.forcing`: force mode's gates;
* :mod:`.device`: what the observer asks of CUDA, in one place (tests stand a fake in for it).
"""
