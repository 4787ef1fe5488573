"""Offload campaigns: the offloader protocol, its episode ops and oracle, and the engine-pattern examples.

Each racy example of examples/engine_offloaders.py must be found on the simulator with a trace of
at most 6 ops that replays; each race-free one must come out clean, and must move exactly the bytes
of its blocks on every geometry and host pool. The oracle's own findings (a report of a job that
does not exist, a job never reported, a store reported before its bytes arrived) are shown on
small offloaders written here. The cuda cases run where there is a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fuzz.engine.campaigns import PROFILES, Campaign, offload_campaigns, run_campaign
from fuzz.engine.component import COMPONENT_KINDS, ComponentKind
from fuzz.engine.episode import Episode, EpisodeConfig, run_ops
from fuzz.engine.ops import CORE_FIELDS, FIELDS, merged_fields
from fuzz.engine.handles import concrete, symbolic
from fuzz.engine.harness_error import HarnessError
from fuzz.engine.signature import finding_signature
from zeroer.cache.block_map import CacheBlockMap
from zeroer.cache.geometries import geometry, geometry_names
from zeroer.cache.layout import build_cache
from zeroer.offload import OffloaderCapabilities, OffloaderSpecError, build_host_pool, finished_job_ids
from zeroer.registry import load_offloader
from racecheck.ranges import byte_runs

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = "examples/engine_offloaders.py"
_spec = importlib.util.spec_from_file_location("_engine_offloaders", ROOT / EXAMPLES)
engine_offloaders = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_offloaders)
VERDICTS = engine_offloaders.VERDICTS
RACY = sorted(n for n, v in VERDICTS.items() if v == "racy")
RACE_FREE = sorted(n for n, v in VERDICTS.items() if v == "race-free")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BACKENDS = ["sim", pytest.param("cuda", marks=CUDA)]

# The shortest program that shows each racy example's race, by hand: what the fuzzer must get to.
SHORTEST = {
    "store_without_compute_event": [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}],
    "copy_thread_without_compute_event": [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}],
    "load_unfenced": [{"op": "start"}, {"op": "allocate", "n": 2}, {"op": "store", "block": 2}, {"op": "poll", "sync": 1},
                      {"op": "free", "block": 1}, {"op": "load", "slot": 1}],
    "load_acked_on_issue": [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1},
                            {"op": "poll", "sync": 1}, {"op": "load", "slot": 1}, {"op": "poll"}],
    "staging_freed_on_return": [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1},
                                {"op": "poll", "sync": 1}, {"op": "load", "slot": 1}, {"op": "load", "slot": 1}],
    "report_without_end_query": [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "poll"}],
    # tiny's host rows go through a pageable temporary, so the stream has passed the start event (and
    # the copies) at the store's return; its end event is still queued (test below: async copies)
    "report_on_start_query": [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "poll"}],
    # the caller asks to evict the slot of a load not yet reported, and the offloader frees it (SGLang #27444)
    "host_lock_released_on_issue": [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1},
                                    {"op": "poll", "sync": 1}, {"op": "load", "slot": 1}, {"op": "evict", "slot": 1}],
}
# The kind of finding each shows first where it is not a hazard: CUDA refusing to time a job the
# handler reports before its end event completed (tests/test_cuda_errors.py).
FIRST_KIND = {"report_without_end_query": "cuda error", "report_on_start_query": "cuda error"}
# Its race-free twin, for each racy example: the same program is clean there.
TWIN = {"store_without_compute_event": "store_after_compute_event",
        "copy_thread_without_compute_event": "copy_thread_after_compute_event", "load_unfenced": "load_waits_forward",
        "load_acked_on_issue": "load_acked_on_event", "staging_freed_on_return": "staging_freed_after_event",
        "report_without_end_query": "report_after_end_query",
        "report_on_start_query": "report_after_end_query",
        "host_lock_released_on_issue": "host_lock_held_until_loaded"}


def _config(name: str, **fields) -> EpisodeConfig:
    return EpisodeConfig(offloader=f"{EXAMPLES}:{name}", **fields)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", RACY)
def test_each_racy_example_shows_on_its_shortest_program_and_not_on_its_twin(name: str, backend: str) -> None:
    mode = {"mode": "controlled"} if backend == "cuda" else {}
    found = run_ops(_config(name, backend=backend, **mode), SHORTEST[name])
    assert found and found[0].kind == FIRST_KIND.get(name, "hazard"), found
    assert run_ops(_config(TWIN[name], backend=backend, **mode), SHORTEST[name]) == []


@pytest.mark.parametrize("name", RACY)
def test_the_fuzzer_finds_each_racy_example_in_at_most_six_ops(name: str, tmp_path: Path) -> None:
    # What the shrinker reaches, not how fast: a loaded machine (pytest -n beside another job) once
    # hit the simulator's 120 s bound and kept a longer trace, so the bound is lifted here.
    result = run_campaign(Campaign(_config(name), shard=0, expect="finds"), PROFILES["ci"], tmp_path, shrink_bound_s=3600)
    assert result.found, f"{name}: not found in {result.examples} examples"
    assert not result.shrink["cut_off"] and len(result.violation.trace) <= 6, (result.shrink, result.violation.trace)
    assert run_ops(result.violation.config, result.violation.trace), "the shrunk trace does not replay"
    assert result.trace_path is not None and result.trace_path.exists()


@pytest.mark.parametrize("name", RACE_FREE)
def test_each_race_free_example_is_clean_in_the_ci_profile(name: str, tmp_path: Path) -> None:
    result = run_campaign(Campaign(_config(name, host_memory="registered"), shard=1, expect="clean"), PROFILES["ci"], tmp_path)
    assert not result.found, result.violation and str(result.violation.findings[0])
    assert result.harness_error is None and result.steps > 200
    # an offloader's campaign runs its kind's multiple of the profile's examples (its races need longer programs)
    assert result.examples >= COMPONENT_KINDS["offloader"].examples_factor * PROFILES["ci"].max_examples > 40


@pytest.mark.parametrize("memory", ["pinned", "registered"])
@pytest.mark.parametrize("geometry_name", geometry_names())
def test_race_free_examples_move_exactly_their_blocks_on_every_geometry(geometry_name: str, memory: str) -> None:
    """Store two written blocks, load both back into other blocks, evict, and read: every byte right,
    every other block, slot and guard untouched (the oracle checks them all at the end)."""
    ops = [{"op": "start"}, {"op": "allocate", "n": 2}, {"op": "write", "block": 1}, {"op": "write", "block": 2, "stream": 1},
           {"op": "store", "block": 1}, {"op": "store", "block": 2, "stream": 2}, {"op": "poll", "sync": 1},
           {"op": "free", "block": 1}, {"op": "load", "slot": 2, "stream": 1}, {"op": "load", "slot": 1, "oldest": 1},
           {"op": "poll", "sync": 1},
           {"op": "evict", "slot": 1}, {"op": "read", "block": 3, "stream": 2}]
    for name in RACE_FREE:
        assert run_ops(_config(name, geometry=geometry_name, host_memory=memory), ops) == [], name


def test_a_components_op_in_an_episode_without_that_component_is_a_usage_error_and_changes_nothing() -> None:
    episode = Episode(EpisodeConfig())  # a zeroer's campaign: no component beside the zeroer
    episode.apply({"op": "start"})
    block = episode.apply({"op": "allocate", "n": 1})[0]
    with pytest.raises(ValueError, match=r"^op 'store' needs a component that has it: this episode's is none$"):
        episode.apply({"op": "store", "block": block})
    assert episode.component is None and episode.finish() == []


@pytest.mark.parametrize("geometry_name", ["block_outer_fp8", "mla_indexer"])
def test_an_offloaders_own_stream_run_part_way_shows_a_job_reported_on_its_start_event(geometry_name: str) -> None:
    # Where the store's copies are queued (contiguous host rows), the offloader's stream runs only as
    # far as the host waits for it: reported on its start event, the job shows early only once that
    # stream has run past the start and not yet its copies (the caller's stream first: it waits on it).
    program = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1},
               {"op": "advance", "stream": 0, "ops": 4}, {"op": "poll"}]
    part_way = [*program[:-1], {"op": "advance_own", "stream": 0, "ops": 2}, program[-1]]
    assert run_ops(_config("report_on_start_query", geometry=geometry_name), program) == []
    found = run_ops(_config("report_on_start_query", geometry=geometry_name), part_way)
    assert [f.kind for f in found] == ["cuda error"], found
    assert "reported before its copy finished" in str(found[0])
    assert run_ops(_config("report_after_end_query", geometry=geometry_name), part_way) == []
    # the caller's stream left where it was: the offloader's stream waits on it, so it runs first
    # the least work that wait needs, as the device runs streams side by side
    own_alone = [*program[:3], {"op": "advance_own", "stream": 0, "ops": 2}, program[-1]]
    assert [f.kind for f in run_ops(_config("report_on_start_query", geometry=geometry_name), own_alone)] == ["cuda error"]


def test_a_component_kinds_ops_reach_every_trace_reader_from_its_declaration_alone() -> None:
    # The offloader's side runs exactly the ops its kind declares, and the trace's op table has them.
    episode = Episode(_config("load_waits_forward"))
    assert set(episode.component.ops()) == set(COMPONENT_KINDS["offloader"].ops) <= set(FIELDS)
    episode.close()
    # A further kind's ops join the table with no edit to it; a name the caller or a kind has is refused.
    copier = ComponentKind("example:Copier", "example:CopierPart", {"copy": (("block",), {"stream": 0})})
    fields = merged_fields(CORE_FIELDS, {**COMPONENT_KINDS, "copier": copier})
    assert fields["copy"] == (("block",), {"stream": 0}) and fields["store"] == FIELDS["store"]
    with pytest.raises(ValueError, match="component kind 'copier' declares op 'read', which the caller or another kind has"):
        merged_fields(CORE_FIELDS, {"copier": ComponentKind("example:Copier", "example:CopierPart", {"read": ((), {})})})


def test_a_load_shows_the_bytes_the_store_saw_not_later_writes() -> None:
    episode = Episode(_config("load_waits_forward"))
    episode.apply({"op": "start"})
    block = episode.apply({"op": "allocate", "n": 1})[0]
    episode.apply({"op": "write", "block": block})
    expected = episode.shadow.blocks[block].expect
    slot = episode.apply({"op": "store", "block": block})
    assert episode.component.slots[slot].state == "storing"
    with pytest.raises(ValueError, match="under offload job"):
        episode.apply({"op": "write", "block": block})  # the caller's promise: not until it is reported
    episode.apply({"op": "poll", "sync": 1})
    episode.apply({"op": "write", "block": block})  # now the block is the caller's again
    loaded = episode.apply({"op": "load", "slot": slot})
    assert episode.shadow.blocks[loaded].expect == expected != episode.shadow.blocks[block].expect
    assert episode.finish() == []


class LoadsNothing(engine_offloaders.CpuOffloadHandler):
    """Stores right; a load moves no byte and is reported finished at the next poll."""

    def load(self, job_id, slot_ids, block_ids):
        self.acked.append(job_id)


LOAD_LAST = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "poll", "sync": 1},
             {"op": "load", "slot": 1}]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_load_first_reported_as_the_episode_ends_is_read_and_judged(backend: str) -> None:
    # The end's poll reports the load and reads its block; that read must run before the verdict
    # (on the GPU an unrun read's words were a freed index tensor's ids: a false `wrong bytes loaded`).
    mode = {"mode": "controlled"} if backend == "cuda" else {}
    episode = Episode(_config("load_waits_forward", backend=backend, **mode))
    try:
        for op in LOAD_LAST:
            episode.apply(op)
        assert episode.finish() == []
    finally:
        if not episode.finished:  # an op raised: its runtime still closed (on cuda, gates open)
            episode.abandon()
    (capture,) = [c for c in episode.groups[0].captures if c.kind == "wrong bytes loaded"]
    assert [d.cpu().unique().tolist() for d in capture.data] == [[capture.expect]] * len(capture.data)
    found = run_ops(EpisodeConfig(offloader="tests/test_offload.py:LoadsNothing", backend=backend, **mode), LOAD_LAST)
    assert found and found[0].kind == "wrong bytes loaded" and "load job 3 reported finished" in found[0].message, found


class _LateClones(TorchDispatchMode):
    """``clone`` returns memory that holds ``tenant``'s words at once; ``copies`` fill it later."""

    def __init__(self, tenant: torch.Tensor, copies: list) -> None:
        super().__init__()
        self.tenant, self.copies = tenant.view(torch.int32), copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not torch.ops.aten.clone.default:
            return func(*args, **(kwargs or {}))
        source, words = args[0], torch.zeros_like(args[0])
        n = min(words.numel(), self.tenant.numel())
        words.view(-1)[:n] = self.tenant[:n]
        self.copies.append(lambda: words.copy_(source))
        return words


