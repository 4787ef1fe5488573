"""The sanitizer on the CPU simulator: the same program, its ``cuda`` work simulated.

Where there is no GPU (CI), a program's torch code runs under :mod:`kvdevice.intercept`, the
interception the fuzzer uses for plain torch zeroers: device tensors live in simulated device
memory, streams and events are the simulator's, and the same happens-before checker sees every op.
A queued op runs only when the host waits for its stream, so a copy from pinned memory always reads
what the host left there by then: the simulator runs every program as force mode would, and
``--force`` changes nothing there.

* :mod:`.session`: the program's session: what a report needs and a zeroer's session does not
  (program lines, pinned allocations with their sites, every thread, CUDA graphs, registered host
  memory), the host side shared with the GPU (:class:`sanitizer.watch.HostWatch`);
* :mod:`.device_api`: ``torch.cuda.cudart()`` and ``torch.cuda._sleep`` as a program sees them there.
"""
