"""The pytest plugin behind ``pytest fuzz``: options, campaign parametrization, GPU per worker,
interrupts, crashed workers, the run's registry of shrunk bugs (shared with every xdist worker, so
a bug is shrunk once per run: :mod:`fuzz.engine.known_bugs`) and the run's summary.

It is registered by this distribution's ``pytest11`` entry point, named ``fuzz.plugin``, so it
loads in any repository where the package is installed: the entry point's module
(:mod:`kvzero_fuzz.pytest_plugin`) first checks that ``fuzz``, ``repro`` and ``zeroer`` are this
distribution's packages, then re-exports this module's hooks and fixtures. The checkout's own
``-p fuzz.plugin`` (``pyproject.toml``) loads that entry point when the package is installed, and
this module directly when it is not, so a checkout works without installing. Its campaigns live in
:mod:`fuzz.test_campaigns`; ``pytest --zeroer SPEC`` with no test path collects them from the
installed package (:func:`pytest_load_initial_conftests`), so a user's repository needs no test
file of its own.

Exit status: 0 clean, 1 a finding (or a missed self-check), 2 a usage error (one line naming the
value and the fix; ``--fuzz-debug`` shows the traceback) or an interrupted run, 3 an internal error.
"""

from __future__ import annotations

import atexit
import fnmatch
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from racecheck import interrupts

# Now, before the imports below (torch alone takes seconds), rather than in pytest_configure. Python's
# own SIGINT handler raises KeyboardInterrupt wherever the main thread is, and when that is a
# weakref callback of the import machinery CPython prints "Exception ignored" and drops it: the run
# would go on to its end as if Ctrl-C had never come. Ours marks the process interrupted before it
# raises, so a dropped KeyboardInterrupt still stops the run before its next example.
interrupts.install(until_started=True)  # until pytest_configure: other plugins are still importing

from fuzz.engine.campaigns import Campaign, default_campaigns, offload_campaigns  # noqa: E402
from fuzz.engine.journal import Journal, rescue  # noqa: E402
from fuzz.engine.known_bugs import KnownBugs  # noqa: E402
from fuzz.engine.summary import harness_status, is_unexpected, render_summary, write_summary  # noqa: E402
from fuzz.engine.trace import read_trace  # noqa: E402
from fuzz.options import FuzzOptions, check_output_paths, fuzz_options, gpu_for_worker  # noqa: E402
from racecheck.cli import USAGE as USAGE_EXIT  # noqa: E402
from zeroer.errors import ZeroerError  # noqa: E402
from racecheck.gate import request_gate_settings  # noqa: E402

CAMPAIGNS_MODULE = Path(__file__).with_name("test_campaigns.py")
BUGS_KEY = "kvzero_fuzz_bugs"  # workerinput: the run's registry of shrunk bugs (fuzz.engine.known_bugs)


