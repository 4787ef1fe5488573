"""``python -m repro export`` and ``regenerate``, and the curated cases in ``repro/``: the racy
design must still fail on its trace and the race-free ones must pass on the same trace."""

from __future__ import annotations

import ast
import datetime
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.engine.campaigns import PROFILES, run_campaign
from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.harness_error import HarnessError
from racecheck.resources import ResourceExhausted
from fuzz.engine.trace import write_trace
from fuzz.trace import load_trace
from repro.__main__ import main
from repro.export import render_script
from repro.regenerate import find_campaign

ROOT = Path(__file__).resolve().parents[1]
RACE = [{"op": "start", "in_flight": 1}, {"op": "allocate", "n": 1, "stream": 0}, {"op": "allocate", "n": 1, "stream": 0}]
# A curated case is a script in repro/cases/ exported from the trace of the same name beside it.
CURATED = sorted(ROOT / "repro" / "cases" / f"{case.stem}.py" for case in (ROOT / "repro" / "cases").glob("*.json"))
RACE_FREE = ("per_call", "event_ring", "reference")


def run_script(path: Path, *args: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """Run an exported script's main() in this process (a subprocess costs a torch import)."""
    spec = importlib.util.spec_from_file_location(f"_repro_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    return module.main()


def test_the_curated_cases_are_the_two_upstream_races():
    assert [p.name for p in CURATED] == ["ring_overrun.py", "single_buffer_pre_48085.py"]
    for script in CURATED:
        assert script.is_file(), f"repro/cases/{script.stem}.json has no exported script {script}"


@pytest.mark.parametrize("script", CURATED, ids=lambda p: p.stem)
def test_a_curated_case_still_fails_on_its_racy_design(script, monkeypatch, capsys):
    assert run_script(script, monkeypatch=monkeypatch) == 1
    out = capsys.readouterr().out
    assert "reproduced 1 of 1 on sim" in out and "non-zero after zeroing: block 1" in out


@pytest.mark.parametrize("zeroer", RACE_FREE)
@pytest.mark.parametrize("script", CURATED, ids=lambda p: p.stem)
def test_the_race_free_designs_pass_on_the_same_curated_steps(script, zeroer, monkeypatch, capsys):
    assert run_script(script, "--zeroer", zeroer, monkeypatch=monkeypatch) == 0
    assert f"{zeroer}: reproduced 0 of 1 on sim" in capsys.readouterr().out


@pytest.mark.parametrize("script", CURATED, ids=lambda p: p.stem)
def test_a_curated_script_is_a_fresh_export_of_its_trace(script, monkeypatch):
    # Regenerate with: python -m repro export repro/cases/NAME.json -o repro/cases/NAME.py --title "..."
    text = script.read_text()
    title = " ".join(ast.get_docstring(ast.parse(text)).split("\n\n")[0].split())
    exported = datetime.date.fromisoformat(re.search(r"exported   (\S+) ", text).group(1))
    monkeypatch.chdir(ROOT)  # the export writes paths relative to the repository root
    trace = load_trace(Path("repro") / "cases" / f"{script.stem}.json")
    assert render_script(trace, f"repro/cases/{script.name}", title=title, today=exported) == text


@pytest.mark.parametrize("script", CURATED, ids=lambda p: p.stem)
def test_a_curated_trace_replays_like_its_script(script, capsys):
    assert main(["replay", str(ROOT / "repro" / "cases" / f"{script.stem}.json")]) == 1


def test_an_exported_script_runs_alone_without_hypothesis_and_exits_1(tmp_path):
    trace = write_trace(tmp_path, EpisodeConfig(zeroer="single_buffer", kernel="torch"), RACE, [], seed=3, campaign="c-shard0")
    script = tmp_path / "case.py"
    assert main(["export", str(trace), "-o", str(script)]) == 0
    text = script.read_text()
    code = text.split('"""', 2)[2]
    assert "import hypothesis" not in code and "from hypothesis" not in code
    assert 'op({"op": "allocate", "n": 1, "stream": 0})  # zero_block_ids([2]) on stream 0  <-- the happens-before checker fires here' in text
    assert "found by   campaign c-shard0, Hypothesis seed 3" in text
    # a copy of the repository root layout: the script finds the package one directory up
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    target = ROOT / "repro" / "_test_export_case.py"
    target.write_text(text)
    try:
        run = subprocess.run([sys.executable, str(target)], capture_output=True, text=True, env=env, timeout=120)
        assert run.returncode == 1, run.stdout + run.stderr
        assert run.stdout.rstrip().endswith("single_buffer: reproduced 1 of 1 on sim")
        clean = subprocess.run([sys.executable, str(target), "--zeroer", "per_call"], capture_output=True, text=True, env=env, timeout=120)
        assert clean.returncode == 0, clean.stdout + clean.stderr
    finally:
        target.unlink()


def _exported(tmp_path: Path) -> Path:
    trace = write_trace(tmp_path, EpisodeConfig(zeroer="single_buffer", kernel="torch"), RACE, [], seed=3, campaign="c-shard0")
    script = tmp_path / "case.py"
    assert main(["export", str(trace), "-o", str(script)]) == 0
    return script


def test_an_exported_script_that_cannot_run_says_so_in_one_line_and_never_exits_1(tmp_path):
    # Exit 1 means "reproduced": a script that crashed must never exit with it (an uncaught
    # exception does, with a traceback that a caller reading stdout never sees).
    run = subprocess.run([sys.executable, str(_exported(tmp_path)), "--zeroer", "no_such_design"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.startswith("error: unknown zeroer 'no_such_design'; use a built-in name (") and run.stderr.count("\n") == 1, run.stderr
    assert "reproduced" not in run.stdout


def _failing_episode(error: BaseException):
    """An Episode class stand-in that raises ``error`` (the harness failing, not the zeroer)."""
    def build(config):
        raise error
    return build


@pytest.mark.parametrize("error, status, line", [
    (RuntimeError("boom"), 3, "case.py: internal error, a bug in kvzero-fuzz: RuntimeError: boom (rerun with --debug for "
                              "the traceback and report it)"),
    (HarnessError("harness error at step 2 in x, not a finding: the fix", 2), 2,
     "case.py: harness error at step 2 in x, not a finding: the fix"),
    (ResourceExhausted("the GPU ran out of memory (x);\nrun fewer workers"), 2,
     "case.py: the GPU ran out of memory (x); run fewer workers"),
], ids=["internal", "harness", "out-of-memory"])
def test_an_exported_script_keeps_the_exit_status_convention_on_errors(tmp_path, monkeypatch, capsys, error, status, line):
    script = _exported(tmp_path)
    spec = importlib.util.spec_from_file_location("_repro_case", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "Episode", _failing_episode(error))
    monkeypatch.setattr(sys, "argv", [str(script)])
    assert module.main() == status
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and "reproduced" not in captured.out
    if status == 3:  # --debug adds the traceback, the status stays
        assert module.main(["--debug"]) == 3
        assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_an_exported_script_counts_a_zeroer_that_raises_as_reproduced(tmp_path, monkeypatch, capsys):
    """A zeroer's own exception is a finding (as in the fuzzer and the replayer), not a crash."""
    (tmp_path / "raiser.py").write_text(
        "from zeroer.designs import PerCallZeroer\n\n"
        "class Raiser(PerCallZeroer):\n"
        "    def zero_block_ids(self, block_ids):\n"
        "        if list(block_ids) != [0]:\n"
        "            raise ValueError('no room')\n"
        "        super().zero_block_ids(block_ids)\n\n"
        "def make(cache, runtime):\n    return Raiser(cache, runtime, kernel='torch')\n\n"
        "make.capabilities = Raiser.capabilities\n")
    assert run_script(_exported(tmp_path), "--zeroer", f"{tmp_path / 'raiser.py'}:make", monkeypatch=monkeypatch) == 1
    out = capsys.readouterr().out
    assert "zeroer raised at step 2 in zero_block_ids" in out and out.rstrip().endswith("reproduced 1 of 1 on sim"), out


def test_export_refuses_an_output_name_that_is_not_a_module_name(tmp_path, capsys):
    trace = write_trace(tmp_path, EpisodeConfig(zeroer="single_buffer"), RACE, [])
    assert main(["export", str(trace), "-o", str(tmp_path / "my-case.py")]) == 2
    assert capsys.readouterr().err.startswith(f"error: -o {tmp_path / 'my-case.py'}: name the script like a Python module")
    assert not (tmp_path / "my-case.py").exists()


def test_export_of_a_missing_trace_is_one_line_exit_2(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none.json"), "-o", str(tmp_path / "x.py")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'none.json'}: no such file\n"


def test_a_seed_from_a_summary_regenerates_the_same_shrunk_trace(tmp_path, capsys):
    campaign = find_campaign("single_buffer-tiny-sim-k-torch-shard0")
    found = run_campaign(campaign, PROFILES["quick"], tmp_path / "first")
    summary = {
        "totals": {"profile": "quick"},
        "campaigns": [{"campaign": campaign.id, "found": True, "seeds": found.seeds, "trace": str(found.trace_path)}],
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(["regenerate", "--summary", str(tmp_path / "summary.json"), "--repro-dir", str(tmp_path / "again")]) == 1
    again = tmp_path / "again" / found.trace_path.name
    assert json.loads(again.read_text())["ops"] == json.loads(found.trace_path.read_text())["ops"]
    assert "(the same trace as the summary's)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["regenerate", "nope-tiny-sim-shard0", "--seed", "1"], r"error: unknown campaign 'nope-tiny-sim-shard0' \(a campaign of an outside zeroer also needs --zeroer SPEC, an offloader's --offloader SPEC\); `pytest fuzz --collect-only -q` lists them"),
        (["regenerate", "ring-tiny-sim-shard9", "--seed", "1"], r"error: unknown campaign 'ring-tiny-sim-shard9' .*; campaigns of that zeroer: ring-.*"),
        (["regenerate", "ring-tiny-sim-k-torch-shard0"], r"error: give CAMPAIGN --seed N \(from a summary\), or --summary FILE"),
        (["regenerate", "ring-tiny-sim-k-torch-shard0", "--seed", "1", "--profile", "weekly"], r"error: unknown profile 'weekly'; choose one of quick, ci, nightly"),
        (["regenerate", "--summary", "/nonexistent/summary.json"], r"error: /nonexistent/summary.json: no such file"),
    ],
)
def test_regenerate_explains_bad_input_and_exits_2(args, message, capsys):
    assert main(args) == 2
    assert __import__("re").match(message + "$", capsys.readouterr().err.strip())


def test_a_finding_saved_after_ctrl_c_does_not_wait_for_the_gpu_probe(tmp_path, monkeypatch):
    """On a busy GPU the probe (CUDA's initialisation, nvidia-smi) took seconds after the signal;
    the trace saved on the way out records the versions and says the GPU was not probed."""
    from racecheck import environment as probe
    from fuzz.engine.campaigns import Campaign, _save_interrupted
    from fuzz.engine.oracle import Finding
    from fuzz.engine.violation import ZeroerViolation

    def no_probe_now():
        raise AssertionError("the GPU was probed after Ctrl-C")

    monkeypatch.setattr(probe, "_environment", functools.lru_cache(maxsize=1)(no_probe_now))
    config = EpisodeConfig(zeroer="single_buffer", kernel="torch")
    violation = ZeroerViolation([Finding("hazard", None, "hazard at step 3: planted")], RACE, config)
    stop = KeyboardInterrupt()
    _save_interrupted(stop, violation, tmp_path, 7, Campaign(config))
    (trace,) = tmp_path.glob("*.json")
    environment = load_trace(trace).environment
    assert environment["gpu_probed"] is False and environment["torch"] and environment["gpu"] is None
    assert stop.__notes__[0].startswith("single_buffer-tiny-sim-k-torch-shard0: interrupted after a finding")


def test_a_script_exported_outside_the_checkout_finds_kvzero_fuzz_where_it_is_not_installed(tmp_path):
    # Written to /tmp, the script used to put the directory above itself on sys.path: where
    # kvzero-fuzz was not pip-installed (the H200 ran the suite from a copy of the tree) its first
    # import failed. It names the exporting checkout instead.
    text = _exported(tmp_path).read_text()
    line = next(line for line in text.splitlines() if line.startswith("sys.path.insert(0, "))
    root = Path(eval(line.split("sys.path.insert(0, ", 1)[1].rsplit(")", 1)[0].split("  #")[0],  # noqa: S307
                     {"Path": Path, "str": str, "__file__": str(tmp_path / "case.py")}))
    assert (root / "fuzz" / "cli.py").is_file(), line
