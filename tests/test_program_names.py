"""The names a program owns stay its own under both tools (racecheck/effects.py, "the names a tool
takes while it runs"), and a failure inside a tool's stand-in, model or patch is never the program's.

A modelled op nothing defines is a stand-in only while a tool runs, never registered with torch: a
program that defines ``sgl_kernel``'s or vLLM's ops itself (``torch.library`` DEF or FRAGMENT), before
or after the tool started, or after it took the stand-in, gets its own op, and the model follows it.
A modelled module (``lmcache.c_ops``) is the program's wherever it can import it: a program that
puts its own ``lmcache`` on ``sys.path`` after start-up gets its package, its ``__init__``'s names
and its ``c_ops`` (wrapped), or a stand-in ``c_ops`` where it has none; a stand-in package gives way
to the program's own once that can be imported, and no stand-in outlives the tool. Each case is a
real program: under ``python -m sanitizer --backend sim``, the simulator in this process, the GPU
observer through the CUDA stand-in, and the fuzzer's episodes (in a child process where the program
defines ops that would outlive the test).
"""

from __future__ import annotations

import importlib.machinery
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fake_cuda import FakeCuda
from racecheck import custom_ops
from sanitizer.sim.session import simulate

ROOT = Path(__file__).resolve().parents[1]
OP = "sgl_kernel::transfer_kv_per_layer"
SCHEMA = next(m.schema for m in custom_ops.models() if m.name == OP)
SWAP_SCHEMA = next(m.schema for m in custom_ops.models() if m.name == "_C_cache_ops::swap_blocks")


def _programs_own_kernel(*args, **kwargs):
    raise RuntimeError("the program's own CPU kernel ran: the tool did not follow the op by its model")


@pytest.fixture
def own_ops():
    """``define(namespace, kind, schema)``: the program's own definition of an op, with a CPU kernel
    that says so if it runs (on the simulator the model's reference runs instead); undone after the
    test, as the program's process would end."""
    libraries = []

    def define(namespace: str = "sgl_kernel", kind: str = "DEF", schema: str = SCHEMA,
               kernel=_programs_own_kernel) -> None:
        library = torch.library.Library(namespace, kind)
        libraries.append(library)
        library.define(schema)
        library.impl(schema.partition("(")[0], kernel, "CPU")

    yield define
    for library in reversed(libraries):
        library._destroy()


def _transfer(op=None) -> tuple:
    """``transfer_kv_per_layer`` on a side stream, its destination read on the main stream with no
    event between them: a race, when the tool follows the op."""
    src, dst = torch.arange(48.0).reshape(6, 8).cuda(), torch.zeros(6, 8).cuda()
    si, di = torch.tensor([1, 4]).cuda(), torch.tensor([0, 5]).cuda()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        (op or torch.ops.sgl_kernel.transfer_kv_per_layer)(src, dst, src, dst, si, di, item_size=32, block_quota=2,
                                                           num_warps_per_block=1)
    dst.sum()
    torch.cuda.synchronize()
    return src.cpu(), dst.cpu()


def _followed(races, error, unfollowed, moved) -> None:
    assert error is None and unfollowed == [], (error, unfollowed)
    assert [r.kind for r in races] == ["unordered-device-access"] and "transfer_kv_per_layer" in str(races[0])
    src, dst = moved[0]
    assert torch.equal(dst[0], src[1]) and torch.equal(dst[5], src[4])  # the model's reference moved them


# -- ops the program defines itself -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["DEF", "FRAGMENT"])
def test_an_op_the_program_defines_after_the_sanitizer_started_is_its_own_and_followed_by_the_model(kind, own_ops):
    moved = []

    def main() -> None:
        own_ops(kind=kind)  # the program's own definition, the sanitizer running
        assert type(torch.ops.sgl_kernel.transfer_kv_per_layer).__name__ == "OpOverloadPacket"
        moved.append(_transfer())

    races, error, _, unfollowed = simulate(main)
    _followed(races, error, unfollowed, moved)


@pytest.mark.parametrize("kind", ["DEF", "FRAGMENT"])
def test_an_op_the_program_defines_before_the_sanitizer_starts_is_its_own_even_after_an_earlier_run(kind, own_ops):
    simulate(lambda: _transfer())  # an earlier run in this process (an earlier test) stood the op in
    own_ops(kind=kind)
    moved = []
    races, error, _, unfollowed = simulate(lambda: moved.append(_transfer()))
    _followed(races, error, unfollowed, moved)


