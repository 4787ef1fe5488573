"""Trace files: the shrunk ops of a finding as versioned JSON, written atomically.

A trace holds everything needed to run the episode again: the episode config (zeroer spec,
geometry, backend), the Hypothesis seed of the run that found it, every op in order (schedule
choices and delays included) and the findings. The file name is a stable content hash of the
config and ops, so the same finding from two workers lands in one file and concurrent writers
never clobber each other (temp file + rename). Format: docs/trace-format.md.

Example::

    path = write_trace(Path("repro/failures"), config, ops, findings, seed=12, campaign="ring-tiny-sim-shard0")
    data = read_trace(path)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .episode import EpisodeConfig
from .oracle import Finding

TRACE_VERSION = 1


def trace_name(config: EpisodeConfig, ops: list[dict]) -> str:
    body = json.dumps({"config": dataclasses.asdict(config), "ops": ops}, sort_keys=True)
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    safe = config.zeroer.replace("/", "_").replace(":", "_").replace(".", "_")
    return f"{safe}-{config.geometry}-{digest}.json"


def write_trace(
    directory: Path,
    config: EpisodeConfig,
    ops: list[dict],
    findings: list[Finding],
    *,
    seed: int | None = None,
    campaign: str | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "version": TRACE_VERSION,
        "campaign": campaign,
        "seed": seed,
        "config": dataclasses.asdict(config),
        "ops": ops,
        "findings": [dataclasses.asdict(f) for f in findings],
    }
    path = directory / trace_name(config, ops)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")
    os.replace(tmp, path)
    return path


def read_trace(path: Path) -> dict[str, Any]:
    with open(path) as handle:
        return json.load(handle)
