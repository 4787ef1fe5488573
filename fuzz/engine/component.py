"""What the code under test asks of the caller that drives it: the caller core's public side.

An episode (:class:`fuzz.engine.episode.Episode`) is the caller: it owns the KV caches and their
blocks, the streams and the fences between them, the shadow that says what each block must hold,
and the findings. The zeroer is driven by the episode itself; another kind of code under test (an
offloader: :class:`fuzz.engine.offload.OffloadSide`) is a :class:`Component` that plugs in beside
it: the episode calls it only through that protocol, and it reaches the caller only through the
methods :class:`CallerCore` names, so neither module imports the other's internals (and
``fuzz.engine.offload`` does not import ``fuzz.engine.episode`` at all). Its rules in the state
machine are a part of their own (:class:`fuzz.engine.offload_rules.OffloadPart`) beside the caller's.

A component makes each call of its code inside ``core.component_call(group, "store(2, [1], [1])")``:
the core knows which kind is under test, so the ops the call queues carry that kind as their owner
(:mod:`kvdevice.runtime.op_origin`), reports name it (``the offloader's store(2, [1], [1])``), and
a finding raised there is filed under it (``offloader raised``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

class CallerCore(Protocol):
    """The caller's methods a component uses (an :class:`~fuzz.engine.episode.Episode` provides them)."""

    config: Any
    rt: Any  # the runtime: streams, events, the happens-before checker
    groups: list[Any]  # the KV caches, each with its blocks' shadow and last accesses
    owners: int  # allocations made so far: a block's owner tag
    step: int

    def stream_of(self, index: int) -> Any:
        """The runtime stream the episode calls ``index``."""

    def note(self, text: str) -> str:
        """``text`` placed at the current step, for a finding's history."""

    def component_call(self, group: Any, call: str) -> Any:
        """A context for one call of the component's code (``call`` names it, ``store(2, [1], [1])``):
        the ops it queues are the component's, and what it raises is its finding."""

    def factory_call(self, component: str, spec: str, signature: str) -> Any:
        """A context for building a component: a factory that raises is a usage error, never a finding."""

    def order_before(self, group: Any, block: int, stream: int, skip_kinds: tuple[str, ...] = ()) -> None:
        """Make ``stream`` wait for the last access to ``block`` of ``group`` on another stream."""

    def device_work(self, fn: Any, *args: Any) -> Any:
        """Run a runtime call that may execute queued device work of the code under test."""

    def hand_out(self, group: Any, stream: int, *, oldest: bool = False) -> int:
        """A free block for the component to fill on ``stream``, its last tenant ordered before it."""

    def check_live(self, group: Any, block: int, what: str) -> None:
        """Raise the caller's usage error unless ``block`` is allocated and live."""

    def read_capture(self, group: Any, block: int, stream: int, where: str, kind: str | None = None) -> None:
        """Read ``block`` on ``stream`` and keep what it saw for the oracle's verdict."""


class Component(Protocol):
    """A kind of code under test driven beside the zeroer (an offloader's side): what the caller
    core asks of it. It is built with the episode (:func:`build_component`), reaches the core
    only through :class:`CallerCore`, and adds its own ops to the trace (:meth:`ops`).

    Optionally (the core looks it up with ``getattr``) ``explain_cuda_error(call, error) -> str |
    None``: what CUDA refusing one of its calls means for this kind of code, for the words of the
    ``cuda error`` finding (fuzz.engine.cuda_error)."""

    noun: str  # how a message names it: "the offloader"
    keeps_cache_tensors: bool  # built with the cache's tensors: the caller may not move the cache

    def ops(self) -> dict[str, Any]:
        """Its trace ops ("store", "load", ...): each called with the op record's fields."""

    def warmup(self) -> None:
        """Its warm-up, ungated, after the zeroers' (the caller's first step)."""

    def holding(self, block: int) -> str | None:
        """Why the caller may not write or free ``block`` of the first cache now, or None."""

    def finish(self) -> None:
        """At the end of the episode, the device idle: its last checks (findings go to the core)."""

    def close(self) -> None:
        """Close the code under test (its queued work may still run)."""

    def release(self) -> None:
        """After the runtime closed: give back what it held (host memory, registrations)."""

    def abandon(self) -> None:
        """Close it without judging (a failed or interrupted episode); best effort."""


