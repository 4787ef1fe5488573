"""The caller keeps the zeroer's input contract: ids come only in the containers it declares.

vLLM's ``zero_block_ids(self, block_ids: list[int])`` starts with ``if not block_ids: return``; a
numpy array there raises, which proves nothing about the zeroer. So the container comes from the
zeroer's declaration (``Capabilities(ids_as=...)``), else its annotation, else ``list[int]``.
"""

from __future__ import annotations

import re
import sys
import typing
from collections.abc import Iterable, Sequence
from typing import Any, NewType, Optional, Union

import numpy as np
import numpy.typing as npt
import pytest
import torch
from typing_extensions import TypeAliasType

from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign
from fuzz.engine.episode import Episode, EpisodeConfig, run_ops
from fuzz.engine.harness_error import HarnessError
from zeroer.id_containers import IdsContractError, accepted_containers
from zeroer.protocol import Capabilities, ZeroerSpecError
from zeroer.registry import load_zeroer

BlockIds = NewType("BlockIds", list)


_T = typing.TypeVar("_T")
_IdArray = TypeAliasType("_IdArray", np.ndarray[Any, np.dtype[_T]], type_params=(_T,))


def _call(annotation: Any):
    def zero_block_ids(block_ids) -> None: ...

    zero_block_ids.__annotations__["block_ids"] = annotation
    return zero_block_ids


@pytest.mark.parametrize(("annotation", "containers"), [
    (list[int], ("list",)),
    (typing.List[int], ("list",)),
    (list, ("list",)),
    (tuple[int, ...], ("tuple",)),
    (Sequence[int], ("list", "tuple")),
    (typing.Sequence[int], ("list", "tuple")),
    (Iterable[int], ("list", "tuple")),
    (np.ndarray, ("array",)),
    (npt.NDArray[np.int64], ("array",)),
    (torch.Tensor, ("tensor",)),
    (list[int] | None, ("list",)),
    (Optional[Sequence[int]], ("list", "tuple")),
    (Union[list[int], np.ndarray], ("list", "array")),
    (Sequence[int] | np.ndarray | torch.Tensor, ("list", "tuple", "array", "tensor")),
    (Any, ("list",)),
    (BlockIds, ("list",)),
    ("list[int]", ("list",)),  # from __future__ import annotations
    ("Sequence[BlockId] | None", ("list", "tuple")),  # a name only type checkers see: read by its text
    ("npt.NDArray[np.int64] | list[int]", ("list", "array")),
    # numpy >= 2.3 on Python 3.12 spells NDArray as a PEP 695 alias (``type NDArray[T] = ...``):
    # the H200's numpy 2.5 made npt.NDArray[np.int64] unreadable until aliases were followed.
    (_IdArray[np.int64], ("array",)),
    (_IdArray[np.int64] | list[int], ("list", "array")),
])
def test_the_annotation_of_zero_block_ids_says_which_containers_the_caller_hands_over(annotation, containers):
    assert accepted_containers(_call(annotation)) == containers


def test_no_annotation_means_vllms_list_of_ints():
    def zero_block_ids(block_ids) -> None: ...

    assert accepted_containers(zero_block_ids) == ("list",)


def test_an_annotation_that_admits_no_container_the_caller_has_says_what_to_declare():
    with pytest.raises(IdsContractError, match=re.escape(
            "zeroer 'mine.py:make': zero_block_ids(block_ids: set[int]) takes none of the containers the fuzzer's caller "
            "hands ids over in (list, tuple, array, tensor); annotate it with one of them (list[int], as vLLM does), "
            "or declare them on its factory: capabilities = Capabilities(ids_as=('list',))") + "$"):
        accepted_containers(_call(set[int]), "mine.py:make")


def test_a_declaration_names_known_containers_only():
    with pytest.raises(ZeroerSpecError, match=r"^Capabilities\(ids_as=\('list', 'set'\)\): 'set' is not one of "
                                              r"list, tuple, array, tensor$"):
        Capabilities(ids_as=("list", "set"))


# -- what the fuzzer's caller does --------------------------------------------------------------------------------
SEEN: list[str] = []


class _Recording:
    """A race-free zeroer (the harness's reference design, through the runtime) that records the
    container of every call; subclasses annotate or declare differently."""

    def __init__(self, cache, runtime) -> None:
        from zeroer.designs import ReferenceZeroer

        self._inner = ReferenceZeroer(cache, runtime)

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:  # vLLM's first line: a numpy array raises here
            return
        SEEN.append(type(block_ids).__name__)
        self._inner.zero_block_ids(list(block_ids))


class ListsOnly(_Recording):
    capabilities = Capabilities(api="runtime", follows_reallocation=True)


class Sequences(_Recording):
    capabilities = Capabilities(api="runtime", follows_reallocation=True)

    def zero_block_ids(self, block_ids: Sequence[int]) -> None:
        super().zero_block_ids(block_ids)


