"""Sizing cuda parallelism to the free GPU memory, and an out-of-memory error as a resource error
(issue 17), without a GPU: the plan is arithmetic, the error is raised by hand."""

from __future__ import annotations

import pytest
import torch

from fuzz.bench.detect.report import judge, summarize
from fuzz.engine.gpu_workers import CONTEXT_BYTES, GIB, plan_workers, worker_bytes
from racecheck.resources import ResourceExhausted, is_out_of_memory, raise_if_out_of_memory
from zeroer.cache.geometries import geometry


def test_a_cache_knows_its_device_bytes():
    spec = geometry("int32_wrap")  # ten 512 MiB pages plus guards: just over 5 GiB
    assert 5 * GIB < spec.device_bytes < 5 * GIB + (1 << 20)


def test_a_worker_needs_a_context_and_copies_of_its_largest_cache():
    one, two = worker_bytes([geometry("tiny"), geometry("int32_wrap")], 1), worker_bytes([geometry("int32_wrap")], 2)
    assert one > CONTEXT_BYTES + 15 * GIB and two > 2 * (one - CONTEXT_BYTES)


def test_no_more_workers_than_the_free_memory_holds_and_the_plan_says_so():
    plan = plan_workers(16, 31 * GIB, [140 * GIB])
    assert plan.chosen == 4  # 4 x 31 <= 0.9 x 140 < 5 x 31
    assert plan.describe().startswith("GPU workers: 4 (asked for 16; more would not fit): 140 GiB free")


def test_workers_go_round_robin_over_the_gpus():
    # worker i runs on GPU i % 2: 5 workers put 3 on GPU 0, which has room for 2 only
    assert plan_workers(8, 10 * GIB, [25 * GIB, 100 * GIB]).chosen == 4
    assert plan_workers(3, 1 * GIB, [100 * GIB]).describe().startswith("GPU workers: 3:")


def test_at_least_one_worker_runs_even_when_none_fits():
    assert plan_workers(4, 200 * GIB, [100 * GIB]).chosen == 1


def test_an_out_of_memory_error_is_recognised_through_its_causes():
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    try:
        raise RuntimeError("while running copy_") from oom
    except RuntimeError as wrapped:
        assert is_out_of_memory(wrapped)
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(ResourceExhausted, match=r"^the GPU ran out of memory in warmup \(CUDA out of memory"):
        raise_if_out_of_memory(oom, "in warmup")
    raise_if_out_of_memory(ValueError("not memory"))  # anything else: left to the caller


def _record(seed: int, **fields) -> dict:
    base = {"method": "fuzz", "entry": "zoo.a", "kind": "zoo", "seed": seed, "geometry": "tiny", "found": True,
            "seconds": 0.5, "examples": 4, "steps": 60, "trace_len": 3, "repro": "/tmp/a.json", "message": "hazard",
            "error": None, "wall_s": 1.0}
    return {**base, **fields}


def test_a_resource_error_in_the_detection_benchmark_is_neither_found_nor_missed():
    oom = _record(2, found=False, seconds=None, error="the GPU ran out of memory", resource_error=True)
    rows = summarize([_record(1), oom])
    assert rows[0]["verdict"] == "resource error"
    summary = judge(rows, [])
    assert summary["by_method"]["fuzz"]["resource_errors"] == ["zoo.a"] and summary["exit_status"] == 2
    missed = _record(1, entry="zoo.b", found=False, seconds=None)
    assert judge(summarize([oom, missed]), [])["exit_status"] == 1  # a real miss still decides


def test_an_abandoned_episode_lets_go_of_its_caches_while_it_is_still_referenced():
    """A failing example's traceback keeps its episode alive until the garbage collector runs;
    on cuda each such episode pinned a whole cache (5 GiB for int32_wrap) until the GPU ran out
    of memory. Abandoned, it must hold no cache buffer any more."""
    import gc
    import weakref

    from fuzz.engine.episode import Episode, EpisodeConfig

    gc.disable()  # only reference counting: what a cycle through a traceback would leave
    try:
        episode = Episode(EpisodeConfig(zeroer="single_buffer", geometry="tiny", kernel="torch"))
        episode.apply({"op": "start", "in_flight": 1})
        episode.apply({"op": "allocate", "n": 1, "stream": 0})
        buffers = [weakref.ref(raw) for group in episode.groups for raw in group.cache.raws]
        episode.abandon()
        assert all(ref() is None for ref in buffers)
    finally:
        gc.enable()


