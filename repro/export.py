"""``python -m repro export TRACE -o repro/NAME.py``: a trace as a script you can read and run.

The script is nanoGPT-shaped (STYLE.md, "repro scripts"): a docstring with where the finding came
from and the exact commands, a block of constants, then one straight line per op, in order, each
an op record handed to :class:`fuzz.engine.episode.Episode` (the executor the fuzzer and the replayer
use, so the script cannot drift from them). No Hypothesis. It keeps the exit-status convention of
every command here (:mod:`racecheck.cli`, through :func:`racecheck.cli.run_main`): 1 when the bug shows, 0
when it does not, 2 for a bad option or a zeroer that cannot run here, 3 for a bug of kvzero-fuzz,
each error one line on stderr and never a traceback (``--debug`` adds it), so that a script that
crashed can never pass for one that reproduced. It takes ``--backend``, ``--mode``, ``--repeat``
and ``--zeroer`` so the same steps run on a GPU or against a race-free design.

Comments on the ops (the block ids an ``allocate`` gets, the step a finding names) come from a
replay on the simulator during the export.

Example::

    text = render_script(load_trace(Path("repro/failures/ring-tiny-0123.json")), "repro/cases/ring_overrun.py")
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import keyword
import re
import textwrap
from pathlib import Path

from racecheck.environment import describe
from fuzz.engine.episode import Episode
from fuzz.trace import Trace

PROJECT_ROOT = Path(__file__).resolve().parents[1]  # the directory that holds fuzz/, zeroer/ and repro/


def _annotations(trace: Trace) -> dict[int, str]:
    """Per op index, a short comment from a replay on the simulator (best effort)."""
    notes: dict[int, str] = {}
    episode: Episode | None = None
    try:
        episode = Episode(dataclasses.replace(trace.config, backend="sim", device=None))
        for index, op in enumerate(trace.ops):
            result = episode.apply(op)
            if op["op"] == "allocate":
                notes[index] = f"zero_block_ids({result}) on stream {op.get('stream', 0)}"
            elif op["op"] in ("write", "read"):
                notes[index] = f"{op['op']} block {op['block']} on stream {op.get('stream', 0)}"
            elif op["op"] == "free":
                notes[index] = f"free block {op['block']}; its page is poisoned (NaN bytes)"
            elif op["op"] == "store":
                notes[index] = f"store block {op['block']} into host slot {result} on stream {op.get('stream', 0)}"
            elif op["op"] == "load":
                notes[index] = f"load host slot {op['slot']} into block {result} on stream {op.get('stream', 0)}"
            elif op["op"] == "poll":
                notes[index] = f"get_finished() -> jobs {result}"
            if episode.new_hazard_findings():
                notes[index] = notes.get(index, op["op"]) + "  <-- the happens-before checker fires here"
                break
    except Exception as error:  # a zeroer that cannot run here (e.g. cuda-only): no comments
        notes[-1] = f"(no step comments: replaying on the simulator failed: {error!r})"
    finally:
        if episode is not None:  # nothing judged here: its zeroer and runtime closed, whatever an op raised
            episode.abandon()
    return notes


def _dict_literal(name: str, value: dict | None) -> list[str]:
    if not value:
        return [f"{name} = None  # the trace did not record its environment"]
    return [f"{name} = {{"] + [f"    {k!r}: {v!r}," for k, v in sorted(value.items())] + ["}"]


def _headline(trace: Trace, title: str | None) -> str:
    config = trace.config
    if title:
        return title.rstrip(".") + "."
    kinds: dict[str, object] = {}
    for finding in trace.findings:
        kinds.setdefault(finding["kind"], finding.get("block"))
    found = "; ".join(k + (f" (block {b})" if b is not None else "") for k, b in kinds.items()) or "no recorded finding"
    return f"{config.offloader or config.zeroer} on {config.geometry}: {found}."


def _wrap(text: str, indent: str, width: int = 96) -> list[str]:
    """Whole words, lines shorter than ``width``."""
    return textwrap.wrap(" ".join(text.split()), width - 1, initial_indent=indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False)


def _root_line(output: str) -> str:
    """The line that puts the repository root on ``sys.path``. The script is run from the root, so
    for a script written inside it that is as many directories up as ``output`` lies below the
    current one (``repro/cases/x.py``: 2), and the script keeps working in another checkout. A
    script written elsewhere (``/tmp/race.py``) names this checkout's root by its absolute path:
    the directories above it say nothing about where kvzero-fuzz lies, and where it is not
    installed the script would stop at its first import (seen on the H200, running the suite
    from a copy of the tree)."""
    here = Path.cwd().resolve()
    try:
        parents = len((here / output).resolve().relative_to(here).parts) - 1
    except ValueError:
        return f"sys.path.insert(0, {str(PROJECT_ROOT)!r})  # the kvzero-fuzz checkout that exported it"
    return f"sys.path.insert(0, str(Path(__file__).resolve().parents[{parents}]))  # the repository root"


def render_script(trace: Trace, output: str, *, title: str | None = None, today: datetime.date | None = None) -> str:
    """The text of the standalone script for ``trace``, to be saved at ``output``."""
    config = trace.config
    offload = config.offloader is not None
    today = today or datetime.date.today()
    notes = _annotations(trace)
    run = f"python {output}"
    head = _wrap(_headline(trace, title), "")
    lines: list[str] = ["#!/usr/bin/env python3", f'"""{head[0]}', *head[1:], ""]
    lines += ["Provenance:"]
    lines += [f"  found by   campaign {trace.campaign or '?'}, Hypothesis seed {trace.seed if trace.seed is not None else '?'}"]
    backend = "the simulator" if config.backend == "sim" else f"cuda ({config.mode} mode)"
    lines += [f"  found on   {backend}: {describe(trace.environment)}"]
    lines += [f"  exported   {today.isoformat()} from {trace.path} by `python -m repro export`"]
    for finding in trace.findings[:3]:
        lines += _wrap(f"finding: {finding['message']}", "  ")
    lines += [
        "",
        "Run it from the repository root. Exit status: 1 when the bug shows, 0 when it does not, 2 for a",
        f"bad option or {'an offloader' if offload else 'a zeroer'} that cannot run here, 3 for a bug of kvzero-fuzz (one line on stderr;",
        "--debug adds the traceback).",
        f"    {run}                              # the CPU simulator",
        f"    {run} --backend cuda --repeat 20   # a GPU: gates force the recorded schedule",
        (f"    {run} --offloader FILE.py:factory  # the same steps on another offloader"
         if config.offloader else f"    {run} --zeroer per_call            # the same steps on a race-free design: exits 0"),
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import sys",
        "from pathlib import Path",
        "",
        _root_line(output),
        "",
        "from fuzz.cli import ArgumentParser, run_main  # noqa: E402",
        "from fuzz.environment import describe, environment  # noqa: E402",
        "from fuzz.engine.episode import CodeUnderTestRaised, Episode, EpisodeConfig  # noqa: E402",
        "",
        "# -- the episode, as found " + "-" * 70,
        f"ZEROER = {config.zeroer!r}" + ("  # the caller's own zeroer, which allocates the blocks the offloader moves"
                                         if offload else ""),
        f"GEOMETRY = {config.geometry!r}",
        f"BACKEND = {config.backend!r}  # sim or cuda; --backend overrides",
        f"MODE = {config.mode!r}  # cuda only: controlled (gates enforce the schedule) or free",
        f"KERNEL = {config.kernel!r}  # built-in staged designs: torch or triton (None: their default)",
        f"STREAMS = {config.streams!r}",
        f"CALLER_FAULT = {config.caller_fault!r}",
        *([f"OFFLOADER = {config.offloader!r}  # the offloader under test; --offloader overrides",
           f"HOST_MEMORY = {config.host_memory!r}  # its host pool: pinned or registered (cudaHostRegister)"]
          if offload else []),
        *(["WARMUP_SYNC = False  # the stricter caller: no synchronisation after the zeroer's warm-up"]
          if not config.warmup_sync else []),
        *_dict_literal("FOUND_ON", trace.environment),
        "",
        "",
        "def steps(episode: Episode) -> None:",
        '    """The ops in the order the fuzzer ran them (docs/trace-format.md says what each does)."""',
        "    op = episode.apply",
    ]
    if -1 in notes:
        lines.append(f"    # {notes[-1]}")
    for index, record in enumerate(trace.ops):
        call = f"    op({json.dumps(record)})"
        lines.append(call + (f"  # {notes[index]}" if index in notes else ""))
    lines += [
        "",
        "",
        "def run_once(config: EpisodeConfig) -> list:",
        '    """One episode of the steps, judged as the fuzzer and the replayer judge it (run_ops)."""',
        "    episode = Episode(config)  # a factory that raises: a usage error (exit status 2), not a finding",
        "    try:",
        "        steps(episode)",
        "        return episode.finish()  # one synchronisation, then the oracle checks every read and block",
        "    except CodeUnderTestRaised:  # the code under test raised: a finding, with those made before it",
        "        return list(episode.findings)",
        "    finally:",
        "        if not episode.finished:  # stopped by an error: still free the runtime (open every gate on cuda)",
        "            episode.abandon()",
        "",
        "",
        "def main(argv: list[str] | None = None) -> int:",
        '    """The exit status: 1 reproduced, 0 not, 2 a bad option or a zeroer that cannot run here, 3 a bug',
        '    of kvzero-fuzz; an error is one line on stderr (--debug adds the traceback)."""',
        "    return run_main(_main, argv, Path(__file__).name)",
        "",
        "",
        "def _main(argv: list[str]) -> int:",
        "    parser = ArgumentParser(description=__doc__.split('\\n\\n')[0])",
        "    parser.add_argument('--backend', choices=('sim', 'cuda'), default=BACKEND)",
        "    parser.add_argument('--mode', choices=('controlled', 'free'), default=MODE)",
        "    parser.add_argument('--repeat', type=int, default=1, help='run the steps N times and count')",
        "    parser.add_argument('--zeroer', default=ZEROER, help='another zeroer spec, e.g. a race-free design')",
        *(["    parser.add_argument('--offloader', default=OFFLOADER, help='another offloader spec, e.g. its race-free twin')"]
          if offload else []),
        "    args = parser.parse_args(argv)",
        "    if args.repeat < 1:",
        "        parser.error(f'--repeat {args.repeat} must be at least 1')",
        "    kernel = KERNEL if args.zeroer == ZEROER else None",
        "    config = EpisodeConfig(zeroer=args.zeroer, geometry=GEOMETRY, backend=args.backend, mode=args.mode,",
        "                           kernel=kernel, streams=STREAMS, caller_fault=CALLER_FAULT"
        + (", offloader=args.offloader,\n                           host_memory=HOST_MEMORY" if offload else "")
        + (", warmup_sync=WARMUP_SYNC" if not config.warmup_sync else "") + ")",
        "    print(f'found on: {describe(FOUND_ON)}')",
        "    print(f'running on: {describe(environment())}', flush=True)",
        "    shown, first = 0, []",
        "    for _ in range(args.repeat):",
        "        findings = run_once(config)",
        "        shown += bool(findings)",
        "        first = first or findings",
        "    for finding in first[:10]:",
        "        print(finding)",
        "    where = args.backend + (f' ({args.mode})' if args.backend == 'cuda' else '')",
        f"    print(f'{{args.{'offloader' if offload else 'zeroer'}}}: reproduced {{shown}} of {{args.repeat}} on {{where}}')",
        "    return 1 if shown else 0",
        "",
        "",
        "if __name__ == '__main__':",
        "    sys.exit(main())",
        "",
    ]
    return "\n".join(lines)


def check_output_name(output: Path) -> None:
    """The script is imported by nothing, but a module-safe name keeps `python -m` and tests easy."""
    stem = output.stem
    if output.suffix != ".py" or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", stem) or keyword.iskeyword(stem):
        raise ValueError(f"-o {output}: name the script like a Python module, e.g. repro/cases/ring_overrun.py")
