"""One episode: a correct caller of zeroers, driven by operations that are plain data.

The fuzzer's rules, the replayer and exported scripts build op records such as
``{"op": "allocate", "n": 2, "stream": 1}`` (:mod:`fuzz.engine.ops`) and hand them to
:meth:`Episode.apply`; this is the only place that says what an op means (STYLE.md, "ops as
data, one executor").

The caller plays an inference engine's scheduler and model runner and keeps every promise of
the contract (docs/contract.md):

* (a) before a freed block is passed to ``zero_block_ids`` on stream ``S``, ``S`` waits for the
  event recorded after the block's last access (vLLM's deferred-free fence, #45357);
* (b) a write or read of a block on another stream than the one that zeroed it first waits for
  the event recorded after the zero call; more generally every access to a block is ordered after
  the previous one, so the caller never races itself.

Nothing else is promised, and the caller uses that freedom (c): calls land on any stream, the host
runs ahead without limit (the simulator is lazy), several zero calls share a step, up to
``in_flight`` steps are queued before the host waits for the oldest one (async scheduling), the
ids come in a list, tuple, numpy array or CPU tensor that the caller may scribble over or drop
once the call returns (promise 3), and an episode may hold several KV caches, one zeroer each,
built by the same factory and sharing the runtime and its streams (an engine builds one zeroer
per KV-cache group). A *caller-fault* configuration drops one kind of wait on purpose to show that
the oracle notices.

Example::

    episode = Episode(EpisodeConfig(zeroer="single_buffer"))
    episode.apply({"op": "start", "in_flight": 2})
    a = episode.apply({"op": "allocate", "n": 1, "stream": 0})
    b = episode.apply({"op": "allocate", "n": 1, "stream": 0})
    episode.apply({"op": "read", "block": a[0], "stream": 1})
    findings = episode.finish()       # block 1: expected zeros, observed the NaN poison
"""

from __future__ import annotations

import traceback
from collections import deque
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field, make_dataclass, replace
from typing import Any

import numpy as np
import torch

from fuzz.engine.free_queue import FreeQueue
from fuzz.engine.cache_pool import CachePool
from fuzz.engine.component import COMPONENT_KINDS, Component, build_component, chosen_kinds
from fuzz.engine.cuda_error import CUDA_ERROR, cuda_error_message, cuda_refusal
from fuzz.engine.harness_error import factory_error, harness_error, raise_if_harness
from fuzz.engine.ops import OPS, check_op
from fuzz.engine.oracle import Finding, Shadow, all_rows_match
from racecheck.resources import raise_if_gpu_lost, raise_if_resource
from racecheck.interrupts import interrupted
from zeroer.cache.geometries import geometry
from zeroer.cache.layout import CacheSpec, KVCache, build_cache
from zeroer.errors import ZeroerError
from kvdevice.origin import blame
from zeroer.protocol import BoundZeroer
from zeroer.registry import kernel_options, load_zeroer
from kvdevice.runtime import Event, make_runtime
from kvdevice.runtime.op_origin import HARNESS, failed_op

CALLER_FAULTS = ("no-free-fence", "no-zero-wait")
MAX_ZEROERS = 4

__all__ = ["CALLER_FAULTS", "OPS", "CachePool", "CodeUnderTestRaised", "Episode", "EpisodeConfig", "ZeroerRaised", "run_ops"]


@dataclass(frozen=True)
class CallerConfig:
    """The caller's settings of an episode; :data:`EpisodeConfig` adds each component kind's."""

    zeroer: str = "reference"  # a registered name, "module:attr" or "path/file.py:attr"
    geometry: str = "tiny"
    backend: str = "sim"  # "sim" or "cuda" (already resolved)
    mode: str = "controlled"  # cuda only: "controlled" (gates) or "free" (real timing)
    kernel: str | None = None  # built-in staged designs: "torch" or "triton"; None = their default
    streams: int = 3
    caller_fault: str | None = None  # one of CALLER_FAULTS, or None for a correct caller
    device: int | None = None  # cuda device index
    zeroers: int = 1  # KV caches in the episode, one zeroer each, built by the same factory
    # The caller synchronises the device after the zeroer's warm-up, as vLLM's start-up does; False:
    # the stricter caller of an engine whose start-up does not (docs/contract.md).
    warmup_sync: bool = True

    def __post_init__(self) -> None:
        if self.caller_fault not in (None, *CALLER_FAULTS):
            raise ValueError(f"caller_fault={self.caller_fault!r}; choose None or one of {', '.join(CALLER_FAULTS)}")
        if not isinstance(self.streams, int) or not 1 <= self.streams <= 8:
            raise ValueError(f"streams={self.streams!r} must be between 1 and 8")
        if not isinstance(self.zeroers, int) or not 1 <= self.zeroers <= MAX_ZEROERS:
            raise ValueError(f"zeroers={self.zeroers!r} must be between 1 and {MAX_ZEROERS}")
        chosen = chosen_kinds(self)
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(f'{name}=' for name in chosen)} are set; an episode drives one component beside the zeroer")
        for name, kind in COMPONENT_KINDS.items():
            kind.check(name, self)


