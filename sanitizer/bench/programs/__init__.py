"""Engine-like torch programs with a planted race each, and their race-free twins.

Every module here is a plain torch script written the way vLLM writes engine code (pinned staging
written through numpy views, ``non_blocking=True`` copies, side streams, events, ``record_stream``)
on device ``"cuda"``. It imports nothing from this project, exposes ``main(steps=32)`` which checks
its own device results (``AssertionError`` when they are wrong), and runs as a script
(``python PATH --steps N``). :data:`PROGRAMS` says which are racy, what a sanitizer should report
for them, and which program is each one's twin.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HOST_WRITE = "host-write-vs-pending-copy"
DEVICE_ACCESS = "unordered-device-access"


@dataclass(frozen=True)
class Program:
    name: str  # module name in this package
    racy: bool
    hazard: str  # the kind a sanitizer should report (HOST_WRITE or DEVICE_ACCESS); "" for a twin
    twin: str  # the other program of the pair
    pattern: str  # the engine pattern, in one line


def _pair(racy: str, twin: str, hazard: str, pattern: str) -> tuple[Program, Program]:
    return Program(racy, True, hazard, twin, pattern), Program(twin, False, "", racy, pattern)


PROGRAMS: tuple[Program, ...] = (
    *_pair("block_table_one_buffer", "block_table_fresh_pinned", HOST_WRITE,
           "block-table staging through one pinned buffer (vLLM #48085; fix #48399)"),
    *_pair("pinned_ring_wrong_stream_event", "pinned_ring_copy_stream_event", HOST_WRITE,
           "ring of pinned buffers copied on a side stream, slot reuse gated by an event"),
    *_pair("async_sched_shared_input", "async_sched_double_buffer", HOST_WRITE,
           "async scheduling: next step's inputs staged while this step's copy is queued"),
    *_pair("kv_offload_shared_bounce", "kv_offload_bounce_event", HOST_WRITE,
           "KV reload from a CPU store through a pinned bounce buffer"),
    *_pair("side_stream_no_record_stream", "side_stream_record_stream", DEVICE_ACCESS,
           "main-stream tensor consumed on a side stream, then freed and its memory reused"),
    *_pair("cross_stream_no_wait", "cross_stream_wait_stream", DEVICE_ACCESS,
           "tensor written on the main stream and read on a side stream"),
)
BY_NAME: dict[str, Program] = {p.name: p for p in PROGRAMS}

# The fuzz campaigns' vLLM-style zeroers (examples/engine_zeroers.py), each driven by the plain
# engine loop of :mod:`sanitizer.bench.engine_loop`: a row named ``zeroer:FACTORY``.
ENGINE_ZEROERS = Path(__file__).resolve().parents[3] / "examples" / "engine_zeroers.py"
_ZEROER_PATTERN = "a vLLM-style zeroer driven by an engine loop on two streams"
ZEROERS: tuple[Program, ...] = (
    Program("zeroer:single_pinned_buffer", True, HOST_WRITE, "zeroer:fresh_pinned_per_call", _ZEROER_PATTERN),
    Program("zeroer:pinned_ring", True, HOST_WRITE, "zeroer:event_guarded_ring", _ZEROER_PATTERN),
    Program("zeroer:side_stream_copy_no_record", True, DEVICE_ACCESS, "zeroer:side_stream_copy", _ZEROER_PATTERN),
    Program("zeroer:side_stream_copy_event_on_caller", True, DEVICE_ACCESS, "zeroer:side_stream_copy",
            _ZEROER_PATTERN),
    Program("zeroer:fresh_pinned_per_call", False, "", "zeroer:single_pinned_buffer", _ZEROER_PATTERN),
    Program("zeroer:event_guarded_ring", False, "", "zeroer:pinned_ring", _ZEROER_PATTERN),
    Program("zeroer:side_stream_copy", False, "", "zeroer:side_stream_copy_no_record", _ZEROER_PATTERN),
)


def zeroer_spec(program: Program) -> str:
    """The ``file.py:factory`` spec a ``zeroer:`` row drives."""
    return f"{ENGINE_ZEROERS}:{program.name.removeprefix('zeroer:')}"


def script(program: Program, steps: int) -> list[str]:
    """What follows ``python`` to run ``program`` for ``steps`` steps."""
    if program.name.startswith("zeroer:"):
        return ["-m", "sanitizer.bench.engine_loop", "--zeroer", zeroer_spec(program), "--steps", str(steps)]
    return [str(path(program.name)), "--steps", str(steps)]


def load(name: str) -> ModuleType:
    """The program's module (``KeyError`` for a name not in :data:`PROGRAMS`)."""
    return importlib.import_module(f"{__name__}.{BY_NAME[name].name}")


def path(name: str) -> Path:
    """The program's source file, to run it as a script."""
    return Path(__file__).with_name(f"{BY_NAME[name].name}.py")