def test_an_op_looked_up_before_the_program_defines_it_goes_to_the_programs_op_once_defined(own_ops):
    moved = []

    def main() -> None:
        held = torch.ops.sgl_kernel.transfer_kv_per_layer  # the stand-in: nothing defines it yet
        own_ops(kind="DEF")
        moved.append(_transfer(held))  # the program's op now, followed by the model all the same

    races, error, _, unfollowed = simulate(main)
    _followed(races, error, unfollowed, moved)


def test_once_the_sanitizer_ends_nothing_of_its_stand_in_ops_is_left_for_the_programs_definition_to_meet(own_ops):
    races, error, _, _ = simulate(lambda: _transfer())
    assert error is None and len(races) == 1  # the stand-in was followed while the sanitizer ran
    assert not hasattr(torch.ops.sgl_kernel, "transfer_kv_per_layer")  # as without a tool
    own_ops(kind="DEF")  # registers, where a definition left behind would have been refused
    assert hasattr(torch.ops.sgl_kernel, "transfer_kv_per_layer")


def test_the_gpu_observer_follows_a_modelled_op_the_program_defines_after_it_started(own_ops):
    from sanitizer.gpu.observer import Observer

    cuda = FakeCuda()
    obs = Observer(device=cuda)
    cuda.obs = obs
    obs.start()
    try:
        own_ops("_C_cache_ops", "FRAGMENT", SWAP_SCHEMA, _swap_rows)  # vLLM's op, the program's own definition
        src, dst = cuda.device(torch.arange(32.0).reshape(8, 4)), cuda.device(torch.zeros(8, 4))
        side = cuda.new_stream()
        with cuda.stream(side):
            torch.ops._C_cache_ops.swap_blocks(src, dst, 16, torch.tensor([[1, 3]]))  # the program's op runs
        dst.sum()
    finally:
        races = obs.stop()
    assert [r.kind for r in races] == ["unordered-device-access"] and "swap_blocks" in str(races[0])
    assert torch.equal(dst[3], src[1])


def _swap_rows(src, dst, block_size_in_bytes, block_mapping):
    """The program's own CPU kernel of vLLM's ``swap_blocks`` (row ``s`` of ``src`` to row ``d`` of ``dst``)."""
    for s, d in block_mapping.tolist():
        dst[d] = src[s]


# -- a package the program puts on sys.path --------------------------------------------------------------

OWN_INIT = 'torch_dev = "the program\'s own"\n'
OWN_C_OPS = '''\
import enum


class TransferDirection(enum.IntEnum):
    H2D = 0
    D2H = 1


class GPUKVFormat(enum.IntEnum):
    NB_NL_TWO_BS_NH_HS = 0
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2
    NL_X_NB_BS_HS = 3
    TWO_X_NL_X_NBBS_NH_HS = 4
    NL_X_NBBS_ONE_HS = 5


EngineKVFormat = GPUKVFormat


class PageBufferShapeDesc:
    def __init__(self):
        self.kv_size, self.nl, self.nb, self.bs, self.nh, self.hs, self.element_size = 2, 0, 0, 0, 0, 0, 2
        self.block_stride_elems = 0


def multi_layer_block_kv_transfer(*args, **kwargs):
    raise RuntimeError("the program's own c_ops ran: the tool did not follow it by its model")
'''


def _own_lmcache(where: Path, c_ops: bool) -> Path:
    """The program's own ``lmcache`` (a source checkout, say): ``torch_dev`` in its ``__init__``, and
    its ``c_ops`` where ``c_ops`` (a module of the modelled function's name, and the names LMCache's has)."""
    package = where / "own" / "lmcache"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(OWN_INIT)
    if c_ops:
        (package / "c_ops.py").write_text(OWN_C_OPS)
    return package.parent


@pytest.fixture
def no_lmcache_left():
    """The program's ``lmcache`` (and ``sys.path``) as they were: what it imported goes with it."""
    path = list(sys.path)
    yield
    sys.path[:] = path
    for name in [n for n in sys.modules if n == "lmcache" or n.startswith("lmcache.")]:
        del sys.modules[name]


LMCACHE_PROGRAM = '''\
import sys

sys.path.insert(0, OWN)  # the program's own lmcache, importable only now: the sanitizer has started
from lmcache import torch_dev

print("torch_dev:", torch_dev)
sys.path.insert(0, ROOT)
from examples.lmcache_transfer_context import main

main(fixed=False, steps=2)
'''


