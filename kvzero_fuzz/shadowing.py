"""Is ``import fuzz`` (or ``repro``, ``zeroer``) this distribution's package?

The three top-level names of kvzero-fuzz are generic: unrelated ``fuzz`` and ``repro``
distributions exist on PyPI, and a user's repository may well hold a ``fuzz/`` package of its
own, which ``python -m pytest`` puts first on ``sys.path``. Shadowed, the plugin would fail with a
``ModuleNotFoundError`` about a module that is plainly installed, or run someone else's code. So
before anything else loads, each name is imported and must carry this distribution's marker
(``__distribution__ = "kvzero-fuzz"`` in its ``__init__.py``); if one does not, the error names
what was found, the distribution that installed it, and the fix.

:func:`shadowing_message` is the pure part (tests give it made-up findings); :func:`resolve` and
:func:`check_own_packages` look at the running interpreter. Example::

    >>> print(shadowing_message([Found("fuzz", "/repo/fuzz/__init__.py", ours=False)]))
    kvzero-fuzz cannot load: 'import fuzz' finds /repo/fuzz/__init__.py, a 'fuzz' package that no installed distribution provides: ...
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DISTRIBUTION = "kvzero-fuzz"
OWN_PACKAGES = ("fuzz", "repro", "zeroer", "kvdevice", "racecheck", "sanitizer")
MARKER = "__distribution__"  # set to DISTRIBUTION in each own package's __init__.py
USAGE_EXIT = 2  # a shadowed package is a usage error (docs/bad-input.md)


class ShadowedPackageError(ImportError):
    """One of this distribution's packages resolves to something else."""


@dataclass(frozen=True)
class Found:
    """What ``import NAME`` found in this interpreter."""

    name: str
    origin: str | None  # the package's __init__.py; None: no regular package was found
    ours: bool  # it carries this distribution's marker
    owner: str | None = None  # the installed distribution whose file list holds ``origin``, if any
    namespace: tuple[str, ...] = ()  # the directories of the namespace package found instead, if any


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _problem(item: Found, distribution: str) -> str:
    name = item.name
    if item.origin is None and item.namespace:
        return (f"'import {name}' finds {', '.join(item.namespace)}, a directory without an __init__.py, instead of "
                f"{distribution}'s package: an editable install (pip install -e) is searched after every directory "
                f"on sys.path, so a plain '{name}' directory there hides it. Run from another directory, or install "
                f"{distribution} without -e")
    if item.origin is None:
        return (f"'import {name}' finds no package of {distribution}: the installation is incomplete; reinstall it "
                f"with: pip install --force-reinstall {distribution}")
    if item.owner is not None and _canonical(item.owner) != _canonical(distribution):
        return (f"'import {name}' finds {item.origin}, which the distribution '{item.owner}' installed: another "
                f"project's top-level '{name}' package shadows {distribution}'s, and the two cannot share an "
                f"environment. Fix: pip uninstall {item.owner} && pip install --force-reinstall {distribution} (the "
                f"reinstall restores any file the other one overwrote), or give {distribution} its own virtualenv")
    if item.owner is not None:
        return (f"'import {name}' finds {item.origin}, installed by {distribution} but without its marker ({MARKER}): "
                f"another install overwrote it, or it is left from an older version. Fix: pip install "
                f"--force-reinstall {distribution}")
    return (f"'import {name}' finds {item.origin}, a '{name}' package that no installed distribution provides: its "
            f"directory {Path(item.origin).parent.parent} comes before {distribution} on sys.path (python -m pytest "
            f"puts the current directory first; so does PYTHONPATH). Fix: run from a directory without a '{name}' "
            f"package, or rename that package")


def shadowing_message(found: Iterable[Found], distribution: str = DISTRIBUTION) -> str | None:
    """The error for every name in ``found`` that is not this distribution's; None if all are."""
    problems = [_problem(item, distribution) for item in found if not item.ours]
    if not problems:
        return None
    return f"{distribution} cannot load: " + "; and ".join(problems)  # one line, as every usage error


