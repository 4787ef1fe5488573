"""The ``pytest11`` entry point of kvzero-fuzz, registered as ``fuzz.plugin``.

It checks that ``fuzz``, ``repro`` and ``zeroer`` are this distribution's packages
(:mod:`kvzero_fuzz.shadowing`) and only then loads :mod:`fuzz.plugin`, whose hooks and fixtures
it re-exports, so pytest registers them once, under the entry point's name. It lives outside
``fuzz`` because a shadowed ``fuzz`` would make ``fuzz.plugin`` itself unimportable, and pytest
would report a bare ``ModuleNotFoundError`` before any of our code ran.

A shadowed package stops a run that asks for kvzero-fuzz (one of its options, ``-p`` of its
plugins, a test path in its checkout: :func:`kvzero_fuzz.shadowing.asks_for_us`) before pytest
parses the whole command line (so before ``--zeroer`` would be an unknown option), as every usage
error of this project does (docs/bad-input.md): exit 2 and one line on stderr that says what was
found and how to fix it; another project's run goes on without kvzero-fuzz::

    error: kvzero-fuzz cannot load: 'import fuzz' finds /repo/fuzz/__init__.py, a 'fuzz' package that
    no installed distribution provides: its directory /repo comes before kvzero-fuzz on sys.path ...

(pytest's own ``UsageError`` would exit 4; a ``SystemExit`` raised while pytest loads its plugins
passes through it.)

``pytest -p fuzz.plugin`` loads this entry point too (pytest looks entry points up by name first);
in a checkout that is not installed it imports :mod:`fuzz.plugin` directly.
"""

from kvzero_fuzz.shadowing import shadowed_plugin, shadowing_problem

_PROBLEM = shadowing_problem()
if _PROBLEM is None:
    # Every public name of fuzz.plugin: its hooks and fixtures, whatever it adds later.
    from fuzz.plugin import *  # noqa: F401,F403
else:  # only a run that asks for kvzero-fuzz stops; another project's pytest runs as if it were not installed
    pytest_load_initial_conftests = shadowed_plugin(_PROBLEM)
