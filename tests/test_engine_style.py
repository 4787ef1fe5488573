"""The engines' own way of testing their KV transfer code, run under ``pytest --kvz-sanitize
--kvz-sanitize-backend sim`` in a subprocess, as a user would run it (tests/engine_style/README.md).

Each file of tests/engine_style/ must pass with 0 races; with ``ENGINE_STYLE_PLANTED_RACE=1`` its
code under test is the racy twin (one wait missing), and the same run must fail with the race's
kind at both of its marked lines (``# race: queued``, ``# race: later``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE_STYLE = ROOT / "tests" / "engine_style"

# test file -> the kind of race its code under test's racy twin has
PLANTED = {
    "test_cpu_gpu.py": "unordered-device-access",  # the store does not wait for the compute stream (vLLM #46278)
    "test_hicache_controller.py": "host-write-vs-pending-copy",  # a load acked before its finish event (SGLang #27444)
}


def run_sanitized(test_file: str, planted: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "ENGINE_STYLE_PLANTED_RACE"}
    env["PYTHONPATH"] = str(ROOT)
    if planted:
        env["ENGINE_STYLE_PLANTED_RACE"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", str(ENGINE_STYLE / test_file), "--kvz-sanitize",
                           "--kvz-sanitize-backend", "sim", "-p", "no:randomly", "-q"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)




def marks(test_file: str) -> dict[str, tuple[str, int]]:
    """The ``# race: queued`` and ``# race: later`` lines of ``test_file`` and its code under test."""
    module = {"test_cpu_gpu.py": "cpu_gpu_offload.py", "test_hicache_controller.py": "hicache_controller.py"}[test_file]
    sites: dict[str, tuple[str, int]] = {}
    for name in (test_file, module):
        for number, line in enumerate((ENGINE_STYLE / name).read_text().splitlines(), start=1):
            # a line may carry other races' marks after this one (``# race: later, race[27444]: later``)
            match = re.search(r"# race: (queued|later)(?=,|$)", line.rstrip())
            if match:
                assert match.group(1) not in sites, f"two '# race: {match.group(1)}' marks for {test_file}"
                sites[match.group(1)] = (f"tests/engine_style/{name}", number)
    assert set(sites) == {"queued", "later"}, f"{test_file}: marks {sorted(sites)}"
    return sites


def summary_races(out: str) -> list[str]:
    """The race reports of the plugin's terminal summary, one string each."""
    section = out.split("kvz-sanitize (simulator)")[-1].split("short test summary info")[0]
    return [block for block in section.split("\n\n") if block.lstrip("= \n").startswith("kvz-sanitize: ") and "[" in block]


@pytest.mark.parametrize("test_file", sorted(PLANTED))
def test_an_engines_own_transfer_tests_pass_on_the_simulator_with_no_race(test_file: str) -> None:
    done = run_sanitized(test_file, planted=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in [\d.]+s", last), last  # every test ran, none skipped or failed
    assert "kvz-sanitize: 0 distinct races" in done.stdout, out


@pytest.mark.parametrize("test_file", sorted(PLANTED))
def test_the_racy_twin_of_the_code_under_test_fails_with_its_race_at_both_marked_lines(test_file: str) -> None:
    done = run_sanitized(test_file, planted=True)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert re.search(r"\d+ failed", done.stdout.strip().splitlines()[-1]), out
    sites = marks(test_file)
    queued = re.compile(rf"^  queued: .*, at {re.escape(sites['queued'][0])}:{sites['queued'][1]} ", re.M)
    later = re.compile(rf"^  then: .*, at {re.escape(sites['later'][0])}:{sites['later'][1]} ", re.M)
    kind = f"[{PLANTED[test_file]}]"
    races = summary_races(done.stdout)
    assert any(kind in race and queued.search(race) and later.search(race) for race in races), out


def test_the_engine_style_polls_wait_for_a_copy_thread_slower_than_many_polls() -> None:
    # On an H100 under --kvz-sanitize, SimpleCPUOffload's race-free test failed with "jobs [0, 1, 2,
    # 3] never finished (copy thread error: None)": its poll gave up after 100,000 busy polls, fewer
    # than the time the copy thread's first launch took under the tool. A poll waits by the clock.
    import threading
    import time
    import types

    pytest.importorskip("cuda.bindings.driver", reason="the SimpleCPUOffload tests need cuda-bindings")
    from tests.engine_style.test_simple_cpu_offload import poll

    finished = types.SimpleNamespace(query=lambda: True)
    backend = types.SimpleNamespace(events=[], error=None)

    def copy_thread() -> None:  # the first job's event recorded 0.5 s late
        time.sleep(0.5)
        backend.events.append((0, finished))
        time.sleep(0.5)

    backend.thread = threading.Thread(target=copy_thread)
    backend.thread.start()
    try:
        poll(backend, {0})
    finally:
        backend.thread.join()
    with pytest.raises(AssertionError, match=r"jobs \[1\] never finished"):
        poll(backend, {1}, seconds=0.2)
