"""Device values read on the host, on the simulator as on CUDA: the host waits for the stream first.

The model. On a GPU, every way of reading a device tensor's values on the host (``t.tolist()``,
``t.item()``, ``int(t)``, ``bool(t)`` as in ``if torch.all(x == 1):``, iterating, ``repr(t)``,
a blocking ``t.cpu()``) is a synchronising device-to-host copy: the host waits until the work
queued on the current stream has run, then reads. On the simulator most of these reach the
simulated tensor's router whole and are synchronising ops there already (``_local_scalar_dense``
under ``item``/``int``/``bool``, ``_to_copy`` under ``.cpu()``: :mod:`racecheck.ops`). What
does not is read here, with the same meaning: one synchronising op on the current stream
(``InterceptSession.run_now``), after which the happens-before checker knows the host has seen
that stream, exactly as after ``.cpu()``:

* ``t.tolist()``, which torch refuses for a tensor subclass;
* ``repr(t)``, ``str(t)`` and ``f"{t}"``, which torch builds from dozens of small ops: the values
  are read once and printed as torch prints a CUDA tensor (``tensor([1, 2], device='cuda:0')``);
  a 0-dim tensor formats as its ``item()``, as torch formats one;
* ``t.numpy()`` and ``np.asarray(t)``, which CUDA refuses with a ``TypeError`` of the zeroer's.

A tensor printed by the harness (a debugger, a failing assertion) outside the zeroer's calls reads
nothing: it describes itself (``SimCudaTensor(shape=(3,), ...)``), so looking never runs a stream.

Example (inside an intercepted call on the simulator)::

    ids = torch.tensor([3, 4], device="cuda")
    ids.tolist()                 # [3, 4]: the current stream ran first, then one d2h read
    f"{ids}"                     # "tensor([3, 4], device='cuda:0')"
"""

from __future__ import annotations

from typing import Any

import torch

from kvdevice.intercept.errors import raise_as_cuda


def read(tensor: Any, what: str) -> torch.Tensor:
    """``tensor``'s values (a :class:`SimCudaTensor`) as a CPU tensor, read after the current
    stream's queued work, as one synchronising op named ``what``."""
    session = tensor._session
    reads, _, _ = session.sim_ops._accesses([tensor], [])
    box: list[torch.Tensor] = []
    inner = tensor._inner

    def run() -> None:
        box.append(inner.clone(memory_format=torch.contiguous_format))

    session.run_now(run, name=what, reads=reads)
    return box[0]


def tolist(tensor: Any) -> Any:
    return read(tensor, "tolist (d2h)").tolist()


def cuda_repr(tensor: Any) -> str:
    """What torch prints for ``tensor`` on a GPU: its values, read once, with CUDA's suffixes
    (the dense branch of ``torch._tensor_str._str_intern``, whose formatter and suffix layout
    are reused as they are)."""
    from torch._tensor_str import PRINT_OPTS, _add_suffixes, _tensor_str

    host = read(tensor, "repr (d2h)")
    prefix = "tensor("
    suffixes = [f"device='{tensor.device}'"]
    complex_default = torch.cdouble if torch.get_default_dtype() == torch.double else torch.cfloat
    if host.numel() == 0:
        if host.dim() != 1:
            suffixes.append(f"size={tuple(host.shape)}")
        if host.dtype != torch.get_default_dtype():
            suffixes.append(f"dtype={host.dtype}")
        contents = "[]"
    else:
        if not PRINT_OPTS.edgeitems:
            suffixes.append(f"size={tuple(host.shape)}")
        if host.dtype not in (torch.get_default_dtype(), complex_default, torch.int64, torch.bool):
            suffixes.append(f"dtype={host.dtype}")
        contents = _tensor_str(host, len(prefix))
    return _add_suffixes(prefix + contents, suffixes, len(prefix), force_newline=False)


def cuda_format(tensor: Any, spec: str) -> str:
    """``format(tensor, spec)`` as torch does it for a CUDA tensor (``Tensor.__format__``)."""
    if tensor.dim() == 0:
        return tensor.item().__format__(spec)
    return object.__format__(tensor, spec)


def refuse_numpy(tensor: Any) -> None:
    """``.numpy()`` / ``np.asarray`` of a device tensor: CUDA's own refusal, the zeroer's error."""
    raise_as_cuda(TypeError(
        f"can't convert {tensor.device} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host "
        "memory first."
    ))
