"""The offload side of an episode: a host pool, the offloader under test, and the caller's book of
its jobs, slots and the blocks they move.

An episode with ``EpisodeConfig(offloader=SPEC)`` holds one KV cache (zeroed on allocation by the
harness's reference zeroer, which is not under test), a host pool of the cache's geometry
(:func:`zeroer.offload.build_host_pool`) and the offloader built for both. Its ops
(:mod:`fuzz.engine.ops`):

* ``store``: a live block's bytes into a free host slot (taken from a FIFO queue of slots 1..N-1);
* ``load``: a stored slot's bytes into a free device block (the one freed last, or with ``oldest``
  the queue's head) fenced as a zero call's blocks are (promise (a) of docs/contract.md);
* ``evict``: a stored slot back to the queue, its bytes then overwritten on the host (the next
  tenant's, as a recycled host page's are: the NaN poison). An offloader with ``evict(slot_ids)``
  is asked first, and the caller may ask while loads from the slot are not yet reported: the host
  lock is the offloader's (SGLang's host pages are freed by its own eviction, #27444), so a slot it
  frees under a load is overwritten at once, and one it keeps stays stored;
* ``wait``: the caller waits for the store into a slot (the offloader's ``wait(job_ids)``, vLLM's,
  or the whole device where it has none), then polls;
* ``poll``: ``get_finished()`` (with ``sync``, after the caller has waited for the whole device),
  and what the caller does with a finished job: a store's slot is
  read on the host at once; a loaded block is read on the main stream and is the caller's from then on.

The caller keeps every promise of docs/offload-contract.md: a block under a store is not written
or freed, a block under a load is not touched, a slot under a job is not evicted, until the
offloader reports the job finished; each op waits for what the contract says it waits for and
nothing more. The oracle then judges:

* **wrong bytes loaded**: a loaded block, read once its load was reported, that does not hold what
  was stored in its slot;
* **transfer not done**: a store reported finished whose slot does not hold the block's bytes;
* **slot clobbered** / **stray write**: a held slot, or a pool guard word, changed by what should not change it;
* **bad report**: a job reported twice, a job that does not exist, or reported failed;
* **never finished**: a job still unreported once the device is idle at the end;
* every hazard of the happens-before checker, and the device cache's own checks (clobbered
  blocks, stray writes), as for a zeroer;
* **cuda error**: CUDA refused one of its calls for the state it was in, named after the call, the
  state and what it means here (``elapsed_time on an end event that had not completed: the job
  was reported before its copy finished``: :meth:`OffloadSide.explain_cuda_error`).

Example::

    episode = Episode(EpisodeConfig(offloader="examples/engine_offloaders.py:store_after_compute_event"))
    episode.apply({"op": "start"})
    block = episode.apply({"op": "allocate", "n": 1})[0]
    episode.apply({"op": "write", "block": block})
    slot = episode.apply({"op": "store", "block": block, "stream": 0})
    episode.apply({"op": "sync_device"}); episode.apply({"op": "poll"})
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fuzz.engine.oracle import Finding, Shadow
from zeroer.cache.geometries import geometry
from zeroer.cache.layout import POISON_WORD
from zeroer.offload import build_host_pool
from zeroer.registry import load_offloader

from fuzz.engine.component import CallerCore
from kvdevice.runtime.cuda_errors import NOT_COMPLETED
from fuzz.engine.free_queue import FreeQueue


WARMUP_JOBS = (0, 1)  # the warm-up's store and load of block 0 / slot 0; the caller's jobs start at 2


@dataclass
class Job:
    id: int
    kind: str  # "store" | "load"
    block: int
    slot: int
    word: int  # the word the destination must hold once the job is done
    step: int
    slot_freed: bool = False  # a load whose slot the offloader freed (evict) before it was reported


@dataclass
class SlotShadow:
    state: str = "free"  # "free" | "storing" | "stored"
    expect: int = POISON_WORD
    loads: int = 0  # loads from it not yet reported finished
    history: list[str] = field(default_factory=list)


class OffloadSide:
    """See the module docstring: built by :class:`~fuzz.engine.episode.Episode` when its config names an offloader."""

    def __init__(self, episode: CallerCore) -> None:
        config = episode.config
        self.episode = episode
        self.loaded = load_offloader(config.offloader)
        self.pool = build_host_pool(geometry(config.geometry), memory=config.host_memory)
        self.slots = [SlotShadow() for _ in range(self.pool.num_slots)]
        self.slots[0] = SlotShadow(state="warm-up", history=["the warm-up stored the null block 0 here"])
        self.free_slots = FreeQueue(self.pool.num_slots)
        self.jobs: dict[int, Job] = {}
        self.reported: set[int] = set()
        self.busy: dict[int, int] = {}  # device block -> the job it is under
        self.calling: str | None = None  # the offloader's method being called now ("get_finished")
        self.next_job = WARMUP_JOBS[-1] + 1
        self.offloader: Any = None
        group = episode.groups[0]
        with episode.rt.block_space(group.index), \
                episode.factory_call("offloader", self.loaded.spec, "(cache, host_pool, runtime)"):
            self.offloader = self.loaded.build(group.cache, self.pool, episode.rt)

    # -- fuzz.engine.component.Component ---------------------------------------------------------------
    noun = "the offloader"
    keeps_cache_tensors = True  # an engine's handler keeps the cache tensors it was built with

    def ops(self) -> dict[str, Any]:
        return {"store": self.store, "load": self.load, "evict": self.evict, "wait": self.wait_for, "poll": self.poll,
                "advance_own": self.advance_own}

    def holding(self, block: int) -> str | None:
        job = self.busy.get(block)
        if job is None:
            return None
        return f"it is under offload job {job}, not yet reported finished (docs/offload-contract.md)"

    def abandon(self) -> None:
        if self.offloader is not None:
            self.offloader.close()

    def explain_cuda_error(self, call: str, error: BaseException) -> str | None:
        """What CUDA refusing the offloader's ``call`` says of it: ``get_finished()`` timing a job
        whose events had not completed (vLLM's handler reports each job with
        ``start.elapsed_time(end)``) was reporting that job before its copies ran (promise 3)."""
        if self.calling == "get_finished" and getattr(error, "reason", None) == NOT_COMPLETED:
            return "the job was reported before its copy finished"
        return None

    # -- calls of the offloader ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _call(self, what: str, method: str | None = None) -> Iterator[None]:
        """One call of the offloader's ``method``, shown in reports as ``what``."""
        self.calling = method
        try:
            with self.episode.component_call(self.episode.groups[0], what):
                yield
        finally:
            self.calling = None

    # -- warm-up --------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """The offloader's own warm-up, then one store of the null block 0 into slot 0, reported
        once the device is idle, and its load back (every copy and kernel it uses compiled and
        loaded before any gated work), then drained."""
        episode = self.episode
        rt = episode.rt
        with rt.block_space(0):
            with self._call("warmup"):
                self.offloader.warmup()
            # The store reported before its slot is loaded (caller promise c): an offloader may put
            # a store's bytes in the slot only as it reports the job (LMCache's objects are).
            for kind, job in zip(("store", "load"), WARMUP_JOBS):
                with self._call(self.offloader.spelled(kind, job, [0], [0]) + " (the warm-up)"):
                    getattr(self.offloader, kind)(job, [0], [0])
                episode.device_work(rt.synchronize)
                with self._call("get_finished() (the warm-up)", "get_finished"):
                    self.offloader.get_finished()  # warm-up jobs: whatever it says of them is ignored

    # -- ops ------------------------------------------------------------------------------------------
    def own_streams(self) -> list[Any]:
        """The streams the offloader made (every stream of the runtime the episode did not make), in
        the order they were made: the same in every replay of a program."""
        episode = self.episode
        caller = {id(stream) for stream in episode.streams}
        return [stream for stream in episode.rt.streams if id(stream) not in caller]

    def own_work_by_stream(self) -> list[bool]:
        """For each of the offloader's streams, whether it has work queued that it could run part of."""
        return [bool(self.episode.rt.pending(stream)) for stream in self.own_streams()]

    def advance_own(self, stream: int, ops: int = 1) -> int:
        """Let the offloader's ``stream``-th stream (modulo how many it made) run up to ``ops`` queued
        ops, a stream it waits on first running the least work that wait needs (the device runs
        streams side by side); how many ran. A simulated stream runs only as far as the host waits for it unless
        something advances it, so without this op a job reported on an event its stream passes
        before its copies (the start event, the first layer's of a layer-by-layer transfer) was
        never seen reported early."""
        own = self.own_streams()
        if not own:
            return 0
        episode = self.episode
        return episode.device_work(episode.rt.advance_through, own[stream % len(own)], ops)

    def store(self, block: int, stream: int = 0) -> int:
        episode = self.episode
        episode.stream_of(stream)  # checked before anything changes
        group = episode.groups[0]
        episode.check_live(group, block, "store")
        if block in self.busy:
            raise ValueError(f"store block {block}: it is under job {self.busy[block]}, not yet reported finished")
        if not self.free_slots:
            raise ValueError("store: no host slot is free (evict one first)")
        slot = self.free_slots.popleft()
        episode.order_before(group, block, stream)  # its writes are ordered before the caller's stream
        job = self._new_job("store", block, slot, group.shadow.blocks[block].expect)
        shadow = self.slots[slot]
        shadow.state = "storing"
        shadow.history.append(episode.note(f"store job {job.id}: block {block} on stream {stream}"))
        with episode.rt.use_stream(episode.stream_of(stream)), episode.rt.annotate(f"step {episode.step} store"), \
                episode.rt.block_space(group.index), self._call(self.offloader.spelled("store", job.id, [block], [slot])):
            self.offloader.store(job.id, [block], [slot])
        group.shadow.noted(block, episode.note(f"store job {job.id} into slot {slot} on stream {stream}"))
        return slot

    def load(self, slot: int, stream: int = 0, oldest: int = 0) -> int:
        episode = self.episode
        episode.stream_of(stream)  # checked before anything changes
        group = episode.groups[0]
        shadow = self._slot(slot, "load")
        if shadow.state != "stored":
            raise ValueError(f"load slot {slot}: it is {shadow.state}, not stored (its store not reported finished)")
        if not group.free:
            raise ValueError("load: no device block is free")
        # Which free block is the caller's choice: the one freed last (a block whose last tenant may
        # still be queued: the default, so shrinking keeps to it), or the queue's head.
        block = episode.hand_out(group, stream, oldest=bool(oldest))  # promise (a): its last tenant is ordered before
        job = self._new_job("load", block, slot, shadow.expect)
        shadow.loads += 1
        shadow.history.append(episode.note(f"load job {job.id} into block {block} on stream {stream}"))
        group.shadow.loading(block, episode.owners, shadow.expect,
                             episode.note(f"load job {job.id} from slot {slot} on stream {stream}"))
        with episode.rt.use_stream(episode.stream_of(stream)), episode.rt.annotate(f"step {episode.step} load"), \
                episode.rt.block_space(group.index), self._call(self.offloader.spelled("load", job.id, [block], [slot])):
            self.offloader.load(job.id, [slot], [block])
        return block

    def evict(self, slot: int) -> None:
        episode = self.episode
        shadow = self._slot(slot, "evict")
        asks = self.offloader.evicts
        if shadow.state != "stored" or (shadow.loads and not asks):
            what = f"{shadow.loads} load(s) from it are not reported finished" if shadow.loads else f"it is {shadow.state}"
            raise ValueError(f"evict slot {slot}: {what}")
        if asks and not self._offloader_frees(slot, shadow):
            return
        label = f"step {episode.step} evict: the caller's host write of slot {slot} (its next tenant)"
        pool = self.pool.cache
        for seg in range(len(pool.segments)):
            self.offloader.host_access(pool.pages(seg)[slot], label, write=True)
        pool.poison([slot])
        shadow.state, shadow.expect = "free", POISON_WORD
        shadow.history.append(episode.note("evict, then overwritten on the host"))
        self.free_slots.append(slot)

    def _offloader_frees(self, slot: int, shadow: SlotShadow) -> bool:
        """Ask the offloader to free ``slot`` (its ``evict``). Freed, the loads from it still in
        flight are the offloader's word that nothing reads the slot any more: their jobs are judged
        as any other, and the slot is the caller's to overwrite now."""
        episode = self.episode
        with episode.rt.block_space(0), self._call(f"evict([{slot}])"):
            freed = self.offloader.evict([slot])
        if not freed:
            shadow.history.append(episode.note("evict refused: the offloader keeps the slot"))
            return False
        for job in self.jobs.values():
            if job.kind == "load" and job.slot == slot and job.id not in self.reported:
                job.slot_freed = True
        if shadow.loads:
            shadow.history.append(episode.note(f"the offloader freed it with {shadow.loads} load(s) from it not yet reported"))
        shadow.loads = 0
        return True

    def wait_for(self, slot: int) -> list[int]:
        """The caller waits for the store in flight into ``slot`` (the offloader's ``wait(job_ids)``,
        or the whole device without one), then polls."""
        self._slot(slot, "wait")
        pending = {j.id for j in self.jobs.values() if j.kind == "store" and j.slot == slot and j.id not in self.reported}
        episode = self.episode
        if pending and self.offloader.waits:
            with episode.rt.block_space(0), self._call(f"wait({sorted(pending)})"):
                self.offloader.wait(pending)
        elif pending:
            episode.device_work(episode.rt.synchronize)
        return self.poll()

    def poll(self, sync: int = 0) -> list[int]:
        """``get_finished()``; each finished job is checked and its memory handed back to the caller."""
        episode = self.episode
        if sync:  # the caller waits for the whole device first
            episode.device_work(episode.rt.synchronize)
        with episode.rt.block_space(0), self._call("get_finished()", "get_finished"):
            reported = self.offloader.get_finished()
        done = []
        for job_id, ok in reported:
            if job_id in WARMUP_JOBS:
                continue
            job = self.jobs.get(job_id)
            if job is None or job_id in self.reported or not ok:
                why = ("reported failed" if job is not None and job_id not in self.reported else
                       "reported finished a second time" if job is not None else "a job the caller never started")
                self._finding("bad report", job.block if job else None,
                              f"bad report at step {episode.step}: get_finished() listed job {job_id}: {why}")
                continue
            self.reported.add(job_id)
            done.append(job_id)
            (self._store_done if job.kind == "store" else self._load_done)(job)
        return done

    # -- finished jobs --------------------------------------------------------------------------------
    def _store_done(self, job: Job) -> None:
        episode = self.episode
        self.busy.pop(job.block, None)
        shadow = self.slots[job.slot]
        label = f"step {episode.step} poll: the caller reads slot {job.slot} of finished store job {job.id}"
        pool = self.pool.cache
        observed = []
        for seg in range(len(pool.segments)):
            view = pool.pages(seg)[job.slot]
            self.offloader.host_access(view, label, write=False)
            observed.append(view.clone())
        shadow.state, shadow.expect = "stored", job.word
        shadow.history.append(episode.note(f"store job {job.id} reported finished"))
        finding = Shadow.verify(job.slot, job.word, observed, f"step {episode.step} (store job {job.id} reported finished)",
                                 shadow.history, kind="transfer not done", noun="host slot")
        if finding is not None:
            self._finding(finding.kind, None, finding.message)

    def _load_done(self, job: Job) -> None:
        episode = self.episode
        group = episode.groups[0]
        self.busy.pop(job.block, None)
        slot = self.slots[job.slot]
        if not job.slot_freed:  # freed under the load (evict), the slot has moved on
            slot.loads -= 1
        group.shadow.loaded(job.block, episode.note(f"load job {job.id} reported finished"))
        # The caller uses the block at once on its main stream (the host has seen the job finish).
        episode.read_capture(group, job.block, 0, kind="wrong bytes loaded",
                              where=f"step {episode.step} poll: load job {job.id} reported finished, block read on stream 0")

    # -- the end --------------------------------------------------------------------------------------
    def finish(self) -> None:
        """After the device is idle: every job reported, every slot holding what it should."""
        self.poll()
        for job in self.jobs.values():
            if job.id not in self.reported:
                self._finding("never finished", job.block,
                              f"never finished: {job.kind} job {job.id} (block {job.block}, slot {job.slot}, step {job.step}) "
                              f"was not reported by get_finished() once the device was idle at the end")
        pool = self.pool.cache
        for slot, shadow in enumerate(self.slots):
            if shadow.state in ("warm-up", "storing"):
                continue
            words = [pool.pages(seg)[slot] for seg in range(len(pool.segments))]
            kind = "stray write" if shadow.expect == POISON_WORD else "slot clobbered"
            finding = Shadow.verify(slot, shadow.expect, words, "the end of the episode", shadow.history, kind=kind,
                                     noun="host slot")
            if finding is not None:
                self._finding(finding.kind, None, finding.message)
        for violation in pool.guard_violations():
            self._finding("stray write", None, f"stray write: host pool {violation}")

    def close(self) -> None:
        if self.offloader is not None:
            try:
                with self._call("close"):
                    self.offloader.close()
            finally:
                self.offloader = None

    def release(self) -> None:
        self.offloader = None
        self.pool.release()

    # -- helpers --------------------------------------------------------------------------------------
    def _slot(self, slot: int, what: str) -> SlotShadow:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 1 <= slot < len(self.slots):
            raise ValueError(f"{what} slot {slot!r}: the host pool has slots 1..{len(self.slots) - 1}")
        return self.slots[slot]

    def _new_job(self, kind: str, block: int, slot: int, word: int) -> Job:
        job = Job(self.next_job, kind, block, slot, word, self.episode.step)
        self.next_job += 1
        self.jobs[job.id] = job
        self.busy[block] = job.id
        return job

    def _finding(self, kind: str, block: int | None, message: str) -> None:
        episode = self.episode
        finding = Finding(kind, block, message, episode.config.caller_fault is not None, step=episode.step)
        episode.findings.append(finding)
        episode.fresh_findings.append(finding)

