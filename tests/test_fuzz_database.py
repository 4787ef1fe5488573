"""The example database (fuzz/engine/database.py, fuzz/engine/outbox.py): ``--fuzz-db`` values and
their usage errors, a distinct key per campaign, and the layered local + Redis database on
fakeredis: every operation agrees with Hypothesis's in-memory database through outages, and an
outbox written offline is published on the next contact, once.

A real Redis server and two pytest hosts: tests/test_fleet_redis.py."""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase, InMemoryExampleDatabase, MultiplexedDatabase
from hypothesis.internal.reflection import function_digest
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from fuzz.engine import database
from fuzz.engine.campaigns import default_campaigns
from fuzz.engine.database import DatabaseSpec, example_database, layered_database, parse_database_spec, redact
from fuzz.engine.machine import machine_for
from fuzz.engine.outbox import FuzzDatabaseWarning, OutboxDatabase
from fuzz.options import fuzz_options

fakeredis = pytest.importorskip("fakeredis", reason="fakeredis is not installed: pip install -e '.[fleet]'")
from hypothesis.extra.redis import RedisExampleDatabase  # noqa: E402 (needs redis, which fakeredis brings)

FIX = "give a directory, redis://host:port/N or DIR,redis://host:port/N, e.g. redis://127.0.0.1:6379/0"


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


# -- --fuzz-db values ------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "spec"), [
    (".hypothesis/fuzz-db", DatabaseSpec(Path(".hypothesis/fuzz-db"))),
    ("/var/db/a,b", DatabaseSpec(Path("/var/db/a,b"))),  # a comma alone does not make a URL
    ("redis://fuzz-redis:6379/0", DatabaseSpec(Path(".hypothesis/fuzz-db"), "redis://fuzz-redis:6379/0")),
    ("/var/db,redis://h:6379/3", DatabaseSpec(Path("/var/db"), "redis://h:6379/3")),
    ("d, rediss://:pw@h/2", DatabaseSpec(Path("d"), "rediss://:pw@h/2")),  # TLS, a password, the default port
])
def test_a_database_is_a_directory_a_redis_url_or_a_directory_and_a_url(value, spec):
    assert parse_database_spec(value) == spec


@pytest.mark.parametrize(("value", "message"), [
    ("http://h:6379/0", f"'http://h:6379/0' is not a database: scheme 'http' is neither redis nor rediss; {FIX}"),
    ("db,mysql://h/0", f"'mysql://h/0' is not a database: scheme 'mysql' is neither redis nor rediss; {FIX}"),
    ("redis://:6379/0", f"'redis://:6379/0' names no host; {FIX}"),
    ("redis://h:63x9/0", f"'redis://h:63x9/0': port '63x9' is not a port number (1-65535); {FIX}"),
    ("redis://h:70000/0", f"'redis://h:70000/0': port '70000' is not a port number (1-65535); {FIX}"),
    ("redis://h:0/0", f"'redis://h:0/0': port 0 is not a port number (1-65535); {FIX}"),
    ("redis://h:6379", "'redis://h:6379' names no database number; add it, e.g. redis://h:6379/0"),
    ("redis://h:6379/", "'redis://h:6379/' names no database number; add it, e.g. redis://h:6379/0"),
    ("redis://h:6379/one", "'redis://h:6379/one': database 'one' is not a number; give redis://host:port/N with N "
                           "a number, e.g. redis://127.0.0.1:6379/0"),
    (",redis://h:6379/0", "',redis://h:6379/0' has an empty local directory before the comma; "
                          "give DIR,redis://127.0.0.1:6379/0 or just redis://127.0.0.1:6379/0"),
])
def test_a_bad_database_url_names_the_value_and_the_fix(value, message):
    with pytest.raises(ValueError, match=exactly(message)):
        parse_database_spec(value)


def test_a_redis_url_without_the_redis_package_says_which_extra_installs_it(monkeypatch):
    monkeypatch.setattr(database, "redis_installed", lambda: False)
    with pytest.raises(ValueError, match=exactly(
            "'redis://h:6379/0' needs the redis package, which is not installed; install it with "
            "pip install 'kvzero-fuzz[fleet]' (in a checkout: pip install -e '.[fleet]')")):
        parse_database_spec("redis://h:6379/0")


def test_a_password_never_shows_in_a_message():
    assert redact("redis://user:hunter2@h:6379/0") == "redis://user:***@h:6379/0"
    with pytest.raises(ValueError) as error:
        parse_database_spec("redis://:hunter2@h:6379/x")
    assert "hunter2" not in str(error.value) and "redis://:***@h:6379/x" in str(error.value)