class _ReadsRunLate:
    """The controlled cuda mode's read of a block, on the simulator's host tensors: its words are
    memory the caching allocator hands out when the read is enqueued, still holding that memory's
    last tenant's bytes, and the copy into them runs only when the stream reaches the read (its
    gate opens). The last tenant is the last index tensor the harness staged: the row ids that
    ``device_index`` stages for the reference zeroer's ``index_fill_``, freed on the same stream."""

    def __init__(self, episode: Episode, monkeypatch: pytest.MonkeyPatch) -> None:
        import zeroer.kernel

        self.staged = torch.zeros(1, dtype=torch.int64)
        stage, launch = zeroer.kernel.device_index, episode.rt.launch

        def device_index(ids, device):
            self.staged = ids.clone()
            return stage(ids, device)

        def late_launch(fn, *, name="kernel", **declared):
            if name != "read":
                return launch(fn, name=name, **declared)
            copies = []
            with _LateClones(self.staged, copies):
                fn()  # enqueued: its words exist from now on
            return launch(lambda: [copy() for copy in copies], name=name, **declared)

        monkeypatch.setattr(zeroer.kernel, "device_index", device_index)
        monkeypatch.setattr(episode.rt, "launch", late_launch)


def test_a_read_is_judged_only_once_it_has_run_though_its_words_exist_from_its_enqueue(monkeypatch) -> None:
    # On cuda a read's words are tensors from its enqueue on; in the controlled mode they hold their
    # memory's last tenant until the read's gate opens. The verdict reads them on torch's current
    # stream, which no runtime stream is ordered with, so it must wait for each read first. Judged
    # before the read ran, the load's block read as the zeroer's staged row ids ([1] for block 1:
    # word 0 read 1), the false `wrong bytes loaded` an H100 showed on race-free offloaders.
    episode = Episode(_config("load_waits_forward"))
    late = _ReadsRunLate(episode, monkeypatch)
    try:
        for op in LOAD_LAST:
            episode.apply(op)
        assert late.staged.tolist() == [1]  # the allocate's zero staged block 1's row
        assert episode.finish() == []
    finally:
        if not episode.finished:
            episode.abandon()
    (capture,) = [c for c in episode.groups[0].captures if c.kind == "wrong bytes loaded"]
    assert [d.unique().tolist() for d in capture.data] == [[capture.expect]] * len(capture.data)


