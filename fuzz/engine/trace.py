"""Trace files: the shrunk ops of a finding as versioned JSON, written atomically.

Model. A trace holds everything needed to run the episode again: the episode config (zeroer spec,
geometry, backend), the Hypothesis seed of the run that found it, every op in order (schedule
choices and delays included), the findings, and the machine it was found on (GPU, driver, torch,
triton). The file name is a stable content hash of the config and ops, so the same finding from
two workers lands in one file, and concurrent writers never clobber each other (temp file +
rename, :mod:`racecheck.atomic_file`). Format: docs/trace-format.md.

The format is the engine's: what it holds are the engine's ops, config and findings, and the
engine is what writes it (a campaign's finding, :mod:`fuzz.engine.campaigns`; the in-flight
journal and its rescue after a crash, :mod:`fuzz.engine.journal`). So it lives here, and the
dependency goes one way: the commands that read a trace a user hands them check it field by field
with :func:`fuzz.trace.load_trace`, which builds on :data:`TRACE_VERSION` here. :func:`read_trace`
is the raw, unchecked read, for the engine's own files.

Example::

    path = write_trace(Path("repro/failures"), config, ops, findings, seed=12, campaign="ring-tiny-sim-shard0")
    read_trace(path)["ops"] == ops      # True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from racecheck.atomic_file import write_json_atomically
from fuzz.engine.episode import EpisodeConfig
from fuzz.engine.oracle import Finding
from racecheck.environment import environment

TRACE_VERSION = 1


def trace_name(config: EpisodeConfig, ops: list[dict]) -> str:
    """``<zeroer or offloader>-<geometry>-<hash of config and ops>.json``: one file per distinct finding."""
    body = json.dumps({"config": dataclasses.asdict(config), "ops": ops}, sort_keys=True)
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    spec = getattr(config, "offloader", None) or config.zeroer  # an offload campaign's: its offloader
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
    reproduction: dict[str, Any] | None = None,
    shrink: dict[str, Any] | None = None,
    probe: bool = True,
) -> dict[str, Any]:
    """The JSON object of a trace file (docs/trace-format.md). ``reproduction``: how often a
    free-running finding showed again when it was replayed on the spot (fuzz.engine.campaigns);
    ``shrink``: how its ops were shrunk (fuzz.engine.shrink.ShrinkRecord);
    ``probe=False``: do not start the GPU probe for its environment (a save after Ctrl-C)."""
    data = {
        "version": TRACE_VERSION,
        "campaign": campaign,
        "seed": seed,
        "config": dataclasses.asdict(config),
        "ops": ops,
        "findings": [dataclasses.asdict(f) for f in findings],
        "environment": environment(probe),
    }
    if reproduction is not None:
        data["reproduction"] = reproduction
    if shrink is not None:
        data["shrink"] = shrink
    return data


def write_trace(directory: Path, config: EpisodeConfig, ops: list[dict], findings: list[Finding], **fields: Any) -> Path:
    """Save a finding under ``directory`` with its content-hash name; returns the path. ``fields``:
    :func:`trace_data`'s keywords (``seed``, ``campaign``, ``reproduction``, ``shrink``, ``probe``)."""
    return write_json_atomically(directory / trace_name(config, ops), trace_data(config, ops, findings, **fields))


def read_trace(path: Path) -> dict[str, Any]:
    """The raw JSON object of a trace file, unchecked (:func:`fuzz.trace.load_trace` checks it)."""
    with open(path) as handle:
        return json.load(handle)