def test_pytest_n_on_cuda_is_capped_by_the_free_gpu_memory_and_says_so(monkeypatch, capsys):
    from types import SimpleNamespace

    import fuzz.engine.gpu_workers as gpu_workers
    import fuzz.plugin as plugin

    monkeypatch.setattr(gpu_workers, "free_gpu_bytes", lambda: [140 * GIB])
    options = SimpleNamespace(backends=["cuda"], zeroer="zoo.int32_offset_4gib", geometries=None,
                              cuda_modes=("controlled",), shard=None, offloader=None, strict_caller=False)
    config = SimpleNamespace(option=SimpleNamespace(numprocesses=16), _fuzz_options=options)
    plugin._size_gpu_workers(config)
    assert config.option.numprocesses == 4
    assert capsys.readouterr().err.startswith("fuzz: GPU workers: 4 (asked for 16; more would not fit): 140 GiB free")
    sim = SimpleNamespace(option=SimpleNamespace(numprocesses=16), _fuzz_options=SimpleNamespace(**{**vars(options), "backends": ["sim"]}))
    plugin._size_gpu_workers(sim)
    assert sim.option.numprocesses == 16  # the simulator needs no GPU memory


def test_the_detection_benchmark_on_cuda_defaults_to_auto_and_fits_the_free_memory(monkeypatch, capsys):
    import fuzz.engine.gpu_workers as gpu_workers
    from fuzz.bench.detect.cli import AUTO_JOBS, detection_jobs, parse_args, workers_for

    monkeypatch.setattr(gpu_workers, "free_gpu_bytes", lambda: [140 * GIB])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    args = parse_args(["--backend", "cuda", "--methods", "fuzz", "--seeds", "1"], cuda_available=True)
    assert args.jobs == AUTO_JOBS
    assert workers_for(args, detection_jobs(args)) == 4  # zoo.int32_offset_4gib's x2 campaign: 31 GiB a worker
    assert "GPU workers: 4 (asked for 16; more would not fit)" in capsys.readouterr().err
    small = parse_args(["--backend", "cuda", "--methods", "fuzz", "--seeds", "1", "--entries", "zoo.single_buffer", "-j", "3"],
                       cuda_available=True)
    assert workers_for(small, detection_jobs(small)) == 3  # tiny caches: as many as asked
    assert parse_args([], cuda_available=False).jobs == 1  # the simulator keeps one by default

    def no_answer() -> list[int]:
        raise RuntimeError("could not read the free GPU memory: the query did not answer in 120 s")

    monkeypatch.setattr(gpu_workers, "free_gpu_bytes", no_answer)
    assert workers_for(args, detection_jobs(args)) == 1
    assert ("could not size the workers by the free GPU memory (could not read the free GPU memory: the query did "
            "not answer in 120 s); running 1") in capsys.readouterr().err


def test_a_free_memory_query_that_hangs_is_an_error_the_callers_report_not_a_crash(monkeypatch):
    """pytest fuzz and the detection benchmark catch RuntimeError (and run unsized, or one job); a
    hung query (a wedged driver) must reach them as one."""
    import subprocess

    from fuzz.engine import gpu_workers

    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    monkeypatch.setattr(gpu_workers.subprocess, "run", hang)
    with pytest.raises(RuntimeError, match=r"^could not read the free GPU memory: the query did not answer in 120 s$"):
        gpu_workers.free_gpu_bytes()


def test_a_bench_worker_on_a_gpu_asks_for_hardware_queues_and_eager_modules_before_its_context(monkeypatch):
    # On the H100 (2026-12-06) the offload bench's workers made their CUDA context in set_device
    # with the default 8 queues: an offloader's ninth stream was a harness error in every controlled
    # campaign. What the driver reads at context creation must be set before set_device.
    import os

    from fuzz.bench.pool import init_worker

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    seen = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.update(
        queues=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), loading=os.environ.get("CUDA_MODULE_LOADING")))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    init_worker(0)
    assert seen == {"queues": "32", "loading": "EAGER"}
    # Without a device index too (the detection bench's workers: the runtime makes the context later).
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    init_worker()
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "32" and os.environ.get("CUDA_MODULE_LOADING") == "EAGER"
