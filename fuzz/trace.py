"""Trace files read back for replay and export: every field checked, nothing run from the file.

Model. The trace format (what a trace holds, its version, its file name, how it is written) is the
engine's, :mod:`fuzz.engine.trace`: the engine writes what it finds. This module is the other
side, the commands' (``python -m repro``, the timeline, the examples benchmark): a trace file that
a user hands a command is input, not the engine's own output, so it is checked before anything is
built from it, and a file it cannot use is a usage error (exit status 2). It builds on the engine,
never the other way round.

:func:`load_trace` checks every field of the JSON (the config's types and values, every op record)
and builds an :class:`~fuzz.engine.episode.EpisodeConfig` and a list of op records; a file it
cannot use is a :class:`TraceError` whose one-line message names the file and the field. The only
code it imports is the zeroer factory that ``config.zeroer`` names, to check it.

Example::

    trace = load_trace(Path("repro/cases/single_buffer_pre_48085.json"))
    trace.config.zeroer, len(trace.ops)      # ('single_buffer', 3)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from racecheck.cli import UsageError
from fuzz.engine.episode import CALLER_FAULTS, MAX_ZEROERS, EpisodeConfig
from fuzz.engine.ops import OpError, check_op
from fuzz.engine.trace import TRACE_VERSION
from zeroer.cache.geometries import GEOMETRIES, LARGE_GEOMETRIES, geometry
from zeroer.designs.common import KERNELS
from zeroer.errors import ZeroerError
from zeroer.offload import HOST_MEMORY
from zeroer.registry import load_offloader, load_zeroer
from kvdevice.runtime import CUDA_MODES


class TraceError(UsageError):
    """A trace file that cannot be replayed; the message names the file and the field (exit 2)."""


@dataclass
class Trace:
    path: Path
    config: EpisodeConfig
    ops: list[dict]
    findings: list[dict] = field(default_factory=list)
    campaign: str | None = None
    seed: int | None = None
    environment: dict[str, Any] | None = None


# Optional top-level fields: (their types, what a message says they must be).
_TOP = {
    "campaign": ((str, type(None)), "a campaign id (string) or null"),
    "seed": ((int, type(None)), "an integer or null"),
    "findings": ((list, type(None)), "a list of finding objects"),
    "environment": ((dict, type(None)), "an object or null"),
}
# Config fields with a fixed set of values (None is JSON null).
_CHOICES = {
    "backend": ("sim", "cuda"),
    "mode": CUDA_MODES,
    "kernel": (None, *KERNELS),
    "caller_fault": (None, *CALLER_FAULTS),
    "host_memory": HOST_MEMORY,
    "warmup_sync": (True, False),
}


def load_trace(path: Path) -> Trace:
    """Read and check a trace file for replay or export; :class:`TraceError` if it is unusable.

    Every field is checked: the config's types and values (a known geometry, a zeroer spec that
    loads and supports that geometry and backend), and every op record (:func:`fuzz.engine.ops.check_op`,
    then its stream, cache and block against the config and the geometry).
    """
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text file; expected a JSON trace") from None
    except PermissionError:
        raise TraceError(f"{path}: permission denied; give a trace file you can read") from None
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
    for name, (types, what) in _TOP.items():
        value = data.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            raise TraceError(f"{path}: field {name!r} is {value!r}; it must be {what}")
    for index, finding in enumerate(data.get("findings") or []):
        if not isinstance(finding, dict) or not isinstance(finding.get("kind"), str):
            raise TraceError(f"{path}: field 'findings[{index}]' is {finding!r}; a finding is an object with a 'kind' string")
    config = _config(path, data["config"])
    for index, op in enumerate(data["ops"]):
        _check_op(path, index, op, config)
    return Trace(
        path=path,
        config=config,
        ops=data["ops"],
        findings=data.get("findings") or [],
        campaign=data.get("campaign"),
        seed=data.get("seed"),
        environment=data.get("environment"),
    )


def _config(path: Path, raw: dict[str, Any]) -> EpisodeConfig:
    """The trace's config, every field checked; missing fields take their defaults."""
    known = {f.name for f in dataclasses.fields(EpisodeConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TraceError(f"{path}: field 'config.{unknown[0]}' is not a config field ({', '.join(sorted(known))})")

    def bad(name: str, must: str) -> TraceError:
        return TraceError(f"{path}: field 'config.{name}' is {raw[name]!r}; {must}")

    for name, choices in _CHOICES.items():
        if name in raw and raw[name] not in choices:
            raise bad(name, "choose one of " + ", ".join("null" if c is None else c for c in choices))
    for name, low, high in (("streams", 1, 8), ("zeroers", 1, MAX_ZEROERS), ("device", 0, None)):
        value = raw.get(name)
        if name in raw and not (name == "device" and value is None) and (
                isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high)):
            raise bad(name, f"it must be an integer from {low} to {high}" if high else f"it must be null or an integer >= {low}")
    presets = sorted({*GEOMETRIES, *LARGE_GEOMETRIES})
    if "geometry" in raw and raw["geometry"] not in presets:
        raise bad("geometry", f"known geometries: {', '.join(presets)}")
    if "zeroer" in raw and (not isinstance(raw["zeroer"], str) or not raw["zeroer"]):
        raise bad("zeroer", "give a built-in name, 'module:attr' or 'path/to/file.py:attr'")
    if raw.get("offloader") is not None and (not isinstance(raw["offloader"], str) or ":" not in raw["offloader"]):
        raise bad("offloader", "give null or 'module:attr' or 'path/to/file.py:attr' naming an offloader factory")
    if raw.get("offloader") is not None and raw.get("zeroers", 1) != 1:
        raise bad("zeroers", "an offload trace (config.offloader set) holds one KV cache: 1")
    try:
        config = EpisodeConfig(**raw)
    except ValueError as error:  # what the checks above do not repeat: a component kind's own options
        raise TraceError(f"{path}: field 'config': {error}") from None
    try:
        capabilities = load_zeroer(config.zeroer).capabilities
    except ZeroerError as error:
        raise TraceError(f"{path}: field 'config.zeroer': {error}") from None
    if config.offloader is not None:
        try:
            offloader = load_offloader(config.offloader).capabilities
        except ZeroerError as error:
            raise TraceError(f"{path}: field 'config.offloader': {error}") from None
        if not offloader.supports_geometry(config.geometry) or not offloader.runs_on(config.backend):
            raise TraceError(f"{path}: field 'config.offloader': offloader {config.offloader!r} does not run on "
                             f"geometry {config.geometry!r} and backend {config.backend!r} (its OffloaderCapabilities)")
    if not capabilities.supports_geometry(config.geometry):
        raise TraceError(f"{path}: field 'config.geometry' is {config.geometry!r}; zeroer {config.zeroer!r} "
                         f"supports only {', '.join(capabilities.geometries or ())}")
    if not capabilities.runs_on(config.backend):
        raise TraceError(f"{path}: field 'config.backend' is {config.backend!r}; zeroer {config.zeroer!r} "
                         f"runs on {', '.join(capabilities.backends)} only")
    return config


def _check_op(path: Path, index: int, op: object, config: EpisodeConfig) -> None:
    """One op record: its fields (:func:`check_op`), then its indices against the config."""
    try:
        _, args = check_op(op)
    except OpError as error:
        where = f"ops[{index}]" + (f".{error.field}" if error.field else "")
        raise TraceError(f"{path}: field {where!r} {error.problem}") from None
    blocks = geometry(config.geometry).num_blocks
    bounds = {  # field -> (lowest, highest or None, what the range comes from)
        "stream": (0, config.streams - 1, f"config.streams is {config.streams}"),
        "cache": (0, config.zeroers - 1, f"config.zeroers is {config.zeroers}"),
        "block": (0, blocks - 1, f"geometry {config.geometry!r} has {blocks} blocks"),
        "slot": (1, blocks - 1, f"the host pool of geometry {config.geometry!r} has slots 1..{blocks - 1}"),
        "n": (1, blocks - 1, f"geometry {config.geometry!r} has {blocks - 1} blocks to hand out"),
        "in_flight": (1, 8, "steps in flight"),
        "ops": (0, None, "ops to run"),
        "amount": (1, None, "delay units"),
    }
    for name, value in args.items():
        if name in bounds:
            low, high, why = bounds[name]
            if value < low or (high is not None and value > high):
                valid = f"{low}..{high}" if high is not None else f">= {low}"
                raise TraceError(f"{path}: field 'ops[{index}].{name}' is {value}; it must be {valid} ({why})")
