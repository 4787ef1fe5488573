"""The op records: what the fuzzer, the replayer and exported scripts hand to an episode.

An op is plain data, ``{"op": "allocate", "n": 2, "stream": 1}``; :class:`~fuzz.engine.episode.Episode`
is the one executor that says what each means (STYLE.md, "ops as data, one executor"). This module
says which ops exist and which fields each takes, with their defaults, so a trace written before a
field existed still replays (a missing field takes its default).

Fields a caller may vary to exercise the contract (docs/contract.md):

* ``cache``: which of the episode's KV caches (one zeroer each, built by the same factory);
* ``ids_as``: the container the ids are handed over in: a ``list``, a ``tuple``, a numpy ``array``
  or a CPU ``tensor``, each only to a zeroer that takes it (zeroer.id_containers: its declaration,
  else its annotation, else ``list[int]``);
* ``then``: what the caller does with that container once the call has returned (promise 3):
  ``keep`` it as it is, ``scribble`` over it (mutate it, or refill it for its next use) or ``drop``
  it.

Example::

    check_op({"op": "allocate", "n": 2})             # fine: the other fields take their defaults
    check_op({"op": "allocate", "n": 2, "cash": 1})  # OpError (a ValueError) naming the field and the valid ones
"""

from __future__ import annotations

from typing import Any

from fuzz.engine.component import COMPONENT_KINDS, ComponentKind
from zeroer.id_containers import IDS_CONTAINERS as IDS_AS
THEN = ("keep", "scribble", "drop")

# op -> (required fields, {optional field: default}), in signature order for messages: the caller's
# own ops, then each component kind's (fuzz.engine.component.COMPONENT_KINDS).
CORE_FIELDS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "start": ((), {"in_flight": 1}),
    "allocate": (("n",), {"stream": 0, "cache": 0, "ids_as": "list", "then": "keep"}),
    "write": (("block",), {"stream": 0, "cache": 0}),
    "read": (("block",), {"stream": 0, "cache": 0}),
    "free": (("block",), {"cache": 0}),
    "advance": (("stream",), {"ops": 1}),
    "delay": (("stream",), {"amount": 1}),
    "end_step": ((), {}),
    "sync_stream": (("stream",), {}),
    "sync_device": ((), {}),
    "reallocate": ((), {"cache": 0}),
}


def merged_fields(core: dict[str, Any], kinds: dict[str, ComponentKind]) -> dict[str, tuple[tuple[str, ...], dict[str, Any]]]:
    """The caller's ops and every component kind's, each name with one meaning in every trace."""
    fields = dict(core)
    for name, kind in kinds.items():
        for op, declared in kind.ops.items():
            if op in fields:
                raise ValueError(f"component kind {name!r} declares op {op!r}, which the caller or another kind has")
            fields[op] = declared
    return fields


FIELDS = merged_fields(CORE_FIELDS, COMPONENT_KINDS)
OPS = tuple(sorted(FIELDS))
_ALL = {name: frozenset(required) | frozenset(optional) for name, (required, optional) in FIELDS.items()}
_REQUIRED = {name: frozenset(required) for name, (required, _) in FIELDS.items()}


class OpError(ValueError):
    """An op record that is not valid. ``field`` names the bad field (``None``: the record itself)
    and ``problem`` says what is wrong with it, so a trace reader can name ``ops[3].n``."""

    def __init__(self, message: str, field: str | None, problem: str) -> None:
        super().__init__(message)
        self.field = field
        self.problem = problem


def check_op(op: Any) -> tuple[str, dict[str, Any]]:
    """``(name, arguments)`` of a valid op record, defaults filled in; else an :class:`OpError` that says why."""
    if not isinstance(op, dict):
        problem = f"is {op!r}; an op record is a JSON object such as {{'op': 'allocate', 'n': 1}}"
        raise OpError(f"an op record is a JSON object such as {{'op': 'allocate', 'n': 1}}, not {op!r}", None, problem)
    name = op.get("op")
    if name not in FIELDS:
        raise OpError(f"unknown op {name!r}; ops: {', '.join(OPS)}", "op", f"is {name!r}; known ops: {', '.join(OPS)}")
    args = {k: v for k, v in op.items() if k != "op"}
    if not (args.keys() <= _ALL[name] and _REQUIRED[name] <= args.keys()):  # set views: cheap on the hot path
        unknown = sorted(args.keys() - _ALL[name])
        missing = sorted(_REQUIRED[name] - args.keys())
        fields = f"its fields are: {', '.join((*FIELDS[name][0], *FIELDS[name][1])) or 'none'}"
        problem = f"has unknown field {unknown[0]!r}" if unknown else f"is missing field {missing[0]!r}"
        where = f"is not a field of op {name!r}" if unknown else f"is missing; op {name!r} needs it"
        raise OpError(f"op {name!r} {problem}; {fields}", unknown[0] if unknown else missing[0], f"{where} ({fields})")
    for field, value in args.items():
        allowed = IDS_AS if field == "ids_as" else THEN if field == "then" else None
        if allowed is not None:
            if value not in allowed:
                problem = f"is {value!r}; choose one of {', '.join(allowed)}"
                raise OpError(f"op {name!r} field {field!r} {problem}", field, problem)
        elif isinstance(value, bool) or not isinstance(value, int):
            problem = f"is {value!r}; it must be an integer"
            raise OpError(f"op {name!r} field {field!r} {problem}", field, problem)
    return name, {**FIELDS[name][1], **args}
