"""``pytest --kvz-sanitize``: a repository's own tests, run under the sanitizer.

Every test runs as it always does, on its own streams, threads and schedule (observe mode); what
the sanitizer saw during each phase (setup, call, teardown) is checked when the phase ends. A phase
with a race fails with the race's report (a test that failed anyway keeps its own failure and gets
the report beside it); the terminal summary lists each distinct race once, with the tests it was
seen in. ``--kvz-sanitize-force`` also holds queued copies to and from pinned memory until the host
next synchronises (:mod:`sanitizer.gpu.forcing`). Something the sanitizer cannot follow fails the
test with one line saying so, unless ``--kvz-sanitize-partial``, and a run whose only failures are
those exits 2 (the command's status for it), never 1; what it assumed (an order between
threads it cannot see) is a note beside the test, never a failure.

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

from racecheck.cli import INTERNAL, USAGE
from sanitizer.races import Race, distinct

PROPERTY = "kvz_sanitize"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvz-sanitize", "race sanitizer for pinned memory and streams (kvzero-fuzz)")
    add = group.addoption
    add("--kvz-sanitize", dest="kvz_sanitize", action="store_true", default=False,
        help="run the tests under the race sanitizer (observe mode: the tests' own schedule)")
    add("--kvz-sanitize-force", dest="kvz_sanitize_force", action="store_true", default=False,
        help="sanitize and hold queued copies to and from pinned memory until the host synchronises, so races "
             "show as wrong values (the simulator always does)")
    add("--kvz-sanitize-partial", dest="kvz_sanitize_partial", action="store_true", default=False,
        help="with --kvz-sanitize: report what the sanitizer cannot follow as a note instead of failing the test")
    add("--kvz-sanitize-backend", dest="kvz_sanitize_backend", default=None,
        help="with --kvz-sanitize: auto (default: cuda when there is a GPU), cuda, or sim (the tests' cuda work "
             "on the CPU simulator)")


def pytest_configure(config: pytest.Config) -> None:
    """Register the sanitizer for this run when it asks for it."""
    from racecheck.cli import USAGE, UsageError

    try:
        _configure(config)
    except UsageError as error:
        pytest.exit(f"error: {error}", returncode=USAGE)


def _configure(config: pytest.Config) -> None:
    from racecheck.cli import UsageError

    asked = config.getoption("kvz_sanitize", False) or config.getoption("kvz_sanitize_force", False)
    backend = config.getoption("kvz_sanitize_backend", None)
    if not asked:
        for flag, given in (("--kvz-sanitize-backend", backend is not None),
                            ("--kvz-sanitize-partial", config.getoption("kvz_sanitize_partial", False))):
            if given:
                raise UsageError(f"{flag} is given without --kvz-sanitize, so nothing would be sanitized; "
                                 f"add --kvz-sanitize (or --kvz-sanitize-force)")
        return
    from sanitizer.runner import prepare, resolve_backend

    mode = "force" if config.getoption("kvz_sanitize_force") else "observe"
    prepare(mode)  # before resolve_backend asks torch about the GPU
    backend = resolve_backend(backend or "auto")
    config.pluginmanager.register(SanitizePlugin(config, backend, mode), "kvz-sanitize")


class SanitizePlugin:
    def __init__(self, config: pytest.Config, backend: str, mode: str) -> None:
        self.config = config
        self.backend = backend
        self.mode = mode
        self.partial = config.getoption("kvz_sanitize_partial")
        self.gpu: Any = None
        # The simulator's session: one for the whole run, as one GPU serves every test: a stream, an
        # event or device memory a module- or session-scoped fixture made lives on into later tests.
        self.session: Any = None
        self.in_test = False
        self.reports: list[tuple[str, dict]] = []  # (nodeid, what its phase found), on the controller
        # On the controller: the phases that failed only because something was not followed, and the
        # others that failed; a run whose every failure is the first kind exits 2 as the command does.
        self.unfollowed_failures: set[str] = set()
        self.internal_failures: set[str] = set()  # failed inside the sanitizer's own code: its bug
        self.other_failures: set[str] = set()

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
        # What the sanitizer could not follow is not a finding: the run says so with exit 2 (add an
        # effect model, or --kvz-sanitize-partial), never 1, unless a test also failed otherwise.
        # A failure of the sanitizer's own exits 3 (racecheck.cli), one of the tests' or a race 1.
        if session.exitstatus == pytest.ExitCode.TESTS_FAILED and not self.other_failures:
            if self.internal_failures:
                session.exitstatus = INTERNAL
            elif self.unfollowed_failures:
                session.exitstatus = USAGE

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Any:
        if self.backend != "sim":
            yield
            return
        from sanitizer.sim.session import ProgramSession, sanitized

        if self.session is None:
            self.session = ProgramSession("tests")
        self.in_test = True
        try:
            with sanitized(self.session, "test"):
                yield
        finally:
            self.in_test = False

    def _checkpoint(self, failed: bool) -> tuple[list[Race], list[str], list[str]]:
        if self.gpu is not None:
            return self.gpu.checkpoint(failed=failed)
        if self.session is None or not self.in_test:
            return [], [], []
        from sanitizer.sites import caller_site

        watch = self.session.watch
        watch.scope_end(caller_site())
        unfollowed, self.session.unfollowed = self.session.unfollowed, []
        return watch.take_races(), unfollowed, watch.take_notes()

    # -- verdicts ----------------------------------------------------------------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        races, unfollowed, notes = self._checkpoint(failed=call.excinfo is not None and not call.excinfo.errisinstance(
            pytest.skip.Exception))
        outcome = yield
        report = outcome.get_result()
        inside, refused = failed_inside_line(call)
        if inside:  # never the test's own failure: said beside its failure, and in the summary
            report.sections.append((f"kvz-sanitize ({call.when})", inside))
        if not races and not unfollowed and not notes and not inside:
            return
        races = [Race(**{**r.__dict__, "where": item.nodeid}) for r in races]
        groups = distinct(races)
        lines = [first.format() + (f"\n  seen:    {len(all_)} times in this {call.when}" if len(all_) > 1 else "")
                 for first, all_ in groups]
        hint = "" if self.partial else "; rerun with --kvz-sanitize-partial to check the rest of the test"
        lines += [f"{line}{hint}" for line in unfollowed]
        failing = bool(races) or (bool(unfollowed) and not self.partial)
        text = "\n\n".join(lines)
        only_unfollowed = False
        if report.passed and failing:
            only_unfollowed = not races
            report.outcome = "failed"
            report.longrepr = text + ("\n\n" + "\n".join(notes) if notes else "")
        else:
            if text:
                report.sections.append((f"kvz-sanitize ({call.when})", text))
            if notes:
                report.sections.append((f"kvz-sanitize notes ({call.when})", "\n".join(notes)))
        # A phase that failed only for what the sanitizer could not follow or refused (the user's to
        # act on: exit 2), or only inside the sanitizer's own code (its bug: exit 3), is no finding.
        failed_in_ours = bool(inside) and not refused and not races
        only_unfollowed = only_unfollowed or (refused and not races)
        report.user_properties.append(
            (PROPERTY, json.dumps({"races": [r.to_json() for r in races], "unfollowed": unfollowed, "notes": notes,
                                   "failed_inside": inside, "refused": refused, "failed_unfollowed": only_unfollowed,
                                   "failed_in_ours": failed_in_ours})))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        failed_unfollowed = failed_in_ours = False
        for name, value in report.user_properties:
            if name == PROPERTY:
                data = json.loads(value)
                failed_unfollowed = failed_unfollowed or data.get("failed_unfollowed", False)
                failed_in_ours = failed_in_ours or data.get("failed_in_ours", False)
                self.reports.append((report.nodeid, data))
        if report.failed:
            phase = f"{report.nodeid} {report.when}"
            (self.internal_failures if failed_in_ours else self.unfollowed_failures if failed_unfollowed
             else self.other_failures).add(phase)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(self.config, "workerinput"):
            return
        races = [Race.from_json(r) for _, data in self.reports for r in data["races"]]
        unfollowed = [(nodeid, line) for nodeid, data in self.reports for line in data["unfollowed"]]
        inside = [(nodeid, data["failed_inside"]) for nodeid, data in self.reports if data.get("failed_inside")]
        refused = sum(1 for _, data in self.reports if data.get("failed_inside") and data.get("refused"))
        notes = sorted({line for _, data in self.reports for line in data.get("notes", [])})
        write = terminalreporter.write_line
        where = f"{self.mode} mode" if self.backend == "cuda" else "simulator"
        terminalreporter.section(f"kvz-sanitize ({where})")
        groups = distinct(races)
        for first, members in groups:
            write(first.format())
            write(f"  seen:    {seen_in(members)}")
            write("")
        for line in notes:
            write(line)
        for nodeid, line in unfollowed + inside:
            write(f"{nodeid}: {line}")
        ours = len(inside) - refused
        write(f"kvz-sanitize: {len(groups)} distinct race{'s' if len(groups) != 1 else ''}"
              f"{'' if not unfollowed else f', {len(unfollowed)} thing(s) not followed'}"
              f"{'' if not notes else f', {len(notes)} note(s)'}"
              f"{'' if not refused else f', {refused} test phase(s) it cannot run'}"
              f"{'' if not ours else f', {ours} test failure(s) inside kvz-sanitize'}")


def failed_inside_line(call: pytest.CallInfo) -> tuple[str, bool]:
    """The line for a test phase that failed inside one of the sanitizer's stand-ins, models or
    patches (:func:`sanitizer.runner.inside_sanitizer`), which it names (empty where it did not),
    and whether it was a refusal that names its fix (the user's to act on, not a bug of ours)."""
    if call.excinfo is None or call.excinfo.errisinstance(pytest.skip.Exception):
        return "", False
    from sanitizer.runner import inside_sanitizer

    found = inside_sanitizer(call.excinfo.value)
    if found is None:
        return "", False
    inside, status = found
    if status != INTERNAL:  # what the refusal says, at the test's line
        from kvdevice.origin import blame

        where = blame(call.excinfo.value).where
        from kvdevice.intercept.errors import in_tool_words

        said = in_tool_words(call.excinfo.value, "a GPU instead (--kvz-sanitize-backend cuda)")
        return f"kvz-sanitize cannot run this {call.when}{f' at {where}' if where else ''}: {said}", True
    return (f"kvz-sanitize: this {call.when} failed inside {inside}, not on its own; a bug of kvz-sanitize, "
            f"not of the test: please report this line"), False


def seen_in(members: list[Race]) -> str:
    """``5 times in 1 test: t.py::test_a`` (the tests it was seen in, at most five named)."""
    tests = sorted({m.where for m in members})
    times = "once" if len(members) == 1 else f"{len(members)} times"
    shown = ", ".join(tests[:5]) + (" ..." if len(tests) > 5 else "")
    return f"{times} in {len(tests)} test{'s' if len(tests) != 1 else ''}: {shown}"
