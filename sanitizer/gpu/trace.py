"""torch's GPU trace callbacks: streams, events, synchronisations and the caching allocator.

The same hooks ``TORCH_CUDA_SANITIZER`` uses (``torch.cuda._gpu_trace``), registered once per
process (torch offers no way to take them back) and forwarded to the innermost observer running.
A callback comes on the thread that made the CUDA call, so every synchronisation is the calling
host thread's observation, whichever thread it is. Each callback is a boundary: the host writes
since the last one are looked for before what it reports counts as seen.

* stream creation: the stream is named by the line that made it;
* event record: the event carries its stream's clock (the record's stamp); event wait: the waiting
  stream joins it;
* event, stream and device synchronisation: the calling thread has seen that work complete, and
  force mode's gates open just before (the host is about to wait for them);
* memory allocation: the caching allocator handed an address out (its reuse rule is the
  observer's :meth:`~sanitizer.gpu.observer.Observer.memory_allocated`).

Inside a CUDA graph capture nothing of this runs on the GPU: events recorded and waited there are
part of the graph and ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sanitizer.sites import Site, caller_site

_ACTIVE: list[Any] = []
_INSTALLED = False


def install(observer: Any) -> None:
    """Forward the callbacks to ``observer`` until :func:`uninstall` (innermost observer first)."""
    global _INSTALLED
    _ACTIVE.append(observer)
    if _INSTALLED:
        return
    import torch
    import torch.cuda._gpu_trace as gpu_trace

    torch._C._activate_gpu_trace()
    for name, handler in (("stream_creation", stream_created), ("event_record", event_recorded),
                          ("event_wait", event_waited), ("event_deletion", event_deleted),
                          ("event_synchronization", event_synchronized),
                          ("stream_synchronization", stream_synchronized),
                          ("device_synchronization", device_synchronized), ("memory_allocation", memory_allocated)):
        getattr(gpu_trace, f"register_callback_for_{name}")(_forward(handler))
    _INSTALLED = True


def uninstall(observer: Any) -> None:
    if observer in _ACTIVE:
        _ACTIVE.remove(observer)


def _forward(handler: Callable[..., None]) -> Callable[..., None]:
    def callback(*args: Any) -> None:
        observer = _ACTIVE[-1] if _ACTIVE else None
        if observer is None or observer.paused:
            return
        with observer.lock:
            handler(observer, *args)

    return callback


def _boundary(obs: Any, site: Site | None = None) -> None:
    """The host code since the last boundary is checked before what the callback reports counts
    (nothing to check, and no line to find, when no queued copy reads pinned memory). ``site``: the
    callback's line where its handler has it already (:func:`caller_site` walks the stack)."""
    if obs.pinned.pending:
        obs.boundary(site or caller_site(3))


def _capturing(obs: Any) -> bool:
    return obs.graphs.capturing() is not None


# -- the handlers (called under the observer's lock) ---------------------------------------------------

def stream_created(obs: Any, stream: int) -> None:
    site = caller_site(3)
    obs._stream_names[stream] = f"stream 0x{stream:x} (created at {site.short})"


def event_recorded(obs: Any, event: int, stream: int) -> None:
    if _capturing(obs):
        return
    site = caller_site(3)
    _boundary(obs, site)
    # the record's stamp: its clock is what a wait on the event joins, and its line what a report
    # of the event's time read too early names (Observer.event_time_read)
    obs._events[event] = obs.enqueue("event record", stream, site)


def event_waited(obs: Any, event: int, stream: int) -> None:
    if _capturing(obs):
        return
    _boundary(obs)
    obs.enqueue("event wait", stream, None)
    record = obs._events.get(event)
    obs.hb.stream_waits(obs.stream_thread(stream), record.vc if record is not None else None)


def event_deleted(obs: Any, event: int) -> None:
    obs._events.pop(event, None)


def _host_waits(obs: Any) -> None:
    """A synchronisation: force mode's gates open first (the host is about to wait for them)."""
    _boundary(obs)
    obs.release_forced(obs.last_site)


def event_synchronized(obs: Any, event: int) -> None:
    _host_waits(obs)
    event_completed(obs, event)


def event_completed(obs: Any, event: int) -> None:
    """``Event.query()`` answered True: the host has seen everything the event covers."""
    record = obs._events.get(event)
    obs.hb.host_observes(record.vc if record is not None else None, obs.threads.current())
    _observed(obs)


def stream_synchronized(obs: Any, stream: int) -> None:
    _host_waits(obs)
    stream_completed(obs, stream)


def stream_completed(obs: Any, stream: int) -> None:
    obs.observes_stream(stream)
    _observed(obs)


def device_synchronized(obs: Any) -> None:
    _host_waits(obs)
    obs.hb.host_observes_all(obs.threads.current())
    _observed(obs)


def memory_allocated(obs: Any, address: int) -> None:
    obs.memory_allocated(address)


def _observed(obs: Any) -> None:
    """The host learned that work ran: indexed ops waiting for their rows may get them now."""
    obs.indices.resolve()
    obs.collect()
