"""A harness failure is never a finding: each kind stops its campaign as a harness error.

Whose an exception is comes from where it was raised (kvdevice/origin.py), not from its type. Each
kind below (an op the harness cannot route, a clash in the runtime, a simulator gap, an input
outside the zeroer's contract, the GPU out of memory while a campaign is set up) must come out
as an error with its exit status and one line, and the campaign must not be counted as a finding;
and the other side: what the zeroer's own code raises, or a library raises on the zeroer's own
call, is still the zeroer's finding.
"""

from __future__ import annotations

import re

import pytest
import torch

from fuzz.engine.campaigns import PROFILES, Campaign, CampaignResult, run_campaign
from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.summary import harness_status, is_unexpected, render_summary, result_record
from kvdevice.origin import blame

SPEC = "tests/test_harness_errors.py"


class _VllmStyle:
    """Enough of a vLLM-style zeroer to run: the null block aside, it zeroes nothing itself."""

    def __init__(self, cache, runtime) -> None:
        self.device = cache.device
        self.seen = 0

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        self.seen += 1
        self.body(block_ids)

    def body(self, block_ids: list[int]) -> None:
        raise NotImplementedError


class UsesACudaGraph(_VllmStyle):
    def body(self, block_ids: list[int]) -> None:
        torch.cuda.CUDAGraph()  # the harness cannot order or schedule it


class TwoSideStreams(_VllmStyle):
    def __init__(self, cache, runtime) -> None:
        super().__init__(cache, runtime)
        self.sides = [torch.cuda.Stream(), torch.cuda.Stream()]

    def body(self, block_ids: list[int]) -> None:
        pass


class StagesIds(_VllmStyle):
    def body(self, block_ids: list[int]) -> None:
        torch.tensor(block_ids, dtype=torch.int64, device=self.device)


class RaisesItself(_VllmStyle):
    def body(self, block_ids: list[int]) -> None:
        raise RuntimeError(f"planted: cannot zero {block_ids}")


class FaultsTheGpu(_VllmStyle):
    def body(self, block_ids: list[int]) -> None:
        # What torch raises at the next CUDA call once a kernel made an illegal access (the H200,
        # side_stream_copy_event_on_caller in the controlled mode: its kernel read ids the race
        # had left unwritten).
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                           "asynchronously reported at some other API call")


class BadTorchCall(_VllmStyle):
    def body(self, block_ids: list[int]) -> None:
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        ids.view(len(block_ids) + 1)  # wrong on any device: torch refuses the zeroer's call


def _planted_in(module: str, source: str, **names):
    """The function ``source`` defines, as if it were code of the harness's ``module``: a test's
    monkeypatch is the test's code, which kvdevice.origin would take for the zeroer's."""
    namespace = {"__name__": module, **names}
    exec(compile(source, f"<planted in {module}>", "exec"), namespace)
    return next(value for key, value in namespace.items() if callable(value) and key not in names)


def _run(name: str, tmp_path, **config) -> CampaignResult:
    campaign = Campaign(EpisodeConfig(zeroer=f"{SPEC}:{name}", geometry="tiny", **config), 0, "clean")
    return run_campaign(campaign, PROFILES["quick"], tmp_path)


def _not_a_finding(result: CampaignResult, status: int, starts: str) -> None:
    record = result_record(result)
    assert not result.found and result.violation is None and result.trace_path is None
    assert result.harness_status == status and result.harness_error.startswith(starts), result.harness_error
    assert "\n" not in result.harness_error and result.harness_details.startswith("Traceback")
    assert not is_unexpected(record) and harness_status([record]) == status
    text, data = render_summary([record], "quick")
    assert data["totals"]["findings"] == 0 and data["totals"]["harness_errors"] == 1
    assert f"HARNESS ERROR, not judged: {starts}" in text and "VIOLATION" not in text


def test_an_unroutable_call_is_a_harness_error_the_user_can_fix_naming_the_call_and_its_line(tmp_path):
    result = _run("UsesACudaGraph", tmp_path)
    _not_a_finding(result, 2, "harness error at step 1 in the zeroer's warmup, called at ")
    assert re.search(r"called at \S*tests/test_harness_errors\.py:\d+ \(torch\.cuda\.CUDAGraph\(\) # the harness "
                     r"cannot order or schedule it\), not a finding: InterceptError: torch\.cuda\.CUDAGraph: the harness "
                     r"cannot order or schedule it; run the code on a GPU in the free-running mode instead",
                     result.harness_error), result.harness_error


