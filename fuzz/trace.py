"""Trace files: the shrunk ops of a finding as versioned JSON, written atomically, read back checked.

A trace holds everything needed to run the episode again: the episode config (zeroer spec,
geometry, backend), the Hypothesis seed of the run that found it, every op in order (schedule
choices and delays included), the findings, and the machine it was found on (GPU, driver, torch,
triton). The file name is a stable content hash of the config and ops, so the same finding from
two workers lands in one file, and concurrent writers never clobber each other (temp file +
rename, :mod:`fuzz.atomic_file`). The in-flight journal (:mod:`fuzz.engine.journal`) writes the
same format. Format: docs/trace-format.md.

Reading for replay or export (:func:`load_trace`) never runs code from the file: it checks the
JSON and builds an :class:`~fuzz.engine.episode.EpisodeConfig` and a list of op records, and a
file it cannot use is a :class:`TraceError` whose one-line message names the file and the field.
The only code a replay imports is the zeroer factory that ``config.zeroer`` names.

Example::

    path = write_trace(Path("repro/failures"), config, ops, findings, seed=12, campaign="ring-tiny-sim-shard0")
    trace = load_trace(Path("repro/cases/single_buffer_pre_48085.json"))
    trace.config.zeroer, len(trace.ops)      # ('single_buffer', 3)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.atomic_file import write_json_atomically
from fuzz.environment import environment
from fuzz.engine.episode import OPS, EpisodeConfig
from fuzz.engine.oracle import Finding

TRACE_VERSION = 1


# -- writing ---------------------------------------------------------------------------------

def trace_name(config: EpisodeConfig, ops: list[dict]) -> str:
    """``<zeroer>-<geometry>-<hash of config and ops>.json``: one file per distinct finding."""
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


def write_trace_data(path: Path, data: dict[str, Any]) -> Path:
    """Write a trace object (:func:`trace_data`, or one read back) to ``path`` atomically."""
    return write_json_atomically(path, data)


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
    return write_trace_data(directory / trace_name(config, ops), data)


# -- reading ---------------------------------------------------------------------------------

def read_trace(path: Path) -> dict[str, Any]:
    """The raw JSON object of a trace file, unchecked (:func:`load_trace` checks it)."""
    with open(path) as handle:
        return json.load(handle)


class TraceError(Exception):
    """A trace file that cannot be replayed; the message names the file and the field."""


@dataclass
class Trace:
    path: Path
    config: EpisodeConfig
    ops: list[dict]
    findings: list[dict] = field(default_factory=list)
    campaign: str | None = None
    seed: int | None = None
    environment: dict[str, Any] | None = None


def load_trace(path: Path) -> Trace:
    """Read and check a trace file for replay or export; :class:`TraceError` if it is unusable."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file; expected a JSON trace") from None
    except json.JSONDecodeError as error:
        raise TraceError(f"{path}: invalid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None
    if not isinstance(data, dict):
        raise TraceError(f"{path}: expected a JSON object at the top level")
    if data.get("version") != TRACE_VERSION:
        raise TraceError(f"{path}: field 'version' is {data.get('version')!r}; this replayer reads version {TRACE_VERSION}")
    for name in ("config", "ops"):
        if name not in data:
            raise TraceError(f"{path}: missing field {name!r}")
    if not isinstance(data["config"], dict):
        raise TraceError(f"{path}: field 'config' must be an object")
    if not isinstance(data["ops"], list):
        raise TraceError(f"{path}: field 'ops' must be a list of op records")
    known = {f.name for f in dataclasses.fields(EpisodeConfig)}
    unknown = sorted(set(data["config"]) - known)
    if unknown:
        raise TraceError(f"{path}: field 'config.{unknown[0]}' is not a config field ({', '.join(sorted(known))})")
    for index, op in enumerate(data["ops"]):
        if not isinstance(op, dict) or op.get("op") not in OPS:
            name = op.get("op") if isinstance(op, dict) else op
            raise TraceError(f"{path}: field 'ops[{index}].op' is {name!r}; known ops: {', '.join(OPS)}")
    try:
        config = EpisodeConfig(**data["config"])
    except (TypeError, ValueError) as error:
        raise TraceError(f"{path}: field 'config': {error}") from None
    return Trace(
        path=path,
        config=config,
        ops=data["ops"],
        findings=data.get("findings") or [],
        campaign=data.get("campaign"),
        seed=data.get("seed"),
        environment=data.get("environment"),
    )