# Everything an episode needs besides its ops; a campaign is one of these plus settings. Each
# component kind adds the field naming its code under test and its options
# (fuzz.engine.component.COMPONENT_KINDS): an offload campaign sets offloader= (with the harness's
# reference zeroer zeroing allocations, fuzz.engine.offload) and host_memory= ("pinned" or
# "registered").
EpisodeConfig = make_dataclass(
    "EpisodeConfig", [f for name, kind in COMPONENT_KINDS.items() for f in kind.config_fields(name)],
    bases=(CallerConfig,), frozen=True, namespace={"__module__": __name__, "__qualname__": "EpisodeConfig"},
)


class ContractError(ZeroerError, ValueError):
    """An op that would call the zeroer outside its declared contract (a container it does not
    take): a harness error the user can fix, never a finding (fuzz.engine.harness_error)."""

    user_fixable = True


class CodeUnderTestRaised(Exception):
    """A call of the code under test (the zeroer, or a component: an offloader), or the device work
    it queued, raised: ``finding`` is the finding filed under its kind (``offloader raised``)."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.message)
        self.finding = finding


# The name it had while only zeroers were under test: scripts exported before the rename
# (python -m repro export) import it.
ZeroerRaised = CodeUnderTestRaised


@dataclass
class _Access:
    stream: int
    event: Event
    kind: str  # "zero", "write", "read", "poison"


@dataclass
class _Capture:
    block: int
    expect: int
    where: str
    history: list[str]
    data: list[torch.Tensor] = field(default_factory=list)
    kind: str | None = None  # the finding's kind if it differs (None: by the words, fuzz.engine.oracle)
    step: int | None = None  # the step that queued the read, and the stream it ran on: its finding's place
    stream: int | None = None
    done: Event | None = None  # recorded behind the read on its stream: its words are final once it completes


class CacheGroup:
    """One KV cache, the zeroer built for it, and the caller's book of its blocks."""

    def __init__(self, index: int, cache: KVCache, many: bool) -> None:
        self.index = index
        self.label = f"cache {index}: " if many else ""  # how a message names it, where there are several
        self.cache = cache
        self.zeroer: BoundZeroer | None = None
        num_blocks = cache.spec.num_blocks
        self.shadow = Shadow(num_blocks)
        self.free: FreeQueue = FreeQueue(num_blocks)  # FIFO, like vLLM's free block queue
        self.last: dict[int, _Access] = {}
        self.captures: list[_Capture] = []
        self.retired: list[KVCache] = []  # what reallocations replaced, recycled at close()


# ids_as -> the ids as the caller hands them over (an engine passes lists, arrays and tensors).
_NOT_OWNED = nullcontext()  # a scope that names no owner (device work: each op's own origin says)
_CONTAINERS = {"list": list, "tuple": tuple, "array": lambda ids: np.array(ids, dtype=np.int64),
               "tensor": lambda ids: torch.tensor(ids, dtype=torch.int64)}


def _scribble(container: Any, values: list[int]) -> None:
    """Overwrite the caller's container in place, as a caller reusing it for its next call does."""
    if isinstance(container, (list, np.ndarray)):
        container[:] = values[: len(container)]
    elif isinstance(container, torch.Tensor):
        container.copy_(torch.tensor(values[: container.numel()], dtype=container.dtype))
    # a tuple cannot change: nothing to do


