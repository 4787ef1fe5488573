"""``python -m sanitizer`` and ``pytest --kvz-sanitize`` on the simulator: verdicts, reports,
exit statuses and bad input (docs/sanitizer.md)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sanitizer.bench.programs import BY_NAME, path, source
from sanitizer.bench.verdict import FOUND, judge
from sanitizer.races import Access, Race, distinct
from sanitizer.sites import Site

ROOT = Path(__file__).resolve().parents[1]


def sanitize_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sanitizer", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def plugin_run(tmp_path: Path, source: str, name: str = "test_prog.py") -> subprocess.CompletedProcess:
    """``pytest --kvz-sanitize --kvz-sanitize-backend sim`` on a test file of ``source``, in ``tmp_path``."""
    (tmp_path / name).write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "fuzz.plugin",
                           "-p", "sanitizer.pytest_plugin", "--rootdir", str(tmp_path), "-c", "/dev/null", "--kvz-sanitize",
                           "--kvz-sanitize-backend", "sim", str(tmp_path / name)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_a_racy_program_is_reported_once_with_both_lines_and_exits_1(tmp_path: Path) -> None:
    report = tmp_path / "races.json"
    done = sanitize_cli("--backend", "sim", "--json", str(report), "--",
                        "python", str(path("block_table_one_buffer")), "--steps", "4")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.count("[host-write-vs-pending-copy]") == 1  # one distinct race, however many steps
    assert "queued:  copy_" in done.stdout and "block_table_one_buffer.py:" in done.stdout
    assert "through the buffer's numpy view" in done.stdout
    data = json.loads(report.read_text())
    assert data["races"] and {r["kind"] for r in data["races"]} == {"host-write-vs-pending-copy"}


def test_a_race_free_twin_is_clean_and_exits_0() -> None:
    done = sanitize_cli("--backend", "sim", "--", "python", str(path("block_table_fresh_pinned")), "--steps", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no race" in done.stdout


def test_a_bad_option_is_one_line_and_exit_2() -> None:
    # The command's other bad inputs are rows of tests/test_bad_input.py (docs/bad-input.md).
    done = sanitize_cli("--backend", "tpu", "--", "python", "x.py")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "invalid choice" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_program_that_fails_on_its_own_with_no_race_exits_2_with_its_traceback(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import torch\nx = torch.ones(2, device='cuda')\nraise ValueError('the program itself')\n")
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 2
    assert "ValueError: the program itself" in done.stderr and "failed (ValueError) on its own" in done.stderr
    assert "sanitizer/" not in done.stderr.split("ValueError")[0]  # the program's traceback, not ours


def test_pytest_plugin_fails_the_racy_test_and_lists_the_race_once(tmp_path: Path) -> None:
    done = plugin_run(tmp_path, """
        import torch

        def stage(buf, dev, steps):
            for s in range(steps):
                buf.numpy()[:4] = [s, s + 1, s + 2, s + 3]
                dev[:4].copy_(buf[:4], non_blocking=True)

        def test_racy_one():
            stage(torch.empty(8, dtype=torch.int64, pin_memory=True), torch.zeros(8, dtype=torch.int64, device="cuda"), 3)
            torch.cuda.synchronize()

        def test_racy_two():
            stage(torch.empty(8, dtype=torch.int64, pin_memory=True), torch.zeros(8, dtype=torch.int64, device="cuda"), 2)
            torch.cuda.synchronize()

        def test_clean():
            dev = torch.zeros(4, dtype=torch.int64, device="cuda")
            for s in range(3):
                dev.copy_(torch.tensor([s] * 4).pin_memory(), non_blocking=True)
            torch.cuda.synchronize()
            assert dev.tolist() == [2] * 4
    """, "test_engine.py")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "2 failed, 1 passed" in out
    # The plugin's section only: under CI=true pytest prints the short summary's lines untruncated.
    summary = out.split("kvz-sanitize (simulator)")[1].split("short test summary info")[0]
    assert summary.count("[host-write-vs-pending-copy]") == 1 and "in 2 tests: " in summary
    assert "test_engine.py:7 (stage)" in summary  # the queued copy's line


def _race(file: str, queued: int, later: int, stream: str = "the default stream", address: str = "0x1") -> Race:
    return Race("host-write-vs-pending-copy", f"pinned host buffer at {address}", Site(file, 3, "main"),
                Access("copy_", stream, Site(file, queued, "main")), Access("host write", "the host", Site(file, later, "main")))


def test_a_race_is_the_same_bug_whatever_its_addresses_and_streams() -> None:
    same = [_race("p.py", 7, 6), _race("p.py", 7, 6, stream="stream 0x55aa", address="0x2")]
    other = _race("p.py", 9, 6)
    groups = distinct([*same, other])
    assert [len(members) for _, members in groups] == [2, 1]
    assert Race.from_json(json.loads(json.dumps(other.to_json()))) == other


RACE_THEN_WAIT = """
import sys, time
import torch

