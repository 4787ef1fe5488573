"""The fuzz options: every parser of ``fuzz/options.py`` on good and bad values, then ``pytest fuzz``
end to end (a bad option is a usage error; a racy zeroer fails and leaves a trace; a race-free
one passes).

The parsers are pure functions, so most of this file calls them directly; the end-to-end checks
run one small campaign each in a subprocess, side by side."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fuzz.engine.campaigns import PROFILES
from fuzz.options import (
    FuzzOptions,
    check_zeroer_runs_here,
    fuzz_options,
    gpu_for_worker,
    output_path,
    parse_backend,
    parse_cuda_mode,
    parse_journal,
    parse_minutes,
    parse_seed,
    parse_profile,
    parse_shrink_seconds,
    parse_zeroer,
)
from zeroer.registry import zeroer_names

ROOT = Path(__file__).resolve().parents[1]
BUILT_INS = ", ".join(zeroer_names())


def exactly(message: str) -> str:
    """An anchored pattern matching ``message`` and nothing more."""
    return "^" + re.escape(message) + "$"


# -- --backend -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "cuda", "backend"),
    [("sim", False, "sim"), ("sim", True, "sim"), ("cuda", True, "cuda"), ("auto", True, "cuda"), ("auto", False, "sim")],
)
def test_parse_backend_resolves_auto_by_whether_a_gpu_is_visible(value, cuda, backend):
    assert parse_backend(value, cuda_available=cuda) == backend


def test_an_unknown_backend_is_a_usage_error_listing_the_backends():
    with pytest.raises(pytest.UsageError, match=exactly("--backend 'nope' is not a backend; choose one of: auto, cuda, sim")):
        parse_backend("nope", cuda_available=True)


def test_backend_cuda_without_a_gpu_is_a_usage_error_that_suggests_sim():
    with pytest.raises(
        pytest.UsageError,
        match=exactly("--backend cuda needs a CUDA GPU and none is visible here; use --backend sim or auto"),
    ):
        parse_backend("cuda", cuda_available=False)


# -- --cuda-mode ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "modes"), [("both", ("controlled", "free")), ("controlled", ("controlled",)), ("free", ("free",))]
)
def test_parse_cuda_mode_expands_both_into_the_two_modes(value, modes):
    assert parse_cuda_mode(value) == modes


def test_an_unknown_cuda_mode_is_a_usage_error_listing_the_modes():
    with pytest.raises(pytest.UsageError, match=exactly("--cuda-mode 'fast' is not a mode; choose one of: both, controlled, free")):
        parse_cuda_mode("fast")


# -- --zeroer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, *zeroer_names(), "zeroer.designs.reference:ReferenceZeroer"])
def test_parse_zeroer_accepts_nothing_a_built_in_name_or_a_module_spec(value):
    assert parse_zeroer(value) == value


def test_parse_zeroer_accepts_a_file_spec_to_a_factory(tmp_path):
    plugin = tmp_path / "mine.py"
    plugin.write_text("def make(cache, runtime):\n    raise NotImplementedError\n")
    assert parse_zeroer(f"{plugin}:make") == f"{plugin}:make"


@pytest.mark.parametrize(("value", "backend", "modes", "message"), [
    ("torch_per_call", "sim", ("controlled",),
     "--zeroer 'torch_per_call' runs on the cuda backend only, not 'sim'; pass --backend cuda on a machine with a GPU"),
    ("zoo.int32_offset_4gib", "sim", ("controlled",),
     "--zeroer 'zoo.int32_offset_4gib' runs on the cuda backend only, not 'sim'; pass --backend cuda on a "
     "machine with a GPU"),
    ("torch_per_call", "cuda", ("controlled",),
     "--zeroer 'torch_per_call' runs in the free cuda mode only, not controlled; pass --cuda-mode free"),
])
def test_a_zeroer_that_cannot_run_on_the_chosen_backend_or_mode_is_a_usage_error(value, backend, modes, message):
    with pytest.raises(pytest.UsageError, match=exactly(message)):
        check_zeroer_runs_here(value, backend, modes)


@pytest.mark.parametrize(("value", "backend", "modes"), [
    (None, "sim", ("controlled",)), ("event_ring", "sim", ("controlled",)), ("graph_ring", "cuda", ("controlled", "free")),
    ("graph_ring", "sim", ("controlled",)),
    ("zoo.int32_offset_4gib", "cuda", ("controlled",)), ("zeroer.designs.reference:ReferenceZeroer", "sim", ("controlled",)),
])
def test_a_zeroer_that_runs_on_the_chosen_backend_passes_the_check(value, backend, modes):
    check_zeroer_runs_here(value, backend, modes)


def test_an_unknown_zeroer_name_is_a_usage_error_listing_the_built_ins():
    with pytest.raises(
        pytest.UsageError,
        match=exactly(
            f"--zeroer 'nope': unknown zeroer 'nope'; use a built-in name ({BUILT_INS}), "
            f"'module:attr' or 'path/to/file.py:attr'"  # the built-ins listed once
        ),
    ):
        parse_zeroer("nope")


def test_a_file_given_without_its_factory_is_a_usage_error_that_says_to_name_it(tmp_path):
    plugin = tmp_path / "zeroers.py"
    plugin.write_text("def make(cache, runtime):\n    raise NotImplementedError\n")
    with pytest.raises(
        pytest.UsageError,
        match=exactly(
            f"--zeroer {str(plugin)!r}: unknown zeroer {str(plugin)!r}; name the factory in it: '{plugin}:<factory>'; use a "
            f"built-in name ({BUILT_INS}), 'module:attr' or 'path/to/file.py:attr'"
        ),
    ):
        parse_zeroer(str(plugin))


def test_an_offloaders_factory_given_as_a_zeroer_is_a_usage_error_that_names_the_option(tmp_path):
    """``(cache, host_pool, runtime=None)`` binds the two arguments a zeroer's factory gets: without
    this check its host pool was handed the runtime, and each campaign failed with advice for
    runtime-API zeroers."""
    plugin = tmp_path / "offloaders.py"
    plugin.write_text("def make(cache, host_pool, runtime=None):\n    raise NotImplementedError\n")
    spec = f"{plugin}:make"
    with pytest.raises(
        pytest.UsageError,
        match=exactly(
            f"--zeroer {spec!r}: zeroer {spec!r} has signature (cache, host_pool, runtime=None), an offloader's "
            f"factory (cache, host_pool, runtime); fuzz it with --offloader {spec}, or give --zeroer a "
            f"factory(cache, runtime) (built-in zeroers: {BUILT_INS})"
        ),
    ):
        parse_zeroer(spec)


def test_a_module_spec_that_cannot_be_imported_is_a_usage_error_naming_the_module():
    with pytest.raises(
        pytest.UsageError,
        match=(
            r"^--zeroer 'no_such_module:f': zeroer 'no_such_module:f': cannot import module 'no_such_module': "
            r"ModuleNotFoundError\(.*no_such_module.*\) \(built-in zeroers: " + re.escape(BUILT_INS) + r"\)$"
        ),
    ):
        parse_zeroer("no_such_module:f")


def test_a_module_spec_without_the_attribute_is_a_usage_error_naming_it():
    spec = "zeroer.designs.reference:NoSuchFactory"
    with pytest.raises(
        pytest.UsageError,
        match=exactly(f"--zeroer {spec!r}: zeroer {spec!r}: 'zeroer.designs.reference' has no attribute 'NoSuchFactory' (built-in zeroers: {BUILT_INS})"),
    ):
        parse_zeroer(spec)


def test_a_file_spec_to_a_missing_file_is_a_usage_error_naming_the_file(tmp_path):
    missing = tmp_path / "missing.py"
    spec = f"{missing}:make"
    with pytest.raises(
        pytest.UsageError,
        match=exactly(f"--zeroer {spec!r}: zeroer {spec!r}: file {str(missing)!r} does not exist (built-in zeroers: {BUILT_INS})"),
    ):
        parse_zeroer(spec)


def test_a_file_spec_without_the_attribute_is_a_usage_error_naming_it(tmp_path):
    plugin = tmp_path / "mine.py"
    plugin.write_text("def make(cache, runtime):\n    raise NotImplementedError\n")
    spec = f"{plugin}:build"
    with pytest.raises(
        pytest.UsageError,
        match=exactly(f"--zeroer {spec!r}: zeroer {spec!r}: {str(plugin)!r} has no attribute 'build' (built-in zeroers: {BUILT_INS})"),
    ):
        parse_zeroer(spec)


def test_a_factory_with_the_wrong_signature_is_a_usage_error_showing_it(tmp_path):
    plugin = tmp_path / "wrong.py"
    plugin.write_text("def make(x):\n    raise NotImplementedError\n")
    spec = f"{plugin}:make"
    with pytest.raises(
        pytest.UsageError,
        match=exactly(
            f"--zeroer {spec!r}: zeroer {spec!r} has signature (x); a factory must accept (cache, runtime): "
            f"too many positional arguments (built-in zeroers: {BUILT_INS})"
        ),
    ):
        parse_zeroer(spec)


def test_a_file_spec_whose_import_fails_is_a_usage_error_with_the_cause(tmp_path):
    plugin = tmp_path / "broken.py"
    plugin.write_text("raise RuntimeError('boom')\n")
    spec = f"{plugin}:make"
    with pytest.raises(
        pytest.UsageError,
        match=exactly(f"--zeroer {spec!r}: zeroer {spec!r}: importing {str(plugin)!r} failed: RuntimeError('boom') (built-in zeroers: {BUILT_INS})"),
    ):
        parse_zeroer(spec)


def test_an_attribute_that_is_not_callable_is_a_usage_error(tmp_path):
    plugin = tmp_path / "value.py"
    plugin.write_text("make = 3\n")
    spec = f"{plugin}:make"
    with pytest.raises(
        pytest.UsageError,
        match=exactly(f"--zeroer {spec!r}: zeroer {spec!r} is int, not a factory(cache, runtime) (built-in zeroers: {BUILT_INS})"),
    ):
        parse_zeroer(spec)


# -- --fuzz-minutes ------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "minutes"), [(None, None), ("30", 30.0), ("0.5", 0.5), ("1e1", 10.0)])
def test_parse_minutes_reads_a_positive_number(value, minutes):
    assert parse_minutes(value) == minutes


@pytest.mark.parametrize("value", ["0", "-5", "-0.1", "nan", "inf", "-inf", "1e999"])
def test_minutes_that_are_not_a_finite_positive_number_are_a_usage_error(value):
    with pytest.raises(
        pytest.UsageError,
        match=exactly(f"--fuzz-minutes {value!r} must be a finite number greater than 0; give minutes, e.g. 30"),
    ):
        parse_minutes(value)


@pytest.mark.parametrize("value", ["abc", "", "10m"])
def test_non_numeric_minutes_are_a_usage_error(value):
    with pytest.raises(
        pytest.UsageError,
        match=exactly(f"--fuzz-minutes {value!r} is not a number; give a positive number of minutes, e.g. 30"),
    ):
        parse_minutes(value)


# -- --fuzz-profile ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_an_explicit_profile_wins_over_ci_and_minutes(name, monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert parse_profile(name, minutes=5.0) is PROFILES[name]


def test_the_default_profile_is_quick_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert parse_profile(None, minutes=None).name == "quick"


def test_an_empty_ci_variable_counts_as_outside_ci(monkeypatch):
    monkeypatch.setenv("CI", "")
    assert parse_profile(None, minutes=None).name == "quick"


def test_the_default_profile_is_ci_when_ci_is_set(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert parse_profile(None, minutes=None).name == "ci"


@pytest.mark.parametrize("ci", [None, "true"])
def test_giving_minutes_selects_the_nightly_profile(ci, monkeypatch):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    assert parse_profile(None, minutes=30.0).name == "nightly"


def test_an_unknown_profile_is_a_usage_error_listing_the_profiles():
    with pytest.raises(pytest.UsageError, match=exactly("--fuzz-profile 'soak' is not a profile; choose one of: ci, nightly, quick")):
        parse_profile("soak", minutes=None)


# -- one GPU per xdist worker --------------------------------------------------------------------


def test_workers_take_gpus_round_robin():
    assert [gpu_for_worker(f"gw{i}", 2) for i in range(6)] == [0, 1, 0, 1, 0, 1]


def test_every_worker_shares_the_only_gpu():
    assert {gpu_for_worker(f"gw{i}", 1) for i in range(4)} == {0}


def test_eight_workers_on_eight_gpus_each_get_their_own():
    assert [gpu_for_worker(f"gw{i}", 8) for i in range(8)] == list(range(8))


@pytest.mark.parametrize("worker", ["master", None, ""])
def test_a_run_without_xdist_uses_gpu_zero(worker):
    assert gpu_for_worker(worker, 4) == 0


@pytest.mark.parametrize("worker", ["gw0", "master", None])
def test_no_visible_gpu_is_a_usage_error_that_suggests_sim(worker):
    with pytest.raises(pytest.UsageError, match=exactly("no CUDA device is visible; use --backend sim")):
        gpu_for_worker(worker, 0)


@pytest.mark.parametrize("worker", ["worker1", "gw", "gwx"])
def test_an_unexpected_worker_id_is_a_usage_error_naming_it(worker):
    with pytest.raises(pytest.UsageError, match=exactly(f"unexpected PYTEST_XDIST_WORKER {worker!r}; expected gw0, gw1, ...")):
        gpu_for_worker(worker, 2)


# -- all options together ------------------------------------------------------------------------


def fake_config(**overrides) -> SimpleNamespace:
    """Stands in for ``pytest.Config``: only ``getoption`` is used."""
    values = {
        "fuzz_backend": "sim", "cuda_mode": "both", "zeroer": None, "fuzz_profile": None, "fuzz_minutes": None,
        "repro_dir": "repro/failures", "fuzz_db": ".hypothesis/fuzz-db", "fuzz_summary": "repro/summary.json",
        "fuzz_journal": "auto", "hypothesis_seed": None, "fuzz_geometry": None, "fuzz_shard": None, "fuzz_debug": False,
        "fuzz_shrink_seconds": None, "offloader": None, "host_memory": "both", "strict_caller": False,
    }
    values.update(overrides)
    return SimpleNamespace(getoption=lambda name, default=None: values[name])


def test_fuzz_options_gathers_every_parsed_value(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    options = fuzz_options(fake_config(zeroer="ring", fuzz_minutes="2", cuda_mode="free", fuzz_db="/tmp/db"))
    assert options == FuzzOptions(
        backends=["sim"], cuda_modes=("free",), zeroer="ring", profile=PROFILES["nightly"], minutes=2.0,
        repro_dir=Path("repro/failures"), database_dir=Path("/tmp/db"), summary_path=Path("repro/summary.json"),
        database="/tmp/db",
    )


def test_the_default_outputs_go_under_the_rootdir_wherever_pytest_runs(tmp_path, monkeypatch):
    # Run from tests/ (cd tests; pytest ../fuzz), a repro/ written into the working directory
    # would hide this project's repro package from the next run there: the defaults are the rootdir's.
    (tmp_path / "tests").mkdir()
    values = {"repro_dir": None, "fuzz_summary": None}
    config = SimpleNamespace(rootpath=tmp_path, getoption=lambda name, default=None: values[name])
    monkeypatch.chdir(tmp_path / "tests")
    assert output_path(config, "repro_dir", Path("repro/failures")) == Path("../repro/failures")
    assert output_path(config, "fuzz_summary", Path("repro/summary.json")) == Path("../repro/summary.json")
    monkeypatch.chdir(tmp_path)
    assert output_path(config, "repro_dir", Path("repro/failures")) == Path("repro/failures")
    values["repro_dir"] = "out/traces"  # a path given is the user's, relative to where they are
    assert output_path(config, "repro_dir", Path("repro/failures")) == Path("out/traces")


def test_hypothesis_seed_runs_every_campaign_once_with_that_seed_and_the_journal_follows_the_backend():
    options = fuzz_options(fake_config(hypothesis_seed="1234", fuzz_journal="on"))
    assert options.seed == 1234 and options.journal is True
    assert fuzz_options(fake_config()).journal is False  # auto: off on the simulator
    assert parse_journal("auto", "cuda") is True and parse_journal("off", "cuda") is False


def test_a_seed_that_is_not_an_integer_is_a_usage_error():
    with pytest.raises(pytest.UsageError, match=r"^--hypothesis-seed 'abc' is not an integer; fuzz campaigns need the integer seed a summary lists, e\.g\. --hypothesis-seed 1234$"):
        parse_seed("abc")


def test_an_unknown_journal_mode_is_a_usage_error():
    with pytest.raises(pytest.UsageError, match=r"^--fuzz-journal 'always' is not one of auto, on, off \(auto: on for the cuda backend\)$"):
        parse_journal("always", "sim")


def test_fuzz_options_checks_minutes_before_the_backend():
    with pytest.raises(pytest.UsageError, match=r"^--fuzz-minutes '-1' must be a finite number greater than 0"):
        fuzz_options(fake_config(fuzz_backend="nope", fuzz_minutes="-1"))


# -- end to end ----------------------------------------------------------------------------------


def pytest_fuzz(*args: str, tmp: Path) -> subprocess.Popen:
    """Start ``python -m pytest fuzz ARGS`` from the repository root, writing only under ``tmp``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    command = [
        sys.executable, "-m", "pytest", "fuzz", "-p", "no:cacheprovider", "-p", "no:xdist",
        "--fuzz-summary", str(tmp / "summary.json"), "--fuzz-db", str(tmp / "db"),
        *(() if "--backend" in args else ("--backend", "sim")),  # ONE_CAMPAIGN is a sim campaign, also on a GPU host
        *args,
    ]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    output, _ = process.communicate(timeout=300)
    return process.returncode, output


