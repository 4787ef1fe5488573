"""Trace files: the shrunk ops of a finding as versioned JSON, written atomically.

A trace holds everything needed to run the episode again: the episode config (zeroer spec,
geometry, backend), the Hypothesis seed of the run that found it, every op in order (schedule
choices and delays included), the findings, and the machine it was found on (GPU, driver, torch,
triton). The file name is a stable content hash of the
config and ops, so the same finding from two workers lands in one file and concurrent writers
never clobber each other (temp file + rename). Format: docs/trace-format.md.

Example::

    path = write_trace(Path("repro/failures"), config, ops, findings, seed=12, campaign="ring-tiny-sim-shard0")
    data = read_trace(path)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from fuzz.environment import environment
from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.oracle import Finding

TRACE_VERSION = 1


def trace_name(config: EpisodeConfig, ops: list[dict]) -> str:
    body = json.dumps({"config": dataclasses.asdict(config), "ops": ops}, sort_keys=True)
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    spec = config.zeroer
    if ".py:" in spec:  # a file's factory: its name, not the whole path
        spec = Path(spec.rpartition(":")[0]).name + ":" + spec.rpartition(":")[2]
    safe = spec.replace("/", "_").replace(":", "_").replace(".", "_")
    return f"{safe}-{config.geometry}-{digest}.json"


def trace_data(
    config: EpisodeConfig,
    ops: list[dict],
    findings: list[Finding],
    *,
    seed: int | None = None,
    campaign: str | None = None,
) -> dict[str, Any]:
    """The JSON object of a trace file (docs/trace-format.md)."""
    return {
        "version": TRACE_VERSION,
        "campaign": campaign,
        "seed": seed,
        "config": dataclasses.asdict(config),
        "ops": ops,
        "findings": [dataclasses.asdict(f) for f in findings],
        "environment": environment(),
    }


def write_atomically(path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as JSON to ``path`` through a temp file and a rename: readers never see half
    a file, and two writers of the same path leave one whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=1)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_trace(
    directory: Path,
    config: EpisodeConfig,
    ops: list[dict],
    findings: list[Finding],
    *,
    seed: int | None = None,
    campaign: str | None = None,
) -> Path:
    """Save a finding under ``directory`` with its content-hash name; returns the path."""
    data = trace_data(config, ops, findings, seed=seed, campaign=campaign)
    return write_atomically(directory / trace_name(config, ops), data)


def read_trace(path: Path) -> dict[str, Any]:
    with open(path) as handle:
        return json.load(handle)
