"""Plain torch zeroers under interception, on the simulator: judged rightly, and told what cannot be routed."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign
from fuzz.engine.episode import Episode, EpisodeConfig
from zeroer.cache.geometries import geometry
from zeroer.cache.layout import build_cache
from kvdevice.intercept.errors import InterceptError, in_tool_words, simulator_gap, unroutable
from kvdevice.intercept.sim_tensor import SimCudaTensor
from zeroer.protocol import check_factory
from zeroer.registry import LoadedZeroer
from kvdevice.runtime import make_runtime

import torch_zeroers  # tests/, with examples/ on sys.path (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = "examples/engine_zeroers.py"
VARIANTS = {**{n: "racy" for n in torch_zeroers.RACY}, **{n: "race-free" for n in torch_zeroers.RACE_FREE}}


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


def campaign_of(spec: str, verdict: str, geometry_name: str = "tiny") -> Campaign:
    return Campaign(EpisodeConfig(zeroer=spec, geometry=geometry_name), 0, "finds" if verdict == "racy" else "clean")


# -- verdicts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_torch_variant_is_judged_rightly_on_the_simulator(name, tmp_path):
    verdict = VARIANTS[name]
    result = run_campaign(campaign_of(f"tests/torch_zeroers.py:{name}", verdict), PROFILES["quick"], tmp_path)
    assert result.found == (verdict == "racy"), result.violation


def test_a_numpy_write_under_a_pending_copy_is_a_hazard_naming_the_call_and_the_op():
    episode = Episode(EpisodeConfig(zeroer=f"{EXAMPLES}:single_pinned_buffer"))
    episode.apply({"op": "start", "in_flight": 1})
    episode.apply({"op": "allocate", "n": 1, "stream": 0})
    episode.apply({"op": "allocate", "n": 1, "stream": 0})
    [finding] = episode.new_hazard_findings()
    assert finding.message.startswith(
        "hazard at step 3: host write to pinned host buffer p1 of the zeroer (torch.empty(pin_memory=True)) by the "
        "host code of examples/engine_zeroers.py:single_pinned_buffer.zero_block_ids#4([2]) between the start of "
        "the call and Tensor.copy_ while copy_ (h2d)#"
    )
    assert "(examples/engine_zeroers.py:single_pinned_buffer.zero_block_ids#3([1])) may not have read it yet" in finding.message
    episode.close()


def test_a_kernel_aimed_outside_every_allocation_is_reported_not_run():
    episode = Episode(EpisodeConfig(zeroer="tests/torch_zeroers.py:wild_kernel"))
    episode.apply({"op": "start", "in_flight": 1})
    [finding] = episode.new_hazard_findings()
    assert re.search(r"illegal address: kernel triton _zero_kv_blocks_kernel stores 32 word\(s\) outside every "
                     r"allocation, the first at 0x[0-9a-f]+ \((\d+ bytes (past the end of|before the start of) .+|no "
                     r"memory near it)\); on a GPU this is cudaErrorIllegalAddress, here the access was skipped$",
                     finding.message), finding.message
    assert not episode.cache.guard_violations()  # the store was skipped
    episode.close()


def test_the_exported_script_of_an_intercepted_finding_imports_the_users_module_and_shows_the_race(tmp_path):
    import subprocess
    import sys

    from fuzz.engine.trace import write_trace
    from repro.__main__ import main
    from repro.replay import replay

    config = EpisodeConfig(zeroer=f"{EXAMPLES}:single_pinned_buffer", geometry="tiny")
    ops = [{"op": "start", "in_flight": 1}, {"op": "allocate", "n": 1, "stream": 0}, {"op": "allocate", "n": 1, "stream": 0}]
    shown, findings, _ = replay(config, ops, repeat=20)
    assert shown == 20 and findings
    trace = write_trace(tmp_path, config, ops, findings, seed=1, campaign="test")
    script = tmp_path / "single_pinned_buffer_race.py"
    assert main(["export", str(trace), "-o", str(script)]) == 0
    # On the simulator, also where CUDA is present (the script's own environment line initialises it).
    run = subprocess.run([sys.executable, str(script), "--repeat", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    shown = f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.returncode == 1, shown
    assert run.stdout.rstrip().endswith("examples/engine_zeroers.py:single_pinned_buffer: reproduced 3 of 3 on sim"), shown


# -- what a plain torch zeroer sees ---------------------------------------------------------------
class _Probe:
    """Records what torch says while it is built and called."""

    def __init__(self, cache, runtime) -> None:
        self.seen = {"available": torch.cuda.is_available(), "cache_is_cuda": cache.layer_tensors[
            next(iter(cache.layer_tensors))].is_cuda}
        host = torch.arange(4, dtype=torch.int64)
        self.moved = host.to("cuda")
        self.host_ptr = host.data_ptr()
        self.stream = torch.cuda.current_stream()

    def zero_block_ids(self, block_ids) -> None:
        self.seen["current"] = torch.cuda.current_stream()


def _bind(factory, geometry_name: str = "tiny", spec: str = "probe"):
    rt = make_runtime("sim")
    cache = build_cache(geometry(geometry_name), device=rt.device)
    return rt, cache, LoadedZeroer(spec, factory, check_factory(factory, spec)).build(cache, rt)


def test_a_plain_torch_zeroer_sees_cuda_and_a_host_move_never_aliases_host_memory():
    rt, cache, bound = _bind(_Probe)
    probe = bound.zeroer
    assert probe.seen == {"available": True, "cache_is_cuda": True}
    assert isinstance(probe.moved, SimCudaTensor) and probe.moved.is_cuda
    assert probe.moved.data_ptr() != probe.host_ptr
    side = rt.new_stream("side")
    with rt.use_stream(side):
        bound.zero_block_ids([1])
    assert probe.seen["current"].runtime_stream is side
    assert torch.cuda.is_available() is False or torch.cuda.device_count() >= 1  # put back after the call


def test_the_patches_are_undone_when_the_zeroer_raises():
    class Raises(_Probe):
        def zero_block_ids(self, block_ids) -> None:
            raise RuntimeError("boom")

    stream_class, run = torch.cuda.Stream, __import__("triton").runtime.jit.JITFunction.run
    rt, cache, bound = _bind(Raises)
    with pytest.raises(RuntimeError, match="^boom$"):
        bound.zero_block_ids([1])
    assert torch.cuda.Stream is stream_class and __import__("triton").runtime.jit.JITFunction.run is run
    assert torch.Tensor.record_stream is torch._C.TensorBase.record_stream


# -- what cannot be routed ---------------------------------------------------------------------
def _refused(body):
    class Refuses(_Probe):
        def zero_block_ids(self, block_ids) -> None:
            body(self)

    return _bind(Refuses)[2]


REFUSED = [
    (lambda z: ctypes.CDLL("libcudart.so").cudaLaunchKernel,
     "ctypes.CDLL('libcudart.so').cudaLaunchKernel: the harness follows cuMemcpyBatchAsync, cuMemcpyAsync, "
     "cudaMemcpyAsync and cuGetProcAddress of the CUDA libraries, and no other raw CUDA call (it can neither simulate nor gate it); run the "
     "code on a GPU in the free-running mode instead (--backend cuda --cuda-mode free), where its calls run as they are"),
    (lambda z: __import__("cupy"),
     "importing 'cupy' inside the intercepted code under test: its CUDA calls bypass torch, so the harness can neither "
     "simulate nor gate them; run the code on a GPU in the free-running mode instead "
     "(--backend cuda --cuda-mode free), where its calls run as they are"),
    (lambda z: torch.cuda.CUDAGraph(),
     "torch.cuda.CUDAGraph: the harness cannot order or schedule it; run the code on a GPU in the free-running "
     "mode instead (--backend cuda --cuda-mode free), where its calls run as they are"),
    (lambda z: torch.cuda.Event(interprocess=True),
     "torch.cuda.Event(enable_timing=False, interprocess=True): an interprocess event is waited on by another "
     "process, which the harness cannot follow; create the event with interprocess=False"),
    (lambda z: _driver().cuMemsetD8Async(0, 0, 16, 0),
     "cuda.bindings.driver.cuMemsetD8Async: a CUDA call made around torch moves or orders device work the harness can "
     "neither simulate nor gate; run the code on a GPU in the free-running mode instead "
     "(--backend cuda --cuda-mode free), where its calls run as they are"),
]


def _driver():
    import sys

    return sys.modules["cuda.bindings.driver"]


@pytest.fixture
def bindings_loaded(monkeypatch):
    """``cuda.bindings.driver`` imported, as torch 2.13 imports the bindings wherever they are
    installed: the real module where cuda-bindings is installed, else a stand-in with its names."""
    import importlib
    import sys
    import types

    try:
        importlib.import_module("cuda.bindings.driver")
    except ImportError:
        package, bindings, module = (types.ModuleType(n) for n in ("cuda", "cuda.bindings", "cuda.bindings.driver"))
        package.bindings, bindings.driver = bindings, module
        module.cuMemcpyAsync = module.cuMemsetD8Async = lambda *args: (0,)
        module.cuDeviceGetCount = lambda: (0, 1)
        for name, value in (("cuda", package), ("cuda.bindings", bindings), ("cuda.bindings.driver", module)):
            monkeypatch.setitem(sys.modules, name, value)


@pytest.mark.parametrize("body, message", REFUSED,
                         ids=["ctypes-cudart", "cupy", "cuda-graph", "interprocess-event", "driver-copy"])
def test_what_cannot_be_routed_is_an_error_naming_the_call_and_the_way_forward(body, message, bindings_loaded):
    bound = _refused(body)
    with pytest.raises(InterceptError, match=exactly(message)):
        bound.zero_block_ids([1])


def test_cuda_bindings_imported_by_torch_or_the_zeroer_are_no_refusal_until_a_call_moves_device_work(
        bindings_loaded):
    # torch 2.13 imports cuda.bindings.runtime wherever cuda-bindings is installed; engines that call
    # the driver import it themselves. Neither moves a byte.
    def body(z):
        import cuda.bindings.driver as driver  # noqa: F401 - the import itself is what is checked

        return driver.cuDeviceGetCount is not None

    class Imports(_Probe):
        def zero_block_ids(self, block_ids) -> None:
            body(self)

    _bind(Imports)[2].zero_block_ids([1])
    assert _driver().cuMemcpyAsync.__name__ != "call"  # put back after the call


def test_a_pageable_tensor_passed_to_a_kernel_is_refused_as_cuda_would():
    from engine_zeroers import FreshPinnedPerCall

    class Pageable(FreshPinnedPerCall):
        def zero_block_ids(self, block_ids) -> None:
            self._launch(torch.tensor(list(block_ids), dtype=torch.int64))

    with pytest.raises(InterceptError, match=exactly(
            "triton _zero_kv_blocks_kernel: argument 'block_ids_ptr': it is a pageable CPU tensor, which a GPU "
            "kernel cannot read; pass a device tensor, or pinned memory (pin_memory=True)")):
        _bind(lambda cache, runtime: Pageable(cache))[2].zero_block_ids([1])


def test_a_torch_zeroer_that_uses_the_runtime_is_told_to_declare_it():
    def factory(cache, runtime):
        runtime.new_stream("mine")

    with pytest.raises(InterceptError, match=exactly(
            "zeroer 'probe' is loaded as a plain torch zeroer (its factory declares no Capabilities(api='runtime')), "
            "but it uses runtime.new_stream; a zeroer written against kvdevice.runtime declares capabilities = "
            "Capabilities(api='runtime') on its factory")):
        _bind(factory)


# -- the simulated allocator's stream rule -------------------------------------------------------------
def test_a_freed_block_is_reused_on_its_stream_only_and_after_record_stream_only_once_the_other_stream_ran():
    from kvdevice.intercept.session import InterceptSession

    rt = make_runtime("sim")
    session = InterceptSession(rt, "probe")
    memory, main, side = session.memory, rt.default_stream, rt.new_stream("side")
    first = memory.alloc(64, main, "a")
    block = first.block
    del first
    assert memory.alloc(64, side, "b").block is not block  # another stream: never handed over
    again = memory.alloc(64, main, "c")
    assert again.block is block and memory.reused == 1
    memory.record_stream(again, side)
    rt.launch(lambda: None, stream=side)  # side has queued work when the block is freed
    del again
    assert memory.alloc(64, main, "d").block is not block  # waits for side's event
    rt.synchronize()
    assert memory.alloc(64, main, "e").block is block


# -- on a GPU ------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")


@cuda
@pytest.mark.parametrize("name", ["single_pinned_buffer", "pinned_ring"])
def test_a_racy_examples_trace_reproduces_forced_on_cuda(name):
    from repro.replay import replay

    ops = [{"op": "start", "in_flight": 1}] + [{"op": "allocate", "n": 1, "stream": 0}] * 3
    config = EpisodeConfig(zeroer=f"{EXAMPLES}:{name}", geometry="tiny", backend="cuda", mode="controlled")
    shown, first, _ = replay(config, ops, repeat=20)
    assert shown >= 19, first


@cuda
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_torch_variant_is_judged_rightly_on_cuda_controlled(name, tmp_path):
    verdict = VARIANTS[name]
    config = EpisodeConfig(zeroer=f"tests/torch_zeroers.py:{name}", geometry="tiny", backend="cuda", mode="controlled")
    result = run_campaign(Campaign(config, 0, "finds" if verdict == "racy" else "clean"), PROFILES["quick"], tmp_path)
    assert result.found == (verdict == "racy"), result.violation


class _NoSession:
    """A session any use of which means a launch was taken for the zeroer's."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the launch reached the interception session ({name})")


