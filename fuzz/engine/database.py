"""The example database a campaign saves its failing and interesting examples in.

``--fuzz-db`` names it, in one of three forms:

* ``DIR``: a directory on this host (Hypothesis's ``DirectoryBasedExampleDatabase``); the default
  is ``.hypothesis/fuzz-db``.
* ``redis://host:port/N``: a Redis database shared by a fleet of hosts (Hypothesis's own
  ``RedisExampleDatabase``, from ``hypothesis.extra.redis``; ``pip install 'kvzero-fuzz[fleet]'``),
  layered over the local directory ``.hypothesis/fuzz-db``. ``rediss://`` is the same over TLS,
  and ``redis://:PASSWORD@host:port/N`` carries a password (it is never printed).
* ``DIR,redis://host:port/N``: the same with ``DIR`` as the local layer.

The two layers are a Hypothesis ``MultiplexedDatabase(local, shared)``: every save, delete and
move goes to both, and a fetch yields the local examples first, then the shared ones it does not
already have. A host that has never run a campaign therefore replays, before anything else,
every example the fleet saved for it, and a host whose Redis is down still replays its own.

The shared layer is wrapped in an :class:`~fuzz.engine.outbox.OutboxDatabase`, so a host works
offline and publishes when it can: a write that cannot reach Redis is kept in an outbox in the
local directory (``DIR/.redis-outbox/``) and published, in order, on the next successful contact,
by this run or a later one on this host. See that module for why it is not Hypothesis's
``BackgroundWriteDatabase``.

Every campaign keys its examples by its own id (``Campaign.database_key``; Hypothesis hashes it
with the source of its state-machine runner), so one directory or one Redis database serves all
campaigns, and hosts share a campaign's examples when they run the same Hypothesis version.

Example::

    parse_database_spec("/var/lib/kvzero/db,redis://fuzz-redis:6379/0")
    # DatabaseSpec(local=PosixPath('/var/lib/kvzero/db'), redis_url='redis://fuzz-redis:6379/0')
    example_database(".hypothesis/fuzz-db")
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase, MultiplexedDatabase

from fuzz.engine.outbox import OutboxDatabase

DEFAULT_LOCAL = Path(".hypothesis/fuzz-db")
REDIS_SCHEMES = ("redis", "rediss")
OUTBOX = ".redis-outbox"  # inside the local layer's directory
KEY_PREFIX = b"kvzero-fuzz:"  # our keys in a Redis that other projects' Hypothesis databases may share
LISTENER_CHANNEL = "kvzero-fuzz-changes"
CONNECT_TIMEOUT_S = 2.0  # an unreachable host costs at most this per attempt ...
RETRY_AFTER_S = 60.0  # ... and is not tried again for this long (under 4% of a run)
SOCKET_TIMEOUT_S = 10.0
FLEET_EXTRA = "pip install 'kvzero-fuzz[fleet]' (in a checkout: pip install -e '.[fleet]')"
EXAMPLE_URL = "redis://127.0.0.1:6379/0"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class DatabaseSpec:
    """Where examples go: the local directory, and the shared Redis database if any."""

    local: Path
    redis_url: str | None = None


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``, for messages.

    >>> redact("redis://:hunter2@db:6379/0")
    'redis://:***@db:6379/0'
    """
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def parse_database_spec(value: str) -> DatabaseSpec:
    """``--fuzz-db``'s value as a :class:`DatabaseSpec`; a ``ValueError`` that names the value and
    the fix if it is not one (a bad scheme, host, port or database number; no ``redis`` package)."""
    head, comma, tail = value.rpartition(",")
    if comma and _URL.match(tail.strip()):
        local, url = Path(head.strip()), tail.strip()
        if not head.strip():
            raise ValueError(f"{redact(value)!r} has an empty local directory before the comma; "
                             f"give DIR,{EXAMPLE_URL} or just {EXAMPLE_URL}")
    elif _URL.match(value.strip()):
        local, url = DEFAULT_LOCAL, value.strip()
    else:
        return DatabaseSpec(Path(value))
    _check_redis_url(url)
    return DatabaseSpec(local, url)


def _check_redis_url(url: str) -> None:
    shown = redact(url)
    fix = f"give a directory, redis://host:port/N or DIR,redis://host:port/N, e.g. {EXAMPLE_URL}"
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(f"{shown!r} is not a database: scheme {parts.scheme!r} is neither redis nor rediss; {fix}")
    if not parts.hostname:
        raise ValueError(f"{shown!r} names no host; {fix}")
    try:
        parts.port  # noqa: B018 (urllib checks the port when it is read)
    except ValueError:
        port = parts.netloc.rpartition("@")[2].rpartition(":")[2]
        raise ValueError(f"{shown!r}: port {port!r} is not a port number (1-65535); {fix}") from None
    if parts.port == 0:
        raise ValueError(f"{shown!r}: port 0 is not a port number (1-65535); {fix}")
    number = parts.path.lstrip("/")
    if not parts.path or parts.path == "/":
        raise ValueError(f"{shown!r} names no database number; add it, e.g. {shown.rstrip('/')}/0")
    if not number.isdigit():
        raise ValueError(f"{shown!r}: database {number!r} is not a number; give redis://host:port/N with N a "
                         f"number, e.g. {EXAMPLE_URL}")
    if not redis_installed():
        raise ValueError(f"{shown!r} needs the redis package, which is not installed; install it with {FLEET_EXTRA}")


def redis_installed() -> bool:
    return importlib.util.find_spec("redis") is not None


def layered_database(local: Path, redis_client, *, name: str | None = None,
                     retry_s: float = RETRY_AFTER_S) -> ExampleDatabase:
    """The local directory, then the shared Redis behind its outbox (see the module docstring).
    ``redis_client`` is a ``redis.Redis`` (tests pass a ``fakeredis.FakeRedis``); ``name`` is how
    messages call it (default: its host, port and database)."""
    from hypothesis.extra.redis import RedisExampleDatabase
    from redis.exceptions import RedisError

    shared = RedisExampleDatabase(redis_client, key_prefix=KEY_PREFIX, listener_channel=LISTENER_CHANNEL)
    # RedisError covers refused and timed-out connections, and also a wrong password or a database
    # number the server does not have: the run goes on locally, and the warning names the error.
    return MultiplexedDatabase(
        DirectoryBasedExampleDatabase(str(local)),
        OutboxDatabase(shared, local / OUTBOX, unreachable=(RedisError, OSError), retry_s=retry_s,
                       name=name or redis_client_url(redis_client)),
    )


def redis_client_url(client) -> str:
    """A readable address of a ``redis.Redis`` client, for messages (no password)."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    host, port, db = kwargs.get("host"), kwargs.get("port"), kwargs.get("db", 0)
    return f"redis://{host}:{port}/{db}" if host else repr(client)


@functools.lru_cache(maxsize=None)
def example_database(spec: str) -> ExampleDatabase:
    """The database ``--fuzz-db spec`` names; one per process and spec, so the campaigns of a
    worker share its Redis connection and its knowledge that Redis is down."""
    parsed = parse_database_spec(spec)
    if parsed.redis_url is None:
        return DirectoryBasedExampleDatabase(str(parsed.local))
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries inside redis-py (its default retries with backoff would cost seconds per op
    # while Redis is down); the outbox retries, at most once a minute.
    client = Redis.from_url(parsed.redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                            socket_timeout=SOCKET_TIMEOUT_S, retry=Retry(NoBackoff(), 0))
    return layered_database(parsed.local, client, name=redact(parsed.redis_url))