class _Run:
    """What the controller learns over the run: registered as a plugin of the session, it hears
    every report (a campaign's result rides in pytest's own ``record_property``, relayed from
    xdist workers)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.time()  # wall clock: compared with trace files' modification times
        self.saved: list[dict] = []  # findings saved when Ctrl-C cut their campaign off (_saved_at_interruption)
        self.results: list[dict] = []
        self.selected: list[str] = []  # campaign ids this run was to run
        self.deselection_done = False  # every plugin's pytest_collection_modifyitems (-k, -m) has run
        self.crashed: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            for name, value in report.user_properties:
                if name == "fuzz":
                    record = json.loads(value) if isinstance(value, str) else value
                    self.results.append(record)
                    if record.get("found") and record.get("expect") != "finds":
                        interrupts.note_found()  # a run ended by force after this exits 1, as one that ends does
                    self.progress(record)

    def progress(self, record: dict) -> None:
        """One line per finished campaign, so a long run shows where it is."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:
            return
        total = len(self.selected) or "?"
        verdict = ("found (expected)" if record["expect"] == "finds" else "FINDING") if record["found"] else (
            "MISSED" if record["expect"] == "finds" else "clean")
        if record.get("resource_error"):
            verdict = "RESOURCE ERROR (GPU out of memory, not judged)"
        elif record.get("harness_error"):
            verdict = "HARNESS ERROR (not judged)"
        elif record.get("same_as"):
            verdict += f" (same bug as {record['same_as']}: not shrunk again)"
        reporter.ensure_newline()
        reporter.write_line(
            f"[{len(self.results)}/{total}] {record['campaign']}: {verdict}, {record['examples']} examples, "
            f"{record['steps']} steps, {record['seconds']:.1f} s"
        )

    @pytest.hookimpl(tryfirst=True)
    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo) -> None:
        """Ctrl-C: pytest formats the interruption's whole traceback (the source and arguments of
        every frame, and of every exception it cut short) only to print its last line; through
        Hypothesis's engine that is a hundred frames and seconds of parsing after the user asked
        to stop. Keep the frame that is printed (``--full-trace`` keeps everything)."""
        # Only for Ctrl-C: a pytest.exit's last frame is pytest's own, hidden, and a traceback of
        # hidden frames alone makes pytest's report of it fail (a usage error would print a traceback).
        if isinstance(excinfo.value, KeyboardInterrupt) and not self.config.getoption("fulltrace", False):
            excinfo.traceback = excinfo.traceback[-1:]
            excinfo.value.__cause__, excinfo.value.__suppress_context__ = None, True


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fuzz", "KV block zeroer fuzzing (kvzero-fuzz)")
    add = group.addoption
    add("--backend", dest="fuzz_backend", default="auto", help="auto, sim or cuda (auto: cuda when a GPU is present)")
    add("--cuda-mode", dest="cuda_mode", default="both", help="cuda campaigns: both, controlled (gates) or free (real timing)")
    add("--zeroer", dest="zeroer", default=None, help="fuzz one zeroer: a built-in name, module:attr or path/to/file.py:attr naming factory(cache, runtime)")
    add("--offloader", dest="offloader", default=None, help="fuzz one KV offloader instead: module:attr or path/to/file.py:attr naming factory(cache, host_pool, runtime) (docs/offload-contract.md)")
    add("--host-memory", dest="host_memory", default="both", help="with --offloader: the host pool it stores into: pinned, registered (cudaHostRegister) or both")
    add("--strict-caller", dest="strict_caller", action="store_true", default=False, help="the zeroer campaigns' stricter caller: no device synchronisation after the zeroer's warm-up (docs/contract.md)")
    add("--geometry", dest="fuzz_geometry", default=None, help="with --zeroer or --offloader: NAME[,NAME...] or all (default: every geometry it supports)")
    add("--repro-dir", dest="repro_dir", default=None, help="where shrunk traces of findings are written (default: repro/failures under the rootdir)")
    add("--fuzz-profile", dest="fuzz_profile", default=None, help="quick (default), ci (default when CI is set) or nightly")
    add("--fuzz-minutes", dest="fuzz_minutes", default=None, help="wall-clock budget for the whole run (selects the nightly profile)")
    add("--fuzz-db", dest="fuzz_db", default=".hypothesis/fuzz-db", help="example database (nightly): DIR, redis://host:port/N (shared by a fleet, over the local .hypothesis/fuzz-db) or DIR,redis://host:port/N")
    add("--fuzz-summary", dest="fuzz_summary", default=None, help="where the run's JSON summary is written (default: repro/summary.json under the rootdir)")
    add("--fuzz-journal", dest="fuzz_journal", default="auto", help="save each op before it runs, so a crashed worker leaves its trace: auto (on for cuda), on or off")
    add("--fuzz-shard", dest="fuzz_shard", default=None, help="i/N: run the i-th of N disjoint shares of the campaigns (a sharded nightly)")
    add("--fuzz-shrink-seconds", dest="fuzz_shrink_seconds", default=None, help="how long each stage of shrinking a finding may take, in seconds (default: 120 on the simulator, 30 on cuda); the smallest trace so far is kept")
    add("--fuzz-debug", dest="fuzz_debug", action="store_true", default=False, help="show the traceback of a usage or harness error (pytest's own --debug writes its log)")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """``pytest --zeroer SPEC`` (or ``--pyargs fuzz``) in a repository with no campaign file of
    its own: collect the installed campaigns."""
    if any(a in ("--zeroer", "--offloader") or a.startswith(("--zeroer=", "--offloader=")) for a in args) and not any(
            not a.startswith("-") and Path(a.split("::")[0]).exists() for a in args):
        args.append(str(CAMPAIGNS_MODULE))