@dataclass(frozen=True)
class ComponentKind:
    """One kind of code under test beside the zeroer: its side, and the trace ops it adds."""

    side: str  # "module:Class" of its Component, imported only for a campaign of its kind
    part: str  # "module:Class" of its rules in the state machine, beside the caller's (fuzz.engine.machine)
    ops: dict[str, tuple[tuple[str, ...], dict[str, Any]]]  # op -> (required fields, {optional field: default})
    # Its settings in the episode's config, each with its choices (the first is the default).
    options: dict[str, tuple[str, ...]] = field(default_factory=dict)
    one_cache: bool = False  # its episode holds one KV cache (one zeroer)
    # Examples a campaign of its kind runs, as a multiple of the profile's: its races need longer
    # programs than a zeroer's (see COMPONENT_KINDS).
    examples_factor: int = 1

    def config_fields(self, name: str) -> list[tuple[str, Any, Any]]:
        """The config fields the kind adds, as ``dataclasses.make_dataclass`` takes them: ``name``
        (the code under test: "module:attr" or "path/file.py:attr", None when not this kind), then
        its options."""
        return [(name, "str | None", None), *((option, "str", choices[0]) for option, choices in self.options.items())]

    def check(self, name: str, config: Any) -> None:
        """Raise ValueError, naming the value and the choices, for a config this kind cannot run."""
        for option, choices in self.options.items():
            value = getattr(config, option)
            if value not in choices:
                raise ValueError(f"{option}={value!r}; choose {' or '.join(repr(c) for c in choices)}")
        if getattr(config, name) is not None and self.one_cache and config.zeroers != 1:
            raise ValueError(f"zeroers={config.zeroers}: an episode with {name}= set holds one KV cache")


# Each kind, under the EpisodeConfig field that names its code under test. A new kind adds itself
# here only: its ops reach fuzz.engine.ops, and its field and options EpisodeConfig, from here.
COMPONENT_KINDS: dict[str, ComponentKind] = {
    # An offloader's store, load and get_finished (a poll, or a wait for one slot's job), and the
    # caller's eviction of a host slot (docs/offload-contract.md).
    "offloader": ComponentKind("fuzz.engine.offload:OffloadSide", "fuzz.engine.offload_rules:OffloadPart", {
        "store": (("block",), {"stream": 0}),
        "load": (("slot",), {"stream": 0, "oldest": 0}),
        "evict": (("slot",), {}),
        "poll": ((), {"sync": 0}),
        "wait": (("slot",), {}),
        # one of the streams the offloader made runs up to `ops` queued ops (fuzz.engine.offload_rules)
        "advance_own": (("stream",), {"ops": 1}),
    }, options={"host_memory": ("pinned", "registered")}, one_cache=True,  # registered: cudaHostRegister
        # An offloader's race needs a store, its report, a load and the call that races it (an
        # eviction, a free, the next load) in one program. SGLang #36738 and #27444 in the
        # controller's real shape were found by 7 and 9 of 16 seeds with the ci profile's 40
        # examples, by 10 and 14 with 120; a race-free offloader's campaign costs a few seconds more.
        examples_factor=3),
}


def chosen_kinds(config: Any) -> list[str]:
    """The kinds whose field ``config`` sets (at most one in a valid config)."""
    return [name for name in COMPONENT_KINDS if getattr(config, name, None) is not None]


def load(where: str) -> Any:
    """The attribute a kind names as ``"module:attr"``, imported only for a campaign of its kind."""
    import importlib

    module, attr = where.split(":")
    return getattr(importlib.import_module(module), attr)


def examples_factor(config: Any) -> int:
    """How many times the profile's examples a campaign of ``config`` runs (its kind's factor)."""
    chosen = chosen_kinds(config)
    return COMPONENT_KINDS[chosen[0]].examples_factor if chosen else 1


def build_component(core: CallerCore) -> Component | None:
    """The component ``core.config`` names, built on ``core``; None for a zeroer's campaign."""
    chosen = chosen_kinds(core.config)
    return load(COMPONENT_KINDS[chosen[0]].side)(core) if chosen else None


__all__ = ["COMPONENT_KINDS", "CallerCore", "Component", "ComponentKind", "build_component", "chosen_kinds",
           "examples_factor", "load"]
