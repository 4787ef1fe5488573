"""The fuzz campaign's command-line options, checked in pure functions that tests call directly.

Every bad value becomes a ``pytest.UsageError`` that names the value and the choices, like
pytest-xdist's messages.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from zeroer.cache.geometries import GEOMETRIES, LARGE_GEOMETRIES, geometry_names
from zeroer.errors import ZeroerError
from zeroer.offload import HOST_MEMORY
from zeroer.registry import load_offloader, load_zeroer, zeroer_names

from racecheck.cli import UsageError, check_output
from fuzz.engine.campaigns import PROFILES, Profile
from fuzz.engine.database import parse_database_spec
from fuzz.engine.journal import JOURNAL_MODES

BACKEND_CHOICES = ("auto", "cuda", "sim")
CUDA_MODE_CHOICES = ("both", "controlled", "free")


@dataclass(frozen=True)
class FuzzOptions:
    backends: list[str]
    cuda_modes: tuple[str, ...]
    zeroer: str | None
    profile: Profile
    minutes: float | None
    repro_dir: Path
    database_dir: Path
    summary_path: Path
    journal: bool = False  # save each op before it runs (fuzz/engine/journal.py)
    seed: int | None = None  # --hypothesis-seed: one run of each campaign with this seed
    geometries: tuple[str, ...] | None = None  # --geometry; None: each zeroer's default
    shard: tuple[int, int] | None = None  # --fuzz-shard i/N: this run's share of the campaigns
    database: str = ".hypothesis/fuzz-db"  # --fuzz-db: DIR, redis://host:port/N or DIR,redis://host:port/N
    debug: bool = False  # --fuzz-debug: tracebacks of usage and harness errors
    shrink_seconds: float | None = None  # --fuzz-shrink-seconds; None: fuzz.engine.shrink.SHRINK_BOUND_S per backend
    offloader: str | None = None  # --offloader: fuzz one offloader (fuzz.engine.offload) instead of zeroers
    host_memory: tuple[str, ...] = HOST_MEMORY  # --host-memory: the host pools an offloader is fuzzed with
    strict_caller: bool = False  # --strict-caller: no device synchronisation after a zeroer's warm-up


def parse_backend(value: str, cuda_available: bool) -> str:
    if value not in BACKEND_CHOICES:
        raise pytest.UsageError(f"--backend {value!r} is not a backend; choose one of: {', '.join(BACKEND_CHOICES)}")
    if value == "auto":
        return "cuda" if cuda_available else "sim"
    if value == "cuda" and not cuda_available:
        raise pytest.UsageError("--backend cuda needs a CUDA GPU and none is visible here; use --backend sim or auto")
    return value


def parse_cuda_mode(value: str) -> tuple[str, ...]:
    if value not in CUDA_MODE_CHOICES:
        raise pytest.UsageError(f"--cuda-mode {value!r} is not a mode; choose one of: {', '.join(CUDA_MODE_CHOICES)}")
    return ("controlled", "free") if value == "both" else (value,)


def parse_zeroer(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        load_zeroer(value)
    except ZeroerError as error:
        names = ", ".join(zeroer_names())
        listed = "" if names in str(error) else f" (built-in zeroers: {names})"  # an unknown name's error lists them
        raise pytest.UsageError(f"--zeroer {value!r}: {error}{listed}") from None
    return value


def check_zeroer_runs_here(value: str | None, backend: str, cuda_modes: tuple[str, ...]) -> None:
    """A zeroer that cannot run on the chosen backend or cuda mode is a usage error, not 0 tests."""
    if value is not None:
        _check_runs_here("--zeroer", value, load_zeroer(value).capabilities, backend, cuda_modes, gpu_hint=True)


def _check_runs_here(flag: str, value: str, capabilities, backend: str, cuda_modes: tuple[str, ...], *,
                     gpu_hint: bool = False) -> None:
    """``flag value`` names a component that runs on ``backend`` and in one of ``cuda_modes``."""
    backends, modes = capabilities.backends, capabilities.cuda_modes
    if backend not in backends:
        raise pytest.UsageError(
            f"{flag} {value!r} runs on the {' and '.join(backends)} backend only, not {backend!r}; "
            f"pass --backend {backends[0]}" + (" on a machine with a GPU" if gpu_hint and backends == ("cuda",) else "")
        )
    if backend == "cuda" and not set(modes) & set(cuda_modes):
        raise pytest.UsageError(
            f"{flag} {value!r} runs in the {' and '.join(modes)} cuda mode only, not "
            f"{' or '.join(cuda_modes)}; pass --cuda-mode {modes[0]}"
        )


def parse_offloader(value: str | None, zeroer: str | None, backend: str, cuda_modes: tuple[str, ...]) -> str | None:
    """``--offloader SPEC``: a checked offloader factory that runs on the chosen backend."""
    if value is None:
        return None
    if zeroer is not None:
        raise pytest.UsageError(f"--offloader {value!r} and --zeroer {zeroer!r}: fuzz one component per run; "
                                f"run pytest twice, once with each")
    try:
        capabilities = load_offloader(value).capabilities
    except ZeroerError as error:
        raise pytest.UsageError(f"--offloader {value!r}: {error}") from None
    _check_runs_here("--offloader", value, capabilities, backend, cuda_modes)
    return value


def parse_host_memory(value: str, offloader: str | None) -> tuple[str, ...]:
    """``--host-memory pinned|registered|both``: the host pools ``--offloader`` is fuzzed with."""
    choices = (*HOST_MEMORY, "both")
    if value not in choices:
        raise pytest.UsageError(f"--host-memory {value!r} is not a host pool; choose one of: {', '.join(choices)}")
    if offloader is None and value != "both":
        raise pytest.UsageError(f"--host-memory {value!r} needs --offloader: it chooses the host pool an offloader "
                                f"stores into, e.g. --offloader my_offloader.py:factory --host-memory registered")
    return HOST_MEMORY if value == "both" else (value,)


def _parse_float(flag: str, value: str | None, zero_ok: bool, give: str, bounds: str) -> float | None:
    """``value`` as a finite number (greater than 0, or with ``zero_ok`` 0 or more); None stays None."""
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        raise pytest.UsageError(f"{flag} {value!r} is not a number; give {give}, e.g. 30") from None
    if not ((number >= 0 if zero_ok else number > 0) and math.isfinite(number)):
        raise pytest.UsageError(f"{flag} {value!r} must be a finite number {bounds}")
    return number


def parse_minutes(value: str | None) -> float | None:
    return _parse_float("--fuzz-minutes", value, False, "a positive number of minutes", "greater than 0; give minutes, e.g. 30")


def parse_shrink_seconds(value: str | None) -> float | None:
    """``--fuzz-shrink-seconds S``: how long each stage of shrinking a finding may take (None: the
    default of the backend it replays on, fuzz.engine.shrink.SHRINK_BOUND_S)."""
    return _parse_float("--fuzz-shrink-seconds", value, True, "seconds",
                        "of seconds, 0 or more; e.g. 30 (0 keeps each finding's first failing program)")


def parse_geometries(value: str | None, zeroer: str | None) -> tuple[str, ...] | None:
    """``--geometry NAME[,NAME...]`` or ``all`` (every preset the simulator runs), for ``--zeroer``
    or ``--offloader`` (``zeroer``: the one given)."""
    if value is None:
        return None
    if zeroer is None:
        raise pytest.UsageError(f"--geometry {value!r} needs --zeroer or --offloader: it chooses the presets one "
                                f"component runs on, e.g. --zeroer my_zeroer.py:factory --geometry packed,tiny")
    if value == "all":
        return tuple(geometry_names())
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    known = sorted({*GEOMETRIES, *LARGE_GEOMETRIES})
    for name in names or ("",):
        if name not in known:
            raise pytest.UsageError(f"--geometry {value!r}: {name!r} is not a geometry; choose from {', '.join(known)}, "
                                    f"or all")
    return names


def parse_shard(value: str | None) -> tuple[int, int] | None:
    """``--fuzz-shard i/N``: run the i-th of N disjoint shares of the campaigns (0 <= i < N)."""
    if value is None:
        return None
    index, slash, count = value.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i, n = -1, 0
    if not slash or not (n >= 1 and 0 <= i < n):
        raise pytest.UsageError(f"--fuzz-shard {value!r} is not a shard; give i/N with 0 <= i < N, e.g. 0/4")
    return i, n


def parse_database(value: str) -> Path:
    """``--fuzz-db DIR``, ``redis://host:port/N`` or ``DIR,redis://host:port/N``
    (:mod:`fuzz.engine.database`): the URL is checked here; returns the local directory."""
    try:
        return parse_database_spec(value).local
    except ValueError as error:
        raise pytest.UsageError(f"--fuzz-db {error}") from None


def check_writable(flag: str, path: Path, what: str) -> Path:
    """A directory the run will write into, checked before any campaign runs (a finding must not
    be lost to a typo found at the end)."""
    try:
        return check_output(flag, path, what)  # the commands' check (racecheck/cli.py), as pytest's error
    except UsageError as error:
        raise pytest.UsageError(str(error)) from None


def parse_profile(value: str | None, minutes: float | None) -> Profile:
    if value is None:
        value = "nightly" if minutes is not None else ("ci" if os.environ.get("CI") else "quick")
    if value not in PROFILES:
        raise pytest.UsageError(f"--fuzz-profile {value!r} is not a profile; choose one of: {', '.join(sorted(PROFILES))}")
    return PROFILES[value]


def gpu_for_worker(worker_id: str | None, device_count: int) -> int:
    """The GPU an xdist worker uses: ``gw3`` on a 2-GPU host takes GPU 1 (round-robin)."""
    if device_count < 1:
        raise pytest.UsageError("no CUDA device is visible; use --backend sim")
    if not worker_id or worker_id == "master":
        return 0
    if not worker_id.startswith("gw") or not worker_id[2:].isdigit():
        raise pytest.UsageError(f"unexpected PYTEST_XDIST_WORKER {worker_id!r}; expected gw0, gw1, ...")
    return int(worker_id[2:]) % device_count


def parse_journal(value: str, backend: str) -> bool:
    if value not in JOURNAL_MODES:
        raise pytest.UsageError(f"--fuzz-journal {value!r} is not one of {', '.join(JOURNAL_MODES)} (auto: on for the cuda backend)")
    return value == "on" or (value == "auto" and backend == "cuda")


def parse_seed(value: object) -> int | None:
    """``--hypothesis-seed`` (Hypothesis's own option), read as the seed of every campaign's run."""
    if value is None:
        return None
    try:
        return int(str(value))
    except ValueError:
        raise pytest.UsageError(
            f"--hypothesis-seed {value!r} is not an integer; fuzz campaigns need the integer seed a summary lists, e.g. --hypothesis-seed 1234"
        ) from None


DEFAULT_REPRO_DIR = Path("repro", "failures")
DEFAULT_SUMMARY = Path("repro", "summary.json")


def output_path(config: pytest.Config, option: str, default: Path) -> Path:
    """The path an output option gives (relative to the working directory, as given), or by default
    ``default`` under pytest's rootdir, written relative to the working directory where it can be.
    Not under the working directory: run from another one (``cd tests; pytest ../fuzz``), a
    ``repro/`` written there would hide this project's own ``repro`` package from the next run
    there (an editable install is searched after every directory on sys.path)."""
    given = config.getoption(option)
    if given is not None:
        return Path(given)
    path = config.rootpath / default
    try:
        return Path(os.path.relpath(path))
    except ValueError:  # another drive (Windows): no relative form
        return path


def fuzz_options(config: pytest.Config, gpu_present: Callable[[], bool] = torch.cuda.is_available) -> FuzzOptions:
    """The run's options. ``gpu_present`` says whether ``auto`` means cuda: by default torch's own
    check, which starts CUDA's driver; a run that will not fuzz on a GPU asks one that does not
    (fuzz.plugin: the program's CUDA settings are read when its driver starts)."""
    cuda = gpu_present()
    minutes = parse_minutes(config.getoption("fuzz_minutes"))
    backend = parse_backend(config.getoption("fuzz_backend"), cuda)
    cuda_modes = parse_cuda_mode(config.getoption("cuda_mode"))
    zeroer = parse_zeroer(config.getoption("zeroer"))
    check_zeroer_runs_here(zeroer, backend, cuda_modes)
    offloader = parse_offloader(config.getoption("offloader"), zeroer, backend, cuda_modes)
    strict = bool(config.getoption("strict_caller"))
    if strict and offloader is not None:
        raise pytest.UsageError("--strict-caller is the zeroer's stricter caller (no synchronisation after its warm-up); "
                                "an offloader's campaigns do not take it: drop one of the two")
    database = config.getoption("fuzz_db")
    return FuzzOptions(
        backends=[backend],
        cuda_modes=cuda_modes,
        zeroer=zeroer,
        profile=parse_profile(config.getoption("fuzz_profile"), minutes),
        minutes=minutes,
        repro_dir=output_path(config, "repro_dir", DEFAULT_REPRO_DIR),
        database_dir=parse_database(database),  # the local layer when a Redis URL is given
        summary_path=output_path(config, "fuzz_summary", DEFAULT_SUMMARY),
        journal=parse_journal(config.getoption("fuzz_journal"), backend),
        seed=parse_seed(config.getoption("hypothesis_seed", None)),
        geometries=parse_geometries(config.getoption("fuzz_geometry"), zeroer or offloader),
        shard=parse_shard(config.getoption("fuzz_shard")),
        database=database,
        debug=bool(config.getoption("fuzz_debug", False)),
        shrink_seconds=parse_shrink_seconds(config.getoption("fuzz_shrink_seconds")),
        offloader=offloader,
        host_memory=parse_host_memory(config.getoption("host_memory"), offloader),
        strict_caller=strict,
    )


def check_output_paths(options: FuzzOptions) -> None:
    """Before the first campaign runs (and only when campaigns will run): every directory the run
    writes into must be writable."""
    check_writable("--repro-dir", options.repro_dir, "directory")
    check_writable("--fuzz-summary", options.summary_path, "file path")
    if options.profile.database:  # the directory, or the local layer (and outbox) of a Redis database
        check_writable("--fuzz-db", options.database_dir, "directory")