def sanitize_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sanitizer", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("c_ops", [True, False], ids=["its-own-c_ops", "no-c_ops"])
def test_a_program_that_puts_its_own_lmcache_on_sys_path_after_start_gets_it_and_its_op_is_followed(c_ops, tmp_path):
    own = _own_lmcache(tmp_path, c_ops)
    script = tmp_path / "engine_loop.py"
    script.write_text(LMCACHE_PROGRAM.replace("OWN", repr(str(own))).replace("ROOT", repr(str(ROOT))))
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 1, done.stdout + done.stderr  # the example's race, through the model
    assert "torch_dev: the program's own" in done.stdout
    assert "multi_layer_block_kv_transfer" in done.stdout and "program's own c_ops ran" not in done.stderr


def test_a_stand_in_package_gives_way_to_the_programs_own_once_it_can_be_imported(tmp_path, no_lmcache_left):
    own = _own_lmcache(tmp_path, c_ops=True)
    seen = {}

    def main() -> None:
        import lmcache.c_ops as first  # nothing can import lmcache yet: kvzero's stand-in

        seen["first"] = type(first).__name__
        sys.path.insert(0, str(own))
        from lmcache import torch_dev  # the program's own __init__ now

        import lmcache.c_ops as mine

        seen["torch_dev"], seen["mine"] = torch_dev, mine.__file__
        seen["routed"] = getattr(mine.multi_layer_block_kv_transfer, "__wrapped_model__", None) is not None

    races, error, _, _ = simulate(main)
    assert error is None, error
    assert seen == {"first": "_StandInModule", "torch_dev": "the program's own",
                    "mine": str(own / "lmcache" / "c_ops.py"), "routed": True}
    import lmcache.c_ops  # after the run: the program's, its function its own again

    assert lmcache.c_ops.multi_layer_block_kv_transfer.__module__ == "lmcache.c_ops"


def test_a_c_ops_extension_that_cannot_load_here_is_stood_in_for_under_the_programs_own_lmcache(tmp_path,
                                                                                                no_lmcache_left):
    own = _own_lmcache(tmp_path, c_ops=False)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (own / "lmcache" / f"c_ops{suffix}").write_bytes(b"not an ELF file: a CUDA build without CUDA's libraries")
    sys.path.insert(0, str(own))
    seen = {}

    def main() -> None:
        from lmcache import torch_dev

        import lmcache.c_ops as ops

        seen["torch_dev"], seen["c_ops"] = torch_dev, type(ops).__name__
        seen["routed"] = getattr(ops.multi_layer_block_kv_transfer, "__wrapped_model__", None) is not None

    races, error, _, _ = simulate(main)
    assert error is None, error
    assert seen == {"torch_dev": "the program's own", "c_ops": "_StandInExtension", "routed": True}
    assert "lmcache.c_ops" not in sys.modules and sys.modules["lmcache"].torch_dev == "the program's own"
    with pytest.raises(ImportError, match=r"c_ops"):
        import lmcache.c_ops  # noqa: F401 - as without the tool


def test_a_stand_in_module_is_in_sys_modules_only_from_the_programs_import_of_it_to_the_tools_end(no_lmcache_left):
    def main() -> None:
        assert "lmcache" not in sys.modules  # the sanitizer has started; the program has imported nothing yet
        import lmcache.c_ops  # noqa: F401 - now kvzero's stand-ins

        assert type(sys.modules["lmcache"]).__name__ == "_StandInModule"

    races, error, _, _ = simulate(main)
    assert error is None and races == [], error
    assert not [n for n in sys.modules if n == "lmcache" or n.startswith("lmcache.")]
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'lmcache'$"):
        import lmcache  # noqa: F401 - as without the tool


# -- the fuzzer ---------------------------------------------------------------------------------------------

EPISODE = '''\
import json, sys
from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.harness_error import HarnessError

ops = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "store", "block": 1}, {"op": "poll", "sync": 1},
       {"op": "load", "slot": 1}, {"op": "poll", "sync": 1}]
try:
    findings = run_ops(EpisodeConfig(zeroer="reference", offloader=sys.argv[1], geometry="tiny"), ops)
except HarnessError as error:
    print(json.dumps({"harness_error": error.message, "status": error.status}))
else:
    print(json.dumps({"findings": [f.kind for f in findings]}))
'''

OWN_SGL_OFFLOADER = '''\
import sys

import torch

sys.path.insert(0, ENGINE_STYLE)
from factories import hicache_controller_kernel


def own_kernel(*args, **kwargs):
    raise RuntimeError("the program's own CPU kernel ran: the fuzzer did not follow the op by its model")


def defines_its_ops(cache, host_pool, runtime=None):
    """SGLang's controller with sgl_kernel's ops defined by the program itself, in its factory: the
    fuzzer's interception is running."""
    library = torch.library.Library("sgl_kernel", KIND)
    for schema in SCHEMAS:
        library.define(schema)
        library.impl(schema.partition("(")[0], own_kernel, "CPU")
    defines_its_ops.library = library  # kept for the process, as an extension's ops are
    return hicache_controller_kernel(cache, host_pool)
'''