class Episode:
    """Executes op records against a fresh runtime, caches and zeroers; collects findings.

    ``caches``: where to take caches from and give them back to when the episode closes (the
    fuzzer's :class:`CachePool`, simulator only); None builds new ones, which nothing else sees.
    """

    def __init__(self, config: EpisodeConfig, caches: CachePool | None = None) -> None:
        self.config = config
        if config.backend == "cuda":
            raise_if_gpu_lost()  # an earlier campaign's fault left this process's GPU unusable
        self.rt = make_runtime(config.backend, mode=config.mode, device=config.device)
        self.groups: list[CacheGroup] = []
        # The component under test beside the zeroer (an offloader's side, fuzz.engine.offload), or
        # None: it plugs in through fuzz.engine.component.Component, and the episode knows no more of it.
        self.component: Component | None = None
        try:
            self._build(caches)
        except BaseException:
            # A factory that raises (a usage error), caches that do not fit, Ctrl-C: nobody holds
            # this half-built episode to close it, so its runtime goes now (on cuda its gates open,
            # and a sanitizer in this process no longer steps aside for it), not at collection.
            self.abandon()
            raise

    def _build(self, caches: CachePool | None) -> None:
        """Everything of the episode but its runtime (__init__ releases that if this raises)."""
        config = self.config
        self.streams = [self.rt.default_stream] + [self.rt.new_stream(f"s{i}") for i in range(1, config.streams)]
        # Recycled caches on the simulator only: there close() means every queued op has run,
        # while a cuda runtime that lost its schedule may close with kernels still running.
        self._caches = caches if self.rt.backend == "sim" else None
        self.loaded = load_zeroer(config.zeroer)
        spec = geometry(config.geometry)
        self.groups = [CacheGroup(i, self._new_cache(spec), config.zeroers > 1) for i in range(config.zeroers)]
        self.trace: list[dict] = []
        self.findings: list[Finding] = []
        self.in_flight = 1
        self._steps_queued: deque[Event] = deque()
        self.owners = 0
        self._hazards_seen = 0
        self.fresh_findings: list[Finding] = []  # value findings made during an op (an offloader's poll)
        self.in_op = False  # an op is running: an interruption now leaves the episode unjudgeable
        self.finished = False
        # Construction is the episode's first device work, and like the warm-up it runs ungated: on
        # controlled cuda each op runs as it is issued (a constructor's first launch of a kernel
        # loads its module, which waits for the GPU to drain), and none is left queued behind a gate
        # for the warm-up's ungated() to refuse (HiCache's constructor stages its tables and free
        # slots on the device). Elsewhere a plain scope: the simulator queues them as before.
        with self.rt.ungated():
            for group in self.groups:
                with self.factory_call("zeroer", self.loaded.spec, "(cache, runtime)"):
                    group.zeroer = self.loaded.build(group.cache, self.rt, **kernel_options(config.zeroer, config.kernel))
            self.component = build_component(self)
        self._component_ops = self.component.ops() if self.component is not None else {}  # looked up per op

    # The first cache, for the common one-zeroer episode (tests and baselines read these).
    @property
    def cache(self) -> KVCache:
        return self.groups[0].cache

    @property
    def zeroer(self) -> BoundZeroer:
        return self.groups[0].zeroer

    @property
    def shadow(self) -> Shadow:
        return self.groups[0].shadow

    @property
    def free(self) -> deque[int]:
        return self.groups[0].free

    # -- the one executor -----------------------------------------------------------------------
    def apply(self, op: dict) -> Any:
        name, args = check_op(op)
        self.trace.append(dict(op))
        self.in_op = True
        run = getattr(self, f"_op_{name}", None) or self._component_ops.get(name)
        if run is None:
            kind = self.component.noun if self.component is not None else "none"
            raise ValueError(f"op {name!r} needs a component that has it: this episode's is {kind}")
        result = run(**args)
        self.in_op = False
        return result

    @property
    def step(self) -> int:
        return len(self.trace)

    def stream_of(self, index: int):
        if not 0 <= index < len(self.streams):
            raise ValueError(f"stream {index} does not exist; this episode has {len(self.streams)} (valid: 0..{len(self.streams) - 1})")
        return self.streams[index]

    def _group(self, index: int) -> CacheGroup:
        if not 0 <= index < len(self.groups):
            raise ValueError(f"cache {index} does not exist; this episode has {len(self.groups)} (valid: 0..{len(self.groups) - 1})")
        return self.groups[index]

    def note(self, text: str) -> str:
        return f"step {self.step} {text}"

    @property
    def under_test(self) -> str:
        """The kind of code under test: the component's (``"offloader"``), else ``"zeroer"``. Beside a
        component the zeroer is the harness's own (fuzz.engine.offload)."""
        kinds = chosen_kinds(self.config)
        return kinds[0] if kinds else "zeroer"

    def zeroer_call(self, group: CacheGroup, call: str) -> _Scope:
        """One call of ``group``'s zeroer (``call`` names it: ``zero_block_ids([3])``): the ops it
        queues are the zeroer's, and what it raises is its finding, not the harness's error."""
        return _Scope(lambda error: self._raised_in_call(group, "zeroer", call, error), self.rt.annotate(owner="zeroer"))

    def component_call(self, group: CacheGroup, call: str) -> _Scope:
        """One call of the component's code (``call`` names it: ``store(2, [1], [1])``): the ops it
        queues are the component's, and what it raises is its finding, not the harness's error."""
        who = self.under_test
        return _Scope(lambda error: self._raised_in_call(group, who, call, error), self.rt.annotate(owner=who))

    def _raised_in_call(self, group: CacheGroup, who: str, call: str, error: Exception) -> None:
        during = f"the {who}'s {call}"
        raise_if_resource(error, f"in {call if who == 'zeroer' else during}")
        # An unroutable call, a simulator gap, a clash in the runtime: the harness's, not a finding.
        raise_if_harness(error, during + (f" (cache {group.index})" if group.label else ""), step=self.step)
        raise CodeUnderTestRaised(_raised_finding(self, who, group.label + call, error)) from error

    def factory_call(self, component: str, spec: str, signature: str) -> _Scope:
        """What a factory raises is a usage error (exit status 2), never a finding. Code that cannot
        be built was never run; only what the zeroer or offloader raises once it exists is judged
        (fuzz.engine.harness_error.factory_error). The ops its constructor queues are its own."""
        return _Scope(lambda error: self._raised_in_factory(component, spec, signature, error),
                      self.rt.annotate(owner=component))

    def _raised_in_factory(self, component: str, spec: str, signature: str, error: Exception) -> None:
        raise_if_resource(error, f"in the {component}'s factory")
        # The harness refusing what the factory built or asked for keeps its own line (and status).
        raise_if_harness(error, f"the {component}'s factory", step=self.step)
        raise factory_error(error, component, spec, signature) from error

    def order_before(self, group: CacheGroup, block: int, stream: int, skip_kinds: tuple[str, ...] = ()) -> None:
        last = group.last.get(block)
        if last is not None and last.stream != stream and last.kind not in skip_kinds:
            self.rt.wait_event(last.event, stream=self.stream_of(stream))

    def _accessed(self, group: CacheGroup, blocks: list[int], stream: int, kind: str) -> Event:
        event = self.rt.record_event(stream=self.stream_of(stream))
        for block in blocks:
            group.last[block] = _Access(stream, event, kind)
        return event

    def device_work(self, fn: Any, *args: Any) -> Any:
        """Run a runtime call that may execute queued device work. An op of the code under test
        that raises there (the runtime marks the error with the op and its origin) is its finding;
        any other op's is a harness error."""
        with _Scope(self._raised_in_device_work):
            return fn(*args)

    def _raised_in_device_work(self, error: Exception) -> None:
        failed = failed_op(error)  # the queued op the runtime ran when it raised
        label = failed.label if failed is not None else None
        raise_if_resource(error, f"running queued device work ({label or 'op unknown'})")
        # Whose the op is, its origin says (kvdevice.runtime.op_origin), never its label: the code
        # under test names its own kernels, and may call one "write" as the caller does.
        who = self.under_test
        if failed is None or failed.origin is None or failed.origin.owner != who:
            raise harness_error(error, f"the harness's queued op {label or '(unknown)'}", step=self.step) from error
        raise_if_harness(error, f"the {who}'s queued op {label}", step=self.step)
        raise CodeUnderTestRaised(_raised_finding(self, who, f"queued op {label}", error, its=True)) from error

    # -- ops ---------------------------------------------------------------------------------
    def _op_start(self, in_flight: int = 1) -> None:
        if not 1 <= in_flight <= 8:
            raise ValueError(f"in_flight={in_flight!r} must be between 1 and 8 steps")
        self.in_flight = in_flight
        # On controlled cuda the first launch of a kernel loads its module, which waits for the
        # GPU to drain and never returns while a gate spins: warm every kernel up ungated.
        with self.rt.ungated(), self.rt.annotate("warm-up", owner=HARNESS):
            for group in self.groups:
                with self.rt.block_space(group.index):
                    group.cache.fill_pages([0], 0)  # the write/poison kernel
                    for words in group.cache.block_words(0):
                        words.clone()  # the read kernel
                    with self.zeroer_call(group, "warmup"):
                        group.zeroer.warmup(group.cache.spec.num_blocks)
            if self.component is not None:  # the harness's own zeroer is not under test: drain it first
                self.device_work(self.rt.synchronize)
                self.component.warmup()
        if self.config.warmup_sync and self.component is None:  # not the stricter caller (docs/contract.md)
            self.device_work(self.rt.synchronize)
        self._settle_outside_work()

    def _new_cache(self, spec: CacheSpec) -> KVCache:
        cache = self._caches.take(spec, self.rt.device) if self._caches is not None else build_cache(spec, device=self.rt.device)
        self._settle_outside_work()  # the cache's poison and guard fill
        return cache

    def _settle_outside_work(self) -> None:
        # Work issued outside the runtime (building the cache, the warm-up's direct kernels) runs
        # on torch's current stream, which the runtime's non-blocking streams are not ordered
        # with: wait for it so it cannot land on top of the episode's first ops.
        if self.rt.device.type == "cuda":
            torch.cuda.current_stream(self.rt.device).synchronize()

    def _op_allocate(self, n: int, stream: int = 0, cache: int = 0, ids_as: str = "list", then: str = "keep") -> list[int]:
        group = self._group(cache)
        if not 1 <= n <= len(group.free):
            raise ValueError(f"allocate n={n}: {len(group.free)} blocks are free in cache {cache}")
        if ids_as not in group.zeroer.ids_as:  # only a trace written by hand gets here: the fuzzer keeps to the contract
            raise ContractError(
                f"allocate ids_as={ids_as!r}: zeroer {self.config.zeroer!r} takes its ids as "
                f"{' or '.join(group.zeroer.ids_as)} (from its zero_block_ids annotation or its "
                f"Capabilities(ids_as=...)), so a caller inside its contract never hands over a {ids_as}; "
                f"drop the field from the op, or declare the container on the zeroer's factory"
            )
        ids = [group.free.popleft() for _ in range(n)]
        skip = ("poison", "zero", "write", "read") if self.config.caller_fault == "no-free-fence" else ()
        for block in ids:
            self.order_before(group, block, stream, skip)  # caller promise (a)
        self.owners += 1
        handed = _CONTAINERS[ids_as](ids)
        with self.rt.use_stream(self.stream_of(stream)), self.rt.annotate(f"step {self.step} allocate_blocks", owner=HARNESS), \
                self.rt.block_space(group.index), self.zeroer_call(group, f"zero_block_ids({ids})"):
            group.zeroer.zero_block_ids(handed)
        # The list is the caller's again (promise 3): reuse it for something else, or let it go.
        if then == "scribble":
            others = [b for b, s in enumerate(group.shadow.blocks) if s.state == "live" and b not in ids] or [0]
            _scribble(handed, [others[i % len(others)] for i in range(n)])
        elif then == "drop":
            del handed
        note = self.note(f"allocate_blocks: {group.label}zero_block_ids({ids}) on stream {stream}")
        for block in ids:
            group.shadow.zeroed(block, self.owners, note)
        self._accessed(group, ids, stream, "zero")
        return ids

    def hand_out(self, group: CacheGroup, stream: int, *, oldest: bool = False) -> int:
        """A free block of ``group`` for a component to fill on ``stream`` (an offloader's load): the one
        freed last, or with ``oldest`` the queue's head; its last tenant is ordered before ``stream``
        (caller promise (a)) and it gets a new owner tag (:attr:`owners`)."""
        if not group.free:
            raise ValueError("no device block is free")
        block = group.free.popleft() if oldest else group.free.pop()
        self.order_before(group, block, stream)
        group.last.pop(block, None)
        self.owners += 1
        return block

    def check_live(self, group: CacheGroup, block: int, what: str) -> None:
        if not isinstance(block, int) or not 0 <= block < len(group.shadow.blocks):
            raise ValueError(f"{what} block {block!r}: cache {group.index} has blocks 0..{len(group.shadow.blocks) - 1}")
        if group.shadow.blocks[block].state != "live":
            raise ValueError(f"{what} block {block}: it is {group.shadow.blocks[block].state}, not live")

    def _check_not_held(self, block: int, what: str) -> None:
        held = self.component.holding(block) if self.component is not None else None
        if held is not None:
            raise ValueError(f"{what} block {block}: {held}")

    def _op_write(self, block: int, stream: int = 0, cache: int = 0) -> None:
        group = self._group(cache)
        self.check_live(group, block, "write")
        self._check_not_held(block, "write")
        skip = ("zero",) if self.config.caller_fault == "no-zero-wait" else ()
        self.order_before(group, block, stream, skip)  # caller promise (b)
        value = group.shadow.written(block, self.note(f"write_block on stream {stream}"))
        pages = group.cache
        with self.rt.annotate(f"step {self.step} write_block", owner=HARNESS), self.rt.block_space(group.index):
            self.rt.launch(lambda: pages.fill_pages([block], value), name="write", stream=self.stream_of(stream), blocks_written=[block])
        self._accessed(group, [block], stream, "write")

    def _op_read(self, block: int, stream: int = 0, cache: int = 0) -> None:
        group = self._group(cache)
        self.check_live(group, block, "read")
        skip = ("zero",) if self.config.caller_fault == "no-zero-wait" else ()
        self.order_before(group, block, stream, skip)
        self.read_capture(group, block, stream, where=f"step {self.step} read_block on stream {stream}")

    def read_capture(self, group: CacheGroup, block: int, stream: int, where: str, kind: str | None = None) -> None:
        """Read ``block`` on ``stream`` (the caller has ordered it) and keep what it saw for the verdict."""
        shadow = group.shadow.blocks[block]
        capture = _Capture(block, shadow.expect, where, list(shadow.history), kind=kind, step=self.step, stream=stream)
        pages = group.cache

        def read() -> None:
            capture.data = [words.clone() for words in pages.block_words(block)]

        with self.rt.annotate(f"step {self.step} read_block", owner=HARNESS), self.rt.block_space(group.index):
            self.rt.launch(read, name="read", stream=self.stream_of(stream), blocks_read=[block])
        group.captures.append(capture)
        capture.done = self._accessed(group, [block], stream, "read")

    def _op_free(self, block: int, cache: int = 0) -> None:
        group = self._group(cache)
        self.check_live(group, block, "free")
        self._check_not_held(block, "free")
        last = group.last[block]
        group.shadow.freed(block, self.note("free_block, then poisoned"))
        pages = group.cache
        # The page's next tenant (fp32 Mamba state) leaves NaN bytes behind; ordered after the
        # block's last access on that access's stream.
        with self.rt.annotate(f"step {self.step} free_block", owner=HARNESS), self.rt.block_space(group.index):
            self.rt.launch(lambda: pages.poison([block]), name="poison", stream=self.stream_of(last.stream), blocks_written=[block])
        self._accessed(group, [block], last.stream, "poison")
        group.free.append(block)

    def _op_advance(self, stream: int, ops: int = 1) -> int:
        return self.device_work(self.rt.advance, self.stream_of(stream), ops)

    def _op_delay(self, stream: int, amount: int = 1) -> None:
        self.rt.delay(self.stream_of(stream), amount)

    def _op_end_step(self) -> None:
        self._steps_queued.append(self.rt.record_event(stream=self.streams[0]))
        while len(self._steps_queued) > self.in_flight:
            self.device_work(self.rt.synchronize_event, self._steps_queued.popleft())

    def _op_sync_stream(self, stream: int) -> None:
        self.device_work(self.rt.synchronize_stream, self.stream_of(stream))

    def _op_sync_device(self) -> None:
        self.device_work(self.rt.synchronize)

    def _op_reallocate(self, cache: int = 0) -> None:
        # The engine moves its KV cache (a resize, a re-initialisation): the host drains the
        # device, copies every page to fresh buffers at new addresses and swaps them into the
        # same KVCache object, whose table then points at the new memory. A zeroer must read
        # the table when it launches (docs/contract.md; zoo.stale_table does not).
        group = self._group(cache)
        if self.component is not None and self.component.keeps_cache_tensors:
            raise ValueError(f"reallocate: {self.component.noun} keeps the tensors it was built with, so this episode's cache does not move")
        if not self.loaded.capabilities.follows_reallocation:
            raise ValueError(
                f"reallocate: zeroer {self.config.zeroer!r} does not declare "
                f"Capabilities(follows_reallocation=True)"
            )
        self.device_work(self.rt.synchronize)
        fresh = self._new_cache(group.cache.spec)
        for new, old in zip(fresh.raws, group.cache.raws):
            new.copy_(old)
        self._settle_outside_work()
        # Swap contents: the group's KVCache object takes the new buffers, and ``fresh`` keeps
        # the old ones, alive until the episode closes (a zeroer that missed the move may still
        # write there; they are never handed to anyone else before then).
        moved = dict(vars(group.cache))
        vars(group.cache).update(vars(fresh))
        vars(fresh).update(moved)
        group.retired.append(fresh)

    # -- verdicts ------------------------------------------------------------------------------
    def new_hazard_findings(self) -> list[Finding]:
        """Happens-before findings since the last call (cheap: checked after every step), and the
        value findings an op made at once (an offloader's finished job checked at its report)."""
        if self.fresh_findings:
            fresh, self.fresh_findings = self.fresh_findings, []
            return fresh + self.new_hazard_findings()
        if len(self.rt.hazards) == self._hazards_seen:
            return []  # the common case
        hazards = self.rt.hazards[self._hazards_seen :]
        self._hazards_seen = len(self.rt.hazards)
        found = [
            Finding("hazard", None, f"hazard at step {self.step}: {h.message}", self.config.caller_fault is not None,
                    step=self.step)
            for h in hazards
        ]
        self.findings.extend(found)
        return found

    def queued(self) -> int:
        """Device ops queued and not yet run, on every stream (how far the host is ahead)."""
        return sum(self.rt.pending(s) for s in self.streams)

    def finish(self) -> list[Finding]:
        """Synchronise once, verify every capture and the final state; return all findings."""
        if self.finished:
            return self.findings
        self.finished = True
        try:
            self._judge()
        except BaseException:
            self.abandon()  # no verdict: released unjudged, as an episode cut off earlier is
            raise
        self.close()
        return self.findings

    def _judge(self) -> None:
        self.device_work(self.rt.synchronize)
        self.new_hazard_findings()
        if self.component is not None:
            self.component.finish()
            self.fresh_findings = []
            # What the component enqueued as it finished (a read of each block a load reported
            # only now filled) runs before the verdict: unrun, the read's words are whatever the
            # allocator's memory held (on the GPU, a late-freed index tensor's int64 ids).
            self.device_work(self.rt.synchronize)
            self.new_hazard_findings()
        fault = self.config.caller_fault is not None
        for group in self.groups:
            self._reads_done(group)
            for finding in _verify(group):
                self.findings.append(replace(finding, message=group.label + finding.message, caller_fault=fault))

    def _reads_done(self, group: CacheGroup) -> None:
        """Wait for every read of ``group`` before the verdict looks at its words.

        On cuda a read's words are tensors from the moment it is enqueued (its clone allocates
        them at the enqueue, and in the controlled mode copies into them only once the read's gate
        opens); until then they hold their memory's last tenant's bytes. The verdict reads them on
        torch's current stream, which no runtime stream is ordered with, so it is ordered after
        each read here, by the event recorded behind it, wherever the read was enqueued. Unordered,
        a load first reported by the episode's last poll was judged on a freed index tensor's
        int64 row ids (a false 'wrong bytes loaded' on an H100: word 0 read 1)."""
        for capture in group.captures:
            self.device_work(self.rt.synchronize_event, capture.done)

    def close(self) -> None:
        """Let every queued op run, release the runtime and give the caches back to the pool."""
        # Now, not when the garbage collector gets to it: graph_ring's graphs destroyed in the
        # middle of a later example's graph capture would break that capture.
        try:
            if self.component is not None:
                self.component.close()
            for group in self.groups:
                if group.zeroer is not None:
                    with self.zeroer_call(group, "close"):
                        group.zeroer.close()
        finally:
            self.rt.close()
            if self.component is not None:
                self.component.release()
            self.finished = True
        # Only a close that ran to its end hands the caches back (only now can nothing write to
        # them any more); after an exception or Ctrl-C above they are dropped, as abandon() does.
        if self._caches is not None and not interrupted():
            self._caches.give([c for g in self.groups for c in (g.cache, *g.retired)])
        self._caches = None

    def abandon(self) -> None:
        """Release everything without judging (an interrupted or failed episode)."""
        self.finished = True
        self._caches = None  # a cut-off episode's caches are not trusted back into the pool
        # Best effort, each step on its own: the episode is being thrown away.
        with suppress(Exception):
            if self.component is not None:
                self.component.abandon()
        with suppress(Exception):
            for group in self.groups:
                if group.zeroer is not None:
                    group.zeroer.close()
        with suppress(Exception):
            self.rt.close()
        with suppress(Exception):
            if self.component is not None:
                self.component.release()
        # A failed example's exception (and Hypothesis, which keeps it while shrinking) holds this
        # episode through its traceback, and reference cycles wait for the garbage collector: on
        # cuda that pinned a 5 GiB cache per failing example (int32_wrap) until the GPU ran out of
        # memory. Let go of the device memory now; the episode is not used after this.
        for group in self.groups:
            group.zeroer, group.cache, group.retired = None, None, []