def _usage_exit(config: pytest.Config, error: BaseException) -> None:
    if config.getoption("fuzz_debug", False):
        raise error
    pytest.exit(f"error: {error}", returncode=USAGE_EXIT)


@pytest.hookimpl(tryfirst=True, specname="pytest_configure")
def pytest_configure_requests_gate_settings_first(config: pytest.Config) -> None:
    """Before this worker's CUDA context exists, and before any other plugin's configure can start
    CUDA's driver (``--kvz-sanitize`` asks torch whether there is a GPU in its own): the queues and
    eagerly loaded modules gated streams need (:func:`racecheck.gate.request_gate_settings`)."""
    config._fuzz_on_cuda = _may_fuzz_on_cuda(config)
    if config._fuzz_on_cuda:
        request_gate_settings()


def pytest_configure(config: pytest.Config) -> None:
    fuzzing_on_cuda = config._fuzz_on_cuda  # decided first (pytest_configure_requests_gate_settings_first)
    try:
        # Any other run is not to start CUDA's driver here either: the program's settings (its own
        # CUDA_MODULE_LOADING, a device list) are read when it starts.
        config._fuzz_options = fuzz_options(config, torch_gpu_present if fuzzing_on_cuda else gpu_listed)
        if not hasattr(config, "workerinput"):
            _check_something_runs(config._fuzz_options)
    except (pytest.UsageError, ZeroerError) as error:
        _usage_exit(config, error)
    config._fuzz_run = _Run(config)
    config.pluginmanager.register(config._fuzz_run, "fuzz-run")
    config._fuzz_bugs = _bug_registry(config)
    _size_gpu_workers(config)
    interrupts.started()


def torch_gpu_present() -> bool:
    """torch's check (it starts CUDA's driver)."""
    import torch

    return torch.cuda.is_available()


def gpu_listed() -> bool:
    """Whether NVML lists a GPU this process may use, without starting CUDA's driver (torch asks
    the driver only where NVML cannot answer)."""
    import torch

    return torch.cuda.device_count() > 0


def _may_fuzz_on_cuda(config: pytest.Config) -> bool:
    """Whether this run collects the campaigns and may run them on a GPU: then its gated streams need
    CUDA's settings asked for before any CUDA call (:func:`racecheck.gate.request_gate_settings`),
    decided from the command line alone. The plugin loads into every pytest run where the package
    is installed: an engine's own test run is not to get eager module loading (seconds at its first
    CUDA call, and GPU memory) or another count of hardware queues because this package is there."""
    if config.getoption("fuzz_backend", "auto") == "sim":
        return False
    if config.getoption("zeroer", None) or config.getoption("offloader", None):
        return True  # the installed campaigns are collected (pytest_load_initial_conftests)
    campaigns = CAMPAIGNS_MODULE.resolve()
    for arg in config.args:
        name = arg.split("::")[0]
        if config.getoption("pyargs", False) and (name == "fuzz" or name.startswith("fuzz.")):
            return True
        path = Path(config.invocation_params.dir, name).resolve()
        if path == campaigns or (path in campaigns.parents and _collected_below(config, path, campaigns)):
            return True
    return False


def _collected_below(config: pytest.Config, directory: Path, module: Path) -> bool:
    """Whether pytest, collecting ``directory``, walks down to ``module``: it skips a virtualenv
    (an engine's project root holds its ``.venv``, where this package is installed) unless told
    to collect in one, and every directory ``norecursedirs`` names."""
    if config.getoption("collect_in_virtualenv", False):
        return True
    skipped = config.getini("norecursedirs")
    for part in module.relative_to(directory).parents:
        below = directory / part
        if below == directory:
            continue
        if (below / "pyvenv.cfg").exists() or below.name in ("site-packages", "dist-packages"):
            return False
        if any(fnmatch.fnmatch(below.name, pattern) for pattern in skipped):
            return False
    return True