def test_the_runtimes_gate_kernel_goes_straight_to_triton_and_any_other_kernel_is_the_zeroers():
    """The controlled CUDA runtime launches its gate kernel in front of every op it queues for the
    zeroer, an event record or wait too: that launch is the runtime's, whatever queued it (taken
    for the zeroer's, it was queued behind a new gate, itself a launch, and so on)."""
    from kvdevice.intercept.triton_launch import TritonLaunches
    from zeroer.kernel import _compiled as zero_kernel
    from racecheck.gate import _gate_kernel

    launched = []
    launches = TritonLaunches(_NoSession())
    launches.original = lambda jit, *args, grid, warmup, **kwargs: launched.append((jit, args, grid))
    run = launches.patches()["run"]
    run(_gate_kernel, 4096, grid=(1,), warmup=False)
    assert launched == [(_gate_kernel, (4096,), (1,))]
    with pytest.raises(AssertionError, match=r"^the launch reached the interception session \(boundary\)$"):
        run(zero_kernel, grid=(1,), warmup=False)


def test_a_way_to_the_gpu_is_said_in_the_words_of_the_tool_that_shows_it() -> None:
    # The fuzzer's words are the message; another tool rebuilds it with its own option, and a brace in
    # the program's own text (a call's repr) is never taken for the option's place.
    refused = unroutable("f({gpu})", "it cannot")
    assert str(refused) == ("f({gpu}): it cannot; run the code on a GPU in the free-running mode instead "
                            "(--backend cuda --cuda-mode free), where its calls run as they are")
    assert in_tool_words(refused, "a GPU instead (--backend cuda)") == (
        "f({gpu}): it cannot; run the code on a GPU instead (--backend cuda), where its calls run as they are")
    own_fix = unroutable("g", "it cannot", "pass x=1")
    assert str(own_fix) == in_tool_words(own_fix, "a GPU instead (--backend cuda)") == "g: it cannot; pass x=1"
    gap = simulator_gap("h()", ValueError("bad"))
    assert str(gap).endswith("meanwhile run this code on a GPU in the free-running mode instead (--backend cuda --cuda-mode free)")
    assert in_tool_words(gap, "a GPU instead (--backend cuda)").endswith("meanwhile run this code on a GPU instead (--backend cuda)")
    assert in_tool_words(ValueError("v {gpu}"), "x") == "v {gpu}"
