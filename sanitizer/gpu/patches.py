"""The few Python functions the observer wraps, because no aten op or trace callback shows them.

Each wrapper hands the program's call on unchanged; all are put back by the function
:func:`install` returns.

* ``torch.cuda.Event.query``, ``torch.cuda.Stream.query``, the device-generic ``torch.Event.query``
  and ``torch.Stream.query``: a True answer is the host observing completion (torch traces no
  query); the host may wait there, so force mode's gates open first. The device-generic two are C
  types that refuse ``setattr``: their namespace takes the wrapper (:mod:`sanitizer.gpu.c_methods`),
  so every instance is followed, however and whenever it was made;
* ``elapsed_time`` of both event types: a host read of the events' times, checked before the call
  (a host that has not seen the events complete gets ``cudaErrorNotReady`` or the time, by timing:
  ``host-read-vs-pending-event``); torch answers only once both events have completed, so an
  answer is the host seeing both;
* ``torch.cuda.empty_cache``: memory given back to CUDA is reused only after a device synchronisation;
* ``torch.Tensor.numpy``: a pinned tensor's numpy view is a :class:`~sanitizer.numpy_views.WatchedArray`,
  and where it was taken is remembered; ``torch.Tensor.tolist``: a host read of pinned memory (it
  reads the bytes in C++, no aten op);
* Triton's ``JITFunction.run``: a launch reads its tensor arguments and writes those that reach a
  ``tl.store`` (:mod:`racecheck.triton_stores`); a pinned tensor argument is read by the GPU when the
  kernel runs, as a non-blocking copy reads it;
* ``torch.tensor``, ``torch.as_tensor``, ``torch.asarray`` and ``torch.Tensor.new_tensor``: from a
  list or a scalar torch copies to the device below the dispatch mode; the copy and, for a small
  integer table, its values (:mod:`sanitizer.gpu.constructors`);
* ``torch.cuda.CUDAGraph.capture_begin``, ``capture_end`` and ``replay``: :mod:`sanitizer.gpu.graphs`;
* ``torch.cuda.cudart().cudaHostRegister`` / ``cudaHostUnregister``: registered memory is pinned
  memory outside the caching allocator (SGLang's host KV pool);
* the entry points of NVIDIA's ``cuda-bindings`` that move or order device work, and the symbols
  of a CUDA library loaded through ``ctypes``: ``cuGetProcAddress`` of ``cuMemcpyBatchAsync`` or
  ``cuMemcpyAsync``, ``cuMemcpyAsync`` and ``cudaMemcpyAsync`` are followed as ops
  (:mod:`sanitizer.gpu.driver`); each call site of any other is one "cannot follow" line and the run
  is partial, never a silent ``no race``;
* ``torch.Event`` (a C type whose ``query`` cannot be wrapped) is a subclass of it whose ``query``
  is, for the events the program makes while the observer runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from sanitizer.gpu import c_methods, driver, trace
from sanitizer.sites import caller_site
from kvdevice.intercept import driver_copies
from kvdevice.origin import forwarding


def install(obs: Any) -> Callable[[], None]:
    """Wrap every function above for ``obs``; the function that puts them back."""
    saved: list[Callable[[], None]] = []  # how to put each patched function back, in patching order

    def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        wrapper = make(original)
        try:
            setattr(owner, name, wrapper)
        except TypeError:  # a C type that refuses setattr (torch.Event, torch.Stream): its namespace
            try:
                saved.append(c_methods.replace(owner, name, wrapper))
            except TypeError as error:
                obs.notes.append(f"kvz-sanitize cannot wrap {owner.__module__}.{owner.__qualname__}.{name} on this "
                                 f"Python ({error}): {_UNWRAPPED.get(name, 'what it does is not followed')}")
            return
        saved.append(functools.partial(setattr, owner, name, original))

    def active() -> bool:
        return obs._started and not obs.paused

    def wrap(before: Callable[..., None] | None = None,
             after: Callable[[tuple, Any], None] | None = None,
             when: Callable[[], bool] = lambda: True) -> Callable[[Any], Any]:
        """A wrapper: while the observer is active (and ``when()``, checked without the lock),
        ``before(*args, **kwargs)`` is told of the call before it runs and ``after(args, result)``
        after it, each under the observer's lock."""

        def make(original: Any) -> Any:
            @forwarding
            @functools.wraps(original)
            def call(*args: Any, **kwargs: Any) -> Any:
                if before is not None and active() and when():
                    with obs.lock:
                        before(*args, **kwargs)
                result = original(*args, **kwargs)
                if after is not None and active():
                    with obs.lock:
                        after(args, result)
                return result

            return call

        return make

    def host_waits(*args: Any, **kwargs: Any) -> None:
        """A call where the host may wait for the GPU: host writes are checked and force mode's
        gates opened before it."""
        obs.boundary(caller_site())
        obs.release_forced(obs.last_site)

    def event_done(args: tuple, done: bool) -> None:
        # An event never recorded answers True too; its handle (0, or one the observer never saw
        # recorded: made before it started) stands for no work, so that answer orders nothing.
        handle = obs.device.event_handle(args[0]) if done else None
        if handle is not None:
            trace.event_completed(obs, handle)

    def time_read(start: Any, end: Any, *args: Any, **kwargs: Any) -> None:
        # Checked before the call: whether it answers depends on the GPU's timing, the verdict does not.
        obs.event_time_read((start, end), caller_site())

    def both_done(args: tuple, milliseconds: float) -> None:
        # elapsed_time answers only once both events have completed (cudaEventElapsedTime returns
        # cudaErrorNotReady before, which torch raises): an answer is the host seeing both.
        for event in args[:2]:
            handle = obs.device.event_handle(event)
            if handle is not None:
                trace.event_completed(obs, handle)

    def stream_done(args: tuple, done: bool) -> None:
        handle = obs.device.stream_handle(args[0]) if done else None
        if handle is not None:
            trace.stream_completed(obs, handle)

    def numpy(original: Any) -> Any:
        @forwarding
        @functools.wraps(original)
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            array = original(tensor, *args, **kwargs)
            if active() and tensor.device.type == "cpu":
                return obs.numpy_taken(tensor, array, caller_site())
            return array

        return call

    def tolist(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if tensor.device.type == "cpu" and obs.pinned.regions:
            obs.tolist_read(tensor, caller_site())

    def undo() -> None:
        for put_back in reversed(saved):
            put_back()
        saved.clear()

    from sanitizer.gpu import constructors, launches

    try:  # a patch that raises half-way puts back the ones made before it
        patch(torch.cuda.Event, "query", wrap(host_waits, event_done))
        patch(torch.cuda.Stream, "query", wrap(host_waits, stream_done))
        # The device-generic C types, named through torch._C: torch.Event may be bound to something
        # else by now (the simulator's stand-ins), and vLLM's offloading handler polls its transfers
        # with torch.Event(enable_timing=True).query(). torch traces no query (c10's
        # CUDAGuardImpl::queryEvent, queryStream); their record, wait and synchronize reach
        # sanitizer.gpu.trace through torch's GPU trace callbacks.
        patch(torch._C.Event, "query", wrap(host_waits, event_done))
        patch(torch._C.Stream, "query", wrap(host_waits, stream_done))
        patch(torch.cuda.Event, "elapsed_time", wrap(time_read, both_done))
        patch(torch._C.Event, "elapsed_time", wrap(time_read, both_done))
        patch(torch.cuda, "empty_cache", wrap(host_waits, lambda args, result: obs.cache_emptied()))
        patch(torch.Tensor, "numpy", numpy)
        # Programs call tolist() often and most have no pinned memory: take no lock for those.
        patch(torch.Tensor, "tolist", wrap(tolist, when=lambda: bool(obs.pinned.regions)))
        launches.patch(obs, patch, wrap)
        constructors.patch(obs, patch, active)
        _patch_graphs(obs, patch, wrap)
        _patch_cudart(obs, patch, wrap, active)
        calls = driver.DriverCalls(obs)
        driver.patch_bindings(calls, patch, wrap)
        driver.patch_libraries(calls, patch)
        following = driver_copies.following(calls)
        following.__enter__()
        saved.append(lambda: following.__exit__(None, None, None))
    except BaseException:
        undo()
        raise
    return undo


# What is lost where a method cannot be wrapped on this Python (a note at the start, never silent).
_UNWRAPPED = {"query": "a True answer does not count as the host seeing the work complete "
                       "(a race may be reported where the program waited); use synchronize()"}


def _patch_graphs(obs: Any, patch: Callable[..., None], wrap: Callable[..., Any]) -> None:
    graph_class = getattr(torch.cuda, "CUDAGraph", None)
    if graph_class is None:
        return

    def ending(original: Any, *, always: bool) -> Any:
        """``original``, after which the calling thread's capture has ended: when it fails
        (``capture_begin``), or always (``capture_end``)."""

        @forwarding
        @functools.wraps(original)
        def call(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                result = original(graph, *args, **kwargs)
            except BaseException:
                obs.graphs.end(graph)
                raise
            if always:
                obs.graphs.end(graph)
            return result

        return call

    def begin(graph: Any, *args: Any, **kwargs: Any) -> None:
        obs.graphs.begin(graph, caller_site())

    def replay(graph: Any, *args: Any, **kwargs: Any) -> None:
        site = caller_site()
        obs.boundary(site)
        obs.graphs.replay(graph, site)

    patch(graph_class, "capture_begin", lambda original: wrap(begin)(ending(original, always=False)))
    patch(graph_class, "capture_end", lambda original: ending(original, always=True))
    patch(graph_class, "replay", wrap(replay))


def _patch_cudart(obs: Any, patch: Callable[..., None], wrap: Callable[..., Any], active: Callable[[], bool]) -> None:
    try:
        runtime = torch.cuda.cudart()
    except Exception:  # noqa: BLE001 - no CUDA runtime bindings in this build
        return
    if runtime is None:
        return

    def register(original: Any) -> Any:
        @forwarding
        @functools.wraps(original)
        def call(address: int, nbytes: int, flags: int = 0, *args: Any) -> Any:
            result = original(address, nbytes, flags, *args)
            if active() and int(getattr(result, "value", result) or 0) == 0:
                with obs.lock:
                    obs.register_host_range(int(address), int(nbytes), caller_site())
            return result

        return call

    def unregister(address: int, *args: Any, **kwargs: Any) -> None:
        obs.boundary(caller_site())
        obs.pinned.unregister_range(int(address))

    patch(runtime, "cudaHostRegister", register)
    patch(runtime, "cudaHostUnregister", wrap(unregister))

