"""A factory that raises is a usage error, never a finding: code that cannot be built was never run.

A zeroer's or offloader's factory that raises (its own bug, or an ``AttributeError`` because a
module it uses failed to import) stops each campaign as an error with exit status 2 and one line
that names the factory, the exception, the ``file:line`` it was raised at and the fix; every path
that builds one agrees (``run_ops``, behind ``python -m repro`` and the benchmarks). What the built
component raises later, on valid input, is still its finding. The factories are written to a
temporary file, as a user's own would be, and run through ``pytest fuzz`` in a real subprocess.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign
from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.harness_error import HarnessError
from fuzz.engine.summary import harness_status, is_unexpected, render_summary, result_record

ROOT = Path(__file__).resolve().parents[1]
START = {"op": "start", "in_flight": 1}

# A factory whose helper module failed to import: the name it reaches for is not there.
ZEROER = '''\
import types

helpers = types.ModuleType("helpers")  # what a failed `from . import helpers` leaves behind


def make(cache, runtime):
    return helpers.Zeroer(cache, runtime)
'''
OFFLOADER = '''\
import types

helpers = types.ModuleType("helpers")


def make(cache, host_pool, runtime=None):
    return helpers.OffloadHandler(cache.layer_tensors, host_pool.layer_tensors)


class StoreRaises:
    def __init__(self, cache, host_pool, runtime=None):
        self.pool = host_pool

    def store(self, job_id, block_ids, slot_ids):
        if list(block_ids) != [0]:  # the harness's warm-up stores the null block 0
            raise RuntimeError(f"planted: cannot store {list(block_ids)}")

    def load(self, job_id, slot_ids, block_ids):
        pass

    def get_finished(self):
        return []


def store_raises(cache, host_pool, runtime=None):
    return StoreRaises(cache, host_pool, runtime)


def uses_the_runtime(cache, host_pool, runtime=None):
    runtime.new_stream("mine")
'''


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(source)
    return path


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _message(component: str, spec: str, at: str, error: str, call: str) -> str:
    return (f"the {component} factory '{spec}' raised at {at}: {error}; it built no {component}, so nothing was fuzzed "
            f"and this is not a finding: fix the factory so that {call} returns the {component}")


def test_a_zeroer_factory_that_raises_is_a_usage_error_naming_the_factory_its_exception_and_line(tmp_path):
    path = _write(tmp_path, "my_zeroer.py", ZEROER)
    spec = f"{path}:make"
    with pytest.raises(HarnessError) as raised:
        run_ops(EpisodeConfig(zeroer=spec), [START])
    expected = _message("zeroer", spec, f"{path}:{_line(path, 'return helpers')} (return helpers.Zeroer(cache, runtime))",
                        "AttributeError: module 'helpers' has no attribute 'Zeroer'", "make(cache, runtime)")
    assert re.fullmatch(re.escape(expected), raised.value.message), raised.value.message
    assert raised.value.status == 2 and raised.value.details.startswith("Traceback")


def test_an_offloader_factory_that_raises_stops_its_campaign_as_a_usage_error_not_a_finding(tmp_path):
    path = _write(tmp_path, "my_offloader.py", OFFLOADER)
    spec = f"{path}:make"
    campaign = Campaign(EpisodeConfig(zeroer="reference", offloader=spec, geometry="tiny"), 0, "clean")
    result = run_campaign(campaign, PROFILES["quick"], tmp_path / "out")
    expected = _message("offloader", spec, f"{path}:{_line(path, 'return helpers')} (return "
                        "helpers.OffloadHandler(cache.layer_tensors, host_pool.layer_tensors))",
                        "AttributeError: module 'helpers' has no attribute 'OffloadHandler'", "make(cache, host_pool, runtime)")
    assert re.fullmatch(re.escape(expected), result.harness_error or ""), result.harness_error
    assert not result.found and result.violation is None and result.trace_path is None
    assert not list((tmp_path / "out").glob("*.json"))  # nothing was found: no trace
    record = result_record(result)
    assert not is_unexpected(record) and harness_status([record]) == 2
    text, data = render_summary([record], "quick")
    assert data["totals"]["findings"] == 0 and "VIOLATION" not in text


def test_what_a_built_offloader_raises_on_valid_input_is_still_its_finding(tmp_path):
    path = _write(tmp_path, "my_offloader.py", OFFLOADER)
    config = EpisodeConfig(zeroer="reference", offloader=f"{path}:store_raises", geometry="tiny")
    [finding] = run_ops(config, [START, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}])
    assert finding.kind == "offloader raised"
    assert re.match(r"offloader raised at step 3 in store\(\d+, \[1\], \[\d+\]\): RuntimeError: planted: cannot store "
                    r"\[1\]$", finding.message), finding.message


def test_an_offloader_that_uses_the_runtime_is_told_it_is_plain_torch_not_how_a_zeroer_declares_it(tmp_path):
    path = _write(tmp_path, "my_offloader.py", OFFLOADER)
    spec = f"{path}:uses_the_runtime"
    with pytest.raises(HarnessError) as raised:
        run_ops(EpisodeConfig(zeroer="reference", offloader=spec, geometry="tiny"), [START])
    assert raised.value.status == 2
    assert raised.value.message.endswith(
        f"InterceptError: offloader {spec!r} uses runtime.new_stream, but an offloader is plain torch and Triton, run "
        "under interception: its factory's runtime argument is a placeholder; queue the work with torch streams, "
        "copies and kernels"), raised.value.message
    assert "zeroer" not in raised.value.message.replace(str(tmp_path), "")


def test_an_offloader_in_a_process_that_imported_cupy_is_named_an_offloader_in_the_refusal(tmp_path, monkeypatch):
    path = _write(tmp_path, "my_offloader.py", OFFLOADER)
    spec = f"{path}:store_raises"
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))  # as if the process had imported it
    with pytest.raises(HarnessError) as raised:
        run_ops(EpisodeConfig(zeroer="reference", offloader=spec, geometry="tiny"), [START])
    assert f"InterceptError: offloader {spec!r} on the sim backend: this process has imported cupy, whose CUDA " \
           "calls bypass torch" in raised.value.message, raised.value.message
    assert raised.value.status == 2


def _pytest_fuzz(tmp_path: Path, *args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, "-m", "pytest", "fuzz", "-p", "no:xdist", "-q", "-p", "no:cacheprovider", *args,
               "--backend", "sim", "--geometry", "tiny", "-k", "tiny-sim-shard0", f"--repro-dir={tmp_path / 'out'}",
               f"--fuzz-summary={tmp_path / 'summary.json'}", f"--fuzz-db={tmp_path / 'db'}"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("component", ["offloader", "zeroer"])
def test_pytest_fuzz_with_a_factory_that_raises_exits_2_with_one_line_and_no_traceback(component, tmp_path):
    path = _write(tmp_path, f"my_{component}.py", OFFLOADER if component == "offloader" else ZEROER)
    status, output = _pytest_fuzz(tmp_path, f"--{component}", f"{path}:make")
    assert status == 2, output
    assert re.search(rf"^the {component} factory '{re.escape(str(path))}:make' raised at {re.escape(str(path))}:\d+ "
                     r"\(return helpers\.\w+\(.*\)\): AttributeError: module 'helpers' has no attribute '\w+'; it built no "
                     rf"{component}, so nothing was fuzzed and this is not a finding: fix the factory so that make\(cache, "
                     rf"(host_pool, )?runtime\) returns the {component}$", output, re.MULTILINE), output
    assert "HARNESS ERROR (not judged)" in output
    assert "Traceback" not in output and "VIOLATION" not in output and "finding(s)" not in output
    assert not list((tmp_path / "out").glob("*.json"))


@pytest.mark.parametrize("method", ["fuzz", "stress"])
def test_a_benchmark_records_a_factory_that_raises_as_its_rows_error_never_a_finding(method, tmp_path):
    from fuzz.bench.detect.run import Job, run_job

    path = _write(tmp_path, "my_offloader.py", OFFLOADER)
    config = EpisodeConfig(zeroer="reference", offloader=f"{path}:make", geometry="tiny")
    record = run_job(Job(method, "make", "race-free", 1, config, 5.0, str(tmp_path / "out")))
    assert not record["found"] and record["message"] == "harness error"
    assert record["error"].startswith(f"the offloader factory '{path}:make' raised at "), record["error"]