# -- the oracle's offload findings, on offloaders written to break one promise each ------------------
class _Base:
    def __init__(self, cache, host_pool, runtime=None) -> None:
        self.done = []

    def store(self, job_id, block_ids, slot_ids):
        self.done.append(job_id)

    def load(self, job_id, slot_ids, block_ids):
        self.done.append(job_id)

    def get_finished(self):
        done, self.done = self.done, []
        return done


class DoesNothing(_Base):
    """Reports every job at once and moves no bytes."""


class ReportsTwice(engine_offloaders.CpuOffloadHandler):
    """Moves the bytes right, and lists every finished job at every call."""

    def __init__(self, cache, host_pool, runtime=None) -> None:
        super().__init__(cache, host_pool)
        self.seen = []

    def get_finished(self):
        self.seen += super().get_finished()
        return list(self.seen)


class NeverReports(engine_offloaders.CpuOffloadHandler):
    def get_finished(self):
        return []


class ReportsFailure(engine_offloaders.CpuOffloadHandler):
    def get_finished(self):
        return [(job, False) for job, _ in super().get_finished()]


@dataclasses.dataclass
class TransferResult:  # vLLM's newer result type
    job_id: int
    success: bool


class VllmShaped(engine_offloaders.CpuOffloadHandler):
    """vLLM's handler shape: one transfer_async(job_id, (src, dst)) for both directions, each side
    with block_ids (a numpy array) and medium(), and TransferResult objects from get_finished()."""

    store = None
    load = None

    def transfer_async(self, job_id, spec):
        src, dst = spec
        if src.medium() == "GPU":
            engine_offloaders.CpuOffloadHandler.store(self, job_id, src.block_ids.tolist(), dst.block_ids.tolist())
        else:
            engine_offloaders.CpuOffloadHandler.load(self, job_id, src.block_ids.tolist(), dst.block_ids.tolist())
        return True

    def get_finished(self):
        return [TransferResult(job, ok) for job, ok in super().get_finished()]