def test_a_clash_in_the_runtime_is_a_harness_error_of_ours(tmp_path, monkeypatch):
    from kvdevice.runtime.base import Runtime

    # What per-session stream names did across the sessions of one runtime (the x2 campaigns).
    one_name = _planted_in("kvdevice.intercept.cuda_api", "def one_name(self, name=None):\n"
                           "    return new_stream(self, 'zeroer-1' if name and name.startswith('zeroer') else name)\n",
                           new_stream=Runtime.new_stream)
    monkeypatch.setattr(Runtime, "new_stream", one_name)
    result = _run("TwoSideStreams", tmp_path)
    _not_a_finding(result, 3, "harness error at step 0 in the zeroer's factory, called at ")
    assert "(self.sides = [torch.cuda.Stream(), torch.cuda.Stream()])" in result.harness_error
    assert "RuntimeUsageError: stream name 'zeroer-1' is already taken" in result.harness_error
    assert result.harness_error.endswith("a bug of kvzero-fuzz, not of the code under test: please report this line with the "
                                         "summary's harness_details (or rerun with --fuzz-debug for the traceback)")


def test_a_simulator_gap_is_a_harness_error_of_ours(tmp_path, monkeypatch):
    from kvdevice.intercept import sim_ops

    lost = _planted_in("kvdevice.intercept.sim_ops", "def lost(self, dst, src, non_blocking, **how):\n"
                       "    raise RuntimeError('planted: the simulator lost its way')\n")
    monkeypatch.setattr(sim_ops.SimOps, "copy", lost)
    result = _run("StagesIds", tmp_path)
    _not_a_finding(result, 3, "harness error at step 1 in the zeroer's warmup, called at ")
    assert "RuntimeError: planted: the simulator lost its way" in result.harness_error


def test_the_zeroers_own_exception_is_still_its_finding(tmp_path):
    result = _run("RaisesItself", tmp_path)
    assert result.found and not result.harness_error
    [finding] = result.violation.findings
    assert finding.message.startswith("zeroer raised at step 1 in warmup: RuntimeError: planted: cannot zero [0]")


def test_torch_refusing_the_zeroers_own_call_on_a_simulated_tensor_is_still_its_finding(tmp_path):
    result = _run("BadTorchCall", tmp_path)
    assert result.found and not result.harness_error
    assert "RuntimeError: shape '[2]' is invalid for input of size 1" in result.violation.findings[0].message


