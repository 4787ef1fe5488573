"""What interception cannot do, said as an error that names the call and the way forward.

Where the way forward is the GPU, each tool spells its option its own way (the fuzzer's free-running
mode, ``--backend cuda --cuda-mode free``; the sanitizer's ``--backend cuda``, or
``--kvz-sanitize-backend cuda`` under pytest): such an error keeps its message with a ``{gpu}``
place (``template``), its text is the fuzzer's, and :func:`in_tool_words` gives another tool's.
"""

from __future__ import annotations

from typing import Any

from racecheck.errors import KvzeroError as ZeroerError
from kvdevice.origin import forwarding

GPU = "{gpu}"  # where a message names the GPU's option
FUZZER_GPU = "a GPU in the free-running mode instead (--backend cuda --cuda-mode free)"
GPU_WAY = f"run the code on {GPU}, where its calls run as they are"
FREE_MODE_HINT = GPU_WAY.replace(GPU, FUZZER_GPU)


class InterceptError(ZeroerError, RuntimeError):
    """A call of a plain torch zeroer that the harness cannot route to its runtime.

    Never a silent pass: the harness stops and says which call and what to do instead. A harness
    error the user can act on (exit status 2), never a finding (kvdevice.origin).
    """

    user_fixable = True
    template: tuple[str, str] | tuple[()] = ()  # (the call's text, the way forward with its {gpu} place), where it has one


class SimulatorGap(ZeroerError, RuntimeError):
    """Something CUDA does that the simulator failed to do for a zeroer's call: a bug of
    kvzero-fuzz (exit status 3), never a finding of the zeroer (kvdevice.origin)."""

    template: tuple[str, str] | tuple[()] = ()  # as InterceptError's


def unroutable(what: str, why: str, fix: str = GPU_WAY) -> InterceptError:
    """``InterceptError("<what>: <why>; <fix>")``; by default the way forward is the GPU. A ``{gpu}``
    in ``fix`` is where the GPU's option goes (module docstring)."""
    return _with_gpu(InterceptError, f"{what}: {why}; ", fix)


def simulator_gap(call: str, error: BaseException) -> SimulatorGap:
    """``SimulatorGap`` for ``call`` (how the zeroer's code spells it), which failed with ``error``."""
    return _with_gpu(SimulatorGap, f"the simulator could not run {call} on a simulated CUDA tensor "
                                   f"({type(error).__name__}: {error}), which CUDA runs; ",
                     f"meanwhile run this code on {GPU}")


def _with_gpu(kind: Any, said: str, fix: str) -> Any:
    """``kind(said + fix)`` in the fuzzer's words, remembering where ``fix`` names the GPU. ``said``
    is the program's text (a call, an error): a brace in it is never a place."""
    error = kind(said + fix.replace(GPU, FUZZER_GPU))
    if GPU in fix:
        error.template = (said, fix)
    return error


def in_tool_words(error: BaseException, gpu: str) -> str:
    """``error``'s message with the GPU's option said as ``gpu`` (``"a GPU instead (--backend cuda)"``: how
    the tool that shows it spells it); any other error's message as it is."""
    template = getattr(error, "template", ())
    if isinstance(error, (InterceptError, SimulatorGap)) and template:
        said, fix = template
        return said + fix.replace(GPU, gpu)
    return str(error)


@forwarding
def forward(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Hand the zeroer's own call on unchanged: what a library raises under it is the zeroer's
    (kvdevice.origin), as it would be on CUDA."""
    return func(*args, **kwargs)


@forwarding
def raise_as_cuda(error: BaseException) -> None:
    """Raise what CUDA raises for the zeroer's call (``.numpy()`` of a device tensor, say): the
    zeroer's error, not the harness's."""
    raise error
