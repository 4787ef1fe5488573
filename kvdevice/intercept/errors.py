"""What interception cannot do, said as an error that names the call and the way forward."""

from __future__ import annotations

from typing import Any

from racecheck.errors import KvzeroError as ZeroerError
from kvdevice.origin import forwarding

FREE_MODE_HINT = (
    "run the code on a GPU in the free-running mode instead (--backend cuda --cuda-mode free), where its "
    "calls run as they are"
)


class InterceptError(ZeroerError, RuntimeError):
    """A call of a plain torch zeroer that the harness cannot route to its runtime.

    Never a silent pass: the harness stops and says which call and what to do instead. A harness
    error the user can act on (exit status 2), never a finding (kvdevice.origin).
    """

    user_fixable = True


class SimulatorGap(ZeroerError, RuntimeError):
    """Something CUDA does that the simulator failed to do for a zeroer's call: a bug of
    kvzero-fuzz (exit status 3), never a finding of the zeroer (kvdevice.origin)."""


def unroutable(what: str, why: str, fix: str = FREE_MODE_HINT) -> InterceptError:
    """``InterceptError("<what>: <why>; <fix>")``."""
    return InterceptError(f"{what}: {why}; {fix}")


def simulator_gap(call: str, error: BaseException) -> SimulatorGap:
    """``SimulatorGap`` for ``call`` (how the zeroer's code spells it), which failed with ``error``."""
    return SimulatorGap(
        f"the simulator could not run {call} on a simulated CUDA tensor ({type(error).__name__}: {error}), "
        f"which CUDA runs; meanwhile a GPU runs this code as it is (--backend cuda --cuda-mode free)"
    )


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