def test_vllm_handler_shape_is_taken_as_it_is() -> None:
    ops = SHORTEST["load_acked_on_issue"] + [{"op": "poll", "sync": 1}, {"op": "read", "block": 7, "stream": 1}]
    assert run_ops(EpisodeConfig(offloader="tests/test_offload.py:VllmShaped"), ops) == []


class NoLoad:
    def __init__(self, cache, host_pool, runtime=None) -> None: ...
    def store(self, job_id, block_ids, slot_ids): ...
    def get_finished(self): return []


STORE = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "poll", "sync": 1}]


@pytest.mark.parametrize(("factory", "kind"), [("DoesNothing", "transfer not done"), ("ReportsTwice", "bad report"),
                                               ("NeverReports", "never finished"), ("ReportsFailure", "bad report")])
def test_an_offloader_that_breaks_its_promise_is_a_finding_of_its_kind(factory: str, kind: str) -> None:
    findings = run_ops(EpisodeConfig(offloader=f"tests/test_offload.py:{factory}"), STORE + [{"op": "poll", "sync": 1}])
    assert findings and findings[0].kind == kind, findings


LOAD_THEN_EVICT = SHORTEST["host_lock_released_on_issue"]


def test_an_offloader_that_holds_a_slot_under_a_load_refuses_its_eviction_and_the_slot_stays_stored() -> None:
    episode = Episode(_config("host_lock_held_until_loaded"))
    for op in LOAD_THEN_EVICT:
        episode.apply(op)
    slot = episode.component.slots[1]
    assert (slot.state, slot.loads) == ("stored", 1) and slot.history[-1].endswith("evict refused: the offloader keeps the slot")
    for op in [{"op": "poll", "sync": 1}, {"op": "load", "slot": 1}, {"op": "poll", "sync": 1}, {"op": "evict", "slot": 1}]:
        episode.apply(op)  # still stored: it loads again, and once both loads are reported it is freed
    assert episode.component.slots[1].state == "free" and episode.finish() == []