def fake_config(**overrides):
    values = {
        "fuzz_backend": "sim", "cuda_mode": "both", "zeroer": None, "fuzz_profile": None, "fuzz_minutes": None,
        "repro_dir": "repro/failures", "fuzz_db": ".hypothesis/fuzz-db", "fuzz_summary": "repro/summary.json",
        "fuzz_journal": "auto", "hypothesis_seed": None, "fuzz_geometry": None, "fuzz_shard": None, "fuzz_debug": False,
        "fuzz_shrink_seconds": None, "offloader": None, "host_memory": "both", "strict_caller": False,
    }
    values.update(overrides)
    return type("Config", (), {"getoption": lambda self, name, default=None: values[name]})()


def test_the_fuzz_db_option_keeps_the_value_and_writes_into_its_local_layer():
    options = fuzz_options(fake_config(fuzz_db="redis://h:6379/0"))
    assert (options.database, options.database_dir) == ("redis://h:6379/0", Path(".hypothesis/fuzz-db"))
    assert fuzz_options(fake_config(fuzz_db="/srv/db,redis://h:6379/0")).database_dir == Path("/srv/db")


def test_a_bad_fuzz_db_is_a_one_line_usage_error_at_option_parsing():
    with pytest.raises(pytest.UsageError, match=exactly(
            f"--fuzz-db 'redis://h:port/0': port 'port' is not a port number (1-65535); {FIX}")) as error:
        fuzz_options(fake_config(fuzz_db="redis://h:port/0"))
    assert "\n" not in str(error.value)


# -- one key per campaign --------------------------------------------------------------------------


def test_every_default_campaign_has_its_own_database_key():
    """Every campaign of both backends and every family (designs, k-triton, x2, caller faults,
    the zoo): distinct keys, and distinct keys where Hypothesis looks, the digest of the machine."""
    campaigns = [campaign for campaign, _ in default_campaigns(["cuda", "sim"])]
    assert len(campaigns) > 100
    families = {"-k-triton-", "-x2-", "-fault-", "zoo.", "-cuda-free-", "-cuda-controlled-", "-sim-"}
    assert all(any(f in c.id for c in campaigns) for f in families)
    assert len({c.database_key for c in campaigns}) == len(campaigns)
    digests = {function_digest(machine_for(c.config, c.id, database_key=c.database_key)) for c in campaigns}
    assert len(digests) == len(campaigns)


# -- the layered database on fakeredis ---------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def redis_content(server, key: bytes) -> set[bytes]:
    return set(RedisExampleDatabase(fakeredis.FakeRedis(server=server), key_prefix=database.KEY_PREFIX).fetch(key))


KEYS = st.sampled_from([b"k1", b"k2"])
VALUES = st.sampled_from([b"a", b"b"])


