"""The engines' transfer code in its real shapes (sanitizer/bench/engine_shapes.py), on the simulator.

Each racy side is found by the sanitizer with its upstream kind and each fixed side is clean; the
fuzzer finds every racy factory with a trace of at most 6 ops that shows in 20 of 20 replays and no
harness error (the engines' extensions stood in by their reference implementations), and each fix
is clean in both campaigns, under Hypothesis's ``ci`` profile: the fuzzer's column of the benchmark
(``python -m sanitizer.bench.engine_shapes``, docs/engine-shapes.md). The other unit-test sides run
under ``pytest --kvz-sanitize`` in tests/test_engine_style.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from racecheck.cli import USAGE
from sanitizer.bench.engine_shapes import BY_NAME, MAX_TRACE_OPS, PAIRS, judge_side, main, plugin_races

LOOPS = sorted(pair.name for pair in PAIRS if not pair.racy.pytest)
# Of the pytest sides (tests/test_engine_style.py runs the others): the handler's unit tests with
# vLLM's swap_blocks op moving the blocks, its reference standing in.
UNIT_ROWS = ["lmcache-4830-unit", "vllm-handler-stores-46278-triton-unit", "vllm-simple-offload-46278-unit"]
LOOPS += UNIT_ROWS + ["vllm-handler-stores-46278-swap-blocks"]
# every pair's factory once (a unit-test row drives its loop row's factories)
FUZZED = sorted(pair.name for pair in PAIRS if pair.name not in UNIT_ROWS)
# The program marks its race the other way round: "queued" on the driver copy, "later" on the
# compute stream's write, which the compute stream queued first (the report's queued side).
REVERSED_MARKS: set[str] = set()  # pairs whose two marks read the wrong way round (none now)


@pytest.mark.parametrize("name", LOOPS)
def test_the_sanitizer_finds_each_racy_engine_loop_with_its_upstream_kind_at_its_marked_lines(name: str) -> None:
    row = judge_side(BY_NAME[name], racy=True, tool="sanitizer")
    assert row["verdict"] == "found", row
    assert BY_NAME[name].kind in row["kinds"], row
    # verdict.py's rule on the program's two marked lines; a reversed pair of marks reads as wrong lines
    assert row.get("lines") == ("wrong lines" if name in REVERSED_MARKS else "found"), row


@pytest.mark.parametrize("name", LOOPS)
def test_the_sanitizer_reports_nothing_on_each_fixed_engine_loop(name: str) -> None:
    row = judge_side(BY_NAME[name], racy=False, tool="sanitizer")
    assert row["verdict"] == "clean", row
    assert row["unfollowed"] == [], row


@pytest.fixture
def derandomized(monkeypatch) -> None:
    """The campaigns under Hypothesis's ``ci`` profile (derandomized, no example database), chosen
    here for every run: a rerun judges the same programs, as CI does."""
    monkeypatch.setenv("CI", "true")


@pytest.mark.parametrize("name", FUZZED)
def test_the_fuzzer_finds_the_racy_factory_in_a_short_trace_with_no_harness_error(name: str, derandomized) -> None:
    row = judge_side(BY_NAME[name], racy=True, tool="fuzz")
    assert row["harness_errors"] == row["resource_errors"] == 0, row
    assert row["verdict"] == "found", row
    assert row["trace_ops"] <= MAX_TRACE_OPS, row


@pytest.mark.parametrize("name", FUZZED)
def test_the_fuzzer_finds_nothing_in_any_campaign_of_the_fixed_factory(name: str, derandomized) -> None:
    row = judge_side(BY_NAME[name], racy=False, tool="fuzz")
    assert row["harness_errors"] == row["resource_errors"] == 0, row
    assert (row["verdict"], row["found"], row["campaigns"]) == ("clean", 0, 2), row


def test_pytorchs_sanitizer_is_recorded_as_needing_a_gpu_where_there_is_none() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: PyTorch's sanitizer runs")
    assert judge_side(PAIRS[0], racy=True, tool="torch") == {
        "pair": PAIRS[0].name, "side": "racy", "tool": "torch", "verdict": "needs a GPU"}


def test_the_plugins_report_is_read_back_as_races_with_both_sites() -> None:
    text = ("kvz-sanitize: device memory accessed from two streams with no event between them [unordered-device-access]\n"
            "  memory:  device block d1 (torch.rand in t.py::test), allocated outside the sanitizer's view\n"
            "  queued:  torch.rand on the default stream, at tests/a.py:69 (test_transfer)\n"
            "  then:    copy_ (d2h) on stream 1 (created at b.py:1), at tests/b.py:153 (transfer_async)\n")
    assert plugin_races(text) == [{"kind": "unordered-device-access", "queued": {"site": {"file": "tests/a.py", "line": 69}},
                                   "later": {"site": {"file": "tests/b.py", "line": 153}}}]


@pytest.mark.parametrize(("argv", "message"), [
    (["--only", "nope"], r"^error: --only 'nope' is not a pair; pairs: vllm-simple-offload-46278, "),
    (["--tools", "gpu"], r"^error: --tools 'gpu': each must be one of fuzz, sanitizer, torch$"),
    (["-j", "0"], r"^error: -j 0 must be a positive number of runs at once$"),
    (["--backend", "gpu"], r"^error: --backend 'gpu' is not one of sim, cuda$"),
    (["--tools", "sanitizer-force"], r"^error: --tools 'sanitizer-force': each must be one of fuzz, sanitizer, torch "
                                     r"\(sanitizer-force needs --backend cuda\)$"),
])
def test_a_bad_command_line_is_one_line_naming_the_value_and_exit_status_2(argv, message, capsys) -> None:
    assert main(argv) == USAGE
    assert re.search(message, capsys.readouterr().err.strip(), re.M)


@pytest.mark.parametrize(("replayed", "verdict"), [("reproduced 20 of 20 on sim", "found"),
                                                    ("reproduced 19 of 20 on sim", "unsteady replay"),
                                                    ("error: the trace could not be read", "unsteady replay")])
def test_a_racy_side_is_found_only_when_its_trace_shows_in_every_replay(replayed, verdict, tmp_path, monkeypatch) -> None:
    import json

    from sanitizer.bench import engine_shapes

    summary = {"campaigns": [{"found": True, "trace_ops": 3, "trace": "t.json", "shrink": {"replays": 2},
                              "first_finding_s": 0.1, "findings": ["hazard"]}],
               "totals": {"harness_errors": 0, "resource_errors": 0, "not_run": 0, "steps": 10}}
    commands = []

    def run(command, env):
        commands.append(command)
        if "fuzz" in command:
            (tmp_path / "summary.json").write_text(json.dumps(summary))
            return 1, "", 0.1
        return (0 if "reproduced" in replayed else 2), replayed, 0.1

    monkeypatch.setattr(engine_shapes, "_run", run)
    row = engine_shapes.fuzz(PAIRS[0].racy, racy=True, scratch=tmp_path)
    assert row["verdict"] == verdict, row
    assert commands[1][-4:] == ["replay", "t.json", "--repeat", "20"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA GPU")
def test_the_cuda_backend_without_a_gpu_is_a_usage_error(capsys) -> None:
    assert main(["--backend", "cuda", "--only", "vllm-simple-offload-46278"]) == USAGE
    assert "--backend cuda needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize(("tool", "extra"), [("sanitizer", []), ("sanitizer-force", ["--force"])])
def test_on_cuda_each_tool_runs_as_a_user_runs_it_on_a_gpu(tool, extra, tmp_path, monkeypatch) -> None:
    from sanitizer.bench import engine_shapes

    commands = []
    monkeypatch.setattr(engine_shapes, "_run", lambda command, env: (commands.append(command), (0, "", 0.1))[1])
    pair = PAIRS[0]
    engine_shapes.judge_side(pair, True, "fuzz", "cuda")
    engine_shapes.judge_side(pair, True, tool, "cuda")
    fuzz_command, sanitizer_command = commands[0], commands[1]
    assert fuzz_command[fuzz_command.index("--backend") + 1] == "cuda"
    assert fuzz_command[fuzz_command.index("--cuda-mode") + 1] == "controlled"
    if pair.racy.pytest:
        assert "--kvz-sanitize-backend" in sanitizer_command and "cuda" in sanitizer_command
        assert ("--kvz-sanitize-force" in sanitizer_command) == bool(extra)
    else:
        assert sanitizer_command[sanitizer_command.index("--backend") + 1] == "cuda"
        assert ("--force" in sanitizer_command) == bool(extra)


@pytest.mark.parametrize("header", ["kvz-sanitize (observe mode)", "kvz-sanitize (force mode)", "something else"])
def test_a_unit_test_sides_report_is_read_from_the_plugins_cuda_sections(header, tmp_path, monkeypatch) -> None:
    from sanitizer.bench import engine_shapes

    pair = next(p for p in PAIRS if p.fixed.pytest)
    monkeypatch.setattr(engine_shapes, "_run", lambda command, env: (0, f"===== {header} =====\n3 passed\n", 0.1))
    row = engine_shapes.sanitizer(pair.fixed, False, pair.kind, tmp_path, "cuda")
    assert row["verdict"] == ("error" if header == "something else" else "clean"), row


@pytest.mark.parametrize("racy", [True, False])
@pytest.mark.parametrize("status", [2, 3])
def test_a_run_that_failed_inside_the_tool_or_on_its_own_is_an_error_never_clean_or_missed(racy, status, tmp_path,
                                                                                           monkeypatch) -> None:
    # The H100 run (2026-12-06): runs that ended in the tool's internal error (exit 3, no race) were
    # judged "clean" on the fixed side and "missed" on the racy one.
    import json

    from sanitizer.bench import engine_shapes

    pair = next(p for p in PAIRS if not p.fixed.pytest)

    def run(command, env):
        report = command[command.index("--json") + 1]
        Path(report).write_text(json.dumps({"races": [], "unfollowed": [],
                                            "program_error": "AttributeError('no attribute out')"}))
        return status, "kvz-sanitize: internal error", 0.1

    monkeypatch.setattr(engine_shapes, "_run", run)
    row = engine_shapes.sanitizer(pair.racy if racy else pair.fixed, racy, pair.kind, tmp_path, "cuda")
    assert row["verdict"] == "error" and "AttributeError" in row["error"], row


def test_a_unit_test_side_whose_tests_failed_with_no_race_reported_is_an_error(tmp_path, monkeypatch) -> None:
    from sanitizer.bench import engine_shapes

    pair = next(p for p in PAIRS if p.fixed.pytest)
    text = "===== kvz-sanitize (observe mode) =====\nFAILED test_x.py::test_y - AttributeError\n1 failed"
    monkeypatch.setattr(engine_shapes, "_run", lambda command, env: (1, text, 0.1))
    assert engine_shapes.sanitizer(pair.fixed, False, pair.kind, tmp_path, "cuda")["verdict"] == "error"


@pytest.mark.parametrize(("output", "status", "racy", "verdict"), [
    ("CSAN detected a possible data race on tensor", 1, True, "found"),
    ("stored: [1.0]", 0, True, "missed"),
    ("CSAN detected a possible data race on tensor", 1, False, "false alarm"),
    ("ModuleNotFoundError: No module named 'lmcache'", 1, True, "needs the extension"),
    ("SKIPPED [6] conftest.py:13: VLLM_OFFLOAD_COPY=swap_blocks needs vLLM's _C extension", 0, False,
     "needs the extension"),
    ("Segmentation fault", -11, False, "error"),
    ("Traceback (most recent call last):\n  ...\nRuntimeError: stores [0] never finished", 1, False, "error"),
])
def test_pytorchs_sanitizer_column_tells_a_report_from_a_missing_extension_and_a_crash(
        output, status, racy, verdict, monkeypatch) -> None:
    import torch

    from sanitizer.bench import engine_shapes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_shapes, "_run", lambda command, env: (status, output, 0.1))
    pair = BY_NAME["lmcache-4830"]
    assert engine_shapes.torch_sanitizer(pair.racy if racy else pair.fixed, racy)["verdict"] == verdict


@pytest.mark.parametrize("returncode", [-2, -15, 130])
def test_an_interrupted_run_stops_the_benchmark_and_writes_nothing(returncode, tmp_path, monkeypatch) -> None:
    import subprocess

    from sanitizer.bench import engine_shapes

    out = tmp_path / "rows.json"
    out.write_text('{"complete": true}')
    monkeypatch.setattr(engine_shapes, "install", lambda: None)  # the test process keeps its own handlers
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, returncode, "", ""))
    assert main(["--only", "lmcache-4830", "--tools", "sanitizer", "--json", str(out)]) == 130
    assert out.read_text() == '{"complete": true}'  # the complete result of an earlier run is kept


def test_a_run_killed_by_a_signal_is_an_error_never_a_verdict(monkeypatch) -> None:
    import subprocess

    from sanitizer.bench import engine_shapes

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, -11, "", ""))
    row = engine_shapes.judge_side(BY_NAME["lmcache-4830"], racy=False, tool="sanitizer")
    assert (row["verdict"], row["error"]) == ("error", "killed by signal 11"), row
