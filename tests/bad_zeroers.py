"""Zeroer specs that are wrong in one way each, for the table of bad inputs (docs/bad-input.md).

Named on a command line as ``tests/bad_zeroers.py:NAME``. The first four are usage errors (exit
status 2: the spec cannot be used), as is ``raising_factory`` (it built nothing); ``RaisingZeroer``
is a finding (exit 1: a zeroer that raises once it exists is a bug in it, kind "zeroer raised",
docs/contract.md); ``OutOfMemoryZeroer`` is a resource error; the last two are harness errors the
user can act on (exit status 2: what the harness cannot follow is never a finding).
"""

from __future__ import annotations

NOT_A_FACTORY = 3  # not callable


def one_argument(cache):  # a factory takes (cache, runtime)
    raise AssertionError("never called: the signature is refused first")


def declares_a_string(cache, runtime):
    raise AssertionError("never called: the declaration is refused first")


declares_a_string.capabilities = "sim"  # should be a zeroer.protocol.Capabilities(...)


def raising_factory(cache, runtime):
    """A factory that fails: a usage error naming it and this line, never a finding."""
    raise RuntimeError("planted: this factory cannot build a zeroer")


class RaisingZeroer:
    """A zeroer whose call fails: a finding at the first zero_block_ids."""

    def __init__(self, cache, runtime) -> None:
        self.cache = cache

    def warmup(self) -> None:
        pass  # the failure is the call's, not the warm-up's

    def zero_block_ids(self, block_ids) -> None:
        raise RuntimeError(f"planted: cannot zero {list(block_ids)}")


class OutOfMemoryZeroer:
    """A zeroer whose call hits CUDA's out-of-memory error (what too many workers on one GPU
    get): a resource error, exit status 2, never a finding (racecheck.resources)."""

    def __init__(self, cache, runtime) -> None:
        self.cache = cache

    def zero_block_ids(self, block_ids) -> None:
        import torch

        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.00 GiB (planted)")


class UsesACudaGraph:
    """A zeroer that captures a CUDA graph, which the harness can neither simulate nor gate: a
    harness error naming the call and the free-running mode, never a finding."""

    def __init__(self, cache, runtime) -> None:
        self.cache = cache

    def zero_block_ids(self, block_ids: list[int]) -> None:
        import torch

        torch.cuda.CUDAGraph()


class TakesASet:
    """A zeroer whose ids are annotated as a set: no container the fuzzer's caller has."""

    def __init__(self, cache, runtime) -> None:
        self.cache = cache

    def zero_block_ids(self, block_ids: set[int]) -> None:
        raise AssertionError("never called: the caller cannot keep its contract")
