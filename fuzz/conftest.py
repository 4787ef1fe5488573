"""pytest wiring for ``pytest fuzz``: options, campaign parametrization, GPU per worker, summary."""

from __future__ import annotations

import json
import os

import pytest

from fuzz.engine.campaigns import default_campaigns
from fuzz.engine.journal import Journal, rescue
from fuzz.options import fuzz_options, gpu_for_worker
from fuzz.engine.summary import render_summary
from zeroer.runtime.cuda.gate import request_hardware_queues

_RESULTS: list[dict] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fuzz", "KV block zeroer fuzzing")
    group.addoption("--backend", dest="fuzz_backend", default="auto", help="auto, sim or cuda (auto: cuda when a GPU is present)")
    group.addoption("--cuda-mode", dest="cuda_mode", default="both", help="cuda campaigns: both, controlled (gates) or free (real timing)")
    group.addoption("--zeroer", dest="zeroer", default=None, help="fuzz one zeroer: a built-in name, module:attr or path/to/file.py:attr naming factory(cache, runtime)")
    group.addoption("--repro-dir", dest="repro_dir", default="repro/failures", help="where shrunk traces of findings are written")
    group.addoption("--fuzz-profile", dest="fuzz_profile", default=None, help="quick (default), ci (default when CI is set) or nightly")
    group.addoption("--fuzz-minutes", dest="fuzz_minutes", default=None, help="wall-clock budget for the whole run (selects the nightly profile)")
    group.addoption("--fuzz-db", dest="fuzz_db", default=".hypothesis/fuzz-db", help="example database directory (nightly); point several runs at one place to share it")
    group.addoption("--fuzz-summary", dest="fuzz_summary", default="repro/summary.json", help="where the run's JSON summary is written")
    group.addoption("--fuzz-journal", dest="fuzz_journal", default="auto", help="save each op before it runs, so a crashed worker leaves its trace: auto (on for cuda), on or off")


def pytest_configure(config: pytest.Config) -> None:
    request_hardware_queues()  # before this worker's CUDA context exists: gated streams need their own queues
    config._fuzz_options = fuzz_options(config)  # raises pytest.UsageError on bad values


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "campaign" not in metafunc.fixturenames:
        return
    options = metafunc.config._fuzz_options
    campaigns = [
        c for c in default_campaigns(options.backends, options.zeroer)
        if c.config.backend == "sim" or c.config.mode in options.cuda_modes
    ]
    metafunc.parametrize("campaign", campaigns, ids=[c.id for c in campaigns])


@pytest.fixture
def fuzz(request: pytest.FixtureRequest):
    return request.config._fuzz_options


@pytest.fixture
def cuda_device(request: pytest.FixtureRequest) -> int | None:
    """The GPU this xdist worker owns (round-robin by worker index), or None on the simulator."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = gpu_for_worker(os.environ.get("PYTEST_XDIST_WORKER"), torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


@pytest.fixture
def journal(request: pytest.FixtureRequest, campaign) -> Journal | None:
    """This worker's in-flight journal for the campaign, when --fuzz-journal says so."""
    options = request.config._fuzz_options
    if not options.journal:
        return None
    return Journal(options.repro_dir, os.environ.get("PYTEST_XDIST_WORKER"), campaign.id)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    """pytest-xdist: a worker died (a CUDA fault kills the process). Save its journal as a trace
    and name it in the failure, so the crash can be replayed."""
    options = report.node.config._fuzz_options if hasattr(report, "node") else None
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
    if options is None or worker is None or "[" not in crashitem:
        return
    campaign = crashitem[crashitem.index("[") + 1 : -1]
    path = rescue(options.repro_dir, worker, campaign)
    if path is not None:
        report.longrepr = f"{report.longrepr}\nthe ops it was running are saved in {path}\nreplay: python -m repro replay {path}"


@pytest.fixture
def campaign_budget(request: pytest.FixtureRequest) -> float | None:
    """Seconds for one campaign when --fuzz-minutes is set: the run's budget spread over the
    campaigns, times the number of workers running them side by side."""
    options = request.config._fuzz_options
    if options.minutes is None:
        return None
    workers = int(getattr(request.config, "workerinput", {}).get("workercount", 1))
    count = max(1, len(request.session.items))
    return options.minutes * 60.0 * workers / count


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        for name, value in report.user_properties:
            if name == "fuzz":
                _RESULTS.append(json.loads(value) if isinstance(value, str) else value)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _RESULTS:
        return
    options = config._fuzz_options
    text, data = render_summary(_RESULTS, options.profile.name)
    terminalreporter.write_sep("=", "fuzz summary")
    terminalreporter.write_line(text)
    from fuzz.atomic_file import write_json_atomically

    write_json_atomically(options.summary_path, data)
    terminalreporter.write_line(f"summary written to {options.summary_path}")
