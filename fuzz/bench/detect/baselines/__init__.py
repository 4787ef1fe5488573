"""The baselines this fuzzer is compared against in the detection benchmark (docs/baselines.md).

Each is a function ``method(config, budget_s, seed) -> DetectionOutcome`` over the same
:class:`~fuzz.engine.episode.EpisodeConfig` entries the fuzzer runs:

* ``stress`` (:mod:`fuzz.bench.detect.baselines.stress`): a plain random loop over the fuzzer's ops, with no
  Hypothesis, no ``advance`` and no ``delay``; value findings only;
* ``sanitizer`` (:mod:`fuzz.bench.detect.baselines.sanitizer`): that loop on cuda under PyTorch's CUDA
  sanitizer (``TORCH_CUDA_SANITIZER=1``), in a child process; a detection is a CSAN report;
* ``handwritten`` (:mod:`fuzz.bench.detect.baselines.handwritten`): one fixed interleaving in the style of
  vLLM's ``tests/v1/worker/test_kv_block_zeroer.py``, run once.

From the command line, mostly for debugging::

    PYTHONPATH=. python -m fuzz.bench.detect.baselines stress --zeroer single_buffer --kernel torch --budget 5 --seed 1
    python -m fuzz.bench.detect.baselines sanitizer --zeroer single_buffer --backend cuda --budget 30

It prints the outcome and exits (:mod:`racecheck.cli`) 1 when the method found something, 0 when not,
2 for a bad command line, 3 for a bug in this tool.

Example::

    from fuzz.bench.detect.baselines import METHODS
    outcome = METHODS["handwritten"](EpisodeConfig(zeroer="single_buffer"), 10.0, 0)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Callable

from fuzz.bench.detect.baselines.handwritten import handwritten
from fuzz.bench.detect.baselines.sanitizer import child_main, sanitizer
from fuzz.bench.detect.baselines.stress import DEFAULT_REPRO_DIR, check_budget, stress
from fuzz.bench.detect.outcome import DetectionOutcome
from fuzz.bench import BenchUsageError, command
from racecheck.cli import CLEAN, FINDING, ArgumentParser, check_output
from fuzz.engine.episode import EpisodeConfig
from zeroer.cache.geometries import geometry
from zeroer.designs.common import KERNELS
from zeroer.errors import ZeroerError
from zeroer.registry import load_zeroer
from kvdevice.runtime import BACKENDS

Method = Callable[[EpisodeConfig, float, int], DetectionOutcome]

METHODS: dict[str, Method] = {
    "handwritten": handwritten,
    "sanitizer": sanitizer,
    "stress": stress,
}
CHILD = "stress-child"  # internal: the sanitizer's child process
PROG = "python -m fuzz.bench.detect.baselines"


def run_method(
    name: str, config: EpisodeConfig, budget_s: float, seed: int, *, repro_dir: Path | None = None
) -> DetectionOutcome:
    """Run the baseline called ``name``; an unknown name is a :class:`BenchUsageError`."""
    if name not in METHODS:
        raise BenchUsageError(f"unknown baseline method {name!r}; choose one of: {', '.join(sorted(METHODS))}")
    return METHODS[name](config, budget_s, seed, repro_dir=repro_dir)


@command(PROG)
def main(argv: list[str]) -> int:
    """The exit status (:mod:`racecheck.cli`): 1 when the method found something, 0 when not."""
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("method", help=f"one of: {', '.join(sorted(METHODS))}")
    parser.add_argument("--zeroer", default="reference", help="a built-in name, module:attr or path/file.py:attr")
    parser.add_argument("--geometry", default="tiny")
    parser.add_argument("--backend", default="auto", help="sim, cuda or auto (the sanitizer always uses cuda)")
    parser.add_argument("--kernel", default=None, help="built-in staged designs: torch or triton")
    parser.add_argument("--budget", type=float, default=10.0, help="seconds (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repro-dir", type=Path, default=DEFAULT_REPRO_DIR)
    parser.add_argument("--config-json", default=None, help=argparse.SUPPRESS)  # the sanitizer's child
    args = parser.parse_args(argv)
    if args.config_json is not None:  # the sanitizer's child: its parent built and checked the config
        config = EpisodeConfig(**json.loads(args.config_json))
        return child_main(config, args.budget, args.seed, args.repro_dir)
    try:
        config = _checked_config(args)
    except (BenchUsageError, ZeroerError) as exc:
        parser.error(str(exc))  # exit status 2, the message names the value
    check_output("--repro-dir", args.repro_dir, "directory")
    outcome = run_method(args.method, config, args.budget, args.seed, repro_dir=args.repro_dir)
    runs = "once" if args.method == "handwritten" else f"seed {args.seed}, budget {args.budget:g} s"  # print only what applies
    print(f"{args.method} on zeroer {config.zeroer!r}, geometry {config.geometry}, {runs}")
    for field in dataclasses.fields(outcome):
        print(f"  {field.name}: {getattr(outcome, field.name)}")
    return FINDING if outcome.found else CLEAN


def _checked_config(args: argparse.Namespace) -> EpisodeConfig:
    """Every option checked before the method runs; a bad one names itself and the choices."""
    if args.method not in METHODS:
        raise BenchUsageError(f"unknown baseline method {args.method!r}; choose one of: {', '.join(sorted(METHODS))}")
    check_budget(args.budget)
    if args.backend not in BACKENDS:
        raise BenchUsageError(f"--backend {args.backend!r} is not a backend; choose one of: {', '.join(BACKENDS)}")
    if args.kernel not in (None, *KERNELS):
        raise BenchUsageError(f"--kernel {args.kernel!r} is not a kernel; choose one of: {', '.join(KERNELS)}")
    import torch

    if (args.backend == "cuda" or args.method == "sanitizer") and not torch.cuda.is_available():
        who = "the sanitizer method runs on cuda and" if args.method == "sanitizer" else "--backend cuda"
        raise BenchUsageError(f"{who} needs a CUDA GPU, and none is visible here; use --backend sim with stress or handwritten")
    geometry(args.geometry)  # an unknown name lists the known ones
    load_zeroer(args.zeroer)  # an unknown spec says what a spec looks like
    return EpisodeConfig(zeroer=args.zeroer, geometry=args.geometry, backend=args.backend, kernel=args.kernel)

