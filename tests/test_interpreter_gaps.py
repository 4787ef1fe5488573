"""A Triton kernel the installed Triton's interpreter cannot run is the simulator's gap, never a finding.

The simulator runs a zeroer's Triton kernels under Triton's interpreter (kvdevice/triton_cpu.py,
kvdevice/intercept/triton_launch.py). Triton 3.6's interpreter failed on a loop bound loaded from
memory (``words = tl.load(sizes + job); for start in range(0, words, BLOCK)``) with ``TypeError:
only 0-dimensional arrays can be converted to Python scalars``: its ``tl.tensor.__index__`` calls
``int()`` on a one-element array, where Triton 3.9's squeezes it first. The interpreter is run with
a loaded scalar's index in hand (:func:`kvdevice.triton_cpu.nested_calls_interpreted`), so that
kernel runs on both; :func:`triton_3_6_index` plants Triton 3.6's own patch in the interpreter's
module to show it is overridden. :func:`interpreter_gap` plants a gap that remains, raised from
the interpreter's module as a real one is. Then:

* on the simulator the launch is a harness error (the interpreter's, recognised by where it was
  raised), never a finding; a genuine error of the kernel's own code (an ``IndexError`` in its
  Python) is still the zeroer's finding;
* a cuda campaign whose finding the simulator cannot replay shrinks it on the campaign's own
  backend instead, and says why (the simulator plays the GPU here, as in tests/test_shrink.py).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as triton_interpreter

from fuzz.engine import shrink as shrink_module
from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign
from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.harness_error import HarnessError
from fuzz.engine.shrink import ShrinkPlan, where

SPEC = "tests/test_interpreter_gaps.py"
START = {"op": "start", "in_flight": 1}
TWO_CALLS = [START, {"op": "allocate", "n": 1}, {"op": "allocate", "n": 1}]  # the single pinned buffer's race
CHUNKS = (1024,)  # words per chunk, one entry: indexed past its end by the broken kernel below


@triton.jit
def _zero_pages_looped(
    seg_addrs_ptr,  # uint64[n_segs]: byte address of logical block 0's page in each segment
    seg_block_strides_ptr,  # int64[n_segs]: int32 words from one logical block to the next
    seg_page_sizes_ptr,  # int64[n_segs]: int32 words to zero per block
    block_ids_ptr,  # int64[n_blocks]: the blocks to zero
    BLOCK: tl.constexpr,  # int32 words per iteration
):
    block_id = tl.load(block_ids_ptr + tl.program_id(0))
    seg = tl.program_id(1)
    page = tl.cast(tl.load(seg_addrs_ptr + seg), tl.pointer_type(tl.int32)) + block_id * tl.load(seg_block_strides_ptr + seg)
    words = tl.load(seg_page_sizes_ptr + seg)
    for start in range(0, words, BLOCK):  # a loaded loop bound: what Triton 3.6's interpreter cannot take
        cols = start + tl.arange(0, BLOCK)
        tl.store(page + cols, tl.zeros([BLOCK], dtype=tl.int32), mask=cols < words)


@triton.jit
def _zero_pages_indexing_past_a_tuple(
    seg_addrs_ptr,  # uint64[n_segs]
    seg_block_strides_ptr,  # int64[n_segs]
    seg_page_sizes_ptr,  # int64[n_segs]
    block_ids_ptr,  # int64[n_blocks]
    BLOCK: tl.constexpr,  # int32 words per iteration
):
    chunk = CHUNKS[2]  # the kernel's own bug: CHUNKS has one entry
    tl.store(tl.cast(tl.load(seg_addrs_ptr), tl.pointer_type(tl.int32)) + tl.arange(0, BLOCK), tl.zeros([BLOCK], dtype=tl.int32) + chunk)


def _single_pinned_buffer(kernel):
    """examples/engine_zeroers.py's single pinned buffer (racy: vLLM before #48085), launching ``kernel``."""
    from examples.engine_zeroers import SinglePinnedBuffer, _segments

    class Zeroer(SinglePinnedBuffer):
        def _launch(self, idx: torch.Tensor) -> None:
            seg_addrs, seg_block_strides, seg_page_sizes, _, _, n_segs = self._meta
            kernel[(idx.shape[0], n_segs)](seg_addrs, seg_block_strides, seg_page_sizes, idx, BLOCK=64)

    def make(cache, runtime):
        zeroer = Zeroer(cache)
        zeroer._segments = _segments
        return zeroer

    return make


looped = _single_pinned_buffer(_zero_pages_looped)
indexing_past_a_tuple = _single_pinned_buffer(_zero_pages_indexing_past_a_tuple)


