"""What interception cannot do, said as an error that names the call and the way forward."""

from __future__ import annotations

from zeroer.errors import ZeroerError

FREE_MODE_HINT = (
    "run this zeroer on a GPU in the free-running mode instead "
    "(pytest fuzz --zeroer SPEC --backend cuda --cuda-mode free), where its calls run as they are"
)


class InterceptError(ZeroerError, RuntimeError):
    """A call of a plain torch zeroer that the harness cannot route to its runtime.

    Never a silent pass: the harness stops and says which call and what to do instead.
    """


def unroutable(what: str, why: str, fix: str = FREE_MODE_HINT) -> InterceptError:
    """``InterceptError("<what>: <why>; <fix>")``."""
    return InterceptError(f"{what}: {why}; {fix}")
