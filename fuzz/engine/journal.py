"""The in-flight journal: the current episode's ops on disk before each op's device work starts.

A broken zeroer on the GPU can write out of bounds; the CUDA fault kills the pytest-xdist worker
and everything in its memory, the Hypothesis shrinker included. So before every op runs, the
ops so far (that one included) are written atomically to one file per worker,
``<repro-dir>/.inflight-<worker>.json``, in the trace format. When xdist reports a crashed
worker, the controller turns that file into a regular trace under ``--repro-dir`` and names it
in the failure (:func:`rescue`). STYLE.md: "save a trace before launching its device work".

It is on for the cuda backend by default (``--fuzz-journal auto``): a write costs about as much
as a simulated op, and the simulator cannot fault.

Example::

    journal = Journal(Path("repro/failures"), worker="gw0", campaign="ring-tiny-cuda-free-shard0", seed=7)
    journal.record(config, ops_so_far + [next_op])    # then run next_op
    rescue(Path("repro/failures"), "gw0", "ring-tiny-cuda-free-shard0")   # in the controller
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.trace import read_trace, trace_data, trace_name
from racecheck.atomic_file import write_json_atomically

JOURNAL_MODES = ("auto", "on", "off")


def journal_path(repro_dir: Path, worker: str | None) -> Path:
    return repro_dir / f".inflight-{worker or 'main'}.json"


@dataclass
class Journal:
    """Where one worker writes the ops of the episode it is running."""

    repro_dir: Path
    worker: str | None
    campaign: str
    seed: int | None = None

    @property
    def path(self) -> Path:
        return journal_path(self.repro_dir, self.worker)

    def record(self, config: EpisodeConfig, ops: list[dict]) -> None:
        data = trace_data(config, ops, [], seed=self.seed, campaign=self.campaign)
        data["status"] = "in-flight"
        write_json_atomically(self.path, data)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


def rescue(repro_dir: Path, worker: str, campaign: str) -> Path | None:
    """Turn the crashed ``worker``'s journal into a trace of ``campaign``; None if there is none.

    The trace's one finding says the worker died while running its last op, so a replay (which
    runs that op too) shows whether the crash reproduces.
    """
    path = journal_path(repro_dir, worker)
    try:
        data = read_trace(path)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if data.get("campaign") != campaign or not data.get("ops"):
        return None  # left over from another campaign: not this crash's
    last = data["ops"][-1]
    data.pop("status", None)
    data["findings"] = [{
        "kind": "crash",
        "block": None,
        "message": f"worker {worker} died (a CUDA fault or another crash) while running op {len(data['ops']) - 1}: {json.dumps(last)}",
        "caller_fault": False,
        "op": len(data["ops"]) - 1,  # the op it died in (0-based): where a timeline draws it
    }]
    config = EpisodeConfig(**data["config"])
    target = write_json_atomically(repro_dir / trace_name(config, data["ops"]), data)
    path.unlink()
    return target