def test_without_an_evict_hook_the_caller_never_evicts_a_slot_under_a_load() -> None:
    # The caller's promise (docs/offload-contract.md): without the offloader's word, a slot is its own
    # to recycle only once every job on it is reported.
    with pytest.raises(ValueError, match=r"^evict slot 1: 1 load\(s\) from it are not reported finished$"):
        run_ops(_config("load_acked_on_event"), LOAD_THEN_EVICT)


class EvictAnswersNone(engine_offloaders.HostLockedLoads):
    """Forgets to return ``evict``'s answer: None, not True or False."""

    def __init__(self, cache, host_pool, runtime=None) -> None:
        super().__init__(cache, host_pool, unlock_on_issue=False)

    def evict(self, slot_ids):
        super().evict(slot_ids)


class FinishedAnswersAString(engine_offloaders.CpuOffloadHandler):
    def get_finished(self):
        return ["job " + str(job) for job, _ in super().get_finished()]


@pytest.mark.parametrize(("factory", "ops", "says"), [
    ("EvictAnswersNone", LOAD_THEN_EVICT, r"evict\(\[1\]\) returned None; fix it to return True"),
    ("FinishedAnswersAString", STORE, r"get_finished\(\) listed 'job \d+', not a job id"),
])
def test_an_answer_the_protocol_does_not_allow_is_the_users_to_fix_never_our_bug(factory: str, ops: list, says: str) -> None:
    # The offloader's code is wrong but not racy: no finding, and not kvzero's bug (exit status 2).
    with pytest.raises(HarnessError, match=says) as caught:
        run_ops(EpisodeConfig(offloader=f"tests/test_offload.py:{factory}"), ops)
    assert caught.value.status == 2 and "bug of kvzero" not in str(caught.value), caught.value


class FreesSlotsOnceLoaded(engine_offloaders.HostLockedLoads):
    """Frees a slot once every load from it has completed on the device (its event queried), before
    ``get_finished()`` has reported them: right, since nothing reads the slot any more."""

    def __init__(self, cache, host_pool, runtime=None) -> None:
        super().__init__(cache, host_pool, unlock_on_issue=False)

    def evict(self, slot_ids):
        return all(done.query() for job, done in self.in_flight if set(self.locked_by.get(job, ())) & set(slot_ids))


def test_a_slot_freed_once_its_load_has_completed_is_clean_before_the_load_is_reported() -> None:
    ops = LOAD_THEN_EVICT[:-1] + [{"op": "sync_device"}, {"op": "evict", "slot": 1}, {"op": "poll"},
                                  {"op": "read", "block": 7, "stream": 1}]
    episode = Episode(EpisodeConfig(offloader="tests/test_offload.py:FreesSlotsOnceLoaded"))
    for op in ops:
        episode.apply(op)
    assert episode.component.jobs[3].slot_freed and episode.component.slots[1].loads == 0
    assert 3 in episode.component.reported and episode.finish() == []
    # asked before the copy has run, it keeps the slot
    episode = Episode(EpisodeConfig(offloader="tests/test_offload.py:FreesSlotsOnceLoaded"))
    for op in LOAD_THEN_EVICT:
        episode.apply(op)
    assert episode.component.slots[1].state == "stored" and episode.finish() == []


def test_an_offloader_without_load_is_refused_with_the_fix() -> None:
    with pytest.raises(HarnessError, match=r"in the offloader's factory, not a finding: .*no load\(\); an offloader has store") as raised:
        Episode(EpisodeConfig(offloader="tests/test_offload.py:NoLoad"))
    assert raised.value.status == 2  # the user's to fix


def test_bad_declarations_and_specs_name_the_value_and_the_fix() -> None:
    with pytest.raises(OffloaderSpecError, match="pass a tuple"):
        OffloaderCapabilities(host_memory="pinned")
    with pytest.raises(OffloaderSpecError, match="'huge' is not one of pinned, registered"):
        OffloaderCapabilities(host_memory=("huge",))
    with pytest.raises(OffloaderSpecError, match="'nope' is not a geometry"):
        OffloaderCapabilities(geometries=("nope",))
    with pytest.raises(OffloaderSpecError, match="file 'missing.py' does not exist"):
        load_offloader("missing.py:make")
    with pytest.raises(OffloaderSpecError, match="'module:attr'"):
        load_offloader("no_colon")
    with pytest.raises(TypeError, match="not a job id"):
        finished_job_ids(["x"], "spec")
    assert finished_job_ids([3, (4, False)], "spec") == [(3, True), (4, False)]


