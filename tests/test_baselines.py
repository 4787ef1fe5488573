"""The detection benchmark's baselines (fuzz/bench/detect/baselines/__init__.py): a plain stress loop, CSAN over it, and
one hand-written vLLM-style interleaving. CPU-only except the two tests marked for a GPU."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from fuzz.bench.detect.baselines.handwritten import VLLM_STALL_UNITS
from fuzz.bench.detect.baselines.sanitizer import (
    RESULT_PREFIX,
    child_main,
    describe_pointer,
    outcome_from_child,
    parse_csan_report,
    run_child,
)
from fuzz.bench import BenchUsageError
from fuzz.bench.detect.baselines.stress import STRESS_OPS, value_findings
from fuzz.bench.detect.baselines import METHODS, main, run_method
from fuzz.engine.episode import Episode, EpisodeConfig
from fuzz.engine.oracle import Finding
from fuzz.engine.trace import read_trace

CUDA = torch.cuda.is_available()
SINGLE_BUFFER = EpisodeConfig(zeroer="single_buffer", kernel="torch")

# As torch/cuda/_sanitizer.py (torch 2.13) prints an UnsynchronizedAccessError to stderr.
CSAN_STDERR = textwrap.dedent("""\
    ============================
    CSAN detected a possible data race on tensor with data pointer 94784769516928
    Access by stream 140000000001 during kernel:
    aten::index_fill_.int_Scalar(Tensor(a!) self, int dim, Tensor index, Scalar value) -> Tensor(a!)
    writing to argument(s) self, and to the output
    With stack trace:
      File "x.py", line 1, in f
        line

    Previous access by stream 140000000002 during kernel:
    aten::copy_(Tensor(a!) self, Tensor src, bool non_blocking=False) -> Tensor(a!)
    reading from argument(s) self
    With stack trace:
      File "x.py", line 1, in f
        line

    Trace for tensor allocation not found.
    """)
CSAN_SUMMARY = (
    "CSAN: possible data race on the tensor at 0x5634cc846580: aten::index_fill_.int_Scalar writing to it "
    "on stream 140000000001, unordered with aten::copy_ reading from it on stream 140000000002"
)


# -- (b) the plain stress loop ---------------------------------------------------------------------
def test_the_stress_loop_finds_the_single_buffer_race_on_the_simulator_within_five_examples(tmp_path):
    # Counted in examples, not seconds: a timed assert fails on a loaded machine (or under
    # pytest --kvz-sanitize); the detection benchmark measures the seconds.
    outcome = METHODS["stress"](SINGLE_BUFFER, 5.0, 1, repro_dir=tmp_path)
    assert outcome.found and outcome.error is None
    assert outcome.examples <= 5
    assert outcome.message.startswith("non-zero after zeroing: block ")
    assert "0xffffffff (NaN poison" in outcome.message and "\n" not in outcome.message
    trace = read_trace(outcome.repro)
    assert len(trace["ops"]) == outcome.trace_len == 26  # start + 25 random ops
    assert trace["ops"][0]["op"] == "start"
    assert {op["op"] for op in trace["ops"][1:]} <= set(STRESS_OPS)  # never advance or delay


def test_the_stress_loop_is_reproducible_from_its_seed(tmp_path):
    first = METHODS["stress"](SINGLE_BUFFER, 5.0, 3, repro_dir=tmp_path)
    again = METHODS["stress"](SINGLE_BUFFER, 5.0, 3, repro_dir=tmp_path)
    assert first.found and first.repro == again.repro  # the file name hashes config and ops
    assert (first.examples, first.steps, first.message) == (again.examples, again.steps, again.message)


def test_the_stress_loop_stays_clean_on_the_reference_zeroer(tmp_path):
    outcome = METHODS["stress"](EpisodeConfig(zeroer="reference"), 0.5, 0, repro_dir=tmp_path)
    assert not outcome.found and outcome.error is None and outcome.message == "no finding"
    assert outcome.examples >= 5 and outcome.steps == 26 * outcome.examples
    assert outcome.seconds is None and outcome.trace_len is None and outcome.repro is None
    assert not list(tmp_path.iterdir())


def test_the_stress_loop_reports_wrong_values_but_not_the_happens_before_checker():
    hazard = Finding("hazard", None, "hazard at step 3: host write to pinned host buffer 1 ...")
    value = Finding("non-zero after zeroing", 1, "non-zero after zeroing: block 1 ...")
    assert value_findings([hazard, value, hazard]) == [value]


# -- (d) the hand-written interleaving -------------------------------------------------------------
def test_the_handwritten_interleaving_catches_the_single_buffer_race(tmp_path):
    outcome = METHODS["handwritten"](SINGLE_BUFFER, 1.0, 0, repro_dir=tmp_path)
    assert outcome.found and outcome.examples == 1 and outcome.trace_len == outcome.steps == 13
    assert outcome.message.startswith("non-zero after zeroing: block 1, segment 0, word 0 ")
    ops = read_trace(outcome.repro)["ops"]
    assert {"op": "delay", "stream": 0, "amount": VLLM_STALL_UNITS} in ops  # vLLM's torch.cuda._sleep


def test_the_handwritten_interleaving_misses_a_depth_two_ring_as_vllms_test_does(tmp_path):
    outcome = METHODS["handwritten"](EpisodeConfig(zeroer="ring", kernel="torch"), 1.0, 0, repro_dir=tmp_path)
    assert not outcome.found and outcome.error is None and outcome.message == "no finding"
    assert (outcome.examples, outcome.steps) == (1, 13)


# -- (c) the sanitizer -----------------------------------------------------------------------------
@pytest.mark.skipif(CUDA, reason="checks the answer on a machine without CUDA")
def test_the_sanitizer_needs_cuda_and_says_so():
    outcome = METHODS["sanitizer"](SINGLE_BUFFER, 1.0, 0)
    assert (outcome.found, outcome.error, outcome.message, outcome.steps) == (False, "needs CUDA", "no finding", 0)


@pytest.mark.skipif(CUDA, reason="checks the answer on a machine without CUDA")
@pytest.mark.parametrize("method", ["handwritten", "stress"])
def test_the_other_methods_on_the_cuda_backend_need_cuda_too(method):
    outcome = METHODS[method](EpisodeConfig(zeroer="reference", backend="cuda"), 1.0, 0)
    assert (outcome.found, outcome.error) == (False, "needs CUDA")


def test_a_csan_report_reads_as_one_line():
    assert parse_csan_report(CSAN_STDERR) == CSAN_SUMMARY
    assert parse_csan_report("Traceback ...\nValueError: no") is None


def test_the_child_result_line_is_the_outcome():
    line = RESULT_PREFIX + json.dumps({
        "found": True, "seconds": 0.5, "examples": 2, "steps": 40, "trace_len": 14, "repro": "/tmp/t.json",
        "message": "CSAN: ...", "error": None,
    })
    outcome = outcome_from_child(0, f"triton noise\n{line}\n", CSAN_STDERR, False, 130.0)
    assert (outcome.found, outcome.examples, outcome.steps, outcome.message) == (True, 2, 40, "CSAN: ...")


def test_a_crashed_child_is_an_error_that_quotes_its_last_words():
    outcome = outcome_from_child(1, "", "Traceback ...\nAssertionError: Torch not compiled with CUDA enabled\n", False, 130.0)
    assert not outcome.found and outcome.message == "no finding"
    assert outcome.error == (
        "the sanitizer child exited with code 1 before reporting; "
        "last stderr line: AssertionError: Torch not compiled with CUDA enabled"
    )


def test_a_csan_report_counts_even_if_the_child_then_died():
    outcome = outcome_from_child(-9, "", CSAN_STDERR, True, 130.0)
    assert outcome.found and outcome.error is None
    assert outcome.message == (
        f"{CSAN_SUMMARY} (the sanitizer child did not finish within 130 s (budget + margin) and was killed)"
    )


def test_a_child_that_outlives_its_limit_is_killed_and_reported(tmp_path):
    rc, stdout, stderr, timed_out = run_child([sys.executable, "-c", "import time; time.sleep(60)"], {}, 0.5)
    assert timed_out and rc == -9
    outcome = outcome_from_child(rc, stdout, stderr, timed_out, 0.5)
    assert outcome.error == "the sanitizer child did not finish within 0.5 s (budget + margin) and was killed"


def test_the_child_refuses_to_run_without_csan(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("TORCH_CUDA_SANITIZER", raising=False)
    assert child_main(SINGLE_BUFFER, 1.0, 0, tmp_path) == 0
    outcome = outcome_from_child(0, capsys.readouterr().out, "", False, 1.0)
    assert outcome.error == "CSAN is not enabled in the child; set TORCH_CUDA_SANITIZER=1 before torch is imported"


@pytest.mark.parametrize(
    ("zeroer", "where"),
    [("single_buffer", "the zeroer's device buffer _dev"), ("event_ring", "the zeroer's device buffer _slots[1].dev")],
)
def test_a_csan_report_names_the_tensor_it_is_about(zeroer, where):
    episode = Episode(EpisodeConfig(zeroer=zeroer, kernel="torch"))
    cache_word = episode.cache.pages(0)[3].data_ptr()
    assert describe_pointer(episode, cache_word) == "KV-cache tensor 0; CSAN tracks whole tensors, not blocks"
    buffers = episode.zeroer.zeroer._slots[1].dev if zeroer == "event_ring" else episode.zeroer.zeroer._dev
    assert describe_pointer(episode, buffers.tensor.data_ptr()) == where
    assert describe_pointer(episode, 8) == "not the KV cache nor a buffer the zeroer keeps"
    episode.finish()


# -- input checks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("budget", [0, -1.5, float("inf"), True, "10"])
def test_a_budget_that_is_not_a_positive_number_of_seconds_is_refused(method, budget):
    with pytest.raises(BenchUsageError, match=rf"^budget_s={budget!r} must be a positive, finite number of seconds \(e\.g\. 10\)$"):
        METHODS[method](SINGLE_BUFFER, budget, 0)


def test_a_seed_that_is_not_an_int_is_refused():
    with pytest.raises(BenchUsageError, match=r"^seed='1' must be an int \(e\.g\. 0\)$"):
        METHODS["stress"](SINGLE_BUFFER, 1.0, "1")


def test_an_unknown_method_is_refused_with_the_choices():
    with pytest.raises(BenchUsageError, match=r"^unknown baseline method 'fuzzer'; choose one of: handwritten, sanitizer, stress$"):
        run_method("fuzzer", SINGLE_BUFFER, 1.0, 0)


def test_the_command_line_names_a_bad_method_and_a_bad_budget(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["nope", "--zeroer", "reference"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m fuzz.bench.detect.baselines: error: unknown baseline method 'nope'; choose one of: handwritten, sanitizer, stress"
    )
    with pytest.raises(SystemExit):
        main(["stress", "--budget", "0"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m fuzz.bench.detect.baselines: error: budget_s=0.0 must be a positive, finite number of seconds (e.g. 10)"
    )


def test_the_command_line_prints_the_outcome(capsys, tmp_path):
    assert main(["handwritten", "--zeroer", "single_buffer", "--kernel", "torch", "--backend", "sim", "--repro-dir", str(tmp_path)]) == 1  # found
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "handwritten on zeroer 'single_buffer', geometry tiny, once"
    assert "  found: True" in out and "  message: non-zero after zeroing: block 1," in out


# -- on a GPU (run on the H200, docs/results.md) ---------------------------------------------------
@pytest.mark.skipif(not CUDA, reason="CUDA required")
def test_on_a_gpu_the_handwritten_stall_catches_single_buffer_and_not_per_call(tmp_path):
    found = METHODS["handwritten"](EpisodeConfig(zeroer="single_buffer", backend="cuda"), 1.0, 0, repro_dir=tmp_path)
    clean = METHODS["handwritten"](EpisodeConfig(zeroer="per_call", backend="cuda"), 1.0, 0, repro_dir=tmp_path)
    assert found.found and found.message.startswith("non-zero after zeroing: block 1,"), found
    assert not clean.found and clean.error is None, clean


@pytest.mark.skipif(not CUDA, reason="CUDA required")
def test_on_a_gpu_the_sanitizer_child_runs_and_reports(tmp_path):
    outcome = METHODS["sanitizer"](EpisodeConfig(zeroer="reference"), 2.0, 0, repro_dir=tmp_path)
    assert outcome.error is None, outcome
    assert outcome.message == "no finding" or outcome.message.startswith("CSAN: possible data race on the tensor at ")
