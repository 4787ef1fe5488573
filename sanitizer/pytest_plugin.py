"""``pytest --kvz-sanitize``: a repository's own tests, run under the sanitizer.

Every test runs as it always does, on its own streams and schedule (observe mode); what the
sanitizer saw during each phase (setup, call, teardown) is checked when the phase ends. A phase
with a race fails with the race's report (a test that failed anyway keeps its own failure and gets
the report beside it); the terminal summary lists each distinct race once, with the tests it was
seen in. ``--kvz-sanitize-force`` also holds queued copies from pinned memory until the host next
synchronises (:mod:`sanitizer.forcing`). Something the sanitizer cannot follow (a CUDA graph
replay) fails the test with one line saying so, unless ``--kvz-sanitize-partial``.

With pytest-xdist each worker sanitizes its own tests; the reports carry their races to the
controller (``user_properties``), which prints the summary.

Example::

    pytest tests/ --kvz-sanitize -n 4
    pytest tests/test_scheduler.py --kvz-sanitize-force
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sanitizer.races import Race, distinct

PROPERTY = "kvz_sanitize"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvz-sanitize", "pinned-staging race sanitizer (kvzero-fuzz)")
    add = group.addoption
    add("--kvz-sanitize", dest="kvz_sanitize", action="store_true", default=False,
        help="run the tests under the race sanitizer (observe mode: the tests' own schedule)")
    add("--kvz-sanitize-force", dest="kvz_sanitize_force", action="store_true", default=False,
        help="sanitize and hold queued copies from pinned memory until the host synchronises, so races show as wrong values")
    add("--kvz-sanitize-partial", dest="kvz_sanitize_partial", action="store_true", default=False,
        help="report what the sanitizer cannot follow (CUDA graph replays) as a note instead of failing the test")
    add("--kvz-sanitize-backend", dest="kvz_sanitize_backend", default="auto",
        help="auto (cuda when there is a GPU), cuda, or sim (the tests' cuda work on the CPU simulator)")


def pytest_configure(config: pytest.Config) -> None:
    """Register the sanitizer for this run when it asks for it."""
    from fuzz.cli import USAGE, UsageError

    try:
        _configure(config)
    except UsageError as error:
        pytest.exit(f"error: {error}", returncode=USAGE)


def _configure(config: pytest.Config) -> None:
    if not (config.getoption("kvz_sanitize", False) or config.getoption("kvz_sanitize_force", False)):
        return
    from sanitizer.runner import prepare, resolve_backend

    mode = "force" if config.getoption("kvz_sanitize_force") else "observe"
    prepare(mode)  # before resolve_backend asks torch about the GPU
    backend = resolve_backend(config.getoption("kvz_sanitize_backend"))
    config.pluginmanager.register(SanitizePlugin(config, backend, mode), "kvz-sanitize")


class SanitizePlugin:
    def __init__(self, config: pytest.Config, backend: str, mode: str) -> None:
        self.config = config
        self.backend = backend
        self.mode = mode
        self.partial = config.getoption("kvz_sanitize_partial")
        self.gpu: Any = None
        self.session: Any = None  # the simulator's session of the running test
        self._scope: Any = None
        self._seen = 0
        self.reports: list[tuple[str, dict]] = []  # (nodeid, what its phase found), on the controller

    # -- the sanitizer's life ---------------------------------------------------------------------
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.backend == "cuda":
            from sanitizer.runner import GpuSanitizer

            self.gpu = GpuSanitizer(self.mode)
            self.gpu.start()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.gpu is not None:
            self.gpu.stop()
            self.gpu = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Any:
        if self.backend != "sim":
            yield
            return
        from sanitizer.simulated import ProgramSession

        self.session, self._seen = ProgramSession(item.nodeid), 0
        with self.session.running("test"):
            yield
        self.session = None

    def _checkpoint(self) -> tuple[list[Race], list[str]]:
        if self.gpu is not None:
            return self.gpu.checkpoint()
        if self.session is None:
            return [], []
        from sanitizer.simulated import race_of

        hazards = self.session.rt.hb.hazards[self._seen:]
        self._seen += len(hazards)
        return [race_of(self.session, h) for h in hazards], []

    # -- verdicts ----------------------------------------------------------------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        races, unfollowed = self._checkpoint()
        outcome = yield
        report = outcome.get_result()
        if not races and not unfollowed:
            return
        races = [Race(**{**r.__dict__, "where": item.nodeid}) for r in races]
        groups = distinct(races)
        lines = [first.format() + (f"\n  seen:    {len(all_)} times in this {call.when}" if len(all_) > 1 else "")
                 for first, all_ in groups]
        hint = "" if self.partial else "; rerun with --kvz-sanitize-partial to check the rest of the test"
        lines += [f"{line}{hint}" for line in unfollowed]
        text = "\n\n".join(lines)
        failing = bool(races) or (bool(unfollowed) and not self.partial)
        if report.passed and failing:
            report.outcome = "failed"
            report.longrepr = text
        else:
            report.sections.append((f"kvz-sanitize ({call.when})", text))
        report.user_properties.append(
            (PROPERTY, json.dumps({"races": [r.to_json() for r in races], "unfollowed": unfollowed})))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for name, value in report.user_properties:
            if name == PROPERTY:
                self.reports.append((report.nodeid, json.loads(value)))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(self.config, "workerinput"):
            return
        races = [Race.from_json(r) for _, data in self.reports for r in data["races"]]
        unfollowed = [(nodeid, line) for nodeid, data in self.reports for line in data["unfollowed"]]
        write = terminalreporter.write_line
        where = f"{self.mode} mode" if self.backend == "cuda" else "simulator"
        terminalreporter.section(f"kvz-sanitize ({where})")
        groups = distinct(races)
        for first, members in groups:
            tests = sorted({m.where for m in members})
            write(first.format())
            write(f"  seen in: {len(members)} place{'s' if len(members) != 1 else ''} over {len(tests)} test"
                  f"{'s' if len(tests) != 1 else ''}: {', '.join(tests[:5])}{' ...' if len(tests) > 5 else ''}")
            write("")
        for nodeid, line in unfollowed:
            write(f"{nodeid}: {line}")
        write(f"kvz-sanitize: {len(groups)} distinct race{'s' if len(groups) != 1 else ''}"
              f"{'' if not unfollowed else f', {len(unfollowed)} thing(s) not followed'}")
