"""Reading a trace file for replay or export: one-line errors that name the file and the field.

Reading never runs code from the file: it checks the JSON and builds an
:class:`~fuzz.engine.episode.EpisodeConfig` and a list of op records. The only code a replay imports is
the zeroer factory that ``config.zeroer`` names.

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

from fuzz.engine.episode import OPS, EpisodeConfig
from fuzz.trace import TRACE_VERSION


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