def _verify(group: CacheGroup) -> list[Finding]:
    """Every capture and the final state of one cache, against its shadow."""
    findings: list[Finding] = []
    cache, shadow = group.cache, group.shadow
    # One vectorised compare per segment first (what a clean episode costs); only when it
    # fails are reads and blocks verified one by one, to find and phrase what differs.
    segments = range(len(cache.segments))
    captures = group.captures
    unrun = [c.where for c in captures if len(c.data) != len(segments)]
    if unrun:  # a verdict on words no read produced would be made up
        raise RuntimeError(f"the read at {unrun[0]} had not run when the episode was verified")
    if captures and not (
        all_rows_match([torch.stack([c.data[seg] for c in captures]) for seg in segments], [c.expect for c in captures])
    ):
        for capture in captures:
            data = [d.cpu() for d in capture.data]
            finding = shadow.verify(capture.block, capture.expect, data, capture.where, capture.history, kind=capture.kind)
            if finding is not None:
                findings.append(replace(finding, step=capture.step, stream=capture.stream))
    if not all_rows_match([cache.pages(seg) for seg in segments], [s.expect for s in shadow.blocks]):
        for block, expected in enumerate(shadow.blocks):
            words = [w.cpu() for w in cache.block_words(block)]
            finding = shadow.verify(block, expected.expect, words, "the end of the episode", expected.history)
            if finding is not None:
                findings.append(finding)
    for violation in cache.guard_violations():
        findings.append(Finding("stray write", None, f"stray write: {violation}"))
    return findings