def _bug_registry(config: pytest.Config) -> str | None:
    """The directory of the run's shrunk bugs (fuzz.engine.known_bugs), shared by all its
    campaigns: made by the controlling process, or the only one, and handed to each xdist worker
    in its ``workerinput`` (:func:`pytest_configure_node`). A fresh one per run, removed at its end:
    a bug of an earlier run is never taken as shrunk."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return workerinput.get(BUGS_KEY)
    try:
        directory = tempfile.mkdtemp(prefix="kvzero-fuzz-bugs-")
    except OSError:  # no temporary directory to write in: every campaign shrinks its own findings
        return None
    config.add_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
    return directory


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist, in the controller: a worker is about to start; give it the run's registry."""
    directory = getattr(node.config, "_fuzz_bugs", None)
    if directory is not None:
        node.workerinput[BUGS_KEY] = directory


def _size_gpu_workers(config: pytest.Config) -> None:
    """``-n N`` (or ``-n auto``) on the cuda backend: run no more xdist workers than the GPU
    memory free now holds (fuzz.engine.gpu_workers), and say what was chosen."""
    options = config._fuzz_options
    requested = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or "cuda" not in options.backends or not isinstance(requested, int) or requested < 2:
        return
    from fuzz.engine.gpu_workers import plan_for

    configs = [campaign.config for campaign, skipped in _campaigns(options) if skipped is None]
    if not configs:
        return
    try:
        plan = plan_for(requested, configs)
    except (OSError, RuntimeError, ValueError) as error:
        print(f"fuzz: could not size the GPU workers ({error}); running {requested}", file=sys.stderr)
        return
    config.option.numprocesses = plan.chosen
    print(f"fuzz: {plan.describe()}", file=sys.stderr)


def _check_something_runs(options: FuzzOptions) -> None:
    """A component named on the command line whose every campaign its own declaration skips (an
    offloader declaring other geometries than ``--geometry``) would test nothing and pass: a usage error."""
    if options.offloader is None and options.zeroer is None:
        return
    pairs = _campaigns(options)
    if pairs and all(skipped for _, skipped in pairs):
        reasons = "; ".join(sorted({skipped for _, skipped in pairs if skipped}))
        raise pytest.UsageError(f"nothing to fuzz: every campaign is skipped ({reasons}); choose what it declares "
                                f"with --geometry and --host-memory, or drop them")


def _campaigns(options: FuzzOptions) -> list[tuple[Campaign, str | None]]:
    if options.offloader is not None:
        chosen = offload_campaigns(options.backends, options.offloader, options.geometries, options.host_memory)
    else:
        chosen = default_campaigns(options.backends, options.zeroer, options.geometries, warmup_sync=not options.strict_caller)
    pairs = [(c, skipped) for c, skipped in chosen if c.config.backend == "sim" or c.config.mode in options.cuda_modes]
    if options.shard is not None:  # every i-th of the sorted list: disjoint, and together all of them
        index, count = options.shard
        pairs = [pair for position, pair in enumerate(pairs) if position % count == index]
    return pairs


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "campaign" not in metafunc.fixturenames:
        return
    pairs = _campaigns(metafunc.config._fuzz_options)
    params = [pytest.param(c, id=c.id, marks=[pytest.mark.skip(reason=skipped)] if skipped else []) for c, skipped in pairs]
    metafunc.parametrize("campaign", params)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected: what remains is the run's
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    run = getattr(config, "_fuzz_run", None)
    if run is not None:
        run.deselection_done = True
    # Only when campaigns will run, and not again in each xdist worker.
    if any("campaign" in getattr(item, "fixturenames", ()) for item in items) and not hasattr(config, "workerinput"):
        try:
            check_output_paths(config._fuzz_options)
        except pytest.UsageError as error:
            _usage_exit(config, error)


