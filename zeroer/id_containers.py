"""Which containers a zeroer's ``zero_block_ids`` takes its ids in: its declared input contract.

An engine's caller hands ids over in one container, and a zeroer is written for it: vLLM's
``zero_block_ids(self, block_ids: list[int])`` starts with ``if not block_ids: return``, which a
numpy array refuses (``ValueError: The truth value of an array ... is ambiguous``) and
``torch.tensor(block_ids, pin_memory=True)`` cannot pin when it is one. A caller that passed an
array would be outside the zeroer's contract, so what it raised would prove nothing. The fuzzer's
caller therefore hands ids only in the containers the zeroer declares:

* ``Capabilities(ids_as=(...))`` on its factory, when it says so (the built-in designs declare all);
* else the annotation of ``zero_block_ids``'s ids parameter: ``list[int]`` means lists only,
  ``tuple[int, ...]`` tuples, ``Sequence[int]`` (or ``Iterable``, ``Collection``) lists and
  tuples, ``numpy.ndarray`` arrays, ``torch.Tensor`` CPU tensors, a union any of its members
  (``None`` aside);
* no annotation (or ``Any``): ``list[int]``, vLLM's contract.

Within a container the caller keeps every freedom the contract gives it: it may mutate, reuse or
drop the list once the call has returned (docs/contract.md, promise 3).

Example::

    class Z:
        def zero_block_ids(self, block_ids: Sequence[int] | np.ndarray) -> None: ...

    accepted_containers(Z().zero_block_ids)     # ('list', 'tuple', 'array')
"""

from __future__ import annotations

import collections.abc
import inspect
import re
import types
import typing
from typing import Any

import numpy as np
import torch

from zeroer.errors import ZeroerError

IDS_CONTAINERS = ("list", "tuple", "array", "tensor")  # every container the fuzzer's caller can hand over
DEFAULT_CONTAINERS = ("list",)  # vLLM's list[int]
_SEQUENCES = (collections.abc.Sequence, collections.abc.Iterable, collections.abc.Collection,
              collections.abc.Reversible)
_BY_NAME = (  # a string annotation that cannot be resolved, read by the names it mentions
    (r"\b(?:Sequence|Iterable|Collection|Reversible)\b", ("list", "tuple")),
    (r"\b(?:list|List)\b", ("list",)),
    (r"\b(?:tuple|Tuple)\b", ("tuple",)),
    (r"\b(?:ndarray|NDArray|ArrayLike)\b", ("array",)),
    (r"\bTensor\b", ("tensor",)),
)


class IdsContractError(ZeroerError, ValueError):
    """An ids annotation the fuzzer cannot honour; the message says what to declare instead."""

    user_fixable = True


def _of_type(hint: Any) -> set[str] | None:
    """The containers ``hint`` admits; None when it is not a type this reads."""
    if hint is Any or hint is object or hint is inspect.Parameter.empty:
        return set(DEFAULT_CONTAINERS)
    if hint is None or hint is type(None):
        return set()
    supertype = getattr(hint, "__supertype__", None)  # typing.NewType
    if supertype is not None:
        return _of_type(supertype)
    origin = typing.get_origin(hint)
    # A PEP 695 alias (``type NDArray[T] = ndarray[..., dtype[T]]``, numpy >= 2.3 on Python 3.12):
    # ``NDArray[np.int64]`` has the alias as its origin, not a class; read what it stands for.
    alias = getattr(origin if origin is not None else hint, "__value__", None)
    if alias is not None:
        return _of_type(alias)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        found: set[str] = set()
        for member in typing.get_args(hint):
            inner = _of_type(member)
            if inner is None:
                return None
            found |= inner
        return found
    base = origin or hint
    if base is typing.Annotated:
        return _of_type(typing.get_args(hint)[0])
    if not isinstance(base, type):
        return None
    for cls, name in ((torch.Tensor, "tensor"), (np.ndarray, "array"), (list, "list"), (tuple, "tuple")):
        if issubclass(base, cls):
            return {name}
    if base in _SEQUENCES:
        return {"list", "tuple"}
    return None


def _of_text(text: str) -> set[str] | None:
    found: set[str] = set()
    for pattern, names in _BY_NAME:
        if re.search(pattern, text):
            found |= set(names)
            if names == ("list", "tuple"):
                text = re.sub(pattern, "", text)  # Sequence[...] is not also a list and a tuple
    return found or None


def accepted_containers(call: Any, spec: str = "zeroer") -> tuple[str, ...]:
    """The containers ``call`` (a bound ``zero_block_ids``) takes its ids in, from its annotation
    (see the module docstring); :class:`IdsContractError` when the annotation admits none of them."""
    try:
        parameter = next(iter(inspect.signature(call).parameters.values()), None)
    except (TypeError, ValueError):  # a builtin without a signature
        parameter = None
    if parameter is None or parameter.annotation is inspect.Parameter.empty:
        return DEFAULT_CONTAINERS
    hint: Any = parameter.annotation
    written = hint if isinstance(hint, str) else hint.__name__ if isinstance(hint, type) else str(hint)
    found: set[str] | None
    if isinstance(hint, str):
        try:
            function = getattr(call, "__func__", call)
            hint = typing.get_type_hints(function).get(parameter.name, hint)
        except Exception:  # noqa: BLE001 - a name imported only for type checkers: read the text instead
            pass
    found = _of_text(hint) if isinstance(hint, str) else _of_type(hint)
    if found is None and not isinstance(hint, str):  # a typing construct this does not read: its names
        found = _of_text(str(hint))
    if hint is Any or (isinstance(hint, str) and hint.strip() in ("Any", "typing.Any", "object")):
        found = set(DEFAULT_CONTAINERS)
    names = tuple(name for name in IDS_CONTAINERS if name in (found or ()))
    if not names:
        raise IdsContractError(
            f"zeroer {spec!r}: zero_block_ids({parameter.name}: {written}) takes none of the containers the fuzzer's "
            f"caller hands ids over in ({', '.join(IDS_CONTAINERS)}); annotate it with one of them (list[int], as "
            f"vLLM does), or declare them on its factory: capabilities = Capabilities(ids_as=('list',))"
        )
    return names
