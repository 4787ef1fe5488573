"""Every bad input of every command: its exit status and its one line, as docs/bad-input.md lists them.

The convention (racecheck/cli.py): 0 clean, 1 a finding, 2 a usage or input error (ONE line naming the
value and the fix, no traceback), 3 a bug in the tool. Each row of :data:`ROWS` is one test and
one line of the table in docs/bad-input.md; :func:`test_the_table_lists_every_row` keeps the two
in step, and ``python tests/test_bad_input.py`` prints the table to paste there.

Commands run in this process through their ``main()`` (fast); ``pytest`` rows run in one helper
process per xdist worker (``--serve``: ``pytest.main`` once per row, so torch is imported once,
with ``-q``, without xdist, and with the summary and example database in a temporary directory),
and one row runs as a real subprocess to check the ``python -m`` wiring. In a command,
``bad.json`` is a file the row writes (``input``) in a temporary directory, ``out`` an empty
temporary directory; commands run from the repository root.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from racecheck.cli import ArgumentParser, run_main

ROOT = Path(__file__).resolve().parent.parent
BASE = "repro/cases/ring_overrun.json"  # the trace the trace rows edit
TABLE = ROOT / "docs" / "bad-input.md"
MAINS = {  # command -> the module whose main(argv) it runs
    "python -m repro": "repro.__main__",
    "python -m fuzz.bench.detect.baselines": "fuzz.bench.detect.baselines",
    "python -m fuzz.bench.detect": "fuzz.bench.detect.cli",
    "python -m fuzz.bench.kernel.scatter": "fuzz.bench.kernel.scatter",
    "python -m fuzz.bench.kernel": "fuzz.bench.kernel.cli",
    "python -m fuzz.bench.speed": "fuzz.bench.speed",
    "python -m fuzz.bench.intercept": "fuzz.bench.intercept",
    "python -m fuzz.bench.selfcheck": "fuzz.bench.selfcheck",
    "python -m fuzz.bench.examples": "fuzz.bench.examples",
    "python -m fuzz.merge": "fuzz.merge",
    "python -m sanitizer": "sanitizer.__main__",
    "python -m sanitizer.bench.compare": "sanitizer.bench.compare",
}
ZEROERS = "event_ring, graph_ring, per_call, reference, ring, single_buffer, torch_per_call, zoo.captured_stream"
UNKNOWN_ZEROER = f"unknown zeroer 'nope'; use a built-in name ({ZEROERS}, ..."
NO_GPU = not torch.cuda.is_available()


@dataclass(frozen=True)
class Row:
    """One bad input: the command as typed, what ``bad.json`` holds, the status and the line.

    ``message`` is the line exactly (after ``bad.json`` and ``out`` become the real paths); a
    trailing `` ...`` stands for the rest of a long list of names.
    """

    command: str
    status: int
    message: str
    edits: dict[str, Any] | None = None  # bad.json = BASE with these fields set ("ops[1].n": "a")
    text: str | None = None  # bad.json holds this text instead
    needs_no_gpu: bool = False  # the row shows what happens without a GPU
    subprocess: bool = False  # run as `python -m ...` rather than through main()
    trace_details: str | None = None  # a finding row: the trace written under out has this in its details

    @property
    def input(self) -> str:
        if self.edits == {}:
            return f"`{Path(BASE).name}` as it is"
        if self.edits is not None:
            return f"`{Path(BASE).name}` with " + ", ".join(f"`{k}` = `{json.dumps(v)}`" for k, v in self.edits.items())
        if self.text is not None:
            return f"`{self.text}`"
        return "(absent)" if "bad.json" in self.command else ""


def trace_row(edits: dict[str, Any], message: str, *, command: str = "python -m repro replay bad.json", status: int = 2,
              **kw: Any) -> Row:
    return Row(command, status, message, edits=edits, **kw)


ROWS: list[Row] = [
    # -- python -m repro: trace files ---------------------------------------------------------------------
    Row("python -m repro replay bad.json", 2, "error: bad.json: no such file"),
    Row("python -m repro replay bad.json", 2, "error: bad.json: invalid JSON at line 1 column 2: "
        "Expecting property name enclosed in double quotes", text="{"),
    trace_row({"version": 7}, "error: bad.json: field 'version' is 7; this replayer reads version 1"),
    trace_row({"config.colour": 1}, "error: bad.json: field 'config.colour' is not a config field (backend, caller_fault, "
              "device, geometry, host_memory, kernel, mode, offloader, streams, warmup_sync, zeroer, zeroers)"),
    trace_row({"config.offloader": "nope"}, "error: bad.json: field 'config.offloader' is 'nope'; give null or "
              "'module:attr' or 'path/to/file.py:attr' naming an offloader factory"),
    trace_row({"config.host_memory": "paged"}, "error: bad.json: field 'config.host_memory' is 'paged'; choose one of "
              "pinned, registered"),
    trace_row({"config.zeroer": "nope"}, f"error: bad.json: field 'config.zeroer': {UNKNOWN_ZEROER}"),
    trace_row({"config.zeroer": "tests/bad_zeroers.py:nothing_here"}, "error: bad.json: field 'config.zeroer': zeroer "
              "'tests/bad_zeroers.py:nothing_here': 'tests/bad_zeroers.py' has no attribute 'nothing_here'"),
    trace_row({"config.zeroer": "tests/bad_zeroers.py:raising_factory"}, "python -m repro: the zeroer factory "
              "'tests/bad_zeroers.py:raising_factory' raised at tests/bad_zeroers.py:28 (raise RuntimeError(\"planted: this "
              "factory cannot build a zeroer\")): RuntimeError: planted: this factory cannot build a zeroer; it built no "
              "zeroer, so nothing was fuzzed and this is not a finding: fix the factory so that raising_factory(cache, "
              "runtime) returns the zeroer"),
    trace_row({"config.geometry": "huge"}, "error: bad.json: field 'config.geometry' is 'huge'; known geometries: "
              "block_outer_fp8, int32_wrap, kv_outer_bf16, mixed_dtypes, mla_indexer, packed, ratio2, shared_layers, tiny"),
    trace_row({"config.backend": "tpu"}, "error: bad.json: field 'config.backend' is 'tpu'; choose one of sim, cuda"),
    trace_row({"config.mode": "fast"}, "error: bad.json: field 'config.mode' is 'fast'; choose one of controlled, free"),
    trace_row({"config.kernel": "cuda"}, "error: bad.json: field 'config.kernel' is 'cuda'; choose one of null, torch, triton"),
    trace_row({"config.streams": "3"}, "error: bad.json: field 'config.streams' is '3'; it must be an integer from 1 to 8"),
    trace_row({"config.zeroers": 9}, "error: bad.json: field 'config.zeroers' is 9; it must be an integer from 1 to 4"),
    trace_row({"config.caller_fault": "no-fence"}, "error: bad.json: field 'config.caller_fault' is 'no-fence'; "
              "choose one of null, no-free-fence, no-zero-wait"),
    trace_row({"config.zeroer": "zoo.int32_offset_4gib"}, "error: bad.json: field 'config.backend' is 'sim'; "
              "zeroer 'zoo.int32_offset_4gib' runs on cuda only"),
    trace_row({"ops[1].n": "a"}, "error: bad.json: field 'ops[1].n' is 'a'; it must be an integer"),
    trace_row({"ops[1].op": "explode"}, "error: bad.json: field 'ops[1].op' is 'explode'; known ops: advance, advance_own, allocate, "
              "delay, end_step, evict, free, load, poll, read, reallocate, start, store, sync_device, sync_stream, wait, write"),
    trace_row({"ops[2].m": 1}, "error: bad.json: field 'ops[2].m' is not a field of op 'allocate' (its fields are: n, "
              "stream, cache, ids_as, then)"),
    trace_row({"ops[1].ids_as": "set"}, "error: bad.json: field 'ops[1].ids_as' is 'set'; choose one of list, tuple, array, tensor"),
    trace_row({"ops[1].stream": 9}, "error: bad.json: field 'ops[1].stream' is 9; it must be 0..2 (config.streams is 3)"),
    trace_row({"ops[1].n": 0}, "error: bad.json: field 'ops[1].n' is 0; it must be 1..7 (geometry 'tiny' has 7 blocks to hand out)"),
    trace_row({"ops[0].in_flight": 0}, "error: bad.json: field 'ops[0].in_flight' is 0; it must be 1..8 (steps in flight)"),
    trace_row({"config.zeroer": "per_call", "ops[4]": {"op": "write", "block": 5}}, "error: bad.json: field 'ops': not a valid program: write block 5: "
              "it is free, not live"),
    trace_row({"config.backend": "cuda"}, "error: bad.json was recorded on cuda and needs a CUDA GPU, and none is visible "
              "here; replay on the simulator with --backend sim", needs_no_gpu=True),
    trace_row({}, "error: --backend cuda needs a CUDA GPU, and none is visible here; replay on the simulator with --backend sim",
              command="python -m repro replay bad.json --backend cuda", needs_no_gpu=True),
    trace_row({}, "python -m repro replay: error: argument --backend: invalid choice: 'tpu' (choose from 'sim', 'cuda')",
              command="python -m repro replay bad.json --backend tpu"),
    trace_row({}, "error: --repeat 0 must be at least 1", command="python -m repro replay bad.json --repeat 0"),
    trace_row({}, "python -m repro replay: error: argument --repeat: invalid int value: 'x'",
              command="python -m repro replay bad.json --repeat x"),
    Row("python -m repro", 2, "python -m repro: error: the following arguments are required: command"),
    trace_row({"ops[3]": 5}, "error: bad.json: field 'ops[3]' is 5; an op record is a JSON object such as "
              "{'op': 'allocate', 'n': 1}", subprocess=True),
    # -- python -m repro: export, regenerate, timeline ---------------------------------------------------------
    trace_row({}, "error: -o my-case.py: name the script like a Python module, e.g. repro/cases/ring_overrun.py",
              command="python -m repro export bad.json -o my-case.py"),
    trace_row({}, "error: -o 'README.md/x.py': 'README.md' is a file, not a directory; give a file path you can write to",
              command="python -m repro export bad.json -o README.md/x.py"),
    Row("python -m repro regenerate nope-tiny-sim-shard0 --seed 1 --repro-dir out/", 2,
        "error: unknown campaign 'nope-tiny-sim-shard0' (a campaign of an outside zeroer also needs --zeroer SPEC, an "
        "offloader's --offloader SPEC); "
        "`pytest fuzz --collect-only -q` lists them"),
    Row("python -m repro regenerate ring-tiny-sim-k-torch-shard0 --seed 1 --profile weekly --repro-dir out/", 2,
        "error: unknown profile 'weekly'; choose one of quick, ci, nightly"),
    Row("python -m repro regenerate --summary bad.json --repro-dir out/", 2,
        "error: bad.json: field 'totals.profile' is 'weekly'; choose one of quick, ci, nightly",
        text='{"totals": {"profile": "weekly"}, "campaigns": []}'),
    Row("python -m repro regenerate --summary bad.json --repro-dir README.md/x", 2,
        "error: --repro-dir 'README.md/x': cannot write there (Not a directory); give a directory you can write to"),
    Row("python -m repro timeline bad.json", 2, "error: bad.json: no such file"),
    # -- python -m fuzz.bench.detect ------------------------------------------------------------------------
    Row("python -m fuzz.bench.detect --budget 0", 2, "error: --budget 0 must be positive; give seconds per entry and seed, e.g. 60"),
    Row("python -m fuzz.bench.detect --budget inf", 2, "error: --budget inf must be positive; give seconds per entry and seed, e.g. 60"),
    Row("python -m fuzz.bench.detect --budget abc", 2, "error: --budget 'abc' is not a number of seconds; give a positive number, e.g. 60"),
    Row("python -m fuzz.bench.detect --seeds 0", 2, "error: --seeds '0' must be a positive integer, e.g. 5"),
    Row("python -m fuzz.bench.detect --entries zoo.nope", 2, "error: --entries: unknown entry 'zoo.nope'; choose from: event_ring, ..."),
    Row("python -m fuzz.bench.detect --backend cuda", 2,
        "error: --backend cuda needs a CUDA GPU and none is visible here; use --backend sim", needs_no_gpu=True),
    Row("python -m fuzz.bench.detect --mode fast", 2,
        "error: --mode 'fast' is not a cuda mode; choose controlled (gates) or free (real timing)"),
    Row("python -m fuzz.bench.detect --json README.md/r.json", 2,
        "error: --json 'README.md/r.json': 'README.md' is a file, not a directory; give a file path you can write to"),
    Row("python -m fuzz.bench.detect plot bad.json --png out/r.png", 2,
        "error: bad.json is a 'clean-soak' report; only detection reports have times to plot", text='{"kind": "clean-soak"}'),
    Row("python -m fuzz.bench.detect plot bad.json", 2,
        "error: usage: python -m fuzz.bench.detect plot REPORT.json --png FILE (got: bad.json)"),
    # -- python -m fuzz.merge -----------------------------------------------------------------------------------
    Row("python -m fuzz.merge bad.json", 2, "error: bad.json: not a fuzz summary (expected totals, campaigns, crashed "
        "and not_run, as pytest fuzz --fuzz-summary writes)", text="{}"),
    Row("python -m fuzz.merge bad.json bad.json", 2, "error: campaign 'ring-tiny-sim-k-torch-shard0' is twice in bad.json: "
        "a campaign belongs to one shard (shards of different --fuzz-shard i/N, or one summary given twice?)",
        text='{"totals": {"profile": "ci"}, "campaigns": [], "crashed": ["ring-tiny-sim-k-torch-shard0"], "not_run": []}'),
    Row("python -m fuzz.merge bad.json --junit README.md/j.xml", 2,
        "error: --junit 'README.md/j.xml': 'README.md' is a file, not a directory; give a file path you can write to",
        text="{}"),
    # -- python -m fuzz.bench.detect.baselines ----------------------------------------------------------------
    Row("python -m fuzz.bench.detect.baselines nope", 2, "python -m fuzz.bench.detect.baselines: error: unknown baseline "
        "method 'nope'; choose one of: handwritten, sanitizer, stress"),
    Row("python -m fuzz.bench.detect.baselines stress --budget nan", 2, "python -m fuzz.bench.detect.baselines: error: "
        "budget_s=nan must be a positive, finite number of seconds (e.g. 10)"),
    Row("python -m fuzz.bench.detect.baselines stress --zeroer nope", 2,
        f"python -m fuzz.bench.detect.baselines: error: {UNKNOWN_ZEROER}"),
    Row("python -m fuzz.bench.detect.baselines stress --geometry huge", 2, "python -m fuzz.bench.detect.baselines: error: "
        "geometry 'huge' does not exist; use one of block_outer_fp8, kv_outer_bf16, mixed_dtypes, mla_indexer, packed, "
        "ratio2, shared_layers, tiny"),
    Row("python -m fuzz.bench.detect.baselines sanitizer", 2, "python -m fuzz.bench.detect.baselines: error: the sanitizer "
        "method runs on cuda and needs a CUDA GPU, and none is visible here; use --backend sim with stress or handwritten",
        needs_no_gpu=True),
    # -- python -m fuzz.bench.kernel and .scatter -----------------------------------------------------------
    Row("python -m fuzz.bench.kernel", 2, "python -m fuzz.bench.kernel: error: no CUDA GPU here (torch.cuda.is_available() "
        "is False) and the full benchmark measures a GPU; run python -m fuzz.bench.kernel --quick for the CPU smoke test",
        needs_no_gpu=True),
    Row("python -m fuzz.bench.kernel --quick --max-seconds inf", 2, "python -m fuzz.bench.kernel: error: argument "
        "--max-seconds: 'inf' is not a positive number of seconds, e.g. --max-seconds 240"),
    Row("python -m fuzz.bench.kernel --quick --geometry gpt2", 2, "python -m fuzz.bench.kernel: error: argument --geometry: "
        "unknown geometry 'gpt2'; choose from llama, hybrid, mla, e.g. --geometry llama,hybrid"),
    Row("python -m fuzz.bench.kernel --quick --json README.md/k.json", 2,
        "error: --json 'README.md/k.json': 'README.md' is a file, not a directory; give a file path you can write to"),
    Row("python -m fuzz.bench.kernel plot bad.json --png-dir out/", 2, "python -m fuzz.bench.kernel plot: error: 'bad.json' "
        "is not a fuzz.bench.kernel result (no \"schema\": ...", text="{}"),
    Row("python -m fuzz.bench.kernel.scatter --quick --blocks 0", 2, "python -m fuzz.bench.kernel.scatter: error: argument "
        "--blocks: 0 is not a positive count; give positive ints separated by commas, e.g. --blocks 1,16,256"),
    Row("python -m fuzz.bench.kernel.scatter --quick --json out/", 2,
        "error: --json 'out' is a directory; give a file path, e.g. out/out.json"),
    # -- python -m fuzz.bench.examples ---------------------------------------------------------------------------
    Row("python -m fuzz.bench.examples nope.py", 2, "error: 'nope.py' is not a Python file; give a file of zeroer "
        "factories, e.g. examples/engine_zeroers.py"),
    Row("python -m fuzz.bench.examples tests/bad_zeroers.py", 2, "error: tests/bad_zeroers.py has no VERDICTS dict; add "
        "one naming each factory's verdict, e.g. VERDICTS = {'my_factory': 'race-free'}"),
    Row("python -m fuzz.bench.examples --geometry huge", 2, "error: --geometry 'huge': 'huge' is not a geometry; choose "
        "from block_outer_fp8, int32_wrap, kv_outer_bf16, mixed_dtypes, mla_indexer, packed, ratio2, shared_layers, tiny"),
    Row("python -m fuzz.bench.examples --replays 0", 2, "python -m fuzz.bench.examples: error: argument --replays: '0' is "
        "not a positive number of replays, e.g. 20"),
    Row("python -m fuzz.bench.examples --soak-steps -5", 2, "error: --soak-steps -5 must be 0 or more"),
    Row("python -m fuzz.bench.examples --json README.md/x.json", 2, "error: --json 'README.md/x.json': 'README.md' is a "
        "file, not a directory; give a file path you can write to"),
    Row("python -m fuzz.bench.examples --backend cuda", 2, "error: --backend cuda needs a CUDA GPU and none is visible "
        "here; use --backend sim", needs_no_gpu=True),
    # -- python -m sanitizer and its benchmark --------------------------------------------------------------
    Row("python -m sanitizer --backend sim", 2,
        "error: no program given; e.g. python -m sanitizer -- python my_script.py"),
    Row("python -m sanitizer --backend sim -- python nope.py", 2, "error: program 'nope.py' is not a file; give the "
        "path of a Python script, e.g. python -m sanitizer -- python my_script.py"),
    Row("python -m sanitizer --backend sim -- python -m", 2,
        "error: -m needs a module name; e.g. python -m sanitizer -- python -m my_pkg.bench"),
    Row("python -m sanitizer --backend sim -- python -X dev", 2,
        "error: python option '-X' is not supported here; give a script path or -m MODULE"),
    Row("python -m sanitizer --json README.md/x.json -- python nope.py", 2, "error: --json 'README.md/x.json': "
        "'README.md' is a file, not a directory; give a file path you can write to"),
    Row("python -m sanitizer --backend cuda -- python examples/engine_zeroers.py", 2, "error: backend 'cuda' needs a GPU and torch with "
        "CUDA, and this machine has none; use --backend sim to run the program's cuda work on the simulator",
        needs_no_gpu=True),
    Row("python -m sanitizer.bench.compare --backend sim --only nope", 2, "error: --only 'nope' is not a program "
        "of the benchmark; programs: block_table_one_buffer, block_table_fresh_pinned, ..."),
    Row("python -m sanitizer.bench.compare --backend sim --tools force", 2, "error: --tools 'force' is not a tool "
        "of backend sim; tools: observe"),
    Row("python -m sanitizer.bench.compare --backend sim --steps 0", 2,
        "error: --steps 0 must be a positive number of steps"),
    Row("python -m zeroer.engine_loop --zeroer nope", 2,
        f"python -m zeroer.engine_loop: error: --zeroer: {UNKNOWN_ZEROER}", subprocess=True),
    Row("python -m zeroer.engine_loop --zeroer per_call --geometry huge", 2,
        "python -m zeroer.engine_loop: error: --geometry 'huge' is not one of block_outer_fp8, "
        "kv_outer_bf16, mixed_dtypes, mla_indexer, packed, ratio2, shared_layers, tiny", subprocess=True),
    # -- python -m fuzz.bench.speed, .intercept, .selfcheck ---------------------------------------------------
    Row("python -m fuzz.bench.speed --backend tpu", 2,
        "python -m fuzz.bench.speed: error: --backend 'tpu' is not a backend; choose sim or cuda"),
    Row("python -m fuzz.bench.speed --seeds 0", 2, "python -m fuzz.bench.speed: error: --seeds 0 must be at least 1; "
        "give the number of seeds per race, e.g. 5"),
    Row("python -m fuzz.bench.speed --quick --json README.md/s.json", 2,
        "error: --json 'README.md/s.json': 'README.md' is a file, not a directory; give a file path you can write to"),
    Row("python -m fuzz.bench.intercept --geometries huge", 2, "python -m fuzz.bench.intercept: error: --geometries: "
        "unknown geometry 'huge'; choose from block_outer_fp8, kv_outer_bf16, mixed_dtypes, mla_indexer, packed, ratio2, "
        "shared_layers, tiny"),
    Row("python -m fuzz.bench.intercept --rounds 0", 2,
        "python -m fuzz.bench.intercept: error: --rounds 0 and --examples 150 must be positive"),
    Row("python -m fuzz.bench.intercept --backend cuda", 2, "python -m fuzz.bench.intercept: error: --backend cuda needs a "
        "CUDA GPU and none is visible here; use --backend sim", needs_no_gpu=True),
    Row("python -m fuzz.bench.selfcheck --seeds 0", 2, "python -m fuzz.bench.selfcheck: error: argument --seeds: '0' is "
        "not a positive number of seeds, e.g. --seeds 10"),
    Row("python -m fuzz.bench.selfcheck --profile nightly", 2, "python -m fuzz.bench.selfcheck: error: argument --profile: "
        "invalid choice: 'nightly' (choose from 'quick', 'ci')"),
    Row("python -m fuzz.bench.selfcheck --geometry tiny -k packed", 2, "python -m fuzz.bench.selfcheck: error: no "
        "self-check matches --geometry tiny and -k packed; the self-checks are: ..."),
    Row("python -m fuzz.bench.selfcheck -k ring_overrun --json README.md/c.json", 2,
        "error: --json 'README.md/c.json': 'README.md' is a file, not a directory; give a file path you can write to"),
    # -- pytest (the plugin: pytest.exit prints "Exit: ", pytest's own rule) ------------------------------------
    Row("pytest --kvz-sanitize-backend sim", 2, "Exit: error: --kvz-sanitize-backend is given without "
        "--kvz-sanitize, so nothing would be sanitized; add --kvz-sanitize (or --kvz-sanitize-force)"),
    Row("pytest --kvz-sanitize-partial", 2, "Exit: error: --kvz-sanitize-partial is given without --kvz-sanitize, "
        "so nothing would be sanitized; add --kvz-sanitize (or --kvz-sanitize-force)"),
    Row("pytest --kvz-sanitize --kvz-sanitize-backend tpu", 2,
        "Exit: error: backend 'tpu' is not one of auto, cuda, sim"),
    Row("pytest fuzz --backend nope", 2, "Exit: error: --backend 'nope' is not a backend; choose one of: auto, cuda, sim"),
    Row("pytest fuzz --backend cuda", 2, "Exit: error: --backend cuda needs a CUDA GPU and none is visible here; use "
        "--backend sim or auto", needs_no_gpu=True),
    Row("pytest fuzz --cuda-mode fast", 2, "Exit: error: --cuda-mode 'fast' is not a mode; choose one of: both, controlled, free"),
    Row("pytest --zeroer nope", 2, f"Exit: error: --zeroer 'nope': {UNKNOWN_ZEROER}"),
    Row("pytest --zeroer tests/missing.py:factory", 2, "Exit: error: --zeroer 'tests/missing.py:factory': zeroer "
        "'tests/missing.py:factory': file 'tests/missing.py' does not exist (built-in zeroers: event_ring, ..."),
    Row("pytest --zeroer tests/bad_zeroers.py:nothing_here", 2, "Exit: error: --zeroer 'tests/bad_zeroers.py:nothing_here': "
        "zeroer 'tests/bad_zeroers.py:nothing_here': 'tests/bad_zeroers.py' has no attribute 'nothing_here' (built-in "
        "zeroers: event_ring, ..."),
    Row("pytest --zeroer tests/bad_zeroers.py:NOT_A_FACTORY", 2, "Exit: error: --zeroer 'tests/bad_zeroers.py:NOT_A_FACTORY': "
        "zeroer 'tests/bad_zeroers.py:NOT_A_FACTORY' is int, not a factory(cache, runtime) (built-in zeroers: event_ring, ..."),
    Row("pytest --zeroer tests/bad_zeroers.py:one_argument", 2, "Exit: error: --zeroer 'tests/bad_zeroers.py:one_argument': "
        "zeroer 'tests/bad_zeroers.py:one_argument' has signature (cache); a factory must accept (cache, runtime): too many "
        "positional arguments (built-in zeroers: event_ring, ..."),
    Row("pytest --zeroer tests/bad_zeroers.py:declares_a_string", 2, "Exit: error: --zeroer "
        "'tests/bad_zeroers.py:declares_a_string': zeroer 'tests/bad_zeroers.py:declares_a_string' declares capabilities = "
        "'sim' (str); declare a zeroer.protocol.Capabilities(...) instead (built-in zeroers: event_ring, ..."),
    Row("pytest --zeroer examples/engine_offloaders.py", 2, "Exit: error: --zeroer 'examples/engine_offloaders.py': unknown "
        "zeroer 'examples/engine_offloaders.py'; name the factory in it: 'examples/engine_offloaders.py:<factory>'; use a "
        "built-in name (event_ring, ..."),
    Row("pytest --zeroer examples/engine_offloaders.py:load_waits_forward", 2, "Exit: error: --zeroer "
        "'examples/engine_offloaders.py:load_waits_forward': zeroer 'examples/engine_offloaders.py:load_waits_forward' has "
        "signature (cache, host_pool, runtime=None, ..."),
    Row("pytest --zeroer per_call --geometry huge", 2, "Exit: error: --geometry 'huge': 'huge' is not a geometry; choose "
        "from block_outer_fp8, int32_wrap, kv_outer_bf16, mixed_dtypes, mla_indexer, packed, ratio2, shared_layers, tiny, or all"),
    Row("pytest fuzz --geometry tiny", 2, "Exit: error: --geometry 'tiny' needs --zeroer or --offloader: it chooses the "
        "presets one component runs on, e.g. --zeroer my_zeroer.py:factory --geometry packed,tiny"),
    Row("pytest fuzz --offloader examples/engine_offloaders.py:nothing_here", 2, "Exit: error: --offloader "
        "'examples/engine_offloaders.py:nothing_here': offloader 'examples/engine_offloaders.py:nothing_here': "
        "'examples/engine_offloaders.py' has no attribute 'nothing_here'"),
    Row("pytest fuzz --offloader examples/engine_offloaders.py:load_waits_forward --zeroer per_call", 2, "Exit: error: "
        "--offloader 'examples/engine_offloaders.py:load_waits_forward' and --zeroer 'per_call': fuzz one component per "
        "run; run pytest twice, once with each"),
    Row("pytest fuzz --offloader tests/engine_style/factories.py:hicache_controller --geometry packed", 2,
        "Exit: error: nothing to fuzz: every campaign is skipped (tests/engine_style/factories.py:hicache_controller "
        "declares OffloaderCapabilities(geometries=(ratio2, tiny)), not packed); choose what it declares with --geometry "
        "and --host-memory, or drop them"),
    Row("pytest fuzz --host-memory registered", 2, "Exit: error: --host-memory 'registered' needs --offloader: it chooses "
        "the host pool an offloader stores into, e.g. --offloader my_offloader.py:factory --host-memory registered"),
    Row("pytest fuzz --offloader examples/engine_offloaders.py:load_waits_forward --host-memory paged", 2, "Exit: error: "
        "--host-memory 'paged' is not a host pool; choose one of: pinned, registered, both"),
    *(Row(f"pytest fuzz --fuzz-minutes {value}", 2, f"Exit: error: --fuzz-minutes '{value}' must be a finite number greater "
          "than 0; give minutes, e.g. 30") for value in ("0", "-1", "nan", "inf")),
    Row("pytest fuzz --fuzz-minutes abc", 2,
        "Exit: error: --fuzz-minutes 'abc' is not a number; give a positive number of minutes, e.g. 30"),
    Row("pytest fuzz --fuzz-shrink-seconds -1", 2, "Exit: error: --fuzz-shrink-seconds '-1' must be a finite number of "
        "seconds, 0 or more; e.g. 30 (0 keeps each finding's first failing program)"),
    Row("pytest fuzz --fuzz-shrink-seconds abc", 2,
        "Exit: error: --fuzz-shrink-seconds 'abc' is not a number; give seconds, e.g. 30"),
    Row("pytest fuzz --fuzz-profile weekly", 2,
        "Exit: error: --fuzz-profile 'weekly' is not a profile; choose one of: ci, nightly, quick"),
    Row("pytest fuzz --fuzz-journal always", 2,
        "Exit: error: --fuzz-journal 'always' is not one of auto, on, off (auto: on for the cuda backend)"),
    Row("pytest fuzz --fuzz-shard 4/4", 2, "Exit: error: --fuzz-shard '4/4' is not a shard; give i/N with 0 <= i < N, e.g. 0/4"),
    Row("pytest fuzz --hypothesis-seed abc", 2, "Exit: error: --hypothesis-seed 'abc' is not an integer; fuzz campaigns need "
        "the integer seed a summary lists, e.g. --hypothesis-seed 1234"),
    Row("pytest fuzz --repro-dir README.md/x", 2, "_pytest.outcomes.Exit: error: --repro-dir 'README.md/x': cannot write there (Not a "
        "directory); give a directory you can write to"),
    Row("pytest fuzz --fuzz-summary README.md/s.json", 2, "_pytest.outcomes.Exit: error: --fuzz-summary 'README.md/s.json': 'README.md' is a "
        "file, not a directory; give a file path you can write to"),
    Row("pytest fuzz --fuzz-minuts 3", 4, "ERROR: usage: ..."),  # pytest's own rule for an unknown option
    # -- zeroers that raise: a factory that raises built nothing (a usage error), a zeroer that raises is a finding --
    Row("pytest --zeroer tests/bad_zeroers.py:raising_factory --backend sim --geometry tiny -k tiny-sim-shard0 --repro-dir=out/", 2,
        "the zeroer factory 'tests/bad_zeroers.py:raising_factory' raised at tests/bad_zeroers.py:28 (raise "
        "RuntimeError(\"planted: this factory cannot build a zeroer\")): RuntimeError: planted: this factory cannot build "
        "a zeroer; it built no zeroer, so nothing was fuzzed and this is not a finding: fix the factory so that "
        "raising_factory(cache, runtime) returns the zeroer"),
    Row("pytest --zeroer tests/bad_zeroers.py:RaisingZeroer --backend sim --geometry tiny -k tiny-sim-shard0 --repro-dir=out/", 1,
        "  - zeroer raised at step 2 in zero_block_ids([1]): RuntimeError: planted: cannot zero [1]",
        trace_details="RuntimeError: planted: cannot zero [1]"),
    # -- what the harness cannot follow: a harness error, never a finding -------------------------------------------
    Row("pytest --zeroer tests/bad_zeroers.py:UsesACudaGraph --backend sim --geometry tiny -k tiny-sim-shard0 --repro-dir=out/", 2,
        "harness error at step 1 in the zeroer's warmup, called at tests/bad_zeroers.py:67 (torch.cuda.CUDAGraph()), not a "
        "finding: InterceptError: torch.cuda.CUDAGraph: the harness cannot order or schedule it; run the code on a GPU in "
        "the free-running mode instead (--backend cuda --cuda-mode free), where its calls run as they are"),
    Row("pytest --zeroer tests/bad_zeroers.py:TakesASet --backend sim --geometry tiny -k tiny-sim-shard0 --repro-dir=out/", 2,
        "harness error at step 0 in the zeroer's factory, not a finding: ZeroerSpecError: zeroer "
        "'tests/bad_zeroers.py:TakesASet': zero_block_ids(block_ids: set[int]) takes none of the containers the fuzzer's "
        "caller hands ids over in (list, tuple, array, tensor); annotate it with one of them (list[int], as vLLM does), or "
        "declare them on its factory: capabilities = Capabilities(ids_as=('list',))"),
    # -- the GPU out of memory: a resource error, neither a finding nor clean --------------------------------------
    Row("pytest --zeroer tests/bad_zeroers.py:OutOfMemoryZeroer --backend sim --geometry tiny -k tiny-sim-shard0 --repro-dir=out/", 2,
        "resource error, not judged: the GPU ran out of memory in warmup (CUDA out of memory. Tried to "
        "allocate 5.00 GiB (planted)); this is a resource error, not a finding: run fewer CUDA processes at once (pytest -n, "
        "python -m fuzz.bench.detect -j) or free GPU memory"),
]


def row_id(row: Row) -> str:
    words = row.command.split()
    tool = "pytest" if words[0] == "pytest" else words[2].rsplit(".", 1)[-1]
    detail = " ".join(words[3:] if words[0] != "pytest" else words[1:])
    edits = ",".join(f"{k}={v}" for k, v in (row.edits or {}).items()) or row.text or ""
    return re.sub(r"[^\w.=,/:-]+", "_", f"{tool}-{detail}-{edits}")[:90]


# -- the table ------------------------------------------------------------------------------------------------

def _code(text: str) -> str:
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def table_line(row: Row) -> str:
    cells = [_code(row.command), row.input, str(row.status), _code(row.message)]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def render_table() -> str:
    return "\n".join(["| command | input (`bad.json`) | exit | message |", "| --- | --- | ---: | --- |",
                      *(table_line(r) for r in ROWS)])


def test_the_table_lists_every_row():
    text = TABLE.read_text()
    listed = [line for line in text.splitlines() if line.startswith("| `")]
    missing = [table_line(r) for r in ROWS if table_line(r) not in listed]
    assert not missing, f"docs/bad-input.md lacks these rows (python tests/test_bad_input.py prints the table): {missing}"
    assert len(listed) == len(ROWS), "docs/bad-input.md has rows the tests do not (python tests/test_bad_input.py prints the table)"
    assert len(ROWS) >= 30


# -- running a row --------------------------------------------------------------------------------------------

def _set(data: Any, dotted: str, value: Any) -> None:
    """``data["ops"][1]["n"] = value`` for ``ops[1].n``; an index one past the end appends."""
    keys = [int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", dotted)]
    for key in keys[:-1]:
        data = data[key]
    if isinstance(data, list) and keys[-1] == len(data):
        data.append(value)
    else:
        data[keys[-1]] = value


def _prepare(row: Row, tmp: Path) -> tuple[list[str], str]:
    """The row's argv with its placeholders made real, and the message it must print."""
    bad, out = tmp / "bad.json", tmp / "out"
    out.mkdir()
    if row.edits is not None:
        data = copy.deepcopy(json.loads((ROOT / BASE).read_text()))
        for dotted, value in row.edits.items():
            _set(data, dotted, value)
        bad.write_text(json.dumps(data))
    elif row.text is not None:
        bad.write_text(row.text)

    def real(text: str) -> str:
        text = re.sub(r"(?<![\w/.])bad\.json", lambda _: str(bad), text)
        return re.sub(r"(?<![\w/.-])out(?=/|'|$)", lambda _: str(out), text)

    return [real(word) for word in shlex.split(row.command)], real(row.message)