class _Scope:
    """The scope of one call of the code under test: inside, ``owned`` (the runtime's annotation
    naming whose code it is) holds; an Exception it raises (other than a finding already made) goes
    to ``handle``, which raises what it stands for (a finding, a usage error)."""

    __slots__ = ("_handle", "_owned")

    def __init__(self, handle: Any, owned: Any = None) -> None:
        self._handle, self._owned = handle, owned if owned is not None else _NOT_OWNED

    def __enter__(self) -> None:
        self._owned.__enter__()

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        self._owned.__exit__(kind, error, tb)
        if isinstance(error, Exception) and not isinstance(error, CodeUnderTestRaised):
            if interrupted():  # after Ctrl-C, not the code's error: what caught the KeyboardInterrupt made it
                raise KeyboardInterrupt("the run was interrupted") from error
            self._handle(error)
        return False


def _raised_finding(episode: Episode, who: str, call: str, error: BaseException, *, its: bool = False) -> Finding:
    """``who`` (``zeroer`` or a component kind) raised in ``call`` (``its``: a thing of the code's
    own, its queued op): its finding, filed under its name, or as a ``cuda error`` when CUDA
    refused a call of its own (fuzz.engine.cuda_error)."""
    details = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    # Where in the zeroer's code it came from: what makes two raises the same bug (fuzz.engine.signature).
    where = blame(error).where or ""
    refusal = cuda_refusal(error)
    if refusal is not None:
        kind = CUDA_ERROR
        message = cuda_error_message(episode.step, f"the {who}'s {call}", where, refusal,
                                     _cuda_error_meaning(episode, who, call, error), error)
    else:
        kind = f"{who} raised"
        message = f"{who} raised at step {episode.step} in {'its ' if its else ''}{call}: {type(error).__name__}: {error}"
    finding = Finding(kind, None, message, episode.config.caller_fault is not None, details, where, step=episode.step)
    episode.findings.append(finding)
    return finding