def test_cache_block_map_names_the_blocks_a_view_meets() -> None:
    cache = build_cache(geometry("ratio2"))  # two kernel blocks per logical block
    blocks = CacheBlockMap(cache)
    kv = cache.layer_tensors["model.layers.0.self_attn.attn"]
    assert blocks.of_runs(byte_runs(kv[:, 6:8])) == {3}
    assert blocks.of_runs(byte_runs(kv[:, 5:7])) == {2, 3}
    assert blocks.of_runs([(cache.raws[0].data_ptr(), cache.raws[0].data_ptr() + 4)]) == set()  # a guard word


def test_host_pool_mirrors_the_device_layout() -> None:
    spec = geometry("kv_outer_bf16")
    pool = build_host_pool(spec, memory="registered")
    try:
        device = build_cache(spec)
        for name, tensor in device.layer_tensors.items():
            assert pool.cache.layer_tensors[name].shape == tensor.shape and pool.cache.layer_tensors[name].device.type == "cpu"
    finally:
        pool.release()


def test_offload_ops_minimize_with_their_slots() -> None:
    """Dropping a store drops the loads and evictions of its slot, and the rest still replays."""
    ops = [{"op": "start"}, {"op": "allocate", "n": 2}, {"op": "store", "block": 1}, {"op": "store", "block": 2},
           {"op": "poll", "sync": 1}, {"op": "load", "slot": 2}, {"op": "poll", "sync": 1}, {"op": "evict", "slot": 1},
           {"op": "write", "block": 7}]
    refs = symbolic(ops, num_blocks=8)
    assert concrete(refs, 8) == ops
    without_first_store = concrete(refs[:2] + refs[3:], 8)
    assert without_first_store == [{"op": "start"}, {"op": "allocate", "n": 2}, {"op": "store", "block": 2},
                                   {"op": "poll", "sync": 1}, {"op": "load", "slot": 1}, {"op": "poll", "sync": 1},
                                   {"op": "write", "block": 7}]
    assert run_ops(_config("load_waits_forward"), without_first_store) == []


def test_offload_campaigns_cover_every_geometry_and_host_pool() -> None:
    campaigns = offload_campaigns(["sim"], f"{EXAMPLES}:load_waits_forward")
    ids = {c.id for c, skipped in campaigns if skipped is None}
    assert len(ids) == len(geometry_names()) * 2 * 2  # geometries x host pools x shards
    assert any("host-registered" in i for i in ids) and all(c.expect == "clean" for c, _ in campaigns)


def test_an_offload_campaign_regenerates_from_its_summary_record(tmp_path: Path) -> None:
    import json

    from repro.regenerate import find_campaign, from_summary

    spec = f"{EXAMPLES}:store_without_compute_event"
    campaign = Campaign(_config("store_without_compute_event"), shard=0, expect="clean")
    assert find_campaign(campaign.id, offloader=spec) == campaign
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"totals": {"profile": "quick"}, "campaigns": [
        {"campaign": campaign.id, "found": True, "seeds": [7], "offloader": spec}]}))
    assert from_summary(summary)[0].offloader == spec


def test_cuda_offloader_accesses_name_the_blocks_their_bytes_meet() -> None:
    """The cuda backend's mapping of an offloader's op to blocks (kvdevice.intercept.cuda_ops), run on
    host tensors standing in for device ones: only the address arithmetic is under test here."""
    from types import SimpleNamespace

    from kvdevice.intercept.cuda_ops import CudaOps
    from kvdevice.intercept.session import InterceptSession

    cache = build_cache(geometry("tiny"))
    session = SimpleNamespace(share=SimpleNamespace(recorded=set()), block_map=CacheBlockMap(cache), ids=(5,))
    ops = CudaOps(session)
    ops.note_cache([raw.untyped_storage().data_ptr() for raw in cache.raws])
    kv = cache.layer_tensors["model.layers.0.self_attn.attn"]
    staging = torch.zeros(2, 4, 2, 4)
    _, _, access = ops._offloader_accesses([kv[:, 3], staging], [], None)  # a store's copy out of block 3
    assert session.block_map.of_runs(access.read) == {3} and not access.written and not access.rows_unknown
    block2 = kv[:, 2]
    _, _, access = ops._offloader_accesses([block2, staging], [block2], None)  # a load's copy into block 2
    assert session.block_map.of_runs(access.written) == {2} and not access.read
    rows = torch.tensor([1, 6])  # index_copy_ into rows a host index names
    _, _, access = ops._offloader_accesses([kv, rows], [kv], (0, 1, rows, True, kv))
    assert session.block_map.of_runs(access.written) == {1, 6}
    on_device = torch.empty(2, dtype=torch.int64, device="meta")  # rows chosen by device values: the call's blocks
    _, _, access = ops._offloader_accesses([kv], [kv], (0, 1, on_device, True, kv))
    assert access.rows_unknown and not access.written
    assert InterceptSession._declare(session, [], [], access)["blocks_written"] == [5]