def test_a_bad_option_exits_with_status_2_and_one_line_that_says_why(tmp_path):
    code, output = finish(pytest_fuzz("--backend", "nope", tmp=tmp_path))
    assert code == 2
    assert re.search(r"^Exit: error: --backend 'nope' is not a backend; choose one of: auto, cuda, sim$", output, re.MULTILINE), output
    assert "Traceback" not in output


# One small campaign: the tiny geometry, first shard, simulator, torch kernel (the triton one
# runs under the interpreter and would only add time).
ONE_CAMPAIGN = "tiny and shard0 and sim and not triton and not x2"


def test_a_racy_zeroer_fails_its_campaign_and_a_race_free_one_passes(tmp_path):
    racy_dir, clean_dir = tmp_path / "racy", tmp_path / "clean"
    racy_dir.mkdir(), clean_dir.mkdir()
    racy = pytest_fuzz("--zeroer", "single_buffer", "-k", ONE_CAMPAIGN, "-q", "--repro-dir", str(racy_dir / "traces"), tmp=racy_dir)
    clean = pytest_fuzz("--zeroer", "per_call", "-k", ONE_CAMPAIGN, "-q", "--repro-dir", str(clean_dir / "traces"), tmp=clean_dir)
    (racy_code, racy_out), (clean_code, clean_out) = finish(racy), finish(clean)

    assert racy_code == pytest.ExitCode.TESTS_FAILED, racy_out
    assert "1 failed" in racy_out
    traces = sorted((racy_dir / "traces").glob("*.json"))
    assert len(traces) == 1, racy_out
    trace = json.loads(traces[0].read_text())
    assert trace["config"]["zeroer"] == "single_buffer"
    assert trace["campaign"] == "single_buffer-tiny-sim-k-torch-shard0"
    assert trace["ops"][0]["op"] == "start"
    assert trace["findings"]
    assert f"python -m repro replay {traces[0]}" in racy_out
    summary = json.loads((racy_dir / "summary.json").read_text())
    assert summary["totals"]["unexpected"] == 1

    assert clean_code == pytest.ExitCode.OK, clean_out
    assert "1 passed" in clean_out
    assert not (clean_dir / "traces").exists() or not any((clean_dir / "traces").iterdir())