buf = torch.empty(4, dtype=torch.int64, pin_memory=True)
dev = torch.zeros(4, dtype=torch.int64, device="cuda")
for s in range(int(sys.argv[1])):
    buf.numpy()[:] = s
    dev.copy_(buf, non_blocking=True)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("steps", [3, 0])
def test_an_interrupted_run_keeps_the_races_it_saw_and_writes_no_result_file(tmp_path: Path, signum: int,
                                                                              steps: int) -> None:
    script = tmp_path / "race_then_wait.py"
    script.write_text(RACE_THEN_WAIT)
    report = tmp_path / "races.json"
    report.write_text('{"a": "complete earlier result"}')
    run = subprocess.Popen([sys.executable, "-m", "sanitizer", "--backend", "sim", "--json", str(report), "--",
                            "python", str(script), str(steps)], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    try:
        line = run.stdout.readline()
        # stdout closed without "ready": the run ended before the program got there; say why
        assert line.strip() == "ready", line + run.stderr.read()
        run.send_signal(signum)
        out, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert "Traceback" not in err, err
    assert report.read_text() == '{"a": "complete earlier result"}'  # never replaced by a run cut short
    if steps:
        assert run.returncode == 1 and out.count("[host-write-vs-pending-copy]") == 1, out + err
        assert err.strip().splitlines()[-1] == ("python -m sanitizer: interrupted; the races above were seen "
                                                "before it (--json not written)")
    else:
        assert run.returncode == 130 and err.strip() == "python -m sanitizer: interrupted", out + err


def test_force_mode_says_when_its_gates_opened_by_the_time_limit_and_still_reports_its_races(
        capsys: pytest.CaptureFixture) -> None:
    from sanitizer.__main__ import report
    from sanitizer.runner import Outcome

    timeouts = ("kvz-sanitize: force mode opened its gates by the 2 s limit 2 time(s) (the host waited for the GPU "
                "where no hook shows it): the values of those copies were not compared")
    assert report(Outcome("cuda", "force", forced_timeouts=2), "p.py", partial=False) == 0
    out = capsys.readouterr().out
    assert timeouts in out and out.strip().endswith("kvz-sanitize: no race in p.py [force mode, cuda]")
    # A gate that opened early costs the comparison of values, never the verdict from the queue order.
    assert report(Outcome("cuda", "force", races=[_race("p.py", 9, 8)], forced_timeouts=2), "p.py", partial=False) == 1
    out = capsys.readouterr().out
    assert timeouts in out and "[host-write-vs-pending-copy]" in out and "at p.py:9 (main)" in out
    assert out.strip().endswith("kvz-sanitize: 1 distinct race (1 seen) in p.py [force mode, cuda]")


# -- the first hour with it (issue 30, item 9) -------------------------------------------------------------

RACY_EXITS = """
import sys
import torch

buf = torch.empty(4, dtype=torch.int64, pin_memory=True)
dev = torch.zeros(4, dtype=torch.int64, device="cuda")
for step in range(3):
    buf.fill_(step)
    dev.copy_(buf, non_blocking=True)
torch.cuda.synchronize()
sys.exit(1 if dev.tolist() != [2] * 4 else STATUS)
"""


def test_a_racy_program_that_ends_with_its_own_exit_status_keeps_its_report_and_exits_1(tmp_path: Path) -> None:
    script = tmp_path / "racy_exit.py"
    script.write_text(RACY_EXITS.replace("STATUS", "4"))
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[host-write-vs-pending-copy]" in done.stdout
    assert "racy_exit.py exited with status 4 after the race above" in done.stdout


def test_a_race_free_program_that_exits_non_zero_on_its_own_exits_2_and_says_so(tmp_path: Path) -> None:
    script = tmp_path / "exits.py"
    script.write_text("import sys\nimport torch\nx = torch.ones(2, device='cuda')\nsys.exit(5)\n")
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("exits.py exited with status 5 on its own with no race "
                                                         "seen [simulator]")


def test_a_host_write_through_fill_is_reported_at_its_own_line(tmp_path: Path) -> None:
    script = tmp_path / "fill.py"
    script.write_text(RACY_EXITS.replace("STATUS", "0"))
    report = tmp_path / "races.json"
    done = sanitize_cli("--backend", "sim", "--json", str(report), "--", "python", str(script))
    assert done.returncode == 1, done.stdout + done.stderr
    (race,) = {(r["queued"]["site"]["line"], r["later"]["site"]["line"]) for r in json.loads(report.read_text())["races"]}
    assert race == (9, 8)  # the copy, then fill_ at its own line, not the copy's
    assert "host write (fill_.Scalar on the pinned buffer) on the host, at " in done.stdout


SIM_FORCE = "[simulator, which holds every copy until the host synchronises, as --force does on a GPU]"


def test_force_on_the_simulator_reports_the_race_at_both_lines_and_the_values_it_made_wrong(tmp_path: Path) -> None:
    # docs/sanitizer.md: on the simulator every run is what --force makes of one on a GPU: the
    # verdict from the queue order, and the held copy reading what the host wrote later.
    racy = BY_NAME["block_table_one_buffer"]
    report = tmp_path / "races.json"
    done = sanitize_cli("--backend", "sim", "--force", "--json", str(report), "--", "python", str(source(racy)),
                        "--steps", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    data = json.loads(report.read_text())
    assert data["mode"] == "force" and data["backend"] == "sim"
    assert judge(racy, data["races"]) == FOUND, data["races"]  # its kind and both marked lines
    assert "gathered block sums" in data["program_error"]  # the program's own check: the values came out wrong
    assert "kvz-sanitize: 1 distinct race (" in done.stdout and f") in {source(racy)} {SIM_FORCE}" in done.stdout
    assert "failed (AssertionError) after the race above" in done.stdout


def test_force_on_the_simulator_leaves_the_race_free_twin_clean_with_its_values_right(tmp_path: Path) -> None:
    twin = BY_NAME["block_table_fresh_pinned"]
    report = tmp_path / "races.json"
    done = sanitize_cli("--backend", "sim", "--force", "--json", str(report), "--", "python", str(source(twin)),
                        "--steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(report.read_text())
    assert data["mode"] == "force" and data["races"] == [] and data["program_error"] is None and not data["notes"]
    assert done.stdout.strip() == f"kvz-sanitize: no race in {source(twin)} {SIM_FORCE}"


def test_a_host_read_under_a_pending_device_to_host_copy_is_its_own_kind(tmp_path: Path) -> None:
    script = tmp_path / "read.py"
    script.write_text(textwrap.dedent("""
        import torch

        counts = torch.arange(4, dtype=torch.int32, device="cuda")
        host = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        view = host.numpy()
        host.copy_(counts, non_blocking=True)
        print(int(view[3]))
    """))
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "host read of pinned memory a queued copy may not have written yet [host-read-vs-pending-copy]" in done.stdout
    assert "queued:  copy_ (d2h) on the default stream, at " in done.stdout and "read.py:7 (<module>)" in done.stdout
    assert "then:    read through the buffer's numpy view on the host, at " in done.stdout
    assert "read.py:8 (<module>)" in done.stdout


def test_the_plugin_says_how_many_times_and_in_how_many_tests_a_race_was_seen(tmp_path: Path) -> None:
    from sanitizer.pytest_plugin import seen_in

    place = Race("host-write-vs-pending-copy", "buf", None, Access("copy_", "s", Site("t.py", 3, "f")),
                 Access("host write", "the host", Site("t.py", 2, "f")), where="t.py::test_a")
    assert seen_in([place] * 5) == "5 times in 1 test: t.py::test_a"
    assert seen_in([place]) == "once in 1 test: t.py::test_a"
    other = Race(**{**place.__dict__, "where": "t.py::test_b"})
    assert seen_in([place, other]) == "2 times in 2 tests: t.py::test_a, t.py::test_b"


def test_what_engines_and_their_tests_call_on_torch_cuda_runs_on_the_simulator(tmp_path: Path) -> None:
    script = tmp_path / "housekeeping.py"
    script.write_text(textwrap.dedent("""
        import torch

        torch.cuda.manual_seed(0)
        a = torch.randn(4, device="cuda")
        torch.cuda.manual_seed_all(0)
        b = torch.randn(4, device="cuda")
        assert torch.equal(a, b)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda.nvtx.range_push("step")
        with torch.cuda.nvtx.range("inner"):
            c = (a * 2).sum()
        torch.cuda.nvtx.range_pop()
        end.record()
        end.synchronize()
        assert start.elapsed_time(end) > 0.0  # the simulator's clock: the ops between the records
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() >= 0 and torch.cuda.memory_reserved() >= 0
        print(c.item())
    """))
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no race" in done.stdout


GRAPH_GATHER = """
import sys
import torch

row = int(sys.argv[1])
kv = torch.zeros(8, 4, device="cuda")
ids = torch.zeros(2, dtype=torch.int64, device="cuda")
out = torch.zeros(2, 4, device="cuda")
side = torch.cuda.Stream()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out.copy_(kv.index_select(0, ids))
torch.cuda.synchronize()
for rows in ([0, 1], [4, 5]):
    ids.copy_(torch.tensor(rows, pin_memory=True), non_blocking=True)
    graph.replay()
    with torch.cuda.stream(side):
        kv[row].fill_(1.0)  # unordered with the replay
    torch.cuda.synchronize()
"""


@pytest.mark.parametrize(("row", "status"), [("2", 0), ("6", 0), ("4", 1), ("0", 1)])
def test_a_replayed_graph_gathers_the_rows_its_index_holds_at_each_replay(tmp_path: Path, row: str,
                                                                          status: int) -> None:
    script = tmp_path / "graph_gather.py"
    script.write_text(GRAPH_GATHER)
    done = sanitize_cli("--backend", "sim", "--", "python", str(script), row)
    assert done.returncode == status, done.stdout + done.stderr
    if status:
        assert "[unordered-device-access]" in done.stdout and "replayed on the default stream" in done.stdout


TRITON_STORE = """
import sys
import torch
import triton
import triton.language as tl


@triton.jit
def plus_one(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask) + 1, mask=mask)


src = torch.arange(4, dtype=torch.int32, device="cuda")
host = torch.zeros(4, dtype=torch.int32, pin_memory=True)
plus_one[(1,)](src, host, 4, BLOCK=4)  # the kernel stores into pinned memory (zero-copy)
if sys.argv[1] == "sync":
    torch.cuda.synchronize()
print(host.tolist())
"""


@pytest.mark.parametrize(("how", "status"), [("sync", 0), ("no-sync", 1)])
def test_a_triton_kernel_storing_into_pinned_memory_is_a_pending_write_of_it(tmp_path: Path, how: str,
                                                                           status: int) -> None:
    script = tmp_path / "triton_store.py"
    script.write_text(TRITON_STORE)
    done = sanitize_cli("--backend", "sim", "--", "python", str(script), how)
    assert done.returncode == status, done.stdout + done.stderr
    if status:
        assert "[host-read-vs-pending-copy]" in done.stdout and "triton_store.py:17" in done.stdout
        assert "triton_store.py:20" in done.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], r"^error: --steps 0 --rounds 3: give at least 1 of each$"),
    (["--json", "."], r"^error: --json '\.' is a directory; give a file path"),
])
def test_the_op_cost_benchmark_refuses_bad_input_in_one_line(args: list[str], message: str) -> None:
    import re

    done = subprocess.run([sys.executable, "-m", "sanitizer.bench.op_cost", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(message, lines[0]), done.stderr


def test_a_site_asked_of_a_thread_with_fewer_frames_is_unknown_not_an_error() -> None:
    # torch's trace callbacks name the line a few frames up; on a thread of C++ code (an extension's
    # worker recording an event) there is no Python caller, and sys._getframe raised ValueError there.
    import threading

    from sanitizer.sites import UNKNOWN, caller_site

    found: list = []
    thread = threading.Thread(target=lambda: found.append(caller_site(50)))
    thread.start()
    thread.join()
    assert found == [UNKNOWN]


@pytest.mark.parametrize("also_failing", [False, True], ids=["only-unfollowed", "and-a-real-failure"])
def test_pytest_plugin_exits_2_when_all_it_failed_is_what_it_could_not_follow(tmp_path: Path, also_failing) -> None:
    # A custom op with no effect model is not a finding: the run says so and exits 2 (the command's
    # status), never 1; a test that fails on its own still makes it 1.
    done = plugin_run(tmp_path, f"""
        import torch

        LIB = torch.library.Library("kvz_cli_test", "DEF")
        LIB.define("twice(Tensor src, Tensor(a!) dst) -> ()")

        @torch.library.impl(LIB, "twice", "CompositeExplicitAutograd")
        def _twice(src, dst):
            dst.copy_(src * 2)

        def test_own_op():
            dst = torch.zeros(4, device="cuda")
            torch.ops.kvz_cli_test.twice(torch.ones(4, device="cuda"), dst)
            torch.cuda.synchronize()

        def test_other():
            assert not {also_failing}
    """, "test_ops.py")
    out = done.stdout
    assert "kvz-sanitize cannot follow custom op kvz_cli_test::twice" in out, out + done.stderr
    assert done.returncode == (1 if also_failing else 2), out + done.stderr


AUTOGRAD = {  # programs that use torch.nn / autograd on "cuda", as an engine's model tests do
    "autograd": "w = torch.ones(2, 4, device='cuda', requires_grad=True)\ny = w * 2\n",
    "parameter": "w = torch.nn.Parameter(torch.ones(2, 4, device='cuda'))\ny = torch.nn.functional.linear(torch.ones(3, 4, device='cuda'), w)\n",
    "module_to": "m = torch.nn.Linear(4, 2).to('cuda')\n",
}


@pytest.mark.parametrize("case", sorted(AUTOGRAD))
def test_autograd_on_the_simulators_cuda_tensors_is_refused_in_one_line_not_a_crash(tmp_path: Path, case: str) -> None:
    # A CPU build of torch aborts the whole process (a C++ terminate: pytest dies with its workers)
    # when autograd meets a tensor that claims CUDA, and nn.Module.to('cuda') left parameters that
    # claimed CUDA with no memory. The simulator refuses both at the call, in one line, exit 2.
    script = tmp_path / f"{case}.py"
    script.write_text("import torch\n" + AUTOGRAD[case])
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("kvz-sanitize cannot run ") and f"{case}.py:" in line and "on a GPU" in line, line
    assert ("t.data = x" if case == "module_to" else "cannot run autograd") in line


def test_a_module_made_on_the_device_runs_on_the_simulator_under_no_grad(tmp_path: Path) -> None:
    script = tmp_path / "model.py"
    script.write_text(
        "import torch\n"
        "m = torch.nn.Linear(4, 2, device='cuda')\n"
        "w = torch.zeros(3, device='cuda', requires_grad=True)\n"
        "x = torch.ones(3, 4, device='cuda')\n"
        "with torch.no_grad():\n    y = m(x)\n"
        "with torch.inference_mode():\n    z = m(x)\n"
        "assert m.weight.requires_grad and w.requires_grad and not y.requires_grad\n"
        "assert torch.equal(y.cpu(), z.cpu()) and y.shape == (3, 2)\n")
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no race" in done.stdout


def test_pytest_plugin_keeps_a_module_scoped_stream_and_event_across_tests(tmp_path: Path) -> None:
    # One simulated device for the whole run, as one GPU serves every test: a fixture's stream made
    # in the first test is the same stream in the next (it was "not a stream of this runtime").
    done = plugin_run(tmp_path, """
        import pytest, torch

        @pytest.fixture(scope="module")
        def side():
            return torch.cuda.Stream(), torch.cuda.Event(), torch.ones(4, device="cuda")

        @pytest.mark.parametrize("step", range(3))
        def test_uses_it(side, step):
            stream, event, kv = side
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                kv.add_(1)
                event.record()
            torch.cuda.current_stream().wait_event(event)
            assert kv.sum().item() == 4 * (2 + step)
    """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout and "0 distinct races" in done.stdout


def test_pytest_plugin_says_what_the_simulator_cannot_run_at_the_tests_line_and_exits_2(tmp_path: Path) -> None:
    done = plugin_run(tmp_path, """
        import torch

        def test_model():
            torch.nn.Linear(4, 2).to("cuda")
    """)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "test_prog.py::test_model: kvz-sanitize cannot run this call at test_prog.py:5 (torch.nn.Linear(4, 2)" \
           ".to(\"cuda\")): t.data = x between a simulated CUDA tensor and a plain one" in done.stdout, done.stdout
    assert "1 test phase(s) it cannot run" in done.stdout


@pytest.mark.parametrize(("racy", "code", "status"), [(True, 0, 1), (False, 3, 2), (False, 0, 0)])
def test_a_program_that_ends_with_os_exit_keeps_its_races_and_the_commands_status(tmp_path: Path, racy: bool,
                                                                                 code: int, status: int) -> None:
    # os._exit skips finally and atexit: without help the report was never printed and the run exited 0.
    script = tmp_path / "hard_exit.py"
    script.write_text(textwrap.dedent(f"""
        import os, torch
        host = torch.zeros(16, pin_memory=True)
        out = torch.zeros(16, device="cuda")
        out.copy_(host, non_blocking=True)
        if not {racy}:
            torch.cuda.synchronize()
        host.fill_(1.0)
        os._exit({code})
    """))
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == status, done.stdout + done.stderr
    assert done.stdout.count("[host-write-vs-pending-copy]") == (1 if racy else 0), done.stdout
    assert f"hard_exit.py ended with os._exit({code}) at " in done.stderr and "Traceback" not in done.stderr


def test_a_refusal_names_the_sanitizers_own_option_for_the_gpu(tmp_path: Path) -> None:
    # The simulator's refusals were written for the fuzzer and told sanitizer users to pass
    # --backend cuda --cuda-mode free, an option the sanitizer does not have.
    script = tmp_path / "resize.py"
    script.write_text("import torch\nt = torch.empty(4, device='cuda')\nt.resize_(8)\n")
    done = sanitize_cli("--backend", "sim", "--", "python", str(script))
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("kvz-sanitize cannot run ") and "resize.py:3" in line, line
    assert line.endswith("in place; run the code on a GPU instead (--backend cuda), where its calls run as they are"), line
    done = plugin_run(tmp_path, """
        import torch

        def test_resize():
            torch.empty(4, device="cuda").resize_(8)
    """)
    assert done.returncode == 2, done.stdout + done.stderr
    ours = [line for line in done.stdout.splitlines() if "kvz-sanitize cannot run this call" in line]
    assert ours and all(line.endswith("in place; run the code on a GPU instead (--kvz-sanitize-backend cuda), where its "
                                      "calls run as they are") for line in ours), done.stdout