def _host_op_mode(pinned_storages, monkeypatch=None):
    """The torch-function mode of an offloader's session on CUDA, every tensor over one of
    ``pinned_storages`` pinned; what it records, as (verb, name) pairs."""
    from types import SimpleNamespace

    from kvdevice.intercept.torch_mode import InterceptMode

    seen = []

    def lookup(t):
        return "region" if t.untyped_storage().data_ptr() in pinned_storages else None

    host = SimpleNamespace(lookup=lookup, host_write=lambda region, t, label: seen.append(("write", label.split(": ")[1])),
                           host_read=lambda region, t, label: seen.append(("read", label.split(": ")[1])))
    session = SimpleNamespace(backend="cuda", host=host, rt=SimpleNamespace(), block_map=object(), call="store#1",
                              boundary=lambda what: None)
    return InterceptMode(session), seen


def test_a_copy_between_the_device_and_pinned_memory_is_not_a_host_op(monkeypatch) -> None:
    """On CUDA a ``pinned.copy_(device_tensor, non_blocking=True)`` reaches the torch-function mode
    with a CPU destination; it is the device's queued copy, not a host write of the pinned bytes."""
    from kvdevice.intercept import torch_mode

    pinned, device_like, source = torch.zeros(4), torch.zeros(4, device="meta"), torch.ones(4)
    mode, seen = _host_op_mode({pinned.untyped_storage().data_ptr(), source.untyped_storage().data_ptr()})
    monkeypatch.setattr(torch_mode, "forward", lambda func, *args, **kwargs: None)  # a meta source cannot be copied
    mode._host_op(torch.Tensor.copy_, (pinned, device_like), {})
    assert seen == []
    monkeypatch.undo()
    mode._host_op(torch.Tensor.copy_, (pinned, source), {})  # host to host: a write of the pinned bytes
    assert [verb for verb, _ in seen] == ["write", "read"]


def test_metadata_and_views_of_pinned_memory_touch_no_byte_but_a_read_of_its_values_does() -> None:
    """vLLM's handler builds its address tables from ``data_ptr()`` and ``stride()`` of the pinned
    pool while a store into it is queued: no byte of it is read then (a false race, seen once)."""
    pool = torch.zeros(8, 4)
    mode, seen = _host_op_mode({pool.untyped_storage().data_ptr()})
    assert mode._host_op(torch.Tensor.stride, (pool,), {}) == (4, 1)
    assert mode._host_op(torch.Tensor.element_size, (pool,), {}) == 4
    assert mode._host_op(torch.Tensor.shape.__get__, (pool,), {}) == (8, 4)
    view = mode._host_op(torch.Tensor.__getitem__, (pool, 3), {})
    assert view.data_ptr() == pool[3].data_ptr() and seen == []
    mode._host_op(torch.Tensor.sum, (pool,), {})
    mode._host_op(torch.Tensor.__getitem__, (pool, torch.tensor([1, 2])), {})  # a gather: a copy of the rows
    mode._host_op(torch.Tensor.fill_, (view, 1.0), {})
    assert seen == [("read", "Tensor.sum reads a pinned buffer"), ("read", "Tensor.__getitem__ reads a pinned buffer"),
                    ("write", "Tensor.fill_ writes a pinned buffer")]


# -- vLLM's handler shape: transfer_async(job_id, (src, dst)), the direction told by the spec's class --
class GPUSpec:
    def __init__(self, block_ids):
        self.block_ids = np.asarray(block_ids, dtype=np.int64)


class CPUSpec(GPUSpec):
    pass


class ClassRoutedHandler:
    """Routes by ``isinstance`` as vLLM's CpuGpuOffloadingHandler does (transfer_async only)."""

    def __init__(self, cache, host_pool) -> None:
        self.inner = engine_offloaders.CpuOffloadHandler(cache, host_pool)

    def transfer_async(self, job_id, spec):
        src, dst = spec
        if isinstance(src, CPUSpec):
            self.inner.load(job_id, src.block_ids.tolist(), dst.block_ids.tolist())
        else:
            self.inner.store(job_id, src.block_ids.tolist(), dst.block_ids.tolist())
        return True

    def get_finished(self):
        return self.inner.get_finished()

    def wait(self, job_ids):
        self.inner.wait(job_ids)