def _cuda_error_meaning(episode: Episode, who: str, call: str, error: BaseException) -> str | None:
    """What CUDA's refusal of ``call`` says of the code under test, where its kind knows
    (an offloader's get_finished() timing an unfinished job: it reported the job early)."""
    explain = getattr(episode.component, "explain_cuda_error", None)
    if explain is None or who == "zeroer":
        return None
    return explain(call, error)


def count_shown(config: EpisodeConfig, ops: list[dict], replays: int) -> int:
    """In how many of ``replays`` runs of ``ops`` a finding showed."""
    return sum(1 for _ in range(replays) if run_ops(config, ops))


def run_ops(config: EpisodeConfig, ops: list[dict], caches: CachePool | None = None) -> list[Finding]:
    """Run ``ops`` as one episode and judge it: the findings (none: clean).

    Like the fuzzer, it stops at the first happens-before hazard, then synchronises once and lets
    the oracle check every read and every block. A program that is not valid here (an op on a
    block that is not live) raises ValueError; a factory that raises, a usage error
    (:class:`~fuzz.engine.harness_error.HarnessError`, status 2): nothing was built to run them on.
    """
    episode = Episode(config, caches=caches)
    try:
        for op in ops:
            episode.apply(op)
            if episode.new_hazard_findings():
                break
        return episode.finish()
    except CodeUnderTestRaised:
        return list(episode.findings)
    finally:
        if not episode.finished:  # an op raised: still free the runtime (open every gate on cuda)
            episode.abandon()
