"""The code under test of tests/engine_style/ under the fuzzer, through factories, on the simulator.

``tests/engine_style/factories.py`` builds each piece of engine-style transfer code, unmodified,
over the harness's KV cache and host pool; here each is fuzzed in a subprocess as a user would run
``pytest fuzz --offloader``, on one geometry with a pinned pool (two campaigns, one per seed
shard). The race-free code must leave every campaign clean; its racy twin
(``ENGINE_STYLE_PLANTED_RACE=1``, the same twin the sanitizer's tests catch in
tests/test_engine_style.py) must be found in every campaign, by the call of the code that races.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = "tests/engine_style/factories.py"

# factory -> the call of the racy twin that a hazard names, and what that call's copy does, in each
# form a hazard of the race may take
PLANTED = {
    # the store reads the block without waiting for the caller's stream (vLLM #46278)
    "cpu_gpu_handler": ("store", ("reads it",)),
    # a load is acked before its finish event (SGLang #27444), so the caller reads the device block
    # mid-load ("... writes it"), or frees the host slot and writes its next tenant while the load's
    # copy still reads it ("... may not have read it yet"): which one a campaign shows first depends on
    # the ops it drew, and a shrink cut short by its time bound (a loaded 2-core machine) keeps either.
    "hicache_controller": ("load", ("writes it", "may not have read it yet")),
}

# A campaign's line in the run's output: "[1/2] tests_engine_style_factories.py:...-tiny-sim-shard0: clean, ..."
CAMPAIGN_LINE = re.compile(r"\[\d+/\d+\] (\S+): ([^,\n]+)")


def fuzz(factory: str, planted: bool, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """One ``pytest fuzz --offloader`` run on ``tiny`` with a pinned pool; each campaign's verdict."""
    env = {key: value for key, value in os.environ.items() if key != "ENGINE_STYLE_PLANTED_RACE"}
    if planted:
        env["ENGINE_STYLE_PLANTED_RACE"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "fuzz", "--offloader", f"{FACTORIES}:{factory}",
                           "--backend", "sim", "--geometry", "tiny", "--host-memory", "pinned", "-p", "no:randomly",
                           "-q", "--repro-dir", str(tmp_path / "failures"), "--fuzz-summary",
                           str(tmp_path / "summary.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    return done, dict(CAMPAIGN_LINE.findall(done.stdout))


@pytest.mark.parametrize("factory", sorted(PLANTED))
def test_the_engine_style_code_leaves_every_fuzz_campaign_clean(factory: str, tmp_path: Path) -> None:
    done, verdicts = fuzz(factory, planted=False, tmp_path=tmp_path)
    out = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, out
    assert sorted(verdicts) == [f"tests_engine_style_factories.py:{factory}-tiny-sim-shard{i}" for i in (0, 1)], out
    assert set(verdicts.values()) == {"clean"}, out
    assert "harness error" not in done.stdout + done.stderr, out


@pytest.mark.parametrize("factory", sorted(PLANTED))
def test_the_racy_twin_is_found_by_the_fuzz_run_at_its_racing_call(factory: str, tmp_path: Path) -> None:
    # The run's verdict (exit 1) is what a user gets. A campaign may miss a six-op race on its shard
    # (docs/fuzzing.md): with CI=true's derandomized seeds, one of HiCache's does.
    done, verdicts = fuzz(factory, planted=True, tmp_path=tmp_path)
    out = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 1, out
    assert len(verdicts) == 2 and any(v.startswith("FINDING") for v in verdicts.values()), out
    assert all(v.startswith("FINDING") or v == "clean" for v in verdicts.values()), out
    assert "harness error" not in done.stdout + done.stderr, out
    assert hazard_of(factory).search(done.stdout), out


def hazard_of(factory: str) -> re.Pattern[str]:
    """A hazard line naming the planted call (its blocks: one in a fully shrunk trace, more where the
    shrink bound cut it short) and what its copy does, in any of the race's forms."""
    call, accesses = PLANTED[factory]
    access = "|".join(re.escape(a) for a in accesses)
    return re.compile(rf"^  - hazard at step \d+: .*\({re.escape(FACTORIES)}:{factory}\.{call}#\d+\(\[[\d, ]+\]\)\) "
                      rf"(?:{access})\b", re.M)


# Lines of real reports, one per form, and lines the check must refuse (another call, another verb,
# not a hazard).
HICACHE_HOST = ("  - hazard at step 9: host write to pinned host buffer p1 of the offloader (the harness's host KV pool, "
                "torch.empty(pin_memory=True)) by step 9 evict: the caller's host write of slot 1 (its next tenant) while "
                "copy_ (h2d)#42 on stream 'offloader-2' (tests/engine_style/factories.py:hicache_controller.load#9([3])) "
                "may not have read it yet: no event or synchronisation observed by the host orders the copy before the write")
HICACHE_BLOCK = ("  - hazard at step 6: block 3: copy_ (h2d)#20 on stream 'offloader-2' "
                 "(tests/engine_style/factories.py:hicache_controller.load#4([3])) writes it and read#23 on stream "
                 "'main' (harness.read#6([3])) reads it with no event path between stream 'offloader-2' and stream 'main'")


def test_the_hazard_check_takes_each_form_of_the_race_and_nothing_else() -> None:
    hicache, handler = hazard_of("hicache_controller"), hazard_of("cpu_gpu_handler")
    assert hicache.search(HICACHE_HOST) and hicache.search(HICACHE_BLOCK)
    assert not hicache.search(HICACHE_BLOCK.replace(".load#", ".store#"))
    assert not hicache.search(HICACHE_BLOCK.replace("writes it", "reads it"))
    assert not hicache.search(HICACHE_BLOCK.replace("  - hazard at", "  - note at"))
    assert not handler.search(HICACHE_BLOCK) and not handler.search(HICACHE_HOST)
    assert handler.search(HICACHE_BLOCK.replace("hicache_controller.load#", "cpu_gpu_handler.store#")
                          .replace("writes it", "reads it"))
