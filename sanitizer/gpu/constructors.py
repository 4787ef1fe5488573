"""Tensors made in device memory from host data: ``torch.tensor(data, device="cuda")`` and its kin.

torch fills such a tensor below the dispatcher's Python key. ``internal_new_from_data``
(torch/csrc/utils/tensor_new.cpp; ``torch.tensor``, ``torch.as_tensor``, ``torch.asarray`` and
``Tensor.new_tensor`` all come to it) builds a list, a tuple or a scalar in host memory and moves it
with ``.to(device)`` while the Python dispatch key is excluded ("Steps 1 and 2 happen with all modes
disabled", its header says): the dispatch mode sees only the ``lift_fresh`` after, so neither the
copy nor the values it delivers would be known. (From a tensor, a numpy array, a DLPack capsule or,
for ``asarray``, a buffer, torch's move is dispatched and :mod:`sanitizer.gpu.copies` sees it.)
vLLM, SGLang and our own zeroers make block-id and address tables exactly this way.

So while the observer runs these four are wrapped (:func:`patch`). The program's call is handed on
unchanged and runs once; after it, when its result is in device memory:

* a copy torch hid is declared: a write of the result on the calling thread's current stream,
  which the host has then seen (torch's copy is blocking: it synchronises that stream);
* when the result is a small integer tensor (:data:`racecheck.device_values.MAX_STORAGE`) whose
  values the shadow does not know, its values are read on the host from the same data, by the same
  constructor with ``device="cpu"`` and the result's dtype, and recorded as a copy from the host
  records them (:meth:`racecheck.device_values.DeviceValues.store`). Only data that a second read
  cannot change and that reaches no device memory is read again: Python and numpy scalars, lists
  and tuples of them, ``range``, numpy arrays, ``bytes``. Anything else (an object of the program's
  own that acts as a sequence, a list holding tensors) leaves the values unknown: a kernel or an op
  that goes through them is one line and the run partial, never a guess. An iterator is never read
  twice: torch refuses one before anything is read.

Which device the result landed on is read from the result, so every spelling of the device counts
(``"cuda"``, ``"cuda:0"``, ``torch.device``, an index, ``torch.set_default_device``, a
``with torch.device(...)`` block, ``new_tensor`` on a CUDA tensor); an ordinary call costs one
check of its result. A name bound to the original before the observer started (``from torch import
tensor`` in a module imported earlier: a ``conftest.py``) is not wrapped: the tables it makes are not
known, and are said to be where they are needed (docs/sanitizer.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from racecheck.device_values import INTEGERS, MAX_STORAGE
from racecheck.devices import names_cuda
from sanitizer.sites import caller_site
from kvdevice.intercept.sim_tensor import SimCudaTensor
from kvdevice.origin import forwarding

# The constructors that come to internal_new_from_data: (owner, name, where the data is).
CONSTRUCTORS = ((torch, "tensor"), (torch, "as_tensor"), (torch, "asarray"), (torch.Tensor, "new_tensor"))
_SCALARS = (bool, int, float, np.generic)


def patch(obs: Any, patch_fn: Callable[..., None], active: Callable[[], bool]) -> None:
    """Wrap the constructors for ``obs`` (:func:`sanitizer.gpu.patches.install` gives ``patch_fn``,
    which puts them back when the observer stops)."""
    for owner, name in CONSTRUCTORS:
        patch_fn(owner, name, lambda original, name=name: _wrapper(obs, original, name, active))


def _wrapper(obs: Any, original: Any, name: str, active: Callable[[], bool]) -> Any:
    method = name == "new_tensor"

    @forwarding  # the program's own call, handed on: what torch raises under it is the program's
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not active():
            return original(*args, **kwargs)
        if obs.forcing is not None and _may_target_cuda(name, args, kwargs):
            with obs.lock:  # torch's copy is blocking: force mode's gates open before the host waits
                obs.release_forced(caller_site())
        result = original(*args, **kwargs)
        if isinstance(result, torch.Tensor) and obs.device.is_device(result) and active():
            with obs.lock:
                made(obs, original, name, _data(args, kwargs, method), args[0] if method else None, result)
        return result

    return call


def made(obs: Any, original: Any, name: str, data: Any, base: torch.Tensor | None, result: torch.Tensor) -> None:
    """``result`` was made in device memory from ``data`` by the constructor ``original`` (``base``:
    the tensor ``new_tensor`` was called on); called under the observer's lock."""
    if isinstance(result, SimCudaTensor) or obs.graphs.capturing() is not None:
        return  # kvzero's simulator at work (its "cuda" is CPU memory); a capture: torch refuses a blocking copy
    hidden = hidden_copy(name, data)
    if hidden:
        site = caller_site()
        obs.boundary(site)
        stream = obs.device.current_stream(obs.device.device_index(result))
        stamp = obs.enqueue(f"{'Tensor' if name == 'new_tensor' else 'torch'}.{name} (H2D copy)", stream, site)
        obs.device_access(result, stamp, write=True)  # fresh memory: nothing of it was known
        obs.observes_stream(stream)
    if (result.dtype in INTEGERS and result.untyped_storage().nbytes() <= MAX_STORAGE
            and (hidden or not obs.values.known(result)) and rereadable(data)):
        host = _host_values(original, name, data, base, result.dtype)
        if host is not None and tuple(host.shape) == tuple(result.shape):
            obs.values.store(result, host)
    obs.collect()


def hidden_copy(name: str, data: Any) -> bool:
    """Whether torch moves ``data`` to the device below the Python key (module docstring)."""
    if isinstance(data, (torch.Tensor, np.ndarray)) or hasattr(data, "__cuda_array_interface__"):
        return False
    if type(data).__name__ == "PyCapsule":  # DLPack
        return False
    if name == "asarray":  # numpy scalars and buffers come to a tensor first, then a dispatched .to()
        if isinstance(data, np.generic):
            return False
        try:
            memoryview(data)
        except TypeError:
            return True
        return False
    return True


def rereadable(data: Any) -> bool:
    """Whether reading ``data`` a second time gives the same values and touches no device memory."""
    if isinstance(data, _SCALARS) or isinstance(data, (range, bytes)):
        return True
    if isinstance(data, np.ndarray):
        return data.dtype != object
    if type(data) in (list, tuple):
        return all(rereadable(item) for item in data)
    return False


def _host_values(original: Any, name: str, data: Any, base: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``data`` as the constructor makes it in host memory, in ``dtype``; None where it refuses."""
    try:
        with torch._C.DisableTorchFunction(), no_dispatch():
            if name == "new_tensor":
                return original(base, data, dtype=dtype, device="cpu")
            return original(data, dtype=dtype, device="cpu")
    except Exception:  # noqa: BLE001 - the values stay unknown (said where they are needed)
        return None


def _data(args: tuple, kwargs: dict, method: bool) -> Any:
    position = 1 if method else 0
    if len(args) > position:
        return args[position]
    return kwargs.get("data", kwargs.get("obj"))


def _may_target_cuda(name: str, args: tuple, kwargs: dict) -> bool:
    """Before the call, in force mode: whether its result may land in CUDA memory."""
    device = kwargs.get("device")
    if device is None and name == "as_tensor" and len(args) > 2:
        device = args[2]
    if device is None and name == "new_tensor" and args and isinstance(args[0], torch.Tensor):
        device = args[0].device
    if device is None:
        device = torch.get_default_device()
    return names_cuda(device)


__all__ = ["CONSTRUCTORS", "hidden_copy", "made", "patch", "rereadable"]
