"""The engines' idioms around a transfer, in both tools, on each backend: accepted and followed.

Each idiom is a short plain-torch program in two forms: race-free, and racy (the host rewrites the
pinned source of a queued copy without the wait the race-free form has). Under the sanitizer and
under the fuzzer's interception, the race-free form runs with no refusal and no race, and the racy
one is reported: an idiom that is refused, or followed so loosely that it hides the race, fails here.
The GPU cases run where there is one (the sanitizer observing, the fuzzer's controlled mode).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import pytest
import torch

from sanitizer.runner import sanitize
# in_a_zeroer's runtimes are closed after each test by its module's fixture, used here too: an H100
# run found this module's cuda cases leaving their gated runtimes open for the tests after them.
from test_sim_conformance import _close_runtimes, in_a_zeroer  # noqa: F401 - the fixture is autouse

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BACKENDS = ["sim", pytest.param("cuda", marks=CUDA)]
N = 64


def _staged(stream: torch.cuda.Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """A pinned source and a queued host-to-device copy of it on ``stream``."""
    host = torch.arange(N, dtype=torch.float32).pin_memory()
    device = torch.empty(N, device="cuda")
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        device.copy_(host, non_blocking=True)
    return host, device


def timing_events_from_a_pool(racy: bool) -> None:
    # vLLM's offloading handler: a stream and two timing events from pools per transfer, and
    # start.elapsed_time(end) reported once the end event has completed.
    streams = [torch.cuda.Stream() for _ in range(2)]
    timers = [(torch.Event(enable_timing=True), torch.Event(enable_timing=True)) for _ in range(2)]
    for job in range(3):
        stream, (start, end) = streams[job % 2], timers[job % 2]
        start.record(stream)
        host, _ = _staged(stream)
        end.record(stream)
        if not racy:
            end.synchronize()
            assert start.elapsed_time(end) >= 0.0
        host.fill_(-1.0)  # the pinned source is reused for the next transfer


def polled_generic_event(racy: bool) -> None:
    # vLLM's offloading handler: get_finished polls each transfer's device-generic torch.Event until
    # it answers True (torch traces no query, and torch.Event is a C type: an H100 run found the
    # sanitizer taking that answer for nothing), then the source is reused
    stream = torch.cuda.Stream()
    end = torch.Event(enable_timing=True)
    host, _ = _staged(stream)
    end.record(stream)
    if not racy:
        while not end.query():
            pass
    host.fill_(-1.0)


def low_priority_streams(racy: bool) -> None:
    # vLLM's SimpleCPUOffload makes its copy streams at the lowest priority of the range
    lowest, _ = torch.cuda.Stream.priority_range()
    stream = torch.cuda.Stream(priority=lowest)
    host, _ = _staged(stream)
    done = torch.cuda.Event()
    done.record(stream)
    if not racy:
        done.synchronize()
    host.fill_(-1.0)


def raw_stream_handles(racy: bool) -> None:
    # a driver call takes stream.cuda_stream; torch code names the same stream again from it
    made = torch.cuda.Stream()
    stream = torch.cuda.ExternalStream(made.cuda_stream)
    host, _ = _staged(stream)
    if not racy:
        stream.synchronize()
    host.fill_(-1.0)


def copy_thread(racy: bool) -> None:
    # a background thread issues the copy and hands its event back through a queue
    jobs: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    stream = torch.cuda.Stream()

    def loop() -> None:
        host = jobs.get()
        device = torch.empty(N, device="cuda")
        with torch.cuda.stream(stream):
            device.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        done.put(event)

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    host = torch.arange(N, dtype=torch.float32).pin_memory()
    jobs.put(host)
    event = done.get()
    if not racy:
        event.synchronize()
    host.fill_(-1.0)
    worker.join()


def cuda_bindings_imported(racy: bool) -> None:
    # torch 2.13 imports cuda.bindings wherever it is installed; engines import it too
    try:
        import cuda.bindings.runtime  # noqa: F401
    except ImportError:
        pass
    stream = torch.cuda.Stream()
    host, _ = _staged(stream)
    if not racy:
        torch.cuda.synchronize()
    host.fill_(-1.0)


@torch.inference_mode()
def under_inference_mode(racy: bool) -> None:
    # vLLM's handlers and their tests run under @torch.inference_mode(), where Tensor.to and
    # Tensor.pin_memory reach a dispatch mode undecomposed (aten.to.dtype_layout, aten.pin_memory):
    # on an H100 the sanitizer took such a copy for some kernel and lost the values it staged
    stream = torch.cuda.Stream()
    host = torch.arange(N, dtype=torch.float32).pin_memory()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        device = host.to("cuda", non_blocking=True)
        back = (device * 2).to("cpu", non_blocking=True)  # into pinned memory torch allocates
    done = torch.cuda.Event()
    done.record(stream)
    if not racy:
        done.synchronize()
    host.fill_(-1.0)
    if not racy:
        assert float(back[1]) == 2.0


IDIOMS: list[Callable[[bool], None]] = [timing_events_from_a_pool, low_priority_streams, raw_stream_handles,
                                        copy_thread, cuda_bindings_imported, under_inference_mode]
# A spin on a query inside one call: the fuzzer's simulator moves queued work between the calls it
# schedules (an engine polls across calls: the scheduler's get_finished), so only the sanitizer,
# whose simulator lets a polled event complete, takes it.
PROGRAM_IDIOMS: list[Callable[[bool], None]] = [*IDIOMS, polled_generic_event]


@pytest.mark.parametrize("racy", [False, True], ids=["race-free", "racy"])
@pytest.mark.parametrize("idiom", PROGRAM_IDIOMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sanitizer_follows_each_idiom(backend: str, idiom: Callable[[bool], None], racy: bool) -> None:
    outcome = sanitize(lambda: idiom(racy), backend=backend, name=idiom.__name__)
    assert outcome.error is None, outcome.error_text
    assert outcome.unfollowed == [] and outcome.notes == []
    if racy:
        assert outcome.races and {race.kind for race in outcome.races} == {"host-write-vs-pending-copy"}, outcome.races
    else:
        assert outcome.races == [], "\n".join(r.format() for r in outcome.races)


@pytest.mark.parametrize("racy", [False, True], ids=["race-free", "racy"])
@pytest.mark.parametrize("idiom", IDIOMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fuzzers_interception_follows_each_idiom(backend: str, idiom: Callable[[bool], None], racy: bool) -> None:
    _, rt = in_a_zeroer(lambda cache: idiom(racy), backend)
    hazards = [str(h) for h in rt.hazards]
    if racy:
        assert hazards and all("host write to pinned" in h for h in hazards), hazards
    else:
        assert hazards == []