def _declaring_factory(tmp_path: Path, handler: str) -> Path:
    """A factory file ``make`` building ``handler`` (a class of this module), declaring its spec classes."""
    source = tmp_path / f"{handler}.py"
    source.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        f"from test_offload import CPUSpec, GPUSpec, {handler}\n"
        "from zeroer.offload import OffloaderCapabilities\n"
        "def make(cache, host_pool, runtime=None):\n"
        f"    return {handler}(cache, host_pool)\n"
        "make.capabilities = OffloaderCapabilities(transfer_specs=(GPUSpec, CPUSpec))\n")
    return source


def test_a_handler_routing_by_its_spec_classes_gets_its_own_classes_when_it_declares_them(tmp_path: Path) -> None:
    source = _declaring_factory(tmp_path, "ClassRoutedHandler")
    source.write_text(source.read_text() + "def undeclared(cache, host_pool, runtime=None):\n"
                                           "    return ClassRoutedHandler(cache, host_pool)\n")
    ops = [{"op": "start"}, {"op": "allocate", "n": 2}, {"op": "write", "block": 1}, {"op": "store", "block": 1},
           {"op": "poll", "sync": 1}, {"op": "free", "block": 1}, {"op": "load", "slot": 1}, {"op": "poll", "sync": 1}]
    assert run_ops(EpisodeConfig(offloader=f"{source}:make"), ops) == []
    # without the declaration every job is taken for a store: the load's block is never written
    assert run_ops(EpisodeConfig(offloader=f"{source}:undeclared"), ops)


def test_transfer_specs_must_be_a_pair_of_callables() -> None:
    from zeroer.offload import OffloaderCapabilities, OffloaderSpecError

    with pytest.raises(OffloaderSpecError, match=r"^OffloaderCapabilities\(transfer_specs=\('GPU', 'CPU'\)\): pass "
                                                 r"\(gpu_spec, cpu_spec\), two classes or functions"):
        OffloaderCapabilities(transfer_specs=("GPU", "CPU"))


class RaisesOnItsFirstStore(ClassRoutedHandler):
    def transfer_async(self, job_id, spec):
        if job_id >= 2 and not isinstance(spec[0], CPUSpec):
            raise ValueError("no room in the CPU pool")
        return super().transfer_async(job_id, spec)


def test_a_transfer_async_offloaders_exception_names_the_call_it_has(tmp_path: Path) -> None:
    source = _declaring_factory(tmp_path, "RaisesOnItsFirstStore")
    found = run_ops(EpisodeConfig(offloader=f"{source}:make"),
                    [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}])
    assert found and found[0].message.startswith(
        "offloader raised at step 3 in transfer_async(2, (GPU[1], CPU[1])): ValueError: no room in the CPU pool")
    assert found[0].kind == "offloader raised"  # filed under its component, as docs/offload-contract.md lists it
    signature = finding_signature(found[0], zeroer=f"{source}:make", geometry="tiny")
    assert signature.site.startswith("transfer_async raised ValueError"), signature


# -- construction and the controlled cuda runtime's ungated() ------------------------------------------

def test_an_offloaders_construction_leaves_nothing_queued_for_the_warm_ups_ungated_scope(monkeypatch):
    # On controlled cuda, ungated() refuses while ops are queued behind gates; HiCache's constructor
    # stages its tables and free slots on the device, and every campaign stopped at its first op with
    # "ungated() needs an idle runtime, but ops are queued on stream(s) 'main' (1)". The simulator here
    # keeps that rule (the controlled runtime's own ungated()); construction now runs ungated.
    from fuzz.engine import episode as episode_module
    from kvdevice.runtime.cuda.controlled import ControlledCudaRuntime
    from kvdevice.runtime.sim import SimRuntime

    class ControlledRules(SimRuntime):
        _ungated = False

        @contextlib.contextmanager
        def ungated(self):
            with ControlledCudaRuntime.ungated(self):  # refused while ops are queued
                yield
                self.queues.drain_all()  # what was issued inside has run (on cuda, each op as it is issued)

    monkeypatch.setattr(episode_module, "make_runtime", lambda backend, **_: ControlledRules())
    episode = Episode(EpisodeConfig(offloader="tests/engine_style/factories.py:hicache_controller", geometry="tiny",
                                    host_memory="pinned"))
    try:
        episode.apply({"op": "start"})
        block = episode.apply({"op": "allocate", "n": 1})[0]
        episode.apply({"op": "write", "block": block})
        episode.apply({"op": "store", "block": block, "stream": 0})
        episode.apply({"op": "sync_device"})
    finally:
        episode.abandon()
