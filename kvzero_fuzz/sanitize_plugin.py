"""The ``pytest11`` entry point of the race sanitizer, registered as ``sanitizer.pytest_plugin``.

The same guard as :mod:`kvzero_fuzz.pytest_plugin`: ``sanitizer``, ``racecheck`` and ``zeroer`` are
generic names, so they must resolve to this distribution's packages (:mod:`kvzero_fuzz.shadowing`)
before :mod:`sanitizer.pytest_plugin` loads; a shadowed one stops pytest with exit status 2 and one
line naming what was found and the fix. ``pytest -p sanitizer.pytest_plugin`` loads this entry point
too; in a checkout that is not installed it imports :mod:`sanitizer.pytest_plugin` directly.
"""

from kvzero_fuzz.shadowing import shadowed_plugin, shadowing_problem

_PROBLEM = shadowing_problem()
if _PROBLEM is None:
    from sanitizer.pytest_plugin import *  # noqa: F401,F403
else:  # only a run that asks for the sanitizer (or kvzero-fuzz) stops (kvzero_fuzz.pytest_plugin)
    pytest_load_initial_conftests = shadowed_plugin(_PROBLEM)
