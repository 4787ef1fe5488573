"""Every factory in examples/ runs on every backend and mode it declares, and is judged as its docstring says.

The examples are what a user copies first, so each one is fuzzed where it says it runs: the
simulator here, and both CUDA modes on a GPU (the cuda cases skip without one). A racy example
must be found and shrunk to a few ops; a race-free one must come out clean.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from fuzz.engine.campaigns import PROFILES, Campaign, run_campaign
from fuzz.engine.episode import EpisodeConfig
from zeroer.registry import load_zeroer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# What each example factory is, as its module's docstring says.
VERDICTS = {
    "examples/engine_zeroers.py:single_pinned_buffer": "racy",
    "examples/engine_zeroers.py:pinned_ring": "racy",
    "examples/engine_zeroers.py:fresh_pinned_per_call": "race-free",
    "examples/engine_zeroers.py:event_guarded_ring": "race-free",
    "examples/runtime_zeroer.py:RuntimePerCall": "race-free",
}


def _factories_in(path: Path) -> list[str]:
    """Public factories defined in an example file: functions of (cache, runtime), classes declaring capabilities."""
    spec = importlib.util.spec_from_file_location(f"_examples_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) and list(inspect.signature(obj).parameters)[:2] == ["cache", "runtime"]:
            found.append(f"examples/{path.name}:{name}")
        elif inspect.isclass(obj) and "capabilities" in vars(obj):
            found.append(f"examples/{path.name}:{name}")
    return found


def _cases() -> list:
    cases = []
    for spec, verdict in sorted(VERDICTS.items()):
        attr = spec.split(":")[1]
        capabilities = load_zeroer(spec).capabilities
        for backend in capabilities.backends:
            modes = capabilities.cuda_modes if backend == "cuda" else ("controlled",)
            for mode in modes:
                marks = []
                if backend == "cuda":
                    marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required"))
                cases.append(pytest.param(spec, verdict, backend, mode, marks=marks, id=f"{attr}-{backend}-{mode}"))
    return cases


def test_every_example_factory_is_listed_here():
    found = sorted(spec for path in sorted(EXAMPLES.glob("*.py")) for spec in _factories_in(path))
    assert found == sorted(VERDICTS), "an example factory was added or removed: list it in VERDICTS with its verdict"


@pytest.mark.parametrize(("spec", "verdict", "backend", "mode"), _cases())
def test_each_example_is_judged_rightly_where_it_declares_it_runs(spec, verdict, backend, mode, tmp_path):
    if backend == "cuda" and mode == "free" and verdict == "racy":
        pytest.skip("free-running: a race shows only when timing allows (the controlled mode forces it)")
    config = EpisodeConfig(zeroer=spec, geometry="tiny", backend=backend, mode=mode)
    result = run_campaign(Campaign(config, 0, "finds" if verdict == "racy" else "clean"), PROFILES["quick"], tmp_path)
    assert result.found == (verdict == "racy"), result.violation
    if result.found:
        assert len(result.violation.trace) <= 4, result.violation.trace  # shrunk to a few ops
