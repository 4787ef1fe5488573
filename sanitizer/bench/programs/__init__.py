"""Engine-like torch programs with a planted race each, and their race-free twins.

Every module here is a plain torch script written the way vLLM writes engine code (pinned staging
written through numpy views, ``non_blocking=True`` copies, side streams, events, ``record_stream``)
on device ``"cuda"``. It imports nothing from this project, exposes ``main(steps=32)`` which checks
its own device results (``AssertionError`` when they are wrong), and runs as a script
(``python PATH --steps N``). :data:`PROGRAMS` says which are racy, what a sanitizer should report
for them, and which program is each one's twin; :func:`marked_lines` reads the two lines a racy
program marks as its race (``# race: queued`` and ``# race: later``). The engines' own races, one
program per upstream bug, are :mod:`sanitizer.bench.corpus`.
"""

from __future__ import annotations

import importlib
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HOST_WRITE = "host-write-vs-pending-copy"
HOST_READ = "host-read-vs-pending-copy"
DEVICE_ACCESS = "unordered-device-access"
REUSE = "reuse-without-record-stream"

# A racy program marks the two lines of its race with trailing comments: ``# race: queued`` on the
# line that queues the op the race is with, ``# race: later`` on the access that may overtake it.
MARKER = re.compile(r"#\s*race:\s*(queued|later)\b")
# A file of several racy factories (the ``zeroer:`` rows) names the factory in each marker, and one
# comment may hold several: ``# race[single_pinned_buffer]: queued``.
FACTORY_MARKER = re.compile(r"\brace\[(\w+)\]:\s*(queued|later)\b")


@dataclass(frozen=True)
class Program:
    name: str  # module name in this package
    racy: bool
    hazard: str  # the kind a sanitizer should report (HOST_WRITE, HOST_READ, DEVICE_ACCESS, REUSE); "" for a twin
    twin: str  # the other program of the pair
    pattern: str  # the engine pattern, in one line
    upstream: str = ""  # the upstream reference, e.g. "vLLM #36013" ("" for a pattern with none)
    collection: str = "programs"  # "programs" (this package), "corpus" (sanitizer.bench.corpus) or "zeroer"

    @property
    def sleeps(self) -> bool:
        """Whether it takes ``--sleep`` (forced delays: the GPU ground truth of the corpus)."""
        return self.collection == "corpus"


def pair(racy: str, twin: str, hazard: str, pattern: str, upstream: str = "",
         collection: str = "programs") -> tuple[Program, Program]:
    """A racy program and its race-free twin, each naming the other."""
    return (Program(racy, True, hazard, twin, pattern, upstream, collection),
            Program(twin, False, "", racy, pattern, upstream, collection))


PROGRAMS: tuple[Program, ...] = (
    *pair("block_table_one_buffer", "block_table_fresh_pinned", HOST_WRITE,
          "block-table staging through one pinned buffer (vLLM #48085; fix #48399)"),
    *pair("pinned_ring_wrong_stream_event", "pinned_ring_copy_stream_event", HOST_WRITE,
          "ring of pinned buffers copied on a side stream, slot reuse gated by an event"),
    *pair("async_sched_shared_input", "async_sched_double_buffer", HOST_WRITE,
          "async scheduling: next step's inputs staged while this step's copy is queued"),
    *pair("kv_offload_shared_bounce", "kv_offload_bounce_event", HOST_WRITE,
          "KV reload from a CPU store through a pinned bounce buffer"),
    *pair("side_stream_no_record_stream", "side_stream_record_stream", REUSE,
          "main-stream tensor consumed on a side stream, then freed and its memory reused"),
    *pair("cross_stream_no_wait", "cross_stream_wait_stream", DEVICE_ACCESS,
          "tensor written on the main stream and read on a side stream"),
)
BY_NAME: dict[str, Program] = {p.name: p for p in PROGRAMS}

# The fuzz campaigns' vLLM-style zeroers (examples/engine_zeroers.py), each driven by the plain
# engine loop of :mod:`zeroer.engine_loop`: a row named ``zeroer:FACTORY``.
ENGINE_ZEROERS = Path(__file__).resolve().parents[3] / "examples" / "engine_zeroers.py"
_ZEROER_PATTERN = "a vLLM-style zeroer driven by an engine loop on two streams"