def test_the_shrink_bound_takes_seconds_and_a_bad_one_is_a_usage_error_naming_it():
    assert parse_shrink_seconds(None) is None and parse_shrink_seconds("12.5") == 12.5 and parse_shrink_seconds("0") == 0.0
    assert fuzz_options(fake_config(fuzz_shrink_seconds="30")).shrink_seconds == 30.0
    for value in ("-1", "nan", "inf"):
        with pytest.raises(pytest.UsageError, match=rf"^--fuzz-shrink-seconds '{value}' must be a finite number of "
                                                    r"seconds, 0 or more; e\.g\. 30 \(0 keeps each finding's first failing program\)$"):
            parse_shrink_seconds(value)
    with pytest.raises(pytest.UsageError, match=r"^--fuzz-shrink-seconds 'abc' is not a number; give seconds, e\.g\. 30$"):
        parse_shrink_seconds("abc")


def test_offloader_options_choose_offload_campaigns_only():
    options = fuzz_options(fake_config(offloader="examples/engine_offloaders.py:load_waits_forward", host_memory="registered",
                                       fuzz_geometry="tiny,packed"))
    assert options.offloader == "examples/engine_offloaders.py:load_waits_forward"
    assert options.host_memory == ("registered",) and options.geometries == ("tiny", "packed")
    from fuzz.plugin import _campaigns

    ids = [c.id for c, _ in _campaigns(options)]
    assert ids and all(i.startswith("examples_engine_offloaders.py:load_waits_forward-") and "host-registered" in i for i in ids)


def test_strict_caller_runs_the_zeroer_campaigns_without_the_warmup_synchronisation():
    from fuzz.plugin import _campaigns

    options = fuzz_options(fake_config(zeroer="per_call", strict_caller=True))
    assert options.strict_caller and all(not c.config.warmup_sync for c, _ in _campaigns(options))
    with pytest.raises(pytest.UsageError, match=r"^--strict-caller is the zeroer's stricter caller"):
        fuzz_options(fake_config(offloader="examples/engine_offloaders.py:load_waits_forward", strict_caller=True))