def pytest_collection_finish(session: pytest.Session) -> None:
    # The campaigns this run is to run, known only now: -k and -m deselect in other plugins'
    # pytest_collection_modifyitems, and a partial summary's "not run" must not count those.
    # pytest calls this hook even when collection was cut off (a Ctrl-C during -k's deselection):
    # then what it lists was never the run's selection, and the run selected nothing yet.
    run = getattr(session.config, "_fuzz_run", None)
    if run is not None and not run.deselection_done:
        return
    _select(session.config, [item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """pytest-xdist, in the controller (which collects nothing itself): what the workers will run."""
    _select(node.config, ids)


def _select(config: pytest.Config, nodeids: list[str]) -> None:
    run = getattr(config, "_fuzz_run", None)
    if run is None or run.selected:
        return
    skipped = {c.id for c, why in _campaigns(config._fuzz_options) if why}  # they never produce a result
    ids = [_campaign_id(nodeid) for nodeid in nodeids]
    run.selected = [c for c in ids if c is not None and c not in skipped]


def _campaign_id(nodeid: str) -> str | None:
    """``fuzz/test_campaigns.py::test_campaign[ring-tiny-sim-k-torch-shard0]`` -> the campaign id."""
    if "::test_campaign[" not in nodeid or not nodeid.endswith("]"):
        return None
    return nodeid[nodeid.index("[") + 1: -1]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_newgateway(gateway) -> None:
    """pytest-xdist, in the controller: a worker process started. Ctrl-C in a terminal reaches it
    through the process group, a SIGTERM to the controller alone would not: pass it on."""
    pid = _worker_pid(gateway)
    if pid is not None:
        interrupts.forward_to(pid)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    pid = _worker_pid(node.gateway)
    if pid is not None:
        interrupts.forget(pid)


def _worker_pid(gateway) -> int | None:
    try:  # execnet's remote info, as xdist itself reads it (cached after the first call)
        return int(gateway._rinfo().pid)
    except Exception:  # noqa: BLE001 - not a local process, or gone: nothing to pass on to
        return None


@pytest.fixture
def fuzz_options_fixture(request: pytest.FixtureRequest) -> FuzzOptions:
    return request.config._fuzz_options


@pytest.fixture
def fuzz_cuda_device(request: pytest.FixtureRequest) -> int | None:
    """The GPU this xdist worker owns (round-robin by worker index), or None on the simulator."""
    import torch

    if not torch.cuda.is_available():
        return None
    # Selected by the campaign itself (fuzz.test_campaigns), where a GPU out of memory is a
    # resource error of the campaign rather than a pytest error with a traceback.
    return gpu_for_worker(os.environ.get("PYTEST_XDIST_WORKER"), torch.cuda.device_count())


@pytest.fixture
def fuzz_journal(request: pytest.FixtureRequest, campaign: Campaign) -> Journal | None:
    """This worker's in-flight journal for the campaign, when --fuzz-journal says so."""
    options = request.config._fuzz_options
    if not options.journal:
        return None
    return Journal(options.repro_dir, os.environ.get("PYTEST_XDIST_WORKER"), campaign.id)


@pytest.fixture
def fuzz_known_bugs(request: pytest.FixtureRequest, campaign: Campaign) -> KnownBugs | None:
    """The bugs other campaigns of this run have shrunk (fuzz.engine.known_bugs), or None where
    this worker cannot see the run's registry (each campaign then shrinks its own findings)."""
    return KnownBugs.at(getattr(request.config, "_fuzz_bugs", None), campaign.id)


@pytest.fixture
def fuzz_budget(request: pytest.FixtureRequest) -> float | None:
    """Seconds for one campaign when --fuzz-minutes is set: the run's budget spread over the
    campaigns, times the number of workers running them side by side."""
    options = request.config._fuzz_options
    if options.minutes is None:
        return None
    workers = int(getattr(request.config, "workerinput", {}).get("workercount", 1))
    count = max(1, len(request.session.items))
    return options.minutes * 60.0 * workers / count


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    """pytest-xdist: a worker died (a CUDA fault, an OOM kill). Save its journal as a trace and
    name it in the failure, so the crash can be replayed; the summary lists it as crashed."""
    config = report.node.config if hasattr(report, "node") else None
    options = getattr(config, "_fuzz_options", None)
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
    campaign = _campaign_id(crashitem)
    if options is None or campaign is None:
        return
    config._fuzz_run.crashed.append(campaign)
    path = rescue(options.repro_dir, worker, campaign) if worker is not None else None
    if path is not None:
        report.longrepr = f"{report.longrepr}\nthe ops it was running are saved in {path}\nreplay: python -m repro replay {path}"


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if interrupts.interrupted():
        # pytest's unraisable-exception check collects garbage ten times over at exit, each a
        # walk over the ~300k objects torch and the imports made: after Ctrl-C, leave them be
        # (until the interpreter's own teardown, which frees them as usual).
        gc.freeze()
        atexit.register(gc.unfreeze)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    run = getattr(config, "_fuzz_run", None)
    if hasattr(config, "workerinput") or run is None:
        return
    # Interrupted (Ctrl-C, SIGTERM): pytest says 2; a finding made before the interruption wins,
    # in a campaign that ended or in one cut off after it (saved by whichever process ran it).
    interrupted = interrupts.interrupted() or exitstatus == pytest.ExitCode.INTERRUPTED
    if interrupted:
        run.saved = _saved_at_interruption(run, config._fuzz_options)
    if interrupted and (any(r["found"] != (r["expect"] == "finds") and r["found"] for r in run.results)
                        or any(s["expect"] == "clean" for s in run.saved)):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif interrupted and not run.crashed:
        # No finding: a campaign the signal cut off may still have failed, with whatever the
        # signal broke on its way out (seen once in 40 signalled runs: exit 1, "1 failed", for a
        # race-free zeroer whose summary listed no finding). That failure is no verdict.
        session.exitstatus = pytest.ExitCode.INTERRUPTED
    # No verdict where something stood in the way and nothing else went wrong: the harness could
    # not follow or run the zeroer (fuzz.engine.harness_error: 3, or 2 where the user can act),
    # the GPU ran out of memory (racecheck.resources: 2, run fewer workers); never 1, which
    # would say the fuzzer found something.
    if not any(map(is_unexpected, run.results)) and not run.crashed and not interrupted:
        statuses = [harness_status(run.results) or 0] + [USAGE_EXIT for r in run.results if r.get("resource_error")]
        if max(statuses):
            session.exitstatus = max(statuses)


def _saved_at_interruption(run: _Run, options: FuzzOptions) -> list[dict]:
    """The findings of campaigns that Ctrl-C cut off after they had found something: the process
    that ran each (an xdist worker, whose own report of it never reaches this one) saved its
    program so far under ``--repro-dir`` (fuzz.engine.campaigns). They are the trace files written
    since this run started for a campaign it selected that has no result."""
    ended = {r["campaign"] for r in run.results}
    expect = {c.id: c.expect for c, _ in _campaigns(options)}
    saved = []
    for path in sorted(Path(options.repro_dir).glob("*.json")):
        if path.name.startswith("."):  # a worker's in-flight journal (fuzz.engine.journal), not a trace
            continue
        try:
            if path.stat().st_mtime < run.started:
                continue
            data = read_trace(path)
        except (OSError, ValueError):  # unreadable, or replaced while read
            continue
        campaign = data.get("campaign") if isinstance(data, dict) else None
        if campaign in run.selected and campaign not in ended:
            saved.append({"campaign": campaign, "expect": expect.get(campaign, "clean"), "trace": str(path)})
    return saved


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    run = getattr(config, "_fuzz_run", None)
    if hasattr(config, "workerinput") or run is None:
        return
    interrupted = interrupts.interrupted() or exitstatus == pytest.ExitCode.INTERRUPTED
    # Stopped by a signal before any campaign ended, the run still says what it did not run
    # (partial). Only a signal: a usage error's pytest.exit has pytest's "interrupted" status too.
    if not (run.results or run.crashed or (interrupts.interrupted() and run.selected)):
        return
    options = config._fuzz_options
    ended = {r["campaign"] for r in run.results} | set(run.crashed)
    # Interrupted after every campaign had ended (while printing, say), the run is still whole.
    partial = interrupted and not (run.selected and set(run.selected) <= ended)
    text, data = render_summary(run.results, options.profile.name, selected=run.selected, crashed=run.crashed,
                                partial=partial, saved=run.saved)
    terminalreporter.write_sep("=", "fuzz summary" + (" (partial: the run was interrupted)" if partial else ""))
    terminalreporter.write_line(text)
    written = write_summary(options.summary_path, data)
    terminalreporter.write_line(f"summary written to {written}")