def _zeroer(factory: str, racy: bool, hazard: str, twin: str) -> Program:
    return Program(f"zeroer:{factory}", racy, hazard, f"zeroer:{twin}", _ZEROER_PATTERN, collection="zeroer")


ZEROERS: tuple[Program, ...] = (
    _zeroer("single_pinned_buffer", True, HOST_WRITE, "fresh_pinned_per_call"),
    _zeroer("pinned_ring", True, HOST_WRITE, "event_guarded_ring"),
    _zeroer("side_stream_copy_no_record", True, REUSE, "side_stream_copy"),
    _zeroer("side_stream_copy_event_on_caller", True, DEVICE_ACCESS, "side_stream_copy"),
    _zeroer("fresh_pinned_per_call", False, "", "single_pinned_buffer"),
    _zeroer("event_guarded_ring", False, "", "pinned_ring"),
    _zeroer("side_stream_copy", False, "", "side_stream_copy_no_record"),
)


def source(program: Program) -> Path:
    """The file of ``program``'s code: its module, or the example zeroers for a ``zeroer:`` row."""
    if program.collection == "zeroer":
        return ENGINE_ZEROERS
    return Path(__file__).resolve().parent.parent / program.collection / f"{program.name}.py"


def race_lines(program: Program) -> dict[str, int]:
    """The two lines of a racy ``program``'s race in :func:`source` (:func:`marked_lines`; a
    ``zeroer:`` row's are marked with its factory's name)."""
    factory = program.name.removeprefix("zeroer:") if program.collection == "zeroer" else None
    return marked_lines(source(program), factory)


def zeroer_spec(program: Program) -> str:
    """The ``file.py:factory`` spec a ``zeroer:`` row drives."""
    return f"{ENGINE_ZEROERS}:{program.name.removeprefix('zeroer:')}"


def script(program: Program, steps: int, sleep: bool = False) -> list[str]:
    """What follows ``python`` to run ``program`` for ``steps`` steps (with its forced delays if
    ``sleep``, which only the corpus takes)."""
    if program.collection == "zeroer":
        return ["-m", "zeroer.engine_loop", "--zeroer", zeroer_spec(program), "--steps", str(steps)]
    return [str(source(program)), "--steps", str(steps), *(["--sleep"] if sleep and program.sleeps else [])]


def load(name: str) -> ModuleType:
    """The program's module (``KeyError`` for a name not in :data:`PROGRAMS`)."""
    return importlib.import_module(f"{__name__}.{BY_NAME[name].name}")


def path(name: str) -> Path:
    """The program's source file, to run it as a script."""
    return Path(__file__).with_name(f"{BY_NAME[name].name}.py")


def marked_lines(path: Path, factory: str | None = None) -> dict[str, int]:
    """The lines a racy program marks as its race: ``{"queued": line, "later": line}`` (1-based).

    ``queued`` is the line with a ``# race: queued`` comment (the op the race is with), ``later``
    the line with ``# race: later`` (the access that may overtake it); with ``factory``, the lines
    marked ``race[factory]: queued`` and ``race[factory]: later`` in a file of several factories.
    Only comments count, not text in strings or docstrings. ``ValueError`` naming the file when a
    marker is missing or appears more than once.
    """
    path = Path(path)
    found: dict[str, list[int]] = {"queued": [], "later": []}
    with tokenize.open(path) as source:
        text = source.read()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            if factory is None:
                marks = [m.group(1) for m in MARKER.finditer(token.string)]
            else:
                marks = [m.group(2) for m in FACTORY_MARKER.finditer(token.string) if m.group(1) == factory]
            for which in marks:
                found[which].append(token.start[0])
    label = "# race" if factory is None else f"race[{factory}]"
    problems = [f"no '{label}: {which}' marker" if not lines else
                f"'{label}: {which}' on {len(lines)} lines ({', '.join(map(str, lines))})"
                for which, lines in found.items() if len(lines) != 1]
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}")
    return {which: lines[0] for which, lines in found.items()}