def triton_3_6_index(monkeypatch) -> None:
    """Triton 3.6's ``tl.tensor.__index__`` (no squeeze), planted in the interpreter's module as the
    real one was."""
    namespace = vars(triton_interpreter)
    patch_tensor = namespace["_patch_lang_tensor"]
    source = ("def _patch_lang_tensor_3_6(tensor, scope):\n"
              "    _kvz_patch_tensor(tensor, scope)\n"
              "    scope.set_attr(tensor, '__index__', lambda self: int(self.handle.data))\n")
    monkeypatch.setitem(namespace, "_kvz_patch_tensor", patch_tensor)
    exec(compile(source, triton_interpreter.__file__, "exec"), namespace)
    monkeypatch.setattr(triton_interpreter, "_patch_lang_tensor", namespace.pop("_patch_lang_tensor_3_6"))


def interpreter_gap(monkeypatch, when=lambda: True) -> None:
    """While ``when()``, an interpreter that cannot take a loaded scalar as an index: the index
    :mod:`kvdevice.triton_cpu` gives the interpreter, replaced by one compiled in the interpreter's
    module that calls ``int()`` on the one-element array, so it raises from there as a gap of the
    interpreter does."""
    import kvdevice.triton_cpu as triton_cpu

    namespace = vars(triton_interpreter)
    source = ("def _kvz_index_3_6(self):\n"
              "    return int(self.handle.data) if _kvz_when() else _kvz_index(self)\n")
    monkeypatch.setitem(namespace, "_kvz_when", when)
    monkeypatch.setitem(namespace, "_kvz_index", triton_cpu._scalar_index)
    exec(compile(source, triton_interpreter.__file__, "exec"), namespace)
    monkeypatch.setattr(triton_cpu, "_scalar_index", namespace.pop("_kvz_index_3_6"))


