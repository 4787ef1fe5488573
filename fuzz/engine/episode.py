"""One episode: a correct caller of a zeroer, driven by operations that are plain data.

The fuzzer's rules, and later the replayer, build op records such as
``{"op": "allocate", "n": 2, "stream": 1}`` and hand them to :meth:`Episode.apply`; this is the
only place that says what an op means (STYLE.md, "ops as data, one executor").

The caller plays an inference engine's scheduler and model runner and keeps every promise of
the contract (docs/contract.md):

* (a) before a freed block is passed to ``zero_block_ids`` on stream ``S``, ``S`` waits for the
  event recorded after the block's last access (vLLM's deferred-free fence, #45357);
* (b) a write or read of a block on another stream than the one that zeroed it first waits for
  the event recorded after the zero call; more generally every access to a block is ordered after
  the previous one, so the caller never races itself.

Nothing else is promised: calls land on any stream, the host runs ahead without limit (the
simulator is lazy), several zero calls share a step, and up to ``in_flight`` steps are queued
before the host waits for the oldest one (async scheduling). A *caller-fault* configuration drops
one kind of wait on purpose to show that the oracle notices.

Example::

    episode = Episode(EpisodeConfig(zeroer="single_buffer"))
    episode.apply({"op": "start", "in_flight": 2})
    a = episode.apply({"op": "allocate", "n": 1, "stream": 0})
    b = episode.apply({"op": "allocate", "n": 1, "stream": 0})
    episode.apply({"op": "read", "block": a[0], "stream": 1})
    findings = episode.finish()       # block 1: expected zeros, observed the NaN poison
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroer.cache.geometries import geometry
from zeroer.cache.layout import CacheSpec, KVCache, build_cache
from zeroer.registry import kernel_options, load_zeroer
from zeroer.runtime import Event, Runtime, make_runtime

from fuzz.engine.oracle import Finding, Shadow, all_rows_match

CALLER_FAULTS = ("no-free-fence", "no-zero-wait")
OPS = ("advance", "allocate", "delay", "end_step", "free", "read", "reallocate", "start", "sync_device", "sync_stream", "write")


@dataclass(frozen=True)
class EpisodeConfig:
    """Everything an episode needs besides its ops; a campaign is one of these plus settings."""

    zeroer: str = "reference"  # a registered name, "module:attr" or "path/file.py:attr"
    geometry: str = "tiny"
    backend: str = "sim"  # "sim" or "cuda" (already resolved)
    mode: str = "controlled"  # cuda only: "controlled" (gates) or "free" (real timing)
    kernel: str | None = None  # built-in staged designs: "torch" or "triton"; None = their default
    streams: int = 3
    caller_fault: str | None = None  # one of CALLER_FAULTS, or None for a correct caller
    device: int | None = None  # cuda device index

    def __post_init__(self) -> None:
        if self.caller_fault not in (None, *CALLER_FAULTS):
            raise ValueError(f"caller_fault={self.caller_fault!r}; choose None or one of {', '.join(CALLER_FAULTS)}")
        if not 1 <= self.streams <= 8:
            raise ValueError(f"streams={self.streams!r} must be between 1 and 8")


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


class CachePool:
    """KV caches in their freshly built state, recycled from episodes that are done with them.

    Building a cache (guarded buffers, typed views, the segment table: dozens of small torch
    calls) took 4 to 7% of a simulator campaign's time, once per example and once per
    reallocation, so the fuzzer's episodes share a pool. A cache goes back only once its
    episode's simulated runtime has run every queued op and closed (:meth:`Episode.close`), so
    nothing can still write to it, and comes out with its buffers restored word for word to
    what ``build_cache`` makes (guards, poisoned pages): no state passes from one example to the
    next. Only the addresses repeat, which nothing may rely on (a fresh cache's are arbitrary
    too).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[CacheSpec, str], list[KVCache]] = {}
        self._pristine: dict[tuple[CacheSpec, str], list[torch.Tensor]] = {}  # build_cache's words

    def take(self, spec: CacheSpec, device: torch.device) -> KVCache:
        key = (spec, str(device))
        free = self._free.get(key)
        if not free:
            cache = build_cache(spec, device=device)
            self._pristine.setdefault(key, [raw.clone() for raw in cache.raws])
            return cache
        cache = free.pop()
        for raw, pristine in zip(cache.raws, self._pristine[key]):
            raw.copy_(pristine)
        return cache

    def give(self, caches: list[KVCache]) -> None:
        for cache in caches:
            self._free.setdefault((cache.spec, str(cache.device)), []).append(cache)


