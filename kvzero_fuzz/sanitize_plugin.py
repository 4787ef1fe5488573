"""The ``pytest11`` entry point of the race sanitizer, registered as ``sanitizer.pytest_plugin``.

The same guard as :mod:`kvzero_fuzz.pytest_plugin`: ``sanitizer``, ``racecheck`` and ``zeroer`` are
generic names, so they must resolve to this distribution's packages (:mod:`kvzero_fuzz.shadowing`)
before :mod:`sanitizer.pytest_plugin` loads; a shadowed one stops pytest with exit status 2 and one
line naming what was found and the fix. ``pytest -p sanitizer.pytest_plugin`` loads this entry point
too; in a checkout that is not installed it imports :mod:`sanitizer.pytest_plugin` directly.
"""

from kvzero_fuzz.shadowing import exit_if_shadowed

exit_if_shadowed()

from sanitizer.pytest_plugin import *  # noqa: E402,F401,F403
