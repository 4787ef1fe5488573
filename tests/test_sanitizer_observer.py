"""The GPU observer (sanitizer/observer.py) where it meets the rest of kvzero, on the CPU.

``pytest --kvz-sanitize`` on a GPU machine also runs every test that uses kvzero's own simulator
and harness, so the observer must keep out of their way: the simulator's "cuda" tensors are CPU
memory (not a device the observer checks), and what torch raises under the observer's frames is
still the caller's error, not kvzero's (zeroer/origin.py decides whose an exception is). The
observer starts on a CPU-only torch too (it only sees no device work there), which is how these
run in CI. Its step-aside for the harness's CUDA runtime runs on the device
(tests/test_sanitizer_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from fuzz.engine.episode import Episode, EpisodeConfig
from sanitizer.observer import Observer
from zeroer.origin import blame


@pytest.fixture
def observer():
    obs = Observer()
    obs.start()
    try:
        yield obs
    finally:
        obs.stop()


def test_the_simulators_tensors_are_not_taken_for_device_memory(observer: Observer) -> None:
    episode = Episode(EpisodeConfig(zeroer="single_buffer", kernel="torch"))
    for op in ({"op": "allocate", "n": 2}, {"op": "allocate", "n": 2}, {"op": "sync_device"}):
        episode.apply(op)
    episode.rt.close()
    assert observer.take_races() == []
    assert observer.hb.hazards == []  # nothing of the simulator reached the observer's checker


def test_what_torch_raises_under_the_observer_is_still_the_callers(observer: Observer) -> None:
    try:
        torch.empty(3).view(4)
    except RuntimeError as error:
        verdict = blame(error)
    else:  # pragma: no cover - torch refuses this view
        raise AssertionError("torch accepted view(4) of 3 elements")
    assert not verdict.harness, verdict
    assert verdict.where is not None and "test_sanitizer_observer.py" in verdict.where


def test_stopping_puts_every_patched_function_back() -> None:
    before = (torch.Tensor.numpy, torch.cuda.Event.query, torch.cuda.empty_cache)
    obs = Observer()
    obs.start()
    assert torch.Tensor.numpy is not before[0]
    torch.cuda.empty_cache()  # the patched call hands on to torch's (a no-op without CUDA)
    obs.stop()
    assert (torch.Tensor.numpy, torch.cuda.Event.query, torch.cuda.empty_cache) == before


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool])
def test_a_pending_read_keeps_the_values_it_was_queued_with(dtype: torch.dtype) -> None:
    import ctypes

    from sanitizer.observer import _EMPTY, _ints, _PendingRead

    buffer = torch.arange(6).reshape(2, 3).to(dtype)
    span = (buffer.data_ptr(), buffer.numel() * buffer.element_size())
    read = _PendingRead(("pinned", 0), buffer, _EMPTY, None, "buffer", None, span, ctypes.string_at(*span))
    assert not read.changed() and (read.staged() == _ints(buffer)).all()  # what force mode reports as staged
    staged = read.staged().copy()
    buffer[1, 2] = 0
    assert read.changed() and (read.staged() == staged).all()