class Episode:
    """Executes op records against a fresh runtime, cache and zeroer; collects findings.

    ``caches``: where to take the cache from and give it back to when the episode closes (the
    fuzzer's :class:`CachePool`, simulator only); None builds a new one, which nothing else ever
    sees.
    """

    def __init__(self, config: EpisodeConfig, caches: CachePool | None = None) -> None:
        self.config = config
        self.rt = make_runtime(config.backend, mode=config.mode, device=config.device)
        self.streams = [self.rt.default_stream] + [self.rt.new_stream(f"s{i}") for i in range(1, config.streams)]
        # Recycled caches on the simulator only: there close() means every queued op has run,
        # while a cuda runtime that lost its schedule may close with kernels still running.
        self._caches = caches if self.rt.backend == "sim" else None
        self._retired: list[KVCache] = []  # what reallocations replaced, recycled at close()
        self.cache = self._new_cache(geometry(config.geometry))
        self.loaded = load_zeroer(config.zeroer)
        self.zeroer = self.loaded.build(self.cache, self.rt, **kernel_options(config.zeroer, config.kernel))
        num_blocks = self.cache.spec.num_blocks
        self.shadow = Shadow(num_blocks)
        self.free: deque[int] = deque(range(1, num_blocks))  # FIFO, like vLLM's free block queue
        self.last: dict[int, _Access] = {}
        self.captures: list[_Capture] = []
        self.trace: list[dict] = []
        self.findings: list[Finding] = []
        self.in_flight = 1
        self._steps_queued: deque[Event] = deque()
        self._owners = 0
        self._hazards_seen = 0
        self.finished = False

    # -- the one executor -----------------------------------------------------------------------
    def apply(self, op: dict) -> Any:
        name = op.get("op")
        if name not in OPS:
            raise ValueError(f"unknown op {name!r}; ops: {', '.join(OPS)}")
        args = {k: v for k, v in op.items() if k != "op"}
        fields, required = _OP_FIELDS[name]
        if not (args.keys() <= fields and required <= args.keys()):  # set views: no sorting on the hot path
            unknown = sorted(args.keys() - fields)
            missing = sorted(required - args.keys())
            raise ValueError(
                f"op {name!r} {'has unknown field ' + repr(unknown[0]) if unknown else 'is missing field ' + repr(missing[0])}; "
                f"its fields are: {', '.join(_OP_FIELD_ORDER[name]) or 'none'}"
            )
        self.trace.append(dict(op))
        return _OP_METHODS[name](self, **args)

    @property
    def step(self) -> int:
        return len(self.trace)

    def _stream(self, index: int):
        if not 0 <= index < len(self.streams):
            raise ValueError(f"stream {index} does not exist; this episode has {len(self.streams)} (valid: 0..{len(self.streams) - 1})")
        return self.streams[index]

    def _note(self, text: str) -> str:
        return f"step {self.step} {text}"

    def _order_before(self, block: int, stream: int, skip_kinds: tuple[str, ...] = ()) -> None:
        last = self.last.get(block)
        if last is not None and last.stream != stream and last.kind not in skip_kinds:
            self.rt.wait_event(last.event, stream=self._stream(stream))

    def _accessed(self, blocks: list[int], stream: int, kind: str) -> None:
        event = self.rt.record_event(stream=self._stream(stream))
        for block in blocks:
            self.last[block] = _Access(stream, event, kind)

    # -- ops ---------------------------------------------------------------------------------
    def _op_start(self, in_flight: int = 1) -> None:
        if not 1 <= in_flight <= 8:
            raise ValueError(f"in_flight={in_flight!r} must be between 1 and 8 steps")
        self.in_flight = in_flight
        # On controlled cuda the first launch of a kernel loads its module, which waits for the
        # GPU to drain and never returns while a gate spins: warm every kernel up ungated.
        with self.rt.ungated(), self.rt.annotate("warm-up"):
            self.cache.fill_pages([0], 0)  # the write/poison kernel
            for words in self.cache.block_words(0):
                words.clone()  # the read kernel
            self.zeroer.warmup()
        self.rt.synchronize()
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

    def _op_allocate(self, n: int, stream: int = 0) -> list[int]:
        if not 1 <= n <= len(self.free):
            raise ValueError(f"allocate n={n}: {len(self.free)} blocks are free")
        ids = [self.free.popleft() for _ in range(n)]
        skip = ("poison", "zero", "write", "read") if self.config.caller_fault == "no-free-fence" else ()
        for block in ids:
            self._order_before(block, stream, skip)  # caller promise (a)
        self._owners += 1
        with self.rt.use_stream(self._stream(stream)), self.rt.annotate(f"step {self.step} allocate_blocks"):
            self.zeroer.zero_block_ids(list(ids))
        note = self._note(f"allocate_blocks: zero_block_ids({ids}) on stream {stream}")
        for block in ids:
            self.shadow.zeroed(block, self._owners, note)
        self._accessed(ids, stream, "zero")
        return ids

    def _check_live(self, block: int, what: str) -> None:
        if self.shadow.blocks[block].state != "live":
            raise ValueError(f"{what} block {block}: it is {self.shadow.blocks[block].state}, not live")

    def _op_write(self, block: int, stream: int = 0) -> None:
        self._check_live(block, "write")
        skip = ("zero",) if self.config.caller_fault == "no-zero-wait" else ()
        self._order_before(block, stream, skip)  # caller promise (b)
        value = self.shadow.written(block, self._note(f"write_block on stream {stream}"))
        cache = self.cache
        with self.rt.annotate(f"step {self.step} write_block"):
            self.rt.launch(lambda: cache.fill_pages([block], value), name="write", stream=self._stream(stream), blocks_written=[block])
        self._accessed([block], stream, "write")

    def _op_read(self, block: int, stream: int = 0) -> None:
        self._check_live(block, "read")
        skip = ("zero",) if self.config.caller_fault == "no-zero-wait" else ()
        self._order_before(block, stream, skip)
        shadow = self.shadow.blocks[block]
        capture = _Capture(block, shadow.expect, f"step {self.step} read_block on stream {stream}", list(shadow.history))
        cache = self.cache

        def read() -> None:
            capture.data = [words.clone() for words in cache.block_words(block)]

        with self.rt.annotate(f"step {self.step} read_block"):
            self.rt.launch(read, name="read", stream=self._stream(stream), blocks_read=[block])
        self.captures.append(capture)
        self._accessed([block], stream, "read")

    def _op_free(self, block: int) -> None:
        self._check_live(block, "free")
        last = self.last[block]
        self.shadow.freed(block, self._note("free_block, then poisoned"))
        cache = self.cache
        # The page's next tenant (fp32 Mamba state) leaves NaN bytes behind; ordered after the
        # block's last access on that access's stream.
        with self.rt.annotate(f"step {self.step} free_block"):
            self.rt.launch(lambda: cache.poison([block]), name="poison", stream=self._stream(last.stream), blocks_written=[block])
        self._accessed([block], last.stream, "poison")
        self.free.append(block)

    def _op_advance(self, stream: int, ops: int = 1) -> int:
        return self.rt.advance(self._stream(stream), ops)

    def _op_delay(self, stream: int, amount: int = 1) -> None:
        self.rt.delay(self._stream(stream), amount)

    def _op_end_step(self) -> None:
        self._steps_queued.append(self.rt.record_event(stream=self.streams[0]))
        while len(self._steps_queued) > self.in_flight:
            self.rt.synchronize_event(self._steps_queued.popleft())

    def _op_sync_stream(self, stream: int) -> None:
        self.rt.synchronize_stream(self._stream(stream))

    def _op_sync_device(self) -> None:
        self.rt.synchronize()

    def _op_reallocate(self) -> None:
        # The engine moves its KV cache (a resize, a re-initialisation): the host drains the
        # device, copies every page to fresh buffers at new addresses and swaps them into the
        # same KVCache object, whose table then points at the new memory. A zeroer must read
        # the table when it launches (docs/contract.md; zoo.stale_table does not).
        if not self.loaded.capabilities.follows_reallocation:
            raise ValueError(
                f"reallocate: zeroer {self.config.zeroer!r} does not declare "
                f"Capabilities(follows_reallocation=True)"
            )
        self.rt.synchronize()
        fresh = self._new_cache(self.cache.spec)
        for new, old in zip(fresh.raws, self.cache.raws):
            new.copy_(old)
        self._settle_outside_work()
        # Swap contents: the episode's KVCache object takes the new buffers, and ``fresh`` keeps
        # the old ones, alive until the episode closes (a zeroer that missed the move may still
        # write there; they are never handed to anyone else before then).
        moved = dict(vars(self.cache))
        vars(self.cache).update(vars(fresh))
        vars(fresh).update(moved)
        self._retired.append(fresh)

    # -- verdicts ------------------------------------------------------------------------------
    def new_hazard_findings(self) -> list[Finding]:
        """Happens-before findings since the last call (cheap: checked after every step)."""
        if len(self.rt.hazards) == self._hazards_seen:
            return []  # the common case
        hazards = self.rt.hazards[self._hazards_seen :]
        self._hazards_seen = len(self.rt.hazards)
        found = [
            Finding("hazard", None, f"hazard at step {self.step}: {h.message}", self.config.caller_fault is not None)
            for h in hazards
        ]
        self.findings.extend(found)
        return found

    def finish(self) -> list[Finding]:
        """Synchronise once, verify every capture and the final state; return all findings."""
        if self.finished:
            return self.findings
        self.finished = True
        self.rt.synchronize()
        self.new_hazard_findings()
        fault = self.config.caller_fault is not None
        # One vectorised compare per segment first (what a clean episode costs); only when it
        # fails are reads and blocks verified one by one, to find and phrase what differs.
        segments = range(len(self.cache.segments))
        if self.captures and not (
            all(len(c.data) == len(segments) for c in self.captures)
            and all_rows_match(
                [torch.stack([c.data[seg] for c in self.captures]) for seg in segments], [c.expect for c in self.captures]
            )
        ):
            for capture in self.captures:
                data = [d.cpu() for d in capture.data]
                finding = self.shadow.verify(capture.block, capture.expect, data, capture.where, capture.history)
                if finding is not None:
                    self.findings.append(Finding(finding.kind, finding.block, finding.message, fault))
        if not all_rows_match([self.cache.pages(seg) for seg in segments], [shadow.expect for shadow in self.shadow.blocks]):
            for block, shadow in enumerate(self.shadow.blocks):
                words = [w.cpu() for w in self.cache.block_words(block)]
                finding = self.shadow.verify(block, shadow.expect, words, "the end of the episode", shadow.history)
                if finding is not None:
                    self.findings.append(Finding(finding.kind, finding.block, finding.message, fault))
        for violation in self.cache.guard_violations():
            self.findings.append(Finding("stray write", None, f"stray write: {violation}", fault))
        self.close()
        return self.findings

    def close(self) -> None:
        """Let every queued op run, release the runtime and give the caches back to the pool."""
        # Now, not when the garbage collector gets to it: graph_ring's graphs destroyed in the
        # middle of a later example's graph capture would break that capture.
        self.zeroer.close()
        self.rt.close()
        self.finished = True
        if self._caches is not None:  # only now can nothing write to them any more
            self._caches.give([self.cache, *self._retired])
            self._caches = None


def _op_params(name: str) -> list[inspect.Parameter]:
    return list(inspect.signature(getattr(Episode, f"_op_{name}")).parameters.values())[1:]  # drop self


# Each op's method and fields, read once from the method (every op record is checked on the hot
# path): (all fields, required fields) as sets, and the fields in signature order for messages.
_OP_METHODS = {name: getattr(Episode, f"_op_{name}") for name in OPS}
_OP_FIELD_ORDER = {name: tuple(p.name for p in _op_params(name)) for name in OPS}
_OP_FIELDS = {
    name: (frozenset(_OP_FIELD_ORDER[name]), frozenset(p.name for p in _op_params(name) if p.default is p.empty))
    for name in OPS
}