class Everything(_Recording):
    capabilities = Capabilities(api="runtime", follows_reallocation=True, ids_as=("list", "tuple", "array", "tensor"))

    def zero_block_ids(self, block_ids) -> None:
        if len(block_ids) == 0:
            return
        SEEN.append(type(block_ids).__name__)
        self._inner.zero_block_ids([int(b) for b in block_ids])


@pytest.mark.parametrize(("name", "seen"), [
    ("ListsOnly", {"list"}),
    ("Sequences", {"list", "tuple"}),
    ("Everything", {"list", "tuple", "ndarray", "Tensor"}),
])
def test_a_campaign_hands_ids_over_only_in_the_containers_the_zeroer_takes(name, seen, tmp_path):
    spec = f"tests/test_id_containers.py:{name}"
    recorded = sys.modules[load_zeroer(spec).factory.__module__].SEEN  # the module as the fuzzer loaded it
    recorded.clear()
    result = run_campaign(Campaign(EpisodeConfig(zeroer=spec, geometry="tiny", zeroers=2), 0, "clean"),
                          PROFILES["quick"], tmp_path)
    assert not result.found and not result.harness_error, (result.violation, result.harness_error)
    assert set(recorded) == seen


def test_a_hand_written_trace_outside_the_contract_is_a_harness_error_the_user_can_fix():
    config = EpisodeConfig(zeroer="tests/test_id_containers.py:ListsOnly", geometry="tiny")
    ops = [{"op": "start"}, {"op": "allocate", "n": 1, "ids_as": "array"}]
    with pytest.raises(ValueError, match=re.escape(
            "allocate ids_as='array': zeroer 'tests/test_id_containers.py:ListsOnly' takes its ids as list (from its "
            "zero_block_ids annotation or its Capabilities(ids_as=...)), so a caller inside its contract never hands "
            "over a array; drop the field from the op, or declare the container on the zeroer's factory") + "$"):
        run_ops(config, ops)


def test_the_state_machine_turns_that_into_a_harness_error_of_status_2_not_a_finding():
    from fuzz.engine.machine import machine_for

    machine = machine_for(EpisodeConfig(zeroer="tests/test_id_containers.py:ListsOnly", geometry="tiny"), "lists")()
    machine.start(in_flight=1, disabled=frozenset())
    with pytest.raises(HarnessError) as raised:
        machine._apply(op="allocate", n=1, ids_as="tensor")
    assert raised.value.status == 2 and raised.value.message.startswith(
        "harness error at step 2 in op 'allocate', not a finding: ContractError: allocate ids_as='tensor'")
    machine.teardown()


def test_the_caller_still_scribbles_on_a_list_it_handed_over():
    episode = Episode(EpisodeConfig(zeroer="reference", geometry="tiny"))
    episode.apply({"op": "start"})
    handed = []
    original = episode.zeroer.zero_block_ids
    episode.zeroer.zero_block_ids = lambda ids: (handed.append(ids), original(ids))
    episode.apply({"op": "allocate", "n": 2, "then": "scribble"})
    episode.apply({"op": "allocate", "n": 1})
    [first, _] = handed
    assert isinstance(first, list) and first != [1, 2]  # rewritten by the caller after the call returned
    episode.finish()


# -- vLLM's warmup(num_kv_blocks) -----------------------------------------------------------------------------------
class WarmsUpWithBlocks(_Recording):
    """vLLM's newest signature: ``warmup(num_kv_blocks)`` zeroes the null block when there are blocks."""

    capabilities = Capabilities(api="runtime", follows_reallocation=True)
    warmed: list[int] = []

    def warmup(self, num_kv_blocks: int) -> None:
        WarmsUpWithBlocks.warmed.append(num_kv_blocks)
        if num_kv_blocks > 0:
            self.zero_block_ids([0])


def test_a_warmup_that_asks_for_the_number_of_blocks_gets_the_caches():
    spec = "tests/test_id_containers.py:WarmsUpWithBlocks"
    owner = load_zeroer(spec).factory
    owner.warmed.clear()
    episode = Episode(EpisodeConfig(zeroer=spec, geometry="tiny"))
    episode.apply({"op": "start"})
    assert owner.warmed == [episode.cache.spec.num_blocks]
    episode.finish()


def test_a_warmup_that_needs_more_than_the_number_of_blocks_is_told_how_to_fit():
    from zeroer.protocol import BoundZeroer

    class TwoArguments:
        def zero_block_ids(self, block_ids: list[int]) -> None: ...

        def warmup(self, num_kv_blocks: int, dtype: str) -> None: ...

    with pytest.raises(ZeroerSpecError, match=re.escape(
            "zeroer 'mine': its warmup(num_kv_blocks, dtype) needs 2 arguments; the harness calls warmup() "
            "or warmup(num_blocks): bind the others first (functools.partial) or give them defaults") + "$"):
        BoundZeroer(TwoArguments(), "mine", Capabilities())
