"""The ``pytest11`` entry point of the race sanitizer, registered as ``sanitizer.pytest_plugin``.

The same guard as :mod:`kvzero_fuzz.pytest_plugin`: ``sanitizer``, ``racecheck`` and ``zeroer`` are
generic names, so they must resolve to this distribution's packages (:mod:`kvzero_fuzz.shadowing`)
before :mod:`sanitizer.pytest_plugin` loads; a shadowed one stops pytest with exit status 2 and one
line naming what was found and the fix. ``pytest -p sanitizer.pytest_plugin`` loads this entry point
too; in a checkout that is not installed it imports :mod:`sanitizer.pytest_plugin` directly.
"""

import sys

from kvzero_fuzz.shadowing import ShadowedPackageError, check_own_packages

USAGE_EXIT = 2

try:
    check_own_packages()
except ShadowedPackageError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(USAGE_EXIT) from None

from sanitizer.pytest_plugin import *  # noqa: E402,F401,F403