OWN_LMCACHE_OFFLOADER = '''\
import sys

sys.path.insert(0, ROOT)
from examples.lmcache_transfer_context import temporaries_synced_before_return


def own_lmcache(cache, host_pool, runtime=None):
    """LMCache's transfer context, its lmcache made importable by the factory (a vendored copy)."""
    sys.path.insert(0, OWN)
    from lmcache import torch_dev

    assert torch_dev == "the program's own"
    return temporaries_synced_before_return(cache, host_pool, runtime)
'''


def _episode(offloader: Path, factory: str) -> dict:
    done = subprocess.run([sys.executable, "-c", EPISODE, f"{offloader}:{factory}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["DEF", "FRAGMENT"])
def test_the_fuzzer_runs_an_offloader_whose_factory_defines_sgl_kernels_ops_and_follows_them(kind, tmp_path):
    schemas = [m.schema for m in custom_ops.models() if m.name in (OP, "sgl_kernel::transfer_kv_all_layer")]
    source = (OWN_SGL_OFFLOADER.replace("ENGINE_STYLE", repr(str(ROOT / "tests" / "engine_style")))
              .replace("KIND", repr(kind)).replace("SCHEMAS", repr(schemas)))
    offloader = tmp_path / "my_offloader.py"
    offloader.write_text(source)
    assert _episode(offloader, "defines_its_ops") == {"findings": []}


@pytest.mark.parametrize("c_ops", [True, False], ids=["its-own-c_ops", "no-c_ops"])
def test_the_fuzzer_runs_an_offloader_whose_factory_puts_its_own_lmcache_on_sys_path(c_ops, tmp_path):
    own = _own_lmcache(tmp_path, c_ops)
    offloader = tmp_path / "my_offloader.py"
    offloader.write_text(OWN_LMCACHE_OFFLOADER.replace("ROOT", repr(str(ROOT))).replace("OWN", repr(str(own))))
    assert _episode(offloader, "own_lmcache") == {"findings": []}


# -- a failure inside a tool's stand-in, model or patch ------------------------------------------------------

LACKS_A_NAME = "import lmcache.c_ops  # kvzero's stand-in: no lmcache here\nfrom lmcache import torch_dev\n"
STAND_IN_LINE = ("kvzero's stand-in module 'lmcache' (nothing else could import 'lmcache' when the program "
                 "imported it)")


def test_a_program_that_fails_inside_a_stand_in_exits_3_with_a_line_naming_it_never_on_its_own(tmp_path):
    script = tmp_path / "engine_loop.py"
    script.write_text(LACKS_A_NAME)
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "ImportError: cannot import name 'torch_dev' from 'lmcache'" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (f"kvz-sanitize: {script} failed (ImportError) inside {STAND_IN_LINE}, not on its own, with no "
                    f"race seen [simulator]; a bug of kvz-sanitize, not of the program: please report this line")


def test_a_program_that_fails_inside_an_effect_model_is_told_so_naming_the_model(capsys):
    from sanitizer.__main__ import report
    from sanitizer.runner import sanitize

    def program() -> None:
        import lmcache.c_ops as ops

        desc = ops.PageBufferShapeDesc()
        desc.nl = desc.nb = desc.bs = desc.nh = desc.hs = 1
        table, objects = torch.zeros(1, dtype=torch.uint64), [0]
        ops.multi_layer_block_kv_transfer(table, objects, torch.tensor([0]), None, ops.TransferDirection.H2D, desc, 1,
                                          99)  # a KV format the model does not know

    outcome = sanitize(program, backend="sim")
    assert report(outcome, "prog.py", partial=False) == 3
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("kvz-sanitize: prog.py failed (ValueError) inside kvzero's effect model of "
                           "lmcache.c_ops.multi_layer_block_kv_transfer (racecheck/engine_ops.py:"), last
    assert last.endswith(", not on its own, with no race seen [simulator]; a bug of kvz-sanitize, not of the "
                         "program: please report this line"), last


def test_a_program_that_fails_inside_a_patch_of_the_simulator_is_told_so_with_the_refusals_status(capsys):
    from sanitizer.__main__ import report
    from sanitizer.runner import sanitize

    def program() -> None:
        torch.zeros(4, device="cuda").resize_(8)  # the simulator refuses, and says what to do instead

    outcome = sanitize(program, backend="sim")
    assert report(outcome, "prog.py", partial=False) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    # one line: the program's line and the refusal, which says what to do instead
    assert re.fullmatch(r"kvz-sanitize cannot run (\S*/)?tests/test_program_names\.py:\d+ "
                        r"\(torch\.zeros\(4, device=\"cuda\"\)\.resize_\(8\)  # the simulator refuses, and says "
                        r"what to do instead\) \[simulator\]: "
                        r"aten\.resize_\.default on a simulated CUDA tensor: .* run the code on a GPU .*", last), last


def test_a_program_that_fails_on_its_own_is_still_said_to(capsys):
    from sanitizer.__main__ import report
    from sanitizer.runner import sanitize

    def program() -> None:
        import lmcache.c_ops  # noqa: F401 - a stand-in met on the way, not where it failed

        raise ValueError("the program itself")

    outcome = sanitize(program, backend="sim")
    assert outcome.inside == "" and report(outcome, "prog.py", partial=False) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kvz-sanitize: prog.py failed (ValueError) on its own with no race seen [simulator]")


def test_a_stand_in_that_cannot_run_on_device_memory_is_named_as_a_refusal_the_user_can_act_on():
    from fuzz.engine.harness_error import HarnessError, raise_if_harness
    from sanitizer.runner import inside_sanitizer

    src, dst = torch.ones(8, 4, device="meta"), torch.zeros(8, 4)  # a device tensor, as on a GPU
    with custom_ops.extension_modules(), pytest.raises(custom_ops.NeedsExtension) as raised:
        torch.ops._C_cache_ops.swap_blocks(src, dst, 16, torch.tensor([[0, 1]]))  # no vLLM here: the stand-in
    inside, status = inside_sanitizer(raised.value)
    assert status == 2
    assert re.fullmatch(r"kvzero's stand-in for _C_cache_ops::swap_blocks \(racecheck/effects\.py:\d+, in route\)",
                        inside), inside
    with pytest.raises(HarnessError) as harness:
        raise_if_harness(raised.value, "the offloader's store")
    assert harness.value.status == 2 and f"in the offloader's store, inside {inside}" in harness.value.message


FAILS_INSIDE = '''\
def lacks_a_name(cache, host_pool, runtime=None):
    import lmcache.c_ops
    from lmcache import torch_dev
'''


def test_an_offloader_factory_that_fails_inside_a_stand_in_is_a_harness_error_naming_it_not_a_factory_to_fix(
        tmp_path):
    from fuzz.engine.episode import EpisodeConfig, run_ops
    from fuzz.engine.harness_error import HarnessError

    offloader = tmp_path / "my_offloader.py"
    offloader.write_text(FAILS_INSIDE)
    with pytest.raises(HarnessError) as raised:
        run_ops(EpisodeConfig(zeroer="reference", offloader=f"{offloader}:lacks_a_name", geometry="tiny"),
                [{"op": "start"}])
    assert raised.value.status == 3
    assert raised.value.message == (
        f"harness error at step 0 in the offloader's factory, inside {STAND_IN_LINE}, called at {offloader}:3 (from "
        f"lmcache import torch_dev), not a finding: ImportError: cannot import name 'torch_dev' from 'lmcache' "
        f"(unknown location); a bug of kvzero-fuzz, not of the code under test: please report this line with the "
        f"summary's harness_details (or rerun with --fuzz-debug for the traceback)")


PYTEST_FILE = '''\
import torch

LIBRARY = torch.library.Library("sgl_kernel", "DEF")  # the test module's own op, defined at collection:
LIBRARY.define(SCHEMA)                                # before the sanitizer's run of any test starts


def test_its_own_op_is_followed():
    assert type(torch.ops.sgl_kernel.transfer_kv_per_layer).__name__ == "OpOverloadPacket"


def test_fails_inside_a_stand_in():
    import lmcache.c_ops
    from lmcache import torch_dev
'''


def test_pytest_kvz_sanitize_keeps_a_test_modules_own_op_and_says_when_a_test_failed_inside_a_stand_in(tmp_path):
    (tmp_path / "test_engine.py").write_text(PYTEST_FILE.replace("SCHEMA", repr(SCHEMA)))
    done = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_engine.py"), "--kvz-sanitize",
                           "--kvz-sanitize-backend", "sim", "-p", "no:cacheprovider", "-p", "no:randomly", "-q"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 3, done.stdout + done.stderr  # its only failure is the sanitizer's own: exit 3, not 1
    assert "1 failed, 1 passed" in done.stdout
    assert (f"test_engine.py::test_fails_inside_a_stand_in: kvz-sanitize: this call failed inside {STAND_IN_LINE}, "
            f"not on its own; a bug of kvz-sanitize, not of the test: please report this line") in done.stdout
