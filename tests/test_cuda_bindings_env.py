"""The fuzzer where NVIDIA's cuda-bindings is installed, as in an engine's environment.

torch 2.13 imports ``cuda.bindings.runtime`` when torch itself is imported, wherever the package
is installed (the H200 image has it; engines that call the driver need it). The campaigns of the
examples must give the verdicts they give without it: importing the bindings moves no bytes.
CI installs cuda-bindings (.ci/run); these tests compare a run that hides it with one that has it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ZEROER_CAMPAIGNS = ("single_buffer-tiny-sim-k-torch-shard0 or per_call-tiny-sim-k-torch-shard0 or "
                    "ring-tiny-sim-k-torch-shard0 or event_ring-tiny-sim-k-torch-shard0")
OFFLOADERS = ("load_unfenced", "load_waits_forward")

# A campaign's line in the run's output: "[2/4] ring-tiny-sim-k-torch-shard0: found (expected), ..."
CAMPAIGN_LINE = re.compile(r"\[\d+/\d+\] (\S+): ([^,\n]+)")

# sys.modules["cuda"] = None makes every ``import cuda...`` fail, as where the package is absent
# (torch then imports without the bindings).
HIDDEN = "import sys; sys.modules['cuda'] = None; "
RUN = "import pytest; raise SystemExit(pytest.main({args!r}))"


def verdicts(args: list[str], *, hide_bindings: bool, tmp_path: Path) -> dict[str, str]:
    """Each campaign's verdict ("clean", "found (expected)", ...) in a fresh process."""
    out = tmp_path / ("hidden" if hide_bindings else "installed")
    # Imported as an engine does (torch 2.13 imports it itself; 2.11, the GPU image's, does not).
    code = (HIDDEN if hide_bindings else "import cuda.bindings.runtime; ") + "import torch, sys; print('bindings:', 'cuda.bindings' in sys.modules); " + \
        RUN.format(args=[*args, "-p", "no:randomly", "-q", "--repro-dir", str(out), "--fuzz-summary", str(out / "summary.json")])
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    assert f"bindings: {not hide_bindings}" in done.stdout
    found = dict(CAMPAIGN_LINE.findall(done.stdout))
    assert found, done.stdout[-3000:]
    return found


@pytest.fixture(scope="module")
def bindings_installed() -> None:
    pytest.importorskip("cuda.bindings.runtime", reason="cuda-bindings is not installed (CI installs it)")


@pytest.mark.parametrize("args", [
    # --backend sim: on a GPU machine the default is cuda, and the -k names sim campaigns
    ["fuzz", "--backend", "sim", "-k", ZEROER_CAMPAIGNS],
    *(["fuzz", "--offloader", f"examples/engine_offloaders.py:{name}", "--geometry", "tiny", "--host-memory",
       "pinned"] for name in OFFLOADERS),
], ids=["torch-zeroers", *OFFLOADERS])
def test_each_campaign_gives_the_same_verdict_with_cuda_bindings_imported_by_torch(args, bindings_installed, tmp_path):
    without = verdicts(args, hide_bindings=True, tmp_path=tmp_path)
    with_bindings = verdicts(args, hide_bindings=False, tmp_path=tmp_path)
    assert with_bindings == without
    assert not any("harness error" in verdict or "refused" in verdict for verdict in with_bindings.values())