class LayeredAgreesWithInMemory(RuleBasedStateMachine):
    """Hypothesis's database-test pattern: the same operations on the layered database (host A)
    and on an in-memory model, with Redis going down and up between them. Host A always answers
    like the model; once A has published its outbox, so do Redis and a second host with an empty
    local directory."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvzero-db-test-"))
        self.server = fakeredis.FakeServer()
        self.host_a = layered_database(self.tmp / "a", fakeredis.FakeRedis(server=self.server), retry_s=0)
        self.host_b = layered_database(self.tmp / "b", fakeredis.FakeRedis(server=self.server), retry_s=0)
        self.model = InMemoryExampleDatabase()

    @rule(key=KEYS, value=VALUES)
    def save(self, key, value):
        self.host_a.save(key, value)
        self.model.save(key, value)

    @rule(key=KEYS, value=VALUES)
    def delete(self, key, value):
        self.host_a.delete(key, value)
        self.model.delete(key, value)

    @rule(src=KEYS, dest=KEYS, value=VALUES)
    def move(self, src, dest, value):
        self.host_a.move(src, dest, value)
        self.model.move(src, dest, value)

    @rule()
    def redis_goes_down(self):
        self.server.connected = False

    @rule()
    def redis_comes_back(self):
        self.server.connected = True

    @invariant()
    def host_a_answers_like_the_model(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FuzzDatabaseWarning)
            for key in (b"k1", b"k2"):
                assert set(self.host_a.fetch(key)) == set(self.model.fetch(key))

    @rule()
    def host_a_publishes(self):
        """Whenever Redis is up, after A publishes its outbox, Redis and host B answer like the
        model (also checked at the end, with Redis back up)."""
        if not self.server.connected:
            return
        self.host_a._wrapped[1].flush()
        for key in (b"k1", b"k2"):
            assert redis_content(self.server, key) == set(self.model.fetch(key))
            assert set(self.host_b.fetch(key)) == set(self.model.fetch(key))

    def teardown(self):
        try:
            self.server.connected = True
            self.host_a_publishes()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def test_the_layered_database_agrees_with_an_in_memory_one_through_outages():
    run_state_machine_as_test(LayeredAgreesWithInMemory, settings=settings(
        max_examples=60, stateful_step_count=10, deadline=None, database=None))


def test_a_host_fetches_what_another_host_saved_in_the_shared_database(tmp_path):
    server = fakeredis.FakeServer()
    host_a = layered_database(tmp_path / "a", fakeredis.FakeRedis(server=server))
    host_b = layered_database(tmp_path / "b", fakeredis.FakeRedis(server=server))
    host_a.save(b"campaign", b"failing example")
    assert list(host_b.fetch(b"campaign")) == [b"failing example"]
    assert isinstance(host_b, MultiplexedDatabase)
    assert list(DirectoryBasedExampleDatabase(str(tmp_path / "b")).fetch(b"campaign")) == []  # only in Redis


def test_an_unreachable_redis_warns_once_and_the_outbox_is_published_by_the_next_run(tmp_path):
    server = fakeredis.FakeServer()
    server.connected = False
    offline = layered_database(tmp_path / "local", fakeredis.FakeRedis(server=server), name="redis://fleet:6379/0")
    with pytest.warns(FuzzDatabaseWarning) as caught:
        offline.save(b"k", b"v1")
        offline.save(b"k", b"v2")
        offline.delete(b"k", b"v1")
    assert len(caught) == 1
    assert re.fullmatch(
        r"example database redis://fleet:6379/0 is unreachable \(ConnectionError: .*\); its writes wait in "
        + re.escape(str(tmp_path / "local" / ".redis-outbox"))
        + r" and are published on the next contact \(tried again after 60 s, and by the next run on this host\)",
        str(caught[0].message))
    assert set(offline.fetch(b"k")) == {b"v2"}  # the local layer answers meanwhile
    assert len(offline._wrapped[1].pending()) == 3

    server.connected = True  # a later run on this host, Redis back
    later = layered_database(tmp_path / "local", fakeredis.FakeRedis(server=server))
    assert set(later.fetch(b"k")) == {b"v2"}
    assert redis_content(server, b"k") == {b"v2"}  # v1 saved, then deleted: published in order
    assert later._wrapped[1].pending() == []


class Recording(InMemoryExampleDatabase):
    """A shared database that counts its calls and can be switched off."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.up = True

    def _call(self) -> None:
        self.calls += 1
        if not self.up:
            raise ConnectionError("down")

    def save(self, key, value):
        self._call()
        super().save(key, value)

    def fetch(self, key):
        self._call()
        return super().fetch(key)


def test_after_a_failure_redis_is_not_tried_again_until_retry_s_has_passed(tmp_path):
    shared, clock = Recording(), FakeClock()
    db = OutboxDatabase(shared, tmp_path / "outbox", unreachable=(ConnectionError,), retry_s=60, clock=clock)
    shared.up = False
    with pytest.warns(FuzzDatabaseWarning):
        db.save(b"k", b"1")
    shared.up = True
    db.save(b"k", b"2")
    assert list(db.fetch(b"k")) == [] and shared.calls == 1 and not db.online  # nothing tried for 60 s
    clock.now = 60.0
    assert sorted(db.fetch(b"k")) == [b"1", b"2"] and db.online  # the outbox went first


def test_an_unreadable_outbox_entry_is_set_aside_and_never_replayed(tmp_path):
    shared = Recording()
    db = OutboxDatabase(shared, tmp_path / "outbox", unreachable=(ConnectionError,))
    (tmp_path / "outbox").mkdir()
    (tmp_path / "outbox" / "00000000000000000001-1-000000.json").write_text("{not json")
    assert db.flush() == 0
    assert sorted(p.name for p in (tmp_path / "outbox").iterdir() if p.name != ".lock") == [
        "00000000000000000001-1-000000.unreadable"]


def test_two_workers_flushing_one_outbox_at_once_publish_each_op_once(tmp_path):
    shared = Recording()
    shared.up = False
    writer = OutboxDatabase(shared, tmp_path / "outbox", unreachable=(ConnectionError,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FuzzDatabaseWarning)
        for i in range(200):
            writer._write("save", b"k", str(i).encode())
    shared.up, shared.calls = True, 0
    workers = [OutboxDatabase(shared, tmp_path / "outbox", unreachable=(ConnectionError,)) for _ in range(2)]
    threads = [threading.Thread(target=w.flush) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert shared.calls == 200 and len(list(shared.fetch(b"k"))) == 200


def test_example_database_is_one_object_per_spec_in_a_process(tmp_path):
    spec = f"{tmp_path / 'db'},redis://127.0.0.1:1/0"
    assert example_database(spec) is example_database(spec)
    assert repr(example_database(spec)).endswith(
        f"OutboxDatabase(redis://127.0.0.1:1/0, outbox='{tmp_path / 'db' / '.redis-outbox'}'))")
