"""A CUDA error raised by the code under test's own call is a finding; one raised inside the harness is ours.

vLLM's CPU offloading handler reports each finished job with its transfer time,
``start.elapsed_time(end)``. A handler that reports a job without asking its end event gets CUDA's
refusal (torch: ``Both events must be completed before calculating elapsed time.``) at that call,
on a GPU as on the simulator: it reported a transfer before the transfer finished. The fuzzer filed
that as a harness error, a bug of kvzero-fuzz (exit 3), because the runtime that raised it is the
harness's code. It is a ``cuda error`` finding now, named after the call, the state and what it
means, shrunk and replayed; the same error raised by the harness's own call stays a harness error.
examples/engine_offloaders.py has the handler (``report_without_end_query``) and its race-free twin
(``report_after_end_query``, which tests/test_offload.py also fuzzes in the ci profile).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign
from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.harness_error import HarnessError
from fuzz.engine.signature import finding_signature
from kvdevice.origin import blame
from kvdevice.runtime import make_runtime

ROOT = Path(__file__).resolve().parent.parent
RACY = "examples/engine_offloaders.py:report_without_end_query"
TWIN = "examples/engine_offloaders.py:report_after_end_query"
SHORTEST = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "poll"}]
NOT_COMPLETED = "RuntimeError: Both events must be completed before calculating elapsed time."


def _planted_in(module: str, source: str, **names):
    """The function ``source`` defines, as if it were code of the harness's ``module``: a test's
    own function is not the harness's, so kvdevice.origin would take it for the code under test's."""
    namespace = {"__name__": module, **names}
    exec(compile(source, f"<planted in {module}>", "exec"), namespace)
    return next(value for key, value in namespace.items() if callable(value) and key not in names)


def _raised(function):
    try:
        function()
    except Exception as error:  # noqa: BLE001 - the point
        return error
    raise AssertionError("did not raise")


def _timed_while_queued(rt):
    """A start and an end event with device work between them, none of it run (the simulator is lazy)."""
    start, end = rt.new_event(timing=True), rt.new_event(timing=True)
    rt.record_event(start)
    rt.launch(lambda: None, name="work")
    rt.record_event(end)
    return start, end


def test_a_handler_that_reports_a_job_before_its_end_event_completed_is_a_cuda_error_naming_the_call_and_the_state():
    [finding] = run_ops(EpisodeConfig(offloader=RACY), SHORTEST)
    assert finding.kind == "cuda error"
    assert re.fullmatch(
        r"cuda error at step 4 in the offloader's get_finished\(\) at examples/engine_offloaders\.py:\d+: elapsed_time on an "
        r"end event that had not completed: the job was reported before its copy finished \(" + re.escape(NOT_COMPLETED) + r"\)",
        finding.message), finding.message
    assert re.match(r"examples/engine_offloaders\.py:\d+ \(seconds = transfer\.start_event\.elapsed_time\(transfer\.end_event\)",
                    finding.where), finding.where
    assert finding.details.startswith("Traceback")
    assert run_ops(EpisodeConfig(offloader=TWIN), SHORTEST) == []


def test_the_fuzzer_finds_the_early_report_in_a_few_ops_and_its_shrunk_trace_replays(tmp_path):
    # A loaded machine must not cut the shrink short (tests/test_offload.py lifts the bound the same way).
    result = run_campaign(Campaign(EpisodeConfig(offloader=RACY), shard=0, expect="finds"), PROFILES["ci"], tmp_path,
                          shrink_bound_s=3600)
    assert result.found and result.harness_error is None, result.harness_error
    assert result.violation.findings[0].kind == "cuda error"
    assert [op["op"] for op in result.violation.trace] == ["start", "allocate", "store", "poll"]
    replayed = subprocess.run([sys.executable, "-m", "repro", "replay", str(result.trace_path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 1, replayed.stderr
    assert "reproduced 1 of 1 on sim" in replayed.stdout and "elapsed_time on an end event that had not completed" in replayed.stdout


def test_the_same_early_report_is_one_bug_whatever_the_step_and_the_jobs():
    def found(step: int, call: str) -> object:
        from fuzz.engine.oracle import Finding

        where = "examples/engine_offloaders.py:363 (seconds = transfer.start_event.elapsed_time(transfer.end_event))"
        message = (f"cuda error at step {step} in the offloader's {call} at examples/engine_offloaders.py:363: elapsed_time on "
                   f"an end event that had not completed: the job was reported before its copy finished ({NOT_COMPLETED})")
        return finding_signature(Finding("cuda error", None, message, where=where), zeroer=RACY, geometry="tiny")

    one, other = found(4, "get_finished()"), found(19, "get_finished()")
    assert one == other and str(one) == (
        "cuda error | engine_offloaders.py:report_without_end_query | the offloader's get_finished: elapsed_time on an end "
        f"event that had not completed: the job was reported before its copy finished ({NOT_COMPLETED}) at "
        "examples/engine_offloaders.py:363")
    assert found(7, "transfer_async(5, (GPU[2], CPU[3]))") == found(9, "transfer_async(8, (GPU[1], CPU[1]))") != one


class TimesItsZero:
    """A zeroer that times each call with two events and reads the time before they have run."""

    def __init__(self, cache, runtime) -> None:
        self.cache = cache

    def zero_block_ids(self, block_ids: list[int]) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for tensor in self.cache.layer_tensors.values():
            tensor.zero_()  # more than it should, beside the point here
        end.record()
        self.last_ms = start.elapsed_time(end)  # not synchronised: CUDA refuses it


def test_a_zeroers_own_refused_call_is_a_cuda_error_too_without_an_offloaders_meaning():
    config = EpisodeConfig(zeroer="tests/test_cuda_errors.py:TimesItsZero")
    [finding] = run_ops(config, [{"op": "start"}, {"op": "allocate", "n": 1}])
    assert finding.kind == "cuda error"
    assert re.fullmatch(r"cuda error at step 1 in the zeroer's warmup at tests/test_cuda_errors\.py:\d+: elapsed_time on "
                        r"an end event that had not completed \(" + re.escape(NOT_COMPLETED) + r"\)",
                        finding.message), finding.message


def test_a_cuda_error_raised_by_the_harness_own_call_stays_a_harness_error_of_ours(monkeypatch):
    from fuzz.engine.offload import OffloadSide

    # The harness times unfinished work itself, inside the scope of the offloader's get_finished().
    poll = _planted_in("fuzz.engine.offload", "def poll(self, sync=0):\n"
                       "    start, end = timed(self.episode.rt)\n"
                       "    with self._call('get_finished()'):\n"
                       "        self.episode.rt.elapsed_time(start, end)\n"
                       "    return []\n", timed=_timed_while_queued)
    monkeypatch.setattr(OffloadSide, "poll", poll)
    with pytest.raises(HarnessError) as raised:
        run_ops(EpisodeConfig(offloader=TWIN), SHORTEST)
    assert raised.value.status == 3
    assert raised.value.message.startswith(
        "harness error at step 4 in the offloader's get_finished(), not a finding: CudaStateRuntimeError: Both events must be "
        "completed before calculating elapsed time.; a bug of kvzero-fuzz, not of the code under test"), raised.value.message


def test_whose_a_refused_runtime_call_is_follows_who_called_the_runtime():
    rt = make_runtime("sim")
    try:
        start, end = _timed_while_queued(rt)
        # the code's own call of the runtime (a runtime-API zeroer): the code's, at its line
        mine = blame(_raised(lambda: rt.elapsed_time(start, end)))
        assert not mine.harness and "tests/test_cuda_errors.py" in mine.where
        # the harness's own call of the runtime: the harness's, a bug of ours
        timing = _planted_in("fuzz.engine.episode", "def timing(rt, start, end):\n    return rt.elapsed_time(start, end)\n")
        ours = blame(_raised(lambda: timing(rt, start, end)))
        assert ours.harness and ours.status == 3
    finally:
        rt.close()


def test_the_stress_loop_counts_the_early_report_as_found(tmp_path):
    from fuzz.bench.detect.baselines.stress import stress

    outcome = stress(EpisodeConfig(offloader=RACY), 60.0, 1, repro_dir=tmp_path)
    assert outcome.found and outcome.error is None, outcome.error
    assert "elapsed_time on an end event that had not completed" in outcome.message


def test_which_errors_are_cuda_errors_and_how_each_is_named():
    from fuzz.engine.cuda_error import cuda_refusal
    from kvdevice.runtime.cuda_errors import CudaStateRuntimeError

    refused = CudaStateRuntimeError("Both events must be completed before calculating elapsed time.",
                                    call="elapsed_time", state="an end event that had not completed")
    assert cuda_refusal(refused) == "elapsed_time on an end event that had not completed"
    assert refused.torch_type == "RuntimeError" and isinstance(refused, RuntimeError)
    # torch's own words for an error CUDA returned: a CUDA error whose state only CUDA's words say
    assert cuda_refusal(RuntimeError("CUDA error: operation not permitted when stream is capturing")) == "CUDA refused the call"
    assert cuda_refusal(RuntimeError("planted: cannot zero [1]")) is None and cuda_refusal(ValueError("bad id")) is None
