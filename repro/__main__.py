"""``python -m repro replay TRACE [--backend sim|cuda] [--mode controlled|free] [--repeat N]``.

Replays a trace written by the fuzzer through the same executor the fuzzer used
(:class:`fuzz.episode.Episode`), prints the findings and exits 1 when the bug shows, 0 when it
does not, 2 on a bad trace file. Replaying executes nothing from the trace but the ops it lists;
the only code it imports is the zeroer factory the trace names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from fuzz.episode import OPS, Episode, EpisodeConfig
from fuzz.trace import TRACE_VERSION


class TraceError(Exception):
    """A trace file that cannot be replayed; the message names the file and the field."""


def load(path: Path) -> tuple[EpisodeConfig, list[dict]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except json.JSONDecodeError as error:
        raise TraceError(f"{path}: invalid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None
    if not isinstance(data, dict):
        raise TraceError(f"{path}: expected a JSON object at the top level")
    if data.get("version") != TRACE_VERSION:
        raise TraceError(f"{path}: field 'version' is {data.get('version')!r}; this replayer reads version {TRACE_VERSION}")
    for field in ("config", "ops"):
        if field not in data:
            raise TraceError(f"{path}: missing field {field!r}")
    known = {f.name for f in dataclasses.fields(EpisodeConfig)}
    unknown = sorted(set(data["config"]) - known)
    if unknown:
        raise TraceError(f"{path}: field 'config.{unknown[0]}' is not a config field ({', '.join(sorted(known))})")
    for index, op in enumerate(data["ops"]):
        if not isinstance(op, dict) or op.get("op") not in OPS:
            name = op.get("op") if isinstance(op, dict) else op
            raise TraceError(f"{path}: field 'ops[{index}].op' is {name!r}; known ops: {', '.join(OPS)}")
    return EpisodeConfig(**data["config"]), data["ops"]


def replay_once(config: EpisodeConfig, ops: list[dict]) -> list:
    episode = Episode(config)
    for op in ops:
        episode.apply(op)
        if episode.new_hazard_findings():
            break
    return episode.finish()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repro", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    replay = sub.add_parser("replay", help="replay a trace file")
    replay.add_argument("trace", type=Path)
    replay.add_argument("--backend", choices=("sim", "cuda"), default=None, help="default: the trace's backend")
    replay.add_argument("--mode", choices=("controlled", "free"), default=None)
    replay.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        config, ops = load(args.trace)
    except TraceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print(f"error: --repeat {args.repeat} must be at least 1", file=sys.stderr)
        return 2
    changes = {k: v for k, v in (("backend", args.backend), ("mode", args.mode)) if v is not None}
    config = dataclasses.replace(config, **changes)
    shown = 0
    first: list = []
    for _ in range(args.repeat):
        findings = replay_once(config, ops)
        if findings:
            shown += 1
            first = first or findings
    for finding in first[:10]:
        print(finding)
    print(f"reproduced {shown} of {args.repeat} on {config.backend}" + (f" ({config.mode})" if config.backend == "cuda" else ""))
    return 1 if shown else 0


if __name__ == "__main__":
    sys.exit(main())