def owner_of(origin: str, providers: Sequence[str]) -> str | None:
    """Which of ``providers`` (distributions that install the name) lists the file ``origin``;
    another project's is named before ours when both list it (one overwrote the other)."""
    target = Path(origin).resolve()
    for candidate in sorted(set(providers), key=lambda d: _canonical(d) == _canonical(DISTRIBUTION)):
        try:
            files = importlib.metadata.distribution(candidate).files or ()
        except importlib.metadata.PackageNotFoundError:
            continue
        if any(f.name == target.name and Path(f.locate()).resolve() == target for f in files):
            return candidate
    return None


def resolve(name: str, providers: Mapping[str, Sequence[str]] | None = None) -> Found:
    """Import ``name`` as the interpreter would and say whose it is. ``providers`` maps a
    top-level name to the distributions that install it (default: read from the environment,
    only when needed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None and spec.origin not in (None, "namespace") else None
    if origin is None:
        locations = tuple(str(p) for p in (spec.submodule_search_locations or ())) if spec is not None else ()
        return Found(name, None, ours=False, namespace=locations)
    try:
        module = importlib.import_module(name)
    except Exception:  # someone else's package that fails to import is still not ours
        ours = False
    else:
        ours = getattr(module, MARKER, None) == DISTRIBUTION
    if ours:
        return Found(name, origin, ours=True)
    if providers is None:
        providers = importlib.metadata.packages_distributions()
    return Found(name, origin, ours=False, owner=owner_of(origin, providers.get(name, ())))


def check_own_packages(names: Iterable[str] = OWN_PACKAGES) -> None:
    """Raise :class:`ShadowedPackageError` unless every one of ``names`` is this distribution's package."""
    message = shadowing_message([resolve(name) for name in names])
    if message is not None:
        raise ShadowedPackageError(message)


def shadowing_problem() -> str | None:
    """The one-line error when one of this distribution's packages is shadowed here; None if none is."""
    try:
        check_own_packages()
    except ShadowedPackageError as error:
        return str(error)
    return None


# Options only this distribution's plugins define, and the names its plugins load under with -p.
OWN_OPTIONS = ("--kvz-sanitize", "--zeroer", "--offloader", "--fuzz-", "--repro-dir", "--cuda-mode", "--host-memory",
               "--strict-caller", "--gpu-tests-only")
OWN_PLUGINS = ("fuzz.plugin", "sanitizer.pytest_plugin")
_JOINED = tuple(f"-p{name}" for name in OWN_PLUGINS)  # -pfuzz.plugin


def asks_for_us(args: Sequence[str], cwd: Path | None = None) -> bool:
    """Whether a pytest command line asks for this distribution: one of its options, ``-p`` of one of
    its plugins, or a test path inside its checkout (``pytest fuzz`` in the repository; no path: the
    working directory). Another project's plain ``pytest`` asks for none of them: there a shadowed
    package (the project's own ``repro/`` directory, say) must not stop its run."""
    root = Path(__file__).resolve().parent.parent
    paths: list[Path] = []
    for i, arg in enumerate(args):
        if arg.startswith(OWN_OPTIONS) or arg in _JOINED:
            return True
        if arg == "-p" and i + 1 < len(args) and args[i + 1] in OWN_PLUGINS:
            return True
        if not arg.startswith("-") and (i == 0 or not args[i - 1].startswith("-")):
            paths.append(Path(arg.split("::")[0]))
    base = cwd or Path.cwd()
    for path in paths or [base]:
        try:
            (base / path).resolve().relative_to(root)
        except ValueError:
            continue
        return True
    return False


def shadowed_plugin(problem: str) -> Callable[..., None]:
    """The one hook an entry point registers when a package is shadowed: it stops a run that asks
    for this distribution (:func:`asks_for_us`) with ``problem`` (exit 2, one line on stderr), before
    pytest would call its options unknown; any other run goes on without this distribution."""

    def pytest_load_initial_conftests(early_config: object, parser: object, args: list[str]) -> None:
        if asks_for_us(args):
            print(f"error: {problem}", file=sys.stderr)
            raise SystemExit(USAGE_EXIT)

    return pytest_load_initial_conftests
