"""pytest plugin for the GPU check (.gpu/check): one JSON line per test phase report, written by the
controller as each report arrives, so a stage cut off by its watchdog still leaves every outcome
and traceback it saw (pytest's own junit XML is written only at the end of a session).

Loaded with ``-p gpu_check_log`` (``.gpu`` on ``PYTHONPATH``); writes to the file ``KVZ_TEST_LOG`` names.
"""

from __future__ import annotations

import json
import os
import time

import pytest

_PATH = os.environ.get("KVZ_TEST_LOG")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _PATH or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller writes every report, the workers' included
    if report.when != "call" and report.passed:
        return
    record = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration": round(report.duration, 3),
        "worker": getattr(report, "node", None) and getattr(report.node, "gateway", None) and report.node.gateway.id,
        "at": time.time(),
    }
    if report.failed:
        record["longrepr"] = str(report.longrepr)[-6000:]
    with open(_PATH, "a") as log:
        log.write(json.dumps(record) + "\n")