def test_the_gpu_out_of_memory_while_a_campaign_is_set_up_is_a_resource_error(monkeypatch):
    from fuzz.test_campaigns import _set_up

    def no_memory(device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (planted)")

    monkeypatch.setattr(torch.cuda, "set_device", no_memory)
    campaign = Campaign(EpisodeConfig(zeroer="per_call", backend="cuda", device=0), 0, "clean")
    result = _set_up(campaign)
    assert result is not None and not result.found and result.harness_error is None
    assert result.resource_error.startswith("the GPU ran out of memory selecting the campaign's GPU (CUDA out of memory.")
    assert not is_unexpected(result_record(result))


def test_another_failure_while_a_campaign_is_set_up_is_a_harness_error(monkeypatch):
    from fuzz.test_campaigns import _set_up

    def broken(device):
        raise RuntimeError("planted: no such device")

    monkeypatch.setattr(torch.cuda, "set_device", broken)
    result = _set_up(Campaign(EpisodeConfig(zeroer="per_call", backend="cuda", device=3), 0, "clean"))
    assert result.harness_status == 3 and result.harness_error.startswith(
        "harness error in selecting GPU 3 for the campaign, not a finding: RuntimeError: planted: no such device")


# -- blame itself -------------------------------------------------------------------------------------------------
def _raised(function):
    try:
        function()
    except Exception as error:  # noqa: BLE001 - the point
        return error
    raise AssertionError("did not raise")


def test_what_a_library_raises_under_the_zeroers_own_frame_is_the_zeroers():
    verdict = blame(_raised(lambda: torch.empty(3).view(4)))
    assert not verdict.harness and verdict.where is not None and "test_harness_errors.py" in verdict.where


def test_what_the_harness_raises_on_its_own_is_the_harnesss():
    from kvdevice.runtime import make_runtime

    rt = make_runtime("sim")
    rt.new_stream("side")
    verdict = blame(_raised(lambda: rt.new_stream("side")))
    # the runtime called straight from code that is not the harness: the zeroer misused its API
    assert verdict.harness and verdict.status == 2


def test_an_attribute_the_documented_cache_lacks_is_the_users_to_fix_and_a_stand_ins_gap_is_ours():
    import zeroer.bind  # noqa: F401 - registers the KV cache as the documented object a factory gets
    from zeroer.cache.geometries import geometry
    from zeroer.cache.layout import build_cache
    from kvdevice.intercept.cuda_api import StreamProxy

    cache = build_cache(geometry("tiny"))
    stream = object.__new__(StreamProxy)
    assert blame(_raised(lambda: cache.kv_caches)).status == 2  # a typo against the documented cache
    gap = blame(_raised(lambda: stream.native_handle))  # torch's Stream has it, our stand-in does not
    assert gap.harness and gap.status == 3
    assert not blame(_raised(lambda: torch.empty(1).no_such_method)).harness  # the zeroer's own mistake


def test_a_gpu_fault_is_a_resource_error_and_the_processs_later_cuda_campaigns_stop_at_once(tmp_path, monkeypatch):
    from racecheck import resources

    monkeypatch.setattr(resources, "_LOST", [])
    result = _run("FaultsTheGpu", tmp_path)
    assert not result.found and result.violation is None and result.harness_error is None
    assert result.resource_error.startswith(
        "the GPU faulted in warmup (CUDA error: an illegal memory access was encountered); CUDA keeps that error, "
        "so this process can run nothing more on the GPU and the campaign has no verdict."), result.resource_error
    assert "--backend sim" in result.resource_error and "\n" not in result.resource_error
    assert not is_unexpected(result_record(result))
    # CUDA keeps the error: a later cuda campaign of this process would fail somewhere unrelated.
    later = run_campaign(Campaign(EpisodeConfig(zeroer="per_call", backend="cuda"), 0, "clean"), PROFILES["quick"], tmp_path)
    assert not later.found and later.harness_error is None
    assert later.resource_error.startswith("this process's GPU was lost to an earlier fault (CUDA error: an illegal "
                                           "memory access was encountered in warmup)"), later.resource_error


def test_one_harness_error_met_by_many_campaigns_is_one_line_of_the_summary():
    records = [{"campaign": f"mine.py:make-{g}-sim-shard{n}", "found": False, "expect": "clean", "examples": 1,
                "steps": 1, "seconds": 0.1, "harness_error": "harness error at step 1 in the offloader's warmup: X"}
               for g in ("tiny", "ratio2") for n in (0, 1)]
    records.append({**records[0], "campaign": "other.py:make-tiny-sim-shard0", "harness_error": "another one"})
    text, data = render_summary(records, "quick")
    assert data["totals"]["harness_errors"] == 5
    lines = [line for line in text.splitlines() if "HARNESS ERROR" in line]
    assert lines == [
        "  4 campaigns (mine.py:make-ratio2-sim-shard0, mine.py:make-ratio2-sim-shard1, mine.py:make-tiny-sim-shard0, "
        "mine.py:make-tiny-sim-shard1): HARNESS ERROR, not judged: harness error at step 1 in the offloader's warmup: X",
        "  other.py:make-tiny-sim-shard0: HARNESS ERROR, not judged: another one"]


def test_an_error_while_the_episode_is_judged_releases_it_unjudged(monkeypatch):
    # The verdict raising (a read that never ran, a device that never drained) leaves no runtime,
    # zeroer or component open behind it: the episode is abandoned, as one cut off earlier is.
    from fuzz.engine import episode as episode_module

    def broken(group):
        raise RuntimeError("the verdict could not be made")

    abandoned = []
    original = episode_module.Episode.abandon
    monkeypatch.setattr(episode_module, "_verify", broken)
    monkeypatch.setattr(episode_module.Episode, "abandon", lambda self: (abandoned.append(self), original(self)))
    with pytest.raises(RuntimeError, match="the verdict could not be made"):
        episode_module.run_ops(episode_module.EpisodeConfig(), [{"op": "start"}, {"op": "allocate", "n": 1}])
    assert len(abandoned) == 1 and abandoned[0].finished