def interpreted_alone(kernel) -> torch.Tensor:
    """``kernel`` zeroing 100 int32 words of one page, under Triton's interpreter as it is."""
    from triton.runtime.interpreter import InterpretedFunction

    page = torch.ones(128, dtype=torch.int32)
    tables = (torch.tensor([page.data_ptr()], dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
              torch.tensor([100], dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    InterpretedFunction(kernel.fn)[(1, 1)](*tables, BLOCK=64)
    return page


def test_the_looped_kernel_runs_under_this_triton_and_its_race_shows():
    [finding] = run_ops(EpisodeConfig(zeroer=f"{SPEC}:looped"), TWO_CALLS)[:1]
    assert finding.kind == "hazard"


def test_the_looped_kernel_runs_under_triton_3_6s_index_too(monkeypatch):
    triton_3_6_index(monkeypatch)
    with pytest.raises(triton.runtime.errors.InterpreterError, match="only 0-dimensional arrays"):
        interpreted_alone(_zero_pages_looped)  # what Triton 3.6 does on its own
    [finding] = run_ops(EpisodeConfig(zeroer=f"{SPEC}:looped"), TWO_CALLS)[:1]
    assert finding.kind == "hazard"


def test_a_kernel_the_interpreter_cannot_run_is_a_harness_error_on_the_simulator_never_a_finding(monkeypatch):
    interpreter_gap(monkeypatch)
    with pytest.raises(HarnessError) as raised:
        run_ops(EpisodeConfig(zeroer=f"{SPEC}:looped"), TWO_CALLS)
    assert re.match(r"harness error at step \d+ in the zeroer's .*, not a finding: SimulatorGap: Triton's interpreter "
                    r"could not run triton _zero_pages_looped on the simulator \(TypeError: only 0-dimensional arrays "
                    r"can be converted to Python scalars\); ", raised.value.message), raised.value.message


def test_an_error_of_the_kernels_own_code_is_still_the_zeroers_finding():
    [finding] = run_ops(EpisodeConfig(zeroer=f"{SPEC}:indexing_past_a_tuple"), TWO_CALLS)
    assert finding.kind == "zeroer raised"
    assert re.match(r"zeroer raised at step \d+ in .*triton _zero_pages_indexing_past_a_tuple.*: IndexError: tuple "
                    r"index out of range$", finding.message), finding.message
    assert finding.where.endswith("(chunk = CHUNKS[2]  # the kernel's own bug: CHUNKS has one entry)"), finding.where


def test_a_finding_the_simulators_interpreter_cannot_replay_is_shrunk_on_the_campaigns_backend(tmp_path, monkeypatch):
    # The simulator plays the GPU; its interpreter fails only while the finding is shrunk "on the simulator".
    shrinking = []
    on_simulator = shrink_module._shrink_on_simulator

    def shrink_on_simulator(*args, **kwargs):
        shrinking.append(True)
        try:
            return on_simulator(*args, **kwargs)
        finally:
            shrinking.pop()

    monkeypatch.setattr(shrink_module, "_shrink_on_simulator", shrink_on_simulator)
    interpreter_gap(monkeypatch, when=lambda: bool(shrinking))
    config = EpisodeConfig(zeroer=f"{SPEC}:looped", geometry="tiny")
    confirmed = []
    plan = ShrinkPlan(shrink_on=dataclasses.replace(config, streams=config.streams),
                      confirm=lambda c, ops: confirmed.append(ops) or run_ops(c, ops))
    result = run_campaign(Campaign(config, expect="finds"), PROFILES["quick"], tmp_path, shrink_plan=plan)
    assert result.found and result.harness_error is None and result.violation.findings[0].kind == "hazard"
    shrink = result.shrink
    assert shrink["by"] == "minimize" and shrink["shrunk_on"] == where(config) and shrink["confirmed_on"] is None
    assert confirmed == []  # nothing shrunk on the simulator to confirm
    assert re.match(rf"the simulator could not run the first failing program \({shrink['from_ops']} ops\): harness "
                    r"error at step \d+ in .*Triton's interpreter could not run triton _zero_pages_looped on the "
                    r"simulator \(TypeError: only 0-dimensional arrays", shrink["fallback"]), shrink["fallback"]
    assert shrink["replays"] > 0 and len(result.violation.trace) <= 4  # shrunk where it was found


def test_the_timeline_of_a_cuda_finding_the_interpreter_cannot_replay_draws_what_ran_and_says_why(tmp_path, monkeypatch):
    # The timeline of every finding is drawn on the simulator, a cuda one's too: a harness error
    # there must not cost the finding (fuzz/test_campaigns.py draws it after the trace is written).
    from fuzz.engine.trace import write_trace
    from fuzz.timeline import build_timeline
    from fuzz.trace import load_trace

    interpreter_gap(monkeypatch)
    trace = write_trace(tmp_path, EpisodeConfig(zeroer=f"{SPEC}:looped"), TWO_CALLS, [], seed=1)
    timeline = build_timeline(load_trace(trace))
    assert re.match(r"replay stopped at op 0 \(start\(in_flight=1\)\): harness error at step 1 in the zeroer's queued op "
                    r"triton _zero_pages_looped.*Triton's interpreter could not run", timeline["otherData"]["stopped"]), \
        timeline["otherData"]["stopped"]


# -- an offloader's queued kernel: the same two verdicts, filed under the offloader ---------------------------
@triton.jit
def _rewrite_page_looped(page_ptr, words_ptr, BLOCK: tl.constexpr):
    words = tl.load(words_ptr)
    for start in range(0, words, BLOCK):  # a loaded loop bound, as in _zero_pages_looped
        cols = start + tl.arange(0, BLOCK)
        tl.store(page_ptr + cols, tl.load(page_ptr + cols, mask=cols < words), mask=cols < words)


@triton.jit
def _rewrite_page_indexing_past_a_tuple(page_ptr, words_ptr, BLOCK: tl.constexpr):
    chunk = CHUNKS[2]  # the offloader's own bug: CHUNKS has one entry
    tl.store(page_ptr + tl.arange(0, BLOCK), tl.load(page_ptr + tl.arange(0, BLOCK)) + chunk)


class _KernelOnStore:
    """An offloader whose store queues ``kernel`` over the block's first page; it reports at once."""

    def __init__(self, kernel, cache, host_pool):
        self.kernel, self.layers = kernel, list(cache.layer_tensors.values())
        self.words = torch.tensor([16], dtype=torch.int64, device=self.layers[0].device)
        self.done = []

    def store(self, job_id, block_ids, slot_ids):
        if list(block_ids) != [0]:  # the harness's warm-up stores the null block 0
            self.kernel[(1,)](self.layers[0].view(torch.int32), self.words, BLOCK=16)
        self.done.append(job_id)

    def load(self, job_id, slot_ids, block_ids):
        self.done.append(job_id)

    def get_finished(self):
        done, self.done = self.done, []
        return done


def looped_offloader(cache, host_pool, runtime=None):
    return _KernelOnStore(_rewrite_page_looped, cache, host_pool)


def indexing_offloader(cache, host_pool, runtime=None):
    return _KernelOnStore(_rewrite_page_indexing_past_a_tuple, cache, host_pool)


STORE_THEN_SYNC = [START, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "poll", "sync": 1}]


def _offloader(attr: str) -> EpisodeConfig:
    return EpisodeConfig(zeroer="reference", offloader=f"{SPEC}:{attr}", geometry="tiny")


def test_an_offloaders_queued_kernel_the_interpreter_cannot_run_is_a_harness_error_named_after_the_offloader(monkeypatch):
    interpreter_gap(monkeypatch)
    with pytest.raises(HarnessError) as raised:
        run_ops(_offloader("looped_offloader"), STORE_THEN_SYNC)
    assert re.match(rf"harness error at step 4 in the offloader's queued op triton _rewrite_page_looped#\d+ on stream "
                    rf"'main' \({re.escape(SPEC)}:looped_offloader\.store#\d+\(\[1\]\)\), not a finding: SimulatorGap: "
                    rf"Triton's interpreter could not run triton _rewrite_page_looped", raised.value.message), raised.value.message
    assert raised.value.status == 3


def test_an_error_of_an_offloaders_queued_kernel_is_the_offloaders_finding():
    [finding] = run_ops(_offloader("indexing_offloader"), STORE_THEN_SYNC)
    assert finding.kind == "offloader raised"
    assert re.match(r"offloader raised at step 4 in its queued op triton _rewrite_page_indexing_past_a_tuple.*: "
                    r"IndexError: tuple index out of range$", finding.message), finding.message
