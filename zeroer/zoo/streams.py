"""Zoo family 2: the zero lands on the wrong stream, or at the wrong time.

The contract (docs/contract.md, promise 1) puts the zero on the stream
that is current at the call, ordered after the work already on it and before the work enqueued
after it. The harness's caller relies on exactly that: it fences a freed block's last access
onto the current stream before the call (promise a) and makes later users of the block wait for
an event recorded on that stream after the call (promise b). Every entry here breaks promise 1 in
a different way, so a write the caller correctly ordered after "the zero" lands first and is
wiped, or the zero runs before the fence:

* ``zoo.shared_device_ids``: one device id buffer shared by calls on different streams;
* ``zoo.side_stream``: the kernel on a private side stream that nothing waits for;
* ``zoo.captured_stream``: every zero on the stream captured at construction;
* ``zoo.deferred_zero``: each call launches the previous call's ids, one call late.

They stage ids race-free, as ``per_call`` does (a fresh protected pinned buffer per call, as vLLM
after #48399), and default to the torch kernel; ``kernel="triton"`` works too.

Example::

    z = SideStream(cache, rt)
    z.zero_block_ids([1])                  # enqueued on the side stream
    rt.launch(write_block_1)               # on the current stream: may run before the zero
"""

from __future__ import annotations

from zeroer.designs import PerCallZeroer
from zeroer.cache.layout import KVCache
from kvdevice.runtime import DeviceBuffer, Runtime
from zeroer.zoo.entry import ZooEntry, advance, allocate, start, write


class SharedDeviceIds(ZooEntry, PerCallZeroer):
    """Fresh pinned memory per call, but one persistent device id buffer for every call.

    Safe while every call is on one stream: stream order puts each copy after the previous
    kernel's read. With calls on two streams (vLLM's device-side ``idx``/``_ids_gpu`` is safe
    only with same-stream use), call *k+1*'s copy on stream B overwrites the buffer while call
    *k*'s kernel on stream A has not read it, and call *k* zeroes call *k+1*'s blocks. Upstream
    analogs: the persistent ``_ids_gpu`` of vLLM's zeroer before #48399 (and each slot of the
    #48085 ring), and the cross-stream buffer races of #51571/#51599 (MRV1 async Mamba-align
    D2H). Symptom: blocks handed out unzeroed (NaN in hybrid models) and another stream's blocks
    zeroed twice.
    """

    name = "zoo.shared_device_ids"
    upstream = "persistent _ids_gpu across streams (fact 7; #51571/#51599 class)"
    # Both copies run before the first kernel reads the shared buffer.
    scenario = (start(), allocate(1, stream=0), allocate(1, stream=1), advance(0, 1), advance(1, 1))

    def __init__(self, cache: KVCache, runtime: Runtime, *, id_cap: int = 256, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
        self._dev = runtime.device_buffer(id_cap, name=f"{self.name} ids")

    def _device_ids(self, n: int) -> DeviceBuffer:
        if n > len(self._dev):
            self._dev = self.rt.device_buffer(2 * n, name=f"{self.name} ids")
        return self._dev  # whichever stream is current: no event orders the reuse


class SideStream(ZooEntry, PerCallZeroer):
    """The zero on a private side stream that waits for the caller's stream, but not vice versa.

    A zeroer that moves its copy and kernel to its own stream to overlap them with the forward,
    orders the side stream after the current one (so freed blocks are quiet), and forgets the
    event back. The caller then writes the new block on its current stream, correctly assuming
    stream order, and the zero can land after the write and wipe it; a read sees the previous
    tenant's bytes. Upstream analog: kekzl/imp#1652, zeroing on the legacy stream 0 while decode
    ran on a non-blocking stream; vLLM's Triton kernel is launched on torch's current stream
    for exactly this reason (docs/contract.md, promise 1). Symptom: freshly written KV
    zeroed (garbled output) or unzeroed pages read (NaN).
    """

    name = "zoo.side_stream"
    upstream = "kekzl/imp#1652 (zeroing on another stream than decode)"
    # The write on stream 0 runs before the side stream's zero, which then wipes it.
    scenario = (start(), allocate(1, stream=0), write(1, stream=0), advance(0, 4))

    def __init__(self, cache: KVCache, runtime: Runtime, *, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
        self.side = runtime.new_stream(f"{self.name} side")

    def _zero(self, ids: list[int]) -> None:
        ready = self.rt.record_event()  # the side stream waits for the caller's stream ...
        self.rt.wait_event(ready, stream=self.side)
        with self.rt.use_stream(self.side):
            super()._zero(ids)
        # ... and the caller's stream never waits for the side stream: the missing event.


class CapturedStream(ZooEntry, PerCallZeroer):
    """Every zero on the stream that was current when the zeroer was built.

    The zeroer captures "the compute stream" once (``torch.cuda.current_stream()`` in the
    constructor) instead of asking at each call. When the caller calls it from another stream,
    for example the stream that then loads KV into the new blocks, the zero is queued behind
    whatever the compute stream still has to run, outside the caller's ordering: the load,
    correctly ordered after the call on its own stream, lands first and the late zero wipes it;
    the zero may also run before the caller's free fence. This is vLLM **#45357**'s second race
    seen from the zeroer's side: ``zero_blocks`` for step N+1 queued on the compute stream behind
    forward(N), the RDMA write into the same new blocks landing first, then wiped (GSM8K 0.108 to
    0.480, "semi-coherent but incorrect" output, every full-attention layer's prefill lost);
    and of **#50696**, where the offloading connector's loads on their own stream were unordered
    with the compute stream that zeroes.
    """

    name = "zoo.captured_stream"
    upstream = "vLLM #45357 / #50696 (zero behind forward(N), load wiped)"
    # The load-like write on stream 1 runs, then the zero queued on stream 0 wipes it.
    scenario = (start(), allocate(1, stream=1), write(1, stream=1), advance(1, 4))

    def __init__(self, cache: KVCache, runtime: Runtime, *, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
        self.stream = runtime.current_stream()  # captured once: the bug

    def _zero(self, ids: list[int]) -> None:
        with self.rt.use_stream(self.stream):
            super()._zero(ids)


class DeferredZero(ZooEntry, PerCallZeroer):
    """Each call launches the ids of the previous call and keeps its own for the next one.

    A zeroer that batches: one launch per call, always one call late (ids are "shipped" with the
    next step). When ``zero_block_ids`` returns, nothing for its ids is enqueued, so the caller's
    writes to the new blocks run first and the late zero wipes them; the last call's blocks are
    never zeroed at all. The stream-order checker cannot see it when both land on one stream;
    the values show it. Upstream analog: vLLM **#50696**, where a zeroing "already shipped in an
    earlier step's SchedulerOutput" for a since-reallocated block landed after the load into
    that block (the skip set cannot retract it), and **#45357**'s zero queued one step late.
    Symptom: freshly loaded or written KV wiped; unzeroed pages read as NaN.
    """

    name = "zoo.deferred_zero"
    upstream = "vLLM #50696 (zeroing shipped a step late lands after a load)"
    scenario = (start(), allocate(1), write(1), allocate(1))

    def __init__(self, cache: KVCache, runtime: Runtime, *, kernel: str = "torch") -> None:
        super().__init__(cache, runtime, kernel=kernel)
        self._pending: list[int] = []

    def zero_block_ids(self, block_ids: list[int]) -> None:
        ids = self._validate(block_ids)
        if not ids:
            return
        late, self._pending = self._pending, ids
        if late:
            with self.rt.annotate(self._origin(late) + " (deferred)"):
                self._zero(late)