def _pattern(message: str) -> str:
    if message.endswith(" ..."):
        return re.escape(message[: -len(" ...")]) + ".*"
    return re.escape(message)


def _in_process(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    command = max((c for c in MAINS if " ".join(argv).startswith(c)), key=len)
    main = importlib.import_module(MAINS[command]).main
    try:
        status = main(argv[len(command.split()):])
    except SystemExit as exit:  # argparse: its own status 2 (or 0 for --help)
        status = exit.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _as_subprocess(argv: list[str]) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("row", ROWS, ids=[row_id(r) for r in ROWS])
def test_a_bad_input_exits_with_its_status_and_one_line(row: Row, tmp_path, capsys, monkeypatch, pytest_server):
    if row.needs_no_gpu and not NO_GPU:
        pytest.skip("shows what happens without a GPU")
    monkeypatch.chdir(ROOT)
    argv, message = _prepare(row, tmp_path)
    if argv[0] == "pytest":
        status, output = pytest_server(argv[1:])
        assert status == row.status, output
        # pytest frames an exit during collection (the output paths are checked then) with "!" marks
        assert re.search(f"^(?:!+ )?{_pattern(message)}(?: !+)?$", output, re.MULTILINE), output
        assert "Traceback" not in output
    else:
        status, out, err = _as_subprocess(argv) if row.subprocess else _in_process(argv, capsys)
        assert status == row.status, (out, err)
        assert "Traceback" not in out + err
        if row.status == 1:
            assert re.search(f"^{_pattern(message)}$", out, re.MULTILINE), out
        else:
            assert re.fullmatch(_pattern(message), err.rstrip("\n")), err  # ONE line on stderr, and only it
    if row.status != 1:  # nothing was found, so no trace may be written
        assert not list((tmp_path / "out").glob("**/*.json"))
    if row.trace_details is not None:  # the finding's trace holds the exception and its traceback
        (trace,) = (tmp_path / "out").glob("*.json")
        (finding,) = json.loads(trace.read_text())["findings"]
        assert finding["kind"] == "zeroer raised"
        assert finding["details"].startswith("Traceback (most recent call last):")
        assert row.trace_details in finding["details"]


# -- pytest rows: one helper process per worker -----------------------------------------------------------------

MARK = "@@bad-input@@ "
SERVING = "KVZERO_BAD_INPUT_HELPER"


def _serve() -> None:
    """``--serve``: for each JSON list of pytest arguments on stdin, run ``pytest.main`` here and
    print one marked JSON line: the status and what it printed. The summary and the example
    database go to a temporary directory unless the row names them (a later option wins)."""
    scratch = Path(tempfile.mkdtemp(prefix="kvzero-bad-input-"))
    quiet = ["-p", "no:xdist", "-q", f"--fuzz-summary={scratch / 'summary.json'}", f"--fuzz-db={scratch / 'db'}"]
    for line in sys.stdin:
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            status = int(pytest.main([*quiet, *json.loads(line)]))
        sys.__stdout__.write(MARK + json.dumps({"status": status, "output": output.getvalue()}) + "\n")
        sys.__stdout__.flush()


@pytest.fixture(scope="session")
def pytest_server():
    process = None
    log = tempfile.TemporaryFile(mode="w+")

    def run(args: list[str]) -> tuple[int, str]:
        nonlocal process
        if os.environ.get(SERVING):  # a run that the helper itself started: never a helper of its own
            pytest.skip("inside the pytest helper process")
        if process is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
            env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
            env[SERVING] = "1"
            process = subprocess.Popen([sys.executable, __file__, "--serve"], cwd=ROOT, env=env, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        process.stdin.write(json.dumps(args) + "\n")
        process.stdin.flush()
        for line in process.stdout:
            if line.startswith(MARK):
                result = json.loads(line[len(MARK):])
                return result["status"], result["output"]
        log.seek(0)
        raise AssertionError(f"the pytest helper process died: {log.read()[-3000:]}")

    yield run
    if process is not None:
        with contextlib.suppress(BrokenPipeError):  # it may have died: its rows said so
            process.stdin.close()
        process.wait(timeout=60)
    log.close()


# -- racecheck/cli.py itself ---------------------------------------------------------------------------------------

def _boom(argv: list[str]) -> int:
    raise KeyError("planted")


def test_an_unexpected_exception_is_one_line_that_says_it_is_a_bug(capsys):
    assert run_main(_boom, [], "python -m tool") == 3
    assert capsys.readouterr().err == ("python -m tool: internal error, a bug in kvzero-fuzz: KeyError: 'planted' "
                                       "(rerun with --debug for the traceback and report it)\n")


def _out_of_queues(argv: list[str]) -> int:
    raise RuntimeError("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in the CUDA docs")


def test_a_cuda_resource_running_out_under_our_own_work_is_the_users_to_free_not_a_bug(capsys):
    """Seen on an H200 with 130 GiB free: a dozen CUDA processes at once, each with 32 hardware
    queues, and CUDA answers a new stream or context with this bare error."""
    assert run_main(_out_of_queues, [], "python -m tool") == 2
    err = capsys.readouterr().err
    assert err == ("python -m tool: the GPU refused a context, stream or pinned allocation (CUDA error: out of memory): "
                   "its memory or its hardware queues are used up (each CUDA process holds up to 32 queues), even with "
                   "memory free; this is a resource error, not a finding: run fewer CUDA processes at once (pytest -n, "
                   "python -m fuzz.bench.detect -j) or free GPU memory\n")


def test_debug_adds_the_traceback_and_keeps_the_status(capsys):
    assert run_main(_boom, ["--debug"], "python -m tool") == 3
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and 'KeyError: \'planted\'\n' in err
    assert err.endswith("(rerun with --debug for the traceback and report it)\n")


def test_debug_is_taken_off_the_command_line_and_listed_in_the_help(capsys):
    seen = []
    assert run_main(lambda argv: seen.append(argv) or 0, ["x", "--debug", "--", "--debug"], "tool") == 0
    assert seen == [["x", "--", "--debug"]]
    with pytest.raises(SystemExit):
        ArgumentParser(prog="tool").parse_args(["--help"])
    assert "--debug" in capsys.readouterr().out


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:
        print(render_table())
